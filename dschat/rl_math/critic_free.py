"""Pure math of the critic-free step-3 algorithms (GRPO, Dr.GRPO, RLOO, REINFORCE++, ReMax), the
KL-as-a-loss term and truncated importance sampling: torch only, no DeepSpeed, no ``args``.

PPO's own math (GAE, the clipped losses, the KL-penalised rewards) is in :mod:`dschat.rl_math.ppo`;
this module reuses it and follows its index conventions (``(B, T)`` per-token tensors, position
``i`` scoring token ``i + 1``; callers slice from ``start = P - 1``). Each formula is written in
``docs/algorithms.md`` next to its paper, and pinned by hand-computed cases in
``tests/rlhf/test_rl_algorithms.py``.

Groups: a generation batch holds each prompt ``K`` times in a row (``--num_generations K``), so a
group is ``K`` consecutive rows and ``rewards.view(-1, K)`` has one group per row. Advantages that
use group statistics are computed on whole generation batches, before micro-batching, so how the
batch is later split changes nothing.
"""
from __future__ import annotations

from typing import Literal

import torch

from dschat.rl_math.ppo import get_advantages_and_returns, kl_penalty
from dschat.rl_math.stats import masked_sum

__all__ = [
    "ALGORITHMS",
    "CRITIC_FREE",
    "GROUP_ALGORITHMS",
    "has_critic",
    "LOSS_AGGREGATIONS",
    "Algorithm",
    "LossAggregation",
    "grpo_advantages",
    "rloo_advantages",
    "remax_advantages",
    "sequence_kl",
    "returns_to_go",
    "token_advantages",
    "policy_loss_per_token",
    "aggregate_loss",
    "tis_weights",
    "IMPORTANCE_SAMPLING_LEVELS",
    "clipped_surrogate",
    "sequence_ratio",
    "overlong_penalty",
    "informative_groups",
]

Algorithm = Literal["ppo", "grpo", "rloo", "reinforce_pp", "remax"]
LossAggregation = Literal["token", "sequence", "token_sum"]

ALGORITHMS: tuple[str, ...] = ("ppo", "grpo", "rloo", "reinforce_pp", "remax")
#: Algorithms without a value model: no critic engine is built, loaded or saved.
CRITIC_FREE: frozenset[str] = frozenset({"grpo", "rloo", "reinforce_pp", "remax"})
#: Algorithms whose baseline is the other answers to the same prompt (need ``K >= 2``).
GROUP_ALGORITHMS: frozenset[str] = frozenset({"grpo", "rloo"})
LOSS_AGGREGATIONS: tuple[str, ...] = ("token", "sequence", "token_sum")
#: ``--importance_sampling_level``: one ratio per token (PPO, GRPO) or one per answer (GSPO).
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")


def has_critic(algorithm: str) -> bool:
    """Whether ``--algorithm`` builds, trains, checkpoints and saves a critic (value model)."""
    return algorithm not in CRITIC_FREE


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (B / K, K): one group of ``K`` consecutive answers per row."""
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def informative_groups(rewards: torch.Tensor, group_size: int, *, atol: float = 1e-4) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: which groups hold answers of different rewards.

    A group whose ``K`` rewards are all equal has a zero reward advantage under a group baseline
    (GRPO, RLOO), so it carries no policy gradient from its reward. Equal means ``max - min <= atol``:
    ``atol`` is well above GRPO's ``eps`` (1e-6), so float noise between equal scores is not made an
    advantage (GRPO's std division would scale a spread of 1e-4 up to order 1: +-0.7 for K = 2); real differences
    that small are dropped with it. Shape: rewards (B,) with ``B = G x K``; returns (G,) bool, True
    where the group's rewards differ.
    """
    groups = _groups(rewards, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > atol


# ------------------------------------------------------------------------------------------------
# Sequence-level advantages
# ------------------------------------------------------------------------------------------------
def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage (Shao et al. 2024, DeepSeekMath, eq. 3, section 4.1.2)::

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    with the sample (unbiased) standard deviation. ``scale_by_std=False`` is Dr.GRPO's
    (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``A_i = r_i - mean(r_group)``, since
    dividing by the std up-weights groups whose answers barely differ.

    Shape: rewards (B,) with B a multiple of ``group_size``; returns (B,).
    """
    grouped = _groups(rewards.float(), group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        centred = centred / (std + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, eq. 6)::

        A_i = r_i - 1/(K - 1) * sum_{j != i} r_j  ( = K / (K - 1) * (r_i - mean(r_group)) )

    Shape: rewards (B,) with B a multiple of ``group_size >= 2``; returns (B,).
    """
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 answers per prompt (--num_generations >= 2)")
    grouped = _groups(rewards.float(), group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def remax_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2024, eq. 5): the baseline is the reward of the greedy answer to the same
    prompt, ``A_i = r(x, y_i) - r(x, y_greedy)``.

    Shape: rewards, greedy_rewards (B,) aligned row by row; returns (B,).
    """
    if rewards.shape != greedy_rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and greedy rewards {tuple(greedy_rewards.shape)} differ")
    return rewards.float() - greedy_rewards.float()


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *,
                estimator: str = "k1") -> torch.Tensor:
    """Per-answer KL to the reference: ``sum_t k(logprobs_t, ref_logprobs_t)`` over the answer's
    tokens, with an estimator of :func:`dschat.rl_math.ppo.kl_penalty`. A critic-free algorithm that
    keeps the KL in the reward subtracts ``kl_ctl`` times this from the answer's score (RLOO,
    ReMax; Ahmadian et al. 2024, eq. 2).

    Shape: logprobs, ref_logprobs, mask (B, T); returns (B,).
    """
    return masked_sum(kl_penalty(logprobs.float(), ref_logprobs.float(), estimator=estimator), mask, dim=1)


def returns_to_go(rewards: torch.Tensor, start: int, *, gamma: float = 1.0,
                  skip: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++'s token returns (Hu 2025, eq. 6): ``G_t = sum_{s >= t} gamma^(s - t) * r_s`` over
    positions ``[start, T)``, where ``r`` holds ``-kl_ctl * KL_t`` on every token and the score at
    the reward slot (:func:`dschat.rl_math.ppo.compute_rewards`). It is GAE with ``V = 0`` and
    ``lambda = 1``, which is how it is computed.

    ``skip`` (B, T) bool marks positions outside the actor's trajectory (a multi-turn episode's
    observation tokens): ``G_t = 0`` there, and the sum runs over unskipped positions only, each
    discounted by the number of unskipped steps between (``get_advantages_and_returns``'s ``skip``).

    Shape: rewards, skip (B, T) (rewards zeroed after each answer's end); returns (B, T - start).
    """
    advantages, _ = get_advantages_and_returns(torch.zeros_like(rewards), rewards, start, gamma=gamma, lam=1.0,
                                               skip=skip)
    return advantages


def token_advantages(sequence_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each answer's advantage on every one of its tokens (0 elsewhere).

    Shape: sequence_advantages (B,), mask (B, T'); returns (B, T').
    """
    return sequence_advantages[:, None].to(torch.float32) * mask.to(torch.float32)


# ------------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------------
def tis_weights(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training"): ``w_t = min(pi_train(y_t) / pi_rollout(y_t), cap)``, detached.

    The rollout's log-probs come from the decoder that generated it (dschat's sampling loop, CUDA
    graphs, oneDNN kernels); the training forward computes slightly different ones. ``w`` reweights
    each token's loss so its gradient estimates the training policy's, truncated at ``cap``.

    Shape: both (B, T'); returns (B, T').
    """
    if not cap > 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    return torch.exp(train_logprobs.detach().float() - rollout_logprobs.float()).clamp(max=cap)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, *, cliprange: float = 0.2,
                      cliprange_high: float | None = None, dual_clip: float = 0.0) -> torch.Tensor:
    """The clipped surrogate loss of each element, without a mask::

        l = max(-A * r, -A * clamp(r, 1 - c_low, 1 + c_high))
        l = min(l, -C * A)   where A < 0, with --dual_clip C > 1

    ``c_low = cliprange``; ``c_high = cliprange_high`` (DAPO's "clip-higher", Yu et al. 2025, eq. 10),
    ``cliprange`` when None. ``dual_clip`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games
    with Deep RL", eq. 5): a negative advantage's loss is at most ``C * |A|``, however large ``r``
    has grown (0: off). With the defaults it is PPO's ``max(-A r, -A clamp(r, 1 - c, 1 + c))``.

    Shape: ratio, advantages broadcastable; returns their broadcast shape.
    """
    high = cliprange if cliprange_high is None else cliprange_high
    loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high))
    if dual_clip:
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (0: off), got {dual_clip}")
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    return loss


def sequence_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy
    Optimization", eq. 7), length-normalised, in its token form (section 4.3, eq. 13)::

        s_i   = exp(1/|y_i| * sum_t (logprobs_it - old_logprobs_it))
        s_it  = sg[s_i] * exp(logprobs_it - sg[logprobs_it])

    ``sg`` is stop-gradient. Every token of answer ``i`` holds the value ``s_i``; the gradient of
    ``s_it`` is ``s_i * grad log pi(y_it)``, so with one advantage per answer and the per-answer mean
    of :func:`aggregate_loss` (``"sequence"``) the loss's value, clipping and gradient are GSPO's
    sequence-level ones: ``grad (1/|y_i|) sum_t l(s_it) = grad l(s_i)`` (tested). An answer without
    tokens gets ``s_i = 1``.

    Shape: all (B, T'); returns (B, T') (any value where ``mask`` is 0: callers mask the loss).
    """
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    mean_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / lengths
    return torch.exp(mean_log_ratio.detach() + logprobs - logprobs.detach())


def policy_loss_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, *, cliprange: float = 0.2, cliprange_high: float | None = None,
                          dual_clip: float = 0.0, level: str = "token") -> torch.Tensor:
    """The PPO clipped surrogate per token (:func:`clipped_surrogate`). With ``level="token"`` the
    ratio is ``r = exp((logprobs - old_logprobs) * mask)`` (masked before ``exp``, as
    :func:`dschat.rl_math.ppo.actor_loss_fn`, whose sum this is before normalising with the
    defaults); with ``level="sequence"`` it is GSPO's :func:`sequence_ratio`, clipped per answer
    with the same bounds. GRPO, RLOO, REINFORCE++ and ReMax all use it (with ``r = 1`` on-policy it
    is ``-A * logprob``'s gradient).

    Shape: all (B, T'); returns (B, T') (0 where ``mask`` is 0).
    """
    if level == "token":
        ratio = torch.exp((logprobs - old_logprobs) * mask)
    elif level == "sequence":
        ratio = sequence_ratio(logprobs, old_logprobs, mask)
    else:
        raise ValueError(f"policy_loss_per_token: level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")
    loss = clipped_surrogate(ratio, advantages, cliprange=cliprange, cliprange_high=cliprange_high,
                             dual_clip=dual_clip)
    return loss * mask


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``factor``: with answer
    length ``n``, ``M = max_len`` (``--max_answer_seq_len``) and ``L = buffer_len``::

        0                              n <= M - L
        -factor * (n - (M - L)) / L    M - L < n <= M      (linear, down to -factor at n = M)
        -factor                        n > M

    ``buffer_len`` 0 is off (all zeros). Added to the answer's score. For a multi-turn episode the
    caller passes the actor's tokens (the action mask's count), not the environment's.

    Shape: lengths (B,) int or float; returns (B,) float32.
    """
    if not 0 <= buffer_len <= max_len or factor < 0:
        raise ValueError(f"overlong_penalty needs 0 <= buffer_len <= max_len and factor >= 0, got buffer_len "
                         f"{buffer_len}, max_len {max_len}, factor {factor}")
    lengths = lengths.to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    over = (lengths - (max_len - buffer_len)).clamp(min=0.0, max=float(buffer_len))
    return -factor * over / buffer_len


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, *,
                   normalizer: float | torch.Tensor | None = None, max_len: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss to the micro-batch's share of the optimizer step's loss.

    * ``"token"``: ``sum_{i,t} l_it / N_tokens`` -- every token weighs the same (PPO here, DAPO).
    * ``"sequence"``: ``sum_i (sum_t l_it / |o_i|) / N_seq`` -- GRPO's paper form (eq. 3): each answer
      weighs the same, so a long answer's tokens weigh less (the length bias Dr.GRPO removes).
    * ``"token_sum"``: ``sum_i (sum_t l_it / max_len) / N_seq`` -- Dr.GRPO (Liu et al. 2025, eq. 4):
      a constant ``max_len`` (``--max_answer_seq_len``) instead of ``|o_i|``.

    ``normalizer`` is ``N_tokens`` (token) or ``N_seq`` (the others) of the whole optimizer step
    divided by ``GA x world`` (see :func:`dschat.rl_math.ppo.actor_loss_fn`), so micro-batch losses sum
    to the full-batch loss; ``None`` uses this micro-batch's own count. Answers without tokens
    count for nothing.

    Shape: per_token, mask (B, T'); returns ().
    """
    mask = mask.to(per_token.dtype)
    if mode == "token":
        count = mask.sum() if normalizer is None else normalizer
        return (per_token * mask).sum() / count
    lengths = mask.sum(dim=1)
    if mode == "sequence":
        per_answer = (per_token * mask).sum(dim=1) / lengths.clamp(min=1.0)
    elif mode == "token_sum":
        if not max_len:
            raise ValueError("aggregate_loss: token_sum needs max_len (the longest possible answer)")
        per_answer = (per_token * mask).sum(dim=1) / float(max_len)
    else:
        raise ValueError(f"aggregate_loss: mode must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    count = (lengths > 0).sum() if normalizer is None else normalizer
    return per_answer.sum() / count
