"""Tests for dschat.rl_math, three ways:

1. small cases worked out by hand (the arithmetic is in the comments);
2. the vectorised code against slow plain-Python references that mirror upstream's loops;
3. invariances: micro-batch accumulation == full batch, whitening statistics.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dschat.rl_math.logprobs import gather_log_probs, sequence_log_probs
from dschat.rl_math.ppo import actor_loss_fn, answer_span, compute_rewards, critic_loss_fn, get_advantages_and_returns, kl_penalty, mask_after_ends, missing_eos_penalty, ppo_policy_stats, reward_positions, sequence_end_indices
from dschat.rl_math.preference import dpo_label_mask, dpo_loss, pairwise_read_ends, pairwise_reward_loss, reward_end_indices, upstream_end_indices
from dschat.rl_math.stats import Moments, explained_variance, explained_variance_from_moments, masked_mean, masked_sum, masked_var, masked_whiten

LN2 = math.log(2.0)


def _close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# =============================================================================================
# 1. Hand-computed cases
# =============================================================================================
class TestGatherLogProbs:
    def test_hand_case(self):
        # One row, V = 3: logits [0, 0, ln 2] -> exp = [1, 1, 2], sum 4, logsumexp = ln 4.
        # label 2: ln 2 - ln 4 = -ln 2 = -0.6931; label 0: 0 - ln 4 = -1.3863.
        logits = torch.tensor([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]]])  # (1, 2, 3)
        labels = torch.tensor([[2, 0]])
        _close(gather_log_probs(logits, labels), [[-LN2, -math.log(4.0)]])

    def test_large_logits_are_stable(self):
        # [1000, 0]: a naive exp overflows; log p(0) = 0, log p(1) = -1000 (exp(-1000) ~ 0).
        logits = torch.tensor([[[1000.0, 0.0], [1000.0, 0.0]]])
        out = gather_log_probs(logits, torch.tensor([[0, 1]]))
        _close(out, [[0.0, -1000.0]])

    def test_matches_log_softmax_gather(self):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 4
        labels = torch.randint(0, 11, (3, 5), generator=g)
        expected = F.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
        torch.testing.assert_close(gather_log_probs(logits, labels), expected)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("fp32", [False, True])
    def test_half_precision_is_computed_in_fp32(self, dtype, fp32):
        # V = 32000 makes logsumexp ~ 10-13, where bf16's step is 0.0625: a low-precision
        # subtraction (or upstream's bf16 log_softmax output) is off by up to ~0.03-0.07 nats.
        g = torch.Generator().manual_seed(1)
        logits = (torch.randn(2, 5, 32000, generator=g) * 3).to(dtype)
        labels = torch.randint(0, 32000, (2, 5), generator=g)
        # Reference in fp64 from the very same low-precision values (the upcast is exact).
        expected = F.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
        out = gather_log_probs(logits, labels, fp32=fp32)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_precision_gradient(self, dtype):
        # d/dlogits of sum_t w_t log p(label_t) = w_t (onehot - softmax), on a non-contiguous view
        # (the trainer passes logits[:, :-1]); rounding of the gradient to ``dtype`` only.
        g = torch.Generator().manual_seed(2)
        full = (torch.randn(2, 6, 300, generator=g) * 3).to(dtype).requires_grad_()
        labels = torch.randint(0, 300, (2, 5), generator=g)
        weights = torch.randn(2, 5, generator=g)
        (gather_log_probs(full[:, :-1], labels) * weights).sum().backward()
        ref = full.detach().double().requires_grad_()
        lp = F.log_softmax(ref[:, :-1], -1).gather(-1, labels[..., None]).squeeze(-1)
        (lp * weights.double()).sum().backward()
        assert full.grad.dtype == dtype
        assert torch.all(full.grad[:, -1] == 0)  # the dropped last position gets no gradient
        step = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]  # relative rounding of the grad
        torch.testing.assert_close(full.grad.double(), ref.grad, atol=step * ref.grad.abs().max().item(), rtol=0)

    def test_shape_mismatch_is_a_readable_error(self):
        with pytest.raises(ValueError, match="logits\\[:, :-1\\]"):
            gather_log_probs(torch.zeros(1, 4, 3), torch.zeros(1, 3, dtype=torch.long))


class TestMaskedStats:
    # x = [1, 2, 3, 100], mask = [1, 1, 1, 0]: sum 6, mean 2,
    # squared deviations [1, 0, 1] -> biased var 2/3, unbiased var 2/2 = 1.
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])

    def test_sum_mean_var(self):
        _close(masked_sum(self.x, self.mask), 6.0)
        _close(masked_mean(self.x, self.mask), 2.0)
        _close(masked_var(self.x, self.mask), 1.0)
        _close(masked_var(self.x, self.mask, unbiased=False), 2.0 / 3.0)

    def test_per_row(self):
        # row 0 as above (mean 2); row 1 = [4, 6, nan, nan] with mask [1, 1, 0, 0] -> mean 5.
        x = torch.cat([self.x, torch.tensor([[4.0, 6.0, float("nan"), float("inf")]])])
        mask = torch.cat([self.mask, torch.tensor([[1, 1, 0, 0]])])
        _close(masked_mean(x, mask, dim=1), [2.0, 5.0])
        _close(masked_sum(x, mask, dim=1), [6.0, 10.0])


class TestKLPenalty:
    # logp = ln 0.5, ref = ln 0.25 -> d = logp - ref = ln 2 = 0.693147
    # k1 = d = 0.693147;  k2 = 0.5 * d^2 = 0.240227;  k3 = exp(-d) - 1 + d = 0.5 - 1 + 0.693147 = 0.193147
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])

    @pytest.mark.parametrize(
        "estimator, expected",
        [("k1", LN2), ("k2", 0.5 * LN2**2), ("k3", 0.5 - 1 + LN2)],
    )
    def test_hand_values(self, estimator, expected):
        _close(kl_penalty(self.logp, self.ref, estimator=estimator), [[expected]])

    def test_exact_expectations_show_which_are_unbiased(self):
        # p = [0.5, 0.3, 0.2], q = [0.2, 0.3, 0.5]:
        # KL(p||q) = 0.5 ln 2.5 + 0.3 ln 1 + 0.2 ln 0.4 = 0.3 * ln 2.5 = 0.274887
        # E_p[k2] = 0.5 * (0.5 + 0.2) * (ln 2.5)^2 = 0.35 * 0.839589 = 0.293856  (biased)
        p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
        q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
        kl = 0.3 * math.log(2.5)

        def expectation(est: str) -> float:
            return float((p * kl_penalty(p.log(), q.log(), estimator=est)).sum())

        assert expectation("k1") == pytest.approx(kl, abs=1e-12)
        assert expectation("k3") == pytest.approx(kl, abs=1e-12)
        assert expectation("k2") == pytest.approx(0.35 * math.log(2.5) ** 2, abs=1e-12)
        assert abs(expectation("k2") - kl) > 0.01

    def test_unknown_estimator(self):
        with pytest.raises(ValueError, match="k1"):
            kl_penalty(self.logp, self.ref, estimator="k4")  # type: ignore[arg-type]


def _rewards_batch():
    """P = 3 (start = 2), A = 5, L = 8, T = 7.

    row 0: left-padded prompt, answer [a a . . .] -> n = 2 (mid-length)
    row 1: answer [a a a a a]                     -> n = 5 (full length, no pad)
    row 2: answer [a a a . .]                     -> n = 3
    """
    attention_mask = torch.tensor(
        [
            [0, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 0, 0],
        ]
    )
    prompts = torch.zeros(3, 3, dtype=torch.long)
    action_mask = attention_mask[:, 1:]
    log_probs = torch.zeros(3, 7)
    ref_log_probs = torch.full((3, 7), -1.0)  # k1 = 0 - (-1) = 1 -> -0.1 * 1 = -0.1 per token
    scores = torch.tensor([2.0, 7.0, -9.0])  # clipped to [2, 5, -5]
    return prompts, log_probs, ref_log_probs, scores, action_mask


class TestComputeRewards:
    def test_upstream_placement_after_last(self):
        prompts, lp, ref, scores, am = _rewards_batch()
        rewards = compute_rewards(prompts, lp, ref, scores, am)
        # row 0: ends = 2 + 2 + 1 = 5, rewards[0, 2:5][-1] is index 4 = start + n (first pad slot)
        # row 1: ends = 2 + 5 + 1 = 8 > T, rewards[1, 2:8] = [2:7], last is 6 = start + n - 1
        # row 2: ends = 2 + 3 + 1 = 6, index 5; score 7 -> +5 (row 1), -9 -> -5 (row 2)
        k = -0.1
        expected = torch.full((3, 7), k)
        expected[0, 4] += 2.0  # 1.9
        expected[1, 6] += 5.0  # 4.9
        expected[2, 5] += -5.0  # -5.1
        _close(rewards, expected)
        _close(reward_positions(am, 2), [4, 6, 5])

    def test_reward_at_last_action_token(self):
        prompts, lp, ref, scores, am = _rewards_batch()
        rewards = compute_rewards(prompts, lp, ref, scores, am, reward_at="last")
        # start + n - 1: row 0 -> 3, row 1 -> 6, row 2 -> 4
        expected = torch.full((3, 7), -0.1)
        expected[0, 3] += 2.0
        expected[1, 6] += 5.0
        expected[2, 4] += -5.0
        _close(rewards, expected)

    def test_clip_and_kl_hyperparameters(self):
        prompts, lp, ref, scores, am = _rewards_batch()
        rewards = compute_rewards(prompts, lp, ref, scores, am, kl_ctl=0.5, clip_reward_value=1.0)
        # KL term -0.5 * 1; scores [2, 7, -9] clip to [1, 1, -1]
        _close(rewards[:, 4], [-0.5 + 1.0, -0.5, -0.5])
        _close(rewards[1, 6], -0.5 + 1.0)
        _close(rewards[2, 5], -0.5 - 1.0)

    def test_k3_estimator(self):
        prompts, lp, ref, scores, am = _rewards_batch()
        rewards = compute_rewards(prompts, lp, ref, torch.zeros(3), am, kl_estimator="k3")
        # d = 1: k3 = exp(-1) - 1 + 1 = 0.367879 -> -0.1 * 0.367879 = -0.0367879 everywhere
        _close(rewards, torch.full((3, 7), -0.1 * math.exp(-1.0)))

    def test_inputs_not_mutated(self):
        prompts, lp, ref, scores, am = _rewards_batch()
        lp_before = lp.clone()
        compute_rewards(prompts, lp, ref, scores, am)
        assert torch.equal(lp, lp_before)

    def test_ends_and_zeroing_after_ends(self):
        prompts, lp, ref, scores, am = _rewards_batch()
        ends = sequence_end_indices(am, 2)
        _close(ends, [5, 8, 6])  # upstream's start + n + 1
        rewards = mask_after_ends(compute_rewards(prompts, lp, ref, scores, am), ends)
        expected = torch.tensor(
            [
                [-0.1, -0.1, -0.1, -0.1, 1.9, 0.0, 0.0],  # zero from 5 on
                [-0.1, -0.1, -0.1, -0.1, -0.1, -0.1, 4.9],  # ends = 8: nothing zeroed
                [-0.1, -0.1, -0.1, -0.1, -0.1, -5.1, 0.0],  # zero from 6 on
            ]
        )
        _close(rewards, expected)
        # reward_at="last": one past the last action token, [4, 7, 5]
        _close(sequence_end_indices(am, 2, reward_at="last"), [4, 7, 5])

    def test_bad_reward_at(self):
        prompts, lp, ref, scores, am = _rewards_batch()
        with pytest.raises(ValueError, match="after_last"):
            compute_rewards(prompts, lp, ref, scores, am, reward_at="eos")  # type: ignore[arg-type]


class TestAnswerSpan:
    """Multi-turn episodes: ``action_mask`` is 0 at observation tokens inside the answer."""

    def test_span_of_contiguous_holey_and_empty_rows(self):
        # start = 1, T = 6; answer part is action_mask[:, 1:] (5 slots).
        am = torch.tensor(
            [
                [0, 1, 1, 0, 0, 0],  # contiguous, 2 tokens          -> 2
                [0, 1, 0, 0, 1, 0],  # turn, 2 observation, turn     -> last actor at slot 3 -> 4
                [0, 0, 0, 0, 0, 0],  # nothing                       -> 0
                [1, 0, 0, 0, 0, 0],  # prompt slot only              -> 0
                [0, 1, 1, 1, 1, 1],  # full                          -> 5
                [0, 0, 1, 0, 0, 1],  # hole at start, ends last slot -> 5
            ]
        )
        got = answer_span(am, 1)
        assert got.dtype == torch.int64
        assert got.tolist() == [2, 4, 0, 0, 5, 5]
        assert answer_span(am, 6).tolist() == [0] * 6  # start == T: empty answer part

    @pytest.mark.parametrize("seed", range(3))
    def test_span_is_the_count_on_contiguous_masks(self, seed):
        prompts, _, _, _, am = _random_rollout(seed)
        start = prompts.shape[1] - 1
        assert answer_span(am, start).tolist() == am[:, start:].sum(1).tolist()

    def test_ends_and_reward_positions_unchanged_on_contiguous_masks(self):
        _, _, _, _, am = _rewards_batch()  # n = [2, 5, 3], start = 2, T = 7
        assert sequence_end_indices(am, 2).tolist() == [5, 8, 6]
        assert sequence_end_indices(am, 2, reward_at="last").tolist() == [4, 7, 5]
        assert reward_positions(am, 2).tolist() == [4, 6, 5]
        assert reward_positions(am, 2, reward_at="last").tolist() == [3, 6, 4]

    def test_ends_and_reward_positions_follow_the_last_actor_token_with_holes(self):
        # start = 2, T = 9; answer slots 2..8 (7 slots). o = observation (0 in action_mask).
        am = torch.tensor(
            [
                [0, 1, 1, 1, 0, 0, 1, 1, 0],  # a a o o a a .  -> span 6 (count 4)
                [0, 1, 1, 0, 0, 1, 0, 0, 0],  # a o o a . . .  -> span 4 (count 2)
                [1, 1, 1, 0, 1, 1, 1, 1, 1],  # a o a a a a a  -> span 7 (count 6), no pad
            ]
        )
        # after_last: ends = start + span + 1 = [9, 7, 10]; slot min(start + span, T - 1) = [8, 6, 8]
        assert sequence_end_indices(am, 2).tolist() == [9, 7, 10]
        assert reward_positions(am, 2).tolist() == [8, 6, 8]
        # last: ends = max(start + span, start + 1) = [8, 6, 9]; slot start + span - 1 = [7, 5, 8]
        assert sequence_end_indices(am, 2, reward_at="last").tolist() == [8, 6, 9]
        assert reward_positions(am, 2, reward_at="last").tolist() == [7, 5, 8]
        # compute_rewards puts the score there: k1 = 0 everywhere, scores [1, 2, 3]
        prompts = torch.zeros(3, 3, dtype=torch.long)
        rewards = compute_rewards(prompts, torch.zeros(3, 9), torch.zeros(3, 9), torch.tensor([1.0, 2.0, 3.0]), am,
                                  reward_at="last")
        expected = torch.zeros(3, 9)
        expected[0, 7], expected[1, 5], expected[2, 8] = 1.0, 2.0, 3.0
        _close(rewards, expected)


class TestGAE:
    def test_hand_case_gamma_lam(self):
        # T = 3, start = 1, gamma = 0.9, lam = 0.8; values [_, 1, 2], rewards [_, 0.5, 1]
        # t = 2: next = 0   -> delta = 1 + 0 - 2 = -1;             A2 = -1
        # t = 1: next = 2   -> delta = 0.5 + 0.9*2 - 1 = 1.3;       A1 = 1.3 + 0.72*(-1) = 0.58
        # returns = A + V = [0.58 + 1, -1 + 2] = [1.58, 1.0]
        values = torch.tensor([[9.0, 1.0, 2.0]], requires_grad=True)
        rewards = torch.tensor([[9.0, 0.5, 1.0]])
        adv, ret = get_advantages_and_returns(values, rewards, 1, gamma=0.9, lam=0.8)
        _close(adv, [[0.58, -1.0]])
        _close(ret, [[1.58, 1.0]])
        assert not adv.requires_grad

    def test_hand_case_upstream_defaults(self):
        # gamma = 1, lam = 0.95, start = 0; rewards [0, 0, 1], values [0.5, 0.5, 0.5]
        # t = 2: delta = 1 - 0.5 = 0.5;      A2 = 0.5
        # t = 1: delta = 0 + 0.5 - 0.5 = 0;  A1 = 0.95 * 0.5 = 0.475
        # t = 0: delta = 0;                  A0 = 0.95 * 0.475 = 0.45125
        # returns = [0.95125, 0.975, 1.0]
        adv, ret = get_advantages_and_returns(torch.full((1, 3), 0.5), torch.tensor([[0.0, 0.0, 1.0]]), 0)
        _close(adv, [[0.45125, 0.475, 0.5]])
        _close(ret, [[0.95125, 0.975, 1.0]])


    def test_hand_case_with_one_hole(self):
        # T = 4, start = 0, gamma = lam = 0.5, position 1 skipped (an observation token);
        # values [1, 5, 2, 0.5], rewards [0, 7, 0, 1]: the 5 and the 7 must play no part.
        # t = 3: next = 0    -> delta = 1 - 0.5 = 0.5;                      A3 = 0.5
        # t = 2: next = 0.5  -> delta = 0 + 0.25 - 2 = -1.75;               A2 = -1.75 + 0.25*0.5 = -1.625
        # t = 1: skipped     -> A1 = 0; carry next = V2 = 2, A = -1.625
        # t = 0: next = 2    -> delta = 0 + 0.5*2 - 1 = 0;                  A0 = 0 + 0.25*(-1.625) = -0.40625
        # returns = A + V = [0.59375, 5 (= V1), 0.375, 1.0]
        values = torch.tensor([[1.0, 5.0, 2.0, 0.5]], requires_grad=True)
        rewards = torch.tensor([[0.0, 7.0, 0.0, 1.0]])
        skip = torch.tensor([[False, True, False, False]])
        adv, ret = get_advantages_and_returns(values, rewards, 0, gamma=0.5, lam=0.5, skip=skip)
        _close(adv, [[-0.40625, 0.0, -1.625, 0.5]])
        _close(ret, [[0.59375, 5.0, 0.375, 1.0]])
        assert not adv.requires_grad and ret.requires_grad

    def test_no_skip_is_bit_identical(self):
        g = torch.Generator().manual_seed(7)
        values, rewards = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
        adv, ret = get_advantages_and_returns(values, rewards, 3, gamma=0.99, lam=0.9)
        skip = torch.zeros(4, 9, dtype=torch.bool)
        for s in (None, skip, skip.clone().index_fill_(1, torch.tensor([0, 2]), True)):  # holes before start only
            adv_s, ret_s = get_advantages_and_returns(values, rewards, 3, gamma=0.99, lam=0.9, skip=s)
            assert torch.equal(adv_s, adv) and torch.equal(ret_s, ret)
        # and the hand case above is unchanged by an all-False skip
        adv, ret = get_advantages_and_returns(torch.tensor([[9.0, 1.0, 2.0]]), torch.tensor([[9.0, 0.5, 1.0]]), 1,
                                              gamma=0.9, lam=0.8, skip=torch.zeros(1, 3, dtype=torch.bool))
        _close(adv, [[0.58, -1.0]])
        _close(ret, [[1.58, 1.0]])

    @pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 0.95), (0.5, 0.0)])
    def test_holes_equal_gae_on_the_compacted_sequence(self, gamma, lam):
        # Each row: remove its skipped columns, run GAE on what is left, scatter back with 0 at the holes.
        g = torch.Generator().manual_seed(11)
        B, T, start = 5, 10, 2
        values = torch.randn(B, T, generator=g, dtype=torch.float64)
        rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
        skip = torch.zeros(B, T, dtype=torch.bool)
        skip[0, [4, 5, 6]] = True  # one observation of 3 tokens
        skip[1, [2, 7]] = True  # hole at start and a later one
        skip[2, [0, 1, 3, 5, 6]] = True  # holes before start are ignored
        skip[4, [3, 4, 5, 6, 7, 8]] = True  # a long observation, last actor token at T - 1
        adv, ret = get_advantages_and_returns(values, rewards, start, gamma=gamma, lam=lam, skip=skip)
        for b in range(B):
            keep = [t for t in range(start, T) if not skip[b, t]]
            a_c, _ = get_advantages_and_returns(values[b : b + 1, keep], rewards[b : b + 1, keep], 0,
                                                gamma=gamma, lam=lam)
            expected = torch.zeros(T - start, dtype=torch.float64)
            expected[[t - start for t in keep]] = a_c[0]
            torch.testing.assert_close(adv[b], expected, rtol=0, atol=1e-12)
            torch.testing.assert_close(ret[b], expected + values[b, start:], rtol=0, atol=1e-12)

    def test_skip_of_the_wrong_shape(self):
        with pytest.raises(ValueError, match="skip"):
            get_advantages_and_returns(torch.zeros(2, 4), torch.zeros(2, 4), 1,
                                       skip=torch.zeros(2, 3, dtype=torch.bool))


class TestActorLoss:
    def test_clipping_both_sides(self):
        # log-ratios [1, 1, -1, -1] -> ratios [e, e, 1/e, 1/e] = [2.7183, 2.7183, 0.3679, 0.3679]
        # advantages [+1, -1, +1, -1], cliprange 0.2 -> clamp to [0.8, 1.2]
        #   a: max(-e, -1.2)         = -1.2     (A > 0, ratio clipped at 1.2)
        #   b: max(+e, +1.2)         = 2.7183   (A < 0, unclipped: pessimistic bound)
        #   c: max(-0.3679, -0.8)    = -0.3679  (A > 0, unclipped)
        #   d: max(0.3679, 0.8)      = 0.8      (A < 0, ratio clipped at 0.8)
        #   e: masked; log-ratio 1000 with A = -1 would give max(+inf, 1.2) = inf and inf * 0 = nan
        #      unless the log-ratio is masked before exp (then ratio = 1 and 1.2 * 0 = 0)
        # loss = (-1.2 + 2.7183 - 0.3679 + 0.8) / 4 = 1.9504 / 4 = 0.4876
        logprobs = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1000.0]])
        old = torch.zeros(1, 5)
        adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0]])
        mask = torch.tensor([[1, 1, 1, 1, 0]])
        total = -1.2 + math.e - math.exp(-1.0) + 0.8
        _close(actor_loss_fn(logprobs, old, adv, mask), total / 4)
        _close(actor_loss_fn(logprobs, old, adv, mask, normalizer=8), total / 8)
        # cliprange 0.5 -> clamp to [0.5, 1.5]: a -> -1.5, d -> 0.5
        total_05 = -1.5 + math.e - math.exp(-1.0) + 0.5
        _close(actor_loss_fn(logprobs, old, adv, mask, cliprange=0.5), total_05 / 4)


class TestCriticLoss:
    def test_value_clipping_and_half_factor(self):
        # cliprange_value 0.2:
        #   a: v=1, old=0.5, R=0 -> v_clip = 0.7; (1-0)^2 = 1,   (0.7-0)^2 = 0.49 -> 1.0
        #   b: v=1, old=0.5, R=2 -> v_clip = 0.7; (1-2)^2 = 1,   (0.7-2)^2 = 1.69 -> 1.69
        #   c: v=0, old=0.1, R=0 -> v_clip = 0.0 (inside [-0.1, 0.3]); 0, 0 -> 0
        #   d: masked (huge error ignored)
        # loss = 0.5 * (1 + 1.69 + 0) / 3 = 0.448333
        values = torch.tensor([[1.0, 1.0, 0.0, 50.0]])
        old = torch.tensor([[0.5, 0.5, 0.1, 0.0]])
        returns = torch.tensor([[0.0, 2.0, 0.0, -50.0]])
        mask = torch.tensor([[1, 1, 1, 0]])
        _close(critic_loss_fn(values, old, returns, mask), 0.5 * 2.69 / 3)
        _close(critic_loss_fn(values, old, returns, mask, normalizer=2), 0.5 * 2.69 / 2)
        # cliprange_value 1.0: b -> v_clip = 1.0, (1-2)^2 = 1 -> loss = 0.5 * 2 / 3
        _close(critic_loss_fn(values, old, returns, mask, cliprange_value=1.0), 0.5 * 2.0 / 3)

    def test_compute_fp32_loss(self):
        values = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
        old = torch.tensor([[0.5, 0.5]], dtype=torch.bfloat16)
        returns = torch.tensor([[0.0, 2.0]], dtype=torch.bfloat16)
        mask = torch.ones(1, 2)
        assert critic_loss_fn(values, old, returns, mask.bfloat16()).dtype == torch.bfloat16
        out = critic_loss_fn(values, old, returns, mask, compute_fp32_loss=True)
        assert out.dtype == torch.float32
        # 0.5 * (1 + 1.69) / 2 with v_clip = bf16(0.7) = 0.69921875 -> (0.69921875 - 2)^2 = 1.692032
        _close(out, 0.5 * (1.0 + (2.0 - 0.69921875) ** 2) / 2, atol=1e-6)


class TestPolicyStats:
    def test_hand_case(self):
        # log-ratios [ln 2, 0, -ln 2] (+ a masked 5) -> ratios [2, 1, 0.5]
        # mean 3.5/3 = 1.1667, max 2, min 0.5
        # k3 = (r - 1) - ln r: [1 - ln2, 0, -0.5 + ln2] -> sum 0.5 -> mean 0.5/3 = 0.1667
        # clipped (|r - 1| > 0.2): 2 of 3
        s = ppo_policy_stats(torch.tensor([[LN2, 0.0, -LN2, 5.0]]), torch.zeros(1, 4), torch.tensor([[1, 1, 1, 0]]))
        _close(s.ratio_mean, 3.5 / 3)
        _close(s.ratio_max, 2.0)
        _close(s.ratio_min, 0.5)
        _close(s.approx_kl, 0.5 / 3)
        _close(s.clip_frac, 2 / 3)
        # Masked tokens stay out of max/min: ratios [2, 4] plus a masked token (ratio 1 if it
        # leaked in as exp(0), e^5 = 148.4 if unmasked) -> min 2, max 4.
        s = ppo_policy_stats(torch.tensor([[LN2, 2 * LN2, 5.0]]), torch.zeros(1, 3), torch.tensor([[1, 1, 0]]))
        _close(s.ratio_min, 2.0)
        _close(s.ratio_max, 4.0)
        s = ppo_policy_stats(torch.tensor([[-LN2, -2 * LN2, 5.0]]), torch.zeros(1, 3), torch.tensor([[1, 1, 0]]))
        _close(s.ratio_max, 0.5)  # not 1 (a leaked masked token)
        _close(s.ratio_min, 0.25)
        # cliprange 0.6: only |2 - 1| = 1 exceeds it -> 1/3
        s = ppo_policy_stats(torch.tensor([[LN2, 0.0, -LN2]]), torch.zeros(1, 3), torch.ones(1, 3), cliprange=0.6)
        _close(s.clip_frac, 1 / 3)
        # Clip-higher: ratios [2, 1, 0.5] in [1 - 0.2, 1 + 1.5] -> only 0.5 is outside: 1/3; with
        # cliprange_high 0.5, 2 is outside too: 2/3.
        s = ppo_policy_stats(torch.tensor([[LN2, 0.0, -LN2]]), torch.zeros(1, 3), torch.ones(1, 3), cliprange=0.2,
                             cliprange_high=1.5)
        _close(s.clip_frac, 1 / 3)
        s = ppo_policy_stats(torch.tensor([[LN2, 0.0, -LN2]]), torch.zeros(1, 3), torch.ones(1, 3), cliprange=0.2,
                             cliprange_high=0.5)
        _close(s.clip_frac, 2 / 3)
        # GSPO (level "sequence"): the clip tests each answer's exp(mean log-ratio). Answer 0: log-ratios
        # [ln 2, 0, -ln 2] -> s = 1, inside; answer 1: [ln 2, ln 2, (masked 5)] -> s = 2, outside for its 2
        # tokens. Token-weighted: 2 of 5; the ratio statistics stay the tokens'.
        s = ppo_policy_stats(torch.tensor([[LN2, 0.0, -LN2], [LN2, LN2, 5.0]]), torch.zeros(2, 3),
                             torch.tensor([[1, 1, 1], [1, 1, 0]]), cliprange=0.2, level="sequence")
        _close(s.clip_frac, 2 / 5)
        _close(s.ratio_mean, (3.5 + 4.0) / 5)


class TestExplainedVariance:
    def test_hand_cases(self):
        returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
        mask = torch.tensor([[1, 1, 1, 1, 0]])
        _close(explained_variance(returns.clone(), returns, mask), 1.0)  # perfect critic
        _close(explained_variance(torch.full_like(returns, 2.0), returns, mask), 0.0)  # constant
        # values [1, 2, 3, 5]: residual [0, 0, 0, -1], var = 0.25 - 0.0625 = 0.1875
        # var(returns) = 7.5 - 6.25 = 1.25 -> 1 - 0.1875 / 1.25 = 0.85
        values = torch.tensor([[1.0, 2.0, 3.0, 5.0, -99.0]])
        _close(explained_variance(values, returns, mask), 0.85)
        assert torch.isnan(explained_variance(values, torch.ones_like(returns), mask))


class TestRewardModelIndices:
    def test_reward_end_indices(self):
        mask = torch.tensor(
            [
                [1, 1, 1, 1, 0, 0],  # right-padded: last real index 3
                [1, 1, 1, 1, 1, 1],  # full: 5
                [0, 1, 1, 0, 0, 0],  # masked BOS (OPT step-3 style): 2
                [0, 0, 0, 0, 0, 0],  # empty: 0
            ]
        )
        _close(reward_end_indices(mask), [3, 5, 2, 0])

    def test_opt_style_upstream_vs_mask(self):
        # OPT: pad == eos == bos == 2, BOS at index 0, num_padding_at_beginning = 1.
        pad = 2
        ids = torch.tensor(
            [
                [2, 11, 12, 13, 14, 2, 2],  # pads at 0, 5, 6 -> pads[1] = 5 -> c_ind 5, score at 4
                [2, 11, 12, 15, 2, 2, 2],  # pads at 0, 4, 5, 6 -> c_ind 4, score at 3
                [2, 11, 12, 13, 14, 15, 16],  # only the BOS pad -> c_ind = L = 7, score at 6
                [2, 11, 12, 2, 14, 2, 2],  # an EOS inside the text: pads 0, 3, 5, 6 -> c_ind 3 (!)
            ]
        )
        # Tokenizer attention masks (the BOS and the inner EOS are real tokens):
        mask = torch.tensor(
            [
                [1, 1, 1, 1, 1, 0, 0],  # last real 4 -> end 5, same as upstream
                [1, 1, 1, 1, 0, 0, 0],  # last real 3 -> end 4, same
                [1, 1, 1, 1, 1, 1, 1],  # last real 6 -> end 7, same
                [1, 1, 1, 1, 1, 0, 0],  # last real 4 -> end 5; upstream stops at the inner EOS (3)
            ]
        )
        _close(upstream_end_indices(ids, pad, num_padding_at_beginning=1), [5, 4, 7, 3])
        _close(reward_end_indices(mask) + 1, [5, 4, 7, 5])
        # Without the BOS skip (num_padding_at_beginning = 0) every row ends at the BOS: c_ind 0,
        # and upstream reads the score at index -1, i.e. the last (pad) position.
        _close(upstream_end_indices(ids, pad, num_padding_at_beginning=0), [0, 0, 0, 0])

    def test_opt_without_bos_skip_reads_the_last_position(self):
        # Same OPT pair scored with num_padding_at_beginning = 0: c_ind = r_ind = 0, so upstream
        # reads chosen_reward[-1] / rejected_reward[-1] (index 6, a pad slot) and the span
        # [divergence 3, end max(0, 0) = 0) is empty -> nan loss. Hence the flag for OPT.
        chosen_ids = torch.tensor([[2, 11, 12, 13, 14, 2, 2]])
        rejected_ids = torch.tensor([[2, 11, 12, 15, 2, 2, 2]])
        values = torch.arange(7, dtype=torch.float32)[None, :]  # value at index i is i
        ends = upstream_end_indices(chosen_ids, 2, 0), upstream_end_indices(rejected_ids, 2, 0)
        out = pairwise_reward_loss(values, -values, chosen_ids, rejected_ids, *ends)
        _close(out.chosen_end_scores, [6.0])
        _close(out.rejected_end_scores, [-6.0])
        assert torch.isnan(out.loss)


def _ln1pexp(x: float) -> float:
    """-logsigmoid(x) = log(1 + exp(-x))."""
    return math.log1p(math.exp(-x))


class TestPairwiseLossHand:
    def test_plain_and_identical_pairs(self):
        # pad = 0, L = 5.
        # pair 0: chosen [5 6 7 0 0] (c_ind 3), rejected [5 6 8 9 0] (r_ind 4)
        #   divergence = 2, end = max(3, 4) = 4 -> span [2, 4)
        #   c - r = [1 - 0, 2 - 2] = [1, 0] -> (ln(1 + e^-1) + ln 2) / 2 = (0.313262 + 0.693147) / 2 = 0.503204
        #   end scores: chosen[c_ind - 1 = 2] = 1.0, rejected[r_ind - 1 = 3] = 2.0
        # pair 1: identical [5 6 0 0 0] -> end = L = 5, divergence = L - 1 = 4 -> span [4, 5)
        #   c - r at 4 = 3 - 1 = 2 -> ln(1 + e^-2) = 0.126928
        #   end scores at c_ind - 1 = 1 for both sides: 0.25 and -0.25
        # loss = (0.503204 + 0.126928) / 2 = 0.315066
        chosen_ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 0, 0, 0]])
        rejected_ids = torch.tensor([[5, 6, 8, 9, 0], [5, 6, 0, 0, 0]])
        chosen_values = torch.tensor([[9.0, 9.0, 1.0, 2.0, 9.0], [0.0, 0.25, 0.0, 0.0, 3.0]])
        rejected_values = torch.tensor([[-9.0, -9.0, 0.0, 2.0, -9.0], [0.0, -0.25, 0.0, 0.0, 1.0]])
        c_end = upstream_end_indices(chosen_ids, 0)
        r_end = upstream_end_indices(rejected_ids, 0)
        _close(c_end, [3, 2])
        _close(r_end, [4, 2])
        out = pairwise_reward_loss(chosen_values, rejected_values, chosen_ids, rejected_ids, c_end, r_end)
        pair0 = (_ln1pexp(1.0) + LN2) / 2
        pair1 = _ln1pexp(2.0)
        _close(out.loss, (pair0 + pair1) / 2)
        _close(out.chosen_end_scores, [1.0, 0.25])
        _close(out.rejected_end_scores, [2.0, -0.25])
        # An identical pair reads the rejected score at the *chosen* end (upstream: r_ind = c_ind),
        # even if the rejected end passed in says otherwise (here 4 -> it would read -> 0.0).
        out = pairwise_reward_loss(
            chosen_values, rejected_values, chosen_ids, rejected_ids, c_end, torch.tensor([4, 4])
        )
        _close(out.rejected_end_scores, [2.0, -0.25])
        _close(out.loss, (pair0 + pair1) / 2)

    def test_opt_style_pair(self):
        # pad = eos = bos = 2, num_padding_at_beginning = 1.
        # chosen   [2 11 12 13 14 2 2]: c_ind 5;  rejected [2 11 12 15 2 2 2]: r_ind 4
        # divergence 3 (13 vs 15), end 5 -> span [3, 5): c - r = [1 - 0, 2 - 3] = [1, -1]
        #   -> (ln(1 + e^-1) + ln(1 + e^1)) / 2 = (0.313262 + 1.313262) / 2 = 0.813262
        # end scores: chosen[4] = 2.0, rejected[3] = 0.0. The mask-derived ends give the same.
        chosen_ids = torch.tensor([[2, 11, 12, 13, 14, 2, 2]])
        rejected_ids = torch.tensor([[2, 11, 12, 15, 2, 2, 2]])
        chosen_values = torch.tensor([[5.0, 5.0, 5.0, 1.0, 2.0, 5.0, 5.0]])
        rejected_values = torch.tensor([[-5.0, -5.0, -5.0, 0.0, 3.0, -5.0, -5.0]])
        up = (upstream_end_indices(chosen_ids, 2, 1), upstream_end_indices(rejected_ids, 2, 1))
        from_mask = (
            reward_end_indices(torch.tensor([[1, 1, 1, 1, 1, 0, 0]])) + 1,
            reward_end_indices(torch.tensor([[1, 1, 1, 1, 0, 0, 0]])) + 1,
        )
        for c_end, r_end in (up, from_mask):
            out = pairwise_reward_loss(chosen_values, rejected_values, chosen_ids, rejected_ids, c_end, r_end)
            _close(out.loss, (_ln1pexp(1.0) + _ln1pexp(-1.0)) / 2)
            _close(out.chosen_end_scores, [2.0])
            _close(out.rejected_end_scores, [0.0])

    def test_divergence_at_zero_is_rejected(self):
        ids_c, ids_r = torch.tensor([[1, 2, 0]]), torch.tensor([[3, 2, 0]])
        with pytest.raises(ValueError, match="position 0"):
            ends = torch.tensor([2])
            pairwise_reward_loss(torch.zeros(1, 3), torch.zeros(1, 3), ids_c, ids_r, ends, ends)

    def test_empty_span_is_nan_like_upstream(self):
        # Ids differ only after both ends (pad 0): c_ind = r_ind = 2, divergence 3 -> span [3, 2)
        # is empty and upstream's mean over it is nan.
        ids_c, ids_r = torch.tensor([[5, 6, 0, 7]]), torch.tensor([[5, 6, 0, 8]])
        ends = upstream_end_indices(ids_c, 0)
        out = pairwise_reward_loss(torch.zeros(1, 4), torch.zeros(1, 4), ids_c, ids_r, ends, ends)
        assert torch.isnan(out.loss)
        assert torch.isnan(_upstream_pairwise_loop(torch.zeros(1, 4), torch.zeros(1, 4), ids_c, ids_r, 0, 0)[0])

    def test_compute_fp32_loss(self):
        ids_c, ids_r = torch.tensor([[5, 6, 0]]), torch.tensor([[5, 7, 0]])
        ends = torch.tensor([2])
        vals = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.bfloat16)
        assert pairwise_reward_loss(vals, -vals, ids_c, ids_r, ends, ends).loss.dtype == torch.bfloat16
        out = pairwise_reward_loss(vals, -vals, ids_c, ids_r, ends, ends, compute_fp32_loss=True)
        assert out.loss.dtype == torch.float32
        _close(out.loss, _ln1pexp(2.0))  # span [1, 2): c - r = 1 - (-1) = 2


class TestDPO:
    def test_sequence_log_probs(self):
        # V = 2, L = 3. Position 0 logits [0, ln 3] -> p = [1/4, 3/4]; position 1 [ln 3, 0] -> [3/4, 1/4].
        # labels [x, 1, 0]: shifted labels [1, 0] -> ln(3/4) + ln(3/4) = -0.575364
        # with mask [1, 1, 0] only the first shifted token counts: ln(3/4) = -0.287682
        ln3 = math.log(3.0)
        logits = torch.tensor([[[0.0, ln3], [ln3, 0.0], [0.0, 0.0]]]).repeat(3, 1, 1)
        # -100 or an out-of-vocab id under a zero mask is never gathered (upstream: labels * mask)
        labels = torch.tensor([[7, 1, 0], [7, 1, -100], [7, 1, 99]])
        mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
        expected = [2 * math.log(0.75), math.log(0.75), math.log(0.75)]
        _close(sequence_log_probs(logits, labels, mask), expected)

    def test_label_mask(self):
        # pad 0, B = 2, rows [chosen0, chosen1, rejected0, rejected1]
        # pair 0 diverges at 2 -> both rows masked before 2 and at pads
        # pair 1 identical -> divergence 0 (upstream's DPO convention): only pads masked
        ids = torch.tensor([[7, 8, 9, 0], [7, 8, 0, 0], [7, 8, 5, 6], [7, 8, 0, 0]])
        _close(dpo_label_mask(ids, 0), [[0, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0]])

    def test_loss_with_label_smoothing(self):
        # pi_c - ref_c = -10 - (-12) = 2, pi_r - ref_r = -20 - (-17) = -3
        # logits = 0.1 * (2 - (-3)) = 0.5
        # eps = 0:   -logsigmoid(0.5) = ln(1 + e^-0.5) = 0.474077
        # eps = 0.1: 0.9 * 0.474077 + 0.1 * ln(1 + e^0.5) = 0.9 * 0.474077 + 0.1 * 0.974077 = 0.524077
        # rewards: chosen 0.1 * 2 = 0.2, rejected 0.1 * -3 = -0.3
        args = (torch.tensor([-10.0]), torch.tensor([-20.0]), torch.tensor([-12.0]), torch.tensor([-17.0]))
        out = dpo_loss(*args)
        _close(out.losses, [_ln1pexp(0.5)])
        _close(out.chosen_rewards, [0.2])
        _close(out.rejected_rewards, [-0.3])
        smoothed = dpo_loss(*args, label_smoothing=0.1)
        _close(smoothed.losses, [0.9 * _ln1pexp(0.5) + 0.1 * _ln1pexp(-0.5)])
        # beta = 0.5: logits = 2.5 -> ln(1 + e^-2.5) = 0.078889
        _close(dpo_loss(*args, beta=0.5).losses, [_ln1pexp(2.5)])


# =============================================================================================
# 2. Vectorised code against slow references that mirror upstream's loops
# =============================================================================================
def _random_rollout(seed: int, B: int = 16):
    """Left-padded prompts of width P, answers of n in [0, A] contiguous tokens, right-padded."""
    g = torch.Generator().manual_seed(seed)
    P = int(torch.randint(2, 6, (1,), generator=g))
    A = int(torch.randint(1, 9, (1,), generator=g))
    L = P + A
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        p = int(torch.randint(1, P + 1, (1,), generator=g))
        n = A if b % 4 == 0 else int(torch.randint(0, A + 1, (1,), generator=g))  # some full-length
        attention_mask[b, P - p : P] = 1
        attention_mask[b, P : P + n] = 1
    T = L - 1
    log_probs = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref_log_probs = torch.randn(B, T, generator=g, dtype=torch.float64)
    scores = torch.randn(B, generator=g, dtype=torch.float64) * 6  # some beyond +-5
    prompts = torch.zeros(B, P, dtype=torch.long)
    return prompts, log_probs, ref_log_probs, scores, attention_mask[:, 1:]


@pytest.mark.parametrize("seed", range(5))
def test_compute_rewards_matches_upstream_loop(seed):
    prompts, lp, ref, scores, am = _random_rollout(seed)
    # Upstream's DeepSpeedPPOTrainer.compute_rewards and train_rlhf zeroing, line by line.
    kl_ctl, clip = 0.1, 5
    expected = -kl_ctl * (lp - ref)
    start = prompts.shape[1] - 1
    ends = start + am[:, start:].sum(1) + 1
    reward_clip = torch.clamp(scores, -clip, clip)
    for j in range(lp.shape[0]):
        expected[j, start : ends[j]][-1] += reward_clip[j]
    torch.testing.assert_close(compute_rewards(prompts, lp, ref, scores, am), expected, rtol=0, atol=0)
    for i in range(expected.shape[0]):
        expected[i, ends[i] :] = 0
    got_ends = sequence_end_indices(am, start)
    assert got_ends.tolist() == ends.tolist()
    zeroed = mask_after_ends(compute_rewards(prompts, lp, ref, scores, am), got_ends)
    torch.testing.assert_close(zeroed, expected, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(5))
def test_compute_rewards_last_and_k3_match_python_loop(seed):
    prompts, lp, ref, scores, am = _random_rollout(seed)
    start = prompts.shape[1] - 1
    B, T = lp.shape
    expected = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            d = float(lp[b, t] - ref[b, t])
            expected[b, t] = -0.3 * (math.exp(-d) - 1 + d)
        n = int(am[b, start:].sum())
        expected[b, max(start + n - 1, start)] += max(-2.0, min(2.0, float(scores[b])))
    got = compute_rewards(
        prompts, lp, ref, scores, am, kl_ctl=0.3, clip_reward_value=2.0, kl_estimator="k3", reward_at="last"
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def _gae_python(values: list[list[float]], rewards: list[list[float]], start: int, gamma: float, lam: float):
    advantages, returns = [], []
    for v, r in zip(values, rewards):
        T = len(r)
        adv = [0.0] * T
        running = 0.0
        for t in range(T - 1, start - 1, -1):
            next_v = v[t + 1] if t + 1 < T else 0.0
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            adv[t] = running
        advantages.append(adv[start:])
        returns.append([a + vv for a, vv in zip(adv[start:], v[start:])])
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(6))
def test_gae_matches_python_loop(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B, T = 5, int(torch.randint(2, 12, (1,), generator=g))
    start = int(torch.randint(0, T, (1,), generator=g))
    gamma, lam = [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0), (0.9, 0.8), (0.0, 0.95)][seed]
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = get_advantages_and_returns(values, rewards, start, gamma=gamma, lam=lam)
    exp_adv, exp_ret = _gae_python(values.tolist(), rewards.tolist(), start, gamma, lam)
    assert adv.shape == (B, T - start)
    torch.testing.assert_close(adv, exp_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, exp_ret, rtol=0, atol=1e-12)


def _upstream_pairwise_loop(chosen_values, rejected_values, chosen_ids, rejected_ids, pad_id, npb):
    """Upstream's RewardModel.forward loss loop, transcribed (ids-based ends)."""
    bs, seq_len = chosen_ids.shape
    loss = 0.0
    c_scores, r_scores = [], []
    for i in range(bs):
        chosen_id, rejected_id = chosen_ids[i], rejected_ids[i]
        chosen_reward, rejected_reward = chosen_values[i], rejected_values[i]
        c_inds = (chosen_id == pad_id).nonzero()
        c_ind = c_inds[npb].item() if len(c_inds) > npb else seq_len
        check_divergence = (chosen_id != rejected_id).nonzero()
        if len(check_divergence) == 0:
            end_ind = rejected_reward.size(-1)
            divergence_ind = end_ind - 1
            r_ind = c_ind
        else:
            r_inds = (rejected_id == pad_id).nonzero()
            r_ind = r_inds[npb].item() if len(r_inds) > npb else seq_len
            end_ind = max(c_ind, r_ind)
            divergence_ind = check_divergence[0]
        assert divergence_ind > 0
        c_trunc = chosen_reward[divergence_ind:end_ind]
        r_trunc = rejected_reward[divergence_ind:end_ind]
        c_scores.append(chosen_reward[c_ind - 1])
        r_scores.append(rejected_reward[r_ind - 1])
        loss += -F.logsigmoid(c_trunc - r_trunc).mean()
    return loss / bs, torch.stack(c_scores), torch.stack(r_scores)


def _random_pairs(seed: int, B: int = 24, L: int = 14, opt_style: bool = False):
    """Pairs sharing a prompt; some identical, some where one answer extends the other."""
    g = torch.Generator().manual_seed(seed)
    pad = 2 if opt_style else 0

    def tokens(k: int) -> list[int]:
        return (torch.randint(3, 12, (k,), generator=g)).tolist()

    chosen, rejected = [], []
    for b in range(B):
        prefix = ([pad] if opt_style else []) + tokens(int(torch.randint(1, 4, (1,), generator=g)))
        room = L - len(prefix)
        c = tokens(int(torch.randint(1, room + 1, (1,), generator=g)))
        kind = b % 4
        if kind == 0:
            r = list(c)  # identical pair
        elif kind == 1:
            r = c + tokens(max(0, min(2, room - len(c))))  # rejected extends chosen (maybe equal)
        else:
            r = tokens(int(torch.randint(1, room + 1, (1,), generator=g)))
        chosen.append((prefix + c + [pad] * L)[:L])
        rejected.append((prefix + r + [pad] * L)[:L])
    chosen_ids, rejected_ids = torch.tensor(chosen), torch.tensor(rejected)
    chosen_values = torch.randn(B, L, generator=g, dtype=torch.float64) * 3
    rejected_values = torch.randn(B, L, generator=g, dtype=torch.float64) * 3
    return chosen_values, rejected_values, chosen_ids, rejected_ids, pad


def test_pairwise_read_ends_by_hand():
    # Pairs of 6 columns: chosen ends 5 / rejected 3 (the longer end, 5); 2 / 4 (4); identical (the row end, 6).
    chosen = torch.tensor([[1, 2, 3, 4, 5, 0], [1, 2, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0]])
    rejected = torch.tensor([[1, 2, 9, 0, 0, 0], [1, 7, 8, 9, 0, 0], [1, 2, 3, 0, 0, 0]])
    ends = pairwise_read_ends(chosen, rejected, torch.tensor([5, 2, 3]), torch.tensor([3, 4, 3]))
    assert ends.tolist() == [5, 4, 6]
    from dschat.rl_math.preference import identical_pairs

    assert identical_pairs(chosen, rejected).tolist() == [False, False, True]


@pytest.mark.parametrize("seed, opt_style", [(s, o) for s in range(4) for o in (False, True)])
def test_pairwise_loss_matches_upstream_loop(seed, opt_style):
    cv, rv, cid, rid, pad = _random_pairs(seed, opt_style=opt_style)
    npb = 1 if opt_style else 0
    cv_loop, rv_loop = cv.clone().requires_grad_(), rv.clone().requires_grad_()
    exp_loss, exp_c, exp_r = _upstream_pairwise_loop(cv_loop, rv_loop, cid, rid, pad, npb)
    exp_loss.backward()

    cv_vec, rv_vec = cv.clone().requires_grad_(), rv.clone().requires_grad_()
    out = pairwise_reward_loss(
        cv_vec, rv_vec, cid, rid, upstream_end_indices(cid, pad, npb), upstream_end_indices(rid, pad, npb)
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, exp_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.chosen_end_scores, exp_c, rtol=0, atol=0)
    torch.testing.assert_close(out.rejected_end_scores, exp_r, rtol=0, atol=0)
    torch.testing.assert_close(cv_vec.grad, cv_loop.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(rv_vec.grad, rv_loop.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_upstream_end_indices_match_nonzero_rule(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (20, 9), generator=g)  # many pads (id 0) in random places
    for npb in (0, 1, 2):
        expected = []
        for row in ids:
            inds = (row == 0).nonzero()
            expected.append(inds[npb].item() if len(inds) > npb else ids.shape[1])
        assert upstream_end_indices(ids, 0, npb).tolist() == expected


def test_sequence_log_probs_matches_upstream_get_batch_logps():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 6, 9, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 9, (4, 6), generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).long()
    # upstream get_batch_logps, transcribed
    labels = (ids.clone() * mask)[:, 1:]
    per_token = torch.gather(logits[:, :-1].log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    expected = (per_token * mask[:, 1:]).sum(-1)
    torch.testing.assert_close(sequence_log_probs(logits, ids, mask), expected, rtol=0, atol=1e-12)


# =============================================================================================
# 3. Invariances
# =============================================================================================
def _ppo_batch(seed: int, B: int = 8, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # lengths 1..T, so micro-means differ
    new = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return new, old, adv, mask


@pytest.mark.parametrize("seed", range(3))
def test_actor_loss_micro_batches_sum_to_full_batch(seed):
    new, old, adv, mask = _ppo_batch(seed)
    full_new = new.clone().requires_grad_()
    full = actor_loss_fn(full_new, old, adv, mask)  # 8 x 1: upstream's per-batch token mean
    full.backward()

    total = mask.sum()
    micro_new = new.clone().requires_grad_()
    micro_losses = [
        actor_loss_fn(micro_new[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], normalizer=total)
        for i in range(8)
    ]  # 1 x 8
    accumulated = torch.stack(micro_losses).sum()
    accumulated.backward()
    torch.testing.assert_close(accumulated, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(micro_new.grad, full_new.grad, rtol=0, atol=1e-12)
    # Without the normalizer, averaging per-micro-batch means weights short rows up: not equal.
    naive = torch.stack(
        [actor_loss_fn(new[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1]) for i in range(8)]
    ).mean()
    assert not torch.allclose(naive, full.detach())


@pytest.mark.parametrize("seed", range(3))
def test_critic_loss_micro_batches_sum_to_full_batch(seed):
    values, old_values, returns, mask = _ppo_batch(seed)
    full = critic_loss_fn(values, old_values, returns, mask, cliprange_value=0.1)
    total = mask.sum()

    def micro(i: int, **kwargs) -> torch.Tensor:
        rows = slice(i, i + 1)
        return critic_loss_fn(
            values[rows], old_values[rows], returns[rows], mask[rows], cliprange_value=0.1, **kwargs
        )

    accumulated = sum(micro(i, normalizer=total) for i in range(8))
    torch.testing.assert_close(accumulated, full, rtol=0, atol=1e-12)
    naive = sum(micro(i) for i in range(8)) / 8
    assert not torch.allclose(naive, full)


def test_masked_whiten_zero_mean_unit_variance_over_mask():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 10, generator=g, dtype=torch.float64) * 3 + 5
    mask = torch.rand(6, 10, generator=g) > 0.4
    x = torch.where(mask, x, torch.full_like(x, 1e6))  # garbage outside the mask must not count
    kept = masked_whiten(x, mask)[mask]
    assert abs(float(kept.mean())) < 1e-9
    assert float(kept.var()) == pytest.approx(1.0, abs=1e-6)  # torch.var: unbiased, eps = 1e-8
    unshifted = masked_whiten(x, mask, shift_mean=False)[mask]
    assert float(unshifted.mean()) == pytest.approx(float(x[mask].mean()), abs=1e-9)
    assert float(unshifted.var()) == pytest.approx(1.0, abs=1e-6)


def test_whitening_and_explained_variance_of_one_tensor_do_not_cancel_in_float32():
    # A mean large beside the spread: E[x^2] - mean^2 in float32 loses the variance (whitened std 0.09
    # instead of 1); the two-pass statistics keep it. An empty mask is nan, not a scaled-up x.
    g = torch.Generator().manual_seed(7)
    x = 1000 + 0.01 * torch.randn(4, 64, generator=g)
    mask = torch.ones_like(x, dtype=torch.bool)
    assert float(masked_whiten(x, mask).std()) == pytest.approx(1.0, abs=1e-3)
    returns = 1000 + 0.01 * torch.randn(4, 64, generator=g)
    values = returns + 0.001 * torch.randn(4, 64, generator=g)
    expected = 1 - float((returns - values).double().var(unbiased=False) / returns.double().var(unbiased=False))
    assert float(explained_variance(values, returns, mask)) == pytest.approx(expected, abs=1e-3)
    empty = torch.zeros_like(mask)
    assert torch.isnan(masked_whiten(x, empty)).all()
    assert torch.isnan(explained_variance(values, returns, empty))


def test_moments_of_micro_batches_give_the_statistics_of_the_whole_rollout():
    # The trainer whitens and scores a rollout of micro-batches of different widths (two generation
    # batches), on several ranks, from Moments added up over them: the same as over the whole batch.
    g = torch.Generator().manual_seed(5)
    parts = [(torch.randn(3, w, generator=g, dtype=torch.float64), torch.rand(3, w, generator=g) > 0.3)
             for w in (7, 4)]
    values = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x, _ in parts]
    flat_x = torch.cat([x[m] for x, m in parts])
    flat_v = torch.cat([v[m] for v, (_, m) in zip(values, parts)])
    ones = torch.ones_like(flat_x, dtype=torch.bool)
    moments = Moments(0.0, 0.0, 0.0)
    for x, mask in parts:
        moments = moments.plus(Moments.of(x, mask))
    assert moments.count == ones.sum() and moments.mean == pytest.approx(float(flat_x.mean()), abs=1e-12)
    assert moments.var() == pytest.approx(float(flat_x.var()), abs=1e-12)  # unbiased
    whole = masked_whiten(flat_x, ones)
    split = torch.cat([masked_whiten(x, m, moments=moments)[m] for x, m in parts])
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)
    # The trainer's formula before it used masked_whiten, bit for bit.
    mean = moments.total / max(moments.count, 1.0)
    var = max(moments.total_sq / max(moments.count, 1.0) - mean ** 2, 0.0) * moments.count / max(moments.count - 1.0, 1.0)
    x, m = parts[0]
    assert torch.equal(masked_whiten(x, m, moments=moments), (x - mean) * (var + 1e-8) ** -0.5)
    # Explained variance from the returns' and residuals' moments == over the concatenated tokens.
    residual = Moments(0.0, 0.0, 0.0)
    for (x, mask), v in zip(parts, values):
        residual = residual.plus(Moments.of(x - v, mask))
    expected = 1.0 - float((flat_x - flat_v).var(unbiased=False)) / float(flat_x.var(unbiased=False))
    assert explained_variance_from_moments(moments, residual) == pytest.approx(expected, abs=1e-12)
    assert float(explained_variance(flat_v, flat_x, ones)) == pytest.approx(expected, abs=1e-6)  # float32
    assert math.isnan(explained_variance_from_moments(Moments(0.0, 0.0, 0.0), residual))


def test_moments_of_float32_values_with_a_small_spread_keep_their_variance():
    # 4096 float32 values 5 + 0.01 * (+-1): variance 1e-4 (to float32's rounding of 5.01). Summed in
    # float32, E[x^2] - mean^2 lost about 1 % of it; the moments are summed in float64.
    x = (5.0 + 0.01 * torch.tensor([1.0, -1.0]).repeat(2048)).float().view(64, 64)
    mask = torch.ones_like(x, dtype=torch.bool)
    exact = float(x.double().var(unbiased=False))
    assert exact == pytest.approx(1e-4, rel=1e-3)
    assert Moments.of(x, mask).var(unbiased=False) == pytest.approx(exact, rel=1e-6)


def test_causal_lm_loss_shifts_and_ignores_masked_labels():
    from dschat.rl_math.logprobs import causal_lm_loss

    # Vocabulary of 2, uniform logits except position 0 strongly predicts token 1.
    logits = torch.zeros(1, 3, 2)
    logits[0, 0] = torch.tensor([0.0, 10.0])
    labels = torch.tensor([[0, 1, -100]])
    # Shifted: position 0 predicts label 1 -> -log softmax([0, 10])[1] = log(1 + e^-10);
    # position 1 predicts -100 -> ignored. Mean over one token.
    expected = math.log(1 + math.exp(-10.0))
    assert causal_lm_loss(logits, labels).item() == pytest.approx(expected, abs=1e-6)  # fp32 rounding
    # The same loss HF models compute for labels=input_ids with -100 on padding.
    labels2 = torch.tensor([[0, 0, 1]])
    manual = (math.log(1 + math.exp(10.0)) + math.log(2.0)) / 2  # -log p(0|pos0), -log p(1|pos1)
    assert causal_lm_loss(logits, labels2).item() == pytest.approx(manual, rel=1e-5)


def test_missing_eos_penalty_by_hand():
    scores = torch.tensor([1.0, -0.5, 2.0])
    ended = torch.tensor([True, False, False])
    assert torch.equal(missing_eos_penalty(scores, ended, 1.5), torch.tensor([1.0, -2.0, 0.5]))
    assert missing_eos_penalty(scores, ended, 0.0) is scores  # off: untouched
