"""One PPO iteration of step 3, and what it logs.

The PPO epoch loop (:func:`dschat.training.loop.train_ppo_epochs`) collects experience batch by
batch; once a rollout is complete (``--generation_batches`` batches) step 3's ``main`` has it call
:func:`train_iteration` (``--ppo_epochs`` passes of actor step, critic step and optional PPO-ptx step
per micro-batch, the EMA actor after each) and :func:`log_iteration` (upstream's log lines, the
throughput lines, TensorBoard, ``metrics.jsonl``). :class:`~dschat.training.loop.PPOCounters`, the
state besides the engines that a step-3 checkpoint carries, lives beside the loop and is re-exported
here.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dschat.paths import METRICS_FILE
from dschat.rlhf.actor_ema import moving_average
from dschat.rlhf.experience_maker import RolloutStats
from dschat.rlhf.ppo_trainer import MicroStepStats
from dschat.runtime.dist import all_reduce_sum, get_all_reduce_mean, print_rank_0
from dschat.runtime.perf import print_throughput_step3
from dschat.training.loop import PPOCounters

__all__ = ["METRICS_FILE", "IterationResult", "PPOCounters", "log_iteration", "train_iteration",
           "truncate_metrics"]

DASHES = "-" * 85


# ------------------------------------------------------------------------------------------------
# Training on one rollout
# ------------------------------------------------------------------------------------------------
@dataclass
class IterationResult:
    """One trained PPO iteration: rollout statistics (all ranks) and this rank's mean losses."""

    rollout: RolloutStats
    ppo_epochs: int
    actor_loss: float
    critic_loss: float
    unsup_loss: float
    training_time: float


def train_iteration(trainer: Any, args: Any, exp_dataset: list, unsup_dataset: list | None) -> IterationResult:
    """Advantages and rollout statistics, then the micro-steps of ``trainer.schedule`` (actor step,
    critic step, the PPO-ptx step when ``unsup_dataset`` is given, the EMA actor after each)."""
    engine = trainer.rlhf_engine
    start = time.time()
    rollout = trainer.prepare_rollout(exp_dataset)
    trainer.train()
    if args.actor_gradient_checkpointing:
        engine.actor.module.gradient_checkpointing_enable()
    steps, ppo_ep = 0, 0
    actor_sum = critic_sum = unsup_sum = 0.0
    for ppo_ep, exp_data, unsup_data in trainer.schedule(exp_dataset, unsup_dataset):
        actor_loss, critic_loss = trainer.train_rlhf(exp_data)
        actor_sum += actor_loss.item()
        critic_sum += critic_loss.item()
        if unsup_dataset is not None:
            unsup_sum += trainer.train_unsupervised(unsup_data, args.unsup_coef).item()
        steps += 1
        if args.enable_ema:
            moving_average(engine.actor, engine.actor_ema, zero_stage=args.actor_zero_stage)
    if args.actor_gradient_checkpointing:
        engine.actor.module.gradient_checkpointing_disable()  # never during generation
    steps = max(steps, 1)
    return IterationResult(rollout, ppo_ep + 1, actor_sum / steps, critic_sum / steps, unsup_sum / steps,
                           time.time() - start)


# ------------------------------------------------------------------------------------------------
# Logging
# ------------------------------------------------------------------------------------------------
def log_iteration(trainer: Any, args: Any, counters: PPOCounters, it: IterationResult, *, epoch: int, step: int,
                  gen_time: float, exp_time: float, rank: int, tb: Any) -> dict:
    """Upstream's log lines and throughput lines, then one record (docs/metrics.md) to TensorBoard and
    ``metrics.jsonl``; advances ``counters.global_step``. Returns the record."""
    engine = trainer.rlhf_engine
    print_rank_0(f"Epoch: {epoch} | Step: {step} | PPO Epoch: {it.ppo_epochs} | Actor Loss: {it.actor_loss} | "
                 f"Critic Loss: {it.critic_loss} | Unsupervised Loss: {it.unsup_loss}", rank)
    print_throughput_step3(engine.actor.module, engine.critic, args, gen_time + exp_time + it.training_time,
                           gen_time, it.training_time, rank)
    # Mean over kept answers of all ranks; the EMA is fed that mean (upstream fed a sum over
    # micro-batches).
    ema_reward = counters.ema_reward.update(it.rollout.reward)
    print_rank_0(f"Average reward score: {it.rollout.reward} | EMA reward score: {ema_reward}", rank)
    print_rank_0(DASHES, rank)

    record = iteration_record(epoch, step, counters.global_step, trainer.pop_micro_stats(), it.rollout, ema_reward,
                              it.unsup_loss, gen_time, exp_time, it.training_time)
    tb.scalars(counters.global_step, **tensorboard_scalars(record))
    if args.output_dir is not None and rank == 0:
        # With --eval_interval the evaluation before the first step has started the file already.
        fresh = counters.global_step == 0 and not getattr(args, "eval_interval", 0)
        append_metrics(Path(args.output_dir) / METRICS_FILE, record, fresh=fresh)
    counters.global_step += 1
    return record


def iteration_record(epoch: int, step: int, global_step: int, micro: list[MicroStepStats], rollout: RolloutStats,
                     ema_reward: float, unsup_loss: float, gen_time: float, exp_time: float,
                     train_time: float) -> dict:
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
        "micro_steps": [asdict(m) for m in micro],
    }


def tensorboard_scalars(record: dict) -> dict[str, float]:
    """The scalar names documented in docs/metrics.md."""
    keys = ("reward", "ema_reward", "actor_loss", "critic_loss", "unsup_loss", "approx_kl", "clip_frac",
            "ratio_mean", "ratio_max", "ratio_min", "kl_to_ref", "value_explained_variance", "response_length")
    scalars = {k: record[k] for k in keys}
    scalars.update({"dropped_answers": record["dropped"], "time/generation": record["time_generation"],
                    "time/experience": record["time_experience"], "time/training": record["time_training"]})
    return scalars


def append_metrics(path: Path, record: dict, *, fresh: bool) -> None:
    """One JSON line per PPO iteration (what the e2e report plots); a new run starts a new file.

    Written as it goes, so a crashed run still leaves the curve up to its last iteration.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({k: v for k, v in record.items() if k != "micro_steps"}, allow_nan=True)
    with path.open("w" if fresh else "a", encoding="utf-8") as f:
        f.write(line + "\n")


def truncate_metrics(path: Path, iterations: int) -> None:
    """On resume: keep the lines of the iterations the checkpoint holds (a killed run may have
    written more), so the resumed run's lines follow without duplicates. An evaluation record
    (``"kind": "eval"``) at step N was made before checkpoint N: kept with it."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            limit = iterations + 1 if record.get("kind") == "eval" else iterations
            if record.get("global_step", iterations) < limit:
                kept.append(line + "\n")
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    path.write_text("".join(kept), encoding="utf-8")
