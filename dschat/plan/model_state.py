"""Model-state bytes of one DeepSpeed engine per rank, as DeepSpeed 0.19 partitions them.

Categories (each a storage of its own; a tensor that shares another's storage is not counted twice):

* ``params``: the module's weights. ZeRO 0: every parameter. ZeRO-1/2, trained: each optimizer
  group flattened into one buffer padded to a multiple of ``2 x world`` elements (DeepSpeed's
  ``nccl_start_alignment_factor``), frozen parameters as they are. ZeRO-3: each parameter's own
  partition of ``ceil(numel / world)`` elements (what the engine holds between passes; the
  parameters a pass gathers, persistent ones included, are the phases' working set).
* ``master``: the fp32 copy the optimizer steps. ZeRO 0 in fp32 steps the weights themselves (none);
  ZeRO-1/2: one partition per group (the padded group / world); ZeRO-3: the sum of the group's
  parameter partitions (the same storage as the weights where they are fp32 on an accelerator other
  than the CPU; a copy of its own otherwise).
* ``moments``: Adam's ``exp_avg`` and ``exp_avg_sq``, fp32, each the size of the master partition
  (ZeRO 0: of the trainable parameters).
* ``grads``: the gradient storage after a backward. ZeRO 0: every trainable parameter's ``.grad``;
  ZeRO-1/2: one buffer holding *whole* every parameter whose elements reach into this rank's
  partition (so a parameter across a partition boundary is held by both ranks), or with optimizer
  offload the fp32 partitions' gradients on the host; ZeRO-3: the sum of
  the parameter partitions. In the weights' dtype.
* ``buckets``: ZeRO's reduction buckets, in the weights' dtype, of a trained engine. ZeRO-1/2:
  ``reduce_bucket_size`` elements, two with ``overlap_comm``, allocated as each backward starts and
  freed after its reduction (a training phase's working set, :mod:`dschat.plan.phases`, not in
  ``device``); ZeRO-3: one buffer of ``reduce_bucket_size`` elements allocated with the optimizer and
  kept (resident). Not part of the CPU exactness check.
* ``step_working``: what the optimizer step allocates on the device beyond the states (the
  optimizer-step phase's working set, not resident). ZeRO 0 in fp16/bf16 on an accelerator other
  than the CPU (DeepSpeed's ``FP16_Optimizer`` over ``FusedAdam``; bf16 at ZeRO 0 takes the same
  wrapper): group after group, every gradient converted to fp32 and flattened (8 bytes an element
  while the group is flattened; the flat 4 stay until after the update, and the group's 2-byte
  ``.grad`` is freed), so the peak is the largest ``sum(earlier groups) x (4 - el) + group x 8``.
  ZeRO-1/2 without optimizer offload: each group's gradient partition flattened (``el`` bytes an
  element) and converted to fp32 (4 more; none in fp32, where the flat copy is fp32 already), one
  group at a time: the largest partition times ``el + 4``. Offloaded, the step runs on the host
  from the fp32 gradients already counted. ZeRO-3 without optimizer offload: the same for each
  optimizer sub-group in turn (a group's partitions, split at DeepSpeed's ``sub_group_size``, 1e9
  elements, which dschat does not change), the largest times ``el + 4`` (4 in fp32). ZeRO 0 in
  fp32: none.
* ``offload_buffers``: ZeRO-1/2 with optimizer offload, trained: the buffers DeepSpeed moves
  gradients and weights between the device and the host with, in the weights' dtype and kept for
  the engine's life: on the device one gradient buffer the size of the largest trainable parameter;
  on the host another, and one copy of the rank's weight partitions (the padded groups / world).
* ``accumulation``: ZeRO-1 with ``gradient_accumulation_steps > 1`` reduces only at the
  accumulation boundary, so between boundaries every rank holds every trained parameter's whole
  ``.grad`` (trainable x ``el``) besides the gradient partition buffer: a training phase's working
  set. ZeRO-2 reduces at every micro-step; none there.

Placement: with ``offload_optimizer`` the master, the moments and (ZeRO-1/2/3) the gradient
partitions live on the host (ZeRO-3 then holds the gradient partitions twice there: in the
weights' dtype and as the fp32 partitions' gradients); with ``offload_param`` (ZeRO-3 only) the parameter partitions do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from dschat.plan.inventory import Inventory, Param, optimizer_groups

__all__ = ["EngineSpec", "ModelState", "model_state", "DS_REDUCE_BUCKET_SIZE"]

# DeepSpeed's default ``reduce_bucket_size`` (elements); dschat's configs leave it at the default.
DS_REDUCE_BUCKET_SIZE = 500_000_000
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class EngineSpec:
    """How one engine is built: its ZeRO stage, world size, dtype and offload, from its DeepSpeed config."""

    stage: int
    world: int
    dtype: str
    trained: bool
    offload_optimizer: bool = False
    offload_param: bool = False
    persistence_threshold: int = 10_000
    overlap_comm: bool = True
    reduce_bucket_size: int = DS_REDUCE_BUCKET_SIZE
    cpu_accelerator: bool = False
    gradient_accumulation_steps: int = 1

    @classmethod
    def from_ds_config(cls, ds_config: dict, *, world: int, trained: bool, cpu_accelerator: bool) -> "EngineSpec":
        zero = ds_config.get("zero_optimization", {})
        dtype = "fp16" if ds_config.get("fp16", {}).get("enabled") else (
            "bf16" if ds_config.get("bfloat16", {}).get("enabled") else "fp32")
        return cls(stage=int(zero.get("stage", 0)), world=world, dtype=dtype, trained=trained,
                   offload_optimizer=trained and zero.get("offload_optimizer", {}).get("device") == "cpu",
                   offload_param=zero.get("offload_param", {}).get("device") == "cpu" and zero.get("stage") == 3,
                   persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 10_000)),
                   overlap_comm=bool(zero.get("overlap_comm", False)),
                   reduce_bucket_size=int(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET_SIZE)),
                   cpu_accelerator=cpu_accelerator,
                   gradient_accumulation_steps=_accumulation_steps(ds_config, world))


def _accumulation_steps(ds_config: dict, world: int) -> int:
    """The config's gradient accumulation steps, or as DeepSpeed derives them from the batch keys
    (``train_batch_size / (train_micro_batch_size_per_gpu x world)``)."""
    if ds_config.get("gradient_accumulation_steps"):
        return int(ds_config["gradient_accumulation_steps"])
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 0) or 0)
    total = int(ds_config.get("train_batch_size", 0) or 0)
    return max(1, total // (micro * world)) if micro and total else 1


@dataclass
class ModelState:
    """Bytes per category on the most loaded rank; ``device`` / ``host`` split them by placement."""

    params: int = 0
    master: int = 0
    moments: int = 0
    grads: int = 0
    buckets: int = 0
    offload_buffers: int = 0
    step_working: int = 0
    accumulation: int = 0
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    def counted(self) -> dict[str, int]:
        """The categories the exactness test compares with a live engine."""
        return {"params": self.params, "master": self.master, "moments": self.moments, "grads": self.grads,
                "offload_buffers": self.offload_buffers}


def _aligned(numel: int, world: int) -> int:
    alignment = 2 * world
    return int(math.ceil(numel / alignment)) * alignment


def _zero2_grads(group: Sequence[Param], world: int) -> list[int]:
    """Per rank: elements of the whole parameters that reach into the rank's partition of ``group``."""
    size = _aligned(sum(p.numel for p in group), world) // world
    held = [0] * world
    offset = 0
    for p in group:
        start, end = offset, offset + p.numel
        for rank in range(world):
            lo, hi = rank * size, (rank + 1) * size
            if start < hi and end > lo:
                held[rank] += p.numel
        offset = end
    return held


ZERO3_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


def _step_working(groups: Sequence[Sequence[Param]], spec: EngineSpec) -> int:
    """The optimizer step's device bytes beyond the states (the module docstring's ``step_working``)."""
    el = DTYPE_BYTES[spec.dtype]
    sizes = [sum(p.numel for p in g) for g in groups]
    if spec.stage == 0 and spec.dtype != "fp32" and not spec.cpu_accelerator:
        peak, done = 0, 0
        for n in sizes:  # earlier groups: their fp32 flat kept, their 2-byte grads freed
            peak = max(peak, done * (4 - el) + 8 * n)
            done += n
        return peak
    if spec.stage in (1, 2) and not spec.offload_optimizer and sizes:
        partition = max(_aligned(n, spec.world) // spec.world for n in sizes)
        return partition * (el + (4 if el != 4 else 0))
    if spec.stage == 3 and not spec.offload_optimizer and sizes:
        return max(_zero3_sub_groups(groups, spec.world)) * (el + (4 if el != 4 else 0))
    return 0


def _zero3_sub_groups(groups: Sequence[Sequence[Param]], world: int) -> list[int]:
    """The partition elements of each ZeRO-3 optimizer sub-group on one rank: a group's parameters in
    order, a sub-group closed once it reaches ``ZERO3_SUB_GROUP_SIZE`` (a group that holds fewer
    is one sub-group), each parameter's partition ``ceil(numel / world)``."""
    found = []
    for group in groups:
        current = 0
        for param in group:
            current += -(-param.numel // world)
            if current >= ZERO3_SUB_GROUP_SIZE:
                found.append(current)
                current = 0
        if current:
            found.append(current)
    return found or [0]


def model_state(inv: Inventory, spec: EngineSpec) -> ModelState:
    """The bytes ``inv`` takes as an engine built with ``spec`` (most loaded rank)."""
    el = DTYPE_BYTES[spec.dtype]
    world = spec.world
    groups = optimizer_groups(inv) if spec.trained else []
    trainable = [p for g in groups for p in g]
    trained_ids = {id(p) for p in trainable}
    frozen = [p for p in inv.params if id(p) not in trained_ids]
    state = ModelState()
    offload_device = offload_host = 0  # ZeRO-1/2 with optimizer offload (ModelState.offload_buffers)
    if spec.stage == 3:
        part = [int(math.ceil(p.numel / world)) for p in inv.params]
        state.params = sum(part) * el
        train_part = sum(int(math.ceil(p.numel / world)) for p in trainable)
        shared = spec.dtype == "fp32" and not spec.offload_optimizer and not spec.cpu_accelerator
        state.master = 0 if shared or not spec.trained else train_part * 4
        state.moments = 2 * train_part * 4
        # Offloaded, the fp32 partitions also get an fp32 gradient of their own on the host.
        state.grads = train_part * el + (train_part * 4 if spec.offload_optimizer else 0)
    elif spec.stage in (1, 2) and spec.trained:
        flat = sum(_aligned(sum(p.numel for p in g), world) for g in groups)
        state.params = flat * el + sum(p.numel for p in frozen) * el
        state.master = flat // world * 4
        state.moments = 2 * state.master
        if spec.offload_optimizer:
            state.grads = state.master  # reduced straight into the fp32 partitions' host gradients
            offload_device = max((p.numel for p in trainable), default=0) * el  # DeepSpeed's temp_grad_buffer_for_gpu_offload
            offload_host = offload_device + flat // world * el  # ..._for_cpu_offload, the 16-bit partition copies
            state.offload_buffers = offload_device + offload_host
        elif world > 1:
            per_rank = [sum(x) for x in zip(*[_zero2_grads(g, world) for g in groups])] or [0]
            state.grads = max(per_rank) * el
        else:
            state.grads = sum(p.numel for p in trainable) * el
    else:
        state.params = inv.numel * el
        numel = sum(p.numel for p in trainable)
        state.master = 0 if spec.dtype == "fp32" else numel * 4
        state.moments = 2 * numel * 4
        state.grads = numel * el
    if spec.trained and spec.stage in (1, 2):
        state.buckets = (2 if spec.overlap_comm else 1) * spec.reduce_bucket_size * el
    elif spec.trained and spec.stage == 3:
        state.buckets = spec.reduce_bucket_size * el
    if not spec.trained:
        state.master = state.moments = state.grads = 0
    else:
        state.step_working = _step_working(groups, spec)
        if spec.stage == 1 and spec.gradient_accumulation_steps > 1:
            state.accumulation = sum(p.numel for p in trainable) * el
    optimizer_on_host = spec.offload_optimizer and spec.stage > 0
    state.device = {"params": 0 if spec.offload_param else state.params,
                    "master": 0 if optimizer_on_host else state.master,
                    "moments": 0 if optimizer_on_host else state.moments,
                    "grads": 0 if optimizer_on_host else state.grads,
                    "buckets": state.buckets if spec.stage == 3 else 0,
                    "offload buffers": offload_device}
    state.host = {"params": state.params if spec.offload_param else 0,
                  "master": state.master if optimizer_on_host else 0,
                  "moments": state.moments if optimizer_on_host else 0,
                  "grads": state.grads if optimizer_on_host else 0,
                  "offload buffers": offload_host}
    return state
