"""Weights-only checkpoint files: every parameter of an engine in one safetensors file (step 3's EMA
actor, which has no optimizer for DeepSpeed to checkpoint, and which DeepSpeed cannot checkpoint as an
optimizer-less ZeRO-3 engine).

A half-precision parameter averaged into through an fp32 copy (the EMA actor's:
:mod:`dschat.rlhf.actor_ema`) holds that copy as its attribute :data:`FP32_SHADOW`. Where it is whole
(not a ZeRO-3 shard) and current (its rounding is the parameter), the file holds it, in fp32, in the
parameter's place, and loading puts it back beside the rounded parameter: a resumed run goes on
averaging exactly where the uninterrupted run would (rebuilt from the rounded weights, it drifted
by one rounding step). A ZeRO-3 shard's copy is not saved; a resumed run rebuilds it from the weights.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dschat.errors import UserError, first_line
from dschat.runtime.zero3 import gathered_parameters, is_zero3_param, release_zero3_prefetch

__all__ = ["FP32_SHADOW", "current_shadow", "load_weights", "save_weights"]

#: The attribute of a half-precision parameter holding the fp32 copy that is averaged into.
FP32_SHADOW = "_dschat_ema_fp32"
_HALF = (torch.float16, torch.bfloat16)


def current_shadow(holder: Any, target: torch.Tensor) -> torch.Tensor | None:
    """The fp32 copy ``holder`` keeps of ``target`` when it is current (rounded, it is ``target``: the
    weights were not changed since), else None."""
    shadow = getattr(holder, FP32_SHADOW, None)
    if shadow is None or shadow.shape != target.shape or not torch.equal(shadow.to(target.dtype), target):
        return None
    return shadow


def _current_shadow(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s fp32 copy when it is whole (not a ZeRO-3 shard's) and current, else None."""
    if is_zero3_param(param) or param.dtype not in _HALF:
        return None
    return current_shadow(param, param.detach())


def save_weights(engine: Any, path: Path, rank: int) -> None:
    """Every parameter of ``engine`` (ZeRO-3: gathered; one with a current fp32 copy: the copy) to one
    safetensors file, written by rank 0 (collective)."""
    module = getattr(engine, "module", engine)
    originals = dict(module.named_parameters())
    tensors = {}
    for name, param in gathered_parameters(engine):
        if rank == 0:
            shadow = _current_shadow(originals[name])
            tensors[name] = (param if shadow is None else shadow).to("cpu").clone().contiguous()
    if rank == 0:
        save_file(tensors, str(path))


def load_weights(engine: Any, path: Path, rank: int) -> None:
    """The inverse of :func:`save_weights` (collective; ZeRO-3: rank 0 writes, DeepSpeed re-partitions).
    An fp32 tensor loaded into a whole half-precision parameter also becomes its fp32 copy."""
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:  # a cut, foreign or missing file
        raise UserError(f"cannot read {path} ({type(err).__name__}: {first_line(err)}); the checkpoint is "
                        "damaged: pass --resume_from with another one") from None
    release_zero3_prefetch(engine)
    module = getattr(engine, "module", engine)
    names = [name for name, _ in module.named_parameters()]
    if sorted(names) != sorted(state):
        raise UserError(f"{path} does not match this model's parameters; resume with the flags that wrote it")
    for name, param in module.named_parameters():
        zero3 = is_zero3_param(param)
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=zero3):
            if rank == 0 or not zero3:
                with torch.no_grad():
                    param.copy_(state[name].to(param.device, param.dtype))
        if not zero3 and param.dtype in _HALF and state[name].dtype == torch.float32:
            setattr(param, FP32_SHADOW, state[name].to(param.device))
