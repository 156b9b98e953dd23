"""dschat's consolidated training state: what a checkpoint needs to resume on another shape
(another number of ranks, another ZeRO stage).

DeepSpeed's own checkpoint files are partitioned by rank and laid out by ZeRO stage, so
``engine.load_checkpoint`` needs the world size and ZeRO stage that wrote them. Beside them every
checkpoint holds, in ``consolidated/``, each trained engine's state gathered by parameter name:

* ``<tag>.fp32.safetensors``, ``<tag>.exp_avg.safetensors``, ``<tag>.exp_avg_sq.safetensors``: for
  every trainable parameter (its full shape) the fp32 master value and Adam's two moments, gathered
  with DeepSpeed's ``safe_get_full_*`` functions (ZeRO 1-3, the bf16 optimizer) or read from the
  plain torch optimizer (ZeRO-0 in fp32). No pickles.
* ``state.json``: the world size, and for each engine its ZeRO stage, dtype (also when the engine is
  not covered), gradient accumulation,
  each parameter's Adam step count, the parameter groups (names and learning rate), the LR
  scheduler's state and DeepSpeed's step counters; and the training data's order parameters
  (world size, per-rank batch size, dataset size, seed, drop_last) of each training loader.

:func:`save_consolidated` writes them (collective). On resume :func:`reshape_of` compares the
checkpoint with this run: the same world size and the same ZeRO stage and dtype of every engine load
through DeepSpeed's native checkpoint (whose file names and records depend on all three); anything
else (``--dtype bf16`` on an fp32 checkpoint, say) loads the consolidated state
(:func:`load_consolidated`, collective) into the engines: weights (module and fp32 master), both
moments, the step counts, the learning rates, the scheduler, DeepSpeed's counters. The data
position is converted by :func:`convert_batches_done`, on either path; so is the micro-step count
(:func:`convert_micro_steps`: another ``--gradient_accumulation_steps`` keeps the optimizer steps
done); random states by :func:`derived_rng_state`. A setup the consolidated state does not cover
(fp16 loss scaling, ZeRO offload, an optimizer other than Adam(W), a checkpoint written without
this folder) is one line naming what to resume with.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import deepspeed
import numpy as np
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from safetensors.torch import load_file, save_file

from dschat.errors import UserError
from dschat.runtime.dist import get_world_size, print_rank_0
from dschat.runtime.fs import atomic_file
from dschat.runtime.zero3 import is_zero3_param, release_zero3_prefetch

FOLDER = "consolidated"
STATE = "state.json"
FORMAT_VERSION = 1
KINDS = ("fp32", "exp_avg", "exp_avg_sq")  # one safetensors file per kind and engine
ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam)


# ------------------------------------------------------------------------------------------------
# Where an engine keeps a parameter's fp32 master and Adam state
# ------------------------------------------------------------------------------------------------
def _base_optimizer(engine: Any) -> Any:
    wrapper = engine.optimizer
    if isinstance(wrapper, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer)):
        return wrapper.optimizer
    return wrapper


def unsupported_reason(engine: Any) -> str | None:
    """Why the consolidated state cannot describe ``engine`` (None: it can)."""
    wrapper, base = engine.optimizer, _base_optimizer(engine)
    if engine.fp16_enabled():
        return "fp16 runs keep a loss scale the consolidated state does not hold"
    offload_param = engine.zero_offload_param()
    if engine.zero_use_cpu_optimizer() or (offload_param is not None and offload_param.device != "none"):
        return "ZeRO offload (--offload, --offload_reference_model) is not covered by the consolidated state"
    if not isinstance(base, ADAM_TYPES) or any(group.get("amsgrad") for group in base.param_groups):
        return f"the optimizer is {type(base).__name__}, not Adam(W)"
    if not isinstance(wrapper, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer)) and \
            any(p.dtype != torch.float32 for group in base.param_groups for p in group["params"]):
        return f"its optimizer {type(wrapper).__name__} keeps no fp32 master the consolidated state can read"
    return None


def engine_dtype(engine: Any) -> str:
    """The dtype ``engine`` trains in, as ``state.json`` records it: ``fp16``, ``bf16`` or ``fp32``."""
    if engine.fp16_enabled():
        return "fp16"
    return "bf16" if engine.bfloat16_enabled() else "fp32"


def _flat_of(engine: Any) -> dict[int, tuple[torch.Tensor, int]]:
    """id(trainable parameter) -> (the tensor the base optimizer keys its state by, the index of its
    parameter group): the flat fp32 partition under ZeRO and the bf16 optimizer, the parameter itself
    in plain torch."""
    wrapper = engine.optimizer
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        return {id(p): (wrapper.single_partition_of_fp32_groups[i], i)
                for i, group in enumerate(wrapper.bit16_groups) for p in group}
    if isinstance(wrapper, BF16_Optimizer):
        return {id(p): (wrapper.fp32_groups_flat_partition[i], i)
                for i, group in enumerate(wrapper.bf16_groups) for p in group}
    if isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
        sub_group = {id(p): wrapper.grad_position[wrapper.get_param_id(p)][0] for p in trainable}
        return {key: (wrapper.fp32_partitioned_groups_flat[i], wrapper.sub_group_to_group_id[i])
                for key, i in sub_group.items()}
    group_of = {id(p): i for i, group in enumerate(wrapper.param_groups) for p in group["params"]}
    return {id(p): (p, group_of[id(p)]) for p in trainable}


def trainable_named(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def _full_shape(param: torch.Tensor) -> list[int]:
    return list(getattr(param, "ds_shape", param.shape))


def _plain(engine: Any) -> bool:
    """ZeRO-0 in fp32: the torch optimizer steps the parameters themselves."""
    return not isinstance(engine.optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer))


def _gather(engine: Any, kind: str, has_state: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Each trainable parameter's full fp32 ``kind`` (``fp32``: the master value), in name order
    (collective under ZeRO 1-3: every rank calls it, in the same order)."""
    base = _base_optimizer(engine)
    for name, param in trainable_named(engine):
        if kind != "fp32" and not has_state:  # no optimizer step has run yet
            value = torch.zeros(_full_shape(param), dtype=torch.float32)
        elif _plain(engine):
            value = param.detach() if kind == "fp32" else base.state[param][kind]
        elif kind == "fp32":
            value = safe_get_full_fp32_param(param)
        else:
            value = safe_get_full_optimizer_state(param, kind)
        yield name, value.detach().to("cpu", torch.float32).reshape(_full_shape(param))


def _has_state(engine: Any) -> bool:
    """Whether Adam's state exists (an optimizer step has run); if so, every parameter's view of it is
    linked again: ZeRO 1-2 link after stepping their first group, when the other groups have no state
    yet, and never again, so DeepSpeed's ``safe_get_full_optimizer_state`` would miss those groups."""
    base = _base_optimizer(engine)
    flats = _flat_of(engine).values()
    has = all("exp_avg" in base.state.get(flat, {}) for flat, _ in flats)
    if has:
        _link_states(engine)
    return has


def _link_states(engine: Any) -> None:
    if isinstance(engine.optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()


def _engine_record(engine: Any) -> dict[str, Any]:
    """The JSON part of one engine's consolidated state (every rank computes the same)."""
    base = _base_optimizer(engine)
    flats = _flat_of(engine)
    names = trainable_named(engine)
    groups: list[dict[str, Any]] = [{"lr": float(g["lr"]), "names": []} for g in base.param_groups]
    steps = {}
    for name, param in names:
        flat, group = flats[id(param)]
        groups[group]["names"].append(name)
        steps[name] = int(float(base.state.get(flat, {}).get("step", 0)))
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return {
        "zero_stage": int(engine.zero_optimization_stage()),
        "dtype": engine_dtype(engine),
        "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
        "parameters": [f"{name} {_full_shape(p)}" for name, p in names],
        "param_groups": groups,
        "steps": steps,
        "scheduler": json.loads(json.dumps(scheduler)) if scheduler is not None else None,
        "counters": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                     "skipped_steps": int(engine.skipped_steps)},
    }


# ------------------------------------------------------------------------------------------------
# The data order of a training loader
# ------------------------------------------------------------------------------------------------
def loader_order(loader: Any) -> dict[str, Any]:
    """What fixes a training loader's order (``make_train_loader``: a seeded ``DistributedSampler``,
    a function of (seed, epoch, rank))."""
    sampler = loader.sampler
    digest = getattr(loader.dataset, "digest", None)  # a PromptDataset's rows (PPO-ptx data has none)
    return {"world_size": int(getattr(sampler, "num_replicas", 1)), "batch_size": int(loader.batch_size),
            "dataset_size": len(loader.dataset), "drop_last": bool(loader.drop_last),
            "sampler_drop_last": bool(getattr(sampler, "drop_last", False)),
            "shuffle": bool(getattr(sampler, "shuffle", False)), "seed": int(getattr(sampler, "seed", 0)),
            "rows_sha256": digest() if callable(digest) else None}


def _batches_per_epoch(order: Mapping[str, Any]) -> int:
    size, world = order["dataset_size"], order["world_size"]
    per_rank = size // world if order["sampler_drop_last"] else math.ceil(size / world)
    return per_rank // order["batch_size"] if order["drop_last"] else math.ceil(per_rank / order["batch_size"])


def convert_batches_done(done: int, saved: Sequence[Mapping[str, Any]], now: Sequence[Mapping[str, Any]]) -> int:
    """The batches of the epoch in progress to skip on this run's shape after ``done`` batches on the
    saved one, for loaders that advance together (step 3: prompts and PPO-ptx data).

    ``DistributedSampler`` permutes the epoch's indices by (seed, epoch) alone, pads them to a
    multiple of the world size W and deals index ``i`` to rank ``i mod W``: ``k`` batches of ``b``
    on every rank are the permutation's first ``k*b*W`` entries. On W' ranks with batches of b'
    the rest of the epoch starts after ``k*b*W / (b'*W')`` batches; an epoch finished on the saved
    shape is finished on this one. Anything else (another dataset size, seed or shuffle, a
    position that is not a whole number of batches here) raises a one-line :class:`UserError`.
    """
    if len(saved) != len(now):
        raise UserError(f"the checkpoint recorded {len(saved)} training data loader(s), this run has {len(now)}; "
                        "resume with the flags that wrote it")
    skips = set()
    for old, new in zip(saved, now):
        for key in ("dataset_size", "seed", "shuffle"):
            if old[key] != new[key]:
                raise UserError(f"the training data's {key} is {new[key]} here but was {old[key]} when the "
                                "checkpoint was written; resume with the same data and --seed")
        if done >= _batches_per_epoch(old):
            skips.add(_batches_per_epoch(new))  # the epoch is over on either shape
            continue
        if old.get("rows_sha256") and new.get("rows_sha256") and old["rows_sha256"] != new["rows_sha256"]:
            raise UserError("the training data has as many rows as when the checkpoint was written but not the same "
                            "ones (another --data_path order, an edited data file, another tokenizer or length): the "
                            "rows the checkpoint skips as trained would not be; resume with the data it was written "
                            "with, or start afresh without --resume")
        samples = done * old["batch_size"] * old["world_size"]
        step = new["batch_size"] * new["world_size"]
        if samples % step:
            raise UserError(
                f"the checkpoint is {done} batches of {old['batch_size']} into its epoch on {old['world_size']} "
                f"rank(s) ({samples} samples), not a whole number of batches of {new['batch_size']} on "
                f"{new['world_size']} rank(s); resume on a number of ranks (or a per-device batch size) that "
                f"divides {samples} samples, or from a checkpoint at the end of an epoch")
        skips.add(samples // step)
    if len(skips) > 1:
        raise UserError(f"the training loaders would skip different numbers of batches ({sorted(skips)}) on this "
                        "shape; keep the per-device batch sizes' ratio of the run that wrote the checkpoint")
    return skips.pop() if skips else done


# ------------------------------------------------------------------------------------------------
# Saving (collective)
# ------------------------------------------------------------------------------------------------
def write_engine_state(engine: Any, out: Path, tag: str, rank: int) -> dict[str, Any]:
    """Gather ``engine``'s fp32 masters and Adam moments into ``out/<tag>.<kind>.safetensors`` (rank 0
    writes them; one kind of tensor at a time is held) and return its JSON record, or
    ``{"unsupported": reason}`` and no files (collective: every rank calls it)."""
    reason = unsupported_reason(engine)
    if reason is not None:
        return {"unsupported": reason, "zero_stage": int(engine.zero_optimization_stage()),
                "dtype": engine_dtype(engine)}
    release_zero3_prefetch(engine)
    has_state = _has_state(engine)
    for kind in KINDS:
        tensors = {name: value.clone().contiguous() for name, value in _gather(engine, kind, has_state)}
        if rank == 0:
            save_file(tensors, str(out / f"{tag}.{kind}.safetensors"))
        del tensors
    return _engine_record(engine)


def save_consolidated(folder: Path, engines: Mapping[str, Any], rank: int,
                      loaders: Sequence[Any] = ()) -> list[Path]:
    """Write ``folder/consolidated/`` for ``engines`` and the order of the training ``loaders``
    (collective: every rank calls it); the files rank 0 wrote (the other ranks write none)."""
    out = folder / FOLDER
    if rank == 0:
        out.mkdir(exist_ok=True)
    record: dict[str, Any] = {"format": FORMAT_VERSION, "world_size": get_world_size(),
                              "data": [loader_order(loader) for loader in loaders], "engines": {}}
    for tag, engine in engines.items():
        record["engines"][tag] = write_engine_state(engine, out, tag, rank)
    if rank != 0:
        return []
    with atomic_file(out / STATE) as path:
        path.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return sorted(out.iterdir())


# ------------------------------------------------------------------------------------------------
# Resuming on another shape
# ------------------------------------------------------------------------------------------------
class Reshape:
    """A checkpoint written on another shape than this run's, and how to load it."""

    def __init__(self, folder: Path, record: Mapping[str, Any]) -> None:
        self.folder = folder
        self.record = record

    def describe(self, engines: Mapping[str, Any]) -> str:
        """``saved on W rank(s) (<tag> ZeRO s, ...), resumed on W' rank(s) (...)``; each engine's dtype
        too when any differs."""
        saved = self.record["engines"]
        dtypes = not all(_same_dtype(saved.get(tag, {}), engine) for tag, engine in engines.items())
        was = ", ".join(f"{tag} ZeRO {rec['zero_stage']}" + (f" {rec.get('dtype', '?')}" if dtypes else "")
                        for tag, rec in saved.items())
        now = ", ".join(f"{tag} ZeRO {engine.zero_optimization_stage()}"
                        + (f" {engine_dtype(engine)}" if dtypes else "") for tag, engine in engines.items())
        return (f"saved on {self.record['world_size']} rank(s) ({was}), resumed on {get_world_size()} rank(s) "
                f"({now})")


def _read_record(folder: Path) -> dict[str, Any] | None:
    path = folder / FOLDER / STATE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path} ({type(err).__name__}); the checkpoint is damaged: pass "
                        "--resume_from with another one") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
        raise UserError(f"{path} was written by another dschat checkpoint format; resume with the dschat version "
                        "that wrote it")
    return record


def _same_dtype(saved: Mapping[str, Any], engine: Any) -> bool:
    """Whether ``engine`` trains in the dtype a checkpoint's engine record names; True for a record
    without one (an unsupported engine's record of a dschat that did not write it)."""
    return not isinstance(saved.get("dtype"), str) or saved["dtype"] == engine_dtype(engine)


def _shape_hint(record: Mapping[str, Any], saved: Mapping[str, Any] | None) -> str:
    """What to resume with to load DeepSpeed's own files: ``N rank(s), ZeRO stage S and --dtype D``."""
    stage = saved["zero_stage"] if saved else "?"
    dtype = f" and --dtype {saved['dtype']}" if saved and isinstance(saved.get("dtype"), str) else ""
    return f"{record['world_size']} rank(s), ZeRO stage {stage}{dtype}"


def reshape_of(folder: Path, engines: Mapping[str, Any]) -> Reshape | None:
    """None when ``folder`` was written with this run's world size and every engine's ZeRO stage and
    dtype (load DeepSpeed's own checkpoint); else how to load it here. A shape the checkpoint cannot
    be loaded on is one line (:class:`UserError`)."""
    world = get_world_size()
    record = _read_record(folder)
    if record is None:
        saved_world = len(list(folder.glob("rng_rank*.json")))
        if saved_world and saved_world != world:
            raise UserError(f"{folder} was written on {saved_world} rank(s) without dschat's consolidated state, so it "
                            f"loads only on the same shape; resume with {saved_world} rank(s) and the ZeRO stage that "
                            "wrote it")
        return None
    same = record["world_size"] == world and all(
        tag in record["engines"] and record["engines"][tag]["zero_stage"] == engine.zero_optimization_stage()
        and _same_dtype(record["engines"][tag], engine)
        for tag, engine in engines.items())
    if same:
        return None
    for tag in engines:
        saved = record["engines"].get(tag)
        if saved is None or "unsupported" in saved:
            why = "it holds no consolidated state for it" if saved is None else saved["unsupported"]
            raise UserError(f"{folder} cannot resume '{tag}' on another shape: {why}; resume with "
                            f"{_shape_hint(record, saved)}")
        reason = unsupported_reason(engines[tag])
        if reason is not None:
            raise UserError(f"this run cannot load '{tag}' from {folder} on another shape: {reason}; resume with "
                            f"{_shape_hint(record, saved)}")
    return Reshape(folder, record)


def _step_value(base: Any, flat: torch.Tensor, group_index: int, step: int) -> Any:
    """``step`` as ``base`` keeps it: a float32 tensor for torch's Adam(W) (on the parameter's device
    when fused or capturable), an int for DeepSpeed's FusedAdam and DeepSpeedCPUAdam."""
    if isinstance(base, (torch.optim.Adam, torch.optim.AdamW)):
        group = base.param_groups[group_index]
        device = flat.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
        return torch.tensor(float(step), dtype=torch.float32, device=device)
    return int(step)


def _load_tensors(folder: Path, tag: str, kind: str, names: list[str]) -> dict[str, torch.Tensor]:
    path = folder / FOLDER / f"{tag}.{kind}.safetensors"
    try:
        tensors = load_file(str(path))
    except (OSError, RuntimeError, ValueError) as err:  # missing, truncated or not safetensors
        raise UserError(f"cannot read {path} ({type(err).__name__}); the checkpoint is damaged: pass "
                        "--resume_from with another one") from None
    if sorted(tensors) != sorted(names):
        raise UserError(f"{path} does not hold this run's trainable parameters; resume with the flags that wrote it")
    return tensors


def load_engine(folder: Path, tag: str, engine: Any, saved: Mapping[str, Any], rank: int) -> None:
    """Load one engine's consolidated state (collective under ZeRO-3: the module's weights are set
    through a gather; ZeRO 1-2 and the bf16 optimizer set their master partitions locally)."""
    named = trainable_named(engine)
    now = [f"{name} {_full_shape(p)}" for name, p in named]
    if now != saved["parameters"]:
        raise UserError(f"{folder}: '{tag}' trained other parameters than this run does; the flags that choose "
                        "what trains (--freeze_layers, LoRA flags) differ: resume with the ones that wrote it")
    base, flats = _base_optimizer(engine), _flat_of(engine)
    groups_now = [[] for _ in base.param_groups]
    for name, param in named:
        groups_now[flats[id(param)][1]].append(name)
    if groups_now != [g["names"] for g in saved["param_groups"]]:
        raise UserError(f"{folder}: '{tag}''s optimizer parameter groups differ from this run's (weight decay, "
                        "--actor_lora_learning_rate ...); resume with the flags that wrote it")
    names = [name for name, _ in named]
    master = _load_tensors(folder, tag, "fp32", names)
    release_zero3_prefetch(engine)
    device = engine.device
    for name, param in named:  # the module's weights: the master value in the module's dtype
        zero3 = is_zero3_param(param)
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=zero3):
            if rank == 0 or not zero3:
                with torch.no_grad():
                    param.copy_(master[name].to(param.device, param.dtype).reshape(param.shape))
    if not _plain(engine):
        for name, param in named:
            safe_set_full_fp32_param(param, master[name].to(device))
    del master
    for name, param in named:  # Adam's state, made where no step has run, and its step count
        flat, group = flats[id(param)]
        state = base.state[flat]
        state["step"] = _step_value(base, flat, group, saved["steps"][name])
        for kind in KINDS[1:]:
            if kind not in state:
                state[kind] = torch.zeros_like(flat, memory_format=torch.preserve_format)
    _link_states(engine)  # point each parameter at the state made above
    for kind in KINDS[1:]:
        values = _load_tensors(folder, tag, kind, names)
        for name, param in named:
            if _plain(engine):
                base.state[param][kind].copy_(values[name].reshape(param.shape))
            else:
                safe_set_full_optimizer_state(param, values[name].to(device), kind)
    for group, saved_group in zip(base.param_groups, saved["param_groups"]):
        group["lr"] = saved_group["lr"]
    if engine.lr_scheduler is not None and saved["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["scheduler"])
    counters = saved["counters"]
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]


def convert_micro_steps(position: Any, engines: Mapping[str, Any]) -> str | None:
    """Put ``position.micro_steps`` (micro-steps in units of the accumulation that wrote it) on this
    run's ``--gradient_accumulation_steps``: the optimizer steps done times this run's accumulation.

    A checkpoint is written right after an optimizer step, so its micro-steps are a whole number of
    the old accumulation; a resumed engine's own micro-step count starts at 0 (a boundary), so the
    converted count keeps the run's step counter, its ``--max_train_steps`` and its saves on the
    same optimizer steps. A position without micro-steps (step 3's) is left as it is. Returns a
    notice when the accumulation differs, else None.
    """
    first = next(iter(engines.values()), None)
    if not position.micro_steps or first is None:
        return None
    accumulation = int(first.gradient_accumulation_steps())
    converted = position.optimizer_steps * accumulation
    if converted == position.micro_steps:
        return None
    was = position.micro_steps // position.optimizer_steps if position.optimizer_steps else "?"
    position.micro_steps = converted
    return (f"--gradient_accumulation_steps is {accumulation} here and was {was} when the checkpoint was written: "
            f"its {position.optimizer_steps} optimizer steps stay done; each one from here accumulates "
            f"{accumulation} micro-batches")


def resume_on_new_shape(folder: Path, engines: Mapping[str, Any], rank: int, position: Any,
                        loaders: Sequence[Any] = ()) -> Reshape | None:
    """When ``folder`` was written on another shape (:func:`reshape_of`), load every engine's
    consolidated state and put ``position`` (a ``TrainingPosition``, changed in place) on this run's
    shape; None, and nothing loaded, when DeepSpeed's own checkpoint fits (collective).

    The data position goes through :func:`convert_batches_done` with ``loaders`` (this run's training
    loaders); the micro-step count becomes the optimizer steps times this run's gradient accumulation
    (:func:`convert_micro_steps`). One line says the run resumed on another shape.
    On the same shape the data position and the micro-step count are checked and converted the same
    way: another dataset size, seed or shuffle, or a batch size it is not a whole number of batches
    of, is one line; another gradient accumulation is a one-line notice.
    """
    reshape = reshape_of(folder, engines)
    if reshape is None:
        saved = _read_record(folder)
        if saved and saved.get("data") and loaders and position.epoch_micro_steps:
            position.epoch_micro_steps = convert_batches_done(position.epoch_micro_steps, saved["data"],
                                                              [loader_order(x) for x in loaders])
        notice = convert_micro_steps(position, engines)
        if notice is not None:
            print_rank_0(f"[checkpoint] {notice}", rank)
        return None
    record = reshape.record
    done = position.epoch_micro_steps
    data = "the epoch in progress had no batches done"
    if done:
        if not loaders or not record.get("data"):
            raise UserError(f"{folder} is {done} batches into epoch {position.epoch} and its data order "
                            "cannot be placed on this shape; resume with the world size that wrote it")
        position.epoch_micro_steps = convert_batches_done(done, record["data"], [loader_order(x) for x in loaders])
        data = (f"{done} batches of epoch {position.epoch} done there are {position.epoch_micro_steps} on each rank "
                "here")
    for tag, engine in engines.items():
        load_engine(folder, tag, engine, record["engines"][tag], rank)
    convert_micro_steps(position, engines)
    print_rank_0(f"[checkpoint] resumed on another shape: {reshape.describe(engines)}; weights, Adam moments and "
                 f"steps, learning rates and the LR schedule from {folder / FOLDER}; {data}", rank)
    return reshape


def derived_rng_state(folder: Path, rank: int) -> dict[str, Any]:
    """The random states of a rank the checkpoint has none for (a run with more ranks than the one
    that wrote it), in the JSON form of ``rng_rank<r>.json``: Python, NumPy and torch seeded with
    SHA-256 of rank 0's saved states and ``rank``. The same checkpoint and rank always give the same
    states, and no two ranks share a stream; ranks the checkpoint has keep their own. A CUDA
    generator keeps the state the run's ``--seed`` gave it."""
    try:
        saved = (folder / "rng_rank0.json").read_bytes()
    except OSError as err:
        raise UserError(f"cannot read {folder / 'rng_rank0.json'} ({err.strerror}); the checkpoint is damaged: pass "
                        "--resume_from with another one") from None
    seed = int.from_bytes(hashlib.sha256(saved + f"/rank{rank}".encode()).digest()[:8], "little")
    version, internal, gauss = random.Random(seed).getstate()
    name, keys, pos, has_gauss, cached = np.random.RandomState(seed % 2**32).get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.Generator().manual_seed(seed).get_state().tolist()}
