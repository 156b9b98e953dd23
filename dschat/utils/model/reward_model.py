"""Upstream's import path ``dschat.utils.model.reward_model``: an alias of :mod:`dschat.models.reward_model`."""
from dschat.models.reward_model import *  # noqa: F401,F403
from dschat.models.reward_model import __all__  # noqa: F401
