"""Upstream's import path ``dschat.utils.model.model_utils``: an alias of :mod:`dschat.models.build`."""
from dschat.models.build import *  # noqa: F401,F403
from dschat.models.build import __all__  # noqa: F401
