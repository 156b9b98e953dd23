"""dschat.rlhf.ppo_loop's bookkeeping: the counters a step-3 checkpoint carries, the metrics file on
resume, and the per-iteration record (the PPO iteration itself runs in test_step3_*.py)."""
from __future__ import annotations

import json
import math

from dschat.rlhf.ppo_loop import (PPOCounters, append_metrics, iteration_record, resume_metrics, tensorboard_scalars,
                                  truncate_metrics)
from dschat.rlhf.ppo_trainer import MicroStepStats, RolloutStats
from dschat.training.checkpoint import TrainingPosition
from dschat.training.nonfinite import NonFiniteGuard


def test_counters_survive_a_checkpoint_record_through_json():
    guard = NonFiniteGuard(10, rank=0, device="cpu")
    guard.consecutive, guard.skipped = 2, 5
    counters = PPOCounters(global_step=7, non_overflow_step_count=9)
    counters.ema_reward.update(1.0)
    counters.ema_reward.update(3.0)  # 0.9 * 1 + 0.1 * 3
    position = counters.position(epoch=1, batches_done=4, nonfinite=guard)
    assert (position.epoch, position.epoch_micro_steps, position.optimizer_steps) == (1, 4, 7)

    # What the checkpoint file holds is JSON; restore from a copy that went through it.
    stored = TrainingPosition(**json.loads(json.dumps(position.__dict__)))
    fresh = NonFiniteGuard(10, rank=0, device="cpu")
    restored = PPOCounters.restore(stored, fresh)
    assert restored.global_step == 7 and restored.non_overflow_step_count == 9
    assert math.isclose(restored.ema_reward.ema, 1.2)
    assert (fresh.consecutive, fresh.skipped) == (2, 5)
    # The restored EMA goes on from the stored value, not from the next reward alone.
    assert math.isclose(restored.ema_reward.update(2.2), 0.9 * 1.2 + 0.1 * 2.2)


def test_counters_before_the_first_reward_restore_an_empty_ema():
    guard = NonFiniteGuard(0, rank=0, device="cpu")
    position = PPOCounters().position(0, 0, guard)
    restored = PPOCounters.restore(TrainingPosition(**json.loads(json.dumps(position.__dict__))), guard)
    assert restored.ema_reward.ema is None and restored.ema_reward.update(4.0) == 4.0


class _FakeTrainer:
    def __init__(self, overflow):
        self.overflow = overflow

    def get_overflow(self):
        return self.overflow


def test_overflow_counting_follows_upstream():
    counters = PPOCounters()
    for overflow in [(False, False), (True, False), (False, True), (False, False)]:
        counters.count_overflow(_FakeTrainer(overflow))
    assert counters.non_overflow_step_count == 2


def _record(global_step):
    micro = [MicroStepStats(actor_loss=1.0, critic_loss=2.0, ratio_mean=1.0, ratio_max=1.5, ratio_min=0.5,
                            approx_kl=0.01, clip_frac=0.1, tokens=10),
             MicroStepStats(actor_loss=3.0, critic_loss=4.0, ratio_mean=1.0, ratio_max=1.2, ratio_min=0.7,
                            approx_kl=0.03, clip_frac=0.3, tokens=12)]
    rollout = RolloutStats(reward=0.5, kl_to_ref=0.02, response_length=11.0, value_explained_variance=0.1,
                           kept=4, dropped=0)
    return iteration_record(0, global_step, global_step, micro, rollout, 0.4, 0.0, 1.0, 2.0, 3.0)


def test_iteration_record_means_and_extremes():
    record = _record(0)
    assert record["actor_loss"] == 2.0 and record["critic_loss"] == 3.0
    # Token-weighted: (0.01 x 10 + 0.03 x 12) / 22 = 0.46 / 22; (0.1 x 10 + 0.3 x 12) / 22 = 4.6 / 22.
    assert math.isclose(record["approx_kl"], 0.46 / 22) and math.isclose(record["clip_frac"], 4.6 / 22)
    assert record["ratio_max"] == 1.5 and record["ratio_min"] == 0.5
    scalars = tensorboard_scalars(record)
    assert scalars["time/training"] == 3.0 and scalars["dropped_answers"] == 0 and "micro_steps" not in scalars
    # every name of docs/metrics.md's iteration tables (no --env, no --dynamic_sampling), no other
    assert set(scalars) == {"reward", "ema_reward", "kl_to_ref", "response_length", "dropped_answers", "actor_loss",
                            "critic_loss", "unsup_loss", "ratio_mean", "ratio_max", "ratio_min", "approx_kl",
                            "clip_frac", "logprob_gap", "value_explained_variance", "time/generation",
                            "time/experience", "time/training"}


def test_a_micro_step_without_tokens_does_not_make_the_means_nan():
    # A micro-batch whose answers were all dropped: ppo_policy_stats gives nan means and -inf/inf extremes.
    empty = MicroStepStats(actor_loss=0.0, critic_loss=0.0, ratio_mean=math.nan, ratio_max=-math.inf,
                           ratio_min=math.inf, approx_kl=math.nan, clip_frac=math.nan, tokens=0)
    full = MicroStepStats(actor_loss=1.0, critic_loss=2.0, ratio_mean=1.1, ratio_max=1.5, ratio_min=0.5,
                          approx_kl=0.01, clip_frac=0.1, tokens=10)
    rollout = RolloutStats(reward=0.5, kl_to_ref=0.02, response_length=11.0, value_explained_variance=0.1,
                           kept=2, dropped=2)
    record = iteration_record(0, 0, 0, [empty, full], rollout, 0.4, 0.0, 1.0, 2.0, 3.0)
    assert record["approx_kl"] == 0.01 and record["clip_frac"] == 0.1 and record["ratio_mean"] == 1.1
    assert record["ratio_max"] == 1.5 and record["ratio_min"] == 0.5
    assert record["actor_loss"] == 0.5  # losses stay plain means over micro-steps
    only_empty = iteration_record(0, 0, 0, [empty], rollout, 0.4, 0.0, 1.0, 2.0, 3.0)
    assert all(math.isnan(only_empty[k]) for k in ("approx_kl", "clip_frac", "ratio_mean", "ratio_max", "ratio_min"))


def test_metrics_file_on_resume_keeps_the_checkpointed_iterations_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in range(5):
        append_metrics(path, _record(step), fresh=step == 0)
    with path.open("a", encoding="utf-8") as f:
        f.write('{"global_step": 5, "rew')  # the line a kill cut
    truncate_metrics(path, 3)
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [line["global_step"] for line in lines] == [0, 1, 2]
    assert "micro_steps" not in lines[0]
    append_metrics(path, _record(3), fresh=False)
    assert [json.loads(x)["global_step"] for x in path.read_text(encoding="utf-8").splitlines()] == [0, 1, 2, 3]
    truncate_metrics(tmp_path / "absent.jsonl", 3)  # nothing to do, no error
    assert not (tmp_path / "absent.jsonl").exists()



def test_a_fresh_run_sets_an_earlier_runs_metrics_aside_at_start_up(tmp_path, capsys):
    """Even a run that logs no iteration (every rollout skipped) leaves no earlier run's curves beside
    its models; the earlier lines are kept."""
    path = tmp_path / "metrics.jsonl"
    append_metrics(path, _record(0), fresh=True)
    earlier = path.read_text(encoding="utf-8")
    (tmp_path / "metrics.jsonl.1").write_text("older\n")
    resume_metrics(path, 0, None)
    assert not path.exists() and (tmp_path / "metrics.jsonl.2").read_text(encoding="utf-8") == earlier
    assert "[metrics] a fresh run: the earlier run's metrics.jsonl is kept as metrics.jsonl.2" in capsys.readouterr().out
    resume_metrics(path, 0, None)  # nothing to set aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl.1", "metrics.jsonl.2"]


def test_resuming_from_another_folders_checkpoint_starts_the_metrics_from_that_run(tmp_path):
    """--resume_from A/checkpoints/step_3 with --output_dir B, where B holds another run's
    metrics.jsonl: B's file starts with A's lines up to the checkpoint (not B's lines 0-1 spliced with
    the resumed run's), and B's earlier lines are kept aside as metrics.jsonl.1 (then .2). A checkpoint
    of B's own is cut back as before."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, steps, reward in ((a, 5, 1.0), (b, 2, -1.0)):
        for step in range(steps):
            append_metrics(folder / "metrics.jsonl", {**_record(step), "reward": reward}, fresh=step == 0)
    (a / "checkpoints" / "step_00000003").mkdir(parents=True)
    earlier = (b / "metrics.jsonl").read_text(encoding="utf-8")
    resume_metrics(b / "metrics.jsonl", 3, a / "checkpoints" / "step_00000003")
    lines = [json.loads(x) for x in (b / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(x["global_step"], x["reward"]) for x in lines] == [(0, 1.0), (1, 1.0), (2, 1.0)]
    assert (b / "metrics.jsonl.1").read_text(encoding="utf-8") == earlier
    (b / "metrics.jsonl").rename(b / "mine.jsonl")  # a link to A's checkpoint names A's run, from any folder
    (tmp_path / "ck").symlink_to(a / "checkpoints" / "step_00000003")
    resume_metrics(b / "metrics.jsonl", 3, tmp_path / "ck")
    adopted = (b / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["reward"] for x in adopted] == [1.0] * 3
    (b / "mine.jsonl").replace(b / "metrics.jsonl")
    resume_metrics(b / "metrics.jsonl", 3, tmp_path / "elsewhere" / "step_00000003")  # no metrics beside it
    assert (b / "metrics.jsonl").read_text(encoding="utf-8") == "" and (b / "metrics.jsonl.2").exists()
    (b / "checkpoints" / "step_00000002").mkdir(parents=True)
    append_metrics(b / "metrics.jsonl", _record(0), fresh=True)
    append_metrics(b / "metrics.jsonl", _record(2), fresh=False)
    resume_metrics(b / "metrics.jsonl", 2, b / "checkpoints" / "step_00000002")  # its own: cut back
    assert [json.loads(x)["global_step"] for x in (b / "metrics.jsonl").read_text().splitlines()] == [0]
    assert not (b / "metrics.jsonl.3").exists()
