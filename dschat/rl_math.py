"""Pure RL math for DeepSpeed-Chat's three steps: torch only, no DeepSpeed, no transformers.

Everything here is a small function of tensors (no state, no ``args``), so each formula can be
read next to upstream's and pinned by a test (``tests/test_rl_math.py``). Hyperparameters are
keyword arguments whose defaults are upstream's hard-coded values (``ppo_trainer.py``:
``kl_ctl=0.1, clip_reward_value=5, cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95``;
DPO ``beta=0.1, label_smoothing=0.0``).

Index conventions for step 3 (upstream's, kept as they are):

* ``seq`` is ``(B, L)``: a prompt left-padded to exactly ``P`` tokens, then ``A`` answer tokens,
  right-padded. Log-probs, values and rewards are ``(B, T)`` with ``T = L - 1``: position ``i``
  scores token ``i + 1`` (``gather_log_probs(logits[:, :-1], seq[:, 1:])``).
* ``start = P - 1`` is the first position that scores an answer token, and
  ``action_mask = attention_mask[:, 1:]`` (``(B, T)``).
* ``n = action_mask[:, start:].sum(1)`` counts the non-pad answer tokens (upstream assumes they are
  contiguous from ``start``).

Defaults reproduce upstream exactly; anything beyond upstream (``reward_at="last"``, the k2/k3
estimators, ``normalizer``) is opt-in.
"""
from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "KLEstimator",
    "RewardAt",
    "gather_log_probs",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "kl_penalty",
    "sequence_end_indices",
    "reward_positions",
    "mask_after_ends",
    "compute_rewards",
    "get_advantages_and_returns",
    "actor_loss_fn",
    "critic_loss_fn",
    "PolicyStats",
    "ppo_policy_stats",
    "explained_variance",
    "reward_end_indices",
    "upstream_end_indices",
    "first_divergence_indices",
    "PairwiseLossOutput",
    "pairwise_reward_loss",
    "sequence_log_probs",
    "dpo_label_mask",
    "DPOOutput",
    "dpo_loss",
    "causal_lm_loss",
]

KLEstimator = Literal["k1", "k2", "k3"]
RewardAt = Literal["after_last", "last"]

_KL_ESTIMATORS = ("k1", "k2", "k3")
_REWARD_AT = ("after_last", "last")


# --------------------------------------------------------------------------------------------
# Log-probs
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is non-zero (over everything, or along ``dim``).

    Masked-out entries are excluded with ``where`` (not multiplied by 0), so a ``nan``/``inf``
    outside the mask does not leak in. Shape: x, mask (B, T) (any matching shapes).
    """
    zeros = torch.zeros((), dtype=x.dtype, device=x.device)
    kept = torch.where(mask.bool(), x, zeros)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is non-zero. An empty mask gives ``nan``.

    Shape: x, mask (B, T); returns a scalar, or (B,) for ``dim=1``.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the masked entries (a scalar).

    ``unbiased=True`` applies Bessel's correction ``n / (n - 1)`` (TRL's ``masked_var``
    convention, and ``torch.var``'s default), so ``masked_whiten`` output has unit sample variance.
    Shape: x, mask (B, T); returns ().
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.bool().sum()
        var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` with the mean and (unbiased) variance of its masked entries.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back (only the
    scale changes, as for rewards in TRL). Upstream DeepSpeed-Chat never whitens; this is for
    opt-in advantage whitening. Entries outside the mask are
    transformed too but do not influence the statistics.

    Shape: x, mask (B, T); returns (B, T).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# --------------------------------------------------------------------------------------------
# KL penalty and rewards (step 3)
# --------------------------------------------------------------------------------------------
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


def sequence_end_indices(
    action_mask: torch.Tensor, start: int, *, reward_at: RewardAt = "after_last"
) -> torch.Tensor:
    """Exclusive end of each answer's reward span, in log-prob positions.

    ``"after_last"`` gives upstream's ``ends = start + n + 1`` (it can be ``T + 1`` for an answer
    that fills ``max_answer_seq_len``); rewards and values from ``ends`` on are zeroed in
    ``train_rlhf``. ``"last"`` gives ``max(start + n, start + 1)``: one past the last real action
    token, so nothing after the scored token takes part in GAE.

    Shape: action_mask (B, T); returns (B,) int64.
    """
    _check_reward_at(reward_at)
    n = action_mask[:, start:].long().sum(1)
    if reward_at == "after_last":
        return start + n + 1
    return torch.clamp(start + n, min=start + 1)


def reward_positions(
    action_mask: torch.Tensor, start: int, *, reward_at: RewardAt = "after_last"
) -> torch.Tensor:
    """Position in ``rewards`` (B, T) where the clipped reward-model score is added.

    * ``"after_last"`` (upstream): the last element of ``rewards[j, start:ends[j]]``, i.e.
      ``min(start + n, T - 1)``: the slot of the first pad after the answer (one past the last
      action token, DSE PR #672), or the last answer slot when the answer has no pad. Decoding
      stops when every row has ended, so the row that ended last has its EOS in the last column and
      no pad after it: its score lands on its EOS slot, one slot earlier than the other rows' (with
      upstream's ``ids != pad`` masks the EOS of OPT was not an action, so every row was scored on
      its EOS slot). ``"last"`` has no such exception.
    * ``"last"`` (opt-in): ``start + n - 1``, the last real action token (``start`` if ``n == 0``).

    Shape: action_mask (B, T); returns (B,) int64.
    """
    _check_reward_at(reward_at)
    T = action_mask.shape[1]
    n = action_mask[:, start:].long().sum(1)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over positions ``[start, T)`` (upstream's trlX-style GAE).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_T = 0``, and
    ``A_t = delta_t + gamma * lam * A_{t+1}``; ``returns = A + V[:, start:]``. The scan runs over
    time, batched over rows, with upstream's operation order (so results match bit for bit).
    No whitening (upstream has none; see ``masked_whiten``).

    Shape: values, rewards (B, T); returns advantages (B, T - start) detached, and
    returns (B, T - start).
    """
    length = rewards.shape[-1]
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
    ``compute_fp32_loss`` the values are cast to float32 after clipping (DSE #501). ``normalizer``
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
    tokens with ``|r - 1| > cliprange``.
    """

    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor
    approx_kl: torch.Tensor
    clip_frac: torch.Tensor


@torch.no_grad()
def ppo_policy_stats(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, *, cliprange: float = 0.2
) -> PolicyStats:
    """Ratio statistics, approximate KL and clip fraction over the masked tokens.

    Shape: logprobs, old_logprobs, mask (B, T - start); returns a ``PolicyStats`` of scalars.
    """
    keep = mask.bool()
    log_ratio = torch.where(keep, (logprobs - old_logprobs).float(), 0.0)
    ratio = torch.exp(log_ratio)
    inf = torch.tensor(float("inf"), device=ratio.device)
    return PolicyStats(
        ratio_mean=masked_mean(ratio, keep),
        ratio_max=torch.where(keep, ratio, -inf).max(),
        ratio_min=torch.where(keep, ratio, inf).min(),
        approx_kl=masked_mean((ratio - 1.0) - log_ratio, keep),
        clip_frac=masked_mean(((ratio - 1.0).abs() > cliprange).float(), keep),
    )


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over the masked tokens (CleanRL's
    ``losses/explained_variance``): 1 is a perfect critic, 0 no better than a constant, negative
    worse. ``nan`` when the returns have zero variance.

    Shape: values, returns, mask (B, T - start); returns ().
    """
    values, returns = values.float(), returns.float()
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(returns - values, mask, unbiased=False)
    nan = torch.tensor(float("nan"), device=values.device)
    return torch.where(var_returns == 0, nan, 1.0 - var_residual / var_returns)


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


class PairwiseLossOutput(NamedTuple):
    """Result of ``pairwise_reward_loss``.

    ``loss``: () batch-mean pairwise loss. ``chosen_end_scores`` / ``rejected_end_scores``: (B,)
    values at ``end - 1`` (upstream's misnamed ``chosen_mean_scores``/``rejected_mean_scores``).
    """

    loss: torch.Tensor
    chosen_end_scores: torch.Tensor
    rejected_end_scores: torch.Tensor


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
    positions of the shorter side included, DSE #316); the loss is the batch mean. An empty span
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
    identical = ~(chosen_ids != rejected_ids).any(-1)  # (B,)
    divergence = first_divergence_indices(chosen_ids, rejected_ids, if_identical=L - 1).to(device)
    if bool((divergence == 0).any()):
        raise ValueError(
            "pairwise_reward_loss: a chosen/rejected pair differs at position 0; the pair must "
            "share at least its first token (the prompt)"
        )
    c_end = chosen_end.to(device).long()
    r_end = torch.where(identical.to(device), c_end, rejected_end.to(device).long())
    end = torch.where(identical.to(device), torch.full_like(c_end, L), torch.maximum(c_end, r_end))

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


def _check_reward_at(reward_at: str) -> None:
    if reward_at not in _REWARD_AT:
        raise ValueError(f"reward_at must be one of {_REWARD_AT}, got {reward_at!r}")


# ---------------------------------------------------------------------------------------------
# Supervised fine-tuning
# ---------------------------------------------------------------------------------------------


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
