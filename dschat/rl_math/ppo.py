"""PPO's math for step 3: the KL penalty, per-token rewards, GAE, the clipped actor and critic
losses, and the policy-ratio diagnostics (upstream's ``DeepSpeedPPOTrainer`` formulas as pure
functions; index conventions in :mod:`dschat.rl_math`)."""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from dschat.rl_math.stats import masked_mean

__all__ = ["KLEstimator", "RewardAt", "kl_penalty", "answer_span", "sequence_end_indices", "reward_positions",
           "missing_eos_penalty", "mask_after_ends", "compute_rewards", "get_advantages_and_returns", "actor_loss_fn",
           "critic_loss_fn", "PolicyStats", "ppo_policy_stats"]

KLEstimator = Literal["k1", "k2", "k3"]
RewardAt = Literal["after_last", "last"]

_KL_ESTIMATORS = ("k1", "k2", "k3")
_REWARD_AT = ("after_last", "last")


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: KLEstimator = "k1"
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (the actor).

    With ``d = logprobs - ref_logprobs = log(pi(x) / pi_ref(x))`` (Schulman, "Approximating KL
    Divergence", 2020):

    * ``"k1"``: ``d``. Unbiased, since ``KL = E_pi[log pi/pi_ref]`` by definition; high variance and
      negative for individual tokens. Upstream's (only) estimator.
    * ``"k2"``: ``0.5 * d**2``. Biased (its expectation is not the KL, only close to it when the
      two policies are close), always >= 0, low variance.
    * ``"k3"``: ``exp(-d) - 1 + d`` i.e. ``(r - 1) - log r`` with ``r = pi_ref/pi``. Unbiased,
      because ``E_pi[pi_ref/pi] = 1`` makes the ``r - 1`` term a zero-mean control variate; always
      >= 0 and lower variance than k1.

    Shape: logprobs, ref_logprobs (B, T); returns (B, T).
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"kl_penalty: estimator must be one of {_KL_ESTIMATORS}, got {estimator!r}")


def answer_span(action_mask: torch.Tensor, start: int) -> torch.Tensor:
    """Length of each row's answer span: one past the last nonzero of ``action_mask[:, start:]``
    (0 for a row with none).

    The span runs from ``start`` to the row's last actor token and includes any holes (positions
    scoring environment observation tokens, 0 in ``action_mask``) inside it. For a mask that is
    contiguous from ``start`` (``1...1 0...0``) it equals the count ``action_mask[:, start:].sum(1)``.

    Shape: action_mask (B, T); returns (B,) int64, each in ``[0, T - start]``.
    """
    answer = action_mask[:, start:] != 0
    if answer.shape[1] == 0:
        return torch.zeros(answer.shape[0], dtype=torch.long, device=answer.device)
    one_based = torch.arange(1, answer.shape[1] + 1, device=answer.device)
    return torch.where(answer, one_based, 0).amax(dim=1)


def sequence_end_indices(
    action_mask: torch.Tensor, start: int, *, reward_at: RewardAt = "after_last"
) -> torch.Tensor:
    """Exclusive end of each answer's reward span, in log-prob positions.

    With ``n = answer_span(action_mask, start)`` (the count of answer tokens for a contiguous mask,
    one past the last actor token for a multi-turn mask with observation holes):
    ``"after_last"`` gives upstream's ``ends = start + n + 1`` (it can be ``T + 1`` for an answer
    that fills ``max_answer_seq_len``); rewards and values from ``ends`` on are zeroed in
    ``train_rlhf``. ``"last"`` gives ``max(start + n, start + 1)``: one past the last real action
    token, so nothing after the scored token takes part in GAE.

    Shape: action_mask (B, T); returns (B,) int64.
    """
    _check_reward_at(reward_at)
    n = answer_span(action_mask, start)
    if reward_at == "after_last":
        return start + n + 1
    return torch.clamp(start + n, min=start + 1)


def reward_positions(
    action_mask: torch.Tensor, start: int, *, reward_at: RewardAt = "after_last"
) -> torch.Tensor:
    """Position in ``rewards`` (B, T) where the clipped reward-model score is added, with
    ``n = answer_span(action_mask, start)`` (in a multi-turn episode the slot is set by the last
    actor turn; an observation inside the episode never moves it):

    * ``"after_last"`` (upstream): the last element of ``rewards[j, start:ends[j]]``, i.e.
      ``min(start + n, T - 1)``: the slot of the first pad after the answer (one past the last
      action token: docs/upstream.md#where-step-3-adds-the-reward), or the last answer slot when
      the answer has no pad. Decoding
      stops when every row has ended, so the row that ended last has its EOS in the last column and
      no pad after it: its score lands on its EOS slot, one slot earlier than the other rows'
      (docs/upstream.md#pad-and-eos). ``"last"`` has no such exception.
    * ``"last"`` (opt-in): ``start + n - 1``, the last real action token (``start`` if ``n == 0``).

    Shape: action_mask (B, T); returns (B,) int64.
    """
    _check_reward_at(reward_at)
    T = action_mask.shape[1]
    n = answer_span(action_mask, start)
    if reward_at == "after_last":
        return torch.clamp(start + n, max=T - 1)
    return torch.clamp(start + n - 1, min=start)


def missing_eos_penalty(scores: torch.Tensor, ended: torch.Tensor, penalty: float) -> torch.Tensor:
    """``scores - penalty`` where the answer never produced EOS (``ended`` False), else ``scores``.

    The reward model only ever scored complete answers (every training text ends with EOS), so its
    score of an answer cut at the length limit is an extrapolation an actor can exploit by never
    stopping. Shapes: scores (B,), ended (B,) bool.
    """
    if penalty == 0.0:
        return scores
    return scores - penalty * (~ended.bool()).to(scores.dtype)


def mask_after_ends(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Copy of ``x`` with ``x[i, ends[i]:] = 0`` (upstream zeroes rewards and values after
    ``ends`` before GAE so padding neither earns reward nor bootstraps a value).

    Upstream does this in place on ``values``, which aliases the ``old_values`` later used by the
    critic loss; callers should pass the returned tensor as ``old_values`` to get the same result.

    Shape: x (B, T), ends (B,); returns (B, T).
    """
    positions = torch.arange(x.shape[1], device=x.device)
    return x.masked_fill(positions[None, :] >= ends[:, None].to(x.device), 0)


def compute_rewards(
    prompts: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    reward_score: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    kl_ctl: float = 0.1,
    clip_reward_value: float = 5.0,
    kl_estimator: KLEstimator = "k1",
    reward_at: RewardAt = "after_last",
) -> torch.Tensor:
    """Per-token PPO rewards: ``-kl_ctl * KL`` everywhere, plus the clipped RM score at one slot.

    Upstream's ``DeepSpeedPPOTrainer.compute_rewards`` by default: the KL term covers the whole
    ``T`` length (prompt positions too; GAE ignores them), ``start = P - 1``, and
    ``clamp(reward_score, -clip_reward_value, clip_reward_value)`` is added at
    ``reward_positions(action_mask, start, reward_at=reward_at)``. Rewards after ``ends`` are
    *not* zeroed here (upstream does that in ``train_rlhf``): use ``mask_after_ends`` with
    ``sequence_end_indices``.

    Shape: prompts (B, P) (only P is used), log_probs / ref_log_probs / action_mask (B, T),
    reward_score (B,); returns (B, T) in log_probs' dtype.
    """
    if log_probs.shape != ref_log_probs.shape or log_probs.shape != action_mask.shape:
        raise ValueError(
            f"compute_rewards: log_probs {tuple(log_probs.shape)}, ref_log_probs "
            f"{tuple(ref_log_probs.shape)} and action_mask {tuple(action_mask.shape)} must match; "
            "action_mask is attention_mask[:, 1:]"
        )
    start = prompts.shape[1] - 1
    rewards = -kl_ctl * kl_penalty(log_probs, ref_log_probs, estimator=kl_estimator)
    score = torch.clamp(reward_score, -clip_reward_value, clip_reward_value).to(rewards.dtype)
    where = reward_positions(action_mask, start, reward_at=reward_at).to(rewards.device)
    return rewards.scatter_add(1, where[:, None], score[:, None])


def get_advantages_and_returns(
    values: torch.Tensor,
    rewards: torch.Tensor,
    start: int,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    skip: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over positions ``[start, T)`` (upstream's trlX-style GAE).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_T = 0``, and
    ``A_t = delta_t + gamma * lam * A_{t+1}``; ``returns = A + V[:, start:]``. The scan runs over
    time, batched over rows, with upstream's operation order (so results match bit for bit).
    No whitening (upstream has none; see ``masked_whiten``).

    ``skip`` (B, T) bool marks positions outside the actor's trajectory (a multi-turn episode's
    environment observation tokens). A skipped position gets ``A_t = 0`` and the recursion passes
    over it: ``V_{t+1}`` and ``A_{t+1}`` above are those of the next unskipped position (``V = 0``
    and ``A = 0`` past the last one). Each row's result is therefore GAE on the row with its skipped
    positions removed, scattered back with 0 at the holes; ``returns`` there is ``V_t``. ``None``
    or an all-False ``skip`` computes exactly the result without it.

    Shape: values, rewards, skip (B, T); returns advantages (B, T - start) detached, and
    returns (B, T - start).
    """
    length = rewards.shape[-1]
    if skip is not None and skip.shape != rewards.shape:
        raise ValueError(
            f"get_advantages_and_returns: skip {tuple(skip.shape)} must match rewards {tuple(rewards.shape)}"
        )
    if skip is not None and bool(skip[:, start:].any()):
        advantages = _gae_with_skip(values, rewards, start, skip.bool(), gamma=gamma, lam=lam)
        return advantages.detach(), advantages + values[:, start:]
    lastgaelam: torch.Tensor | float = 0.0
    advantages_reversed = []
    for t in reversed(range(start, length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values[:, start:]
    return advantages.detach(), returns


def _gae_with_skip(values: torch.Tensor, rewards: torch.Tensor, start: int, skip: torch.Tensor, *,
                   gamma: float, lam: float) -> torch.Tensor:
    """GAE's scan where ``skip[:, t]`` carries ``V_{t+1}`` and ``A_{t+1}`` over position ``t``
    unchanged and sets ``A_t = 0`` (contract in ``get_advantages_and_returns``). Shape: (B, T) in,
    (B, T - start) out."""
    nextvalues = torch.zeros_like(values[:, -1])
    lastgaelam = torch.zeros_like(rewards[:, -1])
    advantages_reversed = []
    for t in reversed(range(start, rewards.shape[-1])):
        keep = ~skip[:, t]
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = torch.where(keep, delta + gamma * lam * lastgaelam, lastgaelam)
        nextvalues = torch.where(keep, values[:, t], nextvalues)
        advantages_reversed.append(torch.where(keep, lastgaelam, 0.0))
    return torch.stack(advantages_reversed[::-1], dim=1)


# --------------------------------------------------------------------------------------------
# PPO losses and diagnostics
# --------------------------------------------------------------------------------------------
def _normalise(
    total: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None
) -> torch.Tensor:
    """``total / mask.sum()`` (upstream), or ``total / normalizer`` when one is given."""
    return total / (mask.sum() if normalizer is None else normalizer)


def actor_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange: float = 0.2,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate loss (upstream's ``actor_loss_fn``).

    ``log_ratio = (logprobs - old_logprobs) * mask`` is masked *before* ``exp`` so padding cannot
    overflow; the loss is ``sum(max(-A * r, -A * clamp(r, 1 - c, 1 + c)) * mask) / normalizer``.

    ``normalizer=None`` divides by ``mask.sum()`` (upstream: a per-micro-batch token mean). Pass
    the token count of the whole optimizer step instead and the micro-batch losses *sum* to the
    full-batch loss. DeepSpeed's engine divides each micro-batch loss by
    ``gradient_accumulation_steps`` and averages gradients over ranks, so the step's gradient is
    the full-batch token mean when ``normalizer = total_tokens / (gradient_accumulation_steps *
    world_size)``.

    Shape: logprobs, old_logprobs, advantages, mask (B, T - start); returns ().
    """
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return _normalise(torch.sum(torch.max(pg_loss1, pg_loss2) * mask), mask, normalizer)


def critic_loss_fn(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float = 0.2,
    compute_fp32_loss: bool = False,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped value loss (upstream's ``critic_loss_fn``).

    ``v_clip = clamp(values, old - c, old + c)``;
    ``0.5 * sum(max((v - R)**2, (v_clip - R)**2) * mask) / normalizer``. With
    ``compute_fp32_loss`` the values are cast to float32 after clipping, as upstream (docs/upstream.md#the-critics-loss-in-fp32). ``normalizer``
    as in ``actor_loss_fn``.

    Shape: values, old_values, returns, mask (B, T - start); returns ().
    """
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    if compute_fp32_loss:
        values = values.float()
        values_clipped = values_clipped.float()
    vf_loss1 = (values - returns) ** 2
    vf_loss2 = (values_clipped - returns) ** 2
    return 0.5 * _normalise(torch.sum(torch.max(vf_loss1, vf_loss2) * mask), mask, normalizer)


class PolicyStats(NamedTuple):
    """Diagnostics of one PPO update over the masked tokens (0-dim detached tensors).

    ``approx_kl`` is CleanRL's ``losses/approx_kl``: the k3 estimator ``mean((r - 1) - log r)`` with
    ``r = pi_new / pi_old`` on tokens sampled from ``pi_old``. ``clip_frac`` is the fraction of
    tokens whose ratio lies outside ``[1 - cliprange, 1 + cliprange_high]`` (``cliprange_high``
    defaults to ``cliprange``: ``|r - 1| > cliprange``).
    """

    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor
    approx_kl: torch.Tensor
    clip_frac: torch.Tensor


@torch.no_grad()
def ppo_policy_stats(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, *, cliprange: float = 0.2,
    cliprange_high: float | None = None, level: str = "token",
) -> PolicyStats:
    """Ratio statistics, approximate KL and clip fraction over the masked tokens. The clip fraction
    tests the ratio the loss clips: each token's, or with ``level="sequence"`` (GSPO) its answer's
    ``exp(mean log ratio)``, counted once per token so it adds up over micro-steps as the others do.

    Shape: logprobs, old_logprobs, mask (B, T - start); returns a ``PolicyStats`` of scalars.
    """
    keep = mask.bool()
    log_ratio = torch.where(keep, (logprobs - old_logprobs).float(), 0.0)
    ratio = torch.exp(log_ratio)
    clipped = ratio
    if level == "sequence":
        per_answer = log_ratio.sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)
        clipped = torch.exp(per_answer).expand_as(ratio)
    inf = torch.tensor(float("inf"), device=ratio.device)
    high = cliprange if cliprange_high is None else cliprange_high
    return PolicyStats(
        ratio_mean=masked_mean(ratio, keep),
        ratio_max=torch.where(keep, ratio, -inf).max(),
        ratio_min=torch.where(keep, ratio, inf).min(),
        approx_kl=masked_mean((ratio - 1.0) - log_ratio, keep),
        clip_frac=masked_mean(((clipped < 1.0 - cliprange) | (clipped > 1.0 + high)).float(), keep),
    )


def _check_reward_at(reward_at: str) -> None:
    if reward_at not in _REWARD_AT:
        raise ValueError(f"reward_at must be one of {_REWARD_AT}, got {reward_at!r}")

