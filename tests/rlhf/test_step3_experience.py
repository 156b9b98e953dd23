"""Experience: masks against hand-written tensors (incl. pad == eos == bos), eval-mode passes with
mask-derived positions, dropped short answers, reward placement, the container protocol."""
from __future__ import annotations

import pytest
import torch

from dschat.utils.data.data_utils import MiniDataset
from dschat.rlhf.experience import Experience, answer_mask, sequence_masks

from helpers.step3 import base_argv, step3_main

Q = 2  # tiny-opt-quirk: bos == eos == pad == 2


# ---------------------------------------------------------------------------------- pure masks


def test_answer_mask_keeps_tokens_up_to_and_including_the_first_eos():
    answers = torch.tensor([
        [11, 12, Q, Q, Q],  # EOS at 2, then padding that equals EOS
        [Q, Q, Q, Q, Q],  # EOS first: a one-token answer
        [11, 12, 13, 14, 15],  # no EOS: every token is real
        [11, Q, 12, Q, Q],  # only the first EOS ends it
    ])
    assert answer_mask(answers, Q).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
    ]
    assert answer_mask(answers, None).tolist() == [[1] * 5] * 4


def test_sequence_masks_with_left_padded_prompts_and_pad_equal_to_bos_and_eos():
    # Prompt width P = 4, left-padded with pad (== bos == eos); the BOS itself is real.
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    seq = torch.tensor([
        [Q, Q, 20, 21, 30, 31, Q, Q],  # pad, BOS, 2 prompt tokens | answer 30 31 EOS, pad
        [Q, 22, 23, 24, 32, Q, Q, Q],  # BOS + 3 prompt tokens | answer 32 EOS, pad, pad
    ])
    m = sequence_masks(prompt_mask, seq, eos_token_id=Q)
    assert m.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0]]
    # Positions count real tokens only, as generate() used them.
    assert m.position_ids.tolist() == [[0, 0, 1, 2, 3, 4, 5, 5], [0, 1, 2, 3, 4, 5, 5, 5]]
    assert m.answer_lengths.tolist() == [3, 2]  # EOS counted
    # Upstream's `seq != pad` would have masked the BOS and both EOS tokens:
    assert (seq != Q).long().tolist() != m.attention_mask.tolist()


def _experience(B: int = 4, P: int = 3, A: int = 4) -> Experience:
    L, T = P + A, P + A - 1
    return Experience(
        prompts=torch.arange(B * P).view(B, P), seq=torch.arange(B * L).view(B, L),
        attention_mask=torch.ones(B, L, dtype=torch.long), position_ids=torch.arange(L).repeat(B, 1),
        action_mask=torch.ones(B, T, dtype=torch.long), logprobs=torch.randn(B, T), ref_logprobs=torch.randn(B, T),
        values=torch.randn(B, T), reward_score=torch.arange(B, dtype=torch.float), valid=torch.ones(B, dtype=torch.bool),
    )


def test_experience_upstream_keys_rows_and_minidataset_split():
    exp = _experience()
    assert exp["rewards"] is exp.reward_score and exp["value"] is exp.values and exp["input_ids"] is exp.seq
    assert set(exp.keys()) == {"prompts", "logprobs", "ref_logprobs", "value", "rewards", "input_ids", "attention_mask"}
    with pytest.raises(KeyError):
        exp["advantages"]
    assert exp.start == 2 and len(exp) == 4
    mini = MiniDataset(2, 2)
    assert mini.add(exp) is None
    parts = mini.add(_experience())
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert all(isinstance(p, Experience) for p in parts)
    assert parts[1].reward_score.tolist() == [2.0, 3.0] and parts[1].prompts.shape == (2, 3)


# ---------------------------------------------------------------------------------- with models


def _build(model: str, critic_dirs, data_cache, *extra: str):
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.runtime.dist import init_distributed

    init_distributed()
    args = step3_main().parse_args(base_argv(model, critic_dirs[model], data_cache, *extra))
    tokenizer = load_hf_tokenizer(model)
    torch.manual_seed(0)
    engine = DeepSpeedRLHFEngine(model, str(critic_dirs[model]), tokenizer, args, 10)
    return DeepSpeedPPOTrainer(engine, args), tokenizer


def _fixed_generation(monkeypatch, trainer, seq):
    from dschat.rlhf.rollout.sampling import Rollout

    monkeypatch.setattr(trainer.generator, "rollout", lambda prompts, mask: Rollout(seq.clone(), None))


def test_quirk_experience_keeps_eos_in_action_mask_and_drops_one_token_answers(monkeypatch, critic_dirs, data_cache):
    trainer, tok = _build("tiny-opt-quirk", critic_dirs, data_cache, "--actor_dropout", "0.5")
    assert tok.pad_token_id == tok.eos_token_id == tok.bos_token_id == Q
    prompts = torch.tensor([[Q, Q, 20, 21], [Q, 22, 23, 24], [Q, 25, 26, 27]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    seq = torch.cat([prompts, torch.tensor([[30, 31, Q, Q], [32, Q, Q, Q], [Q, Q, Q, Q]])], dim=1)
    _fixed_generation(monkeypatch, trainer, seq)
    exp = trainer.generate_experience(prompts, prompt_mask, step=0)

    assert exp.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert exp.valid.tolist() == [True, True, False]  # the EOS-only answer is dropped
    start = exp.start
    # Positions start..start+n-1 score the answer tokens; the EOS (index start+2 / start+1) is an action.
    assert exp.action_mask[:, start:].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert exp.logprobs.shape == exp.ref_logprobs.shape == exp.values.shape == (3, 7)
    assert exp.reward_score.shape == (3,)

    # Eval mode: no dropout (actor_dropout 0.5), so scoring twice gives the same log-probs,
    # and the explicit positions give the same numbers as a hand-made forward.
    again = trainer.generate_experience(prompts, prompt_mask, step=1)
    assert torch.equal(exp.logprobs, again.logprobs)
    actor = trainer.actor_model.module
    assert not actor.training
    with torch.no_grad():
        logits = actor(seq, attention_mask=exp.attention_mask, position_ids=exp.position_ids).logits
    manual = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seq[:, 1:, None]).squeeze(-1)
    # Every column a real token predicts from (packed rows leave the padding columns 0).
    real = exp.attention_mask[:, :-1].bool()
    assert torch.allclose(exp.logprobs[real], manual[real], atol=1e-5)

    # Reward placement (upstream default): one slot after the last action token; "last": on the EOS.
    rewards = trainer.compute_rewards(exp.prompts, exp.logprobs, exp.ref_logprobs, exp.reward_score, exp.action_mask)
    kl = -trainer.kl_ctl * (exp.logprobs - exp.ref_logprobs)
    bonus = (rewards - kl)[0]
    expected = torch.zeros(7)
    expected[start + 3] = exp.reward_score[0].clamp(-5, 5)
    assert torch.allclose(bonus, expected, atol=1e-6)
    trainer.reward_at = "last"
    bonus_last = (trainer.compute_rewards(exp.prompts, exp.logprobs, exp.ref_logprobs, exp.reward_score,
                                          exp.action_mask) - kl)[0]
    assert bonus_last.nonzero().flatten().tolist() == [start + 2]  # the EOS position


def test_every_forward_gets_mask_derived_positions(monkeypatch, critic_dirs, data_cache):
    # RoPE models are shift-invariant, but models with learned absolute positions are not: each
    # experience and training forward must receive cumsum(mask) - 1 (upstream passed none). Padded
    # rows here; packed rows are tests/rlhf/test_sequence_packing.py's.
    trainer, tok = _build("tiny-llama", critic_dirs, data_cache, "--actor_dropout", "0.0", "--sequence_packing", "off")
    pad, bos, eos = tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    prompts = torch.tensor([[pad, pad, bos, 40, 41], [bos, 40, 41, 42, 43]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    seq = torch.cat([prompts, torch.tensor([[50, eos, pad], [50, 51, 52]])], dim=1)
    expected = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 4, 5, 6, 7]])
    seen = []
    bodies = [trainer.actor_model.module.model, trainer.ref_model.module.model,
              trainer.critic_model.module.rwtransformer, trainer.reward_model.module.rwtransformer]
    for body in bodies:
        monkeypatch.setattr(body, "forward", _spy(body.forward, seen))
    _fixed_generation(monkeypatch, trainer, seq)
    exp = trainer.generate_experience(prompts, prompt_mask, step=0)
    assert torch.equal(exp.position_ids, expected)
    trainer.train()
    trainer.train_rlhf(exp)
    assert len(seen) == 6  # actor, ref, reward, critic (experience) + actor, critic (training)
    assert all(p is not None and torch.equal(p, expected) for p in seen)


def _spy(forward, seen):
    def wrapped(*args, **kwargs):
        seen.append(kwargs.get("position_ids"))
        return forward(*args, **kwargs)

    return wrapped


def test_all_short_answers_on_every_rank_skip_the_step(monkeypatch, critic_dirs, data_cache):
    trainer, tok = _build("tiny-opt", critic_dirs, data_cache)
    eos = tok.eos_token_id
    prompts = torch.tensor([[1, 2, 40, 41], [2, 42, 43, 44]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    seq = torch.cat([prompts, torch.tensor([[eos, 1, 1], [55, eos, 1]])], dim=1)  # answers of 1 and 2 tokens
    _fixed_generation(monkeypatch, trainer, seq)
    exp = trainer.generate_experience(prompts, prompt_mask, step=0)
    assert exp.valid.tolist() == [False, True]
    seq_short = torch.cat([prompts, torch.tensor([[eos, 1, 1], [eos, 1, 1]])], dim=1)
    _fixed_generation(monkeypatch, trainer, seq_short)
    assert trainer.generate_experience(prompts, prompt_mask, step=1) is None  # upstream asserted here


@pytest.mark.slow
def test_first_batch_all_short_does_not_crash_the_run(monkeypatch, tmp_path, critic_dirs, data_cache, capsys):
    # One-token answers everywhere (each answer is its end token): every step is skipped, the run still
    # finishes and saves.
    from dschat.rlhf.rollout.generator import RolloutGenerator
    from dschat.rlhf.rollout.sampling import Rollout

    def one_token(self, prompts, mask, conversation=None):
        return Rollout(torch.cat([prompts, torch.full((prompts.shape[0], 1), self.end_ids[0])], dim=1), None)

    monkeypatch.setattr(RolloutGenerator, "_rollout", one_token)
    argv = base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(tmp_path / "out"))
    result = step3_main().main(argv)
    assert result.skipped_steps == [0, 1] and result.history == []
    assert "too short on every rank at step=0" in capsys.readouterr().out
    assert (tmp_path / "out" / "actor" / "config.json").exists()


def test_missing_eos_penalty_lowers_only_the_cut_answers(monkeypatch, critic_dirs, data_cache):
    trainer, tok = _build("tiny-opt", critic_dirs, data_cache)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompts = torch.tensor([[pad, 20, 21], [22, 23, 24]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    seq = torch.cat([prompts, torch.tensor([[30, 31, eos, pad], [32, 33, 34, 35]])], dim=1)  # row 1 never ends
    _fixed_generation(monkeypatch, trainer, seq)
    plain = trainer.generate_experience(prompts, prompt_mask, step=0).reward_score
    trainer.missing_eos_penalty = 2.0
    penalised = trainer.generate_experience(prompts, prompt_mask, step=0).reward_score
    assert penalised[0] == plain[0] and penalised[1] == pytest.approx(plain[1] - 2.0)


def test_train_rlhf_uses_the_stored_advantages_without_recomputing_rewards(monkeypatch, critic_dirs, data_cache):
    # prepare_rollout stores advantages and returns; a micro-step then needs only the old values (the
    # value loss clips around them): the per-token rewards are computed once per rollout, not again.
    trainer, tok = _build("tiny-opt", critic_dirs, data_cache)
    eos = tok.eos_token_id
    prompts = torch.tensor([[1, 2, 40, 41], [2, 42, 43, 44]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    _fixed_generation(monkeypatch, trainer, torch.cat([prompts, torch.tensor([[50, 51, eos], [55, 56, 57]])], dim=1))
    exp = trainer.generate_experience(prompts, prompt_mask, step=0)
    calls = []
    compute_rewards = trainer.compute_rewards
    monkeypatch.setattr(trainer, "compute_rewards", lambda *a: calls.append(1) or compute_rewards(*a))
    trainer.prepare_rollout([exp])
    assert len(calls) == 1
    trainer.train_rlhf(exp)
    assert len(calls) == 1
    # An upstream-style caller (no prepare_rollout) still gets them per micro-batch.
    trainer.train_rlhf(trainer.generate_experience(prompts, prompt_mask, step=1))
    assert len(calls) == 2


def test_the_ema_actors_config_has_the_actors_dropout(critic_dirs, data_cache):
    """actor_ema/config.json kept the starting model's dropout (tiny-opt's 0.1) beside actor/'s 0.0."""
    trainer, _ = _build("tiny-opt", critic_dirs, data_cache, "--enable_ema", "--actor_dropout", "0.0")
    engine = trainer.rlhf_engine
    assert engine.actor.module.config.dropout == engine.actor_ema.module.config.dropout == 0.0


@pytest.mark.parametrize("whiten", [False, True])
def test_an_upstream_style_caller_gets_advantages_whitened_as_the_run_would(whiten, monkeypatch, critic_dirs,
                                                                            data_cache):
    """Without prepare_rollout (generate_experience -> train_rlhf, upstream's order) the micro-step
    computes the advantages itself: whitened (over the micro-batch) when the run whitens them
    (--whiten_advantages; REINFORCE++ always), as they were not before."""
    from dschat.rl_math.stats import masked_mean

    trainer, tok = _build("tiny-opt", critic_dirs, data_cache, *(["--whiten_advantages"] if whiten else []))
    eos = tok.eos_token_id
    prompts = torch.tensor([[1, 2, 40, 41], [2, 42, 43, 44]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    _fixed_generation(monkeypatch, trainer, torch.cat([prompts, torch.tensor([[50, 51, eos], [55, 56, 57]])], dim=1))
    exp = trainer.generate_experience(prompts, prompt_mask, step=0)
    exp.reward_score = torch.tensor([4.0, 9.0])  # far from whitened: a mean of 0 is no accident
    seen = []
    policy_loss = trainer.policy_loss
    monkeypatch.setattr(trainer, "policy_loss", lambda lp, old, adv, *a: seen.append(adv) or policy_loss(lp, old, adv, *a))
    trainer.train_rlhf(exp)
    mask = exp.action_mask[:, exp.start:].bool()
    mean = float(masked_mean(seen[0], mask))
    assert (abs(mean) < 1e-5) == whiten, mean
    if whiten:
        assert float(seen[0][mask].std()) == pytest.approx(1.0, abs=1e-3)
