"""Statistics over the masked entries of a tensor: sums, means, variances, whitening, and the
critic's explained variance.

A rollout's statistics cover every micro-batch of every rank. :class:`Moments` (count, sum, sum of
squares) are what such a statistic needs: they add up over micro-batches, and over ranks in one
all-reduce, and :func:`masked_whiten` and :func:`explained_variance_from_moments` take them, so the
trainer's rollout-wide whitening and explained variance are the same functions as the per-tensor ones.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "Moments", "masked_whiten", "explained_variance",
           "explained_variance_from_moments"]


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



class Moments(NamedTuple):
    """Sum, sum of squares and count of a tensor's masked entries, as Python floats: what a mean and a
    variance need. Moments of several micro-batches add up (:meth:`plus`), and those of several ranks
    in one all-reduce of ``list(moments)``, so a statistic over a whole rollout costs one collective.
    """

    total: float
    total_sq: float
    count: float

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor) -> "Moments":
        """The moments of ``x`` where ``mask`` is set, summed in float64: ``E[x^2] - mean^2`` in float32
        sums loses the variance of values whose spread is small beside their mean. Shape: x, mask (B, T)."""
        x = x.double()
        return cls(float(masked_sum(x, mask)), float(masked_sum(x * x, mask)), float(mask.bool().sum()))

    def plus(self, other: "Moments") -> "Moments":
        return Moments(self.total + other.total, self.total_sq + other.total_sq, self.count + other.count)

    @property
    def mean(self) -> float:
        """The mean (0 without entries)."""
        return self.total / max(self.count, 1.0)

    def var(self, *, unbiased: bool = True) -> float:
        """``E[x^2] - mean^2``; ``unbiased`` applies Bessel's correction ``n / (n - 1)`` to it, clamped
        at 0 first (it can round below 0, and a whitening scale must not be nan)."""
        var = self.total_sq / max(self.count, 1.0) - self.mean ** 2
        if not unbiased:
            return var
        return max(var, 0.0) * self.count / max(self.count - 1.0, 1.0)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
    moments: Moments | None = None,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and unbiased variance of its masked entries.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back (only the
    scale changes, as for rewards in TRL). Upstream DeepSpeed-Chat never whitens; this is for
    opt-in advantage whitening. Entries outside the mask are transformed too but do not influence
    the statistics. Without ``moments`` the statistics are ``x``'s own, in two passes (mean, then the
    mean squared deviation: no cancellation when the mean is large beside the spread; an empty mask
    gives ``nan``). ``moments`` replaces them: the trainer passes those of the whole rollout (every
    micro-batch, every rank) to whiten each micro-batch alike; moments without entries give mean 0,
    variance 0.

    Shape: x, mask (B, T); returns (B, T).
    """
    if moments is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased=True)
    else:
        mean, var = moments.mean, moments.var(unbiased=True)
    whitened = (x - mean) * (var + eps) ** -0.5
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def explained_variance_from_moments(returns: Moments, residual: Moments) -> float:
    """``1 - Var[returns - values] / Var[returns]`` from the moments of the returns and of the
    residuals ``returns - values`` over the same tokens (population variances); ``nan`` without
    tokens or when the returns have no variance."""
    if not returns.count:
        return float("nan")
    var_returns = returns.var(unbiased=False)
    if not var_returns > 0:
        return float("nan")
    return 1.0 - residual.var(unbiased=False) / var_returns


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over the masked tokens (CleanRL's
    ``losses/explained_variance``): 1 is a perfect critic, 0 no better than a constant, negative
    worse. ``nan`` when the returns have zero variance or no token is masked in. The variances are
    taken in float32, in two passes (no cancellation when the mean is large beside the spread).

    Shape: values, returns, mask (B, T - start); returns ().
    """
    returns = returns.float()
    var_returns = masked_var(returns, mask, unbiased=False)
    if not var_returns > 0:
        return torch.tensor(float("nan"), device=values.device)
    return 1.0 - masked_var(returns - values.float(), mask, unbiased=False) / var_returns
