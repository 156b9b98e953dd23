"""The one set of ZeRO-3 parameter predicates and gathers, and ZeRO-3's prefetch trace across step
3's passes.

ZeRO-3 replaces each parameter's data by an empty placeholder and marks it with DeepSpeed's
attributes: ``ds_id`` (partitioned by ZeRO-3 at all), ``ds_tensor`` (this rank's partition),
``ds_shape`` / ``ds_numel`` (the whole parameter's shape and size) and ``ds_status`` (whether the
whole parameter is gathered right now). Every module that has to tell a partitioned parameter from a
plain one asks here, so the attribute names are read in one place.

**The prefetch trace.** Under ZeRO-3 DeepSpeed records the order in which one pass (a forward, and
the backward after it) fetches the modules' parameters, and from the next pass on all-gathers the
parameters of the modules ahead of the one running (``stage3_prefetch_bucket_size``), overlapping the
communication with the compute. A pass that leaves the recorded order (a module the trace does not
expect, or more modules than it holds) invalidates the trace: that pass and the next fetch every
module on demand (the next one is recorded afresh), and prefetching resumes with the pass after
them. A pass begins where DeepSpeed's hook on the root module's forward resets the trace's cursor.

Step 3 alternates passes without a backward (generation, the scoring passes) with training passes.
Left to DeepSpeed, two things kept a trained engine's trace from ever covering a training pass:

* A pass without a backward recorded right after an invalidation gives a trace that ends where the
  training pass's backward begins, so every training backward invalidated it again, and the next pass
  without a backward recorded the same short trace: the actor's backward never prefetched.
* The critic's and the reward model's passes (``forward_value``) do not go through the root module's
  call, so no pass ever began for DeepSpeed: their trace was never recorded and nothing was prefetched.

:func:`zero3_pass` begins a pass the way DeepSpeed's hook does, except that a trained engine whose
trace is invalid waits for a pass with gradients to record it, so the trace it records covers the
forward and the backward and a pass without a backward follows its first part. Such a pass ends by
partitioning again what the trace kept gathered for the backward it will not run.
:func:`begin_passes_with_dschats_rule` puts those rules on a trained engine's root module, in place of
DeepSpeed's hook; :mod:`dschat.rlhf.scoring_passes` wraps each ``forward_value`` pass in
:func:`zero3_pass`. (The rollout's gather keeps the trace too: :func:`gathered_without_hooks`; a pass
inside that gather, such as a scoring pass of a model gathered whole, is no ZeRO-3 pass. An engine
whose training passes run gathered whole, ``--zero3_gather_for_training``, is ruled as a frozen one
(:func:`mark_trained_whole`): its passes through the hooks have no backward.) Everything here is a
no-op below ZeRO-3 and for plain modules.
"""
from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import deepspeed
import psutil
import torch
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from torch.utils.hooks import RemovableHandle

__all__ = [
    "is_zero3_param",
    "is_partitioned",
    "is_available",
    "is_resident",
    "any_zero3",
    "full_shape",
    "full_numel",
    "params_to_fetch",
    "gathered",
    "gathered_to_read",
    "in_zero3_gather",
    "release_zero3_prefetch",
    "gathered_parameters",
    "full_parameter_bytes",
    "free_memory_bytes",
    "fits_gathered",
    "parameter_offload",
    "zero3_offload",
    "params_offloaded",
    "whole_partitions",
    "quantized_partitions",
    "gathered_without_hooks",
    "gathered_whole",
    "mark_trained_whole",
    "trained_whole",
    "hooks_detached",
    "zero3_pass",
    "begin_passes_with_dschats_rule",
]


def is_zero3_param(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 manages ``param`` (it carries a ``ds_id``), gathered right now or not."""
    return hasattr(param, "ds_id")


def is_partitioned(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter whose partition (``ds_tensor``) exists: the EMA reads and writes it directly."""
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


def is_available(param: torch.Tensor) -> bool:
    """Gathered and complete right now (``ds_status == AVAILABLE``); False for plain tensors."""
    return getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE


def is_resident(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter whose whole data is present or on its way (``AVAILABLE`` or ``INFLIGHT``):
    anything but partitioned away."""
    return param.ds_status != ZeroParamStatus.NOT_AVAILABLE


def any_zero3(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is managed by ZeRO-3 (the model was built or wrapped at stage 3)."""
    return any(hasattr(p, "ds_id") for p in params)


def full_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """A parameter's shape, also while ZeRO-3 has partitioned it away (``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def full_numel(param: torch.Tensor) -> int:
    """A parameter's element count, also while ZeRO-3 has partitioned it away (``ds_numel``)."""
    return param.ds_numel if hasattr(param, "ds_numel") else param.numel()


def params_to_fetch(params: Iterable[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """ZeRO-3 parameters that are partitioned away right now and must be gathered to be read."""
    return [p for p in params
            if p is not None and hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def gathered(params: Sequence[torch.Tensor], modifier_rank: Optional[int] = None) -> AbstractContextManager[Any]:
    """Gather ZeRO-3 partitioned ``params`` (all ranks must enter); a no-op for plain tensors."""
    if not any_zero3(params):
        return nullcontext()
    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank)


def gathered_to_read(params: Sequence[Optional[torch.Tensor]]) -> AbstractContextManager[Any]:
    """Gather the ZeRO-3 partitioned ``params`` to read them (nothing is written back); a no-op for
    parameters that are not partitioned away."""
    fetch = params_to_fetch(params)
    if not fetch:
        return nullcontext()
    return deepspeed.zero.GatheredParameters(fetch, modifier_rank=None)


def in_zero3_gather(param: torch.Tensor) -> Optional[bool]:
    """True while ``param`` is held gathered by an open ``deepspeed.zero.GatheredParameters``; None
    with a DeepSpeed that does not count those contexts (before 0.19)."""
    attr = getattr(partition_parameters, "DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR", None)
    return None if attr is None else getattr(param, attr, 0) > 0


def release_zero3_prefetch(model: Any) -> None:
    """Call before gathering a ZeRO-3 engine's parameters outside a forward or backward pass (saving,
    checkpointing, digests, a rollout): waits for the parameters DeepSpeed's prefetcher still has in
    flight and partitions every parameter again. After step 1's evaluation loop on SmolLM2 some
    prefetched parameters were still in flight, and ``GatheredParameters`` failed with "Cannot
    partition a param in flight" (the tiny test models keep most of their small parameters resident
    and never showed it). A no-op for plain modules and below ZeRO-3. Call it on every rank at the
    same point (it waits on all-gathers every rank issued), as the gathering after it requires anyway.

    Unlike DeepSpeed's ``engine.empty_partition_cache()`` it runs no full garbage collection and
    keeps the accelerator's cached blocks: a save calls it several times for every engine, and in a
    large process each full collection costs far more than the partitioning (benchmarks/results.md,
    "A checkpoint's garbage collections")."""
    partitioned = getattr(model, "zero_optimization_partition_weights", None)
    if callable(partitioned) and partitioned():
        parameter_offload(model).empty_partition_cache()


def gathered_parameters(model: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, parameter)`` for every parameter of ``model`` (an engine or a module), each whole:
    under ZeRO-3 one parameter at a time is gathered (read-only, ``modifier_rank=None``) for as long
    as the loop body holds it, so copy what must outlive the step. Collective under ZeRO-3: every
    rank must run the loop to its end."""
    release_zero3_prefetch(model)
    for name, param in getattr(model, "module", model).named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None, enabled=is_zero3_param(param)):
            yield name, param.detach()


def full_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter of ``module`` at full (unpartitioned) size."""
    return sum(full_numel(p) * p.element_size() for p in module.parameters())


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the GPU's, or the host's available memory for a CPU. On a GPU the
    caching allocator's unused blocks are returned first (``empty_cache``), so the answer does not
    depend on whether an earlier pass emptied the cache. (Counting reserved minus allocated bytes as
    free instead over-states it: split blocks and CUDA-graph pools are reserved, unused, and not
    reusable by a gather.) Called for the few once-per-model decisions, not per step."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def fits_gathered(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters at full size fit in half of its device's free memory, on every
    rank: collective (one all-reduce) where a process group is up, so that every rank gives the same
    answer and enters the same gathers."""
    device = next(module.parameters()).device
    flag = torch.tensor([1.0 if full_parameter_bytes(module) <= free_memory_bytes(device) // 2 else 0.0],
                        device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item() > 0)


def parameter_offload(engine: Any) -> Any:
    """DeepSpeed's ZeRO-3 parameter coordinator object that owns the fetch/release hooks."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "parameter_offload"):
        return optimizer.parameter_offload
    if optimizer is not None and hasattr(optimizer, "forward_hooks"):
        return optimizer
    raise AttributeError("this DeepSpeed engine exposes no ZeRO-3 parameter_offload hooks")


def zero3_offload(engine: Any) -> Any:
    """:func:`parameter_offload` of a ZeRO-3 engine, or None: below ZeRO-3, and for a plain module."""
    try:
        return parameter_offload(engine)
    except AttributeError:
        return None


def params_offloaded(engine: Any) -> bool:
    """Whether ZeRO-3 keeps ``engine``'s parameters off the accelerator (``offload_param``: the
    ``--offload_reference_model`` / ``--offload_reward_model`` / ``--offload`` configs)."""
    getter = getattr(engine, "zero_offload_param", None)
    config = getter() if callable(getter) else None
    return config is not None and getattr(config, "device", "none") != "none"


def whole_partitions(engine: Any) -> bool:
    """Whether every ZeRO-3 partition of ``engine`` is its whole parameter (one rank in each
    parameter's partition group): gathering then makes each parameter a view of its partition
    (DeepSpeed's ``_no_gather_coalesced``), which costs no memory where the parameters are not offloaded."""
    if not torch.distributed.is_initialized():
        return True
    groups = {id(p.ds_process_group): p.ds_process_group for p in engine.module.parameters() if hasattr(p, "ds_id")}
    return all(torch.distributed.get_world_size(group) == 1 for group in groups.values())


def quantized_partitions(engine: Any) -> bool:
    """Whether ZeRO-3 stores any of ``engine``'s partitions quantized (``zero_quantized_nontrainable_weights``,
    MixZ++'s frozen weights): gathering those dequantizes each into a new tensor at full precision."""
    return any(hasattr(getattr(p, "ds_tensor", None), "ds_quant_scale") for p in engine.module.parameters())


@contextmanager
def gathered_without_hooks(engine: Any) -> Iterator[None]:
    """All parameters gathered once and ZeRO-3's hooks detached, for one rollout, scoring pass or
    training pass (forward and backward).

    Collective: every rank must enter. Nothing may be written into the gathered tensors: with one rank
    they are the partitions themselves (DeepSpeed's ``_no_gather_coalesced`` returns a view of
    ``ds_tensor``), so an in-place edit would outlive the gather whatever ``modifier_rank`` says. LoRA
    fusion inside it swaps each base weight's ``.data`` for a new tensor and puts the gathered one back
    before the exit (:meth:`~dschat.models.lora.LinearLayer_LoRA.fuse_lora_weight`), so the
    partitions come back bit-identical; on exit the gathered copies are released (``modifier_rank=None``).

    The hooks -- each module's fetch/release hooks and the pass hooks on the root -- are taken
    out of their modules' hook tables and put back in their places on exit, the same hook objects. So
    DeepSpeed's module ids and its prefetch trace of the training pass outlive the rollout: removing
    the hooks and registering them again (``_register_deepspeed_module``) renumbers every module and
    invalidates the trace, and the next training pass then fetched every module on demand.
    """
    offload = parameter_offload(engine)
    release_zero3_prefetch(engine)  # nothing in flight: the gather below reads every parameter
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for param in iter_params(offload.module, recurse=True):
            param.ds_active_sub_modules.clear()
        with hooks_detached([*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]):
            _GATHERED_WHOLE.add(offload)
            try:
                yield
            finally:
                _GATHERED_WHOLE.discard(offload)


# The parameter offloads (one per ZeRO-3 engine) inside gathered_without_hooks right now.
_GATHERED_WHOLE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def gathered_whole(engine: Any) -> bool:
    """Whether ``engine`` is inside :func:`gathered_without_hooks`: its passes are plain module calls
    on whole parameters, nothing for ZeRO-3's trace to see."""
    offload = zero3_offload(engine)
    return offload is not None and offload in _GATHERED_WHOLE


# The parameter offloads of trained ZeRO-3 engines whose training passes run gathered whole.
_TRAINED_WHOLE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def mark_trained_whole(engine: Any, whole: bool = True) -> None:
    """Record that ``engine``'s training passes (forward and backward) run inside
    :func:`gathered_without_hooks` (``whole=False``: no longer): its passes through ZeRO-3's hooks are
    then all without gradients, as a frozen model's (:func:`zero3_pass`)."""
    offload = zero3_offload(engine)
    if offload is not None:
        (_TRAINED_WHOLE.add if whole else _TRAINED_WHOLE.discard)(offload)


def trained_whole(engine: Any) -> bool:
    """Whether :func:`mark_trained_whole` marked ``engine``."""
    offload = zero3_offload(engine)
    return offload is not None and offload in _TRAINED_WHOLE


@contextmanager
def hooks_detached(handles: Sequence[RemovableHandle]) -> Iterator[None]:
    """The module hooks behind ``handles`` out of their hook tables inside, and back on exit in the
    places they held (a hook registered inside stays, after them)."""
    tables: dict = {}  # id(table) -> (table, its keys in order, {handle id: the hook taken out})
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            table = ref()
            if table is None or handle.id not in table:
                continue
            entry = tables.setdefault(id(table), (table, list(table), {}))
            entry[2][handle.id] = table.pop(handle.id)
    try:
        yield
    finally:
        for table, order, taken in tables.values():
            now = dict(table)
            table.clear()
            for key in order:
                if key in taken:
                    table[key] = taken[key]
                elif key in now:
                    table[key] = now.pop(key)
            table.update(now)


# ------------------------------------------------------------------------------ the prefetch trace
def _trains(engine: Any) -> bool:
    """Whether ``engine`` is a ZeRO-3 engine with an optimizer whose training passes run through
    ZeRO-3's hooks (its hooked passes have backwards); an inference engine's offload is the optimizer
    slot itself, and an engine trained gathered whole (:func:`mark_trained_whole`)
    runs only passes without gradients through them."""
    optimizer = getattr(engine, "optimizer", None)
    return optimizer is not None and hasattr(optimizer, "parameter_offload") and not trained_whole(engine)


def _begin(coordinator: Any, trains: bool) -> None:
    if trains and not torch.is_grad_enabled() and coordinator.is_invalid_trace():
        return  # record at the next pass with a backward, not this one
    coordinator.reset_step()


def _end(offload: Any, trains: bool) -> None:
    """After a trained engine's pass without gradients: partition again what its trace kept gathered
    for the backward (DeepSpeed keeps a parameter whose next use is within ``stage3_max_reuse_distance``,
    1e9 elements by default), which this pass will never run. Left, the critic stayed whole from its
    scoring pass through the actor's training, and an actor fetched layer by layer stayed whole across
    its decode steps. Persistent parameters stay, as DeepSpeed keeps them; DeepSpeed's count of
    gathered elements, which these partitions leave high, is reset as the next pass begins."""
    coordinator = offload.get_param_coordinator()
    if not trains or torch.is_grad_enabled() or not coordinator.is_complete_trace():
        return
    coordinator._clean_inflight_param_registry()  # wait for the prefetches still in flight, release them
    for param in iter_params(offload.module, recurse=True):
        if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_persist and not param.ds_active_sub_modules:
            param.partition()


@contextmanager
def zero3_pass(engine: Any) -> Iterator[None]:
    """One pass of ``engine`` for ZeRO-3's trace (the module's docstring, *The prefetch trace*),
    around a pass that does not go through the root module's call (``forward_value``); on every rank
    alike."""
    offload = zero3_offload(engine)
    if offload is None or gathered_whole(engine):  # whole and unhooked: nothing for the trace to see
        yield
        return
    trains = _trains(engine)
    _begin(offload.get_param_coordinator(), trains)
    yield
    _end(offload, trains)


def begin_passes_with_dschats_rule(engine: Any) -> None:
    """Put the rules of :func:`zero3_pass` on a trained ZeRO-3 engine's root module: its pass-start
    hook replaces DeepSpeed's, first in the root's hooks as DeepSpeed's was, and a pass-end hook joins
    DeepSpeed's forward hooks. Both handles sit where DeepSpeed keeps its own (``fwd_pre_hook``,
    ``forward_hooks``), so its teardown removes them and the rollout's gather detaches them."""
    offload = zero3_offload(engine)
    if offload is None or not _trains(engine):
        return

    def start_of_pass(module: torch.nn.Module, args: Any) -> None:
        _begin(offload.get_param_coordinator(), _trains(engine))

    def end_of_pass(module: torch.nn.Module, args: Any, output: Any) -> None:
        _end(offload, _trains(engine))

    offload.fwd_pre_hook.remove()
    offload.fwd_pre_hook = offload.module.register_forward_pre_hook(start_of_pass, prepend=True)
    offload.forward_hooks.append(offload.module.register_forward_hook(end_of_pass))
