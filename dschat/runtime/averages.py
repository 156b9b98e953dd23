"""Upstream's running mean of logged scalars (``dschat.utils.utils.MovingAverage`` upstream). Its
other running average, the ``EMA reward score`` step 3 logs and checkpoints, is
:class:`dschat.training.ppo_counters.ExponentialMovingAverage`."""
from __future__ import annotations

__all__ = ["MovingAverage"]


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
