"""The step scripts' data loaders and seeding: the order a run reads its data in is a function of
(seed, epoch, rank) only, and iterating a loader leaves the global RNG alone (resume reproduces the
uninterrupted run)."""
from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler

from dschat.data.collators import drop_padding_columns
from dschat.errors import UserError
from dschat.runtime.devices import to_device
from dschat.runtime.dist import get_world_size


def set_random_seed(seed: int | None) -> None:
    """Seed python, numpy, torch and the accelerator (upstream name; a no-op for ``None``): what
    upstream's ``set_random_seed`` seeds, ``transformers.set_seed`` included, without importing
    ``transformers.trainer_utils``, which imports peft and bitsandbytes at every run's start-up
    (benchmarks/results.md, "Start-up")."""
    if seed is None:
        return
    # lazy: DeepSpeed's import, +1.5 s CPU after torch (python -X importtime), which --help must not pay
    from deepspeed.accelerator import get_accelerator

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA, XPU and MPS device
    get_accelerator().manual_seed_all(seed)  # upstream's: DeepSpeed's accelerator (NPU, HPU, MLU, ...)


def make_train_loader(
    dataset: Dataset, batch_size: int, collate_fn: Callable | None, seed: int, *, shuffle: bool = True,
    drop_last: bool = False,
) -> DataLoader:
    """A loader with a seeded ``DistributedSampler`` (also for one process).

    One sampler type everywhere makes the order a function of (seed, epoch, rank) only; callers
    must call ``set_epoch`` each epoch (docs/upstream.md#data-cache). ``drop_last`` drops each
    rank's last, short batch (step 3 does when a short rollout would shift its optimizer steps).
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
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      generator=_loader_generator(seed), drop_last=drop_last)


def _loader_generator(seed: int) -> torch.Generator:
    """A DataLoader without its own generator draws a worker base seed from the *global* torch RNG
    each time it is iterated; with one, iterating leaves the global RNG (dropout) alone, which a
    resumed run needs to reproduce the uninterrupted one (dschat.training.checkpoint)."""
    return torch.Generator().manual_seed(seed)


def make_eval_loader(dataset: Dataset, batch_size: int, collate_fn: Callable | None) -> DataLoader:
    """Each rank evaluates its shard of the held-out split (no shuffling, no padding duplicates
    beyond what ``DistributedSampler`` adds to even out ranks)."""
    if len(dataset) == 0:
        raise UserError("the held-out (eval) split is empty; use more data or another --data_split")
    if get_world_size() > 1:
        sampler: Any = DistributedSampler(dataset, shuffle=False)
    else:
        sampler = SequentialSampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      generator=_loader_generator(0))


def prepare_batch(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """A right-padded step-1/2/DPO batch on ``device``, without its all-padding columns.

    Upstream pads every row to ``--max_seq_len``; the dropped columns change no real token's output
    or loss (see :func:`dschat.data.collators.drop_padding_columns`), only the compute.
    """
    return drop_padding_columns(to_device(batch, device), side="right")
