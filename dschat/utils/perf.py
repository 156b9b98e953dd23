"""Upstream's import path: an alias of :mod:`dschat.runtime.perf`."""
from dschat.runtime.perf import *  # noqa: F401,F403
from dschat.runtime.perf import __all__  # noqa: F401
