"""User-facing errors and the CLI wrapper that turns them into one clear line and exit code 2.

Every bad input (wrong path, malformed rows, contradictory flags) raises :class:`UserError` with a
message that names the problem *and* the fix. Entry points run through :func:`cli_main`, which prints
``error: <message>`` on stderr and exits with :data:`EXIT_USAGE` -- no traceback unless ``--debug``
is on the command line (or ``DSCHAT_DEBUG=1`` is set).
"""
from __future__ import annotations

import os
import shlex
import sys
from typing import Callable, Sequence

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input the user can fix. The message is a single line: what is wrong, and what to do."""

    def __init__(self, message: str):
        # Keep it one line: CLIs print it verbatim.
        super().__init__(" ".join(str(message).split()))


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message ("" when it has none), for an error line that quotes it."""
    text = str(err)
    return text.splitlines()[0] if text else ""


def cannot_read(path: str | os.PathLike, err: OSError) -> UserError:
    """The one line for a file or folder this account may not read: ``cannot read X (Permission denied): fix``."""
    where = os.fspath(path)
    return UserError(f"cannot read {where} ({err.strerror or type(err).__name__}): give this account read access "
                     f"to it (e.g. chmod -R a+rX {shlex.quote(where)}) or pass a copy it can read")


def first_keys(keys: list[str], n: int = 5) -> str:
    """The first ``n`` keys for an error line (a state-dict key mismatch), and how many there are in all."""
    return ", ".join(keys[:n]) + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def debug_requested(argv: Sequence[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("DSCHAT_DEBUG", "") not in ("", "0")


def cli_main(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; map :class:`UserError` to one stderr line and exit code 2.

    Returns the process exit code (0 on success). Other exceptions propagate unchanged: they are
    bugs, and their traceback is what a bug report needs.
    """
    try:
        main(argv)
    except UserError as err:
        if debug_requested(argv):
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0
