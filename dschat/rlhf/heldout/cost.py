"""What step 3's held-out evaluation costs: the PPO steps a run plans, and ``--eval_interval auto``.

With ``auto`` every evaluation and every PPO step is timed. After each evaluation (once a PPO step
after it is timed) the next one is scheduled N steps later, N the smallest interval at which the
run's evaluations -- those made, and one every N steps until the planned last step -- take at most
:data:`MAX_EVAL_SHARE` of the step-3 wall time, at the mean costs measured so far
(:func:`auto_interval`, a pure function, hand-tested in ``tests/rlhf/test_step3_evaluation.py``). A
first PPO step slowed by warm-up is corrected at the next evaluation.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer

__all__ = ["MAX_EVAL_SHARE", "auto_interval", "eval_share", "planned_ppo_steps"]

#: ``--eval_interval auto`` keeps evaluation at or under this share of the step-3 wall time.
MAX_EVAL_SHARE = 0.10


def eval_share(eval_seconds: float, step_seconds: float, steps: int, interval: int, *, since: int = 0,
               spent: float | None = None) -> float:
    """The share of the wall time that evaluation takes in a run of ``steps`` PPO steps: ``spent``
    seconds of evaluations up to step ``since`` (default: the one before the first step), then one
    every ``interval`` steps until ``steps``, each ``eval_seconds``; a PPO step takes ``step_seconds``."""
    spent = eval_seconds if spent is None else spent
    evaluation = spent + (steps - since) // interval * eval_seconds
    return evaluation / (evaluation + steps * step_seconds)


def auto_interval(eval_seconds: float, step_seconds: float, steps: int | None, *, since: int = 0,
                  spent: float | None = None, share: float = MAX_EVAL_SHARE) -> int:
    """The smallest N >= 1 with ``eval_share(...) <= share``: the next evaluation N steps after ``since``.

    Without a planned length (``steps`` None, or ``since`` at or past it) the evaluations to come are
    what counts over a long run: ``E / (N * S + E) <= share``, so ``N = ceil(E (1 - share) / (share S))``.
    When even one more evaluation, after the last step, exceeds the share, N runs to the last step:
    a run is evaluated at its end.
    """
    if eval_seconds <= 0 or step_seconds <= 0:
        return 1
    if steps is None or steps <= since:
        return max(1, math.ceil(eval_seconds * (1 - share) / (share * step_seconds) - 1e-9))
    low, high = 1, steps - since  # the share only falls as N grows: the smallest N that fits
    if eval_share(eval_seconds, step_seconds, steps, high, since=since, spent=spent) > share:
        return high
    while low < high:
        middle = (low + high) // 2
        if eval_share(eval_seconds, step_seconds, steps, middle, since=since, spent=spent) <= share:
            high = middle
        else:
            low = middle + 1
    return low


class RunLength(Protocol):
    """The settings that end a run early: step 3's :class:`~dschat.rlhf.config.EvalConfig` or its flags."""

    enable_test_mode: bool
    test_stop_step: int
    generation_batches: int


def planned_ppo_steps(args: RunLength, trainer: DeepSpeedPPOTrainer | None) -> int | None:
    """The PPO steps (iterations) this run plans: the LR schedule's optimizer steps over the
    optimizer steps per rollout, rounded down, at most ``--test_stop_step / --generation_batches`` in test mode;
    None when the trainer does not say (no engine's schedule or batch plan)."""
    engine, plan = getattr(trainer, "rlhf_engine", None), getattr(trainer, "plan", None)
    total = getattr(engine, "num_total_iters", None)
    if total is None or plan is None:
        return None
    # Rounded down: a rollout needs all of its --generation_batches prompt batches, and the schedule's
    # count (upstream's formula, rounded up) counts the batches of an unfinished last rollout too.
    steps = max(1, math.floor(total / plan.optimizer_steps_per_rollout + 1e-9))
    if getattr(args, "enable_test_mode", False):
        steps = min(steps, max(1, int(args.test_stop_step) // int(args.generation_batches)))
    return steps
