"""``python -m dschat.serve``: see :mod:`dschat.serve.cli`."""
import sys

from dschat.serve.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
