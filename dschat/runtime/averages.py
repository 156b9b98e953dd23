"""Upstream's two running averages of logged scalars (``dschat.utils.utils`` upstream): the plain
mean and the exponential moving average that step 3 logs as ``EMA reward score``."""
from __future__ import annotations

__all__ = ["MovingAverage", "ExponentialMovingAverage"]


class MovingAverage:
    """Running arithmetic mean: ``update(x)`` returns the mean of every value seen so far."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.mean = 0.0

    def update(self, num: float) -> float:
        self.total += num
        self.count += 1
        self.mean = self.total / self.count
        return self.mean


class ExponentialMovingAverage:
    """``ema = alpha * prev + (1 - alpha) * x``; the first value is ``x`` itself (upstream's)."""

    def __init__(self, alpha: float = 0.9) -> None:
        self.alpha = alpha
        self.ema: float | None = None

    def update(self, num: float) -> float:
        prev = num if self.ema is None else self.ema
        self.ema = self.alpha * prev + (1.0 - self.alpha) * num
        return self.ema

    def get(self) -> float:
        """The current average (0 before the first update, as upstream)."""
        return self.ema if self.ema is not None else 0.0
