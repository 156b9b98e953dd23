"""The one DeepSpeed config builder, for every role (actor, reference, EMA, critic, reward).

Dict contents and key order follow upstream's ``dschat/utils/ds_utils.py`` exactly, except
(docs/upstream.md#deepspeed-config):

* the batch keys are computed here, once, from ``micro_batch_size``, ``gradient_accumulation_steps``
  and the world size. A call that leaves ``micro_batch_size`` out (code written against upstream,
  which sets both keys afterwards) gets upstream's placeholders exactly (``GLOBAL_BATCH_SIZE`` /
  ``MICRO_BATCH_SIZE``);
* ``dtype="fp32"`` is accepted and emits no fp16/bf16 block.

Callers pick the dtype with :func:`resolve_dtype` first (fp16 is not available on a CPU
accelerator); the builders themselves never change the dtype they are given, so the same call
produces the same dict on every machine.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch
from deepspeed.accelerator import get_accelerator

from dschat.errors import UserError
from dschat.runtime.dist import get_world_size

__all__ = [
    "DTYPES",
    "GLOBAL_BATCH_SIZE",
    "MICRO_BATCH_SIZE",
    "check_optimizer_offload",
    "check_param_offload",
    "get_train_ds_config",
    "get_eval_ds_config",
    "resolve_dtype",
    "torch_dtype_of",
]

logger = logging.getLogger(__name__)

# Upstream's module constants: the batch keys the builders emit when the caller leaves
# ``micro_batch_size`` out, for the caller to overwrite (docs/upstream.md#deepspeed-config).
GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4

DTYPES = ("fp16", "bf16", "fp32")
_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

_warned_fp16_on_cpu = False


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} (--dtype)")
    return dtype


def _accelerator_name() -> str:
    return get_accelerator().device_name()


def _device_count() -> int:
    """Accelerator devices on this node (a seam so tests can pin it)."""
    return int(get_accelerator().device_count())


def resolve_dtype(dtype: str) -> str:
    """The dtype to actually train in: ``dtype``, except fp16 on a CPU accelerator becomes fp32.

    DeepSpeed's CPU accelerator has no fp16 optimizer, so an fp16 request there is downgraded with
    one warning per process; bf16 and fp32 are kept. Unknown values raise :class:`UserError`.
    """
    global _warned_fp16_on_cpu
    _check_dtype(dtype)
    if dtype == "fp16" and _accelerator_name() == "cpu":
        if not _warned_fp16_on_cpu:
            logger.warning("dtype fp16 is not supported on the CPU accelerator; training in fp32 instead")
            _warned_fp16_on_cpu = True
        return "fp32"
    return dtype


def torch_dtype_of(dtype: str) -> torch.dtype:
    """``"fp16" | "bf16" | "fp32"`` -> the matching ``torch.dtype``."""
    return _TORCH_DTYPES[_check_dtype(dtype)]


def _dtype_block(dtype: str, *, train: bool) -> Dict[str, Dict[str, Any]]:
    """``{"fp16": ...}`` / ``{"bfloat16": ...}`` / ``{}`` (fp32 is DeepSpeed's default)."""
    _check_dtype(dtype)
    if dtype == "fp16":
        # Upstream sets a short loss-scale window for training only.
        return {"fp16": {"enabled": True, "loss_scale_window": 100} if train else {"enabled": True}}
    if dtype == "bf16":
        return {"bfloat16": {"enabled": True}}
    return {}


def check_optimizer_offload(stage: int, stage_flag: str) -> None:
    """``--offload`` needs a ZeRO stage: DeepSpeed moves optimizer state to the CPU only under ZeRO
    1-3; at stage 0 ``DeepSpeedCPUAdam`` meets accelerator parameters and fails at the first step
    ("CPUAdam param is on cuda:0 and must be 'cpu'")."""
    if stage == 0:
        raise UserError(
            f"--offload needs ZeRO: DeepSpeed offloads the optimizer only under ZeRO stage 1, 2 or 3 (stage 0 "
            f"fails at the first optimizer step on a GPU); pass {stage_flag} 2 (or 1, 3) or drop --offload"
        )


def check_param_offload(flag: str, stage: int, stage_flag: str) -> None:
    """Offloading a frozen model (``offload_param``) works only under ZeRO-3; below it DeepSpeed
    ignores the setting, so the flag would silently keep the whole model on the accelerator."""
    if stage != 3:
        raise UserError(
            f"{flag} needs {stage_flag} 3: DeepSpeed offloads a frozen model's parameters only under ZeRO-3, "
            f"which this model uses only when {stage_flag} is 3 (at {stage_flag} {stage} the flag would do "
            f"nothing); pass {stage_flag} 3 or drop {flag}"
        )


def _batch_keys(micro_batch_size: Optional[int], gradient_accumulation_steps: int,
                world_size: Optional[int]) -> Dict[str, int]:
    """``train_batch_size = micro * world * GA`` -- the one place it is computed.

    ``micro_batch_size=None`` (an upstream-style call) gives upstream's literal placeholders, which
    such a caller overwrites; asking for accumulation or a world size without it is a mistake.
    """
    if micro_batch_size is None:
        if gradient_accumulation_steps != 1 or world_size is not None:
            raise TypeError("gradient_accumulation_steps and world_size need micro_batch_size: the batch keys "
                            "are computed from all three")
        return {"train_batch_size": GLOBAL_BATCH_SIZE, "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE}
    if world_size is None:
        world_size = get_world_size()
    for name, value in (("micro_batch_size", micro_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps),
                        ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    return {
        "train_batch_size": micro_batch_size * world_size * gradient_accumulation_steps,
        "train_micro_batch_size_per_gpu": micro_batch_size,
    }


def get_train_ds_config(offload: bool,
                        dtype: str,
                        stage: int = 2,
                        enable_hybrid_engine: bool = False,
                        inference_tp_size: int = 1,
                        release_inference_cache: bool = False,
                        pin_parameters: bool = True,
                        tp_gather_partition_size: int = 8,
                        max_out_tokens: int = 512,
                        enable_tensorboard: bool = False,
                        enable_mixed_precision_lora: bool = False,
                        tb_path: str = "",
                        tb_name: str = "",
                        *,
                        micro_batch_size: Optional[int] = None,
                        gradient_accumulation_steps: int = 1,
                        world_size: Optional[int] = None,
                        gradient_clipping: float = 1.0) -> Dict[str, Any]:
    """DeepSpeed config for a trained engine (SFT / RM / DPO model, PPO actor and critic).

    Positional arguments are upstream's. ``train_batch_size = micro_batch_size * world_size *
    gradient_accumulation_steps``; ``world_size=None`` means the initialised process group's size,
    else ``$WORLD_SIZE``, else 1. Without ``micro_batch_size`` (upstream's call) the batch keys are
    upstream's placeholders, 32 and 4, for the caller to overwrite. With
    ``enable_mixed_precision_lora`` (ZeRO++ quantised frozen weights) and a world size different
    from the node's device count, the hierarchical partition size is set to the device count, as
    upstream does.
    """
    batch = _batch_keys(micro_batch_size, gradient_accumulation_steps, world_size)
    world_size = get_world_size() if world_size is None else world_size
    device = "cpu" if offload else "none"
    zero_opt_dict: Dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    if enable_mixed_precision_lora:
        zero_opt_dict["zero_quantized_nontrainable_weights"] = True
        device_count = _device_count()
        if world_size != device_count:
            zero_opt_dict["zero_hpz_partition_size"] = device_count
    return {
        **batch,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        **_dtype_block(dtype, train=True),
        "gradient_clipping": gradient_clipping,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": enable_hybrid_engine,
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": release_inference_cache,
            "pin_parameters": pin_parameters,
            "tp_gather_partition_size": tp_gather_partition_size,
        },
        "tensorboard": {
            "enabled": enable_tensorboard,
            "output_path": f"{tb_path}/ds_tensorboard_logs/",
            "job_name": f"{tb_name}_tensorboard",
        },
    }


def get_eval_ds_config(offload: bool,
                       dtype: str,
                       stage: int = 0,
                       *,
                       micro_batch_size: Optional[int] = None,
                       gradient_accumulation_steps: int = 1,
                       world_size: Optional[int] = None) -> Dict[str, Any]:
    """DeepSpeed config for a frozen engine (PPO reference, EMA, reward model).

    No optimizer, hybrid-engine or tensorboard block; the batch keys still matter because
    DeepSpeed validates them at ``initialize`` time (computed as in :func:`get_train_ds_config`,
    upstream's placeholders without ``micro_batch_size``).
    """
    batch = _batch_keys(micro_batch_size, gradient_accumulation_steps, world_size)
    device = "cpu" if offload else "none"
    zero_opt_dict = {
        "stage": stage,
        "stage3_param_persistence_threshold": 1e4,
        "offload_param": {"device": device},
        "memory_efficient_linear": False,
    }
    return {
        **batch,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        **_dtype_block(dtype, train=False),
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
