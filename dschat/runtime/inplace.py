"""Saving into a folder in place: the entries a save owns are replaced, the folder itself never moves.

A step's ``--output_dir`` is often a folder that cannot be renamed: a docker or Kubernetes volume (a
mount point: EBUSY / EXDEV), ``.``, a folder in a parent the user cannot write to, or a team folder
in a sticky ``/scratch`` (EPERM). It also holds what the user keeps there (``checkpoints/``,
``training.log``, TensorBoard runs, their own notes). So a model save never renames the folder and
never moves any entry it does not own; every file and rename stays inside the folder:

1. The new entries are written into a staging folder inside it, ``<path>/.dschat-staging-<id>``,
   made (after the replaced-entries folder of step 3) and opened before anything is written; the
   save then works through the open folders (Linux's ``/proc/self/fd``), so that in a folder others
   can write to, a link planted under either name, or the folder renamed away, cannot send a file
   elsewhere (a staging folder found replaced is one line, and nothing in ``path`` changes).
2. Every file and folder in it is fsync'd; then the journal ``.dschat-staged.json`` (the names
   staged, and the entries of ``path`` the save removes) is written and fsync'd into it: from here on
   the save is complete and will be finished, by the journal alone.
3. Each entry the save owns (``owns(name)``) that the new save does not write, and each entry the
   new save replaces, is renamed into ``<path>/.dschat-replaced-<id>`` (one recovery finds to be a
   link, or not this user's own, is one line, and nothing is moved); each staged entry is renamed
   into ``path``; ``path`` is fsync'd.
4. The replaced entries are deleted, then the staging folder. An error here is raised (the new
   save is in place; the leftovers go at the next recovery).

An exception in step 1 or 2 deletes the staging folder: ``path`` is untouched. An exception in
step 3 reverses every rename done, in reverse order: ``path`` is as it was. A kill at any point is
put right by :func:`recover_in_place` (called before the next save into ``path`` and at every step's
start-up): a staging folder with its journal is finished (step 3 repeated from the journal's names:
the complete new state, whatever ``owns`` the recovering caller passes), one without it deleted
(the complete old state). Entries ``owns`` rejects are never renamed, written or deleted. A folder
or journal that is not this user's own (:func:`owned_privately`) is left alone with a notice: on a
shared machine it may be another user's plant.

One process at a time per folder: a staging folder without its journal is also what a save *still
running* looks like, so :func:`recover_in_place` must not run while another process may save into
``path``. Steps and ``python -m dschat.models.save --recover`` make sure of that with the folder's
run lock (:mod:`dschat.runtime.run_lock`), taken before any recovery.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

from dschat.errors import UserError
from dschat.runtime.fs import (_disk_full_is_a_user_error, _normalise_modes, atomic_file, foreign_link_line, fsync_path,
                               fsync_tree)

from dschat.runtime.trust import owned_privately

__all__ = ["STAGING_PREFIX", "REPLACED_PREFIX", "JOURNAL", "SET_MARKER", "save_in_place", "recover_in_place",
           "unfinished_save", "mark_set", "unmark_set", "unfinished_set"]

STAGING_PREFIX = ".dschat-staging-"
REPLACED_PREFIX = ".dschat-replaced-"
#: Written into a staging folder, last, once everything in it is complete and fsync'd.
JOURNAL = ".dschat-staged.json"
#: Written into a folder before a set of models is saved into its subfolders (step 3's ``actor/``,
#: ``critic/``, ``actor_ema/``), removed after the last one: while it is there, the set may hold
#: models of two runs (each subfolder is saved atomically, the set is not).
SET_MARKER = ".dschat-saving-models.json"


def _ours(name: str) -> bool:
    return name.startswith((STAGING_PREFIX, REPLACED_PREFIX))


def _read_journal(stage: Path) -> tuple[list[str], list[str] | None] | None:
    """(the staged names, the entries the save removes: None in a journal that predates them), or
    None when ``stage`` is unfinished (no journal) or the journal is not this user's own or not one
    dschat wrote."""
    journal = stage / JOURNAL
    if not (journal.is_file() and owned_privately(journal)):
        return None
    try:
        record = json.loads(journal.read_text(encoding="utf-8"))
        names, removes = record.get("entries"), record.get("removes")
    except (OSError, ValueError, AttributeError):
        return None
    if not _names(names) or not (removes is None or _names(removes)):
        return None
    return names, removes


def _removed(path: Path, names: list[str], owns: Callable[[str], bool]) -> list[str]:
    """The entries of ``path`` a save staging ``names`` removes: those ``owns`` claims that it does not write."""
    return sorted(n for n in os.listdir(path) if owns(n) and n not in names and not _ours(n))


def _names(names: object) -> bool:
    """Whether ``names`` is a list of plain entry names (no path, none of the save's own)."""
    return isinstance(names, list) and all(isinstance(n, str) and n and "/" not in n and not _ours(n)
                                           and n not in (".", "..", JOURNAL) for n in names)


class _Moves:
    """The renames of step 3, recorded so that :meth:`undo` reverses them."""

    def __init__(self, path: Path, stage: Path, aside: Path) -> None:
        self.path, self.stage, self.aside = path, stage, aside
        self.done: list[tuple[Path, Path]] = []
        self.names: list[str] = []  # the staged names (forward's)

    def move(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)
        self.done.append((src, dst))

    def forward(self, names: list[str], removes: list[str]) -> None:
        """Step 3 for the staged ``names`` and the entries of ``path`` the save ``removes``; repeating it
        after a kill finishes what the killed process began."""
        path, stage, aside = self.path, self.stage, self.aside
        self.names = names
        lost = [name for name in names if not os.path.lexists(stage / name) and not os.path.lexists(path / name)]
        if lost:  # neither staged nor moved in: finishing would remove the old entries for nothing
            raise UserError(f"the interrupted save {stage} lacks {', '.join(lost)}, which {path} does not hold "
                            f"either, so it cannot be finished; move {stage} out of the folder and check what "
                            f"{path} holds")
        if not os.path.lexists(aside):
            aside.mkdir(mode=0o700)
            os.chmod(aside, 0o700)  # only its owner's, as the staging folder: recover_in_place trusts nothing else
        for name in removes:
            if os.path.lexists(path / name) and not os.path.lexists(aside / name):
                self.move(path / name, aside / name)
        for name in names:
            if not os.path.lexists(stage / name):
                continue  # moved in already
            if os.path.lexists(path / name):
                self.move(path / name, aside / name)
            self.move(stage / name, path / name)
        fsync_path(path)

    def undo(self) -> bool:
        """Reverse the renames done; False when one of them fails, or when a rename was done and not
        recorded (a signal between the two): a staged entry not back in the staging folder, or an
        entry left in the replaced-entries folder. The journal then stays, and
        :func:`recover_in_place` finishes the save instead. The caller removes the (empty)
        replaced-entries folder."""
        try:
            while self.done:
                src, dst = self.done[-1]
                os.replace(dst, src)
                self.done.pop()
            if not all(os.path.lexists(self.stage / name) for name in self.names) or os.listdir(self.aside):
                return False
        except OSError:
            return False
        return True


def _finish(stage: Path, aside: Path) -> None:
    """Step 4: the replaced entries first, the staging folder (and its journal) last, so that a
    kill or an error in between leaves the journal for :func:`recover_in_place` to finish from.
    An error is raised: the new save is in place, but hidden leftovers remain until then."""
    if _private_dir(aside):
        shutil.rmtree(aside)
    shutil.rmtree(stage)


def _private_dir(path: Path) -> bool:
    """Whether ``path`` is a folder (not a link to one) that only this user owns and can write to."""
    return not os.path.islink(path) and os.path.isdir(path) and owned_privately(path)


def _open_dir(name: str, parent_fd: int) -> int:
    """``name`` in the folder open as ``parent_fd``, opened as a folder without following a link."""
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)


def _through(fd: int, fallback: Path) -> Path:
    """A path to the folder open as ``fd`` that no rename of it, and no link planted under its name,
    can redirect (Linux's ``/proc/self/fd/<fd>``); ``fallback`` (its name) where there is none."""
    held = Path(f"/proc/self/fd/{fd}")
    return held if os.path.isdir(held) else fallback


def _is_still(name: str, parent_fd: int, fd: int) -> bool:
    """Whether ``name`` in the folder open as ``parent_fd`` is still the folder open as ``fd``."""
    try:
        entry = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (entry.st_dev, entry.st_ino) == (held.st_dev, held.st_ino)


def _remove_own(parent: Path, name: str, parent_fd: int, fd: int) -> None:
    """Delete the folder ``name`` of ``parent`` (open as ``parent_fd``) if it is still the one open as
    ``fd``: a folder another account put in its place is left alone."""
    if _is_still(name, parent_fd, fd):
        try:
            shutil.rmtree(name, dir_fd=parent_fd)
        except TypeError:  # Python 3.10's rmtree takes no dir_fd
            shutil.rmtree(_through(parent_fd, parent) / name)


def _remove_empty(name: str, parent_fd: int, fd: int) -> None:
    """Remove the folder ``name`` (in the folder open as ``parent_fd``) if it is still the one open as
    ``fd``; an OSError when it is not empty: an entry moved there and not recorded (a signal between a
    rename and its record) is never deleted."""
    if _is_still(name, parent_fd, fd):
        os.rmdir(name, dir_fd=parent_fd)


@contextlib.contextmanager
def save_in_place(path: str | os.PathLike, owns: Callable[[str], bool]) -> Iterator[Path]:
    """Yield an empty staging folder inside ``path`` (created, with its parents, if missing); when
    the body returns, its entries replace ``path``'s, and the entries of ``path`` that ``owns`` claims
    and the new save does not write are removed. See the module docstring for the order and what a
    failure or a kill leaves. A full disk is one line (:class:`~dschat.errors.UserError`) saying the
    previous files are unchanged. Returns nothing; one process at a time per ``path`` (the caller
    holds its run lock, :mod:`dschat.runtime.run_lock`, or knows no other process uses it). A ``path``
    that is a symbolic link another account made (planted in a folder others can write to) is one
    line before anything is written (:func:`~dschat.runtime.fs.foreign_link_line`); the user's own
    link is written through.
    """
    path = Path(path)
    line = foreign_link_line(path)
    if line is not None:
        raise UserError(line)
    with _disk_full_is_a_user_error(path, kept=f"the previous files in {path.name}, if any, are unchanged"), \
            contextlib.ExitStack() as held:
        path.mkdir(parents=True, exist_ok=True)
        recover_in_place(path, owns)
        token = uuid.uuid4().hex[:8]
        stage, aside = path / f"{STAGING_PREFIX}{token}", path / f"{REPLACED_PREFIX}{token}"
        # Both folders are made, and opened without following a link, before anything is written: in a
        # folder others can write to, a name they could see would otherwise be theirs to plant a link
        # at (or to rename away). Everything below goes through the open folders (_through).
        path_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        held.callback(os.close, path_fd)
        fds: dict[str, int] = {}
        try:
            for name in (aside.name, stage.name):  # mkdir never follows a link; one planted first: EEXIST
                os.mkdir(name, 0o700, dir_fd=path_fd)
                fds[name] = _open_dir(name, path_fd)
                held.callback(os.close, fds[name])
                os.fchmod(fds[name], 0o700)  # only its owner's: recover_in_place trusts nothing else
        except FileExistsError as err:
            for name, fd in fds.items():
                _remove_own(path, name, path_fd, fd)
            raise UserError(f"{path / err.filename} appeared before dschat made it: another account can write to "
                            f"{path}, so a save there is not safe; save into a folder only you can write to") from err
        aside_fd, stage_fd = fds[aside.name], fds[stage.name]
        here, work, away = _through(path_fd, path), _through(stage_fd, stage), _through(aside_fd, aside)

        def drop() -> None:
            """The save failed and left ``path`` as it was: its journal goes first, so that a kill
            midway leaves a staging folder without one (deleted at the next start), never a journal
            beside a part of the staged entries, which recovery would take for a save to finish."""
            with contextlib.suppress(OSError):
                (work / JOURNAL).unlink(missing_ok=True)
                fsync_path(work)
                _remove_own(path, stage.name, path_fd, stage_fd)
                _remove_empty(aside.name, path_fd, aside_fd)  # empty here: nothing moved, or all moved back

        try:
            yield work
            if not (_is_still(stage.name, path_fd, stage_fd) and _is_still(aside.name, path_fd, aside_fd)):
                raise UserError(f"{stage} was renamed or replaced while the model was written into it: another "
                                f"account can write to {path}; nothing in {path} was changed; save into a folder "
                                "only you can write to")
            _normalise_modes(work)
            names = sorted(os.listdir(work))
            removes = _removed(here, names, owns)
            fsync_tree(work)
            (work / JOURNAL).write_text(json.dumps({"entries": names, "removes": removes}), encoding="utf-8")
            os.chmod(work / JOURNAL, 0o600)
            fsync_path(work / JOURNAL)
            fsync_path(work)
        except BaseException:
            drop()
            raise
        moves = _Moves(here, work, away)
        try:
            moves.forward(names, removes)
        except BaseException:
            if moves.undo():
                drop()
            raise
        _remove_own(path, aside.name, path_fd, aside_fd)  # step 4: the replaced entries, then the staging folder
        _remove_own(path, stage.name, path_fd, stage_fd)


def recover_in_place(path: str | os.PathLike, owns: Callable[[str], bool]) -> list[str]:
    """Finish or undo a :func:`save_in_place` that a kill interrupted; one notice per fix.

    A staging folder with its journal is finished (the new save takes its place), one without is
    deleted (nothing of ``path`` had been touched). A replaced-entries folder without its staging
    folder gives back the entries ``path`` lacks, then goes. Leftovers that are not this user's own,
    or that others can write to, are left alone with a notice. The caller makes sure no other process
    is saving into ``path`` (its run lock, :mod:`dschat.runtime.run_lock`): a save in progress looks
    like an unfinished one and would be deleted.
    """
    path = Path(path)
    if not path.is_dir():
        return []
    notices: list[str] = []
    leftovers = sorted(p for p in path.iterdir() if _ours(p.name))
    for stage in (p for p in leftovers if p.name.startswith(STAGING_PREFIX)):
        if not (stage.is_dir() and owned_privately(stage)):
            notices.append(f"left {stage} alone: it is not a folder that only you own and can write to, so it "
                           "may not be your dschat run's; if it is yours, 'chmod go-w' it and run again (it may "
                           "hold the only copy of a save)")
            continue
        journal = _read_journal(stage)
        aside = path / f"{REPLACED_PREFIX}{stage.name[len(STAGING_PREFIX):]}"
        if journal is None:
            shutil.rmtree(stage, ignore_errors=True)
            notices.append(f"removed the unfinished save {stage.name} in {path}")
            continue
        names, removes = journal
        if os.path.lexists(aside) and not _private_dir(aside):  # planted: entries would move where it leads
            raise UserError(f"{aside} is not a folder that only you own and can write to, so the interrupted save "
                            f"{stage} cannot put what it replaces there; move both out of {path} and check what "
                            f"{path} holds")
        _Moves(path, stage, aside).forward(names, _removed(path, names, owns) if removes is None else removes)
        _finish(stage, aside)
        notices.append(f"finished an interrupted save into {path}")
    for aside in (p for p in leftovers if p.name.startswith(REPLACED_PREFIX) and p.is_dir()):
        if not aside.exists():
            continue  # finished above
        if not owned_privately(aside):
            notices.append(f"left {aside} alone: it is not a folder that only you own and can write to")
            continue
        put_back = 0
        for entry in sorted(aside.iterdir()):
            if not os.path.lexists(path / entry.name):
                os.replace(entry, path / entry.name)
                put_back += 1
        with contextlib.suppress(OSError):
            shutil.rmtree(aside)
        if put_back:  # an empty one: a save stopped before its swap (the folder is made first)
            notices.append(f"put back the entries of an interrupted save into {path}")
    return notices


def unfinished_save(path: str | os.PathLike) -> Path | None:
    """The first leftover of a :func:`save_in_place` inside ``path`` (a staging or replaced-entries
    folder), or None. While one is there the folder may hold part of the old save and part of the new
    one: a reader refuses it, and :func:`recover_in_place` finishes or undoes the save."""
    folder = Path(path)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    return next((folder / name for name in names if _ours(name)), None)


def mark_set(path: str | os.PathLike, names: list[str]) -> None:
    """Before saving a set of models into ``path``'s subfolders ``names``: :data:`SET_MARKER`, naming
    them, written and fsync'd (never through another account's link)."""
    marker = Path(path) / SET_MARKER
    Path(path).mkdir(parents=True, exist_ok=True)
    line = foreign_link_line(marker)
    if line is not None:
        raise UserError(line)
    with atomic_file(marker) as tmp:
        tmp.write_text(json.dumps({"models": names}), encoding="utf-8")
    fsync_path(Path(path))


def unmark_set(path: str | os.PathLike) -> None:
    """After the last model of the set: the marker removed (the set is one run's)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(Path(path) / SET_MARKER)
    fsync_path(Path(path))


def unfinished_set(folder: str | os.PathLike) -> Path | None:
    """The :data:`SET_MARKER` of ``folder``'s parent when it names ``folder`` (a marker that cannot be
    read names every subfolder), else None: ``folder`` is one of a set of models whose save did not
    finish (a kill or a failure between its folders), so it and the others may be of two runs."""
    folder = Path(folder).resolve()  # "." inside it, or a link to it, is the same folder
    marker = folder.parent / SET_MARKER
    if not marker.is_file():
        return None
    try:
        names = json.loads(marker.read_text(encoding="utf-8")).get("models")
    except (OSError, ValueError, AttributeError):
        return marker
    return marker if not isinstance(names, list) or folder.name in names else None
