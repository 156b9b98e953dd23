"""Earlier import path ``dschat.testing.tiny``: an alias of :mod:`dschat.models.tiny`."""
from dschat.models.tiny import *  # noqa: F401,F403
from dschat.models.tiny import __all__  # noqa: F401
