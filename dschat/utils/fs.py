"""Earlier import path: an alias of :mod:`dschat.runtime.fs`."""
from dschat.runtime.fs import *  # noqa: F401,F403
from dschat.runtime.fs import __all__  # noqa: F401
