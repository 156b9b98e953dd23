"""The held-out evaluation of steps 1 and 2: perplexity (step 1) and the reward model's pairwise
accuracy and mean scores (step 2), summed over every rank. DPO's is :func:`dschat.training.dpo.evaluate_dpo`.

Each held-out row counts once: the rows a rank's shard repeats so that every rank runs as many
batches (:class:`~dschat.training.loaders.EvalShardSampler`) are cut from the batch before the forward
pass, and a batch of repeats only is still run (ZeRO-3 forwards are collective) but counted nowhere."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from dschat.runtime.dist import get_all_reduce_mean
from dschat.training.loaders import eval_batches, keep_rows, prepare_batch


def evaluate_perplexity(engine: Any, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Upstream's eval loss and ``exp`` of it (docs/upstream.md#step-1-sft): the mean over the held-out
    batches of all ranks of each batch's loss (the model's mean over that batch's label tokens), each
    held-out row in one batch once."""
    engine.eval()
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    with torch.no_grad():
        for batch, real in eval_batches(loader):
            loss = engine(**prepare_batch(keep_rows(batch, real) if real else batch, device), use_cache=False).loss
            if real:
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
    """Held-out reward-model metrics: mean end scores, accuracy (chosen > rejected), the number
    of pairs, and the mean pairwise loss (not printed by upstream; tests and TensorBoard use it)."""

    chosen: float
    rejected: float
    accuracy: float
    pairs: int
    loss: float = float("nan")


def evaluate_reward(engine: Any, loader: DataLoader, device: torch.device, eval_iters: int | None) -> RewardEval:
    """Upstream's reward-model eval: accuracy (chosen > rejected) and mean end scores.

    ``eval_iters`` caps the number of batches per rank (upstream's ``--eval_iters``); ``None`` or
    0 means the whole split. Counts are summed over ranks, each held-out pair once, so the numbers
    are exact, not a mean of per-rank means (docs/upstream.md#step-2-reward-model).
    """
    engine.eval()
    sums = torch.zeros(5, device=device, dtype=torch.float64)  # correct, pairs, chosen, rejected, loss*pairs
    with torch.no_grad():
        for step, (batch, real) in enumerate(eval_batches(loader, parts=2)):
            if eval_iters and step >= eval_iters:
                break
            out = engine(**prepare_batch(keep_rows(batch, real, parts=2) if real else batch, device), use_cache=False)
            if not real:
                continue
            chosen = out["chosen_mean_scores"].double()
            rejected = out["rejected_mean_scores"].double()
            pairs = float(chosen.numel())
            sums += torch.stack(
                [(chosen > rejected).sum().double(), torch.tensor(pairs, device=device, dtype=torch.float64),
                 chosen.sum(), rejected.sum(), out["loss"].double() * pairs]
            )
    engine.train()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    correct, pairs, chosen_sum, rejected_sum, loss_sum = sums.tolist()
    denom = max(pairs, 1.0)
    return RewardEval(chosen_sum / denom, rejected_sum / denom, correct / denom, int(pairs), loss_sum / denom)
