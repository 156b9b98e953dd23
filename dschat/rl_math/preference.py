"""Preference losses: the reward model's pairwise loss and end-score indices (step 2), and DPO's
label mask and loss (step2_dpo_finetuning)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dschat.rl_math.stats import masked_sum

__all__ = ["reward_end_indices", "upstream_end_indices", "first_divergence_indices", "PairwiseLossOutput",
           "pairwise_read_ends", "pairwise_reward_loss", "dpo_label_mask", "DPOOutput", "dpo_loss"]


# --------------------------------------------------------------------------------------------
# Reward model (step 2)
# --------------------------------------------------------------------------------------------
def reward_end_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row (the last non-zero of ``attention_mask``).

    For right-padded rows this is ``attention_mask.sum(1) - 1``; taking the last non-zero also
    copes with left padding and with a masked BOS. Rows without any real token give 0.

    Shape: attention_mask (B, L); returns (B,) int64.
    """
    real = attention_mask.bool()
    L = real.shape[1]
    last = L - 1 - real.flip(-1).long().argmax(-1)
    return torch.where(real.any(-1), last, torch.zeros_like(last))


def upstream_end_indices(
    input_ids: torch.Tensor, pad_token_id: int, num_padding_at_beginning: int = 0
) -> torch.Tensor:
    """Upstream's ``c_ind``: index of pad number ``num_padding_at_beginning`` (0-based) in each
    row, or ``L`` if the row has no more pads than that. The end score is read at ``c_ind - 1``.

    For OPT (pad == eos == bos) ``num_padding_at_beginning=1`` skips the BOS at index 0, so
    ``c_ind`` is the first real pad. Any pad-id token inside the text (an EOS) counts too, which
    is where this rule and ``reward_end_indices(attention_mask) + 1`` disagree.

    Shape: input_ids (B, L); returns (B,) int64.
    """
    is_pad = input_ids == pad_token_id
    L = input_ids.shape[1]
    target = is_pad & (is_pad.long().cumsum(-1) == num_padding_at_beginning + 1)
    first = target.long().argmax(-1)
    return torch.where(target.any(-1), first, torch.full_like(first, L))


def first_divergence_indices(a: torch.Tensor, b: torch.Tensor, *, if_identical: int) -> torch.Tensor:
    """First position where rows of ``a`` and ``b`` differ; ``if_identical`` for identical rows.

    Shape: a, b (B, L); returns (B,) int64.
    """
    differ = a != b
    first = differ.long().argmax(-1)
    return torch.where(differ.any(-1), first, torch.full_like(first, if_identical))


def identical_pairs(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor) -> torch.Tensor:
    """Which pairs have the same ids on both sides (upstream scores those with its own rule).

    Shape: *_ids (B, L); returns (B,) bool.
    """
    return ~(chosen_ids != rejected_ids).any(-1)


class PairwiseLossOutput(NamedTuple):
    """Result of ``pairwise_reward_loss``.

    ``loss``: () batch-mean pairwise loss. ``chosen_end_scores`` / ``rejected_end_scores``: (B,)
    values at ``end - 1`` (upstream's misnamed ``chosen_mean_scores``/``rejected_mean_scores``).
    """

    loss: torch.Tensor
    chosen_end_scores: torch.Tensor
    rejected_end_scores: torch.Tensor


def pairwise_read_ends(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_end: torch.Tensor,
                       rejected_end: torch.Tensor) -> torch.Tensor:
    """One past the last position :func:`pairwise_reward_loss` reads in each pair: the longer side's
    end (so the shorter side's padding is read: docs/upstream.md#the-reward-models-pairwise-loss-reads-padding), or the row end ``L`` for an identical
    pair. Shape: *_ids (B, L), *_end (B,) -> (B,) on the ends' device."""
    L = chosen_ids.shape[1]
    identical = identical_pairs(chosen_ids, rejected_ids).to(chosen_end.device)
    c_end, r_end = chosen_end.long(), rejected_end.long()
    return torch.where(identical, torch.full_like(c_end, L), torch.maximum(c_end, r_end))


def pairwise_reward_loss(
    chosen_values: torch.Tensor,
    rejected_values: torch.Tensor,
    chosen_ids: torch.Tensor,
    rejected_ids: torch.Tensor,
    chosen_end: torch.Tensor,
    rejected_end: torch.Tensor,
    *,
    compute_fp32_loss: bool = False,
) -> PairwiseLossOutput:
    """Upstream's step-2 ``RewardModel.forward`` loss, vectorised over the batch.

    Per pair: ``end = max(chosen_end, rejected_end)`` and ``div`` = first position where the ids
    differ; an identical pair uses ``end = L``, ``div = L - 1`` and scores the rejected side at
    ``chosen_end``. The pair loss is ``mean(-logsigmoid(c - r))`` over ``[div, end)`` (pad
    positions of the shorter side included, as upstream); the loss is the batch mean. An empty span
    gives ``nan``, as upstream's mean of an empty slice does. ``div == 0`` is rejected, as
    upstream's assert does.

    ``chosen_end``/``rejected_end`` are upstream's ``c_ind``/``r_ind``: one past the last scored
    token (``upstream_end_indices(...)``, or ``reward_end_indices(mask) + 1``). End scores are
    the values at ``end - 1`` (Python indexing, so ``end == 0`` reads the last position as
    upstream would). ``compute_fp32_loss`` casts the values to float32 before the loss.

    Shape: *_values (B, L), *_ids (B, L), *_end (B,); returns ``PairwiseLossOutput``.
    """
    B, L = chosen_ids.shape
    device = chosen_values.device
    identical = identical_pairs(chosen_ids, rejected_ids)
    divergence = first_divergence_indices(chosen_ids, rejected_ids, if_identical=L - 1).to(device)
    if bool((divergence == 0).any()):
        raise ValueError(
            "pairwise_reward_loss: a chosen/rejected pair differs at position 0; the pair must "
            "share at least its first token (the prompt)"
        )
    c_end = chosen_end.to(device).long()
    r_end = torch.where(identical.to(device), c_end, rejected_end.to(device).long())
    end = pairwise_read_ends(chosen_ids, rejected_ids, c_end, r_end)

    c, r = chosen_values, rejected_values
    if compute_fp32_loss:
        c, r = c.float(), r.float()
    positions = torch.arange(L, device=device)
    span = (positions[None, :] >= divergence[:, None]) & (positions[None, :] < end[:, None])  # (B, L)
    per_token = -F.logsigmoid(c - r)
    per_pair = masked_sum(per_token, span, dim=1) / span.sum(1)
    loss = per_pair.sum() / B

    def _at(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        index = torch.remainder(ends - 1, L)  # end == 0 reads index -1, like upstream
        return values.gather(1, index[:, None]).squeeze(1)

    return PairwiseLossOutput(loss, _at(chosen_values, c_end), _at(rejected_values, r_end))


# --------------------------------------------------------------------------------------------
# DPO (step2_dpo_finetuning)
# --------------------------------------------------------------------------------------------
def dpo_label_mask(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Upstream DPO's label mask for a ``DataCollatorReward`` batch (chosen rows, then rejected).

    ``input_ids != pad``, zeroed in both rows of a pair before their first differing position
    (identical pairs keep everything): a stand-in for a prompt mask.

    Shape: input_ids (2B, L); returns (2B, L) int64.
    """
    B = input_ids.shape[0] // 2
    chosen, rejected = input_ids[:B], input_ids[B:]
    divergence = first_divergence_indices(chosen, rejected, if_identical=0).repeat(2)  # (2B,)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    keep = (input_ids != pad_token_id) & (positions[None, :] >= divergence[:, None])
    return keep.long()


class DPOOutput(NamedTuple):
    """Result of ``dpo_loss``: ``losses`` (B,) per pair (upstream takes their mean), and the
    detached implicit rewards ``beta * (policy - ref)`` for chosen and rejected, (B,) each."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> DPOOutput:
    """DPO loss with conservative label smoothing (upstream's step2_dpo_finetuning).

    ``logits = beta * ((pi_c - ref_c) - (pi_r - ref_r))``;
    ``loss = -logsigmoid(logits) * (1 - eps) - logsigmoid(-logits) * eps`` with
    ``eps = label_smoothing`` (cDPO: preferences flipped with probability eps).

    Shape: every input (B,) summed sequence log-probs; returns ``DPOOutput`` of (B,) tensors.
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    logits = beta * (chosen_logratios - rejected_logratios)
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return DPOOutput(
        losses,
        (beta * chosen_logratios).detach(),
        (beta * rejected_logratios).detach(),
    )

