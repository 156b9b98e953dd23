"""Upstream's import path ``dschat.utils.module.lora``: an alias of :mod:`dschat.models.lora`."""
from dschat.models.lora import *  # noqa: F401,F403
from dschat.models.lora import __all__  # noqa: F401
