"""Checkpoint folders on disk: which are complete, their write order, replacing one, rotation
(``--keep_checkpoints``) and the leftovers of stopped saves.

* A checkpoint ``checkpoints/step_<N>`` is complete when it holds :data:`MARKER`. Its marker records
  a ``sequence`` number, one more than any complete checkpoint beside it had when it was written:
  :func:`complete_checkpoints` lists them in write order (a checkpoint without one, by its marker's
  modification time, before those with one). ``--resume`` takes the last written, not the highest
  step: after a roll-back with ``--resume_from step_50``, the step_60 written next is the newest,
  not an abandoned step_200.
* Rotation (:func:`prune_rotated`) keeps the ``keep`` last written, and never deletes the
  checkpoint just written nor the ``--resume_from`` source. A folder to prune is first renamed to a
  ``.tmp-pruned-*`` name (one atomic rename: it stops counting as complete), then deleted; a kill
  midway leaves a leftover that the next start deletes, never a half-deleted ``step_<N>``. A
  checkpoint that cannot be deleted is kept, with a notice: training goes on.
* A checkpoint is written in a ``.tmp-step_<N>`` folder that holds :data:`WRITING_TAG` from its
  creation. A ``step_<N>`` with that tag and without its marker (a stop between its rename and its
  marker) is removed at the next start (:func:`retire_incomplete`), like the ``.tmp-*`` leftovers.
  A ``step_<N>`` with neither (nor the files of a dschat from before the tag) is not dschat's
  (:func:`foreign_checkpoints`): start-up refuses to run beside it, a save refuses to replace it,
  and nothing deletes it.
* Replacing a complete ``step_<N>`` (the same step saved again after a resume) renames the old one
  to ``step_<N>.replaced-<id>`` before the new one is renamed in (:func:`set_aside`); the old one is
  deleted only once the new one is complete. A kill in between leaves both, and the next start
  (:func:`restore_replaced`) keeps the complete one: step N is never only a ``.tmp-step_<N>``. The
  checkpoint a run resumed from is never replaced (its step counter cannot come back to it).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Sequence

from dschat.errors import UserError
from dschat.runtime.dist import print_rank_0

MARKER = "dschat_checkpoint.json"
WRITING_TAG = ".dschat-checkpoint-writing"  # in every checkpoint folder dschat writes, from its creation on
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
PROBE_PREFIX = f"{TMP_PREFIX}visible-"  # a file rank 0 drops for the other ranks to look for
PRUNED_PREFIX = f"{TMP_PREFIX}pruned-"  # a rotated-out checkpoint being deleted
PRUNING_PREFIX = f"{TMP_PREFIX}pruning-"  # a leftover claimed by a rank for deleting (prune_leftovers)
REPLACED_TAG = ".replaced-"  # step_<N>.replaced-<id>: a complete step_<N> set aside while it is replaced


def checkpoint_name(optimizer_steps: int) -> str:
    return f"{PREFIX}{optimizer_steps:08d}"


def steps_of(folder: Path) -> int | None:
    """N of a ``step_<N>`` folder, else None."""
    name = folder.name
    if not name.startswith(PREFIX) or not name[len(PREFIX):].isdigit():
        return None
    return int(name[len(PREFIX):])


def write_order(folder: Path) -> tuple[int, int]:
    """Sort key of a complete checkpoint: its marker's ``sequence`` (-1 without a readable one),
    then the marker's modification time."""
    marker = folder / MARKER
    try:
        sequence = json.loads(marker.read_text(encoding="utf-8")).get("sequence", -1)
        mtime = marker.stat().st_mtime_ns
    except (OSError, ValueError, AttributeError):
        return (-1, 0)
    return (sequence if isinstance(sequence, int) and not isinstance(sequence, bool) else -1, mtime)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, in write order (the last written last)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and steps_of(p) is not None and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: (write_order(p), steps_of(p) or 0))


def next_sequence(root: Path) -> int:
    """The ``sequence`` of a checkpoint written now: one more than any complete one has."""
    return max((write_order(p)[0] for p in complete_checkpoints(root)), default=-1) + 1


def incomplete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (
        (p.name.startswith(TMP_PREFIX) and left_by_dschat(p))
        or (steps_of(p) is not None and not (p / MARKER).is_file())))


def left_by_dschat(leftover: Path) -> bool:
    """Whether the ``.tmp-*`` entry ``leftover`` of a checkpoint root is dschat's own (and so may be
    deleted): a probe file or a folder being pruned (names only dschat gives), a checkpoint folder
    dschat began (:func:`begun_by_dschat`), or an empty folder (a write stopped before its tag). Any
    other entry of that name is the user's, and is left alone; so is one that cannot be read, or is
    gone while it is looked at (another rank claimed it)."""
    if leftover.name.startswith((PROBE_PREFIX, PRUNED_PREFIX, PRUNING_PREFIX)):
        return True
    try:
        if leftover.is_symlink() or not leftover.is_dir():
            return False
        return begun_by_dschat(leftover) or not any(leftover.iterdir())
    except OSError:  # gone (another rank claimed it meanwhile) or unreadable (not ours to delete)
        return False


def latest_checkpoint(root: Path, rank: int = 0, *, strict: bool = False) -> Path | None:
    """The last written complete checkpoint; each incomplete one is named in a one-line notice. With
    ``strict`` (what ``--resume`` continues from), a complete one whose marker is not a JSON object
    (damaged or edited: where it stands in the write order, the newest or not, is unknown) is one
    :class:`UserError` line naming it."""
    for bad in incomplete_checkpoints(root):
        print_rank_0(f"[checkpoint] ignoring incomplete checkpoint {bad} (a run stopped while writing it)", rank)
    done = complete_checkpoints(root)
    for folder in done if strict else ():
        try:
            if isinstance(json.loads((folder / MARKER).read_text(encoding="utf-8")), dict):
                continue
            problem = "it is not a JSON object"
        except (OSError, ValueError) as err:
            problem = f"it is not readable JSON ({type(err).__name__})"
        raise UserError(f"{folder / MARKER}: {problem}; the checkpoint is damaged or was edited, so the newest "
                        "cannot be told: pass --resume_from with another checkpoint, or move that one away")
    return done[-1] if done else None


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def prune_rotated(root: Path, keep: int, protect: list[Path]) -> list[Path]:
    """Delete all but the ``keep`` last written complete checkpoints, never one in ``protect`` (the
    checkpoint just written, the resume source); return those deleted. Each is made incomplete
    first, by renaming it to a ``.tmp-pruned-*`` name, then deleted."""
    pruned = []
    for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        if any(_same(old, kept) for kept in protect):
            continue
        doomed = root / f"{PRUNED_PREFIX}{old.name}-{secrets.token_hex(4)}"
        try:
            os.replace(old, doomed)
        except OSError as err:  # the new checkpoint is complete: training goes on, the old one stays
            print(f"[checkpoint] could not delete the old checkpoint {old} ({err.strerror or err}); it is kept, "
                  "complete; delete it yourself if you need the space", flush=True)
            continue
        shutil.rmtree(doomed, ignore_errors=True)  # what is left goes at the next start
        pruned.append(old)
    return pruned


def is_in(root: Path, folder: Path) -> bool:
    """Whether ``folder`` is directly in ``root`` (the same folder by any path: links, ``..``)."""
    try:
        return os.path.samefile(folder.parent, root)
    except OSError:  # either is missing: there is nothing of an earlier run in root to mix with
        return folder.absolute().parent == root.absolute()


def begun_by_dschat(folder: Path) -> bool:
    """Whether dschat began writing the checkpoint ``folder``: it holds the in-progress tag, or
    (renamed in by a dschat from before the tag, which renames a folder only once every file is in)
    the ``consolidated/`` folder and ``rng_rank<r>.json`` files that every dschat checkpoint has."""
    return (folder / WRITING_TAG).is_file() or (
        (folder / "consolidated").is_dir() and any(folder.glob("rng_rank*.json")))


def is_foreign(folder: Path) -> bool:
    """Whether ``folder`` (a ``step_<N>``) exists and dschat did not write it: no marker, and not
    begun by dschat (:func:`begun_by_dschat`): another tool's folder."""
    return os.path.lexists(folder) and not (folder / MARKER).is_file() and not begun_by_dschat(folder)


def foreign_checkpoints(root: Path) -> list[Path]:
    """The entries under ``root`` in a save's way that dschat did not write: each ``step_<N>`` (a
    folder, a file or a link) that :func:`is_foreign` names, and each ``.tmp-step_<N>`` of the user's
    (not :func:`left_by_dschat`), where the save of step N begins."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (steps_of(p) is not None and is_foreign(p))
                  or (_save_folder_name(p.name) and not left_by_dschat(p)))


def _save_folder_name(name: str) -> bool:
    """Whether ``name`` is that of the folder a save begins in, ``.tmp-step_<N>`` (as :func:`checkpoint_name`)."""
    steps = steps_of(Path(name.removeprefix(TMP_PREFIX)))
    return steps is not None and name == f"{TMP_PREFIX}{checkpoint_name(steps)}"


def earlier_run_checkpoints(root: Path) -> list[Path]:
    """The checkpoints of an earlier run under ``root`` that a fresh run refuses to start beside, as
    start-up leaves them (:func:`restore_replaced`, :func:`retire_incomplete`): the complete ones, a
    complete ``step_<N>.replaced-*`` copy (kept as ``step_<N>`` when it is the complete one), and each
    ``step_<N>`` that dschat did not begin (one it began and never completed is retired). Reads only,
    so it gives the same answer before start-up (e2e, before a step runs) as after it (the step)."""
    if not root.is_dir():
        return []
    asides = [p for p in sorted(root.glob(f"{PREFIX}*{REPLACED_TAG}*")) if (p / MARKER).is_file()]
    return complete_checkpoints(root) + asides + [
        p for p in incomplete_checkpoints(root) if not p.name.startswith(TMP_PREFIX) and not begun_by_dschat(p)]


def retire_incomplete(root: Path) -> list[str]:
    """Rename each ``step_<N>`` that dschat began and never marked complete (a run stopped after
    renaming it in, before marking it) to a ``.tmp-*`` leftover, which :func:`prune_leftovers` then
    deletes; one notice each. A folder that dschat did not begin is left as it is
    (:func:`foreign_checkpoints`). Rank 0 only, at start-up."""
    notices = []
    for folder in incomplete_checkpoints(root):
        if not folder.name.startswith(TMP_PREFIX) and begun_by_dschat(folder):
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder, root / f"{TMP_PREFIX}{folder.name}-{secrets.token_hex(4)}")
                notices.append(f"{folder} was never completed (a run stopped while writing it); removing it")
    return notices


def replaces_protected(final: Path, protect: Sequence[Path | None]) -> bool:
    """Whether saving ``final`` would replace one of ``protect`` (the checkpoint a run resumed from)."""
    return os.path.lexists(final) and any(kept is not None and _same(final, kept) for kept in protect)


#: What to do when a save would replace the checkpoint the run resumed from (:func:`protected_problem`).
PROTECTED_FIX = "it is left as it is: resume from it with the flags that wrote it"


def protected_problem(final: Path) -> str:
    """Why a save may not replace ``final``, the checkpoint a run resumed from (the fix:
    :data:`PROTECTED_FIX`)."""
    return f"would replace {final}, the checkpoint this run resumed from (the step counter went back to its step)"


def set_aside(final: Path, protect: Sequence[Path | None] = ()) -> Path | None:
    """Rename an existing ``final`` to ``step_<N>.replaced-<id>`` beside it; the new name, or None.
    A ``final`` in ``protect`` (the checkpoint the run resumed from) is never set aside: one
    :class:`~dschat.errors.UserError` line, nothing renamed."""
    if not os.path.lexists(final):
        return None
    if replaces_protected(final, protect):
        raise UserError(f"{protected_problem(final)}; {PROTECTED_FIX}")
    aside = final.with_name(f"{final.name}{REPLACED_TAG}{secrets.token_hex(4)}")
    os.replace(final, aside)
    return aside


def put_back(final: Path, aside: Path | None, tmp: Path) -> None:
    """Undo a commit that failed before ``final`` was complete: ``final`` goes back to ``tmp`` (pruned
    at the next start) and the set-aside checkpoint, if any, back to ``final``."""
    if os.path.lexists(final) and not (final / MARKER).is_file():
        os.replace(final, tmp)
    if aside is not None and os.path.lexists(aside) and not os.path.lexists(final):
        os.replace(aside, final)


def restore_replaced(root: Path) -> list[str]:
    """After a kill while ``step_<N>`` was being replaced: keep the complete one of ``step_<N>`` and
    its ``step_<N>.replaced-*`` (the new one when both are); one notice per fix. Safe to run on
    every rank of a shared folder (a rename that another rank did first is passed over)."""
    if not root.is_dir():
        return []
    notices = []
    for aside in sorted(root.glob(f"{PREFIX}*{REPLACED_TAG}*")):
        final = root / aside.name.split(REPLACED_TAG)[0]
        with contextlib.suppress(FileNotFoundError):
            if (final / MARKER).is_file() or not (aside / MARKER).is_file():
                doomed = root / f"{PRUNED_PREFIX}{aside.name}"
                os.replace(aside, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                continue
            if os.path.lexists(final):  # the new one, never completed
                os.replace(final, root / f"{TMP_PREFIX}{final.name}-{secrets.token_hex(4)}")
            os.replace(aside, final)
            notices.append(f"restored {final} (a run stopped while replacing it)")
    return notices


def prune_leftovers(root: Path, run_tag: str) -> list[str]:
    """Delete the ``.tmp-*`` leftovers of stopped saves under ``root`` as this rank sees it (dschat's own:
    :func:`left_by_dschat`; the user's entries of such names stay); return
    one notice per unfinished checkpoint deleted.

    Every rank calls it (node-local folders have leftovers too), with the same ``run_tag``. A rank
    first claims a leftover by renaming it to ``.tmp-pruning-<run_tag>-<own suffix>``, which the
    other ranks of this run pass over: on a shared file system exactly one rank deletes each.
    """
    if not root.is_dir():
        return []
    ours = f"{PRUNING_PREFIX}{run_tag}-"
    notices = []
    for leftover in sorted(root.glob(f"{TMP_PREFIX}*")):
        if leftover.name.startswith(ours):
            continue  # claimed by another rank of this run
        if not left_by_dschat(leftover):
            continue  # the user's own, named like a leftover
        claimed = root / f"{ours}{secrets.token_hex(6)}"
        try:
            os.replace(leftover, claimed)
        except FileNotFoundError:  # another rank claimed it first
            continue
        if claimed.is_dir() and not claimed.is_symlink():
            shutil.rmtree(claimed, ignore_errors=True)
        else:
            claimed.unlink(missing_ok=True)
        if not leftover.name.startswith((PROBE_PREFIX, PRUNING_PREFIX, PRUNED_PREFIX)):
            notices.append(f"ignoring incomplete checkpoint {leftover} (a run stopped while writing it); "
                           "removed it")
    return notices
