"""``python -m dschat.plan``: see :mod:`dschat.plan.cli`."""
import sys

from dschat.plan.cli import main

sys.exit(main())
