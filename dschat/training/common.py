"""Pieces the step scripts share: data loaders, engine construction, evaluation loops, logging.

The step ``main.py`` files wire these together and read top to bottom; the work happens here.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler

from dschat.errors import UserError
from dschat.utils.dist import get_all_reduce_mean, get_world_size


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor of a (nested) batch to ``device``; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def set_random_seed(seed: int | None) -> None:
    """Seed python, numpy, torch and the accelerator (upstream name; a no-op for ``None``)."""
    if seed is None:
        return
    import random

    import numpy as np
    from transformers import set_seed

    set_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_train_loader(
    dataset: Dataset, batch_size: int, collate_fn: Callable | None, seed: int, *, shuffle: bool = True
) -> DataLoader:
    """A loader with a seeded ``DistributedSampler`` (also for one process).

    One sampler type everywhere makes the order a function of (seed, epoch, rank) only; callers
    must call ``set_epoch`` each epoch (upstream never did, bug §10.3).
    """
    if len(dataset) == 0:
        raise UserError("the training split is empty; check --data_path and --data_split")
    sampler = DistributedSampler(
        dataset,
        num_replicas=get_world_size(),
        rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        shuffle=shuffle,
        seed=seed,
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)


def make_eval_loader(dataset: Dataset, batch_size: int, collate_fn: Callable | None) -> DataLoader:
    """Each rank evaluates its shard of the held-out split (no shuffling, no padding duplicates
    beyond what ``DistributedSampler`` adds to even out ranks)."""
    if get_world_size() > 1:
        sampler: Any = DistributedSampler(dataset, shuffle=False)
    else:
        sampler = SequentialSampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float
    lora_lr: float
    offload: bool
    scheduler: str
    num_warmup_steps: int
    num_training_steps: int


def initialize_engine(model: nn.Module, ds_config: dict, optim: OptimSettings | None) -> Any:
    """``deepspeed.initialize`` with upstream's optimizer and scheduler (or none, for frozen models)."""
    import deepspeed

    from dschat.utils.optim import create_optimizer, create_scheduler, get_optimizer_grouped_parameters

    if optim is None:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        return engine
    groups = get_optimizer_grouped_parameters(model, optim.weight_decay, optim.lora_lr)
    if not groups:
        raise UserError("no trainable parameters: check --only_optimize_lora / --lora_dim / --lora_module_name")
    optimizer = create_optimizer(groups, lr=optim.lr, offload=optim.offload)
    scheduler = create_scheduler(optim.scheduler, optimizer, optim.num_warmup_steps, max(1, optim.num_training_steps))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine


def apply_lora(
    model: nn.Module, lora_dim: int, lora_module_name: str, only_optimize_lora: bool,
    force_optimize_params: Iterable[str] = (),
) -> nn.Module:
    """Upstream's LoRA wiring, refusing a module filter that matches nothing."""
    from dschat.models.families import family_of
    from dschat.utils.module.lora import (
        convert_linear_layer_to_lora,
        make_model_gradient_checkpointing_compatible,
        only_optimize_lora_parameters,
    )

    if lora_dim <= 0:
        return model
    model = convert_linear_layer_to_lora(model, lora_module_name, lora_dim)
    if not any(hasattr(m, "lora_right_weight") for m in model.modules()):
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


def evaluate_perplexity(engine: Any, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Mean LM loss over the whole held-out split (all ranks) and ``exp`` of it (upstream #773)."""
    engine.eval()
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    with torch.no_grad():
        for batch in loader:
            batch = to_device(batch, device)
            loss = engine(**batch, use_cache=False).loss
            total += loss.float()
            count += 1
    engine.train()
    loss = (get_all_reduce_mean(total) / get_all_reduce_mean(count).clamp(min=1)).item()
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = float("inf")
    return perplexity, loss


@dataclass(frozen=True)
class RewardEval:
    chosen: float
    rejected: float
    accuracy: float
    pairs: int


def evaluate_reward(engine: Any, loader: DataLoader, device: torch.device, eval_iters: int | None) -> RewardEval:
    """Upstream's reward-model eval: accuracy (chosen > rejected) and mean end scores.

    ``eval_iters`` caps the number of batches per rank (upstream's ``--eval_iters``); ``None`` or
    0 means the whole split. Counts are summed over ranks, so the numbers are exact, not a mean of
    per-rank means.
    """
    engine.eval()
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # correct, pairs, chosen, rejected
    with torch.no_grad():
        for step, batch in enumerate(loader):
            if eval_iters and step >= eval_iters:
                break
            batch = to_device(batch, device)
            out = engine(**batch, use_cache=False)
            chosen = out["chosen_mean_scores"].double()
            rejected = out["rejected_mean_scores"].double()
            sums += torch.stack(
                [(chosen > rejected).sum(), torch.tensor(float(chosen.numel()), device=device, dtype=torch.float64),
                 chosen.sum(), rejected.sum()]
            )
    engine.train()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    correct, pairs, chosen_sum, rejected_sum = sums.tolist()
    pairs_int = int(pairs)
    denom = max(pairs, 1.0)
    return RewardEval(chosen_sum / denom, rejected_sum / denom, correct / denom, pairs_int)


class TensorBoardLogger:
    """Rank-0 TensorBoard scalars with a global step that never resets across epochs
    (upstream used the per-epoch step, bug §10.5)."""

    def __init__(self, enabled: bool, path: str, name: str):
        self.writer = None
        if enabled and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(path) / name))

    def scalars(self, step: int, **values: float) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def cycle_batches(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def quiet_transformers() -> None:
    """Silence per-load progress bars; keep warnings."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        pass
