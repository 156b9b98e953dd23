"""Experience making for step 3 (upstream's ``generate_experience`` half of ``ppo_trainer.py``):
generate a rollout batch, score it into an :class:`~dschat.rlhf.experience.Experience`, and before the
PPO update fill in every micro-batch's advantages and returns.

:class:`ExperienceMaker` is one of the two parts :class:`~dschat.rlhf.ppo_trainer.DeepSpeedPPOTrainer`
holds (the other is the update, :class:`~dschat.rlhf.ppo_update.PPOUpdate`); both run their passes
through the same :class:`~dschat.rlhf.scoring_passes.ScoringPasses` and take rewards and advantages
from the trainer's :class:`~dschat.rlhf.ppo_formulas.PPOFormulas`; upstream's method names stay on
the trainer. The contract (each upstream difference is explained in docs/upstream.md#step-3-ppo):

* Experience passes run in **eval mode** (no dropout) with **position ids from the mask** (left
  padding); log-probs from fp16/bf16 logits are computed in fp32 (``rl_math.logprobs.gather_log_probs``),
  like the ones kept from generation, so the reference's and the rollout's agree to fp32 rounding.
* Masks come from generation: the answer is every token up to and including the first EOS, so the
  **EOS is an action** even when ``pad == eos``.
* Answers of at most one token are **dropped by masking** (their rows stay, with a zero action
  mask), so ranks keep equal micro-batch counts; if every row on every rank is dropped the step is
  skipped.
* **Decoding** is configurable; the default samples from the policy
  (docs/algorithms.md#decoding-why-sampling-is-the-default).
* The rollout's **old log-probs come from generation** (the sampled tokens' log-probs under the
  sampling temperature, kept by :class:`~dschat.rlhf.rollout.generator.RolloutGenerator`) instead of a
  second actor pass over the sequence; where the generator cannot keep them (Hybrid Engine) the
  actor pass runs.
* Advantages are computed **once per rollout** (:meth:`ExperienceMaker.prepare_rollout`), so
  ``--whiten_advantages`` whitens with the statistics of the whole rollout (every micro-batch, every
  rank).
* **Beyond PPO** (``--algorithm``, :class:`~dschat.rlhf.config.AlgorithmSettings`): GRPO, RLOO, REINFORCE++ and ReMax
  run without a critic engine (``critic_model`` is None). Their advantages come from
  :mod:`dschat.rl_math.critic_free`: per answer from a whole generation batch (groups of
  ``--num_generations`` consecutive rows) in :meth:`~ExperienceMaker.generate_experience`, or per
  token (REINFORCE++) in :meth:`~ExperienceMaker.prepare_rollout`. Rewards are a
  :class:`~dschat.rewards.RewardMix` of the reward model and ``--reward_fn`` functions. PPO's path is
  the same when none of this is asked for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from dschat.rl_math.critic_free import overlong_penalty
from dschat.rl_math.ppo import missing_eos_penalty
from dschat.rl_math.stats import Moments, explained_variance_from_moments, masked_sum, masked_whiten
from dschat.data.prompt_columns import PromptColumns
from dschat.models.packing import PackedRows
from dschat.rewards import RewardMix
from dschat.rlhf.episodes import EpisodePlayer
from dschat.rlhf.experience import Experience, SequenceMasks, raise_together, sequence_masks, sum_over_ranks
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.rollout.sampling import is_end
from dschat.rlhf.ppo_formulas import PPOFormulas
from dschat.rlhf.scoring_passes import ScoringPasses
from dschat.runtime.dist import get_rank, print_rank_0
from dschat.training.nonfinite import NonFiniteGuard

__all__ = ["RewardFn", "RolloutStats", "Generated", "ExperienceMaker"]

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
    # Multi-turn episodes (--env), None without: means over every episode of the rollout (all ranks).
    turns: float | None = None  # actor turns per episode
    observation_tokens: float | None = None  # environment tokens per episode
    cut_share: float | None = None  # share of episodes cut by --max_turns or the length limit


@dataclass(frozen=True)
class Generated:
    """One generation batch before scoring: single answers, or episodes (``--env``)."""

    seq: torch.Tensor  # (B, L) left-padded prompts, answers (or episodes), padding
    masks: SequenceMasks  # attention mask, position ids, the actor's token count per row
    logprobs: torch.Tensor | None  # (B, L - P) the generated tokens' log-probs as sampled, or None
    ended: torch.Tensor  # (B,) bool: the (last) answer ended with EOS
    observation_mask: torch.Tensor | None = None  # (B, L - 1) 1 where seq[:, t + 1] is an environment's token
    env_reward: torch.Tensor | None = None  # (B,) float32: the episode's summed turn rewards
    turns: torch.Tensor | None = None  # (B,) int64
    cut: torch.Tensor | None = None  # (B,) bool


class ExperienceMaker:
    """Generates and scores rollouts with ``generator`` (the actor) and the scoring engines of
    ``passes`` (reference, critic -- None for the critic-free algorithms --, reward model), and
    prepares each rollout for the update; rewards and advantages are ``formulas``'.

    The reward is ``reward_mix`` (:class:`~dschat.rewards.RewardMix`: reward model and ``--reward_fn``
    functions by weight); ``prompt_columns`` gives reward functions the dataset fields beside each
    prompt. ``nonfinite`` counts the rollouts skipped for NaN/inf.
    """

    def __init__(self, generator: RolloutGenerator, tokenizer: PreTrainedTokenizerBase, passes: ScoringPasses,
                 formulas: PPOFormulas, reward_mix: RewardMix, *, prompt_columns: PromptColumns | None,
                 nonfinite: NonFiniteGuard, print_answers: bool, print_answers_interval: int,
                 episodes: EpisodePlayer | None = None) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.passes = passes
        self.formulas = formulas
        self.reward_mix = reward_mix
        self.prompt_columns = prompt_columns
        self.nonfinite = nonfinite
        self.print_answers = print_answers
        self.print_answers_interval = print_answers_interval
        self.episodes = episodes  # --env: multi-turn episodes instead of one answer per prompt
        if episodes is not None and prompt_columns is None:
            raise ValueError("ExperienceMaker: --env needs prompt_columns (its factory gets each prompt's dataset row)")
        self.actor_model: DeepSpeedEngine = passes.models["actor"]
        self.ref_model: DeepSpeedEngine = passes.models["reference"]
        self.critic_model: DeepSpeedEngine | None = passes.models["critic"]
        self.reward_model: DeepSpeedEngine | None = passes.models["reward"]
        # Fast path, on by default: take the old log-probs from generation instead of a second
        # forward pass of the actor (benchmarks/step3.py turns it off for its baseline).
        self.reuse_rollout_logprobs = True
        self.generate_time = 0.0  # last generation call (upstream)
        self.experience_time = 0.0  # last experience forward passes
        self.env_time = 0.0  # the last generate_experience's time in the environments' calls (--env)

    @property
    def device(self) -> torch.device:
        return next(self.actor_model.module.parameters()).device

    def generate_answers(self, prompts: torch.Tensor, mask: torch.Tensor, step: int, *,
                         show: bool = True, sources: torch.Tensor | None = None) -> Generated:
        """Answers for ``(B, P)`` left-padded prompts, or with ``--env`` one episode each; printed
        with ``--print_answers`` (every rank, as upstream) when ``show``. ``sources``: the prompts'
        ``(B, 3)`` dataset rows (:mod:`dschat.data.prompt_columns`), for the environments. Collective."""
        ends = self.generator.end_ids
        P = prompts.shape[1]
        if self.episodes is None:
            rollout = self.generator.rollout(prompts, mask)
            seq = rollout.sequences
            generated = Generated(seq, sequence_masks(mask, seq, ends), rollout.logprobs,
                                  is_end(seq[:, P:], ends).any(-1))
        else:
            columns = self.prompt_columns
            rows = raise_together(
                lambda: columns.rows_for_batch(prompts, mask, self._prompt_texts(prompts, mask), sources),
                "an environment")
            played = self.episodes.play(prompts, mask, rows)
            self.env_time += played.env_seconds
            attention = played.attention_mask
            generated = Generated(played.sequences, SequenceMasks(attention, (attention.cumsum(-1) - 1).clamp(min=0),
                                                                  played.actor_tokens),
                                  played.logprobs, played.ended, played.observation_mask[:, 1:], played.env_reward,
                                  played.turns, played.cut)
        if show and self.print_answers and step % self.print_answers_interval == 0:
            rank = get_rank()
            print(f"--- prompt --> step={step}, rank={rank}, "
                  f"{self.tokenizer.batch_decode(prompts, skip_special_tokens=True)}")
            print(f"--- ans    --> step={step}, rank={rank}, "
                  f"{self.tokenizer.batch_decode(generated.seq[:, P:], skip_special_tokens=True)}")
        return generated

    def _prompt_texts(self, prompts: torch.Tensor, prompt_mask: torch.Tensor) -> list[str]:
        return [self.tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(prompts, prompt_mask)]

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
        prompt_texts = self._prompt_texts(prompts, prompt_mask)
        answer_texts = [self.tokenizer.decode(row[P:][m[P:].bool()], skip_special_tokens=True)
                        for row, m in zip(seq, attention_mask)]
        return prompt_texts, answer_texts

    def _reward_scores(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, seq: torch.Tensor,
                       attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       packed: PackedRows | None = None, sources: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) reward of each answer: the reward model's score and the reward functions, by weight.
        ``packed``: the batch's packed rows (the reward model runs padded without them); ``sources``:
        the prompts' ``(B, 3)`` dataset rows, for the functions' columns."""
        mix = self.reward_mix
        model_scores = None
        if mix.uses_model:
            model_scores = self.passes.reward_scores(seq, attention_mask, position_ids, packed,
                                                     prompts.shape[1]).detach().float()
            if not mix.functions and mix.model_weight == 1.0:
                return model_scores  # upstream's reward, untouched
        def functions() -> torch.Tensor:
            texts = self._decode_for_hook(prompts, prompt_mask, seq, attention_mask)
            columns = (self.prompt_columns.for_batch(prompts, prompt_mask, texts[0], sources)
                       if self.prompt_columns is not None else None)
            return mix.score(*texts, columns, model_scores).to(seq.device)

        return raise_together(functions, "a reward function")  # every rank learns of any rank's failure

    def _greedy_baseline(self, prompts: torch.Tensor, mask: torch.Tensor, step: int,
                         sources: torch.Tensor | None) -> torch.Tensor:
        """ReMax's baseline: the reward of the greedy answer (or episode) to each prompt.
        Shape: prompts (B, P); (B,)."""
        sampling = self.generator.decoding
        self.generator.decoding = replace(sampling, decoding="greedy")
        try:
            greedy = self.generate_answers(prompts, mask, step, show=False, sources=sources)
        finally:
            self.generator.decoding = sampling
        masks = greedy.masks
        with torch.no_grad():
            return self._score(prompts, mask, greedy, self.passes.packed(greedy.seq, masks.attention_mask, "reward"),
                               sources)

    def _score(self, prompts: torch.Tensor, mask: torch.Tensor, generated: Generated,
               packed: PackedRows | None, sources: torch.Tensor | None) -> torch.Tensor:
        """(B,) each answer's (or episode's) score: the reward mix, plus the episode's turn rewards,
        less ``--missing_eos_penalty`` where the (last) answer has no EOS, plus DAPO's overlong penalty
        (``--overlong_buffer_len``) of its length (an episode's: the actor's tokens). Collective."""
        masks = generated.masks
        scores = self._reward_scores(prompts, mask, generated.seq, masks.attention_mask, masks.position_ids, packed,
                                     sources)
        if generated.env_reward is not None:
            scores = scores + generated.env_reward.to(scores.device)
        penalty = self.formulas.missing_eos_penalty
        if penalty:
            scores = missing_eos_penalty(scores, generated.ended.to(scores.device), penalty)
        settings = self.formulas.settings
        if settings.overlong_buffer_len:
            scores = scores + overlong_penalty(masks.answer_lengths, self.formulas.max_answer_seq_len,
                                               settings.overlong_buffer_len,
                                               settings.overlong_penalty_factor).to(scores.device)
        return scores

    def _report_dropped(self, prompts: torch.Tensor, seq: torch.Tensor, valid: torch.Tensor, step: int) -> None:
        if bool(valid.all()):
            return
        P = prompts.shape[1]
        bad = (~valid).nonzero().flatten().tolist()
        print(f"Dropping too short generated answer: step={step} rank={get_rank()} rows={bad}: "
              f"answers: {self.tokenizer.batch_decode(seq[bad, P:], skip_special_tokens=False)}")

    def generate_experience(self, prompts: torch.Tensor, mask: torch.Tensor, step: int,
                            sources: torch.Tensor | None = None) -> Experience | None:
        """Generate one rollout batch and score it. ``None`` when no rank kept any answer.

        Shapes: prompts, mask (B, P) left-padded; ``sources`` (B, 3), the batch's ``prompt_sources``
        (each prompt's dataset row, whose fields reward functions and environments get), or None
        (rows found by the prompts' tokens: :mod:`dschat.data.prompt_columns`). Collective (every
        rank must call it).
        """
        self.eval()
        generate_start = time.time()
        self.env_time = 0.0  # this batch's environment calls (ReMax's greedy episodes included)
        greedy_scores = None
        settings = self.formulas.settings
        k = settings.num_generations
        if settings.algorithm == "remax":
            # One greedy answer per prompt (before the repeat), its reward repeated over the group.
            greedy_scores = self._greedy_baseline(prompts, mask, step, sources).repeat_interleave(k)
        if k > 1:
            # The group: each prompt K times in consecutive rows (rl_math.critic_free's layout).
            prompts, mask = prompts.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)
            sources = sources.repeat_interleave(k, dim=0) if sources is not None else None
        generated = self.generate_answers(prompts, mask, step, sources=sources)
        seq = generated.seq
        _wait_for_device(seq)  # the phases' clocks read after the device's queued work (CUDA is async)
        generate_end = time.time()
        self.generate_time = generate_end - generate_start
        self.generator.scoring_mode()  # training forwards, dropout off

        masks = generated.masks
        valid = masks.answer_lengths > 1  # upstream: valid_ans_len <= 1 is dropped (episodes: the actor's tokens)
        self._report_dropped(prompts, seq, valid, step)
        if settings.mask_truncated_answers:  # DAPO's overlong filtering: a cut answer trains on nothing
            valid = valid & generated.ended.to(valid.device)
        kept_anywhere = sum_over_ranks([float(valid.sum())], self.device)[0]
        if kept_anywhere == 0:
            cut = " or cut without EOS (--mask_truncated_answers)" if settings.mask_truncated_answers else ""
            print_rank_0(f"All generated results are too short{cut} on every rank at step={step}; skipping this "
                         "step (no experience, no update)")
            self.experience_time = 0.0
            return None

        attention_mask, position_ids = masks.attention_mask, masks.position_ids
        passes = self.passes
        packed = passes.packed(seq, attention_mask)  # one packing for every pass
        with torch.no_grad():
            if generated.logprobs is not None and self.reuse_rollout_logprobs:
                # The generator kept the sampled tokens' log-probs: no second actor pass.
                logprobs = self._logprobs_from_rollout(generated.logprobs, prompts.shape[1], attention_mask)
            else:
                with passes.scoring_gather("actor", self.actor_model):
                    logprobs = passes.token_log_probs("actor", self.actor_model, seq, attention_mask, position_ids,
                                                      packed).float()
            with passes.scoring_gather("reference", self.ref_model):
                ref_logprobs = passes.token_log_probs("reference", self.ref_model, seq, attention_mask,
                                                      position_ids, packed).float()
            reward_score = self._score(prompts, mask, generated, packed, sources)
            if self.critic_model is not None:
                with passes.scoring_gather("critic", self.critic_model):
                    values = passes.token_values(seq, attention_mask, position_ids, packed).detach()[:, :-1].float()
            else:  # critic-free: no value model; zeros keep the container's shape
                values = torch.zeros_like(logprobs)
        _wait_for_device(seq)
        self.experience_time = time.time() - generate_end
        answer_mask = attention_mask[:, 1:]  # every row's answer tokens, dropped rows' too
        if generated.observation_mask is not None:  # the environment's tokens are no actions
            answer_mask = answer_mask * (1 - generated.observation_mask.to(answer_mask.dtype))
        action_mask = answer_mask * valid[:, None].to(answer_mask.dtype)
        kept = action_mask.bool()
        # Every row's reward, dropped ones too (a group's statistics and a masked-by-multiplying loss would
        # carry their nan), ReMax's greedy baseline, and the dropped answers' log-probs where their KL
        # enters their group's rewards.
        baseline = () if greedy_scores is None else (greedy_scores,)
        read = (answer_mask if self.formulas.kl_in_group_baseline else action_mask).bool()
        if not self.nonfinite.check(logprobs[read], ref_logprobs[read], values[kept], reward_score, *baseline,
                                    message=f"non-finite log-probs, values or reward in the rollout of step {step}; "
                                            "rollout skipped"):
            return None  # every rank agrees (the check is collective): no experience, no update
        # A dropped answer (too short, or cut under --mask_truncated_answers) trains on nothing, but its
        # KL-penalised reward is still one of its group's (answer_mask, not action_mask).
        sequence_advantages = self.formulas.sequence_advantages(reward_score, logprobs, ref_logprobs, answer_mask,
                                                                prompts.shape[1] - 1, greedy_scores)
        return Experience(prompts=prompts, seq=seq, attention_mask=attention_mask, position_ids=position_ids,
                          action_mask=action_mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
                          reward_score=reward_score, valid=valid, sequence_advantages=sequence_advantages,
                          observation_mask=generated.observation_mask, turns=generated.turns, cut=generated.cut)


    # ================================================================== rollout preparation
    def prepare_rollout(self, exp_dataset: list[Experience]) -> RolloutStats:
        """Fill in advantages / returns of every micro-batch of a rollout; rollout statistics.

        Advantages depend only on the stored experience, so computing them once per rollout is the
        same as upstream's per-micro-batch computation, and lets ``--whiten_advantages`` use the
        statistics of the whole rollout (all micro-batches, all ranks).
        """
        formulas = self.formulas
        per_batch = []
        sums = [0.0] * 14  # reward, kept, dropped, kl, kl tokens, length, returns' and residuals' moments, episodes'
        for exp in exp_dataset:
            with torch.no_grad():
                old_values, old_rewards = formulas._old_values_and_rewards(exp)
                advantages, returns = formulas.advantages_and_returns(exp, old_values, old_rewards,
                                                                      critic=self.critic_model is not None)
            mask = exp.action_mask[:, exp.start:].bool()
            per_batch.append((advantages, returns, mask))
            valid = exp.valid
            kl = (exp.logprobs - exp.ref_logprobs)[:, exp.start:]
            ret = Moments.of(returns.float(), mask)
            res = Moments.of((returns - old_values[:, exp.start:]).float(), mask)
            sums = [a + b for a, b in zip(sums, [
                float(exp.reward_score[valid].float().sum()), float(valid.sum()), float((~valid).sum()),
                float(masked_sum(kl.float(), mask)), float(mask.sum()),
                float(exp.action_mask[:, exp.start:].sum()),
                ret.total, ret.total_sq, res.total, res.total_sq, ret.count,
                *_episode_sums(exp),
            ])]
        (reward, kept, dropped, kl_sum, kl_tokens, length, r1, r2, e1, e2, n,
         turns, observed, cut) = sum_over_ranks(sums, self.device)

        if formulas.whiten_advantages:  # with the moments of the whole rollout: every micro-batch, every rank
            moments = Moments(0.0, 0.0, 0.0)
            for advantages, _, mask in per_batch:
                moments = moments.plus(Moments.of(advantages.float(), mask))
            moments = Moments(*sum_over_ranks(list(moments), self.device))
            per_batch = [(masked_whiten(adv, mask, moments=moments), ret, mask) for adv, ret, mask in per_batch]
        for exp, (advantages, returns, _) in zip(exp_dataset, per_batch):
            exp.advantages, exp.returns = advantages.detach(), returns.detach()

        nan = float("nan")
        explained = (explained_variance_from_moments(Moments(r1, r2, n), Moments(e1, e2, n))
                     if self.critic_model is not None else nan)
        return RolloutStats(
            reward=reward / kept if kept else nan, kl_to_ref=kl_sum / kl_tokens if kl_tokens else nan,
            response_length=length / kept if kept else nan, value_explained_variance=explained,
            kept=int(kept), dropped=int(dropped),
            **({} if not exp_dataset or exp_dataset[0].turns is None else {
                "turns": turns / (kept + dropped), "observation_tokens": observed / (kept + dropped),
                "cut_share": cut / (kept + dropped)}),
        )

    # ---------------------------------------------------------------- modes
    def eval(self) -> None:
        self.generator.eval()  # the actor (Hybrid Engine kernels swapped in where active)
        if self.critic_model is not None:
            self.critic_model.eval()
        self.ref_model.eval()
        if self.reward_model is not None:
            self.reward_model.eval()


def _episode_sums(exp: Experience) -> tuple[float, float, float]:
    """An experience's summed turns, observation tokens and cut episodes (zeros without ``--env``)."""
    if exp.turns is None:
        return 0.0, 0.0, 0.0
    observed = 0.0 if exp.observation_mask is None else float(exp.observation_mask.sum())
    return float(exp.turns.sum()), observed, float(exp.cut.sum())


def _wait_for_device(tensor: torch.Tensor) -> None:
    """Wait for the work queued on ``tensor``'s CUDA device (a no-op elsewhere), so that a phase's time
    is its own and not the next phase's."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
