"""Step 3's glue pinned where a slip would still pass the runs and the hand-checked formulas: ReMax's
KL in its sequence scores, the old values zeroed after each answer's end before GAE, answers dropped
from the loss (one-token answers, truncated ones) kept out of the actor loss and the step's loss
normaliser, ``--align_overflow``'s skip of the model that did not overflow, and a critic that does
not pack scoring padded rows while the actor packs. Pure in-process tests on hand-made experiences,
fake engines and tiny models: no trainer, no run."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import transformers as T

from dschat.rl_math.critic_free import remax_advantages, sequence_kl
from dschat.rl_math.ppo import get_advantages_and_returns
from dschat.rlhf.config import BatchPlan
from dschat.rlhf.experience import Experience
from dschat.rlhf.experience_maker import ExperienceMaker
from dschat.rlhf.ppo_update import PPOUpdate
from dschat.models.reward_model import RewardModel
from dschat.rlhf.scoring_passes import ScoringPasses
from dschat.training.nonfinite import NonFiniteGuard

from test_decoder_model import tiny_config
from test_step3_update_pins import _experience, _formulas


def _with_dropped_row() -> Experience:
    """3 rows, prompts of 2 (start 1), answers of up to 3 tokens (T = 4): row 0 a 2-token answer, row 1 a
    one-token answer (dropped: attention on its token, no action), row 2 a full answer."""
    exp = _experience(B=3, P=2, A=3)
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    valid = torch.tensor([True, False, True])
    return replace(exp, attention_mask=attention, action_mask=attention[:, 1:] * valid[:, None].long(), valid=valid)


# ---------------------------------------------------------------------------------- ReMax's KL


def test_remax_scores_lose_the_kl_when_it_is_in_the_reward():
    """ReMax keeps the KL in the reward by default: each answer's score is its clipped reward less kl_ctl x its
    summed KL to the reference, against the clipped greedy baseline."""
    f = _formulas("--algorithm", "remax", "--kl_ctl", "0.5")
    assert f.settings.kl_in_reward and f.kl_estimator == "k1"
    exp = _experience()
    score, greedy = torch.tensor([1.0, 3.0, 10.0, -2.0]), torch.tensor([7.0, -9.0, 0.5, 2.0])
    got = f.sequence_advantages(score, exp.logprobs, exp.ref_logprobs, exp.action_mask, exp.start, greedy)
    kl = sequence_kl(exp.logprobs[:, 1:], exp.ref_logprobs[:, 1:], exp.action_mask[:, 1:], estimator="k1")
    assert bool((kl.abs() > 0.05).all())
    torch.testing.assert_close(got, remax_advantages(score.clamp(-5, 5) - 0.5 * kl, greedy.clamp(-5, 5)))
    assert f.kl_in_group_baseline  # so the experience maker reads the dropped answers' log-probs too


# ---------------------------------------------------------------------------------- old values after the end


def test_gae_reads_old_values_zeroed_after_each_answers_end():
    """prepare_rollout's GAE (upstream's train_rlhf): the critic's values from each answer's end on
    (``ends = start + n + 1``) are zeroed before GAE, so a short answer's last advantages do not bootstrap
    from the value the critic gave its padding."""
    f = _formulas()  # PPO: GAE with the critic's values, KL in the reward
    exp = _experience(B=2, P=2, A=4)  # start 1, T 5; values are random at every position, padding too
    attention = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])  # row 0: a 2-token answer, ends = 4
    exp = replace(exp, attention_mask=attention, action_mask=attention[:, 1:])
    fake_engine = SimpleNamespace(module=torch.nn.Linear(1, 1))
    passes = SimpleNamespace(models={"actor": fake_engine, "reference": None, "critic": fake_engine, "reward": None})
    maker = ExperienceMaker(None, None, passes, f, None, prompt_columns=None, nonfinite=None, print_answers=False,
                            print_answers_interval=1)
    maker.prepare_rollout([exp])

    values = exp.values.clone()
    values[0, 4:] = 0  # upstream: old_values[i, ends[i]:] = 0 (row 1 fills the row: ends = 6 > T)
    rewards = f.compute_rewards(exp.prompts, exp.logprobs, exp.ref_logprobs, exp.reward_score, exp.action_mask)
    rewards[0, 4:] = 0
    advantages, returns = get_advantages_and_returns(values, rewards, exp.start, gamma=f.gamma, lam=f.lam)
    torch.testing.assert_close(exp.advantages, advantages)
    torch.testing.assert_close(exp.returns, returns)
    # The premise: with the padding's value left in, the short answer's advantages differ.
    unzeroed, _ = get_advantages_and_returns(exp.values, rewards, exp.start, gamma=f.gamma, lam=f.lam)
    assert not torch.allclose(unzeroed[0, :2], advantages[0, :2])


# ---------------------------------------------------------------------------------- dropped rows


@pytest.mark.parametrize("flags", [(), ("--algorithm", "grpo", "--num_generations", "2")], ids=["ppo", "grpo"])
def test_a_dropped_answer_adds_nothing_to_the_actor_loss(flags):
    """An answer dropped from the loss (a one-token answer: attention on its token, no action) neither
    enters the actor loss nor its token count, and gets no gradient: the loss equals the loss of the batch
    without that row (upstream's PPO loss, and the critic-free one)."""
    f = _formulas(*flags)
    assert f.settings.upstream_ppo_loss == (not flags)
    exp = _with_dropped_row()
    start = exp.start
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(3, 3, generator=g)
    advantages[1] = 50.0  # the dropped row: would dominate the loss if it counted
    old = exp.logprobs[:, start:]
    train = (old + 0.1 * torch.randn(3, 3, generator=g)).requires_grad_(True)
    loss = f.policy_loss(train, old, advantages, exp, None, on_policy=False)
    loss.backward()
    kept = exp.valid
    expected = f.policy_loss(train.detach()[kept], old[kept], advantages[kept], exp.rows(kept), None, on_policy=False)
    torch.testing.assert_close(loss.detach(), expected)
    assert bool((train.grad[1] == 0).all()) and bool((train.grad[0, :2] != 0).all())


class _FakeOptimizer:
    """An fp16 optimizer's external overflow check (``check_overflow(external=True)``) and ``skip_step``."""

    def __init__(self, overflow: bool) -> None:
        self.overflow = overflow
        self.skip_step = False

    def check_overflow(self, external: bool = False) -> bool:
        return self.overflow


class _FakeEngine:
    """The part of a DeepSpeed engine the update's schedule and aligned steps touch."""

    def __init__(self, overflow: bool = False) -> None:
        self.optimizer = _FakeOptimizer(overflow)
        self.steps = 0

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def step(self) -> None:
        self.steps += 1

    def was_step_applied(self) -> bool:
        return not (self.optimizer.overflow or self.optimizer.skip_step)


def _update(formulas, actor: _FakeEngine, critic: _FakeEngine | None, *, dtype: str = "fp32",
            align_overflow: bool = False) -> PPOUpdate:
    plan = BatchPlan(generation_batch_size=3, generation_batches=1, training_batch_size=3, ppo_epochs=1,
                     gradient_accumulation_steps=1, gradient_accumulation_steps_actor=1, world_size=1, ptx=False)
    passes = SimpleNamespace(models={"actor": actor, "critic": critic}, device=torch.device("cpu"))
    return PPOUpdate(passes, formulas, plan, ppo_epochs=1, nonfinite=NonFiniteGuard(0, 0, "cpu"), dtype=dtype,
                     align_overflow=align_overflow)


@pytest.mark.parametrize("flags, count", [((), 5.0), (("--algorithm", "grpo", "--num_generations", "2"), 2.0)],
                         ids=["token", "sequence"])
def test_the_step_normaliser_counts_the_action_tokens_only(flags, count):
    """schedule()'s loss normaliser (one micro-batch per optimizer step, one rank): the step's action tokens
    ('token' aggregation: 2 + 0 + 3) or answers with actions ('sequence': 2); a dropped answer's token, which
    keeps its attention, is no action."""
    f = _formulas(*flags)
    update = _update(f, _FakeEngine(), None if flags else _FakeEngine())
    (_, exp, _), = update.schedule([_with_dropped_row()], None)
    assert exp.loss_normalizer == count


# ---------------------------------------------------------------------------------- --align_overflow


@pytest.mark.parametrize("overflowed", ["actor", "critic"])
def test_align_overflow_makes_the_model_that_did_not_overflow_skip_its_step(overflowed):
    """fp16 --align_overflow: when one model's loss scaler overflowed (its optimizer skips the step itself),
    the other model's optimizer is told to skip too (``skip_step``); both engines still step (the scalers
    update)."""
    actor, critic = _FakeEngine(overflow=overflowed == "actor"), _FakeEngine(overflow=overflowed == "critic")
    update = _update(_formulas(), actor, critic, dtype="fp16", align_overflow=True)
    assert update.align_overflow
    update._aligned_steps()
    assert (actor.optimizer.skip_step, critic.optimizer.skip_step) == (overflowed == "critic", overflowed == "actor")
    assert (actor.steps, critic.steps) == (1, 1)


# ---------------------------------------------------------------------------------- packing per model


class _RemoteCodeLlamaModel(T.LlamaModel):
    """What trust_remote_code loads: not transformers' own class, so it keeps the padded layout."""


def test_a_critic_that_cannot_pack_scores_padded_rows_while_the_actor_packs():
    """--sequence_packing auto with a packing actor and a critic that cannot pack: the batch is packed for the
    actor's pass, and the critic's values come from its padded forward (it is never given packed rows)."""
    torch.manual_seed(0)
    actor = T.LlamaForCausalLM(tiny_config("llama")).eval()
    critic = RewardModel(_RemoteCodeLlamaModel(tiny_config("llama")), SimpleNamespace(pad_token_id=0)).eval()
    passes = ScoringPasses({"actor": actor, "reference": None, "critic": critic, "reward": None}, packing="auto",
                           temperature=1.0, fp32=False, scoring_gather="auto", training_gather="auto")
    assert passes.packing == {"actor": True, "critic": False}
    mask = torch.zeros(3, 12, dtype=torch.long)
    for b, (left, right) in enumerate([(0, 12), (4, 7), (2, 6)]):
        mask[b, left:right] = 1
    seq = torch.randint(3, 90, (3, 12), generator=torch.Generator().manual_seed(2)).masked_fill(mask == 0, 0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = passes.packed(seq, mask, "actor", "critic")
    assert packed is not None  # the premise: the actor's pass runs on packed rows
    with torch.no_grad():
        values = passes.token_values(seq, mask, positions, packed)
        padded = critic.forward_value(seq, mask, position_ids=positions, return_value_only=True)
    torch.testing.assert_close(values, padded)
    critic_layout, actor_layout = passes.layout_for("critic", packed), passes.layout_for("actor", packed)
    assert critic_layout is None and actor_layout is packed
