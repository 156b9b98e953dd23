"""dschat.rl_math.critic_free: each algorithm's advantages and losses on small groups, the numbers worked
out by hand from the paper's formula in the comments, plus the invariances
the trainer relies on (sharded == full batch, the token form == PPO's actor_loss_fn)."""
from __future__ import annotations

import math

import pytest
import torch

from dschat.rl_math.critic_free import aggregate_loss, clipped_surrogate, grpo_advantages, overlong_penalty, policy_loss_per_token, sequence_ratio, remax_advantages, returns_to_go, rloo_advantages, sequence_kl, tis_weights, token_advantages
from dschat.rl_math.ppo import actor_loss_fn, compute_rewards
from dschat.rl_math.stats import masked_whiten


def _close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


class TestGRPO:
    def test_hand_case(self):
        # Two groups of K = 3. Group 1: r = [1, 0, 2], mean 1, sample std sqrt(((0)^2 + 1 + 1) / 2) = 1
        #   -> A = [0, -1, 1] / (1 + eps).
        # Group 2: r = [3, 3, 6], mean 4, std sqrt((1 + 1 + 4) / 2) = sqrt(3) = 1.7320508
        #   -> A = [-1, -1, 2] / 1.7320508 = [-0.5773503, -0.5773503, 1.1547005].
        r = torch.tensor([1.0, 0.0, 2.0, 3.0, 3.0, 6.0])
        _close(grpo_advantages(r, 3, eps=0.0), [0.0, -1.0, 1.0, -0.5773503, -0.5773503, 1.1547005])
        # eps enters the denominator: group 1 with eps 1 -> [0, -0.5, 0.5].
        _close(grpo_advantages(r, 3, eps=1.0)[:3], [0.0, -0.5, 0.5])

    def test_dr_grpo_has_no_std_division(self):
        # Dr.GRPO: r - mean -> group 1 [0, -1, 1], group 2 [-1, -1, 2].
        r = torch.tensor([1.0, 0.0, 2.0, 3.0, 3.0, 6.0])
        _close(grpo_advantages(r, 3, scale_by_std=False), [0.0, -1.0, 1.0, -1.0, -1.0, 2.0])

    def test_equal_rewards_give_zero(self):
        # All answers equally good: no signal (std 0, numerator 0 -> 0, not nan).
        _close(grpo_advantages(torch.tensor([2.0, 2.0]), 2), [0.0, 0.0])

    def test_groups_must_divide(self):
        with pytest.raises(ValueError, match="groups of 4"):
            grpo_advantages(torch.zeros(6), 4)


class TestRLOO:
    def test_hand_case(self):
        # K = 4, r = [1, 2, 3, 6]: baseline of i = mean of the other three.
        # A_0 = 1 - (2+3+6)/3 = 1 - 11/3 = -8/3; A_1 = 2 - 10/3 = -4/3; A_2 = 3 - 3 = 0; A_3 = 6 - 2 = 4.
        # Check: K/(K-1) (r - mean) with mean 3: 4/3 * [-2, -1, 0, 3] = [-8/3, -4/3, 0, 4].
        _close(rloo_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), 4), [-8 / 3, -4 / 3, 0.0, 4.0])

    def test_k1_refused(self):
        with pytest.raises(ValueError, match="at least 2"):
            rloo_advantages(torch.tensor([1.0]), 1)


class TestReMax:
    def test_hand_case(self):
        # Sampled rewards [0.5, 2.0] against greedy [1.0, 1.5] -> [-0.5, 0.5].
        _close(remax_advantages(torch.tensor([0.5, 2.0]), torch.tensor([1.0, 1.5])), [-0.5, 0.5])


class TestKL:
    def test_sequence_kl_k1_and_k3(self):
        # One answer of 2 tokens (third masked): d = logp - ref = [ln 2, -ln 2, 5].
        # k1: ln 2 - ln 2 = 0.  k3 = exp(-d) - 1 + d: (0.5 - 1 + ln2) + (2 - 1 - ln2) = 0.5.
        lp = torch.tensor([[math.log(2.0), -math.log(2.0), 5.0]])
        ref = torch.zeros(1, 3)
        mask = torch.tensor([[1, 1, 0]])
        _close(sequence_kl(lp, ref, mask, estimator="k1"), [0.0])
        _close(sequence_kl(lp, ref, mask, estimator="k3"), [0.5])


class TestReinforcePP:
    def test_returns_to_go_hand_case(self):
        # start = 1, T = 4; per-token rewards after the prompt: [-0.1, -0.2, 1.0] (KL, KL, KL + score).
        # gamma = 1: G = [-0.1 - 0.2 + 1, -0.2 + 1, 1] = [0.7, 0.8, 1.0].
        rewards = torch.tensor([[9.0, -0.1, -0.2, 1.0]])  # position 0 (prompt) is ignored
        _close(returns_to_go(rewards, 1), [[0.7, 0.8, 1.0]])
        # gamma = 0.5: G_3 = 1; G_2 = -0.2 + 0.5 = 0.3; G_1 = -0.1 + 0.15 = 0.05.
        _close(returns_to_go(rewards, 1, gamma=0.5), [[0.05, 0.3, 1.0]])

    def test_against_a_python_loop(self):
        torch.manual_seed(0)
        rewards = torch.randn(3, 7)
        got = returns_to_go(rewards, 2, gamma=0.9)
        for b in range(3):
            g = 0.0
            for t in reversed(range(2, 7)):
                g = float(rewards[b, t]) + 0.9 * g
                assert abs(float(got[b, t - 2]) - g) < 1e-5

    def test_returns_to_go_skip_hand_case(self):
        # The hand case above with an observation token inserted at position 2 (skipped; its 7 is no
        # reward of the actor's). gamma = 0.5: G_4 = 1; G_3 = -0.2 + 0.5 = 0.3; G_2 = 0 (hole);
        # G_1 = -0.1 + 0.5 * 0.3 = 0.05 (one discount step across the hole, not two).
        rewards = torch.tensor([[9.0, -0.1, 7.0, -0.2, 1.0]])
        skip = torch.tensor([[False, False, True, False, False]])
        _close(returns_to_go(rewards, 1, gamma=0.5, skip=skip), [[0.05, 0.0, 0.3, 1.0]])
        # gamma = 1: G = [-0.1 - 0.2 + 1, 0, 0.8, 1]
        _close(returns_to_go(rewards, 1, skip=skip), [[0.7, 0.0, 0.8, 1.0]])
        # an all-False skip is the plain sum
        assert torch.equal(returns_to_go(rewards, 1, gamma=0.5, skip=torch.zeros_like(skip)),
                           returns_to_go(rewards, 1, gamma=0.5))

    def test_returns_to_go_skip_equals_the_compacted_sequence(self):
        g = torch.Generator().manual_seed(3)
        rewards = torch.randn(3, 8, generator=g, dtype=torch.float64)
        skip = torch.zeros(3, 8, dtype=torch.bool)
        skip[0, [3, 4]] = True
        skip[1, [1, 5, 6]] = True
        got = returns_to_go(rewards, 1, gamma=0.9, skip=skip)
        for b in range(3):
            expected, g_t = torch.zeros(7, dtype=torch.float64), 0.0
            for t in reversed([t for t in range(1, 8) if not skip[b, t]]):
                g_t = float(rewards[b, t]) + 0.9 * g_t
                expected[t - 1] = g_t
            torch.testing.assert_close(got[b], expected, rtol=0, atol=1e-12)

    def test_global_whitening_of_folded_kl_rewards(self):
        # Two answers, kl_ctl 0.1, k1, start = 1 (P = 2), T = 3, both answers 2 tokens (n = 2), so the
        # score goes to the slot after the last token, min(start + n, T - 1) = 2 (upstream's slot).
        # d = logp - ref: row 0 [., 1, 0], row 1 [., 0, 2] -> rewards -0.1 d: row 0 [., -0.1, 0],
        # row 1 [., 0, -0.2]; scores [1, 0] added at position 2: row 0 [., -0.1, 1], row 1 [., 0, -0.2].
        # Returns: row 0 [0.9, 1.0], row 1 [-0.2, -0.2]. Whitened over the 4 tokens: mean 0.375,
        # unbiased var = (0.525^2 + 0.625^2 + 0.575^2 + 0.575^2) / 3 = 1.3275 / 3 = 0.4425.
        prompts = torch.zeros(2, 2, dtype=torch.long)
        logp = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
        mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
        rewards = compute_rewards(prompts, logp, torch.zeros(2, 3), torch.tensor([1.0, 0.0]), mask, kl_ctl=0.1)
        G = returns_to_go(rewards, 1)
        _close(G, [[0.9, 1.0], [-0.2, -0.2]])
        std = math.sqrt(1.3275 / 3)
        _close(masked_whiten(G, mask[:, 1:]), [[0.525 / std, 0.625 / std], [-0.575 / std, -0.575 / std]],
               atol=1e-5)


class TestLosses:
    def test_on_policy_surrogate_is_minus_advantage(self):
        # r = 1 everywhere: loss_t = -A_t; masked token -> 0.
        lp = torch.tensor([[-1.0, -2.0, -3.0]])
        adv = torch.tensor([[0.5, -1.0, 2.0]])
        mask = torch.tensor([[1.0, 1.0, 0.0]])
        _close(policy_loss_per_token(lp, lp, adv, mask), [[-0.5, 1.0, 0.0]])

    def test_clipping_hand_case(self):
        # log-ratio ln 2 -> r = 2; A = 1: max(-2, -1.2) = -1.2; A = -1: max(2, 1.2) = 2.
        lp = torch.tensor([[math.log(2.0), math.log(2.0)]])
        _close(policy_loss_per_token(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)),
               [[-1.2, 2.0]])

    def test_aggregations_hand_case(self):
        # Two answers: [1, 2, 3] (3 tokens) and [4, _, _] (1 token).
        # token: (1+2+3+4)/4 = 2.5. sequence: (6/3 + 4/1)/2 = 3. token_sum (max_len 4): (6/4 + 4/4)/2 = 1.25.
        loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
        mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
        _close(aggregate_loss(loss, mask, "token"), 2.5)
        _close(aggregate_loss(loss, mask, "sequence"), 3.0)
        _close(aggregate_loss(loss, mask, "token_sum", max_len=4), 1.25)
        # A row without tokens counts for nothing in the sequence count: (6/3) / 1 = 2.
        _close(aggregate_loss(loss, torch.tensor([[1, 1, 1], [0, 0, 0]]), "sequence"), 2.0)

    def test_token_form_is_ppo_actor_loss(self):
        torch.manual_seed(1)
        lp, old, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
        mask = (torch.rand(3, 5) > 0.3).float()
        _close(aggregate_loss(policy_loss_per_token(lp, old, adv, mask), mask, "token"),
               actor_loss_fn(lp, old, adv, mask))

    @pytest.mark.parametrize("mode", ["token", "sequence", "token_sum"])
    def test_micro_batches_sum_to_the_full_batch(self, mode):
        # Step normalisation: with the step's count / (GA x world) as the normaliser, the micro-batch
        # losses, each divided by GA (as DeepSpeed does), sum to the full batch's loss.
        torch.manual_seed(2)
        loss = torch.randn(4, 6)
        mask = (torch.rand(4, 6) > 0.4).long()
        mask[:, 0] = 1
        full = aggregate_loss(loss, mask, mode, max_len=6)
        count = mask.sum() if mode == "token" else (mask.sum(1) > 0).sum()
        ga = 2
        parts = [aggregate_loss(loss[i:i + 2], mask[i:i + 2], mode, normalizer=count / ga, max_len=6) / ga
                 for i in (0, 2)]
        _close(sum(parts), full, atol=1e-5)

    def test_tis_weights(self):
        # train - rollout = [ln 2, ln 4, -ln 2] -> ratios [2, 4, 0.5], cap 3 -> [2, 3, 0.5].
        d = torch.tensor([[math.log(2.0), math.log(4.0), -math.log(2.0)]])
        _close(tis_weights(d, torch.zeros(1, 3), 3.0), [[2.0, 3.0, 0.5]])
        with pytest.raises(ValueError):
            tis_weights(d, d, 0.0)

    def test_token_advantages(self):
        _close(token_advantages(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]])),
               [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


def test_kl_loss_term_ignores_padding_log_probs_that_would_overflow():
    """GRPO's k3 KL as a loss term: a pad position after EOS whose log-probs are 100 nats apart adds
    nothing (before, exp(100) overflowed to inf, inf * 0 made the loss and its gradient nan)."""
    from types import SimpleNamespace

    from dschat.rlhf.config import AlgorithmSettings
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer

    trainer = object.__new__(DeepSpeedPPOTrainer)
    trainer.settings = AlgorithmSettings("grpo", 2, False, "k3", "token", True, False, 0.0)
    trainer.kl_ctl, trainer.kl_estimator, trainer.cliprange, trainer.max_answer_seq_len = 0.1, "k3", 0.2, 3
    # prompt width 2 (start 1); 3 answer positions, the last one padding after EOS
    action_mask = torch.tensor([[0, 1, 1, 0]])
    ref = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    exp = SimpleNamespace(start=1, action_mask=action_mask, ref_logprobs=ref, logprobs=ref.clone(),
                          prompts=torch.zeros(1, 2))
    logprobs = torch.tensor([[-1.2, -1.9, -100.0]], requires_grad=True)
    loss = trainer._actor_loss(logprobs, logprobs.detach(), torch.tensor([[1.0, 1.0, 1.0]]), exp, None, True)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 2] == 0
    # the two answer tokens: -A * ratio (ratio 1) + 0.1 * k3, k3 = exp(r) - r - 1 with r = ref - logprob
    k3 = [math.exp(r) - r - 1 for r in (-1.0 + 1.2, -2.0 + 1.9)]
    assert float(loss.detach()) == pytest.approx(sum(-1.0 + 0.1 * k for k in k3) / 2, rel=1e-5)


class TestDAPOAndGSPO:
    """The DAPO / GSPO options: clip-higher, dual-clip, the sequence-level ratio, the overlong penalty."""

    def test_defaults_are_todays_surrogate_bit_for_bit(self):
        torch.manual_seed(4)
        lp, old, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
        mask = (torch.rand(3, 5) > 0.3).float()
        ratio = torch.exp((lp - old) * mask)
        today = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - 0.2, 1.0 + 0.2)) * mask
        assert torch.equal(policy_loss_per_token(lp, old, adv, mask), today)
        assert torch.equal(policy_loss_per_token(lp, old, adv, mask, cliprange_high=0.2, level="token"), today)

    def test_clip_higher_hand_case(self):
        # r = [1.25, 2, 0.5], A = [1, 1, -1], c = 0.2.
        # symmetric (1 + 0.2): max(-1.25, -1.2) = -1.2; max(-2, -1.2) = -1.2; max(0.5, 0.8) = 0.8.
        # clip-higher 0.28 (1 + 0.28 = 1.28): max(-1.25, -1.25) = -1.25 (no longer clipped);
        #   max(-2, -1.28) = -1.28; the lower bound is still 1 - 0.2: max(0.5, 0.8) = 0.8.
        lp = torch.tensor([[math.log(1.25), math.log(2.0), math.log(0.5)]])
        adv, mask = torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3)
        _close(policy_loss_per_token(lp, torch.zeros(1, 3), adv, mask), [[-1.2, -1.2, 0.8]])
        _close(policy_loss_per_token(lp, torch.zeros(1, 3), adv, mask, cliprange_high=0.28), [[-1.25, -1.28, 0.8]])

    def test_dual_clip_hand_case(self):
        # c = 0.2, C = 3. (r, A):
        #   (5, -1): max(5, 1.2) = 5 -> min(5, 3 * 1) = 3 (bounded; no gradient through r)
        #   (2, -1): max(2, 1.2) = 2 -> min(2, 3) = 2
        #   (5, +1): max(-5, -1.2) = -1.2 (positive advantage: untouched)
        #   (0.5, -2): max(1, 1.6) = 1.6 -> min(1.6, 6) = 1.6
        ratio = torch.tensor([5.0, 2.0, 5.0, 0.5], requires_grad=True)
        adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
        _close(clipped_surrogate(ratio.detach(), adv), [5.0, 2.0, -1.2, 1.6])
        loss = clipped_surrogate(ratio, adv, dual_clip=3.0)
        _close(loss.detach(), [3.0, 2.0, -1.2, 1.6])
        loss.sum().backward()
        _close(ratio.grad, [0.0, 1.0, 0.0, 0.0])  # d(-A r)/dr = 1 on the unclipped (2, -1) only
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            clipped_surrogate(ratio, adv, dual_clip=1.0)

    def test_gspo_sequence_ratio_hand_case(self):
        # Row 0: log-ratios [ln 4, 0, (99 masked)] -> mean over its 2 tokens ln 2 -> s_0 = 2.
        # Row 1: log-ratios [ln 0.5] x 3 -> s_1 = 0.5. Row 2: no tokens -> s_2 = 1.
        lp = torch.tensor([[math.log(4.0), 0.0, 99.0], [math.log(0.5)] * 3, [5.0, 5.0, 5.0]])
        mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        ratio = sequence_ratio(lp, torch.zeros(3, 3), mask)
        _close(ratio * mask + (1 - mask), [[2.0, 2.0, 1.0], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
        # A = [1, -1, 1] per answer, c = 0.2, clip-higher 0.28:
        # row 0: max(-2, -1.28) = -1.28 on both tokens; row 1: max(0.5, 0.8) = 0.8 on each token.
        # (The token ratios of row 0 would have given [max(-4, -1.28), max(-1, -1.28)] = [-1.28, -1].)
        adv = token_advantages(torch.tensor([1.0, -1.0, 1.0]), mask)
        per_token = policy_loss_per_token(lp, torch.zeros(3, 3), adv, mask, cliprange_high=0.28, level="sequence")
        _close(per_token, [[-1.28, -1.28, 0.0], [0.8, 0.8, 0.8], [0.0, 0.0, 0.0]])
        # GSPO's objective: the mean over answers with tokens, (-1.28 + 0.8) / 2 = -0.24.
        _close(aggregate_loss(per_token, mask, "sequence"), -0.24)
        _close(policy_loss_per_token(lp, torch.zeros(3, 3), adv, mask, cliprange_high=0.28)[0], [-1.28, -1.0, 0.0])

    def test_gspo_token_form_has_the_sequence_forms_value_and_gradient(self):
        # With one advantage per answer and the per-answer mean, the token form's loss and gradient are
        # those of l_i = max(-A_i s_i, -A_i clip(s_i)) with s_i = exp(mean_t log-ratio) (GSPO eq. 5 and 10).
        torch.manual_seed(5)
        old = torch.randn(4, 6, dtype=torch.float64)
        lp = (old + 0.3 * torch.randn(4, 6, dtype=torch.float64)).requires_grad_()
        mask = torch.ones(4, 6, dtype=torch.float64)
        mask[0, 4:] = 0
        mask[2, 2:] = 0
        seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
        token_form = aggregate_loss(policy_loss_per_token(lp, old, token_advantages(seq_adv, mask).double(), mask,
                                                          cliprange_high=0.28, level="sequence"), mask, "sequence")
        (g_token,) = torch.autograd.grad(token_form, lp)
        s = torch.exp(((lp - old) * mask).sum(1) / mask.sum(1))
        plain = clipped_surrogate(s, seq_adv, cliprange_high=0.28).mean()
        (g_plain,) = torch.autograd.grad(plain, lp)
        torch.testing.assert_close(token_form, plain, rtol=0, atol=1e-12)
        torch.testing.assert_close(g_token, g_plain, rtol=0, atol=1e-12)
        clipped = (s - 1).abs() > 0.2
        assert clipped.any() and not clipped.all()  # both branches of the clip were exercised

    def test_overlong_penalty_hand_case(self):
        # M = 16, L = 4: free up to 12 tokens; 13 -> -1/4, 15 -> -3/4, 16 -> -1 (x factor); past M: -factor.
        n = torch.tensor([10, 12, 13, 15, 16, 20])
        _close(overlong_penalty(n, 16, 4, 1.0), [0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
        _close(overlong_penalty(n, 16, 4, 2.0), [0.0, 0.0, -0.5, -1.5, -2.0, -2.0])
        # L = M: linear from the first token: n / 16 x 0.5 for n = 8 -> -0.25.
        _close(overlong_penalty(torch.tensor([8]), 16, 16, 0.5), [-0.25])
        _close(overlong_penalty(n, 16, 0, 1.0), [0.0] * 6)  # off
        for bad in ((16, 17, 1.0), (16, 4, -1.0)):
            with pytest.raises(ValueError):
                overlong_penalty(n, *bad)
