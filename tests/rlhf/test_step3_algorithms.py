"""Step 3 with the critic-free algorithms and reward functions, end to end on tiny models (CPU).

One short run per algorithm, spread over ZeRO 0 / 3 with and without LoRA, EMA, PPO-ptx, reward model
and reward functions (not a full product: CI time; the group and resume runs add ZeRO 0 without LoRA); group statistics over whole groups whatever the micro-batch;
exact resume of a critic-free run; reward functions that fail at run time; the flag rules."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dschat.rl_math.critic_free import ALGORITHMS, IMPORTANCE_SAMPLING_LEVELS, LOSS_AGGREGATIONS
from dschat.cli.step3 import ALGORITHM_CHOICES, LOSS_AGGREGATION_CHOICES
from dschat.models.registry import resolve_model_path
from dschat.rlhf.config import resolve_algorithm
from dschat.training import checkpoint as ckpt

from helpers.step3 import (
    Interrupted,
    base_argv,
    crash_after_checkpoint,
    load_state,
    max_abs_diff,
    refused_in_process,
    step3_main,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # every test: tiny models on one thread


def _argv(model, critic, data, *extra, steps=2):
    argv = base_argv(model, critic or Path("unused"), data, *extra, steps=steps)
    if critic is None:  # a critic-free run scored by functions only: no step-2 folder at all
        i = argv.index("--critic_model_name_or_path")
        del argv[i:i + 2]
    return argv


# ------------------------------------------------------------------------------------ flag rules


def _settings(*extra):
    return resolve_algorithm(step3_main().parse_args(["--actor_model_name_or_path", "a", *extra]))


def test_flag_choices_match_the_math_module():
    assert ALGORITHM_CHOICES == ALGORITHMS
    assert LOSS_AGGREGATION_CHOICES == LOSS_AGGREGATIONS


def test_defaults_are_upstream_ppo_and_each_algorithm_resolves_its_autos():
    ppo = _settings()
    assert (ppo.algorithm, ppo.critic, ppo.kl_in_reward, ppo.kl_estimator, ppo.loss_aggregation) == (
        "ppo", True, True, "k1", "token")
    assert ppo.upstream_ppo_loss and not ppo.whiten_advantages and ppo.num_generations == 1
    grpo = _settings("--algorithm", "grpo", "--num_generations", "4")
    assert (grpo.critic, grpo.kl_in_reward, grpo.kl_estimator, grpo.loss_aggregation, grpo.scale_by_std) == (
        False, False, "k3", "sequence", True)
    dr = _settings("--algorithm", "grpo", "--num_generations", "4", "--dr_grpo")
    assert (dr.loss_aggregation, dr.scale_by_std) == ("token_sum", False)
    rpp = _settings("--algorithm", "reinforce_pp")
    assert (rpp.kl_in_reward, rpp.kl_estimator, rpp.whiten_advantages, rpp.loss_aggregation) == (True, "k1", True, "token")
    assert not _settings("--tis_cap", "2").upstream_ppo_loss
    # k1 as a loss term is accepted, with a warning in the start-up line; k3 (the default there) is not warned.
    k1 = _settings("--algorithm", "grpo", "--num_generations", "4", "--kl_estimator", "k1")
    assert "WARNING: the k1 estimator as a loss term has zero expected gradient" in k1.describe()
    assert "WARNING" not in grpo.describe() and "WARNING" not in ppo.describe()


def test_dapo_and_gspo_options_default_off_and_each_leaves_upstreams_loss():
    ppo = _settings()
    assert (ppo.cliprange_high, ppo.dual_clip, ppo.overlong_buffer_len, ppo.overlong_penalty_factor,
            ppo.mask_truncated_answers, ppo.importance_sampling_level) == (None, 0.0, 0, 1.0, False, "token")
    for extra in (("--cliprange_high", "0.28"), ("--cliprange_high", "0.2"), ("--dual_clip", "3"),
                  ("--overlong_buffer_len", "4"), ("--mask_truncated_answers",)):
        settings = _settings(*extra)
        assert not settings.upstream_ppo_loss and settings.algorithm == "ppo", extra
        assert settings.loss_aggregation == "token"
    assert _settings("--overlong_buffer_len", "4").overlong_penalty_factor == 1.0  # the factor's default
    both = _settings("--cliprange_high", "0.28", "--dual_clip", "3", "--overlong_buffer_len", "4",
                     "--overlong_penalty_factor", "0.5", "--mask_truncated_answers")
    assert (both.cliprange_high, both.dual_clip, both.overlong_buffer_len, both.overlong_penalty_factor,
            both.mask_truncated_answers) == (0.28, 3.0, 4, 0.5, True)
    assert ("clip-higher 0.28, dual-clip 3, overlong penalty 0.5 over the last 4 tokens, answers without EOS masked "
            "out of the loss") in both.describe()
    # GSPO: the mean over answers is its objective, so auto aggregates per answer; an explicit choice stays.
    gspo = _settings("--algorithm", "rloo", "--num_generations", "2", "--importance_sampling_level", "sequence")
    assert (gspo.importance_sampling_level, gspo.loss_aggregation) == ("sequence", "sequence")
    assert "sequence-level importance ratio (GSPO)" in gspo.describe()
    assert _settings("--algorithm", "rloo", "--num_generations", "2", "--importance_sampling_level", "sequence",
                     "--loss_aggregation", "token").loss_aggregation == "token"
    assert _settings("--algorithm", "grpo", "--num_generations", "2", "--dr_grpo",
                     "--importance_sampling_level", "sequence").loss_aggregation == "token_sum"
    choices = {a.dest: a.choices for a in _parser()._actions}
    assert tuple(choices["importance_sampling_level"]) == IMPORTANCE_SAMPLING_LEVELS


def _parser():
    import argparse

    from dschat.cli.step3 import add_step3_args

    return add_step3_args(argparse.ArgumentParser(add_help=False))


@pytest.mark.parametrize("extra, message", [
    ((), "--critic_model_name_or_path is required for --algorithm ppo's critic"),
    (("--algorithm", "grpo", "--num_generations", "2"), "required for the reward model"),
    (("--algorithm", "grpo", "--num_generations", "2", "--reward_model_weight", "0"), "leaves nothing to score"),
    (("--algorithm", "ppo", "--kl_in_reward", "off"), "--algorithm ppo keeps the KL in the reward"),
    (("--loss_aggregation", "sequence"), "--loss_aggregation sequence is for the critic-free"),
    (("--tis_cap", "-1"), "--tis_cap must be a finite number >= 0"),
    (("--tis_cap", "nan"), "--tis_cap must be a finite number >= 0"),
    (("--cliprange_high", "-0.1"), "--cliprange_high must be a finite number >= 0"),
    (("--dual_clip", "1"), "--dual_clip must be a finite number > 1"),
    (("--algorithm", "rloo", "--num_generations", "2", "--dual_clip", "0.5"), "--dual_clip must be a finite number > 1"),
    (("--overlong_buffer_len", "17"), "--overlong_buffer_len must be an integer from 0 (off) to --max_answer_seq_len 16"),
    (("--overlong_buffer_len", "-1"), "--overlong_buffer_len must be an integer from 0 (off)"),
    (("--overlong_buffer_len", "4", "--overlong_penalty_factor", "-1"), "--overlong_penalty_factor must be a finite "
                                                                       "number >= 0"),
    # Given without the punishment it scales, even at its default value, it would change nothing.
    (("--overlong_penalty_factor", "1.0"), "--overlong_penalty_factor scales the soft overlong punishment, off "
                                           "without it: add --overlong_buffer_len L (L > 0)"),
    (("--overlong_buffer_len", "0", "--overlong_penalty_factor", "2"), "add --overlong_buffer_len L (L > 0) or drop "
                                                                       "--overlong_penalty_factor"),
    (("--importance_sampling_level", "sequence"), "--importance_sampling_level sequence (GSPO) is for the critic-free "
                                                  "algorithms"),
    (("--algorithm", "grpo", "--num_generations", "2", "--decoding", "greedy"),
     "--algorithm grpo compares the K answers to a prompt, which greedy decoding"),
    (("--algorithm", "rloo", "--num_generations", "2", "--top_k", "1"), "every advantage would be 0"),
    (("--algorithm", "remax", "--decoding", "greedy"), "--algorithm remax compares the answer with the greedy one"),
    (("--reward_model_weight", "inf"), "--reward_model_weight must be a finite number"),
    (("--algorithm", "grpo", "--num_generations", "4", "--reward_fn", "dschat.rewards:gold",
      "--per_device_generation_batch_size", "4096", "--per_device_training_batch_size", "4"),
     "fewer than 1024 (per_device_generation_batch_size 4096 / num_generations 4) rows per rank"),
])
def test_flag_rules_refused_before_any_model(extra, message, tmp_path, data_cache, capsys):
    line = refused_in_process(_argv("tiny-opt", None, data_cache, "--output_dir", str(tmp_path / "out"), *extra), capsys)
    assert message in line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ the runs

COVER = {
    # GRPO, ZeRO-3 actor with LoRA and EMA, scored by functions only (no step-2 folder at all): the gold
    # judge (flat on a tiny model's babble) and answer length
    "grpo-z3-lora-ema-fn": ("tiny-llama", False, ["--algorithm", "grpo", "--num_generations", "2",
                                                  "--actor_zero_stage", "3", "--actor_lora_dim", "4", "--enable_ema",
                                                  "--reward_fn", "dschat.rewards:gold",
                                                  "--reward_fn", "reward_fixtures:length"]),
    # RLOO, ZeRO-0 with actor LoRA, reward model and a column-reading function combined, PPO-ptx, TIS
    "rloo-z0-lora-rm+fn-ptx-tis": ("tiny-opt", True, ["--algorithm", "rloo", "--num_generations", "2", "--actor_lora_dim", "4",
                                                 "--reward_fn", "reward_fixtures:chosen_overlap",
                                                 "--reward_fn_weight", "2.0", "--reward_model_weight", "1.0",
                                                 "--unsupervised_dataset_name", "dschat/builtin", "--unsup_coef", "0.5",
                                                 "--tis_cap", "2.0"]),
    # REINFORCE++ on the reward model, ZeRO-3 actor without LoRA, two micro-batches per rollout
    "reinforce_pp-z3-rm": ("tiny-llama", True, ["--algorithm", "reinforce_pp", "--actor_zero_stage", "3",
                                                "--per_device_training_batch_size", "2",
                                                "--gradient_accumulation_steps", "2"]),
    # ReMax, ZeRO-3 actor and reward model (critic stage 3 is the reward model's), LoRA, Dr.GRPO-style sums
    "remax-z3-lora-rm": ("tiny-opt", True, ["--algorithm", "remax", "--num_generations", "2", "--actor_zero_stage",
                                            "3", "--critic_zero_stage", "3", "--actor_lora_dim", "4",
                                            "--loss_aggregation", "token_sum"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COVER))
def test_critic_free_cover(name, tmp_path, critic_dirs, data_cache, capsys):
    model, with_rm, extra = COVER[name]
    out = tmp_path / "out"
    (out / "critic").mkdir(parents=True)  # an earlier PPO run's critic: set aside once this run's actor is in
    (out / "critic" / "config.json").write_text("{}")
    result = step3_main().main(_argv(model, critic_dirs[model] if with_rm else None, data_cache, *extra,
                                     "--output_dir", str(out)))
    logs = capsys.readouterr().out
    algorithm = extra[extra.index("--algorithm") + 1]

    assert len(result.history) == 2
    for record in result.history:
        for key in ("actor_loss", "reward", "kl_to_ref", "response_length", "logprob_gap"):
            assert math.isfinite(record[key]), (key, record)
        assert math.isnan(record["critic_loss"]) and math.isnan(record["value_explained_variance"])
    assert f"algorithm {algorithm}:" in logs and "no critic" in logs
    # No critic engine, built, checkpointed or saved; the reward model only when it scores.
    assert result.rlhf_engine.critic is None and "Initializing Critic" not in logs
    assert (result.rlhf_engine.reward is not None) == with_rm
    assert ("Initializing Reward" in logs) == with_rm
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == (
        ["actor", "actor_ema", "critic.earlier"] if "--enable_ema" in extra else ["actor", "critic.earlier"])
    assert (out / "critic.earlier" / "config.json").read_text() == "{}"
    assert f"{out / 'critic'} holds an earlier run's model (this run saved none there): now in" in logs
    initial = load_state(Path(resolve_model_path(model)))
    assert max_abs_diff(initial, load_state(out / "actor")) > 0
    if "--enable_ema" in extra:
        assert 0 < max_abs_diff(initial, load_state(out / "actor_ema"))
    if "--unsupervised_dataset_name" in extra:
        assert all(r["unsup_loss"] > 0 for r in result.history)
    if "--reward_fn" in extra and with_rm:
        assert "reward = 1 x reward model + 2 x reward_fixtures:chosen_overlap" in logs


@pytest.mark.slow
def test_groups_are_whole_whatever_the_micro_batch(data_cache, monkeypatch):
    """GRPO with K = 4 in a generation batch of 4 trained as two micro-batches of 2: each micro-batch
    carries the advantages of the whole group (they sum to 0 over the group, not per micro-batch)."""
    from dschat.rlhf.ppo_update import PPOUpdate

    seen = []
    original = PPOUpdate.train_rlhf

    def spy(self, exp):
        seen.append((exp.reward_score.clone(), exp.sequence_advantages.clone()))
        return original(self, exp)

    monkeypatch.setattr(PPOUpdate, "train_rlhf", spy)
    step3_main().main(_argv("tiny-opt", None, data_cache, "--algorithm", "grpo", "--num_generations", "4",
                            "--dr_grpo", "--per_device_training_batch_size", "2", "--gradient_accumulation_steps",
                            "2", "--reward_fn", "reward_fixtures:length", "--kl_ctl", "0", steps=1))
    assert len(seen) == 2  # two micro-batches of one rollout
    rewards = torch.cat([r for r, _ in seen])
    advantages = torch.cat([a for _, a in seen])
    torch.testing.assert_close(advantages, rewards - rewards.mean())  # Dr.GRPO over the group of 4
    # ... which differs from centring each micro-batch on its own (the case would catch a split group).
    assert not torch.allclose(advantages, torch.cat([r - r.mean() for r, _ in seen]))


@pytest.mark.slow
def test_interrupted_and_resumed_grpo_matches_the_uninterrupted_run(tmp_path, data_cache, monkeypatch):
    main = step3_main().main

    def argv(out, *more):
        return _argv("tiny-opt", None, data_cache, "--algorithm", "grpo", "--num_generations", "2", "--enable_ema",
                     "--actor_dropout", "0.1", "--reward_fn", "reward_fixtures:length", "--save_interval", "1",
                     "--output_dir", str(out), *more, steps=4)

    full = main(argv(tmp_path / "full"))
    assert len(full.history) == 4

    crash_after_checkpoint(monkeypatch, optimizer_steps=2)
    with pytest.raises(Interrupted):
        main(argv(tmp_path / "resumed"))
    monkeypatch.undo()
    step = ckpt.complete_checkpoints(tmp_path / "resumed" / "checkpoints")[-1]
    assert not any("critic" in p.name for p in step.rglob("*"))  # no critic state in the checkpoint
    resumed = main(argv(tmp_path / "resumed", "--resume"))
    keys = ("actor_loss", "reward", "kl_to_ref", "ema_reward", "response_length")
    assert [{k: r[k] for k in keys} for r in full.history[2:]] == [{k: r[k] for k in keys} for r in resumed.history]
    for name in ("actor", "actor_ema"):
        assert max_abs_diff(load_state(tmp_path / "full" / name), load_state(tmp_path / "resumed" / name)) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("spec, message", [
    ("reward_fixtures:always_raises", "reward function reward_fixtures:always_raises raised KeyError: 'reference' "
                                      "on row 0"),
    ("reward_fixtures:one_short", "reward function reward_fixtures:one_short returned 3 scores for 4 answers"),
    ("reward_fixtures:nan_on_last", "reward function reward_fixtures:nan_on_last returned nan for row 3"),
])
def test_a_failing_reward_function_stops_the_run_with_one_line(spec, message, tmp_path, data_cache, capsys):
    out = tmp_path / "out"
    line = refused_in_process(_argv("tiny-opt", None, data_cache, "--algorithm", "reinforce_pp", "--reward_fn", spec,
                          "--output_dir", str(out), "--save_interval", "1"), capsys)
    assert message in line
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


@pytest.mark.slow
def test_the_non_finite_guard_skips_a_critic_free_rollout(data_cache, capsys):
    """main's Python hook keeps the guard's rule for every algorithm: a NaN reward skips that rollout."""
    calls = []

    def reward_fn(prompts, answers):
        calls.append(len(answers))
        return [float("nan") if len(calls) == 2 else 0.1 * len(a.split()) for a in answers]

    result = step3_main().main(_argv("tiny-opt", None, data_cache, "--algorithm", "rloo", "--num_generations", "2",
                                     steps=3), reward_fn=reward_fn)
    assert result.skipped_nonfinite == 1 and len(result.history) == 2
    assert "non-finite log-probs, values or reward in the rollout of step 1; rollout skipped" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ DAPO and GSPO options


def _spy_scores(monkeypatch):
    """Record each rollout's reward-mix scores (before the penalties) and each micro-step's experience."""
    from dschat.rlhf.experience_maker import ExperienceMaker
    from dschat.rlhf.ppo_update import PPOUpdate

    raw, trained = [], []
    reward_scores, train_rlhf = ExperienceMaker._reward_scores, PPOUpdate.train_rlhf
    monkeypatch.setattr(ExperienceMaker, "_reward_scores",
                        lambda self, *a, **k: raw.append(reward_scores(self, *a, **k)) or raw[-1])
    monkeypatch.setattr(PPOUpdate, "train_rlhf", lambda self, exp: trained.append(exp) or train_rlhf(self, exp))
    return raw, trained


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, extra, expected", [
    # PPO with clip-higher and dual-clip leaves upstream's actor_loss_fn for the clipped surrogate with these bounds
    ("ppo", ("--cliprange_high", "0.28", "--dual_clip", "3", "--overlong_buffer_len", "16"),
     {"cliprange_high": 0.28, "dual_clip": 3.0, "level": "token"}),
    # GSPO on RLOO: one ratio per answer, clipped with clip-higher's bounds, the loss a mean over answers
    ("rloo", ("--num_generations", "2", "--importance_sampling_level", "sequence", "--cliprange_high", "0.3",
              "--reward_fn", "reward_fixtures:length"),
     {"cliprange_high": 0.3, "dual_clip": 0.0, "level": "sequence"}),
])
def test_clip_options_reach_the_loss(algorithm, extra, expected, critic_dirs, data_cache, monkeypatch, capsys):
    from dschat.rl_math import ppo as ppo_math
    from dschat.rl_math.critic_free import overlong_penalty
    from dschat.rlhf import ppo_formulas

    calls, upstream = [], []
    per_token = ppo_formulas.policy_loss_per_token
    monkeypatch.setattr(ppo_formulas, "policy_loss_per_token",
                        lambda *a, **k: calls.append(k) or per_token(*a, **k))
    monkeypatch.setattr(ppo_formulas, "actor_loss_fn",
                        lambda *a, **k: upstream.append(1) or ppo_math.actor_loss_fn(*a, **k))
    aggregations = []
    aggregate = ppo_formulas.aggregate_loss
    monkeypatch.setattr(ppo_formulas, "aggregate_loss",
                        lambda p, m, mode, **k: aggregations.append(mode) or aggregate(p, m, mode, **k))
    raw, trained = _spy_scores(monkeypatch)
    critic = critic_dirs["tiny-opt"] if algorithm == "ppo" else None
    result = step3_main().main(_argv("tiny-opt", critic, data_cache, "--algorithm", algorithm, *extra, steps=1))
    assert len(result.history) == 1 and math.isfinite(result.history[0]["actor_loss"])
    assert calls and not upstream
    assert all({k: c[k] for k in expected} == expected and c["cliprange"] == 0.2 for c in calls)
    assert set(aggregations) == {"token" if algorithm == "ppo" else "sequence"}
    if "--overlong_buffer_len" in extra:  # L = M = 16: every answer loses n / 16, in PPO's reward score
        exp = trained[0]
        lengths = exp.attention_mask[:, exp.prompts.shape[1]:].sum(1)
        penalty = overlong_penalty(lengths, 16, 16, 1.0)
        assert (penalty < 0).all()
        torch.testing.assert_close(exp.reward_score, raw[0] + penalty)
    assert f"algorithm {algorithm}:" in capsys.readouterr().out


def _even_rows_end_after_four_tokens(monkeypatch) -> int:
    """Rollouts (tiny-opt) whose rows 0, 2, ... end with EOS as their 4th token, padded after it; the
    others run on to the answer limit. Returns the EOS id."""
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.rollout.generator import RolloutGenerator
    from dschat.rlhf.rollout.sampling import Rollout

    tokenizer = load_hf_tokenizer("tiny-opt")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rollout = RolloutGenerator.rollout

    def ending(self, prompts, mask):
        seq = rollout(self, prompts, mask).sequences.clone()
        P = prompts.shape[1]
        assert seq.shape[1] >= P + 5
        seq[0::2, P + 3] = eos
        seq[0::2, P + 4:] = pad
        return Rollout(seq, None)  # the actor's pass scores the edited rows

    monkeypatch.setattr(RolloutGenerator, "rollout", ending)
    return eos


@pytest.mark.slow
def test_overlong_penalty_and_truncated_answers_masked_in_a_grpo_run(data_cache, monkeypatch):
    """GRPO with DAPO's soft overlong punishment and overlong filtering. Rows 0 and 2 of each batch are
    made to end after 4 tokens (EOS included); the others run to the 16-token limit. The cut rows get
    the full penalty -0.5 and leave the loss (zero action mask), yet their rewards enter the group
    statistics."""
    from dschat.rl_math.critic_free import grpo_advantages, overlong_penalty

    eos = _even_rows_end_after_four_tokens(monkeypatch)
    raw, trained = _spy_scores(monkeypatch)
    result = step3_main().main(_argv("tiny-opt", None, data_cache, "--algorithm", "grpo", "--num_generations", "2",
                                     "--reward_fn", "reward_fixtures:length", "--kl_ctl", "0",
                                     "--overlong_buffer_len", "8", "--overlong_penalty_factor", "0.5",
                                     "--mask_truncated_answers", steps=1))
    assert len(result.history) == 1
    (exp,) = trained
    P = exp.prompts.shape[1]
    ended = (exp.seq[:, P:] == eos).any(1)
    assert ended[0::2].all() and not ended.all()  # the test's premise: some rows are cut
    lengths = exp.attention_mask[:, P:].sum(1)
    # M = 16, L = 8: the 4-token answers are free; a cut answer (16 tokens) gets -0.5 x (16 - 8) / 8 = -0.5.
    assert lengths[0::2].tolist() == [4, 4]
    penalty = overlong_penalty(lengths, 16, 8, 0.5)
    assert penalty[ended].eq(0).all() and penalty[~ended].eq(-0.5).all()
    torch.testing.assert_close(exp.reward_score, raw[0] + penalty)
    # cut rows: no loss; ended rows train; the group statistics use every row's (penalised) reward
    assert exp.valid.tolist() == ended.tolist()
    actions = exp.action_mask[:, exp.start:]
    assert actions[~ended].eq(0).all() and (actions[ended].sum(1) == 4).all()
    torch.testing.assert_close(exp.sequence_advantages, grpo_advantages(exp.reward_score, 2))


@pytest.mark.slow
def test_a_cut_answers_kl_penalty_stays_in_its_groups_baseline(data_cache, monkeypatch):
    """RLOO (the KL in the reward) with overlong filtering: a cut answer leaves the loss, but its reward
    enters its group's baseline KL-penalised, its KL summed over its own tokens (before, over its zeroed
    action mask: no penalty at all, which moved every sibling's advantage by kl_ctl x its KL)."""
    from dschat.rl_math.critic_free import rloo_advantages, sequence_kl

    eos = _even_rows_end_after_four_tokens(monkeypatch)
    _, trained = _spy_scores(monkeypatch)
    kl_ctl = 0.5
    result = step3_main().main(_argv("tiny-opt", None, data_cache, "--algorithm", "rloo", "--num_generations", "2",
                                     "--reward_fn", "reward_fixtures:length", "--kl_ctl", str(kl_ctl),
                                     "--mask_truncated_answers", "--actor_learning_rate", "1e-2", steps=2))
    assert len(result.history) == 2
    exp = trained[-1]  # the second rollout: the actor has moved away from the reference
    P = exp.prompts.shape[1]
    ended = (exp.seq[:, P:] == eos).any(1)
    assert exp.valid.tolist() == ended.tolist() and not ended.all()  # the premise: some rows are cut
    kl = sequence_kl(exp.logprobs[:, exp.start:], exp.ref_logprobs[:, exp.start:], exp.attention_mask[:, P:])
    assert kl[~ended].abs().min() > 1e-3  # the cut answers' KL is no zero
    torch.testing.assert_close(exp.sequence_advantages, rloo_advantages(exp.reward_score - kl_ctl * kl, 2))


@pytest.mark.slow
def test_an_episodes_overlong_penalty_counts_the_actors_tokens(data_cache, monkeypatch):
    """Multi-turn episodes (--env): the length the overlong penalty sees is the actor's tokens (the
    action mask's count), not the environment's observation tokens between its turns."""
    from transformers import LogitsProcessorList

    from dschat.rl_math.critic_free import overlong_penalty
    from dschat.rlhf import experience_maker
    from dschat.rlhf.rollout.generator import RolloutGenerator
    from test_step3_envs import TURN, EndTurnAfter  # turns of TURN (even rows) or TURN + 1 tokens

    init = RolloutGenerator.__init__

    def ending_turns(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.extra_generate_kwargs = {
            "logits_processor": LogitsProcessorList([EndTurnAfter(self.tokenizer.eos_token_id, TURN)])}

    monkeypatch.setattr(RolloutGenerator, "__init__", ending_turns)
    seen = []
    monkeypatch.setattr(experience_maker, "overlong_penalty",
                        lambda n, *a: seen.append((n.clone(), overlong_penalty(n, *a))) or seen[-1][1])
    raw, trained = _spy_scores(monkeypatch)
    argv = _argv("tiny-opt", None, data_cache, "--algorithm", "grpo", "--num_generations", "2", "--env",
                 "env_fixtures:ask_twice", "--max_turns", "2", "--kl_ctl", "0", "--max_answer_seq_len", "40",
                 "--overlong_buffer_len", "40", "--overlong_penalty_factor", "2", steps=1)
    step3_main().main(argv)
    (exp,) = trained
    (lengths, penalty), = seen
    observed = exp.observation_mask[:, exp.start:].sum(1)
    assert (observed > 0).all()  # two turns each, a user message between them
    assert lengths.tolist() == exp.action_mask[:, exp.start:].sum(1).tolist() == [2 * TURN, 2 * TURN + 2] * 2
    # L = M = 40, F = 2: -2 n / 40 on the actor's 10 or 12 tokens
    torch.testing.assert_close(penalty, -2.0 * lengths.float() / 40)
    env_reward = exp.reward_score - raw[0] - penalty
    assert (env_reward >= 0.25).all()  # the rest of the score is the turns' rewards (0.25 + words / 10)
