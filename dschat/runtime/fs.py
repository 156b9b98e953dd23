"""Crash-safe writes: a reader never sees a half-written file or folder.

Files and folders are written under a temporary name beside their target, fsync'd, and renamed into
place only once complete (``os.replace`` is atomic on POSIX within one filesystem); the folder
holding them is fsync'd before anything older is deleted (:func:`fsync_path`, :func:`fsync_tree`).
A full disk while writing is a :class:`~dschat.errors.UserError` (one line, exit code 2) that says
the previous file or folder is unchanged. :func:`atomic_files` does the same for a set of files
replaced together, with a journal that :func:`recover_files` finishes after a kill. A model saved
into a folder that must not move (``--output_dir``) uses :mod:`dschat.runtime.inplace` instead.
:func:`check_writable_dir` refuses, at start-up, an output folder that cannot be created.

In an output folder others can write to (a team folder, one another account made 0777), another
account can plant a symlink where dschat writes: :func:`refuse_foreign_links` refuses one at
start-up (one line), and :func:`open_own` opens a file dschat writes in place (``metrics.jsonl``,
``training.log``) without following a link another account made, however late it was planted.
The user's own links are written through.

Leftovers are adopted only when this user may trust them (:mod:`dschat.runtime.trust`).

A folder that :func:`atomic_dir` completes carries :data:`SAVED_MARKER`; :func:`recover_dir` moves
leftovers into place only when they carry it and belong to this user alone (:func:`owned_privately`),
so a folder another local user planted beside ``--output_dir`` is never adopted. A symlinked target
is written through (:func:`resolve_output_dir`): the link stays and the data lands where it points.

Environment variables read here:

* ``DSCHAT_TEST_RANK_OUTPUT_ROOT`` (tests only): when set, :func:`resolve_output_dir` gives every
  rank its own ``--output_dir`` under ``<root>/rank<RANK>/``, so that two ranks on one machine see
  each other's files as two nodes with node-local storage would (none of them).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Callable, Iterator, Sequence

from dschat.errors import UserError
from dschat.runtime.trust import foreign_link, foreign_link_on_the_way, missing_ancestors, owned_privately

__all__ = [
    "SAVED_MARKER",
    "RANK_OUTPUT_ROOT_ENV",
    "resolve_output_dir",
    "check_writable_dir",
    "foreign_link_line",
    "refuse_foreign_links",
    "refuse_foreign_link_on_the_way",
    "open_own",
    "fsync_path",
    "fsync_tree",
    "atomic_file",
    "atomic_files",
    "pending_files",
    "recover_files",
    "atomic_dir",
    "recover_dir",
]

#: errno values of a file system that cannot fsync a folder (the entries' durability is its own).
_NO_FOLDER_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)
#: errno values that mean "the disk (or the user's quota) is full".
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
#: Written into an :func:`atomic_dir` folder once its content is complete, before it is swapped in.
SAVED_MARKER = ".dschat-saved"
#: Test hook: one output root per rank (simulates node-local storage on one machine). Tests only.
RANK_OUTPUT_ROOT_ENV = "DSCHAT_TEST_RANK_OUTPUT_ROOT"


def resolve_output_dir(value: str) -> str:
    """``--output_dir`` as every step uses it (resolved once, at parsing, before anything is written).

    A symlink is replaced by the path it points to (one another account made, there or on the way, is
    one line: :func:`~dschat.runtime.trust.foreign_link_on_the_way`): a save swaps the folder in place
    (:func:`atomic_dir`), and renaming the link would leave the output on the link's file system and
    the link dangling beside it. The link itself stays. Under :data:`RANK_OUTPUT_ROOT_ENV` (tests
    only) each rank gets its own folder ``<root>/rank<RANK>/<name>``.
    """
    test_root = os.environ.get(RANK_OUTPUT_ROOT_ENV)
    if test_root:
        name = os.path.basename(os.path.normpath(value))
        value = os.path.join(test_root, f"rank{os.environ.get('RANK', '0')}", name)
    refuse_foreign_link_on_the_way(value, "--output_dir")
    return os.path.realpath(value) if os.path.islink(os.path.normpath(value)) else value  # "link/" too


def _through_link(path: Path) -> Path:
    """``path``, or the folder it points to when it is a symlink (the link must stay a link)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """Refuse a folder path that cannot be created or written, before any work starts.

    ``flag`` names the option in the message (``--output_dir``). The folder may not exist yet; its
    nearest existing ancestor must then be a folder this process can write into. Permission bits
    are checked with ``os.access`` (as root they do not stop writes, so neither does this check).
    """
    target = Path(os.path.expanduser(os.fspath(path)))
    if target.exists() and not target.is_dir():
        raise UserError(f"{flag} {path} exists and is not a folder; pass a folder path")
    missing = missing_ancestors(target)
    ancestor = missing[-1].parent if missing else target
    if not ancestor.is_dir():
        raise UserError(f"{flag} {path} cannot be created: {ancestor} is a file, not a folder; "
                        "pass a path under a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} cannot be written: no write permission in {ancestor}; "
                        "pass a folder you can write to")


def _written_through(link: str | os.PathLike, reason: str, flag: str = "--output_dir") -> str:
    return (f"{os.fspath(link)} is {reason}; dschat would write through it: remove it, or use an {flag} only you "
            "can write to")


def foreign_link_line(path: str | os.PathLike) -> str | None:
    """The one line refusing ``path`` when it is a symbolic link another account made
    (:func:`~dschat.runtime.trust.foreign_link`), which a write would follow; None otherwise."""
    reason = foreign_link(path)
    return None if reason is None else _written_through(path, reason)


def refuse_foreign_link_on_the_way(value: str | os.PathLike, flag: str) -> None:
    """One line when ``flag``'s folder ``value`` is, or resolving it passes through, a symbolic link
    another account made (:func:`~dschat.runtime.trust.foreign_link_on_the_way`): planted in a folder
    others can write to, it would lead every write of the run where it points."""
    planted = foreign_link_on_the_way(value)
    if planted is not None:
        raise UserError(f"{flag} {os.fspath(value)}: {_written_through(planted[0], planted[1], flag)}")


def refuse_foreign_links(folder: str | os.PathLike, names: Sequence[str]) -> None:
    """One line (:func:`foreign_link_line`) for the first of ``folder``'s entries ``names`` that is a
    symbolic link another account made: at start-up, before anything is written through it."""
    for name in names:
        line = foreign_link_line(Path(os.path.expanduser(os.fspath(folder))) / name)
        if line is not None:
            raise UserError(line)


_OPEN_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
               "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC, "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}


def open_own(path: str | os.PathLike, mode: str = "a", encoding: str | None = None) -> IO:
    """``open(path, mode)`` for a file dschat writes in place in an output folder (``mode``: "w", "a",
    "w+", "a+", each with "b" or not), refusing in one line (:func:`foreign_link_line`) a symbolic link
    another account made there. The open itself does not follow a link (``O_NOFOLLOW``), so one planted
    after a check is never written through; the user's own link is (its target opened the same way,
    so a chain of links is checked link by link)."""
    flags = _OPEN_FLAGS[mode.replace("b", "")] | os.O_CLOEXEC | os.O_NOFOLLOW
    current = os.fspath(path)
    for _ in range(40):  # Linux's limit of links on one path
        try:
            fd = os.open(current, flags, 0o666)
        except OSError as err:
            if err.errno != errno.ELOOP or not os.path.islink(current):
                raise
            before = os.lstat(current)
            line = foreign_link_line(current)
            if line is not None:
                raise UserError(line) from None
            target = os.readlink(current)
            after = os.lstat(current)  # the same link read (not one swapped in meanwhile): else look again
            if (after.st_ino, after.st_dev) == (before.st_ino, before.st_dev):
                current = os.path.join(os.path.dirname(current), target)
            continue
        return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fspath(path))


def _is_disk_full(err: BaseException) -> bool:
    """An ``OSError`` with ENOSPC / EDQUOT, or a writer's own error that quotes one (safetensors
    raises ``SafetensorError("... No space left on device (os error 28) ...")``)."""
    if isinstance(err, OSError):
        return err.errno in _DISK_FULL
    return any(os.strerror(code) in str(err) for code in _DISK_FULL)


@contextlib.contextmanager
def _disk_full_is_a_user_error(path: Path, kept: str | None = None) -> Iterator[None]:
    """Turn "no space left on device" while writing ``path`` into one line that says what to do.

    ``kept`` says what is left as it was (default: "the previous <name>, if any, is unchanged").
    """
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        if not _is_disk_full(err):
            raise
        kept = kept or f"the previous {path.name}, if any, is unchanged"
        raise UserError(
            f"the disk is full (no space left on the device, or the quota is used up) while writing {path}; "
            f"free some space or write elsewhere, then run again ({kept})"
        ) from err


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries (names created, renamed or removed in it), to
    stable storage (``fsync``): after it returns, a power cut keeps what was written or renamed.
    A file system that cannot fsync a folder (some FUSE and object-store mounts answer EINVAL or
    ENOTSUP) keeps its own rules for the folder's entries; its files are still flushed."""
    folder = os.path.isdir(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if folder else 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if not (folder and err.errno in _NO_FOLDER_FSYNC):
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """:func:`fsync_path` on every file and folder under ``folder`` (symlinks are not followed),
    then on ``folder`` itself."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                fsync_path(os.path.join(root, name))
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                fsync_path(os.path.join(root, name))
    fsync_path(folder)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    with atomic_files([path]) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_files(paths: Sequence[str | os.PathLike], mode: int | None = None) -> Iterator[list[Path]]:
    """Replace a set of files that belong together (a data cache) at once; :func:`atomic_file` is
    the one-file case.

    Yields one temporary path beside each of ``paths``. Only once the body has written them all
    do they replace ``paths``, in the order given: put last the file whose presence marks the set
    complete. Each file is fsync'd before it replaces its target, and the folders after the renames,
    so a power cut never leaves an empty file under a target's name. On an exception (a full disk while writing the second file, say) every temporary
    file is removed and every one of ``paths`` is left as it was, previous versions included.
    The files get ``mode`` (0600: private), by default what a plain ``open()`` would give.

    Before the renames a journal (``.<last name>.journal``, naming each temporary file and its
    target) is written and fsync'd; it goes once every rename is done. A kill between the two
    leaves it, and :func:`recover_files` (run here first, one process at a time) finishes the
    renames: the set is the complete new one. Until then :func:`pending_files` is true and a reader
    must not read the set. On an exception during the renames the previous files are put back.
    """
    targets = [Path(p) for p in paths]
    if len(targets) > 1:
        recover_files(targets)
    # A full disk: one file is named with its previous version, a set by its folder.
    disk_full = (_disk_full_is_a_user_error(targets[0]) if len(targets) == 1 else
                 _disk_full_is_a_user_error(targets[0].parent, kept="the previous files there, if any, are unchanged"))
    with disk_full:
        tmps: list[Path] = []
        try:
            for path in targets:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
                os.close(fd)
                tmps.append(Path(tmp))
            yield list(tmps)
            if mode is None:
                mode = 0o666 & ~_umask()  # mkstemp creates 0600 files; give what a plain open() would
            for tmp in tmps:
                os.chmod(tmp, mode)
                fsync_path(tmp)
            if len(targets) == 1:  # one rename: atomic by itself
                os.replace(tmps[0], targets[0])
                fsync_path(targets[0].parent)
            else:
                _replace_journalled(tmps, targets)
        finally:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)  # gone already once renamed


def _journal_of(targets: Sequence[Path]) -> Path:
    return targets[-1].with_name(f".{targets[-1].name}.journal")


def pending_files(paths: Sequence[str | os.PathLike]) -> bool:
    """Whether an :func:`atomic_files` replacement of ``paths`` was stopped midway (its journal is
    there): the set may be part old, part new until :func:`recover_files` runs."""
    return os.path.lexists(_journal_of([Path(p) for p in paths]))


def recover_files(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Finish an :func:`atomic_files` replacement of ``paths`` that a kill stopped (the renames its
    journal names), and remove what a killed one left (temporary files, kept previous versions);
    one notice per fix. A journal that is not this user's alone is left, with a notice. One process
    at a time (a writer holds a lock)."""
    targets = [Path(p) for p in paths]
    journal = _journal_of(targets)
    notices: list[str] = []
    if os.path.lexists(journal):
        if not owned_privately(journal):
            return [f"left {journal} alone: it is not a file that only you own and can write to"]
        names = {p.name for p in targets}
        try:
            pairs = json.loads(journal.read_text(encoding="utf-8"))["pairs"]
            pairs = [(str(a), str(b)) for a, b in pairs if b in names and "/" not in str(a)]
        except (OSError, ValueError, KeyError, TypeError):
            pairs = []  # cut while it was written: no rename had begun
        for tmp, target in pairs:  # only this user's own temporary files are moved into place
            if os.path.lexists(journal.parent / tmp) and owned_privately(journal.parent / tmp):
                os.replace(journal.parent / tmp, journal.parent / target)
        fsync_path(journal.parent)
        journal.unlink()
        notices.append(f"finished an interrupted write of {', '.join(sorted(names))}")
    for target in targets:  # what a killed or failed writer left
        for leftover in target.parent.glob(f".{target.name}.*"):
            if leftover.suffix in (".tmp", ".previous") and owned_privately(leftover):
                leftover.unlink(missing_ok=True)
    return notices


def _replace_journalled(tmps: Sequence[Path], targets: Sequence[Path]) -> None:
    """The journal, then :func:`_replace_all`; the journal goes once the set is in (or put back)."""
    journal = _journal_of(targets)
    journal.write_text(json.dumps({"pairs": [[t.name, p.name] for t, p in zip(tmps, targets)]}), encoding="utf-8")
    os.chmod(journal, 0o600)
    fsync_path(journal)
    fsync_path(journal.parent)
    try:
        _replace_all(tmps, targets)
    except BaseException:
        journal.unlink(missing_ok=True)  # the previous files are back: nothing to finish
        raise
    journal.unlink()


def _replace_all(tmps: Sequence[Path], targets: Sequence[Path]) -> None:
    """``os.replace(tmp, target)`` pairwise, in order; when one fails, the targets already replaced
    get their previous files back (kept as hard links, or copies on a file system without them,
    until every rename is done)."""
    backups: list[tuple[Path, Path]] = []
    done: list[Path] = []
    try:
        for target in targets:
            if target.is_file():
                backup = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.previous")
                try:
                    os.link(target, backup)
                except OSError as err:  # a file system without hard links: a copy keeps it as well
                    if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                        raise
                    shutil.copy2(target, backup)
                backups.append((backup, target))
        for tmp, target in zip(tmps, targets):
            os.replace(tmp, target)
            done.append(target)
        for folder in sorted({target.parent for target in targets}):
            fsync_path(folder)
    except BaseException:
        kept = {target for _, target in backups}
        for target in done:
            if target not in kept:
                target.unlink(missing_ok=True)  # it did not exist before
        for backup, target in backups:
            if target in done:
                os.replace(backup, target)
        raise
    finally:
        for backup, _ in backups:
            with contextlib.suppress(OSError):  # a leftover link: recover_files removes it
                backup.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _mark_saved(folder: Path) -> None:
    """Mark ``folder`` complete; neither it nor the marker is writable by group or others, so
    :func:`recover_dir` can tell it from a folder someone else planted."""
    marker = folder / SAVED_MARKER
    marker.write_text("complete: written by dschat's atomic_dir\n", encoding="utf-8")
    mask = _umask()
    os.chmod(marker, 0o644 & ~mask)
    os.chmod(folder, 0o755 & ~mask)


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

    A previous folder at ``path`` stays intact until the new one is complete and fsync'd (every
    file and folder in it); it is then moved aside, the new one renamed into place, the parent
    folder fsync'd, and only then the old one deleted. On an exception at any point -- while
    writing, or a rename that fails (EXDEV, EBUSY, EPERM) -- every rename done so far is undone, in
    reverse order: ``path`` is as it was, the carried-over entries included, and the temporary
    folder is deleted only once it holds nothing that was carried over. A crash can at worst leave
    hidden ``.<name>.partial-*`` / ``.<name>.old-*`` siblings, never a half-written ``path``, which
    :func:`recover_dir` puts right.

    ``carry_over(name)`` keeps entries of the previous folder that the new one does not write
    (a training log, TensorBoard runs): they are moved -- renamed, so open file handles stay valid
    -- into the new folder just before the swap.

    The complete folder carries :data:`SAVED_MARKER` (written before anything is carried over) and
    is writable by its owner only. A symlinked ``path`` is written through: the link stays; unless
    another account made it (:func:`foreign_link_line`: one line, nothing written).
    """
    line = foreign_link_line(path)
    if line is not None:
        raise UserError(line)
    path = _through_link(Path(path))
    with _disk_full_is_a_user_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _partial_name(path, "partial")
        tmp.mkdir()
        swap = _Swap(path, tmp)
        try:
            yield tmp
            _normalise_modes(tmp)
            _mark_saved(tmp)
            fsync_tree(tmp)
            swap.commit(carry_over)
        except BaseException:
            swap.undo()
            raise
        if swap.old is not None:
            shutil.rmtree(swap.old, ignore_errors=True)


class _Swap:
    """The renames of one :func:`atomic_dir` commit, recorded so that :meth:`undo` can reverse them."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.path, self.tmp = path, tmp
        self.carried: list[str] = []
        self.old: Path | None = None
        self.swapped = False

    def commit(self, carry_over: Callable[[str], bool] | None) -> None:
        path, tmp = self.path, self.tmp
        if path.exists():
            if carry_over is not None:
                for entry in sorted(path.iterdir()):
                    if carry_over(entry.name) and not os.path.lexists(tmp / entry.name):
                        os.replace(entry, tmp / entry.name)
                        self.carried.append(entry.name)
            old = _partial_name(path, "old")
            os.replace(path, old)
            self.old = old
        os.replace(tmp, path)
        self.swapped = True
        fsync_path(path.parent)

    def undo(self) -> None:
        """Reverse the renames done so far; stop at the first that fails (the partial folder then
        stays, complete and marked, for :func:`recover_dir`)."""
        path, tmp = self.path, self.tmp
        try:
            if self.swapped:
                os.replace(path, tmp)
                self.swapped = False
            if self.old is not None:
                os.replace(self.old, path)
                self.old = None
            while self.carried:
                name = self.carried[-1]
                os.replace(tmp / name, path / name)
                self.carried.pop()
        except OSError:
            return
        shutil.rmtree(tmp, ignore_errors=True)


def _is_saved(folder: Path) -> bool:
    """``folder`` was completed by :func:`atomic_dir` (its marker is there, and is this user's alone)."""
    marker = folder / SAVED_MARKER
    return owned_privately(marker) and marker.is_file()


def recover_dir(path: str | os.PathLike, carry_over: Callable[[str], bool] | None = None) -> list[str]:
    """Finish or undo an :func:`atomic_dir` swap that a kill interrupted; return one notice per fix.

    Only leftovers (``.<name>.partial-*`` / ``.<name>.old-*`` beside ``path``) that this user owns and
    nobody else can write to are touched (:func:`owned_privately`); any other one is left alone,
    with a notice: on a shared machine it may be another user's plant (a poisoned checkpoint).

    * No ``path`` (killed between moving the old folder aside and renaming the new one into place,
      or before a first save was renamed): the newest leftover that carries :data:`SAVED_MARKER` --
      a complete new folder first, else the old one -- takes its place. One without the marker is
      never moved into place: an unfinished partial folder is deleted, an old one kept, with a notice.
    * A complete ``.partial-*`` sibling beside an existing ``path`` (killed while carrying entries
      over): the entries ``carry_over`` had moved into it (logs, ``checkpoints/``) go back into
      ``path``; the rest is deleted. An unfinished one held nothing carried over and is deleted.

    Call it before reading ``path`` (one process at a time: it renames). A ``path`` that is a symbolic
    link another account made is left alone, with a notice (:func:`foreign_link_line`).
    """
    line = foreign_link_line(path)
    if line is not None:
        return [f"left {path} alone: {line}"]
    path = _through_link(Path(path))
    if not path.parent.is_dir():
        return []
    notices: list[str] = []

    def siblings(tag: str) -> list[Path]:
        found = []
        for candidate in path.parent.glob(f".{path.name}.{tag}-*"):
            if not (candidate.is_dir() or candidate.is_symlink()):
                continue
            if owned_privately(candidate) and candidate.is_dir():
                found.append(candidate)
            else:
                notices.append(f"left {candidate} alone: it is not a folder that only you own and can write "
                               "to, so it may not be your dschat run's; if it is yours, 'chmod go-w' it and run again")
        return sorted(found, key=lambda p: p.stat().st_mtime)

    partials, olds = siblings("partial"), siblings("old")
    if not path.exists():
        source = next((p for p in reversed(partials) if _is_saved(p)), None) or next(
            (p for p in reversed(olds) if _is_saved(p)), None)
        if source is not None:
            os.replace(source, path)
            (partials if source in partials else olds).remove(source)
            notices.append(f"finished an interrupted save of {path} (from {source.name})")
    for partial in partials:
        if carry_over is not None and path.is_dir() and _is_saved(partial):
            clashes = []
            for entry in sorted(partial.iterdir()):
                if carry_over(entry.name):
                    if os.path.lexists(path / entry.name):
                        clashes.append(entry.name)
                    else:
                        os.replace(entry, path / entry.name)
            if clashes:  # never delete what was carried over: the user decides
                notices.append(f"left {partial} alone: it holds {', '.join(clashes)}, which {path} has too; "
                               "move what you want to keep into it, then delete it")
                continue
        shutil.rmtree(partial, ignore_errors=True)
        notices.append(f"removed the unfinished save {partial.name} beside {path}")
    for old in olds:
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            notices.append(f"left {old} alone: it has no dschat completion marker ({SAVED_MARKER}); "
                           f"rename it to {path} if it holds the output you want back")
    return notices
