"""DAPO's dynamic sampling (``--dynamic_sampling``): the group filter's math, the joining of
generation batches of different widths, the filter's batches, and GRPO runs that drop equal-reward
groups, draw more prompt batches, and resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dschat.rl_math.critic_free import grpo_advantages, informative_groups
from dschat.rlhf.dynamic_sampling import GroupFilter
from dschat.rlhf.experience import Experience, concat_rows
from dschat.training import checkpoint as ckpt

from helpers.step3 import Interrupted, base_argv, crash_after_checkpoint, load_state, max_abs_diff, refused_in_process, \
    step3_main

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 0


def test_informative_groups_by_hand():
    rewards = torch.tensor([1.0, 1.0,   0.0, 1.0,   0.5, 0.50005,   -2.0, 3.0])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, True]  # within 1e-4: equal
    assert informative_groups(rewards, 4).tolist() == [True, True]
    assert informative_groups(rewards, 2, atol=0.0).tolist() == [False, True, True, True]
    # What the filter stands for: an equal-reward group's GRPO advantages are all zero.
    assert grpo_advantages(torch.tensor([0.3, 0.3, 0.3]), 3).abs().max() == 0
    with pytest.raises(ValueError):
        informative_groups(rewards, 3)


def _experience(prompts: list[list[int]], answers: list[list[int]], scores: list[float]) -> Experience:
    """Rows of real tokens (ids > 0) with left-padded prompts and right-padded answers (id 0, no
    attention); log-probs -(token id) / 100 at the column that scores each token, values +that."""
    P, A = max(map(len, prompts)), max(map(len, answers))
    B = len(prompts)
    seq = torch.full((B, P + A), PAD)
    att = torch.zeros((B, P + A), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq[i, P - len(p):P] = torch.tensor(p)
        seq[i, P:P + len(a)] = torch.tensor(a)
        att[i, P - len(p):P + len(a)] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logprobs = -(seq[:, 1:].float() / 100) * att[:, 1:]
    return Experience(prompts=seq[:, :P], seq=seq, attention_mask=att, position_ids=pos,
                      action_mask=att[:, 1:].clone() * (torch.arange(P + A - 1) >= P - 1),
                      logprobs=logprobs, ref_logprobs=logprobs * 2, values=-logprobs,
                      reward_score=torch.tensor(scores), valid=torch.ones(B, dtype=torch.bool),
                      sequence_advantages=torch.tensor(scores) * 10)


def _rows(exp: Experience) -> list[dict]:
    """Each row as what it means: its real tokens, and per real answer token its log-prob, reference
    log-prob, value and action flag (read at the column that scores it), its score."""
    out = []
    for i in range(len(exp)):
        real = exp.attention_mask[i].bool()
        cols = [t - 1 for t in real.nonzero().flatten().tolist() if t >= 1 and t - 1 >= exp.start]
        out.append({"tokens": exp.seq[i][real].tolist(), "positions": exp.position_ids[i][real].tolist(),
                    "logprobs": exp.logprobs[i, cols].tolist(), "ref": exp.ref_logprobs[i, cols].tolist(),
                    "values": exp.values[i, cols].tolist(), "actions": exp.action_mask[i, cols].tolist(),
                    "actions_total": int(exp.action_mask[i].sum()), "score": float(exp.reward_score[i]),
                    "advantage": float(exp.sequence_advantages[i])})
    return out


def test_concat_rows_keeps_every_row_as_it_was():
    a = _experience([[5, 6], [7]], [[11, 12, 13], [14]], [1.0, 2.0])
    b = _experience([[8, 9, 10, 3]], [[15, 16, 17, 18, 19]], [3.0])
    joined = concat_rows([a, b], PAD)
    assert joined.prompts.shape == (3, 4) and joined.seq.shape == (3, 9) and joined.logprobs.shape == (3, 8)
    assert joined.start == 3
    assert _rows(joined) == _rows(a) + _rows(b)
    assert joined.prompts[:2, :2].eq(PAD).all() and joined.seq[:2, -1].eq(PAD).all()
    assert concat_rows([b], PAD).seq.equal(b.seq)
    done = _experience([[5]], [[6]], [0.0])
    done.advantages = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="before prepare_rollout"):
        concat_rows([done], PAD)


def _filter(groups_per_batch: int = 2, max_rounds: int = 3) -> GroupFilter:
    return GroupFilter(group_size=2, groups_per_batch=groups_per_batch, max_rounds=max_rounds, clip_reward_value=10.0,
                       pad_token_id=PAD, device=torch.device("cpu"))


def _batch(scores: list[float], first_token: int) -> Experience:
    n = len(scores)
    return _experience([[first_token + i] for i in range(n)], [[first_token + 50 + i] * (1 + i % 3) for i in range(n)],
                       scores)


def test_the_filter_keeps_the_first_informative_groups_in_order():
    f = _filter()
    f.add(_batch([1, 1, 0, 1], 1))  # group 0 equal, group 1 informative
    assert f.wants_more()
    f.add(None)  # a generation batch skipped on every rank: a round; its 2 groups sampled and dropped, none kept
    assert f.wants_more()
    f.add(_batch([2, 3, 4, 4, 5, 6, 7, 7], 20))  # informative, equal, informative (surplus), equal
    assert not f.wants_more()
    out = f.batch()
    assert [r["tokens"][0] for r in _rows(out)] == [3, 4, 20, 21]
    assert out.valid.all()
    stats = f.pop_stats()
    assert (stats.batches, stats.rounds, stats.groups, stats.dropped_groups, stats.surplus_groups,
            stats.masked_groups) == (1, 3, 8, 5, 1, 0)
    assert f.pop_stats().groups == 0 and f.kept == [] and f.rounds == 0


def test_a_skipped_generation_batch_counts_its_groups_as_sampled_and_dropped(capsys):
    """A generation batch step 3 skipped (no answer anywhere long enough, or uncut) generated its groups
    and none of their answers trains: sampled and dropped (docs/metrics.md), as many as the batch held."""
    f = _filter(groups_per_batch=2, max_rounds=8)
    for _ in range(7):
        f.add(None)
    f.add(_batch([0, 1, 2, 3], 1))  # the eighth batch: both groups informative
    assert not f.wants_more()
    assert len(f.batch()) == 4
    stats = f.pop_stats()
    assert (stats.rounds, stats.groups, stats.dropped_groups, stats.surplus_groups, stats.batches) == (8, 16, 14, 0, 1)
    # Every group generated is trained, dropped or surplus.
    assert stats.groups == 2 * stats.batches + stats.dropped_groups + stats.surplus_groups
    f.add(None, groups=1)  # the epoch's short last prompt batch, skipped: its one group
    f.add(None)
    assert f.batch() is None and "no group of different rewards on any rank in 2" in capsys.readouterr().out
    assert (f.stats.groups, f.stats.dropped_groups, f.stats.rounds) == (3, 3, 2)


def test_the_loop_counts_a_skipped_short_last_batch_by_its_prompts(monkeypatch, capsys):
    """The loop's draws (ppo_loop.fill_groups): a generation batch skipped on every rank counts its own
    prompts' groups, the epoch's short last batch too (it counted a full batch's)."""
    from dschat.rlhf import ppo_loop

    monkeypatch.setattr(ppo_loop, "generate_batch", lambda *args: None)  # every answer skipped
    f = _filter(groups_per_batch=2, max_rounds=3)
    batches = iter([(1, ({"prompt": torch.ones(1, 4)}, None))])  # the epoch's last batch: one prompt
    out, step = ppo_loop.fill_groups(None, None, f, None, {"prompt": torch.ones(2, 4)}, 0, batches, None)
    assert out is None and step == 1 and "no group of different rewards" in capsys.readouterr().out
    assert (f.stats.rounds, f.stats.groups, f.stats.dropped_groups) == (2, 3, 3)


def test_a_batch_still_short_is_filled_with_the_latest_equal_groups_masked():
    f = _filter(groups_per_batch=3, max_rounds=2)
    f.add(_batch([1, 1, 0, 1, 2, 2], 1))
    assert f.wants_more()
    f.add(_batch([3, 3, 4, 4, 5, 6], 20))
    assert not f.wants_more()  # rounds spent
    out = f.batch()
    rows = _rows(out)
    # Informative groups first (3, 4 then 24, 25), then the latest equal group (22, 23) for the shape.
    assert [r["tokens"][0] for r in rows] == [3, 4, 24, 25, 22, 23]
    assert out.valid.tolist() == [True] * 4 + [False] * 2
    assert [r["actions_total"] for r in rows[4:]] == [0, 0] and all(r["actions_total"] > 0 for r in rows[:4])
    assert f.pop_stats().masked_groups == 1


def test_rewards_equal_after_the_clamp_or_no_answer_that_trains_drop_a_group():
    f = _filter(groups_per_batch=3, max_rounds=1)
    short_answers = _batch([0, 1, 11.1, 12.3, 0, 2], 1)  # clamped to +-10: 11.1 and 12.3 are both 10
    short_answers.valid[4:] = False  # group 2 differs, but none of its answers trains
    short_answers.valid[1] = False  # group 0 differs and one of its answers trains: kept
    f.add(short_answers)
    out = f.batch()
    assert out.valid.tolist() == [True, False, False, False, False, False]
    assert f.pop_stats().dropped_groups == 2


def test_a_short_last_prompt_batch_still_trains_its_groups():
    f = _filter(groups_per_batch=3, max_rounds=3)
    f.add(_batch([0, 1, 2, 3], 1))  # the epoch's last batch: 2 groups, both informative
    assert f.wants_more()  # the loop then finds no more prompt batches
    out = f.batch()
    assert len(out) == 4 and out.valid.all()


def test_a_short_last_prompt_batch_keeps_every_equal_group_as_filler():
    f = _filter(groups_per_batch=4, max_rounds=1)
    f.add(_batch([1, 0, 2, 2, 3, 3], 1))  # the epoch's last batch: 3 groups, 1 informative, 2 equal
    out = f.batch()  # 1 informative group and both equal ones (fewer than 4 groups were seen)
    assert [r["tokens"][0] for r in _rows(out)] == [1, 2, 3, 4, 5, 6]
    assert out.valid.tolist() == [True] * 2 + [False] * 4
    assert f.pop_stats().masked_groups == 2


def test_no_informative_group_skips_the_batch(capsys):
    f = _filter(max_rounds=2)
    f.add(_batch([1, 1, 2, 2], 1))
    f.add(_batch([0, 0, 0, 0], 1))
    assert not f.wants_more() and f.batch() is None
    assert "Dynamic sampling: no group of different rewards on any rank in 2 generation batches" in capsys.readouterr().out
    stats = f.pop_stats()
    assert (stats.dropped_groups, stats.batches, stats.rounds) == (4, 0, 2)
    f.add(None)
    f.add(None)
    assert f.batch() is None


# ------------------------------------------------------------------------------------ step 3


def _argv(data, out, *extra, steps=3):
    argv = base_argv("tiny-opt", Path("unused"), data, "--algorithm", "grpo", "--num_generations", "2",
                     "--reward_fn", "reward_fixtures:flat_on_even_prompts", "--dynamic_sampling",
                     "--output_dir", str(out), *extra, steps=steps)
    i = argv.index("--critic_model_name_or_path")
    del argv[i:i + 2]
    return argv


@pytest.mark.parametrize("extra, message", [
    (("--algorithm", "reinforce_pp", "--num_generations", "1"), "--dynamic_sampling drops groups whose answers all "
                                                                "got the same reward"),
    (("--max_sampling_rounds", "0"), "--max_sampling_rounds must be a positive integer"),
])
def test_dynamic_sampling_flag_rules(extra, message, tmp_path, data_cache, capsys):
    line = refused_in_process(_argv(data_cache, tmp_path / "out", *extra), capsys)
    assert message in line
    assert not (tmp_path / "out").exists()


def test_max_sampling_rounds_without_dynamic_sampling_is_refused(tmp_path, data_cache, capsys):
    argv = _argv(data_cache, tmp_path / "out", "--max_sampling_rounds", "4")  # even at its default value
    argv.remove("--dynamic_sampling")
    line = refused_in_process(argv, capsys)
    assert line == ("error: --max_sampling_rounds bounds the draws of --dynamic_sampling, off without it: add "
                    "--dynamic_sampling or drop --max_sampling_rounds")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_grpo_run_trains_only_informative_groups_and_resumes(tmp_path, data_cache, monkeypatch, capsys):
    """Every trained group holds different rewards; equal-reward groups are dropped and more prompt
    batches drawn (the loop's step jumps); the log and metrics count them; a run interrupted after its
    second step and resumed matches the uninterrupted one."""
    from dschat.rlhf.experience_maker import ExperienceMaker

    trained: list[Experience] = []
    original = ExperienceMaker.prepare_rollout

    def spy(self, rollout):
        trained.extend(rollout)
        return original(self, rollout)

    monkeypatch.setattr(ExperienceMaker, "prepare_rollout", spy)
    main = step3_main().main
    full = main(_argv(data_cache, tmp_path / "full", "--save_interval", "1", "--max_sampling_rounds", "4", steps=4))
    logs = capsys.readouterr().out
    monkeypatch.undo()

    assert len(full.history) == 4 and len(trained) == 4
    for exp in trained:
        assert len(exp) == 4 and exp.valid.any()
        for g in range(2):
            rows = slice(2 * g, 2 * g + 2)
            if exp.valid[rows].all():
                assert float(exp.reward_score[rows].max() - exp.reward_score[rows].min()) > 1e-6
            else:  # a filler group: masked out whole
                assert not exp.valid[rows].any() and exp.action_mask[rows].sum() == 0
    dropped = sum(r["dropped_groups"] for r in full.history)
    assert dropped > 0 and any(r["sampling_rounds"] > 1 for r in full.history)
    steps = [r["step"] for r in full.history]
    assert steps[-1] + 1 == sum(r["sampling_rounds"] for r in full.history)  # every batch drawn, from step 0
    assert all(r["sampled_groups"] == 2 * r["sampling_rounds"] for r in full.history)
    assert "Dynamic sampling:" in logs and "dynamic sampling (at most 4 rounds)" in logs
    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [x["dropped_groups"] for x in lines] == [r["dropped_groups"] for r in full.history]

    crash_after_checkpoint(monkeypatch, optimizer_steps=2)
    with pytest.raises(Interrupted):
        main(_argv(data_cache, tmp_path / "resumed", "--save_interval", "1", "--max_sampling_rounds", "4", steps=4))
    monkeypatch.undo()
    assert ckpt.complete_checkpoints(tmp_path / "resumed" / "checkpoints")
    resumed = main(_argv(data_cache, tmp_path / "resumed", "--save_interval", "1", "--max_sampling_rounds", "4",
                         "--resume", steps=4))
    keys = ("step", "actor_loss", "reward", "dropped_groups", "sampling_rounds")
    assert [{k: r[k] for k in keys} for r in full.history[2:]] == [{k: r[k] for k in keys} for r in resumed.history]
    assert max_abs_diff(load_state(tmp_path / "full" / "actor"), load_state(tmp_path / "resumed" / "actor")) == 0.0


@pytest.mark.slow
def test_two_ranks_draw_the_same_batches(tmp_path, data_cache):
    """Rank 1 drops the groups of its even-length prompts, rank 0 almost none: both ranks still draw
    the same number of generation batches (one collective decision), finish, and log the same records."""
    from test_step3_envs_ranks import _two_ranks

    out = tmp_path / "out"
    argv = _argv(data_cache, out, "--max_sampling_rounds", "3", "--actor_zero_stage", "3", steps=3)
    argv[argv.index("reward_fixtures:flat_on_even_prompts")] = "reward_fixtures:flat_on_rank_one"
    ranks = _two_ranks(tmp_path, argv)
    for rank, (code, stdout, stderr) in enumerate(ranks):
        assert code == 0, (rank, stdout[-2000:], stderr[-3000:])
    histories = [json.loads((tmp_path / f"records{rank}.json").read_text())["history"] for rank in (0, 1)]
    keys = ("step", "sampling_rounds", "sampled_groups", "dropped_groups", "surplus_groups", "masked_groups", "reward",
            "actor_loss")
    assert [[r[k] for k in keys] for r in histories[0]] == [[r[k] for k in keys] for r in histories[1]]
    assert len(histories[0]) == 3 and sum(r["dropped_groups"] for r in histories[0]) > 0
    assert (out / "actor" / "config.json").exists()


def test_a_full_batch_in_the_first_round_draws_no_more():
    """Once G informative groups are in, no further batch is drawn: each would use up prompts only
    to throw their groups away as surplus (the tests above stopped only when the rounds ran out)."""
    f = _filter(groups_per_batch=2, max_rounds=8)
    f.add(_batch([0, 1, 2, 3], 1))  # both groups informative
    assert not f.wants_more()
