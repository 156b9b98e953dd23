"""Upstream's import path ``dschat.utils.utils``: its public helper names, re-exported.

The implementations live where they belong (``dschat.utils.dist``, ``dschat.training.common``,
``dschat.models.tokenizer``, ``dschat.utils.optim``, ``dschat.models.save``, ``dschat.rlhf.ema``,
``dschat.utils.model.model_utils``); this module keeps ``from dschat.utils.utils import
print_rank_0, ...`` working for code written against upstream. The two small running-average
classes are defined here, as upstream.

``load_state_dict_into_model`` keeps upstream's signature but is strict: missing, unexpected or
wrongly shaped keys raise :class:`dschat.errors.UserError` before anything is loaded (upstream
ignored them, so a wrong critic path trained a random critic); pass ``strict=False`` to load the
matching keys and get the others back in the returned report.
"""
from __future__ import annotations

from dschat.models.save import save_hf_format, save_zero_three_model
from dschat.models.tokenizer import get_tokenizer, load_hf_tokenizer
from dschat.rlhf.ema import moving_average
from dschat.training.common import set_random_seed, to_device
from dschat.utils.dist import get_all_reduce_mean, is_rank_0, print_rank_0
from dschat.utils.model.model_utils import load_state_dict_into_model
from dschat.utils.optim import get_optimizer_grouped_parameters

__all__ = [
    "print_rank_0",
    "is_rank_0",
    "to_device",
    "MovingAverage",
    "ExponentialMovingAverage",
    "get_tokenizer",
    "load_hf_tokenizer",
    "save_hf_format",
    "set_random_seed",
    "get_all_reduce_mean",
    "get_optimizer_grouped_parameters",
    "load_state_dict_into_model",
    "moving_average",
    "save_zero_three_model",
]


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
