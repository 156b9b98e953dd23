"""The training loops: the epoch loop of steps 1, 2 and DPO, the PPO epoch loop of step 3, and the
final save of steps 1 and 2.

Steps 1 and 2 build their engine, then call :func:`train_epochs` with a ``loss_fn`` (one
micro-batch -> loss) and an ``evaluate`` callback, then :func:`finish_run`. The loop owns what the
three have in common: per-epoch sampler order, resume (skipping the micro-batches a checkpoint
already trained), the non-finite guard, the optimizer-step counter and ``--max_train_steps``,
checkpoints, the loss / throughput lines and TensorBoard's ``train/loss``.

Step 3 calls :func:`train_ppo_epochs` with its trainer and a ``ppo_iteration`` callback (train one
collected rollout, log it): the loop generates experience batch by batch, collects
``--generation_batches`` of them into a rollout, and owns the same per-epoch order, resume,
checkpoints and stop rules. It knows the trainer and the held-out evaluation only by the methods it
calls (:class:`ExperienceSource`, :class:`RolloutEvaluation`): they are step 3's (``dschat/rlhf``), on
the floor above.
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch.utils.data import DataLoader

from dschat.data.collators import RolloutBuffer, drop_padding_columns, set_epoch_if_distributed
from dschat.models.save import save_hf_model
from dschat.runtime.averages import ExponentialMovingAverage
from dschat.runtime.dist import print_rank_0
from dschat.runtime.perf import print_throughput as throughput_line
from dschat.runtime.zero3 import release_zero3_prefetch
from dschat.training.checkpoint import Checkpointer, TrainingPosition
from dschat.training.common import (
    OptimizerStepCounter,
    RunContext,
    RunResult,
    StepTimer,
    TensorBoardLogger,
    prepare_batch,
    print_loss_line,
    to_device,
    write_weight_digest,
)
from dschat.training.nonfinite import NonFiniteGuard

__all__ = ["train_epochs", "finish_run", "PPOCounters", "ExperienceSource", "RolloutEvaluation", "train_ppo_epochs"]


def train_epochs(
    args: argparse.Namespace,
    ctx: RunContext,
    engine: Any,
    train_loader: DataLoader,
    *,
    result: RunResult,
    tb: TensorBoardLogger,
    counter: OptimizerStepCounter,
    loss_fn: Callable[[dict], torch.Tensor],
    evaluate: Callable[[int], None],
    on_optimizer_step: Callable[[int], None] | None = None,
    on_epoch_end: Callable[[int, float], None] | None = None,
    print_loss: bool = False,
    print_throughput: bool = True,
) -> None:
    """Train ``engine`` for ``--num_train_epochs`` (or ``--max_train_steps``), first resuming from
    the checkpoint ``--resume`` / ``--resume_from`` name, if any (the engine is saved under the tag
    ``model``; ``counter`` is set to the checkpoint's micro-steps).

    ``evaluate(epoch)`` runs before training (epoch 0, not on resume) and after each epoch;
    ``on_optimizer_step(optimizer_steps)`` after every optimizer step (step 2's ``--eval_interval``);
    ``on_epoch_end(epoch, mean_loss)`` before the epoch's evaluation, with the mean micro-step loss
    of the epoch (kept across a resume).
    """
    checkpointer = Checkpointer(args, {"model": engine}, ctx.rank, loaders=[train_loader])
    resumed = checkpointer.resume(counter)
    guard = NonFiniteGuard(args.max_nonfinite_steps, ctx.rank, ctx.device, last_checkpoint=checkpointer.latest)
    print_rank_0("***** Running training *****", ctx.rank)
    if resumed is None:
        evaluate(0)
    for epoch in range(checkpointer.first_epoch(), args.num_train_epochs):
        if counter.done:  # resumed from the run's last checkpoint: only the final save is left
            break
        print_rank_0(
            f"Beginning of Epoch {epoch + 1}/{args.num_train_epochs}, Total Micro Batches {len(train_loader)}",
            ctx.rank)
        set_epoch_if_distributed(train_loader, epoch)  # a new order each epoch (upstream never called it)
        engine.train()
        skip = checkpointer.batches_done(epoch)
        loss_sum = float(resumed.extra.get("epoch_loss_sum", 0.0)) if skip and resumed else 0.0
        trained = int(resumed.extra.get("epoch_trained", skip)) if skip and resumed else 0
        for step, batch in enumerate(train_loader):
            if step < skip:  # trained before the checkpoint: the order depends on (seed, epoch, rank) only
                continue
            timer = StepTimer()
            batch = prepare_batch(batch, ctx.device)
            result.step_shapes.append(tuple(batch["input_ids"].shape))
            loss = loss_fn(batch)
            if print_loss:
                print_loss_line(epoch, step, loss)
            if not guard.loss_ok(loss, where=f"epoch {epoch} step {step}"):
                continue
            engine.backward(loss)
            if not guard.step(engine, where=f"epoch {epoch} step {step}"):
                continue
            loss_sum += loss.item()
            trained += 1
            result.train_losses.append(loss.item())
            result.step_times.append(timer.elapsed())
            if print_throughput and ctx.rank == 0:
                throughput_line(engine.module, args, result.step_times[-1], ctx.rank)
            if counter.micro_step():
                tb.scalars(counter.optimizer_steps, **{"train/loss": loss.item()})
                if on_optimizer_step is not None:
                    on_optimizer_step(counter.optimizer_steps)
                    engine.train()
                checkpointer.maybe_save(TrainingPosition(
                    epoch, step + 1, counter.micro_steps, counter.optimizer_steps,
                    extra={"epoch_loss_sum": loss_sum, "epoch_trained": trained}))
                if counter.done:
                    break
        if on_epoch_end is not None:
            on_epoch_end(epoch, loss_sum / max(trained, 1))
        evaluate(epoch + 1)
        engine.tput_timer.update_epoch_count()
        if counter.done:
            print_rank_0(f"Reached --max_train_steps {args.max_train_steps}; stopping", ctx.rank)
            break
    tb.close()
    result.optimizer_steps = counter.optimizer_steps
    result.skipped_nonfinite = guard.skipped


def finish_run(args: argparse.Namespace, ctx: RunContext, engine: Any, tokenizer: Any, result: RunResult,
               digest_tag: str) -> RunResult:
    """The weight digest (2-rank tests), the final Hugging Face folder (collective: ZeRO-3 gathers;
    LoRA fused into the saved copy; written atomically), no ZeRO-3 parameter left in flight, and the
    engine on the result. Collective: every rank calls it."""
    result.weight_digest = write_weight_digest(engine, digest_tag)
    if args.output_dir is not None:
        print_rank_0("saving the final model ...", ctx.rank)
        save_hf_model(engine, tokenizer, args.output_dir, args.save_format)
        result.output_dir = Path(args.output_dir)
    # Saving released them already; without a save, a ZeRO-3 run would end with the last evaluation's
    # prefetched parameters still in flight when the process group is destroyed at exit.
    release_zero3_prefetch(engine)
    result.engine = engine
    return result


# ------------------------------------------------------------------------------------------------
# Step 3
# ------------------------------------------------------------------------------------------------
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

    def count_overflow(self, trainer: Any) -> None:
        """After each generation batch, as upstream: count it unless actor or critic overflowed."""
        actor_overflow, critic_overflow = trainer.get_overflow()
        if not actor_overflow and not critic_overflow:
            self.non_overflow_step_count += 1


class ExperienceSource(Protocol):
    """What :func:`train_ppo_epochs` calls on step 3's trainer
    (:class:`~dschat.rlhf.ppo_trainer.DeepSpeedPPOTrainer`)."""

    generate_time: float  # the last generate_experience call's generation, in seconds
    experience_time: float  # and its scoring passes
    nonfinite: NonFiniteGuard

    def generate_experience(self, prompts: torch.Tensor, mask: torch.Tensor, step: int) -> Any | None: ...

    def get_overflow(self) -> tuple[bool, bool]: ...


class RolloutEvaluation(Protocol):
    """What :func:`train_ppo_epochs` calls on step 3's held-out evaluation
    (:class:`~dschat.rlhf.evaluation.StepThreeEvaluation`)."""

    should_stop: bool  # the over-optimization alarm asks to stop (--stop_on_overoptimization)

    def maybe_evaluate(self, global_step: int, epoch: int = 0) -> Any: ...

    def attach(self, position: TrainingPosition) -> TrainingPosition: ...


#: Trains one collected rollout and logs it: ``(exp_dataset, unsup_dataset, *, epoch, step, gen_time,
#: exp_time) -> record`` (one ``metrics.jsonl`` record, docs/metrics.md).
PPOIteration = Callable[..., dict]


def train_ppo_epochs(
    args: argparse.Namespace,
    ctx: RunContext,
    trainer: ExperienceSource,
    prompt_loader: DataLoader,
    unsup_loader: DataLoader | None,
    *,
    checkpointer: Checkpointer,
    counters: PPOCounters,
    evaluation: RolloutEvaluation,
    ppo_iteration: PPOIteration,
    resumed: bool,
    history: list[dict],
    skipped_steps: list[int],
) -> None:
    """Step 3's loop over ``--num_train_epochs`` of generation batches, after ``checkpointer`` has
    resumed (``resumed``) and ``counters`` hold the checkpoint's state.

    Each batch of prompts is generated and scored (``trainer.generate_experience``; ``None``: every
    answer was too short, the step goes to ``skipped_steps``); once ``--generation_batches`` of them
    (and as many PPO-ptx batches, with ``unsup_loader``) make a rollout, ``ppo_iteration`` trains it
    and its record goes to ``history``, then the evaluation and the checkpoint follow. The loop stops
    at ``--test_stop_step`` batches without an fp16 overflow (``--enable_test_mode``) or when the
    evaluation asks to; the held-out evaluation also runs once before the first PPO step.
    """
    exp_mini_dataset = RolloutBuffer(args.generation_batches, args.per_device_training_batch_size)
    unsup_mini_dataset = RolloutBuffer(args.generation_batches, args.per_device_training_batch_size)
    ptx = unsup_loader is not None
    gen_time = exp_time = 0.0  # summed over the generation batches of the current rollout
    # Resumed from the checkpoint a test-mode run ended with: only the final save is left.
    stop = bool(resumed and args.enable_test_mode and counters.non_overflow_step_count >= args.test_stop_step)
    stop = stop or evaluation.should_stop
    evaluation.maybe_evaluate(counters.global_step)  # before the first PPO step
    for epoch in range(checkpointer.first_epoch(), args.num_train_epochs):
        if stop:
            break
        num_batches = len(prompt_loader) if unsup_loader is None else min(len(prompt_loader), len(unsup_loader))
        print_rank_0(f"Beginning of Epoch {epoch + 1}/{args.num_train_epochs}, Total Generation Batches "
                     f"{num_batches}", ctx.rank)
        set_epoch_if_distributed(prompt_loader, epoch)  # a new order each epoch (upstream never called it)
        if unsup_loader is not None:
            set_epoch_if_distributed(unsup_loader, epoch)
        unsup_batches = unsup_loader if unsup_loader is not None else itertools.repeat(None)
        skip = checkpointer.batches_done(epoch)
        for step, (batch_prompt, batch_unsup) in enumerate(zip(prompt_loader, unsup_batches)):
            if step < skip:  # trained before the checkpoint: the order depends on (seed, epoch, rank) only
                continue
            # Prompts come left-padded to --max_prompt_seq_len; columns that are padding in every row
            # change no output (positions come from the mask), so they are dropped before generation.
            batch_prompt = drop_padding_columns(to_device(batch_prompt, ctx.device), "prompt_att_mask", side="left")
            out = trainer.generate_experience(batch_prompt["prompt"], batch_prompt["prompt_att_mask"], step)
            gen_time += trainer.generate_time
            exp_time += trainer.experience_time
            exp_dataset = unsup_dataset = None
            if out is None:
                skipped_steps.append(step)
            else:
                exp_dataset = exp_mini_dataset.add(out)
                unsup_dataset = unsup_mini_dataset.add(to_device(batch_unsup, ctx.device)) if ptx else None
            if exp_dataset is not None:  # a whole rollout collected: one PPO iteration
                history.append(ppo_iteration(exp_dataset, unsup_dataset, epoch=epoch, step=step, gen_time=gen_time,
                                             exp_time=exp_time))
                gen_time = exp_time = 0.0
                evaluation.maybe_evaluate(counters.global_step, epoch)
            counters.count_overflow(trainer)
            if exp_dataset is not None:
                checkpointer.maybe_save(evaluation.attach(counters.position(epoch, step + 1, trainer.nonfinite)))
            if (args.enable_test_mode and counters.non_overflow_step_count == args.test_stop_step
                    or evaluation.should_stop):
                stop = True
                break
