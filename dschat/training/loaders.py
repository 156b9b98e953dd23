"""The step scripts' data loaders and seeding: the order a run reads its data in is a function of
(seed, epoch, rank) only, and iterating a loader leaves the global RNG alone (resume reproduces the
uninterrupted run)."""
from __future__ import annotations

import random
from typing import Any, Callable, Iterator

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


class EvalShardSampler(DistributedSampler):
    """A rank's shard of the held-out split, in order: rank ``r`` of ``W`` reads rows ``r, r + W, ...``.

    Every rank must run the same number of eval batches (ZeRO-3 forwards are collective), so when
    ``W`` does not divide the split, ``DistributedSampler`` gives the short shards repeats of the
    split's first rows, at their end. :attr:`real_rows` says how many of this rank's rows come
    before them: an evaluation counts those only (:func:`eval_batches`)."""

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    @property
    def real_rows(self) -> int:
        """This rank's rows that are the split's own, not repeats (the first ones it yields)."""
        return len(range(self.rank, len(self.dataset), self.num_replicas))


def make_eval_loader(dataset: Dataset, batch_size: int, collate_fn: Callable | None) -> DataLoader:
    """Each rank evaluates its shard of the held-out split (:class:`EvalShardSampler`; no shuffling);
    the rows repeated to even out the ranks are marked by :func:`eval_batches`, not counted."""
    if len(dataset) == 0:
        raise UserError("the held-out (eval) split is empty; use more data or another --data_split")
    if get_world_size() > 1:
        sampler: Any = EvalShardSampler(dataset)
    else:
        sampler = SequentialSampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      generator=_loader_generator(0))


def eval_batches(loader: DataLoader, parts: int = 1) -> Iterator[tuple[dict[str, Any], int]]:
    """``(batch, real)`` for each batch of an eval loader: ``real`` of the batch's rows (per stacked
    part: ``parts=2`` for :class:`~dschat.data.collators.DataCollatorReward`'s ``[chosen; rejected]``)
    are the split's own, and they come first; the rest repeat rows another rank reads
    (:class:`EvalShardSampler`). A batch with ``real == 0`` must still be run on every rank (a
    collective forward) and counted nowhere. Batches are dicts with ``input_ids`` rows first."""
    left = getattr(loader.sampler, "real_rows", None)
    for batch in loader:
        rows = int(batch["input_ids"].shape[0]) // parts
        real = rows if left is None else max(0, min(rows, left))
        if left is not None:
            left -= rows
        yield batch, real


def keep_rows(batch: dict[str, Any], real: int, parts: int = 1) -> dict[str, Any]:
    """``batch`` with only the first ``real`` rows of each of its ``parts`` stacked parts (tensors whose
    first dimension is the batch's rows; anything else as it is)."""
    total = int(batch["input_ids"].shape[0])
    rows = total // parts
    if real == rows:
        return batch
    index = torch.cat([torch.arange(p * rows, p * rows + real) for p in range(parts)])
    return {k: v[index.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == total else v
            for k, v in batch.items()}


def prepare_batch(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """A right-padded step-1/2/DPO batch on ``device``, without its all-padding columns.

    Upstream pads every row to ``--max_seq_len``; the dropped columns change no real token's output
    or loss (see :func:`dschat.data.collators.drop_padding_columns`), only the compute.
    """
    return drop_padding_columns(to_device(batch, device), side="right")
