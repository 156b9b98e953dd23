"""Earlier import path: an alias of :mod:`dschat.runtime.optim`."""
from dschat.runtime.optim import *  # noqa: F401,F403
from dschat.runtime.optim import __all__  # noqa: F401
