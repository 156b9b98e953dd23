"""Upstream's import path ``dschat.utils.utils``: its public helper names, re-exported.

The implementations live where they belong (``dschat.runtime.dist``, ``dschat.runtime.devices``,
``dschat.models.tokenizer``, ``dschat.runtime.optim``, ``dschat.models.save``, ``dschat.rlhf.actor_ema``,
``dschat.models.build``); this module keeps ``from dschat.utils.utils import
print_rank_0, ...`` working for code written against upstream. The two small running-average
classes live in :mod:`dschat.runtime.averages` (the mean) and :mod:`dschat.training.ppo_counters`
(the EMA step 3 logs).

``load_state_dict_into_model`` keeps upstream's signature but is strict: missing, unexpected or
wrongly shaped keys raise :class:`dschat.errors.UserError` before anything is loaded (upstream
ignored them, so a wrong critic path trained a random critic); pass ``strict=False`` to load the
matching keys and get the others back in the returned report.
"""
from __future__ import annotations

from dschat.models.build import load_state_dict_into_model
from dschat.models.save import save_hf_format, save_zero_three_model
from dschat.models.tokenizer import get_tokenizer, load_hf_tokenizer
from dschat.rlhf.actor_ema import moving_average
from dschat.runtime.averages import MovingAverage
from dschat.runtime.devices import to_device
from dschat.runtime.dist import get_all_reduce_mean, is_rank_0, print_rank_0
from dschat.runtime.optim import get_optimizer_grouped_parameters
from dschat.training.loaders import set_random_seed
from dschat.training.ppo_counters import ExponentialMovingAverage

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
