"""``python -m dschat.plan``: see :mod:`dschat.plan.cli`."""
import sys

from dschat.plan.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
