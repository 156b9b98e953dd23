"""A cache's build lock on a shared machine: :func:`trusted_lock` holds a ``filelock`` lock only when
its file is this user's own (the data cache's, the tiny and embedded models' caches)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from filelock import FileLock, Timeout

from dschat.errors import UserError
from dschat.runtime.trust import check_trusted

__all__ = ["trusted_lock"]


@contextlib.contextmanager
def trusted_lock(path: str | os.PathLike, what: str, fix: str, waiting: str) -> Iterator[None]:
    """Hold ``filelock.FileLock(path)`` (created 0600, opened without following a symbolic link). A lock
    file that is a symbolic link, or that another account owns or could write to
    (:func:`~dschat.runtime.trust.check_trusted`), is refused in one line before it is opened, so a lock
    another account planted (and holds) is never waited on; ``waiting`` is printed when another of
    this user's processes holds it; a lock file or folder this user cannot open is one line (``what``
    names it, ``fix`` says what to do), not a traceback."""
    path = os.fspath(path)
    if os.path.islink(path):
        raise UserError(f"{what} {path} is a symbolic link, not safe to use on a shared machine; {fix}")
    if os.path.lexists(path):
        check_trusted(path, what, fix)
    lock = FileLock(path, mode=0o600)

    def acquire(timeout: float) -> None:
        try:
            lock.acquire(timeout=timeout)
        except Timeout:  # an OSError too: held by another of this user's processes
            raise
        except OSError as err:
            whose = ": another user's file or folder" if isinstance(err, PermissionError) else ""
            raise UserError(f"cannot take the {what} {path} ({err.strerror}){whose}; {fix}") from err

    try:
        acquire(0)
    except Timeout:
        print(waiting, flush=True)
        acquire(-1)
    try:
        yield
    finally:
        lock.release()
