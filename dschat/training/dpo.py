"""DPO pieces of ``training/step2_dpo_finetuning/main.py``: the label mask, one batch's loss, the
held-out evaluation. The formulas are :func:`dschat.rl_math.logprobs.sequence_log_probs` and
:func:`dschat.rl_math.preference.dpo_loss`.

Batches come from ``DataCollatorReward``: ``input_ids`` / ``attention_mask`` of shape (2B, L),
chosen rows first, rejected rows second.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from dschat.errors import UserError
from dschat.rl_math.logprobs import sequence_log_probs
from dschat.rl_math.preference import DPOOutput, dpo_loss, first_divergence_indices
from dschat.training.loaders import eval_batches, keep_rows, prepare_batch


def check_dpo_args(beta: float, label_smoothing: float) -> None:
    """One line for a ``--beta`` that is not a finite number > 0, or a ``--label_smoothing`` outside
    [0, 0.5) (from 0.5 on, the loss prefers the rejected answers)."""
    if not (math.isfinite(beta) and beta > 0):
        raise UserError(f"--beta must be a finite number > 0 (typically 0.1 to 0.5), got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise UserError(f"--label_smoothing must be in [0, 0.5) (the share of preferences taken as flipped), "
                        f"got {label_smoothing}")


def dpo_label_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Upstream's DPO label mask, read from the attention mask instead of ``ids != pad``.

    Tokens from the first position where a pair's chosen and rejected rows differ (both rows of the
    pair; identical pairs keep everything) up to each row's last real token: upstream's stand-in
    for a prompt mask. "Real" comes from the attention mask, so an EOS that shares the pad id is
    kept (docs/upstream.md#pad-and-eos).

    Shape: input_ids, attention_mask (2B, L); returns (2B, L) int64.
    """
    half = input_ids.shape[0] // 2
    divergence = first_divergence_indices(input_ids[:half], input_ids[half:], if_identical=0).repeat(2)  # (2B,)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (attention_mask.bool() & (positions[None, :] >= divergence[:, None])).long()


@dataclass(frozen=True)
class DPOBatch:
    """One batch through the policy and the frozen reference.

    ``loss``: scalar mean over pairs (what is back-propagated); ``output``: per-pair losses and
    implicit rewards (B,) each.
    """

    loss: torch.Tensor
    output: DPOOutput


def dpo_batch(policy: Any, reference: Any, batch: dict[str, torch.Tensor], *, beta: float,
              label_smoothing: float, fp32: bool = False) -> DPOBatch:
    """Forward a (2B, L) batch through both models and compute upstream's DPO loss."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    label_mask = dpo_label_mask(input_ids, attention_mask)
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (2B, L, V)
    logps = sequence_log_probs(logits, input_ids, label_mask, fp32=fp32)  # (2B,)
    with torch.no_grad():
        ref_logits = reference(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        ref_logps = sequence_log_probs(ref_logits, input_ids, label_mask, fp32=fp32)
    half = input_ids.shape[0] // 2
    out = dpo_loss(logps[:half], logps[half:], ref_logps[:half], ref_logps[half:],
                   beta=beta, label_smoothing=label_smoothing)
    return DPOBatch(out.losses.mean(), out)


@dataclass(frozen=True)
class DPOEval:
    """Means over every held-out pair on every rank (upstream reported its last batch's rewards)."""

    chosen: float
    rejected: float
    loss: float
    accuracy: float
    pairs: int


def evaluate_dpo(policy: Any, reference: Any, loader: DataLoader, device: torch.device, *, beta: float,
                 label_smoothing: float, fp32: bool = False) -> DPOEval:
    """Implicit chosen / rejected rewards, loss and reward accuracy over the whole held-out split,
    each pair counted once (the rows a rank's shard repeats are left out: :func:`eval_batches`)."""
    policy.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # chosen, rejected, loss, correct, pairs
    with torch.no_grad():
        for batch, real in eval_batches(loader, parts=2):
            out = dpo_batch(policy, reference, prepare_batch(keep_rows(batch, real, parts=2) if real else batch, device),
                            beta=beta, label_smoothing=label_smoothing, fp32=fp32).output
            if not real:
                continue  # only repeated rows: run on every rank (a collective forward), counted nowhere
            sums += torch.stack([
                out.chosen_rewards.double().sum(), out.rejected_rewards.double().sum(), out.losses.double().sum(),
                (out.chosen_rewards > out.rejected_rewards).double().sum(),
                torch.tensor(float(out.losses.numel()), dtype=torch.float64, device=device),
            ])
    policy.train()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    chosen, rejected, loss, correct, pairs = sums.tolist()
    n = max(pairs, 1.0)
    return DPOEval(chosen / n, rejected / n, loss / n, correct / n, int(pairs))
