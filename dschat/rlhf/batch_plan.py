"""The batch arithmetic of one PPO iteration: how a rollout is cut into micro-batches, and when
optimizer steps happen.

Upstream's README warns that PPO "diverges" unless ``per_device_generation_batch_size ==
per_device_training_batch_size`` and ``ppo_epochs == generation_batches == 1``.
The underlying rule, which TRL made explicit (PR #3493), is about *when optimizer steps happen*:

* one rollout is ``per_device_generation_batch_size x generation_batches`` prompts per rank, and is
  trained as ``M = rollout / per_device_training_batch_size`` micro-batches, ``ppo_epochs`` times:
  ``M x ppo_epochs`` micro-steps per rollout;
* the actor takes an optimizer step every ``gradient_accumulation_steps`` micro-steps;
* the PPO ratio ``pi_theta / pi_old`` is exactly 1 on every micro-step only if no optimizer step
  happens between generating a rollout and the last micro-step trained on it, i.e. iff
  ``gradient_accumulation_steps`` is a multiple of ``M x ppo_epochs`` (every optimizer step covers
  whole rollouts).

:func:`plan_batches` derives these numbers once (a :class:`BatchPlan`) and refuses a rollout that
does not split into whole micro-batches; :func:`num_total_iters` counts the run's optimizer steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dschat.errors import UserError

__all__ = ["BatchPlan", "plan_batches", "num_total_iters", "positive_flag", "OFF_POLICY_WARNING"]

OFF_POLICY_WARNING = (
    "WARNING: this configuration is off-policy: an optimizer step happens before every micro-batch "
    "of a rollout has been trained (gradient_accumulation_steps={ga} is not a multiple of "
    "{micro} micro-batches per rollout x {epochs} ppo_epochs). The PPO ratio is computed against the "
    "rollout's stored log-probs and clipped at 1 +- {clip}; upstream found such runs diverge "
    "(DeepSpeed-Chat README 'Instability', TRL PR #3493). Watch ratio_max / approx_kl / clip_frac in "
    "the logs, or use per_device_generation_batch_size == per_device_training_batch_size and "
    "ppo_epochs == generation_batches == 1."
)


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of one PPO iteration on one rank (all counts per rank).

    ``micro_batches_per_rollout`` (M) micro-batches of ``training_batch_size`` rows make one rollout
    of ``rollout_size`` rows; ``micro_steps_per_rollout = M x ppo_epochs``. ``on_policy`` says every
    optimizer step covers whole rollouts. ``step_normalizable`` says every optimizer step lies inside
    one rollout (``gradient_accumulation_steps`` divides the rollout's micro-steps), so the token
    count of the whole step is known when its first micro-batch is trained.
    """

    generation_batch_size: int
    generation_batches: int
    training_batch_size: int
    ppo_epochs: int
    gradient_accumulation_steps: int
    gradient_accumulation_steps_actor: int
    world_size: int
    ptx: bool

    @property
    def rollout_size(self) -> int:
        return self.generation_batch_size * self.generation_batches

    @property
    def micro_batches_per_rollout(self) -> int:
        return self.rollout_size // self.training_batch_size

    @property
    def micro_steps_per_rollout(self) -> int:
        return self.micro_batches_per_rollout * self.ppo_epochs

    @property
    def on_policy(self) -> bool:
        return self.gradient_accumulation_steps % self.micro_steps_per_rollout == 0

    @property
    def step_normalizable(self) -> bool:
        return self.micro_steps_per_rollout % self.gradient_accumulation_steps == 0

    @property
    def drop_short_batches(self) -> bool:
        """Whether the prompt loaders drop each rank's last, short batch. With several micro-batches
        per generation batch, a short one would make a rollout of fewer micro-steps, and every later
        optimizer step would straddle two rollouts (its first micro-batches trained with the on-policy
        shortcut after the policy moved, its token normaliser wrong). With one micro-batch per
        generation batch a short batch is still one micro-step, so nothing is dropped (as upstream)."""
        return self.generation_batch_size > self.training_batch_size

    @property
    def optimizer_steps_per_rollout(self) -> float:
        return self.micro_steps_per_rollout / self.gradient_accumulation_steps

    def describe(self) -> str:
        """One line for the start-up log."""
        policy = "on-policy" if self.on_policy else "OFF-POLICY"
        return (
            f"PPO batch plan (per rank): rollout = {self.generation_batch_size} prompts x "
            f"{self.generation_batches} generation batches = {self.rollout_size} rows -> "
            f"{self.micro_batches_per_rollout} micro-batches of {self.training_batch_size} x "
            f"{self.ppo_epochs} ppo epochs = {self.micro_steps_per_rollout} micro-steps; "
            f"gradient_accumulation_steps {self.gradient_accumulation_steps} "
            f"(actor {self.gradient_accumulation_steps_actor}{', PPO-ptx' if self.ptx else ''}) -> "
            f"{self.optimizer_steps_per_rollout:g} optimizer steps per rollout; {policy}"
        )

    def off_policy_warning(self, cliprange: float) -> str:
        return OFF_POLICY_WARNING.format(
            ga=self.gradient_accumulation_steps, micro=self.micro_batches_per_rollout,
            epochs=self.ppo_epochs, clip=cliprange,
        )


def positive_flag(name: str, value: Any) -> int:
    """``value`` of flag ``--name`` if it is a positive integer; else one :class:`UserError` line."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"--{name} must be a positive integer, got {value!r}")
    return value


def plan_batches(args: Any, world_size: int, *, ptx: bool = False) -> BatchPlan:
    """Derive the :class:`BatchPlan` from the step-3 flags; refuse a rollout that does not split.

    Upstream's ``MiniDataset`` silently made a short last micro-batch (and its ``num_total_iters``
    counted fractional micro-batches); here every generation batch must split exactly.
    """
    gen_bs = positive_flag("per_device_generation_batch_size", args.per_device_generation_batch_size)
    gen_batches = positive_flag("generation_batches", args.generation_batches)
    train_bs = positive_flag("per_device_training_batch_size", args.per_device_training_batch_size)
    epochs = positive_flag("ppo_epochs", args.ppo_epochs)
    ga = positive_flag("gradient_accumulation_steps", args.gradient_accumulation_steps)
    if gen_bs % train_bs != 0:
        # RolloutBuffer (upstream's MiniDataset) splits each generation batch on its own (as upstream), so a generation batch
        # that does not split would leave a short micro-batch in every one of them.
        raise UserError(
            f"a generation batch of per_device_generation_batch_size {gen_bs} prompts does not split into "
            f"micro-batches of per_device_training_batch_size {train_bs}; make the training batch size "
            f"divide {gen_bs} (recommended: equal to the generation batch size)"
        )
    return BatchPlan(gen_bs, gen_batches, train_bs, epochs, ga, ga * 2 if ptx else ga, world_size, ptx)


def num_total_iters(plan: BatchPlan, num_prompt_batches: int, num_unsup_batches: int | None, epochs: int) -> int:
    """Optimizer steps of the whole run, for the LR schedule (upstream's formula, rounded up).

    ``epochs x min(prompt batches, ptx batches) x (gen_bs / train_bs) x ppo_epochs / GA``.
    """
    batches = num_prompt_batches if num_unsup_batches is None else min(num_prompt_batches, num_unsup_batches)
    micro_steps = batches * (plan.generation_batch_size / plan.training_batch_size) * plan.ppo_epochs
    return max(1, math.ceil(epochs * micro_steps / plan.gradient_accumulation_steps))
