"""Step 3's loop: :func:`run_ppo`, read top to bottom.

For each batch of prompts: **batch** (to the device, padding-only columns dropped) -> **generate**
and score (the experience maker, ``trainer.experience``; with ``--dynamic_sampling`` more batches
until its groups are full, :mod:`dschat.rlhf.dynamic_sampling`) -> **buffer** (``--generation_batches``
batches make a rollout) -> once a rollout is whole: **prepare** (advantages, returns, rollout
statistics) -> **micro-steps** of ``--ppo_epochs`` (the PPO update, ``trainer.update``: actor,
critic, PPO-ptx; then the EMA) -> **log** -> **evaluate** -> **checkpoint** (only between optimizer
steps: one due partway through gradient accumulation waits for the next iteration that ends one).
The loop calls the two parts of :class:`~dschat.rlhf.ppo_trainer.DeepSpeedPPOTrainer` directly and
gets results back (the trainer is their formulas object, so a formula overridden on it still
changes what they compute); the resume, checkpoint timing and stop arithmetic it asks is
:mod:`dschat.training.ppo_counters`. Below the loop: what an iteration logs (upstream's log lines,
the throughput lines, TensorBoard, one ``metrics.jsonl`` record, docs/metrics.md) and the metrics
file cut back on resume.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sized

import torch
from torch.utils.data import DataLoader

from dschat.data.collators import SOURCES_KEY, drop_padding_columns, set_epoch_if_distributed
from dschat.paths import METRICS_FILE
from dschat.rlhf.actor_ema import moving_average
from dschat.rlhf.heldout.evaluation import StepThreeEvaluation
from dschat.rlhf.dynamic_sampling import GroupFilter, SamplingStats
from dschat.rlhf.experience import Experience, RolloutBuffer
from dschat.rlhf.experience_maker import RolloutStats
from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
from dschat.rlhf.ppo_update import MicroStepStats
from dschat.runtime.dist import all_reduce_sum, get_all_reduce_mean, print_rank_0
from dschat.runtime.fs import atomic_file, open_own
from dschat.runtime.perf import print_throughput_step3
from dschat.training.checkpoint import Checkpointer, checkpoint_root
from dschat.runtime.devices import to_device
from dschat.training.progress import TensorBoardLogger
from dschat.training.run_setup import RunContext
from dschat.training.ppo_counters import CheckpointTiming, PPOCounters, finished_before_resume, reached_test_stop

__all__ = ["METRICS_FILE", "PPORun", "IterationResult", "RolloutTimes", "run_ppo", "batches_per_epoch",
           "generate_batch", "group_filter", "fill_groups", "train_rollout", "log_iteration",
           "iteration_record", "tensorboard_scalars", "append_metrics", "truncate_metrics", "adopt_metrics",
           "resume_metrics"]


@dataclass
class PPORun:
    """What :func:`run_ppo` hands back: one ``metrics.jsonl`` record per PPO iteration, and the
    generation steps skipped because no rank kept an answer."""

    history: list[dict] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)


@dataclass
class IterationResult:
    """One trained PPO iteration: rollout statistics (all ranks) and this rank's mean losses."""

    rollout: RolloutStats
    ppo_epochs: int
    actor_loss: float
    critic_loss: float
    unsup_loss: float
    training_time: float


def run_ppo(args: argparse.Namespace, ctx: RunContext, trainer: DeepSpeedPPOTrainer, prompt_loader: DataLoader,
            unsup_loader: DataLoader | None, *, checkpointer: Checkpointer, counters: PPOCounters,
            evaluation: StepThreeEvaluation, tb: TensorBoardLogger, resumed: bool) -> PPORun:
    """Step 3 over ``--num_train_epochs`` of generation batches, after ``checkpointer`` has resumed
    (``resumed``) and ``counters`` hold the checkpoint's state. Stops at ``--test_stop_step`` batches
    without an fp16 overflow (``--enable_test_mode``) or when the evaluation's alarm asks to. The
    held-out evaluation also runs once before the first PPO step. Collective: every rank runs it."""
    run = PPORun()
    rollout_buffer = RolloutBuffer(args.generation_batches, args.per_device_training_batch_size)
    ptx_buffer = RolloutBuffer(args.generation_batches, args.per_device_training_batch_size)
    times = RolloutTimes()  # summed over the generation batches of the current rollout
    groups = group_filter(trainer, args, ctx)  # --dynamic_sampling, else None
    saves = CheckpointTiming(checkpointer, ctx.rank)  # --save_interval, between optimizer steps
    stop = finished_before_resume(args, counters, resumed) or evaluation.should_stop
    evaluation.maybe_evaluate(counters.global_step)  # before the first PPO step
    for epoch in range(checkpointer.first_epoch(), args.num_train_epochs):
        if stop:
            break
        begin_epoch(args, ctx, epoch, prompt_loader, unsup_loader)
        skip = checkpointer.batches_done(epoch)  # trained before the checkpoint: (seed, epoch, rank) fix the order
        ptx_batches = unsup_loader if unsup_loader is not None else itertools.repeat(None)
        batches = enumerate(zip(prompt_loader, ptx_batches))
        for step, (prompt_batch, ptx_batch) in batches:
            if step < skip:
                continue
            # 1.-2. batch, generate and score (--dynamic_sampling: more batches until the groups inform)
            experience = generate_batch(trainer, ctx, prompt_batch, step, times)
            if groups is not None:
                experience, step = fill_groups(trainer, ctx, groups, experience, prompt_batch, step, batches, times)
            # 3. buffer: a rollout is --generation_batches batches (None: every answer too short)
            rollout = ptx_rollout = None
            if experience is None:
                run.skipped_steps.append(step)
            else:
                rollout = rollout_buffer.add(experience)
                if unsup_loader is not None:
                    ptx_rollout = ptx_buffer.add(to_device(ptx_batch, ctx.device))
            if rollout is not None:
                # 4.-5. prepare, then the micro-steps (actor, critic, ptx, EMA)
                iteration = train_rollout(trainer, args, rollout, ptx_rollout)
                # 6. log
                run.history.append(log_iteration(trainer, args, counters, iteration, epoch=epoch, step=step,
                                                 gen_time=times.generation, exp_time=times.experience, rank=ctx.rank,
                                                 tb=tb, env_time=times.environment,
                                                 sampling=groups.pop_stats() if groups is not None else None))
                times = RolloutTimes()
                # 7. evaluate
                evaluation.maybe_evaluate(counters.global_step, epoch)
            counters.count_overflow(trainer.update)
            # 8. checkpoint (due, or postponed: when actor and critic are between optimizer steps)
            if rollout is not None:
                saves.maybe_save(evaluation.attach(counters.position(epoch, step + 1, trainer.nonfinite)))
            if reached_test_stop(args, counters) or evaluation.should_stop:
                stop = True
                break
    if not evaluation.should_stop:  # auto: the run's last step, also when it came before the planned one
        last_epoch = run.history[-1]["epoch"] if run.history else 0  # (batches used up by dynamic sampling)
        evaluation.maybe_evaluate(counters.global_step, last_epoch, at_end=True)
    return run


@dataclass
class RolloutTimes:
    """Seconds spent generating (``environment``: the environments' share of it, ``--env``) and
    scoring the generation batches of one rollout."""

    generation: float = 0.0
    experience: float = 0.0
    environment: float = 0.0


def generate_batch(trainer: DeepSpeedPPOTrainer, ctx: RunContext, prompt_batch: dict, step: int,
                   times: RolloutTimes) -> Experience | None:
    """One generation batch of the prompt loader, generated and scored (``None``: no rank kept an
    answer); its seconds added to ``times``. Collective."""
    # Left-padded prompts; all-padding columns change no output (positions come from the mask).
    prompt_batch = drop_padding_columns(to_device(prompt_batch, ctx.device), "prompt_att_mask", side="left")
    maker = trainer.experience
    experience = maker.generate_experience(prompt_batch["prompt"], prompt_batch["prompt_att_mask"], step,
                                           prompt_batch.get(SOURCES_KEY))
    times.generation += maker.generate_time
    times.experience += maker.experience_time
    times.environment += maker.env_time
    return experience


def group_filter(trainer: DeepSpeedPPOTrainer, args: argparse.Namespace, ctx: RunContext) -> GroupFilter | None:
    """``--dynamic_sampling``'s filter for this run's generation batches, or None without it."""
    settings = trainer.settings
    if not settings.dynamic_sampling:
        return None
    k = settings.num_generations
    return GroupFilter(group_size=k, groups_per_batch=args.per_device_generation_batch_size // k,
                       max_rounds=settings.max_sampling_rounds, clip_reward_value=trainer.clip_reward_value,
                       pad_token_id=trainer.tokenizer.pad_token_id, device=ctx.device)


def fill_groups(trainer: DeepSpeedPPOTrainer, ctx: RunContext, groups: GroupFilter, experience: Experience | None,
                prompt_batch: dict, step: int, batches: Iterator[tuple[int, tuple[dict, object]]],
                times: RolloutTimes) -> tuple[Experience | None, int]:
    """``--dynamic_sampling``: ``experience``'s informative groups (of ``prompt_batch``: one group per
    prompt), then the next generation batches of ``batches`` (their PPO-ptx batches unused) until
    every rank's batch is full of them, the rounds run out or the epoch's prompts do. Returns the batch
    (``None``: no informative group anywhere) and the step of the last generation batch drawn.
    Collective."""
    groups.add(experience, len(prompt_batch["prompt"]))  # a skipped batch counts its own prompts' groups
    while groups.wants_more():
        drawn = next(batches, None)
        if drawn is None:  # every rank's loader has as many batches: all stop here together
            break
        step, (prompt_batch, _) = drawn
        groups.add(generate_batch(trainer, ctx, prompt_batch, step, times), len(prompt_batch["prompt"]))
    return groups.batch(), step


def batches_per_epoch(prompt_loader: Sized, unsup_loader: Sized | None) -> int:
    """Generation batches per epoch: the prompt loader's, or the PPO-ptx loader's where that is
    shorter (the loop zips the two, as upstream's)."""
    return len(prompt_loader) if unsup_loader is None else min(len(prompt_loader), len(unsup_loader))


def begin_epoch(args: argparse.Namespace, ctx: RunContext, epoch: int, prompt_loader: DataLoader,
                unsup_loader: DataLoader | None) -> None:
    """The epoch's line and the samplers' new order (docs/upstream.md#data-cache)."""
    print_rank_0(f"Beginning of Epoch {epoch + 1}/{args.num_train_epochs}, Total Generation Batches "
                 f"{batches_per_epoch(prompt_loader, unsup_loader)}", ctx.rank)
    set_epoch_if_distributed(prompt_loader, epoch)
    if unsup_loader is not None:
        set_epoch_if_distributed(unsup_loader, epoch)


def train_rollout(trainer: DeepSpeedPPOTrainer, args: argparse.Namespace, rollout: list[Experience],
                  ptx_rollout: list[dict] | None) -> IterationResult:
    """One collected rollout: advantages and rollout statistics (the experience maker's
    ``prepare_rollout``), then the micro-steps of the update's ``schedule``: actor step, critic step,
    the PPO-ptx step when ``ptx_rollout`` is given, the EMA actor after each. Collective."""
    engine, update = trainer.rlhf_engine, trainer.update
    start = time.time()
    update.mark_rollout()  # the policy the rollout was sampled from: the on-policy check starts here
    stats = trainer.experience.prepare_rollout(rollout)  # 4. prepare
    update.train()
    if args.actor_gradient_checkpointing:
        engine.actor.module.gradient_checkpointing_enable()
    steps, ppo_epoch = 0, 0
    actor_sum = critic_sum = ptx_sum = 0.0
    for ppo_epoch, exp, ptx_batch in update.schedule(rollout, ptx_rollout):  # 5. micro-steps
        actor_loss, critic_loss = update.train_rlhf(exp)  # actor, then critic
        actor_sum += actor_loss.item()
        critic_sum += critic_loss.item()
        if ptx_rollout is not None:
            ptx_sum += update.train_unsupervised(ptx_batch, args.unsup_coef).item()
        steps += 1
        if args.enable_ema:
            moving_average(engine.actor, engine.actor_ema, zero_stage=args.actor_zero_stage)
    if args.actor_gradient_checkpointing:
        engine.actor.module.gradient_checkpointing_disable()  # never during generation
    steps = max(steps, 1)
    return IterationResult(stats, ppo_epoch + 1, actor_sum / steps, critic_sum / steps, ptx_sum / steps,
                           time.time() - start)


DASHES = "-" * 85


def log_iteration(trainer: DeepSpeedPPOTrainer, args: argparse.Namespace, counters: PPOCounters,
                  iteration: IterationResult, *, epoch: int, step: int, gen_time: float, exp_time: float, rank: int,
                  tb: TensorBoardLogger, env_time: float = 0.0, sampling: SamplingStats | None = None) -> dict:
    """Upstream's log lines and throughput lines, then one record (docs/metrics.md) to TensorBoard and
    ``metrics.jsonl``; advances ``counters.global_step``. Returns the record."""
    engine = trainer.rlhf_engine
    print_rank_0(f"Epoch: {epoch} | Step: {step} | PPO Epoch: {iteration.ppo_epochs} | "
                 f"Actor Loss: {iteration.actor_loss} | Critic Loss: {iteration.critic_loss} | "
                 f"Unsupervised Loss: {iteration.unsup_loss}", rank)
    print_throughput_step3(engine.actor.module, engine.critic, args, gen_time + exp_time + iteration.training_time,
                           gen_time, iteration.training_time, rank,
                           generated_batches=sampling.rounds if sampling is not None else None)
    # Mean over kept answers of all ranks; the EMA is fed that mean (docs/upstream.md#step-3-ppo).
    ema_reward = counters.ema_reward.update(iteration.rollout.reward)
    print_rank_0(f"Average reward score: {iteration.rollout.reward} | EMA reward score: {ema_reward}", rank)
    rollout = iteration.rollout
    if rollout.turns is not None:
        print_rank_0(f"Episodes: {rollout.turns:.2f} turns | {rollout.response_length:.1f} actor tokens | "
                     f"{rollout.observation_tokens:.1f} environment tokens | {rollout.cut_share:.0%} cut | "
                     f"environment time {env_time:.2f}s", rank)
    if sampling is not None:
        print_rank_0(f"Dynamic sampling: {sampling.dropped_groups} of {sampling.groups} groups had equal rewards "
                     f"(or no answer that trains) and were dropped, {sampling.surplus_groups} more were surplus | "
                     f"{sampling.rounds_per_batch:.2f} generation batches drawn per batch trained | "
                     f"{sampling.masked_groups} equal-reward groups masked to fill short batches", rank)
    print_rank_0(DASHES, rank)

    record = iteration_record(epoch, step, counters.global_step, trainer.update.pop_micro_stats(),
                              iteration.rollout, ema_reward, iteration.unsup_loss, gen_time, exp_time,
                              iteration.training_time, env_time, sampling)
    tb.scalars(counters.global_step, **tensorboard_scalars(record))
    if args.output_dir is not None and rank == 0:
        # A fresh run's first line starts the file (with --eval_interval, the evaluation before the
        # first step writes that line).
        fresh = counters.global_step == 0 and not getattr(args, "eval_interval", 0)
        append_metrics(Path(args.output_dir) / METRICS_FILE, record, fresh=fresh)
    counters.global_step += 1
    return record


def iteration_record(epoch: int, step: int, global_step: int, micro: list[MicroStepStats], rollout: RolloutStats,
                     ema_reward: float, unsup_loss: float, gen_time: float, exp_time: float,
                     train_time: float, env_time: float = 0.0, sampling: SamplingStats | None = None) -> dict:
    """One PPO iteration's numbers: rank means of the losses; token-weighted means of the ratio
    statistics over every micro-step of every rank (a micro-step whose answers were all dropped has
    no tokens and no ratio: it counts for nothing instead of making the means ``nan``); rollout stats
    are already global."""
    n = max(len(micro), 1)
    scored = [m for m in micro if m.tokens > 0]
    local = torch.tensor([sum(m.actor_loss for m in micro) / n, sum(m.critic_loss for m in micro) / n],
                         dtype=torch.float64)
    actor_loss, critic_loss = get_all_reduce_mean(local).tolist()
    sums = torch.tensor([sum(m.approx_kl * m.tokens for m in scored), sum(m.clip_frac * m.tokens for m in scored),
                         sum(m.ratio_mean * m.tokens for m in scored), sum(m.tokens for m in scored)],
                        dtype=torch.float64)
    kl_sum, clip_sum, ratio_sum, tokens = all_reduce_sum(sums).tolist()  # a host tensor: NCCL needs the copy
    approx_kl, clip_frac, ratio_mean = ((x / tokens if tokens else float("nan")) for x in (kl_sum, clip_sum, ratio_sum))
    # The rollout decoder's log-prob gap to the training forward, over the micro-steps that measured it.
    gapped = [m for m in scored if m.logprob_gap == m.logprob_gap]
    gap_sum, gap_tokens = all_reduce_sum(torch.tensor([sum(m.logprob_gap * m.tokens for m in gapped),
                                                       sum(m.tokens for m in gapped)], dtype=torch.float64)).tolist()
    optional = {} if rollout.turns is None else {
        "turns": rollout.turns, "observation_tokens": rollout.observation_tokens, "cut_share": rollout.cut_share,
        "time_env": env_time}
    if sampling is not None:  # --dynamic_sampling
        optional.update({"sampled_groups": sampling.groups, "dropped_groups": sampling.dropped_groups,
                         "surplus_groups": sampling.surplus_groups, "masked_groups": sampling.masked_groups,
                         "sampling_rounds": sampling.rounds_per_batch})
    return {
        "epoch": epoch, "step": step, "global_step": global_step,
        "reward": rollout.reward, "ema_reward": ema_reward,
        "actor_loss": actor_loss, "critic_loss": critic_loss, "unsup_loss": unsup_loss,
        "approx_kl": approx_kl, "clip_frac": clip_frac, "ratio_mean": ratio_mean,
        "ratio_max": max((m.ratio_max for m in scored), default=float("nan")),
        "ratio_min": min((m.ratio_min for m in scored), default=float("nan")),
        "logprob_gap": gap_sum / gap_tokens if gap_tokens else float("nan"),
        "kl_to_ref": rollout.kl_to_ref, "value_explained_variance": rollout.value_explained_variance,
        "response_length": rollout.response_length, "kept": rollout.kept, "dropped": rollout.dropped,
        "time_generation": gen_time, "time_experience": exp_time, "time_training": train_time,
        **optional,
        "micro_steps": [asdict(m) for m in micro],
    }


def tensorboard_scalars(record: dict) -> dict[str, float]:
    """The scalar names documented in docs/metrics.md."""
    keys = ("reward", "ema_reward", "actor_loss", "critic_loss", "unsup_loss", "approx_kl", "clip_frac",
            "ratio_mean", "ratio_max", "ratio_min", "logprob_gap", "kl_to_ref", "value_explained_variance",
            "response_length")
    scalars = {k: record[k] for k in keys}
    scalars.update({"dropped_answers": record["dropped"], "time/generation": record["time_generation"],
                    "time/experience": record["time_experience"], "time/training": record["time_training"]})
    if "turns" in record:  # --env
        scalars.update({"episode/turns": record["turns"], "episode/observation_tokens": record["observation_tokens"],
                        "episode/cut_share": record["cut_share"], "time/environment": record["time_env"]})
    if "dropped_groups" in record:  # --dynamic_sampling
        scalars.update({"dynamic_sampling/dropped_groups": record["dropped_groups"],
                        "dynamic_sampling/masked_groups": record["masked_groups"],
                        "dynamic_sampling/rounds": record["sampling_rounds"]})
    return scalars


def append_metrics(path: Path, record: dict, *, fresh: bool = False) -> None:
    """One JSON line per PPO iteration (what the e2e report plots); ``fresh``: the file's first line.

    Written as it goes, so a crashed run still leaves the curve up to its last iteration; never through
    a symbolic link another account made (:func:`~dschat.runtime.fs.open_own`: one line).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({k: v for k, v in record.items() if k != "micro_steps"}, allow_nan=True)
    with open_own(path, "w" if fresh else "a", encoding="utf-8") as f:
        f.write(line + "\n")


def resume_metrics(path: Path, iterations: int, checkpoint: Path | None) -> None:
    """On resume from ``checkpoint`` (of ``iterations`` PPO iterations): this run's ``metrics.jsonl``
    (``path``) cut back to it (:func:`truncate_metrics`), or, when the checkpoint is another folder's
    (``--resume_from``; its run's file is ``<that folder>/metrics.jsonl``), started from that run's
    lines (:func:`adopt_metrics`, one notice). A fresh run (``checkpoint`` None) sets an earlier run's
    file aside as ``metrics.jsonl.N`` (one notice), so that it never stands beside this run's models,
    even when this run logs no iteration."""
    if checkpoint is None:
        aside = _set_aside(path)
        if aside is not None:
            print(f"[metrics] a fresh run: the earlier run's {path.name} is kept as {aside.name}", flush=True)
        return
    source = checkpoint.resolve()  # a link or a relative path names the run whose folder holds it
    if source.parent == checkpoint_root(path.parent).resolve():
        truncate_metrics(path, iterations)
    else:
        print(adopt_metrics(path, iterations, source.parent.parent / path.name), flush=True)


def truncate_metrics(path: Path, iterations: int) -> None:
    """On resume: keep the lines of the iterations the checkpoint holds (a killed run may have
    written more), so the resumed run's lines follow without duplicates. An evaluation record
    (``"kind": "eval"``) at step N was made before checkpoint N: kept with it."""
    if not path.is_file():
        return
    with atomic_file(path) as tmp:  # a kill leaves the old file, never a half-written one
        tmp.write_text("".join(_lines_up_to(path, iterations)), encoding="utf-8")


def adopt_metrics(path: Path, iterations: int, source: Path) -> str:
    """On resume from another folder's checkpoint (``--resume_from``): ``path`` (this folder's
    ``metrics.jsonl``, another run's) is set aside as ``metrics.jsonl.N`` (the first free N), and the
    lines of the checkpoint's own run up to it (``source``: that run's ``metrics.jsonl``, as
    :func:`truncate_metrics` keeps them; none when it is missing) start this folder's file. Returns
    the notice saying so."""
    aside = _set_aside(path)
    lines = _lines_up_to(source, iterations) if source.is_file() else []
    with atomic_file(path) as tmp:
        tmp.write_text("".join(lines), encoding="utf-8")
    kept = f"; {aside.name} keeps its earlier lines (another run's)" if aside is not None else ""
    return (f"[metrics] resumed from another folder's checkpoint: {path} starts with the {len(lines)} line(s) of "
            f"{source} up to iteration {iterations}{kept}")


def _set_aside(path: Path) -> Path | None:
    """``path`` renamed to ``<name>.N``, the first free N (the new name); None when there is none."""
    if not os.path.lexists(path):
        return None
    aside = next(path.with_name(f"{path.name}.{n}") for n in itertools.count(1)
                 if not os.path.lexists(path.with_name(f"{path.name}.{n}")))
    os.rename(path, aside)
    return aside


def _lines_up_to(path: Path, iterations: int) -> list[str]:
    """The lines of ``path`` (a ``metrics.jsonl``) a checkpoint of ``iterations`` PPO iterations
    holds: training records below it, evaluation records up to it; a line a kill cut is dropped."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            limit = iterations + 1 if record.get("kind") == "eval" else iterations
            if record.get("global_step", iterations) < limit:
                kept.append(line + "\n")
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    return kept
