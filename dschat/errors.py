"""User-facing errors and the CLI wrapper that turns them into one clear line and exit code 2.

Every bad input (wrong path, malformed rows, contradictory flags) raises :class:`UserError` with a
message that names the problem *and* the fix. Entry points run through :func:`cli_main`, which prints
``error: <message>`` on stderr and exits with :data:`EXIT_USAGE` -- no traceback unless ``--debug``
is on the command line (or ``DSCHAT_DEBUG=1`` is set). What such a line may show of user values: the
first line of what user code raised (:func:`raised`), a URL without its password or query
(:func:`shown_url`).
"""
from __future__ import annotations

import errno
import os
import shlex
import sys
from typing import Callable, Sequence
from urllib.parse import urlsplit

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


def raised(err: BaseException, limit: int = 200) -> str:
    """``Type: first line of its message`` for a line quoting what user code (an environment, a reward
    function, a module imported) raised: the text cut to ``limit`` characters, ``Type (no message)``
    without one, and ``Type (its str() raised)`` when turning it into text is what fails."""
    name = type(err).__name__
    try:
        text = str(err).strip()
    except Exception:  # noqa: BLE001 -- the exception's own __str__ is user code
        return f"{name} (its str() raised)"
    text = text.splitlines()[0] if text else ""
    if not text:
        return f"{name} (no message)"
    return f"{name}: {text[:limit]}{'...' if len(text) > limit else ''}"


def exit_code(err: SystemExit, limit: int = 60) -> str:
    """``repr`` of what user code passed to ``sys.exit``, cut to ``limit`` characters (its own
    ``__repr__`` raising: a placeholder), for the line that says it exited."""
    try:
        text = repr(err.code)
    except Exception:  # noqa: BLE001 -- the object's own __repr__ is user code
        return f"<a {type(err.code).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


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

    So is an ``OSError`` ENAMETOOLONG (a path flag too long for the file system, :func:`name_too_long`:
    Python's ``Path.exists`` raises it rather than answer False), whichever check meets it first. Returns the process exit code (0 on success). Other exceptions propagate unchanged:
    they are bugs, and their traceback is what a bug report needs.
    """
    try:
        main(argv)
    except UserError as err:
        if debug_requested(argv):
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG or debug_requested(argv):
            raise
        print(f"error: {name_too_long(err)}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


def name_too_long(err: OSError) -> UserError:
    """The one line for an ``OSError`` ENAMETOOLONG: the path (its middle cut past 160 characters), and
    to pass a shorter one."""
    where = os.fspath(err.filename) if err.filename is not None else "a path given"
    if len(where) > 160:
        where = f"{where[:100]}...{where[-57:]}"
    return UserError(f"{where} has a name longer than the file system allows ({err.strerror or 'ENAMETOOLONG'}: a "
                     "file or folder name of more than 255 bytes in it, or more than 4096 bytes in all); pass a "
                     "shorter path")


def shown_url(url: str) -> str:
    """``url`` for lines, logs and names: its user and password (a token may be either) become
    ``***``, a query ``?***``. A URL with none of them is shown as given (``sqlite:////abs/path``
    keeps its empty host, which a rebuilt URL would drop)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc and not parts.query and not parts.fragment:
        return url
    shown = url.split("#", 1)[0].split("?", 1)[0]  # as written: an empty host keeps its //
    if "@" in parts.netloc:
        shown = shown.replace(parts.netloc, "***@" + parts.netloc.rpartition("@")[2], 1)
    return shown + ("?***" if parts.query else "")
