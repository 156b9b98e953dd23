"""Hand-computed values for RL math that the other tests left free: an asymmetric KL (which way round it is
taken), the defaults the callers rely on (the dynamic-sampling tolerance, GRPO's eps), and the logged
approximate KL and GSPO clip fraction."""
from __future__ import annotations

import math

import pytest
import torch

from dschat.rl_math.critic_free import grpo_advantages, informative_groups, sequence_kl
from dschat.rl_math.ppo import ppo_policy_stats

LN2 = math.log(2.0)


def test_the_sequence_kl_is_of_the_policy_to_the_reference_not_the_other_way():
    """logprobs [ln2, 0] against a reference of 0: k1 sums log(pi / ref) = ln2 (the other way round, -ln2);
    k3 sums (r - 1) - log r with r = ref / pi: 0.5 - 1 + ln2 (the other way round, 1 - ln2)."""
    logprobs, ref, mask = torch.tensor([[LN2, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    assert sequence_kl(logprobs, ref, mask).item() == pytest.approx(LN2)
    assert sequence_kl(logprobs, ref, mask, estimator="k3").item() == pytest.approx(0.5 - 1 + LN2)
    assert sequence_kl(logprobs, ref, torch.tensor([[0.0, 1.0]])).item() == 0.0  # only the answer's tokens


def test_rewards_more_than_a_ten_thousandth_apart_are_an_informative_group_by_default():
    assert informative_groups(torch.tensor([0.0, 5e-4, 0.0, 5e-5]), 2).tolist() == [True, False]


def test_grpo_divides_by_the_std_plus_one_millionth():
    """Rewards [0, 1e-3]: sample std 7.0711e-4, so A = +-0.5e-3 / (7.0711e-4 + 1e-6) = +-0.70611."""
    advantages = grpo_advantages(torch.tensor([0.0, 1e-3]), 2)
    expected = 0.5e-3 / (math.sqrt(0.5e-6) + 1e-6)
    assert advantages.tolist() == pytest.approx([-expected, expected], rel=1e-4)
    assert expected == pytest.approx(0.70611, rel=1e-4)


def test_the_logged_approximate_kl_and_the_sequence_clip_fraction_by_hand():
    """approx_kl is mean((r - 1) - log r): for log-ratios [ln2, 0], ((1 - ln2) + 0) / 2 (never below 0).
    GSPO's clip fraction tests exp(mean log-ratio over the answer's own tokens): 2 tokens of 0.3 in 4
    columns give e^0.3 = 1.35 > 1.2, every token clipped (over the 4 columns e^0.15 = 1.16 would not be)."""
    stats = ppo_policy_stats(torch.tensor([[LN2, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert stats.approx_kl.item() == pytest.approx((1 - LN2) / 2)
    log_ratio = torch.tensor([[0.3, 0.3, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    gspo = ppo_policy_stats(log_ratio, torch.zeros(1, 4), mask, level="sequence")
    assert gspo.clip_frac.item() == 1.0
    assert ppo_policy_stats(log_ratio, torch.zeros(1, 4), mask).clip_frac.item() == 1.0  # per token: 1.35 too
