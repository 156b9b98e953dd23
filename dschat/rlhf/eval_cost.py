"""What step 3's held-out evaluation costs: the PPO steps a run plans, and ``--eval_interval auto``.

With ``auto`` the evaluation before the first PPO step and the first PPO step after it are timed,
and the interval N is the smallest one at which the run's evaluations -- that first one and one
every N steps -- take at most :data:`MAX_EVAL_SHARE` of the step-3 wall time, each evaluation
costing what the first one did and each PPO step what the first one did
(:func:`auto_interval`, a pure function, hand-tested in ``tests/test_step3_evaluation.py``).
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_EVAL_SHARE", "auto_interval", "eval_share", "planned_ppo_steps"]

#: ``--eval_interval auto`` keeps evaluation at or under this share of the step-3 wall time.
MAX_EVAL_SHARE = 0.10


def eval_share(eval_seconds: float, step_seconds: float, steps: int, interval: int) -> float:
    """The share of the wall time that evaluation takes in a run of ``steps`` PPO steps evaluated
    before the first step and after every ``interval`` steps (``steps // interval + 1`` evaluations)."""
    evaluation = (steps // interval + 1) * eval_seconds
    return evaluation / (evaluation + steps * step_seconds)


def auto_interval(eval_seconds: float, step_seconds: float, steps: int | None,
                  share: float = MAX_EVAL_SHARE) -> int:
    """The smallest N >= 1 with ``eval_share(E, S, steps, N) <= share``.

    Without a planned length (``steps`` None) the evaluations after the first are what counts over a
    long run: ``E / (N * S + E) <= share``, so ``N = ceil(E (1 - share) / (share S))``. When even an
    evaluation before the first step and one after the last (N = ``steps``) exceed the share, N is
    ``steps``: the two evaluations that a comparison needs.
    """
    if eval_seconds <= 0 or step_seconds <= 0:
        return 1
    smallest = max(1, math.ceil(eval_seconds * (1 - share) / (share * step_seconds) - 1e-9))
    if steps is None or steps < 1:
        return smallest
    for interval in range(smallest, steps + 1):  # the share only falls as N grows
        if eval_share(eval_seconds, step_seconds, steps, interval) <= share:
            return interval
    return max(steps, 1)


def planned_ppo_steps(args: Any, trainer: Any) -> int | None:
    """The PPO steps (iterations) this run plans: the LR schedule's optimizer steps over the
    optimizer steps per rollout, at most ``--test_stop_step / --generation_batches`` in test mode;
    None when the trainer does not say."""
    engine, plan = getattr(trainer, "rlhf_engine", None), getattr(trainer, "plan", None)
    total = getattr(engine, "num_total_iters", None)
    if total is None or plan is None:
        return None
    steps = max(1, round(total / plan.optimizer_steps_per_rollout))
    if getattr(args, "enable_test_mode", False):
        steps = min(steps, max(1, int(args.test_stop_step) // int(args.generation_batches)))
    return steps
