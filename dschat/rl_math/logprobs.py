"""Token likelihoods: each label's log-prob under a model's logits (fp32 for half-precision logits),
a sequence's summed log-prob (DPO), and the causal-LM loss (step 1, PPO-ptx).

Shape conventions as in :mod:`dschat.rl_math`: position ``i`` of ``logits`` scores token ``i + 1``.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["gather_log_probs", "sequence_log_probs", "causal_lm_loss"]


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, fp32: bool = False) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits)``: upstream's
    ``log_softmax(logits).gather(labels)``.

    fp32/fp64 logits: ``logits[label] - logsumexp(logits)`` in their own dtype, without
    materialising a second ``(B, T, V)`` tensor.

    fp16/bf16 logits (with or without ``fp32``, upstream's ``--compute_fp32_loss``): the
    log-sum-exp and the subtraction run in float32, one batch row at a time, and the result is
    float32. Subtracting a low-precision log-sum-exp (about 20-30 for a 32k vocabulary, where bf16's
    step is 0.125) from a low-precision logit would be off by up to ~0.07 nats per token, which
    made the reference model's log-probs disagree with the rollout's fp32 ones (a KL penalty at
    initialisation). The backward is written out (``softmax`` recomputed row by row from the saved
    logits and the (B, T) log-sum-exp), so neither pass keeps a ``(B, T, V)`` float32 copy: the
    peak extra memory is one row's ``(T, V)`` float32 logits.

    Shape: logits (B, T, V), labels (B, T) integer ids in ``[0, V)``; returns (B, T).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"gather_log_probs: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
            "must agree on every dim but the last; pass logits[:, :-1] with labels seq[:, 1:]"
        )
    del fp32  # half precision is always computed in float32 (see above); kept for upstream callers
    index = labels.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64) or not logits.dtype.is_floating_point:
        picked = logits.gather(-1, index).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    return _HalfLogProbs.apply(logits, index)


class _HalfLogProbs(torch.autograd.Function):
    """``log_softmax(logits.float()).gather(index)`` for fp16/bf16 ``logits``, row by row.

    Forward: per batch row, ``logsumexp`` over the row's float32 copy. Backward:
    ``d logits = g * (onehot(index) - softmax(logits))``, the softmax recomputed per row from the
    saved (already alive) low-precision logits and the float32 log-sum-exp.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        lse = torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])  # (B, T) fp32
        picked = logits.gather(-1, index).squeeze(-1).float()
        ctx.save_for_backward(logits, index, lse)
        return picked - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, index, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for b in range(logits.shape[0]):
            g = grad[b].float().unsqueeze(-1)  # (T, 1)
            row = torch.exp(logits[b].float() - lse[b].unsqueeze(-1)).mul_(-g)  # -g * softmax
            row.scatter_add_(-1, index[b], g)
            grad_logits[b] = row
        return grad_logits, None


def sequence_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, *, fp32: bool = False
) -> torch.Tensor:
    """Sum of the log-probs of the shifted labels where ``mask`` is set (upstream's
    ``get_batch_logps``): position ``i`` of ``logits`` scores ``labels[i + 1]``, weighted by
    ``mask[i + 1]``. Masked labels are replaced by 0 before the gather, as upstream's
    ``labels * mask`` does, so ignore-ids such as -100 are safe.

    Shape: logits (B, L, V), labels (B, L), mask (B, L); returns (B,).
    """
    if logits.shape[:-1] != labels.shape or labels.shape != mask.shape:
        raise ValueError(
            f"sequence_log_probs: logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and "
            f"mask {tuple(mask.shape)} must share (B, L)"
        )
    shifted_mask = mask[:, 1:]
    shifted_labels = torch.where(shifted_mask.bool(), labels[:, 1:], torch.zeros_like(labels[:, 1:]))
    per_token = gather_log_probs(logits[:, :-1], shifted_labels, fp32=fp32)
    return (per_token * shifted_mask).sum(-1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, fp32: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy; positions labelled -100 are ignored.

    Token t's logits predict label t+1 (the shift every causal LM uses). ``fp32`` upcasts the
    logits first (upstream's ``--compute_fp32_loss``).

    Shape: logits (B, T, V), labels (B, T) -> scalar.
    """
    shift_logits = logits[..., :-1, :]
    if fp32:
        shift_logits = shift_logits.float()
    shift_labels = labels[..., 1:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=-100
    )
