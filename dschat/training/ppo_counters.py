"""Step 3's resume and stop arithmetic: the counters a step-3 checkpoint carries besides the engines
and the data position (the logged reward's exponential moving average among them), when a due
checkpoint may be written (:class:`CheckpointTiming`), and the plain functions step 3's loop
(:func:`dschat.rlhf.ppo_loop.run_ppo`) asks before and after each generation batch."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from deepspeed import DeepSpeedEngine

from dschat.runtime.dist import print_rank_0
from dschat.training.checkpoint import Checkpointer, TrainingPosition
from dschat.training.nonfinite import NonFiniteGuard

if TYPE_CHECKING:  # step 3's update, on the floor above
    from dschat.rlhf.ppo_update import PPOUpdate

__all__ = ["CheckpointTiming", "ExponentialMovingAverage", "PPOCounters", "between_optimizer_steps",
           "finished_before_resume", "reached_test_stop"]


class ExponentialMovingAverage:
    """``ema = alpha * prev + (1 - alpha) * x``; the first value is ``x`` itself (upstream's
    ``dschat.utils.utils`` class: step 3's logged ``EMA reward score``)."""

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


@dataclass
class PPOCounters:
    """Step 3's state besides the engines and the data position; a checkpoint carries it in
    ``TrainingPosition.extra`` (with the non-finite guard's counts)."""

    global_step: int = 0  # PPO iterations trained, never reset (TensorBoard x-axis; upstream reset per epoch)
    non_overflow_step_count: int = 0  # generation batches without an fp16 overflow (--test_stop_step)
    ema_reward: ExponentialMovingAverage = field(default_factory=ExponentialMovingAverage)

    def position(self, epoch: int, batches_done: int, nonfinite: NonFiniteGuard) -> TrainingPosition:
        """The checkpoint record after ``batches_done`` generation batches of ``epoch``."""
        return TrainingPosition(epoch, batches_done, 0, self.global_step, extra={
            "non_overflow_step_count": self.non_overflow_step_count,
            "ema_reward": self.ema_reward.ema,
            "nonfinite": [nonfinite.consecutive, nonfinite.skipped],
        })

    @classmethod
    def restore(cls, position: TrainingPosition, nonfinite: NonFiniteGuard) -> "PPOCounters":
        """The inverse of :meth:`position` (sets the guard's counts in place)."""
        counters = cls(global_step=position.optimizer_steps,
                       non_overflow_step_count=position.extra["non_overflow_step_count"])
        counters.ema_reward.ema = position.extra["ema_reward"]
        nonfinite.consecutive, nonfinite.skipped = position.extra["nonfinite"]
        return counters

    def count_overflow(self, update: PPOUpdate) -> None:
        """After each generation batch, as upstream: count it unless actor or critic overflowed
        (``update.get_overflow()``; the trainer has the same method)."""
        actor_overflow, critic_overflow = update.get_overflow()
        if not actor_overflow and not critic_overflow:
            self.non_overflow_step_count += 1


def between_optimizer_steps(engines: Iterable[DeepSpeedEngine]) -> bool:
    """Whether every DeepSpeed engine of ``engines`` has just finished an optimizer step, with no
    gradient accumulating: its micro-step count is a multiple of its gradient accumulation steps."""
    return all(engine.micro_steps % engine.gradient_accumulation_steps() == 0 for engine in engines)


class CheckpointTiming:
    """``--save_interval``'s checkpoints of step 3, written only between optimizer steps.

    A checkpoint holds no accumulated gradients, and DeepSpeed starts counting micro-steps at 0 again
    on resume; so a checkpoint written while an engine of ``checkpointer`` (actor, critic) is partway
    through its gradient accumulation (``--gradient_accumulation_steps`` larger than one rollout's
    micro-steps) would resume into another run. A checkpoint due then is postponed to the first
    trained iteration that ends between optimizer steps (said once in the log); the rotation and the
    names stay the checkpointer's (``step_<iterations>``). Without skipped micro-steps one comes
    within the least common multiple of the engines' accumulation steps (in iterations); a NaN/inf loss that
    skipped a micro-step shifts that engine's accumulation for good, so a checkpoint that has waited
    that long is written anyway, its accumulated gradients left out (said once). Collective, as
    the save."""

    def __init__(self, checkpointer: Checkpointer, rank: int = 0) -> None:
        self.checkpointer = checkpointer
        self.rank = rank
        self.waited = 0  # trained iterations a due checkpoint has waited for the end of an optimizer step
        self._said: set[str] = set()

    @property
    def postponed(self) -> bool:
        return self.waited > 0

    def maybe_save(self, position: TrainingPosition) -> Path | None:
        """After a trained PPO iteration: the checkpoint at ``position`` when one is due or postponed
        and every trainable engine is between optimizer steps (or it has waited too long: see the
        class); else None."""
        checkpointer = self.checkpointer
        if not (checkpointer.due(position.optimizer_steps) or self.postponed):
            return None
        engines = list(checkpointer.engines.values())
        if not between_optimizer_steps(engines):
            if self.waited < math.lcm(*(engine.gradient_accumulation_steps() for engine in engines)):
                self.waited += 1
                self._say("waits", f"[checkpoint] the checkpoint due after PPO iteration {position.optimizer_steps} "
                          "waits: the actor or the critic is partway through --gradient_accumulation_steps, and a "
                          "checkpoint holds no accumulated gradients; due checkpoints are written after the first "
                          "iteration that ends an optimizer step")
                return None
            self._say("shifted", f"[checkpoint] writing the checkpoint after PPO iteration {position.optimizer_steps} "
                      "partway through --gradient_accumulation_steps: a skipped (NaN/inf) micro-step shifted the "
                      "accumulation, so no iteration ends an optimizer step; the gradients accumulated since the "
                      "last step are not in it, and a resumed run starts a new accumulation")
        self.waited = 0
        return checkpointer.save(position)

    def _say(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            print_rank_0(line, self.rank)


def reached_test_stop(args: argparse.Namespace, counters: PPOCounters) -> bool:
    """``--enable_test_mode``: the run stops after ``--test_stop_step`` batches without an fp16 overflow."""
    return bool(args.enable_test_mode) and counters.non_overflow_step_count == args.test_stop_step


def finished_before_resume(args: argparse.Namespace, counters: PPOCounters, resumed: bool) -> bool:
    """Resumed from the checkpoint a test-mode run ended with: only the final save is left."""
    return bool(resumed and args.enable_test_mode and counters.non_overflow_step_count >= args.test_stop_step)

