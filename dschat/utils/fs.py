"""Crash-safe writes: a reader never sees a half-written file or folder.

Files and folders are written under a temporary name beside their target and renamed into place
only once complete (``os.replace`` is atomic on POSIX within one filesystem).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp creates 0600 files; give the result the permissions a plain open() would.
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _partial_name(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}")


def _normalise_modes(folder: Path) -> None:
    """Give everything under ``folder`` the permissions plain ``open``/``mkdir`` would (some
    writers use ``mkstemp``, which creates 0600 files other users cannot read)."""
    mask = _umask()
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, carry_over: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; on success it takes ``path``'s place.

    A previous folder at ``path`` stays intact until the new one is complete; it is then moved
    aside and deleted. On an exception the temporary folder is deleted and ``path`` is untouched.
    A crash can at worst leave hidden ``.<name>.partial-*`` / ``.<name>.old-*`` siblings, never a
    half-written ``path``.

    ``carry_over(name)`` keeps entries of the previous folder that the new one does not write
    (a training log, TensorBoard runs): they are moved -- renamed, so open file handles stay valid
    -- into the new folder just before the swap.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial_name(path, "partial")
    tmp.mkdir()
    try:
        yield tmp
        _normalise_modes(tmp)
        old = None
        if path.exists():
            if carry_over is not None:
                for entry in path.iterdir():
                    if carry_over(entry.name) and not (tmp / entry.name).exists():
                        os.replace(entry, tmp / entry.name)
            old = _partial_name(path, "old")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def recover_dir(path: str | os.PathLike, carry_over: Callable[[str], bool] | None = None) -> list[str]:
    """Finish or undo an :func:`atomic_dir` swap that a kill interrupted; return one notice per fix.

    * Killed between moving the old folder aside and renaming the new one into place (no ``path``,
      an ``.old-*`` sibling): the new folder was complete (the old one is moved aside only then), so
      the swap is finished; without a new folder the old one is put back.
    * An unfinished ``.partial-*`` sibling beside an existing ``path``: the entries ``carry_over``
      had moved into it (logs, ``checkpoints/``) go back into ``path``; the rest is deleted.

    Call it before reading ``path`` (one process at a time: it renames).
    """
    path = Path(path)
    if not path.parent.is_dir():
        return []
    notices: list[str] = []

    def siblings(tag: str) -> list[Path]:
        found = [p for p in path.parent.glob(f".{path.name}.{tag}-*") if p.is_dir()]
        return sorted(found, key=lambda p: p.stat().st_mtime)

    partials, olds = siblings("partial"), siblings("old")
    if not path.exists() and (partials or olds):
        source = partials.pop() if partials else olds.pop()
        os.replace(source, path)
        notices.append(f"finished an interrupted save of {path} (from {source.name})")
    for partial in partials:
        if carry_over is not None:
            for entry in partial.iterdir():
                if carry_over(entry.name) and not (path / entry.name).exists():
                    os.replace(entry, path / entry.name)
        shutil.rmtree(partial, ignore_errors=True)
        notices.append(f"removed the unfinished save {partial.name} beside {path}")
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
    return notices

