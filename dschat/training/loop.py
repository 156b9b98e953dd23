"""The training loop of steps 1, 2 and DPO, and their final save.

Steps 1 and 2 build their engine, then call :func:`train_epochs` with a ``loss_fn`` (one
micro-batch -> loss) and an ``evaluate`` callback, then :func:`finish_run`. The loop owns what the
three have in common: per-epoch sampler order, resume (skipping the micro-batches a checkpoint
already trained), the non-finite guard, the optimizer-step counter and ``--max_train_steps``,
checkpoints, the loss / throughput lines and the trackers' ``train/loss`` (each optimizer step's mean
micro-batch loss over every rank: one all-reduce per optimizer step).
Step 3's loop is :func:`dschat.rlhf.ppo_loop.run_ppo`.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

from dschat.data.collators import set_epoch_if_distributed
from dschat.models.save import save_hf_model
from dschat.runtime.dist import get_all_reduce_mean, print_rank_0
from dschat.runtime.optim import FlagSchedule, num_update_steps, resume_schedule
from dschat.runtime.perf import print_throughput as throughput_line
from dschat.runtime.zero3 import release_zero3_prefetch
from dschat.training.checkpoint import Checkpointer, TrainingPosition, refuse_past_the_end
from dschat.training.engine_setup import plan_optimizer_steps
from dschat.training.loaders import prepare_batch
from dschat.training.progress import (
    OptimizerStepCounter,
    RunResult,
    StepTimer,
    TensorBoardLogger,
    print_loss_line,
)
from dschat.training.run_setup import RunContext
from dschat.training.weight_digest import write_weight_digest
from dschat.training.nonfinite import NonFiniteGuard

__all__ = ["train_epochs", "finish_run"]


def steps_planned_and_left(args: argparse.Namespace, num_batches: int, checkpointer: Checkpointer,
                           done: int) -> tuple[int, int]:
    """The optimizer steps this run's LR schedule is planned over (:func:`plan_optimizer_steps`) and
    those left after a resume at ``done`` steps (the rest of the resumed epoch and the later ones, on
    this run's accumulation; within ``--max_train_steps``)."""
    epoch, accumulation = checkpointer.first_epoch(), args.gradient_accumulation_steps
    left = (math.ceil((num_batches - checkpointer.batches_done(epoch)) / accumulation)
            + num_update_steps(num_batches, max(0, args.num_train_epochs - epoch - 1), accumulation))
    if args.max_train_steps > 0:
        left = min(left, max(0, args.max_train_steps - done))
    planned = plan_optimizer_steps(num_batches, args.num_train_epochs, accumulation, args.max_train_steps)
    return planned, left


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
    step: str | None = None,
) -> None:
    """Train ``engine`` for ``--num_train_epochs`` (or ``--max_train_steps``), first resuming from
    the checkpoint ``--resume`` / ``--resume_from`` name, if any (the engine is saved under the tag
    ``model``; ``counter`` is set to the checkpoint's micro-steps).

    ``evaluate(epoch)`` runs before training (epoch 0, not on resume) and after each epoch;
    ``on_optimizer_step(optimizer_steps)`` after every optimizer step (step 2's ``--eval_interval``);
    ``on_epoch_end(epoch, mean_loss)`` before the epoch's evaluation, with the mean micro-step loss
    of the epoch (kept across a resume). ``step`` (``step1``, ``step2``, ``dpo``) is recorded in each
    checkpoint, and a checkpoint another step wrote is refused on resume.
    """
    checkpointer = Checkpointer(args, {"model": engine}, ctx.rank, loaders=[train_loader],
                                models={"model": ("--model_name_or_path", getattr(args, "model_name_or_path", None))},
                                step=step)
    wanted = FlagSchedule.of(engine.lr_scheduler)  # this run's flags, before a checkpoint's schedule loads
    resumed = checkpointer.resume(counter)
    if resumed is not None:  # TensorBoard hides what a killed attempt logged after the checkpoint's step
        refuse_past_the_end(checkpointer, len(train_loader), args.num_train_epochs,
                            (counter.optimizer_steps, args.max_train_steps, "optimizer steps done, past --max_train_steps"))
        tb.resume_at(counter.optimizer_steps + 1)
        for line in resume_schedule(wanted, engine.lr_scheduler, *steps_planned_and_left(
                args, len(train_loader), checkpointer, counter.optimizer_steps)):
            print_rank_0(f"[checkpoint] {line}", ctx.rank)
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
        window: list[float] = []  # the losses since the last optimizer step: its train/loss, meaned over ranks
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
            window.append(loss.item())
            result.train_losses.append(loss.item())
            result.step_times.append(timer.elapsed())
            if print_throughput and ctx.rank == 0:
                throughput_line(engine.module, args, result.step_times[-1], ctx.rank)
            if counter.micro_step():
                step_loss = get_all_reduce_mean(torch.tensor(sum(window) / len(window), dtype=torch.float64))
                tb.scalars(counter.optimizer_steps, **{"train/loss": step_loss.item()})
                window = []
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
