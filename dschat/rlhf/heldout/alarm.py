"""The over-optimization alarm and the best evaluation of step 3's held-out evaluation, as pure
functions of the evaluation series (no models, no DeepSpeed): hand-tested in
``tests/rlhf/test_step3_evaluation.py``, used by :class:`dschat.rlhf.heldout.evaluation.StepThreeEvaluation`.

Every evaluation scores the same K prompts, so two evaluations are compared prompt by prompt
(:func:`~dschat.eval.paired.paired_change`: the mean and standard error of the per-prompt differences). The alarm
(:func:`overoptimization_alarm`) fires when, since ``window`` evaluations back, the proxy's mean rose
while a judge's fell by more than ``sigmas`` of those paired standard errors.

A series whose mean is not finite (a NaN or inf score) at an evaluation says nothing there: that
evaluation is never the best, never fires the alarm, and is passed over as the earlier side of a
comparison, so finite evaluations after it compete and compare as if it had not been made.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from dschat.eval.paired import paired_change

__all__ = ["Alarm", "EvalPoint", "best_index", "not_finite_line", "overoptimization_alarm", "paired_change"]


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation's per-prompt scores, the same prompts in the same order at every evaluation."""

    step: int  # PPO steps trained before it
    proxy: tuple[float, ...]
    judges: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def mean(self, series: str) -> float:
        """The mean of ``"proxy"`` or of a judge's scores."""
        values = self.proxy if series == "proxy" else self.judges[series]
        return statistics.fmean(values)

    def finite(self, series: str) -> bool:
        """Whether ``series`` (``"proxy"`` or a judge's name) is here with a finite mean."""
        return (series == "proxy" or series in self.judges) and math.isfinite(self.mean(series))


@dataclass(frozen=True)
class Alarm:
    """A fired over-optimization alarm: between evaluation steps ``since`` and ``step`` the proxy's
    mean rose by ``proxy_change`` while ``judge``'s fell by ``-judge_change``, beyond ``sigmas``
    paired standard errors (``judge_se``)."""

    step: int
    since: int
    judge: str
    proxy_change: float
    proxy_se: float
    judge_change: float
    judge_se: float
    sigmas: float
    best_step: int | None = None

    def line(self, best_where: str | None = None) -> str:
        """The one printed line."""
        best = ("no best checkpoint kept" if self.best_step is None else
                f"the best evaluation was step {self.best_step}" + (f" ({best_where})" if best_where else ""))
        return (f"[eval] OVER-OPTIMIZATION at step {self.step}: since step {self.since} the proxy rose "
                f"{self.proxy_change:+.4f} (SE {self.proxy_se:.4f}) while judge {self.judge} fell "
                f"{self.judge_change:+.4f} (SE {self.judge_se:.4f}, beyond {self.sigmas:g} SE); {best}")


def overoptimization_alarm(series: Sequence[EvalPoint], *, window: int = 2, sigmas: float = 2.0,
                           best_step: int | None = None) -> Alarm | None:
    """The alarm on an evaluation series (oldest first), or None.

    Compares the newest evaluation with the one ``window`` evaluations before it (the first one
    while there are fewer): it fires for the first judge whose mean fell by more than ``sigmas``
    paired standard errors while the proxy's mean rose. Per judge, only evaluations where the proxy
    and that judge have finite means count (the newest included: else no alarm for that judge).
    ``best_step`` is only carried into the :class:`Alarm` for its line.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if len(series) < 2 or not series[-1].finite("proxy"):
        return None
    newest = series[-1]
    for name, scores in newest.judges.items():
        usable = [p for p in series[:-1] if p.finite("proxy") and p.finite(name)]
        if not newest.finite(name) or not usable:
            continue
        earlier = usable[max(0, len(usable) - window)]
        proxy_change, proxy_se = paired_change(earlier.proxy, newest.proxy)
        if not proxy_change > 0:
            continue
        change, se = paired_change(earlier.judges[name], scores)
        if change < 0 and -change > sigmas * se:
            return Alarm(newest.step, earlier.step, name, proxy_change, proxy_se, change, se, sigmas, best_step)
    return None


def best_index(series: Sequence[EvalPoint], by: str) -> int | None:
    """Index of the evaluation with the highest finite mean of ``by`` (``"proxy"`` or a judge's name);
    the earliest on ties; None when no evaluation has a finite mean of it."""
    best = None
    for i, point in enumerate(series):
        if not point.finite(by):
            continue
        if best is None or point.mean(by) > series[best].mean(by):
            best = i
    return best


def not_finite_line(step: int, means: Mapping[str, float], best_by: str | None) -> str | None:
    """The line for an evaluation at ``step`` where a series' mean (``means``: ``"proxy"`` and each
    judge's name) is not finite, naming what it does not count for: the best checkpoint when it is the
    ``best_by`` series (``--save_best_by``; None: none); the alarm when it is the proxy, else that
    judge's alarm (:func:`overoptimization_alarm`). None when every mean is finite."""
    bad = [name for name, value in means.items() if not math.isfinite(value)]
    if not bad:
        return None
    uncounted = []
    if best_by in bad:
        uncounted.append("the best checkpoint")
    judges = [name for name in means if name != "proxy"]
    bad_judges = [name for name in bad if name != "proxy"]
    if judges and "proxy" in bad:
        uncounted.append("the over-optimization alarm")
    elif bad_judges:
        uncounted.append(f"the over-optimization alarm of judge {', '.join(bad_judges)}")
    shown = ", ".join(f"{name if name == 'proxy' else 'judge ' + name} {means[name]}" for name in bad)
    counts = (f": this evaluation counts neither for {uncounted[0]} nor for {uncounted[1]}" if len(uncounted) == 2
              else f": this evaluation does not count for {uncounted[0]}" if uncounted else "")
    return f"[eval] step {step}: the mean of {shown} is not finite (a score was NaN or inf){counts}"
