"""One dschat run at a time per output folder: an exclusive ``flock`` on ``<folder>/.dschat-run.lock``.

A step's start-up finishes or undoes what a killed run left in its ``--output_dir`` (an unfinished
model save, a half-written checkpoint) and prunes leftovers. Done while another run still writes
there, that would delete the other run's save in progress. So rank 0 of every step (and
``python -m dschat.models.save --recover``) takes this lock before it touches anything, and holds it
while the run lives; a second process finds it taken and stops with one line (exit code 2), having
changed nothing.

Contracts:

* The lock is the kernel's: it goes when the holder's process ends, however it ends (a kill too),
  so a stale lock file never blocks a run. It is not inherited across ``exec``; a forked child that
  keeps the descriptor keeps the lock until it exits.
* Reentrant per process: a folder this process already holds (two step ``main`` calls in one test
  process, ``--resume`` after a run) is taken again at once; it is released when the last holder
  lets go. Folders are told apart by identity (device and inode), not by spelling.
* The lock file is trusted only when it is a plain file (not a symlink) this user owns and nobody
  else can write to (:func:`dschat.runtime.trust.owned_privately`); anything else is refused in one
  line, as docs/shared-machine.md says. A new one is created 0600.
* A run removes the lock file when it lets go (a killed run's stays behind, harmless: the next run
  takes it); a run that changed nothing in the folder (bad input found after start-up) and a
  :func:`run_lock` command also remove the folders made for it. Removal happens while the lock is
  held, and a process that opened the removed file finds it gone after locking and looks again, so
  two holders never coexist.
* On a file system without ``flock`` (some network mounts) the run goes on unlocked, with a notice.
* Folders inside a run's folder: step 3 also holds the model folders it saves into (``actor/``,
  ``critic/``, ``actor_ema/``), so a step saving into one of them while it runs is refused (and the
  other way round); a start-up's recovery finishes or undoes a subfolder's unfinished save, and step
  3's end sets an earlier run's model folder aside, only under that subfolder's lock, so a run
  using a folder inside another's is left alone.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, ParamSpec, TypeVar

from dschat.errors import UserError
from dschat.runtime.fs import check_writable_dir
from dschat.runtime.trust import missing_ancestors, owned_privately, remove_made_folders

__all__ = ["LOCK_NAME", "hold_run_lock", "release_run_lock", "releasing_run_locks", "run_lock", "lock_holder"]

LOCK_NAME = ".dschat-run.lock"
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted FIFO never blocks
_ATTEMPTS = 20  # a lock file removed under us is looked up again this many times


@dataclass
class _Held:
    fd: int
    folder: Path
    pid: int
    created: bool  # this process created the lock file
    made: list[Path]  # the folders this process created for it, innermost first
    entries: list[str]  # the folder's entries (besides the lock) when it was taken
    count: int = 1


_P = ParamSpec("_P")
_R = TypeVar("_R")
_HELD: dict[tuple[int, int], _Held] = {}
_OWNED: dict[int, list[weakref.finalize]] = {}  # id(owner) -> its holds, while the owner lives
_GUARD = threading.RLock()


def _entries(folder: Path) -> list[str]:
    try:
        return sorted(name for name in os.listdir(folder) if name != LOCK_NAME)
    except OSError:
        return []


def lock_holder(path: str | os.PathLike, locks: str = "/proc/locks") -> int | None:
    """The pid holding a ``flock`` on the file ``path``, read from Linux's ``locks`` table; None when
    it cannot be told (no such table, another pid namespace, no holder)."""
    try:
        inode = os.stat(path, follow_symlinks=False).st_ino
        lines = Path(locks).read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; waiters have "->"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            pid = int(fields[4]) if fields[4].isdigit() else 0
            return pid if pid > 0 else None
    return None


def _untrusted(path: Path, flag: str, folder: Path) -> UserError:
    return UserError(f"{flag} {folder}: its run lock {path} is not a plain file that only you own and can "
                     "write to, so another account may have put it there; if it is yours, 'chmod go-w' it, "
                     "else remove it")


def _still_at(path: Path, opened: os.stat_result) -> bool:
    """Whether ``path`` (not followed if a link) is still the file whose descriptor's stat is ``opened``."""
    try:
        return os.path.samestat(os.stat(path, follow_symlinks=False), opened)
    except FileNotFoundError:
        return False


def _open(path: Path, flag: str, folder: Path) -> tuple[int, bool] | None:
    """(descriptor, created) for the lock file, or None when it vanished between two looks."""
    try:
        fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except FileNotFoundError:  # the folder itself was moved away (a set-aside) between two looks
        return None
    else:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is filtered by the umask; this is exact
        return fd, True
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a symlink; EACCES: another account's file
        raise _untrusted(path, flag, folder) from err
    info = os.fstat(fd)
    if not (stat.S_ISREG(info.st_mode) and _still_at(path, info) and owned_privately(path)):
        os.close(fd)
        raise _untrusted(path, flag, folder)
    return fd, False


def _take(folder: str | os.PathLike, flag: str, fix: str) -> tuple[int, int] | None:
    """Take (or take again) the lock of ``folder`` (a leading ``~`` expanded), creating the folder as a
    save would; the key to release it with, or None on a file system without ``flock``."""
    folder = Path(os.path.expanduser(os.fspath(folder)))
    check_writable_dir(folder, flag)  # the lines the step's own path check gives
    made = missing_ancestors(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{flag} {folder} cannot be created ({err.strerror}); pass a folder you can write to") from err
    info = os.stat(folder)
    key = (info.st_dev, info.st_ino)
    with _GUARD:
        held = _HELD.get(key)
        if held is not None and held.pid == os.getpid():
            held.count += 1
            return key
        path = folder / LOCK_NAME
        entries = _entries(folder)
        for _ in range(_ATTEMPTS):
            opened = _open(path, flag, folder)
            if opened is None:
                continue
            fd, created = opened
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = lock_holder(path)
                os.close(fd)
                who = f" (pid {pid})" if pid else ""
                raise UserError(f"another dschat run{who} is using {flag} {folder}; {fix}") from None
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                print(f"[run lock] {path} cannot be locked on this file system ({err.strerror}); nothing stops "
                      f"another run from using {folder} at the same time", file=sys.stderr, flush=True)
                if created:  # an unlocked file protects nothing: not left behind, nor the folders made for it
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    remove_made_folders(made)
                return None
            if not _still_at(path, os.fstat(fd)):  # removed (or replaced) by the previous holder after we opened it: look again
                os.close(fd)
                continue
            _HELD[key] = _Held(fd, folder, os.getpid(), created, made, entries)
            return key
    raise UserError(f"{flag} {folder}: its run lock {path} keeps changing; another process is creating and "
                    "removing it; stop it or pick another folder")


def _release(key: tuple[int, int] | None, tidy: bool = False) -> None:
    """Let go of one hold of the lock ``key``; the last one removes the lock file and unlocks and, when
    this process created the file, removes the folders made for it if ``tidy`` or the folder's entries
    are as they were. A no-op in a forked child and for a lock this process does not hold."""
    if key is None:
        return
    with _GUARD:
        held = _HELD.get(key)
        if held is None or held.pid != os.getpid():
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[key]
        try:
            with contextlib.suppress(OSError):  # still locked: a process that opened it looks again
                if _still_at(held.folder / LOCK_NAME, os.fstat(held.fd)):  # not another run's, after a rename
                    os.unlink(held.folder / LOCK_NAME)
            if held.created and (tidy or _entries(held.folder) == held.entries):
                remove_made_folders(held.made)
        finally:
            os.close(held.fd)


def hold_run_lock(folder: str | os.PathLike, owner: object, flag: str = "--output_dir",
                  fix: str | None = None) -> None:
    """Take ``folder``'s run lock (creating the folder, as a save would) and hold it while ``owner``
    lives, or until :func:`release_run_lock` ``(owner)``; an owner's holds are let go of in the reverse
    order they were taken (a folder inside another first). A step passes its parsed arguments: in a
    step process the lock goes when the process ends; called in-process (tests, notebooks), when
    ``main`` has returned and nothing refers to the arguments any more (an engine kept in the
    result, a reference cycle: then at Python's next garbage collection). An ``owner`` that takes no
    weak reference holds it until the process ends.

    Taken by another process: :class:`~dschat.errors.UserError` (one line naming ``flag``, the folder
    and the holder's pid where Linux tells it, then ``fix``: by default "wait for it to end or pick
    another ``flag``"), before anything in ``folder`` is read or changed. Reentrant: see the module
    docstring.
    """
    key = _take(folder, flag, fix or f"wait for it to end or pick another {flag}")
    try:
        hold = weakref.finalize(owner, _release, key)
    except TypeError:  # no weak reference: held until the process ends
        return
    with _GUARD:
        _OWNED.setdefault(id(owner), []).append(hold)
    weakref.finalize(owner, _OWNED.pop, id(owner), None)


def _let_go(holds: list[weakref.finalize]) -> None:
    """Run an owner's hold finalizers (each :func:`_release` once; the finalizer is then dead), the
    last taken first: a folder inside another is let go of before it."""
    for hold in reversed(holds):
        hold()


def release_run_lock(owner: object) -> None:
    """Let go now of the holds :func:`hold_run_lock` took for ``owner`` (a step's ``main`` ending
    without waiting for its arguments to be freed); a no-op when there are none."""
    with _GUARD:
        holds = _OWNED.pop(id(owner), [])
    _let_go(holds)


def releasing_run_locks(main: Callable[_P, _R]) -> Callable[_P, _R]:
    """``main`` (a step's), letting go of the holds :func:`hold_run_lock` took during the call when it
    returns or raises, so that in-process callers (tests, notebooks) free the folder at once instead
    of when its arguments are garbage-collected. Holds taken before the call are kept."""
    @functools.wraps(main)
    def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with _GUARD:
            before = set(_OWNED)
        try:
            return main(*args, **kwargs)
        finally:
            with _GUARD:
                taken = [_OWNED.pop(key) for key in list(_OWNED) if key not in before]
            for holds in taken:
                _let_go(holds)
    return wrapped


@contextlib.contextmanager
def run_lock(folder: str | os.PathLike, flag: str = "--output_dir",
             fix: str = "wait for it to end, then run this again") -> Iterator[None]:
    """Hold ``folder``'s run lock for the body (see :func:`hold_run_lock`; a command such as
    ``--recover``, which leaves no lock file of its own behind); ``flag`` and ``fix`` word the line
    given when another process holds it."""
    key = _take(folder, flag, fix)
    try:
        yield
    finally:
        _release(key, tidy=True)
