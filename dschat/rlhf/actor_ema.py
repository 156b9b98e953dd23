"""Exponential moving average of the actor's weights (upstream's ``moving_average``, ``--enable_ema``):
not the logged "EMA reward score", which is :class:`dschat.training.ppo_counters.ExponentialMovingAverage`.

``ema <- beta * ema + (1 - beta) * actor`` with ``beta = 0.992``, after every PPO micro-batch; the
result is saved as ``actor_ema/``.

Two upstream differences (docs/upstream.md#step-3-ppo, docs/upstream.md#half-precision-where-the-fix-changes-numbers):

* Under ZeRO-3 the two parameters are averaged shard by shard (actor and EMA are partitioned
  identically: same shapes, same world), which needs no communication at all; if the shards do not
  line up, the EMA parameter is gathered with ``modifier_rank=0`` so the update is kept.
* An fp16/bf16 EMA keeps an fp32 shadow of its weights (of this rank's shard under ZeRO-3) and
  averages into that: ``(1 - 0.992) * gap`` is below the rounding step of a half-precision weight
  unless the gap exceeds ~60 steps (~24% of the weight in bf16, ~3% in fp16), so averaging into the
  low-precision weights, even in fp32 arithmetic, would leave them where they start (docs/upstream.md#half-precision-where-the-fix-changes-numbers).
  The weights are the shadow rounded after every update. Cost: 4 bytes per EMA parameter (divided
  by the world size under ZeRO-3), with ``--enable_ema`` only. The shadow is rebuilt from the
  weights whenever they do not match it (a copy with ``beta=0``, a
  checkpoint loaded into the EMA), so it never overrides them. A checkpoint holds the shadow where it
  is whole (not under ZeRO-3), so a resumed run goes on exactly (:mod:`dschat.training.weights_file`);
  a ZeRO-3 shard's is restarted from the saved half-precision weights.
"""
from __future__ import annotations

from typing import Any

import deepspeed
import torch
from torch import nn

from dschat.runtime.zero3 import is_available, is_partitioned
from dschat.training.weights_file import FP32_SHADOW, current_shadow

__all__ = ["EMA_BETA", "moving_average"]

EMA_BETA = 0.992


def _module(model: Any) -> nn.Module:
    return getattr(model, "module", model)


_SHADOW = FP32_SHADOW  # attribute of the EMA parameter holding the fp32 shadow of ``target``


def _lerp_(target: torch.Tensor, source: torch.Tensor, beta: float, holder: Any) -> None:
    """``target <- beta * target + (1 - beta) * source`` in fp32, in place. A half-precision
    ``target`` is averaged through its fp32 shadow, kept on ``holder`` (module docstring)."""
    source32 = source.to(device=target.device, dtype=torch.float32)
    if target.dtype in (torch.float32, torch.float64) or beta == 0.0:
        target.copy_(torch.lerp(source32, target.float(), beta).to(target.dtype))
        if hasattr(holder, _SHADOW):
            delattr(holder, _SHADOW)  # a copy: the weights are exact, a shadow would be stale
        return
    shadow = current_shadow(holder, target)
    if shadow is None:
        shadow = target.float()  # first update, or the weights were changed outside this function
    shadow = torch.lerp(source32, shadow, beta)
    setattr(holder, _SHADOW, shadow)
    target.copy_(shadow.to(target.dtype))


@torch.no_grad()
def moving_average(model: Any, model_ema: Any, beta: float = EMA_BETA, device: Any = None, zero_stage: int = 0) -> None:
    """Move every parameter of ``model_ema`` towards ``model``'s: ``ema = lerp(param, ema, beta)``.

    Upstream's signature; ``model`` / ``model_ema`` may be DeepSpeed engines. ``device`` (upstream:
    where to do the arithmetic) and ``zero_stage`` are accepted for compatibility; partitioning is
    detected per parameter. ``beta=0`` copies the actor into the EMA.
    """
    del device, zero_stage
    params = list(_module(model).parameters())
    ema_params = list(_module(model_ema).parameters())
    if len(params) != len(ema_params):
        raise ValueError(
            f"moving_average: the actor has {len(params)} parameters and the EMA {len(ema_params)}; "
            "they must be built the same way (same model, same LoRA conversion)"
        )
    for param, ema in zip(params, ema_params):
        if is_partitioned(param) and is_partitioned(ema) and param.ds_tensor.numel() == ema.ds_tensor.numel():
            # Same full shape and world -> the same flat slice lives on this rank in both.
            _lerp_(ema.ds_tensor.data, param.ds_tensor.data, beta, ema.ds_tensor)
            if is_available(ema) and ema.data.data_ptr() != ema.ds_tensor.data_ptr():
                # A persistent (small) parameter also keeps its full copy resident; it is what a
                # forward pass or a save reads, so update it too (same arithmetic, same result).
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None, enabled=not is_available(param)):
                    _lerp_(ema.data, param.data, beta, ema)
        elif is_partitioned(param) or is_partitioned(ema):
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None, enabled=is_partitioned(param)):
                with deepspeed.zero.GatheredParameters([ema], modifier_rank=0, enabled=is_partitioned(ema)):
                    _lerp_(ema.data, param.data, beta, ema)
        else:
            if param.shape != ema.shape:
                raise ValueError(f"moving_average: shape {tuple(param.shape)} vs EMA {tuple(ema.shape)}")
            _lerp_(ema.data, param.data, beta, ema)
