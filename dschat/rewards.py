"""Reward functions for step 3: ``--reward_fn module.path:function``, validated and weighted.

A reward function scores decoded answers, one float each::

    fn(prompts: list[str], answers: list[str], **columns) -> list[float]

``columns`` holds the other fields of each answer's dataset row, one list per column aligned with
``prompts`` (e.g. ``answer=["#### 42", ...]`` for a math set, ``chosen=[...]`` for the embedded
data). A function receives the columns it can take: all of them if it has ``**kwargs``, else those
named among its keyword parameters, so a plain ``fn(prompts, answers)`` works too. A column named
like the function's first two parameters is not passed (it would collide with them).

What goes wrong is the user's to fix, so it stops the run with one line (:class:`UserError`, exit
code 2) that names the function and the row: an unimportable spec, a function that raises or calls
``sys.exit``, returns a string or bytes (``"12"`` is not two scores), the wrong number of scores, a
score that is not a number or is not finite once cast to float32 (``1e39`` is inf there), or a call
that outlasts ``timeout`` seconds (``--reward_fn_timeout``). So does a finite score whose weighted
term, or a sum of finite terms, is beyond float32's range (:meth:`RewardMix.score`).

After a call raises, the failing row is looked for by bisection: halves of the batch are called
again, at most ``2 * ceil(log2(batch))`` calls, stopping at the first probe that raises nothing on
either half, times out or exits. A call that timed out or called ``sys.exit`` is never repeated.

**Timeout.** With ``timeout > 0`` each call runs in a worker thread (daemon; the CUDA device and the
grad mode of the caller carried over) and the caller waits at most ``timeout`` seconds. Python cannot
stop a thread, so a call past its time is left running and the error stops the run: the process
exits, the stuck call with it.

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
import numbers
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

import torch

from dschat.errors import UserError, exit_code, raised
from dschat.gold_judge import gold_score

__all__ = [
    "RewardFunction",
    "RewardMix",
    "load_reward_function",
    "load_reward_functions",
    "reward_model_used",
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
    """The last number in ``text`` in its canonical decimal form, so that two numbers are equal
    exactly when their forms are (no digit is rounded away): thousands commas, leading zeros of the
    whole part and trailing zeros of the fraction dropped, a bare fraction given its ``0``, no
    ``-0`` (``"1,234.50"`` -> ``"1234.5"``, ``"7.0"`` -> ``"7"``, ``"007"`` -> ``"7"``, ``".5"`` ->
    ``"0.5"``). After a ``####`` marker (GSM8K's final-answer line) only what follows it counts.
    None if there is no number."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].replace(",", "")
    sign = "-" if number.startswith("-") else ""
    whole, _, fraction = number.lstrip("-").partition(".")
    whole, fraction = whole.lstrip("0") or "0", fraction.rstrip("0")
    canonical = whole + ("." + fraction if fraction else "")
    return canonical if canonical == "0" else sign + canonical


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
    #: Seconds one call may take (--reward_fn_timeout); 0: no limit, the call runs in the caller's thread.
    timeout: float = 0.0
    # True for an --eval_judge function: a NaN or inf number passes (the evaluation says its mean is not
    # finite and does not compare on it; a judge only observes), anything but a number is still refused.
    nonfinite_numbers: bool = False

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
        kwargs = {k: list(v) for k, v in given.items() if k not in taken and (accepted is True or k in accepted)}
        raw, failure = self._call(prompts, answers, kwargs)
        if failure is not None:
            self._fail(failure, prompts, answers, kwargs)
        return self._check(raw, prompts, answers)

    def _call(self, prompts: list[str], answers: list[str],
              kwargs: dict[str, list[Any]]) -> tuple[Any, BaseException | None]:
        """One call of the function: ``(result, None)``, or ``(None, what it raised)`` -- a
        :class:`CallTimedOut` when it outlasted ``timeout``. ``KeyboardInterrupt`` is not caught."""
        def call() -> Any:
            raw = self.fn(prompts, answers, **kwargs)
            # A generator (or map) does its work as it is read: read here, timed and reported as the call.
            return list(raw) if isinstance(raw, Iterator) else raw

        if not self.timeout:
            try:
                return call(), None
            except (Exception, SystemExit) as err:  # noqa: BLE001 -- any failure of user code is reported
                return None, err
        return PendingCall(call, f"reward function {self.name}").wait(self.timeout)

    def _fail(self, err: BaseException, prompts: list[str], answers: list[str],
              kwargs: dict[str, list[Any]]) -> NoReturn:
        """Raise the one line for a failed batch call; a :class:`UserError` of the function passes as it is."""
        if isinstance(err, UserError):
            raise err
        if isinstance(err, CallTimedOut):
            raise UserError(f"reward function {self.name} did not return within --reward_fn_timeout {err.seconds:g} "
                            f"s on a batch of {len(answers)} rows (row 0 prompt {_excerpt(prompts[0]) if prompts else ''}); "
                            "make it faster or raise --reward_fn_timeout (0: no limit)") from None
        if isinstance(err, SystemExit):
            raise UserError(f"reward function {self.name} called sys.exit({exit_code(err)}) on a batch of {len(answers)} "
                            f"rows (row 0 prompt {_excerpt(prompts[0]) if prompts else ''}); raise an exception or "
                            "return scores instead") from None
        raise UserError(f"reward function {self.name} raised {raised(err)} "
                        f"{self._failing_row(prompts, answers, kwargs)}; fix the function") from err

    def _failing_row(self, prompts: list[str], answers: list[str], kwargs: dict[str, list[Any]]) -> str:
        """``on row i (prompt ..., answer ...)``: a row that raises alone, found by bisection (only after
        the function failed on the batch): the half that raises is split again; at most two calls per
        halving. The search stops where neither half raises, or at a probe that times out or exits."""
        lo, hi = 0, len(answers)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            for a, b in ((lo, mid), (mid, hi)):
                _, err = self._call(prompts[a:b], answers[a:b], {k: v[a:b] for k, v in kwargs.items()})
                if isinstance(err, (CallTimedOut, SystemExit)):
                    return f"on rows {lo}-{hi - 1} of a batch of {len(answers)} (row {lo} prompt {_excerpt(prompts[lo])})"
                if err is not None:
                    lo, hi = a, b
                    break
            else:
                return (f"on rows {lo}-{hi - 1} of a batch of {len(answers)} (no half of them fails alone; row {lo} "
                        f"prompt {_excerpt(prompts[lo])})")
        return f"on row {lo} (prompt {_excerpt(prompts[lo])}, answer {_excerpt(answers[lo])})"

    def _check(self, raw: Any, prompts: list[str], answers: list[str]) -> list[float]:
        if isinstance(raw, (str, bytes, bytearray, Mapping)):
            shown = _excerpt(raw if isinstance(raw, str) else repr(raw))
            raise UserError(f"reward function {self.name} returned {type(raw).__name__} {shown}, not a list of "
                            f"{len(answers)} floats; return one number per answer")
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
            number = not isinstance(value, (str, bytes, bytearray))  # a string is no score, even "12"
            try:
                score = float(value) if number else math.nan
            except OverflowError:  # an int past float's range
                score = math.inf
            except (TypeError, ValueError):
                score, number = math.nan, False
            # The scores are used in float32 (RewardMix): 1e39 is finite here and inf there.
            if self.require_finite and not math.isfinite(as_float32(score)) and not (number and self.nonfinite_numbers):
                raise UserError(f"reward function {self.name} returned {value!r} for row {i} (prompt "
                                f"{_excerpt(prompts[i])}, answer {_excerpt(answers[i])}); scores must be numbers, "
                                "finite in float32 (|x| < 3.4e38)")
            scores.append(score)
        return scores


class CallTimedOut(Exception):
    """A call that outlasted its timeout (still running in its thread)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no result within {seconds:g} s")
        self.seconds = seconds


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as the reward tensor holds it (inf beyond float32's range)."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


#: The longest wait a timeout flag takes (about 31 years): Python's waits (a thread's join, a timer,
#: a socket) overflow above about 9.2e9 seconds.
MAX_TIMEOUT_S = 1e9


def check_timeout(value: float, flag: str, *, zero_is_no_limit: bool = True) -> float:
    """``value`` as seconds for ``flag``: a real number from 0 (or above 0 without ``zero_is_no_limit``)
    to :data:`MAX_TIMEOUT_S`; anything else is one :class:`UserError` line."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not (number and (value >= 0 if zero_is_no_limit else value > 0) and value <= MAX_TIMEOUT_S):
        bounds = "from 0 to 1e9 (0: no limit)" if zero_is_no_limit else "above 0 and at most 1e9"
        raise UserError(f"{flag} must be a number of seconds {bounds}, got {value}")
    return float(value)


class PendingCall:
    """One call of user code, started at once in a daemon worker thread that carries the caller's CUDA device
    and grad mode (both are per thread); :meth:`wait` gives its outcome. Python cannot stop a thread,
    so a call past its time is left running: the caller is to stop the run (the process exits, the
    stuck call with it)."""

    def __init__(self, call: Callable[[], Any], name: str) -> None:
        self._outcome: dict[str, Any] = {}
        grad = torch.is_grad_enabled()
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def work() -> None:
            try:
                if device is not None:  # the CUDA device is per thread
                    torch.cuda.set_device(device)
                with torch.set_grad_enabled(grad):  # so is the grad mode
                    self._outcome["result"] = call()
            except BaseException as err:  # noqa: BLE001 -- handed to the caller, which reports it
                self._outcome["error"] = err

        self._thread = threading.Thread(target=work, name=name, daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None) -> tuple[Any, BaseException | None]:
        """``(result, None)``, or ``(None, what the call raised)`` -- a :class:`CallTimedOut` when it is
        still running after ``timeout`` seconds (None or 0: no limit). A ``KeyboardInterrupt`` is raised."""
        self._thread.join(timeout or None)
        if self._thread.is_alive():
            return None, CallTimedOut(timeout or 0.0)
        if isinstance(self._outcome.get("error"), KeyboardInterrupt):
            raise self._outcome["error"]
        return self._outcome.get("result"), self._outcome.get("error")


def load_callable(spec: str, flag: str, example: str) -> Any:
    """The callable a ``module.path:attr`` spec names (``attr`` may be dotted), imported; ``flag`` and
    ``example`` (a valid spec) word the one :class:`UserError` line of a bad spec, a module that does
    not import (or exits while it imports: ``sys.exit``, argparse at its top level), a missing
    attribute or one that is not callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{flag} {spec!r} is not of the form module.path:function (e.g. {example})")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 -- an import runs user code; any failure is the user's
        raise UserError(f"{flag} {spec}: cannot import module {module_name!r} ({raised(err)}); check the module "
                        "path and PYTHONPATH") from None
    except SystemExit as err:  # top-level code of the module (argparse's parse_args, say) exited
        raise UserError(f"{flag} {spec}: importing module {module_name!r} called sys.exit({exit_code(err)}); "
                        "move the module's script code under if __name__ == '__main__':") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UserError(f"{flag} {spec}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(f"{flag} {spec}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def check_weight(value: float, flag: str) -> float:
    """``value`` as a reward term's weight for ``flag``: a number finite in float32, as the reward tensor
    holds it (a larger one makes every reward inf, and every rollout is skipped as non-finite);
    anything else is one :class:`UserError` line."""
    if not math.isfinite(as_float32(value)):
        raise UserError(f"{flag} must be a finite number (within float32's range, |w| < 3.4e38), got {value}")
    return float(value)


def load_reward_function(spec: str, weight: float = 1.0, timeout: float = 0.0, *,
                         nonfinite_numbers: bool = False) -> RewardFunction:
    """``"module.path:function"`` -> :class:`RewardFunction` (``timeout``: seconds per call, 0 for no
    limit; ``nonfinite_numbers``: see there); a bad spec is one :class:`UserError` line."""
    timeout = check_timeout(timeout, "--reward_fn_timeout")
    fn = load_callable(spec, "--reward_fn", "dschat.rewards:gold")
    return RewardFunction(spec, fn, check_weight(weight, f"--reward_fn_weight for {spec}"), timeout=timeout,
                          nonfinite_numbers=nonfinite_numbers)


def load_reward_functions(specs: Sequence[str], weights: Sequence[float] | None = None,
                          timeout: float = 0.0) -> list[RewardFunction]:
    """The functions of the repeatable ``--reward_fn`` / ``--reward_fn_weight`` flags: no weights
    means 1.0 each, else exactly one weight per function, in order; ``timeout``: ``--reward_fn_timeout``."""
    specs = list(specs or [])
    weights = list(weights or [])
    if weights and len(weights) != len(specs):
        raise UserError(f"{len(weights)} --reward_fn_weight for {len(specs)} --reward_fn; give one weight per "
                        "function, in the same order, or none (all 1.0)")
    return [load_reward_function(s, w, timeout) for s, w in zip(specs, weights or [1.0] * len(specs))]


# ------------------------------------------------------------------------------------------------
# Combining
# ------------------------------------------------------------------------------------------------
def reward_model_weight(given: float | None, *, other_terms: bool) -> float:
    """``--reward_model_weight``: ``given`` when set, else 1 with no other reward term (``--reward_fn``,
    ``--reward_url``, ``--env``, a Python ``reward_fn``) and 0 with any. A weight of 0 means step 3
    loads no reward model; step 3's reward mix and the memory planner both decide by this."""
    if given is not None:
        return float(given)
    return 0.0 if other_terms else 1.0


def reward_model_used(args: Any, python_reward_fn: bool = False) -> bool:
    """Whether step 3 loads a reward model for ``args``' flags (:func:`reward_model_weight`):
    ``--reward_model_weight`` when given (0: not loaded), else 1 without ``--reward_fn``,
    ``--reward_url``, ``--env`` and a Python ``reward_fn`` handed to step 3's ``main``
    (``python_reward_fn``), 0 with any of them."""
    others = (getattr(args, "reward_fn", None) or getattr(args, "reward_url", None) or getattr(args, "env", None)
              or python_reward_fn)
    return reward_model_weight(getattr(args, "reward_model_weight", None), other_terms=bool(others)) != 0.0


@dataclass(frozen=True)
class RewardMix:
    """The reward of step 3: ``model_weight * model score + sum(weight_i * f_i)``.

    ``model_weight`` is 0 when no reward model takes part (then no model score is needed).
    """

    functions: tuple[RewardFunction, ...] = ()
    model_weight: float = 1.0
    environment: str | None = None  # --env: each episode's turn rewards are added (weight 1), named here

    @property
    def uses_model(self) -> bool:
        return self.model_weight != 0.0

    def describe(self) -> str:
        """One line for the start-up log."""
        terms = ([f"{self.model_weight:g} x reward model"] if self.uses_model else []) + [
            f"{f.weight:g} x {f.name}" for f in self.functions]
        if self.environment is not None:
            terms.append(f"the turn rewards of environment {self.environment}")
        return "reward = " + " + ".join(terms)

    def score(self, prompts: Sequence[str], answers: Sequence[str], columns: Mapping[str, Sequence[Any]] | None,
              model_scores: torch.Tensor | None = None) -> torch.Tensor:
        """Combined score per answer. Shape: model_scores (B,) or None; returns (B,) float32 on the
        model scores' device (the CPU without them)."""
        if self.uses_model and model_scores is None:
            raise ValueError("RewardMix.score: the mix uses the reward model but no model scores were given")
        device = model_scores.device if model_scores is not None else torch.device("cpu")
        terms: list[torch.Tensor] = []
        if self.uses_model:
            terms.append(_weighted(self.model_weight, model_scores.float(), "reward model"))
        for fn in self.functions:
            scores = torch.tensor(fn(prompts, answers, columns), dtype=torch.float32, device=device)
            terms.append(_weighted(fn.weight, scores, fn.name))
        total = torch.zeros(len(answers), dtype=torch.float32, device=device)
        for term in terms:
            total = total + term
        overflow = ~torch.isfinite(total) & torch.stack([torch.isfinite(t) for t in terms] or [total]).all(0)
        if overflow.any():
            raise UserError(f"the reward terms of an answer are each finite but their sum ({self.describe()}) is "
                            "beyond float32's range (|x| < 3.4e38); lower the weights")
        return total


def _weighted(weight: float, scores: torch.Tensor, name: str) -> torch.Tensor:
    """``weight * scores`` (float32), refused in one line where a finite score times the weight is not
    finite in float32 (every such reward would be inf and its rollout skipped as non-finite); a score
    that is already not finite is left to the non-finite guard."""
    weighted = weight * scores
    overflow = torch.isfinite(scores) & ~torch.isfinite(weighted)
    if overflow.any():
        score = scores[overflow][0].item()
        raise UserError(f"reward term {weight:g} x {name}: a score of {score:g} times its weight is beyond "
                        "float32's range (|x| < 3.4e38); lower the weight or scale the scores down")
    return weighted
