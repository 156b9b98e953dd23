"""Step 3's formulas bound to the run's hyperparameters, under upstream's method names.

:class:`PPOFormulas` is the contract upstream's ``DeepSpeedPPOTrainer`` exposes for its math --
``compute_rewards``, ``get_advantages_and_returns``, ``actor_loss_fn``, ``critic_loss_fn`` -- plus
the critic-free algorithms' advantages and actor loss. The trainer
(:class:`~dschat.rlhf.ppo_trainer.DeepSpeedPPOTrainer`) is one, and hands itself to the parts it holds
(:class:`~dschat.rlhf.experience_maker.ExperienceMaker`, :class:`~dschat.rlhf.ppo_update.PPOUpdate`),
so a formula patched or a hyperparameter changed on the trainer is the one both parts use. The
formulas themselves are the pure functions of :mod:`dschat.rl_math.ppo` and :mod:`dschat.rl_math.critic_free`;
the hyperparameters come from the flags (upstream hard-coded them).
"""
from __future__ import annotations

import torch

from dschat.rl_math.critic_free import aggregate_loss, grpo_advantages, policy_loss_per_token, remax_advantages, returns_to_go, rloo_advantages, sequence_kl, tis_weights, token_advantages
from dschat.rl_math.ppo import actor_loss_fn, compute_rewards, critic_loss_fn, get_advantages_and_returns, kl_penalty, mask_after_ends, sequence_end_indices
from dschat.rlhf.config import AlgorithmSettings
from dschat.rlhf.config import PPOConfig
from dschat.rlhf.experience import Experience

__all__ = ["PPOFormulas"]


class PPOFormulas:
    """Rewards, advantages and losses with the hyperparameters of a :class:`PPOConfig` and the
    algorithm's :class:`AlgorithmSettings`, as plain attributes (upstream's names: code written
    against upstream may change them on the trainer)."""

    def init_formulas(self, config: PPOConfig, settings: AlgorithmSettings) -> None:
        """Set the hyperparameters (the trainer calls it first in ``__init__``)."""
        self.settings = settings
        self.kl_ctl = config.kl_ctl
        self.clip_reward_value = config.clip_reward_value
        self.gamma = config.gamma
        self.lam = config.lam
        self.kl_estimator = settings.kl_estimator
        self.reward_at = config.reward_at
        self.whiten_advantages = settings.whiten_advantages
        self.missing_eos_penalty = config.missing_eos_penalty
        self.cliprange = config.cliprange
        self.cliprange_value = config.cliprange_value
        self.compute_fp32_loss = config.compute_fp32_loss
        self.max_answer_seq_len = config.max_answer_seq_len

    # ---------------------------------------------------------------- rewards and GAE (upstream names)
    def compute_rewards(self, prompts: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                        reward_score: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        # With the KL as a loss term (GRPO's), the rewards hold the score alone.
        kl_ctl = self.kl_ctl if self.settings.kl_in_reward else 0.0
        return compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask,
                                       kl_ctl=kl_ctl, clip_reward_value=self.clip_reward_value,
                                       kl_estimator=self.kl_estimator, reward_at=self.reward_at)

    def get_advantages_and_returns(self, values: torch.Tensor, rewards: torch.Tensor, start: int,
                                   skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE (upstream's signature; ``skip`` (B, T): an episode's observation positions, passed over)."""
        return get_advantages_and_returns(values, rewards, start, gamma=self.gamma, lam=self.lam, skip=skip)

    def advantages_and_returns(self, exp: Experience, old_values: torch.Tensor, old_rewards: torch.Tensor, *,
                               critic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T - start) advantages and returns of one micro-batch: GAE with the ``critic``'s values,
        or without one the critic-free advantages (as both). An episode's observation positions are
        passed over."""
        if not critic:
            advantages = self._critic_free_advantages(exp, old_rewards)
            return advantages, advantages
        if exp.observation_mask is None:  # upstream's call, so a patched get_advantages_and_returns is used
            return self.get_advantages_and_returns(old_values, old_rewards, exp.start)
        return self.get_advantages_and_returns(old_values, old_rewards, exp.start, skip=exp.observation_mask.bool())

    def _old_values_and_rewards(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's zeroing after ``ends``: (old_values, old_rewards), both (B, T)."""
        return self._old_values(exp), self._old_rewards(exp)

    def _ends(self, exp: Experience) -> torch.Tensor:
        return sequence_end_indices(exp.action_mask, exp.start, reward_at=self.reward_at)

    def _old_values(self, exp: Experience) -> torch.Tensor:
        """The rollout's critic values, zeroed after ``ends`` (B, T): GAE's and the clipped value loss's."""
        return mask_after_ends(exp.values, self._ends(exp))

    def _old_rewards(self, exp: Experience) -> torch.Tensor:
        """The per-token rewards (:meth:`compute_rewards`), zeroed after ``ends`` (B, T)."""
        rewards = self.compute_rewards(exp.prompts, exp.logprobs, exp.ref_logprobs, exp.reward_score,
                                       exp.action_mask)
        if exp.observation_mask is not None:  # the environment's tokens carry no KL (the score is after them)
            rewards = rewards.masked_fill(exp.observation_mask.bool(), 0)
        return mask_after_ends(rewards, self._ends(exp))

    def _critic_free_advantages(self, exp: Experience, rewards: torch.Tensor) -> torch.Tensor:
        """(B, T - start) token advantages without a critic: REINFORCE++'s returns-to-go of the
        KL-penalised per-token rewards (whitened later, over the rollout), or each answer's sequence
        advantage on all of its tokens (GRPO, RLOO, ReMax)."""
        mask = exp.action_mask[:, exp.start:]
        if exp.sequence_advantages is None:  # REINFORCE++: rewards are upstream's, zeroed after the end
            skip = None if exp.observation_mask is None else exp.observation_mask.bool()
            return returns_to_go(rewards, exp.start, gamma=self.gamma, skip=skip) * mask
        return token_advantages(exp.sequence_advantages, mask)

    @property
    def kl_in_group_baseline(self) -> bool:
        """Whether :meth:`sequence_advantages` sums each answer's KL into its group's rewards (GRPO, RLOO,
        ReMax with the KL in the reward): it then reads the log-probs of answers dropped from the loss too."""
        return self.settings.algorithm in ("grpo", "rloo", "remax") and self.settings.kl_in_reward and bool(self.kl_ctl)

    def sequence_advantages(self, reward_score: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                            answer_mask: torch.Tensor, start: int,
                            greedy_scores: torch.Tensor | None) -> torch.Tensor | None:
        """(B,) advantages of GRPO / RLOO / ReMax from a whole generation batch (whole groups), or
        None for the algorithms whose advantages are per token (PPO, REINFORCE++). ``answer_mask``
        (B, T - 1) marks each answer's tokens, those of answers dropped from the loss included: with
        the KL in the reward, every answer's KL-penalised reward enters its group's statistics."""
        settings = self.settings
        if settings.algorithm not in ("grpo", "rloo", "remax"):
            return None
        scores = torch.clamp(reward_score.float(), -self.clip_reward_value, self.clip_reward_value)
        if self.kl_in_group_baseline:
            scores = scores - self.kl_ctl * sequence_kl(
                logprobs[:, start:], ref_logprobs[:, start:], answer_mask[:, start:], estimator=self.kl_estimator)
        if settings.algorithm == "grpo":
            return grpo_advantages(scores, settings.num_generations, scale_by_std=settings.scale_by_std)
        if settings.algorithm == "rloo":
            return rloo_advantages(scores, settings.num_generations)
        baseline = torch.clamp(greedy_scores.float(), -self.clip_reward_value, self.clip_reward_value)
        return remax_advantages(scores, baseline)

    # ---------------------------------------------------------------- the losses (upstream names)
    def actor_loss_fn(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
        return actor_loss_fn(logprobs, old_logprobs, advantages, mask, cliprange=self.cliprange,
                                     normalizer=normalizer)

    def critic_loss_fn(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
        return critic_loss_fn(values, old_values, returns, mask, cliprange_value=self.cliprange_value,
                                      compute_fp32_loss=self.compute_fp32_loss, normalizer=normalizer)

    def _actor_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    exp: Experience, normalizer: float | None, on_policy: bool) -> torch.Tensor:
        """The actor loss beyond upstream's PPO (rl_math.critic_free): the clipped surrogate per token
        (clip bounds [1 - cliprange, 1 + --cliprange_high], --dual_clip, the token or GSPO sequence ratio of
        --importance_sampling_level), times the truncated importance weights (--tis_cap), plus
        kl_ctl x KL when the KL is a loss term, aggregated by --loss_aggregation. Shapes: (B, T - start)."""
        start, settings = exp.start, self.settings
        mask = exp.action_mask[:, start:].to(logprobs.dtype)
        per_token = policy_loss_per_token(logprobs, old_logprobs, advantages, mask, cliprange=self.cliprange,
                                          cliprange_high=settings.cliprange_high, dual_clip=settings.dual_clip,
                                          level=settings.importance_sampling_level)
        if self.settings.tis_cap and on_policy:
            # pi_train(old) is the current forward (the policy has not moved): w = min(pi_train / pi_rollout, C).
            # Off-policy the ratio is already taken against the rollout's log-probs (nothing to add).
            per_token = per_token * tis_weights(logprobs, exp.logprobs[:, start:], self.settings.tis_cap)
        if not self.settings.kl_in_reward and self.kl_ctl:
            ref = exp.ref_logprobs[:, start:].float()
            # Outside the answer the KL is 0 before it is computed: the log-probs of padding after EOS can
            # be far apart, and k3's exp would overflow there (inf * 0 in the mask, a nan gradient).
            current = torch.where(mask.bool(), logprobs.float(), ref)
            kl = kl_penalty(current, ref, estimator=self.kl_estimator)
            per_token = per_token + self.kl_ctl * kl * mask
        return aggregate_loss(per_token, mask, self.settings.loss_aggregation, normalizer=normalizer,
                                            max_len=self.max_answer_seq_len)

    def policy_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    exp: Experience, normalizer: float | None, on_policy: bool) -> torch.Tensor:
        """The actor loss of one micro-step: upstream's :meth:`actor_loss_fn` for upstream's PPO,
        else the critic-free algorithms' (:meth:`_actor_loss`)."""
        if self.settings.upstream_ppo_loss:
            return self.actor_loss_fn(logprobs, old_logprobs, advantages, exp.action_mask[:, exp.start:], normalizer)
        return self._actor_loss(logprobs, old_logprobs, advantages, exp, normalizer, on_policy)
