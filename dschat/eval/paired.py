"""Paired comparisons over the same prompts: the mean change of a score and its standard error.

Two sets of answers to the same prompts (two evaluations of one actor, or the SFT and the RLHF
actor) are compared prompt by prompt, which removes the prompts' own spread from the noise. Used by
the over-optimization alarm (:mod:`dschat.rlhf.heldout.alarm`) and by the report's gold gain
(:mod:`dschat.eval.report`). Pure Python, no torch.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

__all__ = ["paired_change"]


def paired_change(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of ``after[i] - before[i]`` over the same prompts.

    The standard error is ``stdev(d) / sqrt(n)`` (sample standard deviation); ``inf`` with fewer than
    two prompts (no noise estimate: nothing can be called significant).
    """
    if len(before) != len(after):
        raise ValueError(f"paired_change: {len(before)} scores before, {len(after)} after; the same prompts are needed")
    diffs = [b - a for a, b in zip(before, after)]
    if not diffs:
        raise ValueError("paired_change: no scores")
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.inf
    return mean, statistics.stdev(diffs) / math.sqrt(len(diffs))
