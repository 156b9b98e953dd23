"""Earlier import path: an alias of :mod:`dschat.runtime.dist`."""
from dschat.runtime.dist import *  # noqa: F401,F403
from dschat.runtime.dist import __all__  # noqa: F401
