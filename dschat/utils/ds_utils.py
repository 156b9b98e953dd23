"""Upstream's import path ``dschat.utils.ds_utils``: an alias of :mod:`dschat.runtime.ds_config`, plus
the ZeRO-3 gathering helpers that lived here before :mod:`dschat.runtime.zero3`."""
from dschat.runtime.ds_config import *  # noqa: F401,F403
from dschat.runtime.ds_config import __all__ as _config_all
from dschat.runtime.zero3 import gathered_parameters, release_zero3_prefetch  # noqa: F401

__all__ = [*_config_all, "gathered_parameters", "release_zero3_prefetch"]
