"""Training checkpoints and exact resume (``--save_interval``, ``--resume``, ``--resume_from``,
``--keep_checkpoints``).

A checkpoint is a folder ``<output_dir>/checkpoints/step_<N>`` (N = optimizer steps done) holding

* one DeepSpeed checkpoint per trainable engine (``engine.save_checkpoint``: module, optimizer,
  LR scheduler, loss scaler, under the tag ``<name>``);
* ``<name>.safetensors`` per engine kept as weights only (step 3's EMA actor: no optimizer, and
  DeepSpeed cannot checkpoint an optimizer-less ZeRO-3 engine), gathered under ZeRO-3; a
  half-precision EMA's fp32 copy in its weights' place (:mod:`dschat.training.weights_file`);
* ``rng_rank<r>.json``: every rank's Python, NumPy, torch (and CUDA) random states, as JSON;
* ``dschat_checkpoint.json``, written last: the data position (epoch, micro-steps done in that
  epoch), the step counters and any caller state. A folder without it is incomplete.

Writes go to ``checkpoints/.tmp-step_<N>``, are fsync'd and renamed into place once every rank has
written its part, so a kill at any moment leaves the previous checkpoint usable; an incomplete
folder is ignored on resume with a one-line notice. Which checkpoints are complete, their write
order (what ``--resume`` and ``--keep_checkpoints`` go by), replacing a step saved again and
rotation live in :mod:`dschat.training.rotation`; the JSON files and their checks in
:mod:`dschat.training.checkpoint_records`.

Every rank agrees (collectives, :func:`dschat.runtime.dist.gather_ints`): a checkpoint is complete
(its marker written) only once every rank has found the files it wrote in the renamed folder, as
seen from its own node; on ``--resume`` the ranks compare the step they would load before anything
is loaded. A rank that cannot see the folder rank 0 writes (``--output_dir`` on node-local storage)
stops every rank with one line naming it and its host (exit 2), at start-up
(:func:`prepare_checkpoint_root`) and at every save. Leftover ``.tmp-*`` folders are pruned at
start-up by every rank in its own view; a rename claims each one first, so ranks sharing the folder
never delete the same leftover twice. The data position is exact because the training order is
a function of (seed, epoch, rank) only (``make_train_loader``): resuming skips the batches already
trained in that epoch. On a CPU, ZeRO 0 and 2, a resumed run reproduces the uninterrupted run's
losses bit for bit (``tests/training/test_checkpoint.py``).

DeepSpeed's checkpoint files are ``torch.save`` pickles, which DeepSpeed itself loads with
``torch.load(weights_only=False)`` (any object, any code). :func:`load_checkpoint` swaps in
:class:`WeightsOnlyCheckpointEngine` for the load: ``weights_only=True`` with four DeepSpeed record
types allowed (:func:`safe_deepspeed_globals`), so a tampered checkpoint cannot run code; one holding
anything else, or a damaged file, is refused with one line naming the file (exit code 2).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from pickle import UnpicklingError  # the error type only: nothing here unpickles
from typing import Any, Mapping, Protocol, Sequence

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from dschat.errors import UserError
from dschat.models.save import recover_output_dir
from dschat.runtime.dist import barrier, gather_hosts, gather_ints, get_rank, get_world_size, print_rank_0
from dschat.runtime.fs import _disk_full_is_a_user_error, atomic_file, foreign_link_line, fsync_path, fsync_tree
from dschat.runtime.trust import missing_ancestors, remove_made_folders
from dschat.training.consolidated import derived_rng_state, resume_on_new_shape, save_consolidated
from dschat.training.rotation import (MARKER, PROBE_PREFIX, PROTECTED_FIX, PRUNED_PREFIX, TMP_PREFIX, WRITING_TAG,
                                      checkpoint_name, complete_checkpoints, earlier_run_checkpoints,
                                      foreign_checkpoints, is_foreign, is_in, latest_checkpoint, left_by_dschat,
                                      next_sequence, protected_problem, prune_leftovers, prune_rotated, put_back,
                                      replaces_protected, restore_replaced, retire_incomplete, set_aside,
                                      steps_of as _steps_of)
from dschat.training.nonfinite import check_weights_finite
from dschat.training.weights_file import load_weights, save_weights
from dschat.training.checkpoint_records import (FORMAT_VERSION, check_models, check_trainable, check_written_like,
                                                model_record,
                                                read_record, read_rng_file, rng_state, set_rng_state,
                                                trainable_parameters)

# What a rank that cannot see rank 0's folder is told to do.
SHARED_OUTPUT_FIX = ("--output_dir (and --resume_from) must be a folder that every node sees (the same path on a "
                     "shared file system); dschat does not write DeepSpeed's node-local checkpoints "
                     "(checkpoint.use_node_local_storage)")


@dataclass
class TrainingPosition:
    """Where training stands after an optimizer step."""

    epoch: int  # the epoch in progress (0-based)
    epoch_micro_steps: int  # micro-batches of that epoch already trained
    micro_steps: int  # micro-steps trained in total, in this run's accumulation (a resume converts them)
    optimizer_steps: int
    extra: dict[str, Any] = field(default_factory=dict)  # caller state (JSON)


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def refuse_foreign_root(root: Path) -> None:
    """Stop every rank with one line when ``root`` (``checkpoints/``) is a symbolic link another account
    made, as any rank sees it (collective): nothing is renamed, pruned or written through it."""
    line = foreign_link_line(root)
    seen = [rank for rank, (flag,) in enumerate(gather_ints([int(line is not None)])) if flag]
    if seen:  # a rank that does not see it (node-local folders) is told where it is seen
        raise UserError(line or f"{root} is a symbolic link another account made, as rank {seen[0]} sees it; dschat "
                                "would write through it: remove it, or use an --output_dir only you can write to")


def read_position(folder: Path) -> TrainingPosition:
    return TrainingPosition(**read_record(folder)["position"])


# ------------------------------------------------------------------------------------------------
# Rank agreement (collective: every rank calls these, in the same order)
# ------------------------------------------------------------------------------------------------
def refuse_unless_all(ok: bool, problem: str, fix: str = SHARED_OUTPUT_FIX) -> None:
    """Stop every rank with the same one line when ``ok`` is False on any rank.

    ``problem`` says what the first failing rank could not do ("cannot see ..."); the line names
    that rank and its host, and how many others failed with it.
    """
    failed = [rank for rank, (flag,) in enumerate(gather_ints([0 if ok else 1])) if flag]
    if not failed:
        return
    hosts = gather_hosts()  # every rank is here: the flags above are the same on all of them
    first = failed[0]
    more = f" (and {len(failed) - 1} more rank{'s' if len(failed) > 2 else ''})" if len(failed) > 1 else ""
    raise UserError(f"rank {first} on host {hosts[first]}{more} {problem}; {fix}")


def _share_probe(folder: Path, rank: int) -> Path:
    """Rank 0 drops an empty file with a fresh random name into ``folder``; every rank gets its path
    (collective). A stale folder or file of the same name cannot pass for it."""
    token = secrets.randbits(62) if rank == 0 else 0
    if rank == 0:
        (folder / f"{PROBE_PREFIX}{token:x}").touch()
    token = gather_ints([token])[0][0]  # rank 0 wrote the file before it sent the name
    return folder / f"{PROBE_PREFIX}{token:x}"


def refuse_unless_shared(folder: Path, rank: int, what: str) -> None:
    """Every rank must see ``folder`` as rank 0 does (the same folder, not a namesake on its own
    node); otherwise every rank stops with one line (collective; ``folder`` exists on rank 0)."""
    if get_world_size() == 1:
        return
    probe = _share_probe(folder, rank)
    try:
        refuse_unless_all(probe.is_file(), f"cannot see {what} {folder} that rank 0 made")
    finally:
        barrier()
        if rank == 0:
            probe.unlink(missing_ok=True)


class CheckpointSettings(Protocol):
    """What checkpoints read from a step's settings: steps 1-2's parsed flags or step 3's
    :class:`~dschat.rlhf.config.CheckpointConfig` (an upstream-style Namespace may lack all but
    ``output_dir``; each is read with its default)."""

    output_dir: str | None
    save_interval: int
    keep_checkpoints: int
    resume: bool
    resume_from: str | None


def wants_checkpoints(args: CheckpointSettings) -> bool:
    return bool(getattr(args, "save_interval", 0) > 0 or getattr(args, "resume", False)
                or getattr(args, "resume_from", None))


def prepare_checkpoint_root(args: CheckpointSettings, rank: int) -> None:
    """Start-up checks of ``<output_dir>/checkpoints`` that need every rank's view (collective, right
    after the process group starts, before any model loads).

    * A ``checkpoints/`` that is a symbolic link another account made is refused (:func:`refuse_foreign_root`).
    * A ``step_<N>`` folder that dschat did not begin (no marker, and not
      :func:`~dschat.training.rotation.begun_by_dschat`), seen by any rank, is refused: nothing
      here deletes or replaces another tool's folder.
    * A fresh run (no ``--resume`` / ``--resume_from``), or one resuming ``--resume_from`` a checkpoint
      of another ``--output_dir``, refuses a folder with checkpoints of an earlier run, seen by any
      rank: its checkpoints would mix with them, and rotation would delete them.
    * Rank 0 keeps the complete one of a ``step_<N>`` and the copy it was replacing when a run
      stopped (:func:`~dschat.training.rotation.restore_replaced`), and turns a ``step_<N>`` never
      marked complete into a leftover (:func:`~dschat.training.rotation.retire_incomplete`).
    * Each rank prunes the ``.tmp-*`` leftovers it sees (:func:`prune_leftovers`).
    * With checkpoints to write or resume, every rank must see the folder rank 0 sees.
    """
    if not getattr(args, "output_dir", None):  # an upstream-style Namespace may lack it
        return
    root = checkpoint_root(args.output_dir)
    refuse_foreign_root(root)  # a link another account planted in --output_dir: another run's checkpoints
    if rank == 0:  # one process renames (a step_<N> replaced, or never completed, when a run stopped)
        for notice in restore_replaced(root) + retire_incomplete(root):
            print(f"[checkpoint] {notice}", flush=True)
    barrier()
    if wants_checkpoints(args):  # found now, not by the first save after hours of training
        refuse_unless_all(root.is_dir() or not os.path.lexists(root), f"sees {root}, which is not a folder: "
                          "the checkpoints go there", f"move it out of {args.output_dir}, or pass another --output_dir")
    foreign = foreign_checkpoints(root)
    for folder in foreign:
        print(f"[checkpoint] {folder} is not a checkpoint dschat wrote (no {MARKER}, no {WRITING_TAG}, no "
              "consolidated/ and rng_rank*.json); left as it is", flush=True)
    refuse_unless_all(not foreign, f"sees a step_<N> (or .tmp-step_<N>) entry in {root} that dschat did not write "
                      "(named above)", f"move it out of {root} (on every node), then rerun")
    source = getattr(args, "resume_from", None)
    elsewhere = bool(source) and not is_in(root, Path(source))
    fresh = not getattr(args, "resume", False) and (not source or elsewhere)
    # A fresh run would mix its checkpoints with the old ones, and a later --resume could pick an old one.
    earlier = fresh and bool(earlier_run_checkpoints(root))
    refuse_unless_all(not earlier, f"found checkpoints of an earlier run in {root}" + (
        f", and --resume_from {source} is not one of them" if elsewhere else ""),
        ("pass another --output_dir, --resume_from one of those" if elsewhere else "pass --resume to continue that run")
        + f", or delete {root} on every node to start over")
    run_tag = f"{gather_ints([secrets.randbits(62) if rank == 0 else 0])[0][0]:x}"
    for notice in prune_leftovers(root, run_tag):
        print(f"[checkpoint] {notice}", flush=True)
    barrier()  # no rank looks for rank 0's probe before every rank has pruned
    if wants_checkpoints(args) and get_world_size() > 1:
        made = missing_ancestors(root) if rank == 0 else []
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
        try:
            refuse_unless_shared(root, rank, "the checkpoint folder")
        finally:
            remove_made_folders(made)  # a run stopped later by bad input leaves no empty folders behind


# ------------------------------------------------------------------------------------------------
# Saving and loading
# ------------------------------------------------------------------------------------------------
def safe_deepspeed_globals() -> list[Any]:
    """The non-tensor types DeepSpeed 0.19's checkpoints pickle (ZeRO 0-3, offload, bf16, LoRA): plain
    records (the loss scaler's numbers, the ZeRO stage enum, a fragment's (numel, start))."""
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


#: What loading a damaged or foreign file raises besides UnpicklingError: a truncated pickle
#: (EOFError), a broken zip (torch's RuntimeError "PytorchStreamReader failed", zipfile's
#: BadZipFile), odd records (ValueError, TypeError), a file gone missing (OSError).
_UNREADABLE = (EOFError, RuntimeError, zipfile.BadZipFile, ValueError, TypeError, OSError)


def _load_error_detail(err: BaseException) -> str:
    """The informative line of a ``torch.load`` error: the one naming the refused global or
    opcode when there is one (torch puts advice first), else the first line; at most 200
    characters, without terminal colour codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
    lines = [line for line in lines if line]
    detail = next((line for line in lines if "global" in line.lower() or "unsupported" in line.lower()),
                  lines[0] if lines else "no message")
    return detail[:200]


class WeightsOnlyCheckpointEngine:
    """DeepSpeed's checkpoint engine, loading with ``torch.load(weights_only=True)``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load(path, weights_only=True)``; a file that does not load is one line naming it.

        Caught by exception type, not by message: torch words its refusals differently across
        versions and cases ("Unsupported global: GLOBAL x", "unsupported GLOBAL posix.system whose
        module posix is blocked", "Unsupported operand 103"); the message only picks the wording.
        """
        with torch.serialization.safe_globals(safe_deepspeed_globals()):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except torch.OutOfMemoryError:
                raise  # a real out-of-memory (a RuntimeError too), not a bad file
            except (UnpicklingError, *_UNREADABLE) as err:
                detail = _load_error_detail(err)
                if isinstance(err, UnpicklingError) and "global" in detail.lower():  # a refused object
                    raise UserError(f"{path} holds objects dschat does not unpickle ({detail}); resume only "
                                    "from checkpoints dschat wrote") from None
                raise UserError(f"cannot read {path} ({type(err).__name__}: {detail}); the checkpoint is "
                                "damaged or was not written by dschat: pass --resume_from with another one") from None


class RecordingCheckpointEngine:
    """DeepSpeed's checkpoint engine, noting the path of every file this rank saves (so that the rank
    can look for them after the commit). Its torch engine's files are written through a Python file:
    ``torch.save`` to a path loses the errno of a full disk (a RuntimeError from its C++ writer)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.saved: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def save(self, state_dict: Any, path: str) -> Any:
        self.saved.append(str(path))
        if not isinstance(self._inner, TorchCheckpointEngine):
            return self._inner.save(state_dict, path)
        with open(path, "wb") as handle:
            return torch.save(state_dict, handle, _use_new_zipfile_serialization=self._inner.zipfile_serialization)


def _save_engine(engine: Any, folder: Path, tag: str) -> list[Path]:
    """``engine.save_checkpoint`` into ``folder``; the files this rank wrote (collective)."""
    inner = engine.checkpoint_engine
    recorder = RecordingCheckpointEngine(inner)
    engine.checkpoint_engine = recorder
    try:
        engine.save_checkpoint(str(folder), tag=tag, save_latest=False)
    finally:
        engine.checkpoint_engine = inner
    return [Path(path) for path in recorder.saved]


def save_checkpoint(root: Path, engines: Mapping[str, Any], position: TrainingPosition, *, keep: int,
                    rank: int, meta: Mapping[str, Any] | None = None,
                    weights_only: Mapping[str, Any] | None = None, loaders: Sequence[Any] = (),
                    protect: tuple[Path, ...] = (), resumed_from: Path | None = None) -> Path:
    """Write a checkpoint of ``engines`` (full DeepSpeed state; consolidated, with the training ``loaders``'
    order) and ``weights_only`` (parameters) at ``position`` (collective: every rank calls it).

    Rank 0 creates the temporary folder; every rank checks it sees that folder before writing
    into it, fsyncs the files it wrote, and checks that they are in the folder rank 0 renamed into
    place before rank 0 marks the checkpoint complete. A rank that cannot stops every rank (one
    line, exit 2) and the checkpoint is left incomplete; so does a ``step_<N>`` of that step that
    dschat did not begin (it is never replaced). A previous ``step_<N>`` of the same step is
    renamed aside before the new one is renamed in and deleted once the new one is complete; on a
    failure before that it is put back. Once the marker and the folder are fsync'd, rotation keeps
    the ``keep`` last written checkpoints, never the one just written nor those in ``protect``
    (the ``--resume_from`` source) (:mod:`dschat.training.rotation`). Neither those in ``protect``
    nor ``resumed_from`` (the checkpoint the run resumed from, by either flag) is ever replaced: a
    save of their step stops every rank with one line before anything is written.
    """
    name = checkpoint_name(position.optimizer_steps)
    final = root / name
    tmp = root / f"{TMP_PREFIX}{name}"
    never_replaced = (*protect, resumed_from)
    refuse_foreign_root(root)  # planted since start-up
    refuse_unless_all(not (rank == 0 and replaces_protected(final, never_replaced)), protected_problem(final),
                      PROTECTED_FIX)
    refuse_unless_all(not (rank == 0 and os.path.lexists(tmp) and not left_by_dschat(tmp)), f"would replace {tmp}, "
                      "which dschat did not write", f"move it out of {root}, then continue with --resume")
    if rank == 0:
        if os.path.lexists(tmp):  # a stopped save of this step (left_by_dschat): renamed to a name start-up
            doomed = root / f"{PRUNED_PREFIX}{tmp.name}-{secrets.token_hex(4)}"  # prunes, then deleted
            os.replace(tmp, doomed)  # a kill while deleting leaves dschat's own leftover, never a tagless .tmp-step
            shutil.rmtree(doomed)
        tmp.mkdir(parents=True)
        (tmp / WRITING_TAG).write_text("a checkpoint dschat is writing; complete once it holds "
                                       f"{MARKER}\n", encoding="utf-8")
        fsync_path(tmp / WRITING_TAG)
        fsync_path(tmp)  # the tag's entry: a renamed-in step_<N> without it would pass for another tool's
    refuse_unless_shared(tmp, rank, "the new checkpoint folder")
    written: list[Path] = []
    for tag, engine in engines.items():
        written += _save_engine(engine, tmp, tag)
    for tag, engine in (weights_only or {}).items():
        save_weights(engine, tmp / f"{tag}.safetensors", rank)
        if rank == 0:
            written.append(tmp / f"{tag}.safetensors")
    written += save_consolidated(tmp, engines, rank, loaders)
    rng_file = tmp / f"rng_rank{rank}.json"
    rng_file.write_text(json.dumps(rng_state()), encoding="utf-8")
    written.append(rng_file)
    for path in written:  # each rank its own files, before rank 0 renames the folder
        fsync_path(path)
    refuse_unless_all(not (rank == 0 and is_foreign(final)), f"would replace {final}, which dschat did not write "
                      f"(no {MARKER}, no {WRITING_TAG})", f"move it out of {root}, then continue with --resume")
    aside = None
    if rank == 0:
        try:
            aside = set_aside(final, never_replaced)  # the same step saved again (e.g. after a resume)
            os.replace(tmp, final)
        except BaseException:
            put_back(final, aside, tmp)
            raise
    barrier()
    # Each rank looks for its own files where rank 0 committed them, as its own node sees that folder.
    seen = all((final / path.relative_to(tmp)).is_file() for path in written if path.is_relative_to(tmp))
    try:
        refuse_unless_all(seen, f"cannot see the files it wrote for the checkpoint in {final} after rank 0 "
                                "renamed the folder they were written in")
        if rank == 0:
            record = {"format": FORMAT_VERSION, "position": asdict(position), "engines": sorted(engines),
                      "weights_only": sorted(weights_only or {}), "meta": dict(meta or {}),
                      "trainable": {tag: trainable_parameters(engine) for tag, engine in engines.items()},
                      "sequence": next_sequence(root)}
            fsync_tree(final)
            with atomic_file(final / MARKER) as marker:
                marker.write_text(json.dumps(record, indent=2), encoding="utf-8")
            fsync_path(root)
    except BaseException:
        if rank == 0:  # never complete: back under its temporary name (pruned at the next start)
            put_back(final, aside, tmp)
        raise
    if rank == 0:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        prune_rotated(root, keep, [final, *protect])
        print_rank_0(f"[checkpoint] saved {final}", rank)
    barrier()
    return final


def load_checkpoint(folder: Path, engines: Mapping[str, Any], rank: int, weights_only: Mapping[str, Any] | None = None,
                    loaders: Sequence[Any] = (), models: Mapping[str, Any] | None = None,
                    step: str | None = None) -> TrainingPosition:
    """Restore ``engines``, ``weights_only`` and this rank's random states from ``folder``; return the
    position (on another shape: :func:`dschat.training.consolidated.resume_on_new_shape`). A damaged or
    edited marker or random-state file is one line (exit 2), and so are a checkpoint another ``step``
    wrote or with another optimizer offload (:func:`check_written_like`), other models than it holds
    (a critic, an EMA actor) and a run that started from other ``models`` (:func:`check_models`)."""
    record = read_record(folder)
    check_written_like(folder, record, engines, step)
    position = TrainingPosition(**record["position"])
    held = sorted({*record.get("engines", []), *record.get("weights_only", [])})
    if held != (wanted := sorted({*engines, *(weights_only or {})})):
        raise UserError(f"{folder} holds {', '.join(held) or 'no model'} and this run trains {', '.join(wanted)}: "
                        "it was written by another step, or with other flags (a critic, --enable_ema); resume with "
                        "the flags that wrote it")
    check_trainable(folder, record, engines)
    check_models(folder, record, models or {}, rank)
    rng_file = folder / f"rng_rank{rank}.json"
    rng = read_rng_file(rng_file) if rng_file.is_file() else None
    reshape = resume_on_new_shape(folder, engines, rank, position, loaders)  # None: DeepSpeed's files fit
    if rng is None:
        if reshape is None:
            raise UserError(f"{folder} has no random state for rank {rank}: it was written with another number of "
                            "ranks; resume with the same world size")
        rng = derived_rng_state(folder, rank)
    for tag, engine in engines.items() if reshape is None else ():
        unsafe = engine.checkpoint_engine
        engine.checkpoint_engine = WeightsOnlyCheckpointEngine(unsafe)
        try:
            path, _ = engine.load_checkpoint(str(folder), tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
        finally:
            engine.checkpoint_engine = unsafe
        if path is None:
            raise UserError(f"could not load the '{tag}' state from {folder}; the checkpoint is damaged, "
                            "pass --resume_from with an older one")
    for tag, engine in (weights_only or {}).items():
        load_weights(engine, folder / f"{tag}.safetensors", rank)
    set_rng_state(rng)
    print_rank_0(f"[checkpoint] resumed from {folder} (epoch {position.epoch}, {position.optimizer_steps} "
                 f"{'PPO' if 'actor' in engines else 'optimizer'} steps done)", rank)  # step 3: PPO iterations
    return position


def agree_on_resume(folder: Path | None) -> None:
    """The ranks compare the checkpoint each would resume from (``None``: none) before any of them
    loads anything; a difference stops every rank with one line (collective)."""
    steps = _steps_of(folder) if folder is not None and (folder / MARKER).is_file() else None
    seen = [row[0] for row in gather_ints([-1 if steps is None else steps])]
    if len(set(seen)) == 1:
        return
    hosts = gather_hosts()
    views = ", ".join(f"rank {r} on host {hosts[r]}: {'none' if step < 0 else checkpoint_name(step)}"
                      for r, step in enumerate(seen))
    raise UserError(f"the ranks would resume from different checkpoints ({views}); {SHARED_OUTPUT_FIX}")


class Checkpointer:
    """What a step script needs: ``resume()`` once after the engines exist, ``maybe_save()`` after
    every optimizer step."""

    def __init__(self, args: CheckpointSettings, engines: Mapping[str, Any], rank: int,
                 weights_only: Mapping[str, Any] | None = None, loaders: Sequence[Any] = (),
                 models: Mapping[str, tuple[str, str | None]] | None = None, step: str | None = None) -> None:
        self.args = args
        self.step = step  # the step writing and resuming (STEP_NAMES): recorded, and checked on resume
        self.engines = dict(engines)
        self.weights_only, self.loaders = dict(weights_only or {}), list(loaders)  # loaders: the data order to record
        self.rank = rank
        self.interval = int(getattr(args, "save_interval", 0) or 0)
        self.keep = int(getattr(args, "keep_checkpoints", 2))
        self.root = checkpoint_root(args.output_dir) if args.output_dir else None
        self.position: TrainingPosition | None = None  # where a resumed run picks up
        self.source: Path | None = None  # the --resume_from checkpoint: rotation never deletes it
        self.resumed: Path | None = None  # the checkpoint loaded (either flag): never replaced
        self._models = dict(models or {})  # role -> (flag, value); their record (rank 0) taken at start-up
        self._model_record = model_record(self._models) if rank == 0 and wants_checkpoints(args) else None

    def resume(self, counter: Any = None) -> TrainingPosition | None:
        """Load the checkpoint ``--resume`` / ``--resume_from`` name (if any) into the engines and the
        random generators; set ``counter.micro_steps`` (on this run's ``--gradient_accumulation_steps``:
        :func:`~dschat.training.consolidated.convert_micro_steps`). None when starting from scratch."""
        self.position = self._load()
        if self.position is not None and counter is not None:
            counter.micro_steps = self.position.micro_steps
        return self.position

    def first_epoch(self) -> int:
        return self.position.epoch if self.position else 0

    def batches_done(self, epoch: int) -> int:
        """Micro-batches of ``epoch`` trained before the checkpoint (skip them)."""
        return self.position.epoch_micro_steps if self.position and epoch == self.position.epoch else 0

    def _load(self) -> TrainingPosition | None:
        source = getattr(self.args, "resume_from", None)
        if source:
            folder: Path | None = Path(source)
        elif getattr(self.args, "resume", False):
            folder = latest_checkpoint(self.root, self.rank, strict=True) if self.root else None
        else:
            return None
        agree_on_resume(folder)
        if folder is None:
            print_rank_0(f"[checkpoint] --resume: no complete checkpoint under {self.root}; starting from "
                         "the beginning", self.rank)
            return None
        self.source = folder if source else None  # --resume's source rotates out as usual, by write order
        position = load_checkpoint(folder, self.engines, self.rank, self.weights_only, self.loaders, self.models(),
                                   self.step)
        self.resumed = folder
        return position

    def models(self) -> dict[str, Any]:
        """The record of the models this run starts from (:func:`~dschat.training.checkpoint_records.model_record`),
        on rank 0 (which writes and checks it; {} on the others), taken once."""
        if self._model_record is None:
            self._model_record = model_record(self._models) if self.rank == 0 else {}
        return self._model_record

    def latest(self) -> Path | None:
        """The newest complete checkpoint of this run's ``--output_dir`` (None without one)."""
        return latest_checkpoint(self.root, self.rank) if self.root else None

    def due(self, optimizer_steps: int) -> bool:
        return self.root is not None and self.interval > 0 and optimizer_steps % self.interval == 0

    def maybe_save(self, position: TrainingPosition) -> Path | None:
        return self.save(position) if self.due(position.optimizer_steps) else None

    def save(self, position: TrainingPosition) -> Path:
        """The checkpoint at ``position``, due or not (step 3's postponed one). Collective. A full disk
        is one line (the earlier checkpoints are as they were)."""
        check_weights_finite(self.engines, position.optimizer_steps, self.latest)  # else good ones rotate out
        kept = (f"the earlier checkpoints in {self.root} are unchanged, and a save needs room for one more than "
                "--keep_checkpoints: the oldest goes once the new one is complete")
        with _disk_full_is_a_user_error(self.root / checkpoint_name(position.optimizer_steps), kept=kept):
            return save_checkpoint(self.root, self.engines, position, keep=self.keep, rank=self.rank,
                                   weights_only=self.weights_only, loaders=self.loaders,
                                   protect=(self.source,) if self.source is not None else (),
                                   resumed_from=self.resumed,
                                   meta={"models": self.models(), **({"step": self.step} if self.step else {}),
                                         "offload": {tag: bool(engine.zero_use_cpu_optimizer())
                                                     for tag, engine in self.engines.items()}})


def refuse_past_the_end(checkpointer: Checkpointer, num_batches: int, num_train_epochs: int,
                        counted: tuple[int, int, str] = (0, 0, "")) -> None:
    """One :class:`UserError` line when the checkpoint ``checkpointer`` resumed from is past this run's end:
    more epochs done (its epoch plus its batches of ``num_batches``) than ``num_train_epochs``, or a count
    ``counted`` = (done, limit, what) past its limit when that is set (> 0), e.g. optimizer steps past
    ``--max_train_steps``: resuming would train nothing and save that longer-trained model as this run's.
    At the end exactly (a run killed in its final save) is fine: only the final save is left."""
    done, limit, what = counted
    epoch = checkpointer.first_epoch()
    epochs = epoch + checkpointer.batches_done(epoch) / max(1, num_batches)
    if limit > 0 and done > limit:
        past = f"{done} {what} {limit}"
    elif epochs > num_train_epochs:
        past = f"{epochs:.3g} epochs done, past --num_train_epochs {num_train_epochs}"
    else:
        return
    raise UserError(f"the checkpoint resumed from has {past}: this run would train nothing and save that "
                    "longer-trained model as its own; --resume_from an earlier <output_dir>/checkpoints/step_<N>, "
                    "or raise the limit")


def check_checkpoint_args(args: Any) -> None:
    """Flag contradictions, before anything loads."""
    if getattr(args, "save_interval", 0) < 0:
        raise UserError("--save_interval must be >= 0 (0: no checkpoints)")
    if getattr(args, "keep_checkpoints", 1) < 1:
        raise UserError("--keep_checkpoints must be >= 1")
    if getattr(args, "max_nonfinite_steps", 0) < 0:
        raise UserError(f"--max_nonfinite_steps must be >= 0 (0: never stop), got {args.max_nonfinite_steps}")
    wants = getattr(args, "save_interval", 0) > 0 or getattr(args, "resume", False)
    if wants and not args.output_dir:
        raise UserError("--save_interval and --resume need --output_dir (checkpoints live in <output_dir>/checkpoints)")
    source = getattr(args, "resume_from", None)
    if getattr(args, "resume", False) and source:
        raise UserError("pass either --resume (the newest checkpoint in --output_dir) or --resume_from DIR, not both")
    # Before start-up: the launcher's rank (MPI launchers set no RANK yet). The other ranks' views are
    # compared after start-up.
    first = get_rank() == 0
    if args.output_dir and first:  # one process renames; one run per folder: its lock, held while args lives
        for notice in recover_output_dir(args.output_dir, run=args):
            print(f"[checkpoint] {notice}", flush=True)
    if source and first and not (Path(source) / MARKER).is_file():
        raise UserError(f"--resume_from {source}: not a complete dschat checkpoint (no {MARKER}); pick a "
                        "folder <output_dir>/checkpoints/step_<N> (such as step_00000050), or --resume for the newest "
                        "one")
    if source and first:
        read_record(Path(source))  # a damaged or edited marker: one line now, not after the models load
