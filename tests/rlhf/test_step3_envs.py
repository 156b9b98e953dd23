"""Step 3 with ``--env`` (multi-turn episodes), end to end on tiny models (CPU).

A one-turn environment gives today's single-answer run exactly; two-turn episodes are laid out as
``[prompt | actor | observation | actor]`` with the observation masked from the loss, the KL and the
value targets; seeded episodes repeat; an interrupted run resumes to the uninterrupted one; ZeRO-3
plays them too; a failing environment stops the run with one line."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import env_fixtures
from dschat.rlhf.rollout.generator import RolloutGenerator
from helpers.step3 import (Interrupted, base_argv, crash_after_checkpoint, load_state, max_abs_diff,
                           refused_in_process, step3_main)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

TURN = 5  # tokens of an even row's actor turn where the turns are made to end (odd rows: 6)


def _argv(critic: Path | None, data: Path, *extra: str, steps: int = 2) -> list[str]:
    argv = base_argv("tiny-opt", critic or Path("unused"), data, "--max_answer_seq_len", "40", *extra, steps=steps)
    if critic is None:
        i = argv.index("--critic_model_name_or_path")
        del argv[i:i + 2]
    return argv


class EndTurnAfter(LogitsProcessor):
    """In every ``generate`` call, row ``i`` ends with EOS as its ``n + i % 2``-th token (a random tiny
    model rarely ends a turn by itself; rows ending apart leave pad ids after the earlier ones)."""

    def __init__(self, eos: int, n: int) -> None:
        self.eos, self.n = eos, n
        self.start = self.last = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        width = input_ids.shape[1]
        if self.last is None or width != self.last + 1:  # a new call
            self.start = width
        self.last = width
        scores = scores.clone()
        ends = self.n - 1 + torch.arange(scores.shape[0]) % 2  # generated tokens before each row's EOS
        now = (width - self.start) == ends
        scores[~now, self.eos] = -float("inf")
        scores[now] = -float("inf")
        scores[now, self.eos] = 0.0
        return scores


@pytest.fixture
def turns_end(monkeypatch):
    """Rollouts decode with Hugging Face ``generate`` and turns of exactly :data:`TURN` tokens."""
    original = RolloutGenerator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.extra_generate_kwargs = {
            "logits_processor": LogitsProcessorList([EndTurnAfter(self.tokenizer.eos_token_id, TURN)])}

    monkeypatch.setattr(RolloutGenerator, "__init__", init)


@pytest.fixture
def experiences(monkeypatch):
    """Every experience step 3 makes, in order."""
    from dschat.rlhf.experience_maker import ExperienceMaker

    seen = []
    original = ExperienceMaker.generate_experience

    def spy(self, *args, **kwargs):
        exp = original(self, *args, **kwargs)
        seen.append(exp)
        return exp

    monkeypatch.setattr(ExperienceMaker, "generate_experience", spy)
    return seen


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_one_turn_environment_is_the_single_answer_run(algorithm, tmp_path, critic_dirs, data_cache, turns_end,
                                                         experiences):
    """``--env`` whose episodes end after one turn with the reward ``--reward_fn`` would give: the same
    experience, losses and trained weights as the run with that reward function."""
    critic = critic_dirs["tiny-opt"] if algorithm == "ppo" else None
    extra = ("--algorithm", algorithm) + (("--num_generations", "2") if algorithm == "grpo" else ())
    main = step3_main().main
    by_fn = main(_argv(critic, data_cache, *extra, "--reward_fn", "reward_fixtures:length",
                       "--output_dir", str(tmp_path / "fn")))
    fn_exps = list(experiences)
    experiences.clear()
    by_env = main(_argv(critic, data_cache, *extra, "--env", "env_fixtures:one_turn_length", "--max_turns", "1",
                        "--output_dir", str(tmp_path / "env")))
    keys = ("reward", "actor_loss", "critic_loss", "kl_to_ref", "response_length", "approx_kl")
    assert len(by_fn.history) == len(by_env.history) == 2
    # Episodes also end a turn at the chat template's end of turn (tests/rlhf/test_rollout_end_ids.py).
    assert by_env.trainer.generator.chat_turn_end and not by_fn.trainer.generator.chat_turn_end
    assert all(_same(a[k], b[k]) for a, b in zip(by_fn.history, by_env.history) for k in keys)
    assert all(r["turns"] == 1.0 and r["observation_tokens"] == 0.0 for r in by_env.history)
    assert len(fn_exps) == len(experiences) == 2
    for a, b in zip(fn_exps, experiences):
        for name in ("seq", "attention_mask", "action_mask", "logprobs", "ref_logprobs", "values", "reward_score"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.observation_mask is None and not b.observation_mask.any()
    assert max_abs_diff(load_state(tmp_path / "fn" / "actor"), load_state(tmp_path / "env" / "actor")) == 0.0


def _episode_layout(exp, tokenizer, observation_text):
    """Each row's answer part as (role, tokens) runs; checks the masks agree with them."""
    P = exp.prompts.shape[1]
    real = exp.attention_mask[:, P:].bool()
    observed = exp.observation_mask[:, P - 1:].bool()  # (B, T - start): the answer part's roles
    actions = exp.action_mask[:, P - 1:].bool()
    for i in range(len(exp)):
        if not exp.valid[i]:
            continue
        n = int(real[i].sum())
        assert real[i, :n].all() and not real[i, n:].any()  # one contiguous episode, then padding
        assert torch.equal(actions[i, :n], ~observed[i, :n])  # every real token is the actor's or the environment's
        assert not actions[i, n:].any() and not observed[i, n:].any()
        if observed[i].any():
            obs_ids = exp.seq[i, P:][observed[i]].tolist()
            assert tokenizer.decode(obs_ids) == observation_text


def test_two_turn_episodes_mask_the_observation_everywhere(tmp_path, critic_dirs, data_cache, turns_end,
                                                           experiences, capsys):
    """[prompt | 5 or 6 actor tokens | the observation | as many actor tokens]: the observation's tokens take no
    action, no KL in the rewards and no advantage; the reward is the two turns' rewards summed."""
    env_fixtures.SEEN_ROWS.clear()
    result = step3_main().main(_argv(critic_dirs["tiny-opt"], data_cache, "--env", "env_fixtures:ask_twice",
                                     "--max_turns", "2", "--kl_ctl", "0.5"))
    logs = capsys.readouterr().out
    assert "Episodes: 2.00 turns | 11.0 actor tokens |" in logs and "| 0% cut |" in logs
    assert all(r["turns"] == 2.0 and r["cut_share"] == 0.0 and r["response_length"] == 2 * TURN + 1
               for r in result.history)
    # The factory gets its prompt's whole row (dschat.data.prompt_columns).
    assert env_fixtures.SEEN_ROWS and all({"prompt", "chosen", "rejected"} <= set(row) for row in env_fixtures.SEEN_ROWS)
    trainer = result.trainer
    tokenizer = result.tokenizer
    exp = experiences[0]
    trainer.experience.prepare_rollout([exp])  # its advantages (the run's own were on its micro-batches)
    _episode_layout(exp, tokenizer, "Say it again, shorter.")
    P = exp.prompts.shape[1]
    start = P - 1
    observed = exp.observation_mask.bool()
    assert observed[:, start:].any(1).all()  # every episode has its observation
    # Rewards: no KL term on the observation's positions; the score after the last actor token.
    rewards = trainer._old_rewards(exp)
    assert (rewards[observed] == 0).all()
    words = [len(tokenizer.decode(exp.seq[i, P:][exp.action_mask[i, start:].bool()][TURN + i % 2:],
                                  skip_special_tokens=True).split()) / 10.0 for i in range(len(exp))]
    assert torch.allclose(exp.reward_score, torch.tensor(words) + 0.25)
    # Advantages: 0 on the observation; the returns there are not targets (masked).
    advantages = exp.advantages
    assert (advantages[observed[:, start:]] == 0).all()
    assert (advantages[exp.action_mask[:, start:].bool()] != 0).any()


def test_masked_actor_loss_is_the_hand_built_sequences(tmp_path, critic_dirs, data_cache, turns_end, experiences):
    """The actor loss of an episode batch and its gradient equal the same loss over a hand-built
    single sequence whose mask keeps the actor's tokens: the observation's log-probs get no gradient."""
    result = step3_main().main(_argv(None, data_cache, "--algorithm", "grpo", "--num_generations", "2", "--env",
                                     "env_fixtures:ask_twice", "--max_turns", "2", "--kl_ctl", "0", steps=1))
    trainer = result.trainer
    exp = experiences[0]
    trainer.experience.prepare_rollout([exp])
    start = exp.start
    logprobs = (exp.logprobs[:, start:] + 0.1 * torch.randn_like(exp.logprobs[:, start:])).requires_grad_()
    loss = trainer.policy_loss(logprobs, exp.logprobs[:, start:], exp.advantages, exp, None, on_policy=False)
    loss.backward()
    observed = exp.observation_mask[:, start:].bool()
    assert observed.any() and (logprobs.grad[observed] == 0).all()
    # Hand-built: the clipped surrogate over the actor's tokens, mean over each answer's tokens, then
    # over answers (GRPO's sequence aggregation; no KL term with --kl_ctl 0), with no mask but the actor's.
    hand = logprobs.detach().clone().requires_grad_()
    mask = (exp.attention_mask[:, start + 1:].bool() & ~observed & exp.valid[:, None]).float()
    ratio = torch.exp(hand - exp.logprobs[:, start:])
    surrogate = -torch.min(exp.advantages * ratio, exp.advantages * ratio.clamp(1 - trainer.cliprange,
                                                                                 1 + trainer.cliprange))
    kept = mask.sum(1) > 0
    per_answer = (surrogate * mask).sum(1)[kept] / mask.sum(1)[kept]
    expected = per_answer.sum() / len(exp)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-7)
    assert torch.allclose(logprobs.grad, hand.grad, rtol=1e-5, atol=1e-7)


def test_seeded_episodes_repeat_and_resume(tmp_path, data_cache, turns_end):
    """Two runs with the same seed play the same episodes; a run interrupted after its second
    checkpoint and resumed ends where the uninterrupted one does."""
    from dschat.training import checkpoint as ckpt

    main = step3_main().main

    def argv(out, *more):
        return _argv(None, data_cache, "--algorithm", "grpo", "--num_generations", "2", "--env",
                     "env_fixtures:ask_twice", "--max_turns", "2", "--save_interval", "1", "--output_dir", str(out),
                     *more, steps=4)

    full = main(argv(tmp_path / "full"))
    again = main(argv(tmp_path / "again"))
    keys = ("actor_loss", "reward", "kl_to_ref", "response_length", "turns", "observation_tokens")
    assert [{k: r[k] for k in keys} for r in full.history] == [{k: r[k] for k in keys} for r in again.history]

    with pytest.MonkeyPatch.context() as crash:
        crash_after_checkpoint(crash, optimizer_steps=2)
        with pytest.raises(Interrupted):
            main(argv(tmp_path / "resumed"))
    assert ckpt.complete_checkpoints(tmp_path / "resumed" / "checkpoints")
    resumed = main(argv(tmp_path / "resumed", "--resume"))
    assert [{k: r[k] for k in keys} for r in full.history[2:]] == [{k: r[k] for k in keys} for r in resumed.history]
    assert max_abs_diff(load_state(tmp_path / "full" / "actor"), load_state(tmp_path / "resumed" / "actor")) == 0.0


def test_zero3_and_the_cut_episodes(tmp_path, data_cache, capsys):
    """An environment that never says done: every episode is cut (by --max_turns or the length
    limit), under ZeRO-3, and trains."""
    result = step3_main().main(_argv(None, data_cache, "--algorithm", "rloo", "--num_generations", "2",
                                     "--actor_zero_stage", "3", "--env", "env_fixtures:never_done", "--max_turns", "3"))
    assert all(r["cut_share"] == 1.0 and 1.0 <= r["turns"] <= 3.0 for r in result.history)
    assert all(math.isfinite(r["actor_loss"]) for r in result.history)
    assert "Episodes:" in capsys.readouterr().out


def test_a_failing_environment_stops_the_run_with_one_line(tmp_path, data_cache, turns_end, capsys):
    out = tmp_path / "out"
    line = refused_in_process(_argv(None, data_cache, "--algorithm", "rloo", "--num_generations", "2", "--env",
                                    "env_fixtures:fails_on_turn_two", "--output_dir", str(out),
                                    "--save_interval", "1"), capsys)
    assert "environment env_fixtures:fails_on_turn_two: step raised RuntimeError: the tool broke on row 0 " \
           "(prompt ' Human: I am curious about sailing. What should I know? ..., turn 2); fix the " \
           "environment" in line, line
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


def test_held_out_evaluation_plays_episodes(tmp_path, data_cache, turns_end):
    """--eval_interval with --env: the held-out proxy is each episode's return (0.25 for the first
    turn plus the second turn's words / 10), not a single answer's score."""
    result = step3_main().main(_argv(None, data_cache, "--algorithm", "rloo", "--num_generations", "2", "--env",
                                     "env_fixtures:ask_twice", "--max_turns", "2", "--eval_interval", "1",
                                     "--eval_prompts", "4", steps=1))
    assert len(result.evaluations) == 2
    assert all(record["proxy"] >= 0.25 for record in result.evaluations), result.evaluations


@pytest.mark.parametrize("extra, message", [
    (("--env", "no_such_module_here:factory"), "--env"),
    (("--env", "env_fixtures:ask_twice", "--env_timeout", "-1"), "--env_timeout must be a number of seconds from 0 to 1e9"),
    (("--env", "env_fixtures:ask_twice", "--max_turns", "0"), "--max_turns must be a positive integer"),
])
def test_bad_environment_flags_are_one_line(extra, message, data_cache, capsys):
    line = refused_in_process(_argv(None, data_cache, "--algorithm", "rloo", "--num_generations", "2", *extra), capsys)
    assert message in line, line
