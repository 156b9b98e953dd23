"""Experience making for step 3 (upstream's ``generate_experience`` half of ``ppo_trainer.py``):
generate a rollout batch, score it, and before the PPO update fill in every micro-batch's advantages
and returns.

:class:`ExperienceMaker` is the base class of :class:`~dschat.rlhf.ppo_trainer.DeepSpeedPPOTrainer`
(the PPO update, on the same engines and flags); upstream's method names stay on the trainer. What
changed against upstream, with the upstream bug each fixes:

* Experience passes run in **eval mode** (no dropout; upstream switched back to train mode first)
  with **position ids from the mask** (left padding; upstream passed none); log-probs from fp16/bf16 logits
  are computed in fp32 (``rl_math.gather_log_probs``), like the ones kept from generation, so the
  reference's and the rollout's agree to fp32 rounding (upstream's bf16 ``log_softmax``: ~0.07 nats).
* Masks come from generation: the answer is every token up to and including the first EOS, so the
  **EOS is an action** even when ``pad == eos`` (upstream's ``ids != pad`` masked it out).
* Answers of at most one token are **dropped by masking** (their rows stay, with a zero action
  mask), so ranks keep equal micro-batch counts; if every row on every rank is dropped the step is
  skipped (upstream asserted on the first step and otherwise re-trained the previous rollout:
  stale data that is off-policy once an optimizer step has happened).
* **Decoding** is configurable; the default samples from the policy (see the step-3 README).
* The rollout's **old log-probs come from generation** (the sampled tokens' log-probs under the
  sampling temperature, kept by :class:`~dschat.rlhf.hybrid_engine.RolloutGenerator`) instead of a
  second actor pass over the sequence; where the generator cannot keep them (Hybrid Engine) the
  actor pass runs as upstream's.
* Advantages are computed **once per rollout** (:meth:`ExperienceMaker.prepare_rollout`), so
  ``--whiten_advantages`` whitens with the statistics of the whole rollout (every micro-batch, every
  rank).
* **Beyond PPO** (``--algorithm``, :mod:`dschat.rlhf.algorithm`): GRPO, RLOO, REINFORCE++ and ReMax
  run without a critic engine (``critic_model`` is None). Their advantages come from
  :mod:`dschat.rl_algorithms`: per answer from a whole generation batch (groups of
  ``--num_generations`` consecutive rows) in :meth:`~ExperienceMaker.generate_experience`, or per
  token (REINFORCE++) in :meth:`~ExperienceMaker.prepare_rollout`. Rewards are a
  :class:`~dschat.rewards.RewardMix` of the reward model and ``--reward_fn`` functions. PPO's path is
  unchanged when none of this is asked for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from dschat import rl_algorithms, rl_math
from dschat.cli.args import step3_flag
from dschat.data.prompt_columns import PromptColumns
from dschat.errors import UserError
from dschat.models.packing import attention_span
from dschat.rewards import RewardFunction, RewardMix
from dschat.rlhf.algorithm import AlgorithmSettings, resolve_algorithm
from dschat.rlhf.decoding import Rollout
from dschat.rlhf.experience import Experience, sequence_masks
from dschat.rlhf.packed_passes import (pack_batch, resolve_sequence_packing, reward_end_scores, shifted_log_probs,
                                       token_log_probs, token_values)
from dschat.rlhf.zero3_gathers import ScoringGather
from dschat.runtime.dist import all_reduce_sum, get_rank, print_rank_0
from dschat.training.nonfinite import NonFiniteGuard

__all__ = ["RewardFn", "RolloutStats", "ExperienceMaker"]

#: A Python reward hook: scores decoded ``(prompts, answers)`` (lists of strings), one float each.
RewardFn = Callable[[list[str], list[str]], Sequence[float]]


@dataclass
class RolloutStats:
    """Rollout-level numbers over every rank (floats; ``nan`` when there is nothing to average)."""

    reward: float  # mean reward score of the kept answers
    kl_to_ref: float  # mean per-token (logp - ref_logp) over answer tokens
    response_length: float  # mean answer tokens (EOS included) of the kept answers
    value_explained_variance: float
    kept: int  # kept answers
    dropped: int  # answers of <= 1 token


class ExperienceMaker:
    """Generates and scores rollouts on the engines of a
    :class:`~dschat.rlhf.rlhf_engine.DeepSpeedRLHFEngine` (whose ``critic`` is None for the
    critic-free algorithms), and prepares each rollout for the update.

    The reward is ``reward_mix`` (:class:`~dschat.rewards.RewardMix`: reward model and ``--reward_fn``
    functions by weight); a bare ``reward_fn`` (a :data:`RewardFn`) replaces the reward model, as
    before. ``prompt_columns`` gives reward functions the dataset fields beside each prompt.
    """

    def __init__(self, rlhf_engine: Any, args: Any, *, reward_fn: RewardFn | None = None,
                 reward_mix: RewardMix | None = None, prompt_columns: PromptColumns | None = None) -> None:
        self.rlhf_engine = rlhf_engine
        self.actor_model = rlhf_engine.actor
        self.critic_model = rlhf_engine.critic
        self.ref_model = rlhf_engine.ref
        self.reward_model = rlhf_engine.reward
        self.generator = rlhf_engine.generator
        self.tokenizer = rlhf_engine.tokenizer
        self.args = args
        self.max_answer_seq_len = args.max_answer_seq_len
        # Upstream computed the id of the last piece of "<|endoftext|>" here and never used it; the
        # answer ends at the tokenizer's EOS, which is what generate() stops on.
        self.end_of_conversation_token_id = self.tokenizer.eos_token_id
        self.z3_enabled = args.actor_zero_stage == 3
        self.compute_fp32_loss = args.compute_fp32_loss
        self.dtype = rlhf_engine.dtype
        self.reward_fn = reward_fn
        if reward_mix is None:
            reward_mix = (RewardMix((RewardFunction("reward_fn", reward_fn, require_finite=False),), model_weight=0.0)
                          if reward_fn is not None else RewardMix())
        self.reward_mix = reward_mix
        self.prompt_columns = prompt_columns
        if reward_mix.uses_model and self.reward_model is None:
            raise ValueError("DeepSpeedPPOTrainer needs a reward model or a reward_fn")
        self.settings: AlgorithmSettings = resolve_algorithm(args)
        if self.settings.critic and self.critic_model is None:
            raise ValueError(f"--algorithm {self.settings.algorithm} needs a critic engine")

        # Upstream's constants, now flags; an upstream-style Namespace without them gets their defaults.
        self.kl_ctl = step3_flag(args, "kl_ctl")
        self.clip_reward_value = step3_flag(args, "clip_reward_value")
        self.gamma = step3_flag(args, "gamma")
        self.lam = step3_flag(args, "lam")
        self.kl_estimator = self.settings.kl_estimator
        self.reward_at = step3_flag(args, "reward_at")
        self.whiten_advantages = self.settings.whiten_advantages
        self.missing_eos_penalty = float(step3_flag(args, "missing_eos_penalty") or 0.0)
        self.logit_temperature = self.generator.decoding.logit_temperature
        # --sequence_packing: which models run their passes over a rollout on packed rows.
        self.packing = resolve_sequence_packing(str(step3_flag(args, "sequence_packing")), {
            "actor": self.actor_model, "reference": self.ref_model, "critic": self.critic_model,
            "reward": self.reward_model if self.reward_mix.uses_model else None})
        # The actor's shape weighs a packed layout's attention against the padding it saves (every
        # model scores the same packed rows).
        self.packing_span = attention_span(self.actor_model)
        # --zero3_gather_for_scoring: a ZeRO-3 model's scoring pass on its whole parameters, without hooks.
        self.scoring_gather = ScoringGather(str(step3_flag(args, "zero3_gather_for_scoring")))

        # Fast path, on by default: take the old log-probs from generation instead of a second
        # forward pass of the actor (benchmarks/step3.py turns it off for its baseline).
        self.reuse_rollout_logprobs = True
        self.generate_time = 0.0  # last generation call (upstream)
        self.experience_time = 0.0  # last experience forward passes
        # The actor's optimizer steps when the current rollout was prepared (the trainer's on-policy check).
        self._rollout_actor_steps: int | None = None
        # --max_nonfinite_steps: rollouts and micro-steps with NaN/inf are skipped, counted, logged;
        # step 3's main points ``last_checkpoint`` at its checkpoints for the stop message.
        self.nonfinite = NonFiniteGuard(int(step3_flag(args, "max_nonfinite_steps")), get_rank(), self.device)

    # ================================================================== generation + experience
    @property
    def device(self) -> torch.device:
        return next(self.actor_model.module.parameters()).device

    def _over_ranks(self, values: list[float]) -> list[float]:
        """``values`` summed over every rank, in float64 (one all-reduce; a collective)."""
        return all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def _generate_sequence(self, prompts: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
        """Generate answers (upstream's name; :meth:`_rollout` also returns their log-probs)."""
        return self._rollout(prompts, mask, step).sequences

    def _rollout(self, prompts: torch.Tensor, mask: torch.Tensor, step: int) -> Rollout:
        """Generate answers; print them with ``--print_answers`` (every rank, as upstream)."""
        rollout = self.generator.rollout(prompts, mask)
        seq = rollout.sequences
        if self.args.print_answers and step % self.args.print_answers_interval == 0:
            ans = seq[:, prompts.shape[1]:]
            rank = get_rank()
            print(f"--- prompt --> step={step}, rank={rank}, "
                  f"{self.tokenizer.batch_decode(prompts, skip_special_tokens=True)}")
            print(f"--- ans    --> step={step}, rank={rank}, "
                  f"{self.tokenizer.batch_decode(ans, skip_special_tokens=True)}")
        return rollout

    def _log_probs(self, logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """(B, L, V) logits -> (B, L - 1) log-probs of ``seq[:, 1:]`` under the sampling distribution."""
        return shifted_log_probs(logits, seq, temperature=self.logit_temperature, fp32=self.compute_fp32_loss)

    def _token_log_probs(self, name: str, model: Any, seq: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, packed: Any) -> torch.Tensor:
        """(B, L - 1) log-probs of ``seq[:, 1:]`` under ``model`` at the sampling temperature, on the
        batch's packed rows where the model ``name`` packs (:mod:`~dschat.rlhf.packed_passes`)."""
        return token_log_probs(model, seq, attention_mask, position_ids, self._layout_for(name, packed),
                               temperature=self.logit_temperature, fp32=self.compute_fp32_loss)

    def _token_values(self, seq: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      packed: Any) -> torch.Tensor:
        """(B, L) the critic's per-token values, on packed rows where the critic packs."""
        return token_values(self.critic_model, seq, attention_mask, position_ids, self._layout_for("critic", packed))

    @staticmethod
    def _logprobs_from_rollout(answer_logprobs: torch.Tensor, prompt_length: int,
                               attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, A') log-probs of the generated tokens -> the (B, L - 1) layout of :meth:`_log_probs`.

        Column ``t`` scores ``seq[:, t + 1]``, so the answer's columns start at ``P - 1``. Prompt
        columns are 0 (every consumer slices from ``Experience.start``). Columns after EOS keep
        generate's values: the first one -- the log-prob of the first pad, predicted from the
        finished answer -- is upstream's reward slot (``reward_at="after_last"``), whose KL term
        enters the reward, and it equals a forward pass's (same context). Zeroing it put
        ``kl_ctl * -log p_ref(pad)`` on every answer that ended, so actors learned never to stop.
        """
        out = answer_logprobs.new_zeros((attention_mask.shape[0], attention_mask.shape[1] - 1))
        out[:, prompt_length - 1:] = answer_logprobs
        return out

    def _decode_for_hook(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, seq: torch.Tensor,
                         attention_mask: torch.Tensor) -> tuple[list[str], list[str]]:
        P = prompts.shape[1]
        prompt_texts = [self.tokenizer.decode(row[m.bool()], skip_special_tokens=True)
                        for row, m in zip(prompts, prompt_mask)]
        answer_texts = [self.tokenizer.decode(row[P:][m[P:].bool()], skip_special_tokens=True)
                        for row, m in zip(seq, attention_mask)]
        return prompt_texts, answer_texts

    def _packed(self, seq: torch.Tensor, attention_mask: torch.Tensor, *names: str) -> Any:
        """The packed rows of a batch for the passes of the models ``names`` (default: every model's),
        or None where none of them packs."""
        enabled = any(self.packing.get(name, False) for name in names or tuple(self.packing))
        return pack_batch(seq, attention_mask, enabled, self.packing_span)

    def _layout_for(self, name: str, packed: Any) -> Any:
        """``packed`` for the model ``name`` if it packs, else None (its pass runs padded)."""
        return packed if self.packing.get(name) else None

    def _reward_scores(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, seq: torch.Tensor,
                       attention_mask: torch.Tensor, position_ids: torch.Tensor, packed: Any = None) -> torch.Tensor:
        """(B,) reward of each answer: the reward model's score and the reward functions, by weight.
        ``packed``: the batch's packed rows (the reward model runs padded without them)."""
        mix = self.reward_mix
        model_scores = None
        if mix.uses_model:
            with self.scoring_gather("reward model", self.reward_model):
                model_scores = reward_end_scores(self.reward_model, seq, attention_mask, position_ids,
                                                 self._layout_for("reward", packed),
                                                 prompts.shape[1]).detach().float()
            if not mix.functions and mix.model_weight == 1.0:
                return model_scores  # upstream's reward, untouched
        failure: UserError | None = None
        scores = torch.zeros(seq.shape[0], dtype=torch.float32, device=seq.device)
        try:
            texts = self._decode_for_hook(prompts, prompt_mask, seq, attention_mask)
            columns = (self.prompt_columns.for_batch(prompts, prompt_mask, texts[0])
                       if self.prompt_columns is not None else None)
            scores = mix.score(*texts, columns, model_scores).to(seq.device)
        except UserError as err:
            failure = err
        # Every rank learns of a failure on any rank, so none is left waiting in a collective.
        if self._over_ranks([0.0 if failure is None else 1.0])[0] > 0:
            raise failure or UserError("a reward function failed on another rank (its line is in that rank's log)")
        return scores

    def _greedy_baseline(self, prompts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ReMax's baseline: the reward of the greedy answer to each prompt. Shape: prompts (B, P); (B,)."""
        sampling = self.generator.decoding
        self.generator.decoding = replace(sampling, decoding="greedy")
        try:
            seq = self.generator.rollout(prompts, mask).sequences
        finally:
            self.generator.decoding = sampling
        masks = sequence_masks(mask, seq, self.tokenizer.eos_token_id)
        with torch.no_grad():
            scores = self._reward_scores(prompts, mask, seq, masks.attention_mask, masks.position_ids,
                                         self._packed(seq, masks.attention_mask, "reward"))
        if self.missing_eos_penalty:
            ended = (seq[:, prompts.shape[1]:] == self.tokenizer.eos_token_id).any(-1)
            scores = rl_math.missing_eos_penalty(scores, ended, self.missing_eos_penalty)
        return scores

    def _sequence_advantages(self, reward_score: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                             action_mask: torch.Tensor, start: int,
                             greedy_scores: torch.Tensor | None) -> torch.Tensor | None:
        """(B,) advantages of GRPO / RLOO / ReMax from a whole generation batch (whole groups), or
        None for the algorithms whose advantages are per token (PPO, REINFORCE++)."""
        settings = self.settings
        if settings.algorithm not in ("grpo", "rloo", "remax"):
            return None
        scores = torch.clamp(reward_score.float(), -self.clip_reward_value, self.clip_reward_value)
        if settings.kl_in_reward and self.kl_ctl:
            scores = scores - self.kl_ctl * rl_algorithms.sequence_kl(
                logprobs[:, start:], ref_logprobs[:, start:], action_mask[:, start:], estimator=self.kl_estimator)
        if settings.algorithm == "grpo":
            return rl_algorithms.grpo_advantages(scores, settings.num_generations, scale_by_std=settings.scale_by_std)
        if settings.algorithm == "rloo":
            return rl_algorithms.rloo_advantages(scores, settings.num_generations)
        baseline = torch.clamp(greedy_scores.float(), -self.clip_reward_value, self.clip_reward_value)
        return rl_algorithms.remax_advantages(scores, baseline)

    def _report_dropped(self, prompts: torch.Tensor, seq: torch.Tensor, valid: torch.Tensor, step: int) -> None:
        if bool(valid.all()):
            return
        P = prompts.shape[1]
        bad = (~valid).nonzero().flatten().tolist()
        print(f"Dropping too short generated answer: step={step} rank={get_rank()} rows={bad}: "
              f"answers: {self.tokenizer.batch_decode(seq[bad, P:], skip_special_tokens=False)}")

    def generate_experience(self, prompts: torch.Tensor, mask: torch.Tensor, step: int) -> Experience | None:
        """Generate one rollout batch and score it. ``None`` when no rank kept any answer.

        Shapes: prompts, mask (B, P) left-padded. Collective (every rank must call it).
        """
        self.eval()
        generate_start = time.time()
        greedy_scores = None
        k = self.settings.num_generations
        if self.settings.algorithm == "remax":
            # One greedy answer per prompt (before the repeat), its reward repeated over the group.
            greedy_scores = self._greedy_baseline(prompts, mask).repeat_interleave(k)
        if k > 1:
            # The group: each prompt K times in consecutive rows (rl_algorithms' layout).
            prompts, mask = prompts.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)
        rollout = self._rollout(prompts, mask, step)
        seq = rollout.sequences
        generate_end = time.time()
        self.generate_time = generate_end - generate_start
        self.generator.scoring_mode()  # training forwards, dropout off

        masks = sequence_masks(mask, seq, self.tokenizer.eos_token_id)
        valid = masks.answer_lengths > 1  # upstream: valid_ans_len <= 1 is dropped
        self._report_dropped(prompts, seq, valid, step)
        kept_anywhere = self._over_ranks([float(valid.sum())])[0]
        if kept_anywhere == 0:
            print_rank_0(f"All generated results are too short on every rank at step={step}; skipping this "
                         "step (no experience, no update)")
            self.experience_time = 0.0
            return None

        attention_mask, position_ids = masks.attention_mask, masks.position_ids
        packed = self._packed(seq, attention_mask)  # one packing for every pass
        with torch.no_grad():
            if rollout.logprobs is not None and self.reuse_rollout_logprobs:
                # The generator kept the sampled tokens' log-probs: no second actor pass.
                logprobs = self._logprobs_from_rollout(rollout.logprobs, prompts.shape[1], attention_mask)
            else:
                with self.scoring_gather("actor", self.actor_model):
                    logprobs = self._token_log_probs("actor", self.actor_model, seq, attention_mask, position_ids,
                                                     packed).float()
            with self.scoring_gather("reference", self.ref_model):
                ref_logprobs = self._token_log_probs("reference", self.ref_model, seq, attention_mask,
                                                     position_ids, packed).float()
            reward_score = self._reward_scores(prompts, mask, seq, attention_mask, position_ids, packed)
            if self.missing_eos_penalty:
                ended = (seq[:, prompts.shape[1]:] == self.tokenizer.eos_token_id).any(-1)
                reward_score = rl_math.missing_eos_penalty(reward_score, ended, self.missing_eos_penalty)
            if self.critic_model is not None:
                with self.scoring_gather("critic", self.critic_model):
                    values = self._token_values(seq, attention_mask, position_ids, packed).detach()[:, :-1].float()
            else:  # critic-free: no value model; zeros keep the container's shape
                values = torch.zeros_like(logprobs)
        self.experience_time = time.time() - generate_end
        action_mask = attention_mask[:, 1:] * valid[:, None].to(attention_mask.dtype)
        kept = action_mask.bool()
        # Every row's reward, dropped ones too (a group's statistics and a masked-by-multiplying loss
        # would carry their nan), and ReMax's greedy baseline.
        baseline = () if greedy_scores is None else (greedy_scores,)
        if not self.nonfinite.check(logprobs[kept], ref_logprobs[kept], values[kept], reward_score, *baseline,
                                    message=f"non-finite log-probs, values or reward in the rollout of step {step}; "
                                            "rollout skipped"):
            return None  # every rank agrees (the check is collective): no experience, no update
        sequence_advantages = self._sequence_advantages(reward_score, logprobs, ref_logprobs, action_mask,
                                                        prompts.shape[1] - 1, greedy_scores)
        return Experience(prompts=prompts, seq=seq, attention_mask=attention_mask, position_ids=position_ids,
                          action_mask=action_mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
                          reward_score=reward_score, valid=valid, sequence_advantages=sequence_advantages)


    # ================================================================== rewards and GAE (upstream names)
    def compute_rewards(self, prompts: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                        reward_score: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        # With the KL as a loss term (GRPO's), the rewards hold the score alone.
        kl_ctl = self.kl_ctl if self.settings.kl_in_reward else 0.0
        return rl_math.compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask,
                                       kl_ctl=kl_ctl, clip_reward_value=self.clip_reward_value,
                                       kl_estimator=self.kl_estimator, reward_at=self.reward_at)

    def get_advantages_and_returns(self, values: torch.Tensor, rewards: torch.Tensor,
                                   start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rl_math.get_advantages_and_returns(values, rewards, start, gamma=self.gamma, lam=self.lam)

    def _old_values_and_rewards(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's zeroing after ``ends``: (old_values, old_rewards), both (B, T)."""
        return self._old_values(exp), self._old_rewards(exp)

    def _ends(self, exp: Experience) -> torch.Tensor:
        return rl_math.sequence_end_indices(exp.action_mask, exp.start, reward_at=self.reward_at)

    def _old_values(self, exp: Experience) -> torch.Tensor:
        """The rollout's critic values, zeroed after ``ends`` (B, T): GAE's and the clipped value loss's."""
        return rl_math.mask_after_ends(exp.values, self._ends(exp))

    def _old_rewards(self, exp: Experience) -> torch.Tensor:
        """The per-token rewards (:meth:`compute_rewards`), zeroed after ``ends`` (B, T)."""
        rewards = self.compute_rewards(exp.prompts, exp.logprobs, exp.ref_logprobs, exp.reward_score,
                                       exp.action_mask)
        return rl_math.mask_after_ends(rewards, self._ends(exp))

    # ================================================================== rollout preparation
    def prepare_rollout(self, exp_dataset: list[Experience]) -> RolloutStats:
        """Fill in advantages / returns of every micro-batch of a rollout; rollout statistics.

        Advantages depend only on the stored experience, so computing them once per rollout is the
        same as upstream's per-micro-batch computation, and lets ``--whiten_advantages`` use the
        statistics of the whole rollout (all micro-batches, all ranks).
        """
        # The actor's optimizer steps so far: the on-policy shortcut of train_rlhf holds only while
        # no step has happened since this rollout was generated.
        self._rollout_actor_steps = getattr(self.actor_model, "global_steps", None)
        per_batch = []
        sums = [0.0] * 11  # reward, kept, dropped, kl, kl tokens, length, returns' moments and residuals'
        for exp in exp_dataset:
            with torch.no_grad():
                old_values, old_rewards = self._old_values_and_rewards(exp)
                if self.critic_model is not None:
                    advantages, returns = self.get_advantages_and_returns(old_values, old_rewards, exp.start)
                else:
                    advantages = returns = self._critic_free_advantages(exp, old_rewards)
            mask = exp.action_mask[:, exp.start:].bool()
            per_batch.append((advantages, returns, mask))
            valid = exp.valid
            kl = (exp.logprobs - exp.ref_logprobs)[:, exp.start:]
            ret = rl_math.Moments.of(returns.float(), mask)
            res = rl_math.Moments.of((returns - old_values[:, exp.start:]).float(), mask)
            sums = [a + b for a, b in zip(sums, [
                float(exp.reward_score[valid].float().sum()), float(valid.sum()), float((~valid).sum()),
                float(rl_math.masked_sum(kl.float(), mask)), float(mask.sum()),
                float(exp.action_mask[:, exp.start:].sum()),
                ret.total, ret.total_sq, res.total, res.total_sq, ret.count,
            ])]
        (reward, kept, dropped, kl_sum, kl_tokens, length, r1, r2, e1, e2, n) = self._over_ranks(sums)

        if self.whiten_advantages:  # with the moments of the whole rollout: every micro-batch, every rank
            moments = rl_math.Moments(0.0, 0.0, 0.0)
            for advantages, _, mask in per_batch:
                moments = moments.plus(rl_math.Moments.of(advantages.float(), mask))
            moments = rl_math.Moments(*self._over_ranks(list(moments)))
            per_batch = [(rl_math.masked_whiten(adv, mask, moments=moments), ret, mask) for adv, ret, mask in per_batch]
        for exp, (advantages, returns, _) in zip(exp_dataset, per_batch):
            exp.advantages, exp.returns = advantages.detach(), returns.detach()

        nan = float("nan")
        explained = (rl_math.explained_variance_from_moments(rl_math.Moments(r1, r2, n), rl_math.Moments(e1, e2, n))
                     if self.critic_model is not None else nan)
        return RolloutStats(
            reward=reward / kept if kept else nan, kl_to_ref=kl_sum / kl_tokens if kl_tokens else nan,
            response_length=length / kept if kept else nan, value_explained_variance=explained,
            kept=int(kept), dropped=int(dropped),
        )

    def _critic_free_advantages(self, exp: Experience, rewards: torch.Tensor) -> torch.Tensor:
        """(B, T - start) token advantages without a critic: REINFORCE++'s returns-to-go of the
        KL-penalised per-token rewards (whitened later, over the rollout), or each answer's sequence
        advantage on all of its tokens (GRPO, RLOO, ReMax)."""
        mask = exp.action_mask[:, exp.start:]
        if exp.sequence_advantages is None:  # REINFORCE++: rewards are upstream's, zeroed after the end
            return rl_algorithms.returns_to_go(rewards, exp.start, gamma=self.gamma) * mask
        return rl_algorithms.token_advantages(exp.sequence_advantages, mask)

    # ---------------------------------------------------------------- modes
    def eval(self) -> None:
        self.generator.eval()  # the actor (Hybrid Engine kernels swapped in where active)
        if self.critic_model is not None:
            self.critic_model.eval()
        self.ref_model.eval()
        if self.reward_model is not None:
            self.reward_model.eval()
