"""Exponential moving average of the actor's weights (upstream's ``moving_average``, §5.4).

``ema <- beta * ema + (1 - beta) * actor`` with ``beta = 0.992``, after every PPO micro-batch; the
result is saved as ``actor_ema/``.

Two things differ from upstream (``dschat/utils/utils.py::moving_average``):

* Under ZeRO-3 upstream gathered both parameters with ``GatheredParameters(..., modifier_rank=None)``
  and wrote into the gathered EMA tensor; on exit DeepSpeed re-partitions without copying the
  gathered data back (``has_been_updated=False``), so the update was discarded. Here the two
  parameters are averaged shard by shard (actor and EMA are partitioned identically: same shapes,
  same world), which needs no communication at all; if the shards do not line up, the EMA parameter
  is gathered with ``modifier_rank=0`` so the update is kept.
* The average is computed in fp32 and cast back: in bf16, ``(1 - 0.992) * delta`` is below the
  rounding step of most weights and the EMA would never move.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["EMA_BETA", "moving_average"]

EMA_BETA = 0.992


def _module(model: Any) -> nn.Module:
    return getattr(model, "module", model)


def _is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


def _is_available(param: torch.Tensor) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE


def _lerp_(target: torch.Tensor, source: torch.Tensor, beta: float) -> None:
    """``target <- beta * target + (1 - beta) * source`` in fp32, in place."""
    mixed = torch.lerp(source.to(device=target.device, dtype=torch.float32), target.float(), beta)
    target.copy_(mixed.to(target.dtype))


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
        if _is_partitioned(param) and _is_partitioned(ema) and param.ds_tensor.numel() == ema.ds_tensor.numel():
            # Same full shape and world -> the same flat slice lives on this rank in both.
            _lerp_(ema.ds_tensor.data, param.ds_tensor.data, beta)
            if _is_available(ema) and ema.data.data_ptr() != ema.ds_tensor.data_ptr():
                # A persistent (small) parameter also keeps its full copy resident; it is what a
                # forward pass or a save reads, so update it too (same arithmetic, same result).
                import deepspeed

                with deepspeed.zero.GatheredParameters([param], modifier_rank=None, enabled=not _is_available(param)):
                    _lerp_(ema.data, param.data, beta)
        elif _is_partitioned(param) or _is_partitioned(ema):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None, enabled=_is_partitioned(param)):
                with deepspeed.zero.GatheredParameters([ema], modifier_rank=0, enabled=_is_partitioned(ema)):
                    _lerp_(ema.data, param.data, beta)
        else:
            if param.shape != ema.shape:
                raise ValueError(f"moving_average: shape {tuple(param.shape)} vs EMA {tuple(ema.shape)}")
            _lerp_(ema.data, param.data, beta)
