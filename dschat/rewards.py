"""Reward functions for step 3: ``--reward_fn module.path:function``, validated and weighted.

A reward function scores decoded answers, one float each::

    fn(prompts: list[str], answers: list[str], **columns) -> list[float]

``columns`` holds the other fields of each answer's dataset row, one list per column aligned with
``prompts`` (e.g. ``answer=["#### 42", ...]`` for a math set, ``chosen=[...]`` for the embedded
data). A function receives the columns it can take: all of them if it has ``**kwargs``, else those
named among its keyword parameters, so a plain ``fn(prompts, answers)`` works too. A column named
like the function's first two parameters is not passed (it would collide with them).

What goes wrong is the user's to fix, so it stops the run with one line (:class:`UserError`, exit
code 2) that names the function and the row: an unimportable spec, a function that raises, returns
the wrong number of scores, or a score that is not a finite number.

Scores combine by weights (:class:`RewardMix`)::

    r = w_model * reward_model_score + sum_i w_i * f_i(prompts, answers, **columns)

Built-ins: :func:`gold` (the embedded dataset's gold judge, :mod:`dschat.gold_judge`; it plays the
labeller there, so training on it is RLVR on that data, not RLHF) and :func:`math_exact_match`
(1.0 when the answer's final number equals the one of a reference column, else 0.0).

Pure Python (and torch only for the combined tensor): no DeepSpeed, no models. Step 3 and the
held-out evaluation load their functions through :func:`load_reward_function`.
"""
from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from dschat.errors import UserError
from dschat.gold_judge import gold_score

__all__ = [
    "RewardFunction",
    "RewardMix",
    "load_reward_function",
    "load_reward_functions",
    "gold",
    "math_exact_match",
    "final_number",
    "MATH_REFERENCE_COLUMN",
]

#: The column :func:`math_exact_match` compares with (GSM8K's name for it).
MATH_REFERENCE_COLUMN = "answer"

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _excerpt(text: str, limit: int = 60) -> str:
    """``text`` on one line, cut to ``limit`` characters, quoted (for error lines)."""
    flat = " ".join(str(text).split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")


# ------------------------------------------------------------------------------------------------
# Built-ins
# ------------------------------------------------------------------------------------------------
def gold(prompts: list[str], answers: list[str], **_: Any) -> list[float]:
    """The embedded dataset's gold judge (:func:`dschat.gold_judge.gold_score`) per answer, in
    [-4.5, 3.0]. Meaningful only on ``--data_path dschat/builtin``, whose labels it decided."""
    return [gold_score(p, a) for p, a in zip(prompts, answers)]


def final_number(text: str) -> str | None:
    """The last number in ``text``, normalised (``"1,234.50"`` -> ``"1234.5"``, ``"7.0"`` -> ``"7"``);
    after a ``####`` marker (GSM8K's final-answer line) only what follows it counts. None if there
    is no number."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".") or "0"
    if number in ("-0", ""):
        number = "0"
    return number


def math_exact_match(prompts: list[str], answers: list[str], **columns: Sequence[Any]) -> list[float]:
    """1.0 where the answer's final number equals the reference's (column ``answer``), else 0.0.

    The reference may be a bare number or a worked solution ending in ``#### 42`` (GSM8K).
    """
    if MATH_REFERENCE_COLUMN not in columns:
        raise UserError(
            f"dschat.rewards:math_exact_match compares with the dataset column {MATH_REFERENCE_COLUMN!r}, "
            f"which the prompt data lacks (it has {sorted(columns)}); add that column to the data"
        )
    scores = []
    for answer, reference in zip(answers, columns[MATH_REFERENCE_COLUMN]):
        want = final_number(str(reference))
        scores.append(1.0 if want is not None and final_number(answer) == want else 0.0)
    return scores


# ------------------------------------------------------------------------------------------------
# Loading and calling
# ------------------------------------------------------------------------------------------------
def _accepted_columns(fn: Callable[..., Any]) -> tuple[bool | frozenset[str], frozenset[str]]:
    """(True if ``fn`` takes ``**kwargs``, else the names it takes by keyword after the first two;
    the names of its first two parameters, which a column must not take: prompts and answers)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: give it no columns
        return frozenset(), frozenset()
    taken = frozenset(p.name for p in params[:2] if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True, taken
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params[2:] if p.kind in keyword), taken


@dataclass(frozen=True)
class RewardFunction:
    """One reward function, its name for error lines (the ``module:function`` spec) and its weight.

    Calling it validates the result: one finite float per answer (see the module docstring).
    """

    name: str
    fn: Callable[..., Any] = field(repr=False)
    weight: float = 1.0
    # False for step 3's in-process ``main(argv, reward_fn=...)`` hook, whose non-finite scores the
    # non-finite guard handles (that rollout is skipped and counted, --max_nonfinite_steps).
    require_finite: bool = True

    def __call__(self, prompts: Sequence[str], answers: Sequence[str],
                 columns: Mapping[str, Sequence[Any]] | None = None) -> list[float]:
        prompts, answers = list(prompts), list(answers)
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts for {len(answers)} answers")
        given = dict(columns or {})
        for key, values in given.items():
            if len(values) != len(answers):
                raise ValueError(f"column {key!r} has {len(values)} values for {len(answers)} answers")
        accepted, taken = _accepted_columns(self.fn)
        # A column named like the first two parameters (a dataset's "prompts" column for
        # fn(prompts, answers, **kw)) would collide with them: it is not passed.
        kwargs = {k: v for k, v in given.items() if k not in taken and (accepted is True or k in accepted)}
        try:
            raw = self.fn(prompts, answers, **{k: list(v) for k, v in kwargs.items()})
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 -- any failure of user code is reported, one line
            raise UserError(f"reward function {self.name} raised {type(err).__name__}: {err} "
                            f"{self._failing_row(prompts, answers, kwargs)}; fix the function") from err
        return self._check(raw, prompts, answers)

    def _failing_row(self, prompts: list[str], answers: list[str], kwargs: dict[str, Sequence[Any]]) -> str:
        """``on row i (prompt ..., answer ...)``: the first row that raises alone, found by calling
        the function row by row (only after it failed on the batch)."""
        for i, (p, a) in enumerate(zip(prompts, answers)):
            try:
                self.fn([p], [a], **{k: [v[i]] for k, v in kwargs.items()})
            except Exception:  # noqa: BLE001 -- looking for the row that fails
                return f"on row {i} (prompt {_excerpt(p)}, answer {_excerpt(a)})"
        return f"on a batch of {len(answers)} rows (no single row fails alone; row 0 prompt {_excerpt(prompts[0])})"

    def _check(self, raw: Any, prompts: list[str], answers: list[str]) -> list[float]:
        try:
            values = list(raw)
        except TypeError:
            raise UserError(f"reward function {self.name} returned {type(raw).__name__}, not a list of "
                            f"{len(answers)} floats; return one score per answer") from None
        if len(values) != len(answers):
            raise UserError(f"reward function {self.name} returned {len(values)} scores for {len(answers)} "
                            f"answers (row 0 prompt {_excerpt(prompts[0]) if prompts else ''}); return one score "
                            "per answer")
        scores = []
        for i, value in enumerate(values):
            try:
                score = float(value)
            except (TypeError, ValueError):
                score = float("nan")
            if self.require_finite and not math.isfinite(score):
                raise UserError(f"reward function {self.name} returned {value!r} for row {i} (prompt "
                                f"{_excerpt(prompts[i])}, answer {_excerpt(answers[i])}); scores must be finite "
                                "numbers")
            scores.append(score)
        return scores


def load_reward_function(spec: str, weight: float = 1.0) -> RewardFunction:
    """``"module.path:function"`` -> :class:`RewardFunction`; a bad spec is one :class:`UserError` line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"--reward_fn {spec!r} is not of the form module.path:function "
                        "(e.g. dschat.rewards:gold)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 -- an import runs user code; any failure is the user's
        raise UserError(f"--reward_fn {spec}: cannot import module {module_name!r} ({type(err).__name__}: "
                        f"{err}); check the module path and PYTHONPATH") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UserError(f"--reward_fn {spec}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(f"--reward_fn {spec}: {attr!r} is a {type(fn).__name__}, not a function")
    if not math.isfinite(weight):
        raise UserError(f"--reward_fn_weight for {spec} must be a finite number, got {weight}")
    return RewardFunction(spec, fn, float(weight))


def load_reward_functions(specs: Sequence[str], weights: Sequence[float] | None = None) -> list[RewardFunction]:
    """The functions of the repeatable ``--reward_fn`` / ``--reward_fn_weight`` flags: no weights
    means 1.0 each, else exactly one weight per function, in order."""
    specs = list(specs or [])
    weights = list(weights or [])
    if weights and len(weights) != len(specs):
        raise UserError(f"{len(weights)} --reward_fn_weight for {len(specs)} --reward_fn; give one weight per "
                        "function, in the same order, or none (all 1.0)")
    return [load_reward_function(s, w) for s, w in zip(specs, weights or [1.0] * len(specs))]


# ------------------------------------------------------------------------------------------------
# Combining
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RewardMix:
    """The reward of step 3: ``model_weight * model score + sum(weight_i * f_i)``.

    ``model_weight`` is 0 when no reward model takes part (then no model score is needed).
    """

    functions: tuple[RewardFunction, ...] = ()
    model_weight: float = 1.0

    @property
    def uses_model(self) -> bool:
        return self.model_weight != 0.0

    def describe(self) -> str:
        """One line for the start-up log."""
        terms = ([f"{self.model_weight:g} x reward model"] if self.uses_model else []) + [
            f"{f.weight:g} x {f.name}" for f in self.functions]
        return "reward = " + " + ".join(terms)

    def score(self, prompts: Sequence[str], answers: Sequence[str], columns: Mapping[str, Sequence[Any]] | None,
              model_scores: torch.Tensor | None = None) -> torch.Tensor:
        """Combined score per answer. Shape: model_scores (B,) or None; returns (B,) float32 on the
        model scores' device (the CPU without them)."""
        if self.uses_model and model_scores is None:
            raise ValueError("RewardMix.score: the mix uses the reward model but no model scores were given")
        device = model_scores.device if model_scores is not None else torch.device("cpu")
        total = torch.zeros(len(answers), dtype=torch.float32, device=device)
        if self.uses_model:
            total = total + self.model_weight * model_scores.float()
        for fn in self.functions:
            total = total + fn.weight * torch.tensor(fn(prompts, answers, columns), dtype=torch.float32,
                                                     device=device)
        return total
