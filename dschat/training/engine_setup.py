"""The trained engine of steps 1, 2 and DPO (and step 3's engines): the DeepSpeed config from the
step flags, the optimizer and LR schedule, LoRA, and the reward model's final-norm reset."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Iterable

import deepspeed
import torch
from torch import nn

from dschat.errors import UserError
from dschat.models.families import family_of
from dschat.models.lora import (
    convert_linear_layer_to_lora,
    make_model_gradient_checkpointing_compatible,
    only_optimize_lora_parameters,
)
from dschat.runtime.ds_config import get_train_ds_config
from dschat.runtime.grad_reduction import reduce_gradients_in_place_on_one_rank
from dschat.runtime.optim import (
    create_optimizer,
    create_scheduler,
    get_optimizer_grouped_parameters,
    num_update_steps,
)
from dschat.runtime.zero3 import is_zero3_param
from dschat.training.run_setup import RunContext


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float
    lora_lr: float
    offload: bool
    scheduler: str
    num_warmup_steps: int
    num_training_steps: int


def optim_settings(args: argparse.Namespace, num_training_steps: int) -> OptimSettings:
    return OptimSettings(
        lr=args.learning_rate, weight_decay=args.weight_decay, lora_lr=args.lora_learning_rate,
        offload=args.offload, scheduler=args.lr_scheduler_type, num_warmup_steps=args.num_warmup_steps,
        num_training_steps=num_training_steps,
    )


def plan_optimizer_steps(num_batches: int, epochs: int, gradient_accumulation_steps: int,
                         max_train_steps: int = 0) -> int:
    """Optimizer steps the LR schedule is laid out over: upstream's
    ``epochs * ceil(batches / GA)``, capped by ``--max_train_steps`` when that is > 0. A run whose
    micro-batches (``num_batches`` per epoch, every epoch) are fewer than ``gradient_accumulation_steps``
    is one :class:`UserError` line: DeepSpeed would take no optimizer step, and the step would save
    the model untrained (exit 0)."""
    total = num_batches * epochs
    if 0 < total < gradient_accumulation_steps:
        raise UserError(f"--gradient_accumulation_steps {gradient_accumulation_steps} is more than the run's "
                        f"{total} micro-batches ({num_batches} per epoch x {epochs} epoch(s)): no optimizer step "
                        f"would be taken, and the untrained model saved; give at most {total}, or more epochs "
                        "or data")
    steps = num_update_steps(num_batches, epochs, gradient_accumulation_steps)
    return min(steps, max_train_steps) if max_train_steps > 0 else steps


def train_ds_config(args: argparse.Namespace, ctx: RunContext, tb_name: str) -> dict:
    """The trained engine's DeepSpeed config from the step flags (upstream's tb names)."""
    return step_ds_config(args, dtype=ctx.dtype, world_size=ctx.world_size, tb_name=tb_name)


def step_ds_config(args: argparse.Namespace, *, dtype: str, world_size: int, tb_name: str = "") -> dict:
    """Steps 1-2's (and DPO's) trained engine's DeepSpeed config for ``dtype`` on ``world_size`` ranks:
    what :func:`train_ds_config` builds for a run, and the memory planner for a machine it plans."""
    return get_train_ds_config(
        offload=args.offload, dtype=dtype, stage=args.zero_stage,
        enable_tensorboard=args.enable_tensorboard, tb_path=args.tensorboard_path, tb_name=tb_name,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        world_size=world_size,
    )


def initialize_engine(model: nn.Module, ds_config: dict, optim: OptimSettings | None) -> Any:
    """``deepspeed.initialize`` with upstream's optimizer and scheduler (or none, for frozen models)."""
    if optim is None:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        return engine
    groups = get_optimizer_grouped_parameters(model, optim.weight_decay, optim.lora_lr)
    if not groups:
        raise UserError("no trainable parameters: check --only_optimize_lora / --lora_dim / --lora_module_name")
    optimizer = create_optimizer(groups, lr=optim.lr, offload=optim.offload)
    scheduler = create_scheduler(optim.scheduler, optimizer, optim.num_warmup_steps, max(1, optim.num_training_steps))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    reduce_gradients_in_place_on_one_rank(engine)  # ZeRO-0 on one rank: the same numbers, no flat copies
    return engine


def apply_lora(
    model: nn.Module, lora_dim: int, lora_module_name: str, only_optimize_lora: bool,
    force_optimize_params: Iterable[str] = (),
) -> nn.Module:
    """Upstream's LoRA wiring, refusing a module filter that matches nothing."""
    if lora_dim <= 0:
        return model
    model = convert_linear_layer_to_lora(model, lora_module_name, lora_dim)
    if not any(hasattr(module, "lora_right_weight") for module in model.modules()):
        suggestion = family_of(getattr(model, "config", None)).lora_module_name
        raise UserError(
            f"the LoRA module filter {lora_module_name!r} matched no Linear layer of this "
            f"{getattr(getattr(model, 'config', None), 'model_type', 'model')}; "
            f"pass --lora_module_name {suggestion!r} (this family's decoder blocks)"
        )
    if only_optimize_lora:
        model = only_optimize_lora_parameters(model, list(force_optimize_params))
        model = make_model_gradient_checkpointing_compatible(model)
    return model


def reset_final_norm_for_reward(model: nn.Module, zero_stage: int) -> list[str]:
    """Reset the body's final layer norm of a fresh reward model where the family asks for it.

    BLOOM's ``ln_f.weight`` has a large variance that makes bf16 reward training unstable, and the
    norm fed the replaced LM head anyway, so it is reset to weight 1 / bias 0 and always trained,
    as upstream intends (docs/upstream.md#step-2-reward-model). Returns the
    parameter names to force-train (also with ``--only_optimize_lora``).
    """
    norm_name = family_of(model.config).reset_final_norm_for_reward
    if norm_name is None:
        return []
    norm = getattr(model.rwtransformer, norm_name)
    params = [norm.weight, norm.bias]
    is_zero3 = zero_stage == 3 and is_zero3_param(norm.weight)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=is_zero3):
        if not is_zero3 or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            with torch.no_grad():
                torch.nn.init.ones_(norm.weight)
                torch.nn.init.zeros_(norm.bias)
    return [f"rwtransformer.{norm_name}.weight", f"rwtransformer.{norm_name}.bias"]
