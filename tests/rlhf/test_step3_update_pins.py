"""Step 3's glue between its pure formulas, each checked against a hand computation: the values a
PPO micro-step's value loss is given, the KL in the critic-free sequence scores, the clip of ReMax's
greedy baseline, the truncated importance weights (and that no gradient flows through them),
PPO-ptx's coefficient, the reshuffle between PPO epochs and the log-prob gap metric. Runs compare a
run with a resumed or re-packed run of the same code, so a slip in this glue passes them; these
tests are what fails."""
from __future__ import annotations

import random

import pytest
import torch

from dschat.rl_math.critic_free import (aggregate_loss, policy_loss_per_token, remax_advantages, rloo_advantages,
                                        sequence_kl, tis_weights)
from dschat.rl_math.ppo import critic_loss_fn, sequence_end_indices
from dschat.rlhf.config import ppo_config, resolve_algorithm
from dschat.rlhf.experience import Experience
from dschat.rlhf.ppo_formulas import PPOFormulas

from helpers.step3 import base_argv, step3_main

PROMPTS = torch.tensor([[1, 2, 40, 41], [2, 42, 43, 44]])
PROMPT_MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


def _formulas(*flags: str) -> PPOFormulas:
    args = step3_main().parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", *flags])
    formulas = PPOFormulas()
    formulas.init_formulas(ppo_config(args), resolve_algorithm(args))
    return formulas


def _experience(B: int = 4, P: int = 2, A: int = 3, seed: int = 0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    L, T = P + A, P + A - 1
    return Experience(
        prompts=torch.zeros(B, P, dtype=torch.long), seq=torch.zeros(B, L, dtype=torch.long),
        attention_mask=torch.ones(B, L, dtype=torch.long), position_ids=torch.arange(L).repeat(B, 1),
        action_mask=torch.ones(B, T, dtype=torch.long), logprobs=-torch.rand(B, T, generator=g),
        ref_logprobs=-torch.rand(B, T, generator=g), values=torch.randn(B, T, generator=g),
        reward_score=torch.arange(B, dtype=torch.float), valid=torch.ones(B, dtype=torch.bool),
    )


# ---------------------------------------------------------------------------------- the formulas


def test_rloo_scores_lose_the_kl_when_it_is_in_the_reward():
    f = _formulas("--algorithm", "rloo", "--num_generations", "2", "--kl_ctl", "0.5")
    exp = _experience()
    score = torch.tensor([1.0, 3.0, 10.0, -2.0])  # 10 is clipped to --clip_reward_value 5
    got = f.sequence_advantages(score, exp.logprobs, exp.ref_logprobs, exp.action_mask, exp.start, None)
    kl = sequence_kl(exp.logprobs[:, 1:], exp.ref_logprobs[:, 1:], exp.action_mask[:, 1:], estimator="k1")
    assert bool((kl.abs() > 0.05).all())
    torch.testing.assert_close(got, rloo_advantages(score.clamp(-5, 5) - 0.5 * kl, 2))


def test_remax_clips_the_greedy_baseline_as_the_scores():
    f = _formulas("--algorithm", "remax", "--kl_ctl", "0")
    exp = _experience()
    score, greedy = torch.tensor([1.0, 3.0, 10.0, -2.0]), torch.tensor([7.0, -9.0, 0.5, 2.0])
    got = f.sequence_advantages(score, exp.logprobs, exp.ref_logprobs, exp.action_mask, exp.start, greedy)
    torch.testing.assert_close(got, remax_advantages(score.clamp(-5, 5), greedy.clamp(-5, 5)))
    assert got.tolist() == pytest.approx([-4.0, 8.0, 4.5, -4.0])


def test_truncated_importance_weights_scale_the_loss_and_pass_no_gradient():
    f = _formulas("--algorithm", "grpo", "--num_generations", "2", "--kl_ctl", "0", "--tis_cap", "1.5")
    exp = _experience()
    start = exp.start
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, 3)
    train = (exp.logprobs[:, start:] + torch.tensor([0.3, -0.2, 0.6])).requires_grad_(True)  # w: 1.35, .82, 1.5
    loss = f._actor_loss(train, train.detach(), advantages, exp, None, on_policy=True)
    loss.backward()

    again = train.detach().clone().requires_grad_(True)
    mask = exp.action_mask[:, start:].float()
    weights = tis_weights(again.detach(), exp.logprobs[:, start:], 1.5)
    assert bool((weights != 1).all())
    per_token = policy_loss_per_token(again, again.detach(), advantages, mask, cliprange=f.cliprange,
                                      cliprange_high=None, dual_clip=0.0, level="token")
    expected = aggregate_loss(per_token * weights, mask, "sequence", max_len=f.max_answer_seq_len)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(train.grad, again.grad)


def test_off_policy_the_truncated_importance_weights_are_not_applied_again():
    """After the actor has stepped (a later PPO epoch, or a later micro-step) the ratio is taken against the
    rollout's log-probs already: the loss is the one without --tis_cap."""
    capped = _formulas("--algorithm", "grpo", "--num_generations", "2", "--kl_ctl", "0", "--tis_cap", "1.5")
    plain = _formulas("--algorithm", "grpo", "--num_generations", "2", "--kl_ctl", "0")
    exp = _experience()
    advantages = torch.tensor([[1.0], [2.0], [0.5], [1.5]]).expand(4, 3)
    train = exp.logprobs[:, exp.start:] + torch.tensor([0.3, -0.2, 0.6])
    old = exp.logprobs[:, exp.start:]
    off = capped._actor_loss(train, old, advantages, exp, None, on_policy=False)
    torch.testing.assert_close(off, plain._actor_loss(train, old, advantages, exp, None, on_policy=False))
    assert not torch.allclose(capped._actor_loss(train, train, advantages, exp, None, on_policy=True),
                              plain._actor_loss(train, train, advantages, exp, None, on_policy=True))


def test_reinforce_pp_with_the_kl_as_a_loss_term_keeps_it_out_of_the_rewards():
    """--kl_in_reward off: the per-token rewards hold the clipped score at the reward slot alone (the KL is
    the loss's), so the advantages do not depend on the reference's log-probs."""
    f = _formulas("--algorithm", "reinforce_pp", "--kl_in_reward", "off", "--kl_ctl", "0.5")
    exp = _experience()
    score = torch.tensor([1.0, 3.0, 10.0, -2.0])
    rewards = f.compute_rewards(exp.prompts, exp.logprobs, exp.ref_logprobs, score, exp.action_mask)
    again = f.compute_rewards(exp.prompts, exp.logprobs, exp.ref_logprobs - 1.0, score, exp.action_mask)
    torch.testing.assert_close(rewards, again)
    assert rewards.sum(dim=1).tolist() == [1.0, 3.0, 5.0, -2.0]  # the score, clipped to 5, and nothing else


def test_truncated_importance_weights_are_detached():
    train = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    assert not tis_weights(train, torch.tensor([[-1.0, -1.0]]), 2.0).requires_grad


def test_reward_at_last_ends_an_empty_answer_one_past_its_start():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert sequence_end_indices(mask, 1, reward_at="last").tolist() == [3, 2, 4]


def test_the_fp32_value_loss_subtracts_in_fp32():
    # 1 + 8/512 - 1/512 = 1 + 7/512, which bf16 (steps of 4/512 there) rounds up to 1 + 8/512.
    values = torch.tensor([[1.015625]], dtype=torch.bfloat16)
    returns = torch.tensor([[0.001953125]], dtype=torch.bfloat16)
    mask = torch.ones(1, 1)
    got = critic_loss_fn(values, values, returns, mask, compute_fp32_loss=True)
    expected = 0.5 * (values.float() - returns.float()) ** 2
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(expected), rel=1e-7)
    assert float(got) != pytest.approx(float(critic_loss_fn(values, values, returns, mask)), rel=1e-7)


# ---------------------------------------------------------------------------------- a real tiny trainer


def _trainer(critic_dirs, data_cache, *extra: str):
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.rlhf.rollout.sampling import Rollout
    from dschat.runtime.dist import init_distributed

    init_distributed()
    args = step3_main().parse_args(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--actor_dropout", "0",
                                             "--critic_dropout", "0", *extra))
    tokenizer = load_hf_tokenizer("tiny-opt")
    torch.manual_seed(0)
    trainer = DeepSpeedPPOTrainer(DeepSpeedRLHFEngine("tiny-opt", str(critic_dirs["tiny-opt"]), tokenizer, args, 10),
                                  args)
    seq = torch.cat([PROMPTS, torch.tensor([[50, 51, tokenizer.eos_token_id], [55, 56, 57]])], dim=1)
    trainer.generator.rollout = lambda prompts, mask: Rollout(seq.clone(), None)
    return trainer


def test_the_value_loss_gets_each_tokens_own_value(monkeypatch, critic_dirs, data_cache):
    """Upstream's train_rlhf: ``critic(...)[:, :-1]``, position t's value for log-prob position t."""
    trainer = _trainer(critic_dirs, data_cache)
    exp = trainer.generate_experience(PROMPTS, PROMPT_MASK, step=0)
    trainer.prepare_rollout([exp])
    seen = []
    loss_fn = trainer.critic_loss_fn
    monkeypatch.setattr(trainer, "critic_loss_fn", lambda values, *a, **k: seen.append(values) or loss_fn(values, *a, **k))
    trainer.train_rlhf(exp)
    mask = exp.action_mask[:, exp.start:]
    torch.testing.assert_close(seen[0].detach() * mask, exp.values[:, exp.start:] * mask, atol=1e-5, rtol=1e-5)


def test_the_log_prob_gap_is_a_mean_of_absolute_differences(critic_dirs, data_cache):
    trainer = _trainer(critic_dirs, data_cache)
    exp = trainer.generate_experience(PROMPTS, PROMPT_MASK, step=0)
    mask = exp.action_mask[:, exp.start:].float()
    shift = torch.tensor([0.5, -0.5, 0.5]) * mask  # opposite signs: a signed mean would cancel
    exp.logprobs = exp.logprobs.clone()
    exp.logprobs[:, exp.start:] += shift
    trainer.prepare_rollout([exp])
    trainer.train_rlhf(exp)
    assert trainer.update.pop_micro_stats()[-1].logprob_gap == pytest.approx(0.5, abs=1e-3)


def test_ptx_backward_is_weighted_by_unsup_coef(monkeypatch, critic_dirs, data_cache):
    trainer = _trainer(critic_dirs, data_cache)
    update = trainer.update
    update.train()
    passed = []
    backward = update.actor_model.backward
    monkeypatch.setattr(update.actor_model, "backward", lambda loss, *a, **k: passed.append(loss) or backward(loss))
    seq = torch.cat([PROMPTS, PROMPTS], dim=1)
    loss = update.train_unsupervised({"input_ids": seq, "attention_mask": torch.ones_like(seq), "labels": seq}, 0.25)
    assert float(passed[0].detach()) == pytest.approx(0.25 * float(loss), rel=1e-6) and float(loss) > 0


def test_each_ppo_epoch_after_the_first_reshuffles_the_rollout(critic_dirs, data_cache):
    trainer = _trainer(critic_dirs, data_cache, "--ppo_epochs", "3")
    rollout = [_experience(B=2, seed=i) for i in range(5)]
    for i, exp in enumerate(rollout):
        exp.reward_score = torch.full((2,), float(i))
    random.seed(7)
    steps = trainer.update.schedule(rollout, None)
    order = [[int(exp.reward_score[0]) for ep, exp, _ in steps if ep == epoch] for epoch in range(3)]
    random.seed(7)
    expected, unsup = list(range(5)), [None] * 5
    shuffled = []
    for _ in range(2):
        random.shuffle(expected)
        random.shuffle(unsup)
        shuffled.append(list(expected))
    assert order == [list(range(5)), *shuffled] and order[1] != order[0]
