"""PPO trainer (upstream's ``dschat/rlhf/ppo_trainer.py``), corrected.

Upstream's methods keep their names and argument order (``generate_experience``, ``train_rlhf``,
``train_unsupervised``, ``compute_rewards``, ``actor_loss_fn``, ``critic_loss_fn``,
``get_advantages_and_returns``, ``get_overflow``, ``train``, ``eval``); the formulas are the pure
functions of :mod:`dschat.rl_math`, fed with the hyperparameters from the flags (upstream hard-coded
them). Making experience (generation, scoring, advantages) is the base class,
:class:`~dschat.rlhf.experience_maker.ExperienceMaker`; this module holds the update: the schedule of
micro-steps, the actor and critic steps, fp16 overflow alignment and upstream's debugging helpers.
What changed in the update, with the upstream bug each fixes:

* **Off-policy guard** (:mod:`dschat.rlhf.batch_plan`): when every optimizer step covers whole rollouts
  the PPO ratio is exactly 1 and the trainer uses the current log-probs as the old ones (TRL's
  shortcut); otherwise the ratio is taken against the stored behaviour log-probs. Either way the
  measured ratio, approx-KL and clip fraction against the stored log-probs are recorded.
* Losses are normalised over the **whole optimizer step** (token mean over all its micro-batches
  and ranks, OpenRLHF-style) when each step lies inside one rollout; else per micro-batch as
  upstream.
* **Beyond PPO** (``--algorithm``): the critic-free algorithms step the actor alone, with the loss
  aggregation, KL term and truncated importance sampling of :mod:`dschat.rl_algorithms`.
* ``--align_overflow`` works only with fp16 and a DeepSpeed that exposes upstream's external
  overflow check (fp16-optimizer internals); elsewhere it is refused or a no-op with a warning.
"""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, replace
from typing import Any

import torch

from dschat import rl_algorithms, rl_math
from dschat.cli.args import step3_flag
from dschat.data.prompt_columns import PromptColumns
from dschat.data.unsupervised import unsupervised_training_enabled
from dschat.errors import UserError
from dschat.rewards import RewardMix
from dschat.rlhf.experience import Experience
from dschat.rlhf.experience_maker import ExperienceMaker, RewardFn, RolloutStats
from dschat.rlhf.batch_plan import BatchPlan, plan_batches
from dschat.rlhf.zero3_gathers import TrainingGather
from dschat.runtime.dist import all_reduce_sum, get_rank, get_world_size, print_rank_0
from dschat.runtime.zero3 import gathered_parameters

__all__ = [
    "RewardFn",
    "MicroStepStats",
    "RolloutStats",
    "DeepSpeedPPOTrainer",
    "DeepSpeedPPOTrainerUnsupervised",
    "gather_log_probs",
    "get_model_norm",
    "print_all_ranks",
]

gather_log_probs = rl_math.gather_log_probs  # upstream's module-level name


def print_all_ranks(tag: str, value: float, rank: int) -> None:
    """Upstream's debugging helper: rank 0 prints ``tag`` and every rank's ``value`` (a collective)."""
    world = get_world_size()
    values = torch.zeros(world, dtype=torch.float64)
    values[rank] = float(value)
    values = all_reduce_sum(values)
    if rank <= 0:
        print(f"{tag} {values.tolist()}")


def get_model_norm(model: Any) -> float:
    """L2 norm over all of ``model``'s parameters (upstream's debugging helper). Under ZeRO-3 each
    parameter is gathered in turn, so every rank must call it."""
    return sum(float(param.float().pow(2).sum()) for _, param in gathered_parameters(model)) ** 0.5


@dataclass
class MicroStepStats:
    """Diagnostics of one PPO micro-step (floats). Ratio stats are measured against the rollout's
    stored behaviour log-probs, whatever the loss used."""

    actor_loss: float
    critic_loss: float
    ratio_mean: float
    ratio_max: float
    ratio_min: float
    approx_kl: float
    clip_frac: float
    tokens: int
    # Mean |log pi_train - log pi_rollout| over the tokens: the rollout decoder's gap to the training
    # forward, measured while the policy has not moved since the rollout (else nan).
    logprob_gap: float = float("nan")


class DeepSpeedPPOTrainer(ExperienceMaker):
    """PPO -- and the critic-free algorithms of ``--algorithm`` -- on the engines of a
    :class:`~dschat.rlhf.rlhf_engine.DeepSpeedRLHFEngine` (whose ``critic`` is None for those):
    :meth:`generate_experience` and :meth:`prepare_rollout` (:class:`ExperienceMaker`), then
    :meth:`schedule` and one :meth:`train_rlhf` per micro-step.

    ``plan`` defaults to :func:`~dschat.rlhf.batch_plan.plan_batches` of ``args``; ``reward_fn``,
    ``reward_mix`` and ``prompt_columns`` are :class:`ExperienceMaker`'s.
    """

    def __init__(self, rlhf_engine: Any, args: Any, *, plan: BatchPlan | None = None,
                 reward_fn: RewardFn | None = None, reward_mix: RewardMix | None = None,
                 prompt_columns: PromptColumns | None = None) -> None:
        super().__init__(rlhf_engine, args, reward_fn=reward_fn, reward_mix=reward_mix, prompt_columns=prompt_columns)
        self.plan = plan or plan_batches(args, get_world_size(), ptx=unsupervised_training_enabled(args))
        self.cliprange = step3_flag(args, "cliprange")
        self.cliprange_value = step3_flag(args, "cliprange_value")
        self.micro_stats: list[MicroStepStats] = []
        self._said_unaligned = False
        # --zero3_gather_for_training: a ZeRO-3 model's forward and backward on its whole parameters, without hooks.
        self.training_gather = TrainingGather(str(step3_flag(args, "zero3_gather_for_training")),
                                              {"actor": self.actor_model, "critic": self.critic_model})
        # Critic-free: there is no second model to align with; the actor steps on its own.
        self.align_overflow = bool(args.align_overflow) and self.dtype == "fp16" and self.critic_model is not None
        if self.align_overflow:
            self._check_align_overflow_support()

    # ================================================================== the update
    def _step_count(self, exp: Experience) -> float:
        """What this micro-batch adds to its optimizer step's loss normaliser: tokens ('token'
        aggregation) or answers with tokens ('sequence', 'token_sum')."""
        mask = exp.action_mask[:, exp.start:]
        if self.settings.loss_aggregation == "token":
            return float(mask.sum())
        return float((mask.sum(1) > 0).sum())

    def schedule(self, exp_dataset: list[Experience], unsup_dataset: list[Any] | None) -> list[tuple[int, Experience, Any]]:
        """The micro-steps of one rollout in training order: ``(ppo_epoch, experience, ptx batch)``.

        Upstream's order: the first PPO epoch in rollout order, then each epoch after an independent
        ``random.shuffle`` of both lists. With step normalisation each entry carries the token count
        of its optimizer step (all micro-batches, all ranks) divided by ``GA x world``: DeepSpeed divides
        each backward by its GA and averages over ranks, so the step's gradient is the token mean over
        the step. With PPO-ptx the actor's GA is ``2 x GA`` (PPO and ptx backward passes), so its PPO
        gradient is half that, weighted against the ptx loss as upstream's.
        """
        exp_list = list(exp_dataset)
        unsup_list = list(unsup_dataset) if unsup_dataset is not None else [None] * len(exp_list)
        steps: list[tuple[int, Experience, Any]] = []
        for ppo_ep in range(self.args.ppo_epochs):
            if ppo_ep > 0:
                random.shuffle(exp_list)
                random.shuffle(unsup_list)
            steps.extend((ppo_ep, e, u) for e, u in zip(exp_list, unsup_list))
        if not self.plan.step_normalizable or not self._at_optimizer_step_start():
            return steps
        ga, world = self.plan.gradient_accumulation_steps, get_world_size()
        tokens = [self._step_count(exp) for _, exp, _ in steps]
        groups = [sum(tokens[i:i + ga]) for i in range(0, len(tokens), ga)]
        groups = self._over_ranks(groups)
        return [(ep, replace(exp, loss_normalizer=max(groups[i // ga], 1.0) / (ga * world)), u)
                for i, (ep, exp, u) in enumerate(steps)]

    def _at_optimizer_step_start(self) -> bool:
        """Whether actor and critic are at the start of an optimizer step (DeepSpeed's micro-step
        counters), as the step normaliser of :meth:`schedule` assumes. A micro-step the non-finite
        guard skipped shifts every later step by one; the normaliser then falls back to upstream's
        per-micro-batch token mean (said once)."""
        for engine, ga in ((self.actor_model, self.plan.gradient_accumulation_steps_actor),
                           (self.critic_model, self.plan.gradient_accumulation_steps)):
            if engine is None:  # critic-free
                continue
            micro_steps = getattr(engine, "micro_steps", None)
            if isinstance(micro_steps, int) and micro_steps % ga != 0:
                if not self._said_unaligned:
                    print_rank_0("NOTE: optimizer steps no longer start with a rollout (a skipped micro-step "
                                 "shifted them); losses are now per-micro-batch token means, as upstream's")
                    self._said_unaligned = True
                return False
        return True

    def _policy_unchanged_since_rollout(self) -> bool:
        """No actor optimizer step since :meth:`prepare_rollout` (True for a caller that never
        called it: the batch plan's word is then all there is)."""
        before = self._rollout_actor_steps
        now = getattr(self.actor_model, "global_steps", None)
        return before is None or now is None or now == before

    # ================================================================== training
    def train_rlhf(self, inputs: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """One PPO micro-step: actor update, then critic update. Returns (actor_loss, critic_loss)."""
        exp = inputs
        if not self.actor_model.module.training:
            self.train()  # an upstream-style caller may go straight from generate_experience
        start = exp.start
        mask = exp.action_mask[:, start:]
        with torch.no_grad():
            old_values = self._old_values(exp)  # the value loss clips around them
            if exp.advantages is not None:  # stored by prepare_rollout (the step-3 loop always calls it)
                advantages, returns = exp.advantages, exp.returns
            elif self.critic_model is None:  # an upstream-style caller: per micro-batch, as upstream
                advantages = returns = self._critic_free_advantages(exp, self._old_rewards(exp))
            else:
                advantages, returns = self.get_advantages_and_returns(old_values, self._old_rewards(exp), start)
        normalizer = exp.loss_normalizer
        if normalizer is None and float(mask.sum()) == 0:
            normalizer = 1.0  # a micro-batch of dropped rows only: zero loss, not 0/0

        batch = (exp.seq, exp.attention_mask, exp.position_ids)
        packed = self._packed(exp.seq, exp.attention_mask, "actor", "critic")
        stored = exp.logprobs[:, start:]
        # On-policy (every optimizer step covers whole rollouts): the ratio is 1 by construction,
        # so use the current log-probs as the old ones (TRL #3493); dropout noise cannot inflate it.
        # Checked, not assumed: once the actor has stepped since the rollout, the stored ones.
        unchanged = self._policy_unchanged_since_rollout()
        on_policy = self.plan.on_policy and unchanged
        # A non-finite loss skips that model's backward and step (--max_nonfinite_steps); with more
        # than one micro-step per optimizer step, its accumulation then continues on the next one.
        with self.training_gather("actor", self.actor_model):  # forward and backward; the step after it
            actor_log_prob = self._token_log_probs("actor", self.actor_model, *batch, packed)[:, start:]
            old_logprobs = actor_log_prob.detach() if on_policy else stored
            if self.settings.upstream_ppo_loss:
                actor_loss = self.actor_loss_fn(actor_log_prob, old_logprobs, advantages, mask, normalizer)
            else:
                actor_loss = self._actor_loss(actor_log_prob, old_logprobs, advantages, exp, normalizer, on_policy)
            actor_ok = self.nonfinite.loss_ok(actor_loss, where="a PPO actor micro-step")
            if actor_ok:
                self.actor_model.backward(actor_loss)
        policy = rl_math.ppo_policy_stats(actor_log_prob.detach(), stored, mask, cliprange=self.cliprange)
        gap = (float(rl_math.masked_mean((actor_log_prob.detach() - stored).abs().float(), mask))
               if unchanged and float(mask.sum()) > 0 else float("nan"))
        if actor_ok and not self.align_overflow:
            self.nonfinite.step(self.actor_model, where="a PPO actor step")

        if self.critic_model is None:  # critic-free: the actor's step is the whole update
            self.micro_stats.append(self._micro_stats(actor_loss, float("nan"), policy, mask, gap))
            return actor_loss, torch.tensor(float("nan"))
        with self.training_gather("critic", self.critic_model):
            value = self._token_values(*batch, packed)[:, :-1]
            critic_loss = self.critic_loss_fn(value[:, start:], old_values[:, start:], returns, mask, normalizer)
            critic_ok = self.nonfinite.loss_ok(critic_loss, where="a PPO critic micro-step")
            if critic_ok:
                self.critic_model.backward(critic_loss)
        if self.align_overflow:  # fp16: both models step together, DeepSpeed's loss scaler decides
            if actor_ok and critic_ok:
                self._aligned_steps()
                self.critic_model.step()
        elif critic_ok:
            self.nonfinite.step(self.critic_model, where="a PPO critic step")

        self.micro_stats.append(self._micro_stats(actor_loss, critic_loss.item(), policy, mask, gap))
        return actor_loss, critic_loss

    @staticmethod
    def _micro_stats(actor_loss: torch.Tensor, critic_loss: float, policy: rl_math.PolicyStats,
                     mask: torch.Tensor, gap: float) -> MicroStepStats:
        return MicroStepStats(
            actor_loss=actor_loss.item(), critic_loss=critic_loss,
            ratio_mean=float(policy.ratio_mean), ratio_max=float(policy.ratio_max),
            ratio_min=float(policy.ratio_min), approx_kl=float(policy.approx_kl),
            clip_frac=float(policy.clip_frac), tokens=int(mask.sum()), logprob_gap=gap,
        )

    def _actor_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    exp: Experience, normalizer: float | None, on_policy: bool) -> torch.Tensor:
        """The actor loss beyond upstream's PPO (rl_algorithms): the clipped surrogate per token, times
        the truncated importance weights (--tis_cap), plus kl_ctl x KL when the KL is a loss term,
        aggregated by --loss_aggregation. Shapes: (B, T - start)."""
        start = exp.start
        mask = exp.action_mask[:, start:].to(logprobs.dtype)
        per_token = rl_algorithms.policy_loss_per_token(logprobs, old_logprobs, advantages, mask,
                                                        cliprange=self.cliprange)
        if self.settings.tis_cap and on_policy:
            # pi_train(old) is the current forward (the policy has not moved): w = min(pi_train / pi_rollout, C).
            # Off-policy the ratio is already taken against the rollout's log-probs (nothing to add).
            per_token = per_token * rl_algorithms.tis_weights(logprobs, exp.logprobs[:, start:], self.settings.tis_cap)
        if not self.settings.kl_in_reward and self.kl_ctl:
            ref = exp.ref_logprobs[:, start:].float()
            # Outside the answer the KL is 0 before it is computed: the log-probs of padding after EOS can
            # be far apart, and k3's exp would overflow there (inf * 0 in the mask, a nan gradient).
            current = torch.where(mask.bool(), logprobs.float(), ref)
            kl = rl_math.kl_penalty(current, ref, estimator=self.kl_estimator)
            per_token = per_token + self.kl_ctl * kl * mask
        return rl_algorithms.aggregate_loss(per_token, mask, self.settings.loss_aggregation, normalizer=normalizer,
                                            max_len=self.max_answer_seq_len)

    # ---------------------------------------------------------------- the losses (upstream names)
    def actor_loss_fn(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
        return rl_math.actor_loss_fn(logprobs, old_logprobs, advantages, mask, cliprange=self.cliprange,
                                     normalizer=normalizer)

    def critic_loss_fn(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
        return rl_math.critic_loss_fn(values, old_values, returns, mask, cliprange_value=self.cliprange_value,
                                      compute_fp32_loss=self.compute_fp32_loss, normalizer=normalizer)

    # ---------------------------------------------------------------- fp16 overflow alignment
    def _check_align_overflow_support(self) -> None:
        for name, engine in (("actor", self.actor_model), ("critic", self.critic_model)):
            check = getattr(engine.optimizer, "check_overflow", None)
            if check is None or "external" not in inspect.signature(check).parameters:
                raise UserError(
                    f"--align_overflow needs DeepSpeed's external overflow check "
                    f"(optimizer.check_overflow(external=True) and optimizer.skip_step), which the {name} "
                    f"optimizer {type(engine.optimizer).__name__} of this DeepSpeed does not provide; drop "
                    "--align_overflow (or use bf16)"
                )

    def _aligned_steps(self) -> None:
        """Upstream's rule: if either model overflowed, both skip their step (fp16 only)."""
        actor_overflow = self.actor_model.optimizer.check_overflow(external=True)
        critic_overflow = self.critic_model.optimizer.check_overflow(external=True)
        if actor_overflow and not critic_overflow:
            self.critic_model.optimizer.skip_step = True
            print_rank_0("OVERFLOW: actor overflow, skipping both actor and critic steps")
        elif critic_overflow and not actor_overflow:
            self.actor_model.optimizer.skip_step = True
            print_rank_0("OVERFLOW: critic overflow, skipping both actor and critic steps")
        elif actor_overflow and critic_overflow:
            print_rank_0("OVERFLOW: actor and critic overflow, skipping both actor and critic steps")
        self.actor_model.step()

    def dump_model_norms(self, tag: str) -> None:
        """Upstream's debugging helper: every rank's parameter norm of the four models, printed by
        rank 0 (a collective: call it on every rank)."""
        rank = get_rank()
        models = {"actor": self.actor_model, "ref": self.ref_model, "critic": self.critic_model,
                  "reward": self.reward_model}
        for name, model in models.items():
            if model is not None:
                print_all_ranks(f"{tag} {name}_model_norm", get_model_norm(model), rank)

    def get_overflow(self) -> tuple[bool, bool]:
        """(actor, critic) fp16 loss-scale overflow of the last step; never with bf16 / fp32."""
        if self.dtype != "fp16":
            return False, False
        critic = self.critic_model
        return (bool(getattr(self.actor_model.optimizer, "overflow", False)),
                critic is not None and bool(getattr(critic.optimizer, "overflow", False)))

    # ---------------------------------------------------------------- modes
    def _validate_training_mode(self) -> None:
        assert self.actor_model.module.training
        assert self.critic_model is None or self.critic_model.module.training

    def _validate_evaluation_mode(self) -> None:
        assert not self.actor_model.module.training
        assert self.critic_model is None or not self.critic_model.module.training
        assert not self.ref_model.module.training
        if self.reward_model is not None:
            assert not self.reward_model.module.training

    def train(self) -> None:
        self.actor_model.train()
        if self.critic_model is not None:
            self.critic_model.train()

    # ---------------------------------------------------------------- summaries
    def pop_micro_stats(self) -> list[MicroStepStats]:
        stats, self.micro_stats = self.micro_stats, []
        return stats


class DeepSpeedPPOTrainerUnsupervised(DeepSpeedPPOTrainer):
    """PPO-ptx (InstructGPT eq. 2): after each PPO micro-step the actor also takes a language-model
    step on a pretraining batch, weighted by ``unsup_coef``. The actor's gradient accumulation is
    doubled so the PPO and ptx gradients of a micro-batch land in the same optimizer update."""

    def train_unsupervised(self, inputs: dict[str, torch.Tensor], unsup_coef: float) -> torch.Tensor:
        self._validate_training_mode()
        with self.training_gather("actor", self.actor_model):
            outputs = self.actor_model(**inputs, use_cache=False)
            loss = outputs.loss
            if self.compute_fp32_loss:
                loss = rl_math.causal_lm_loss(outputs.logits, inputs["labels"], fp32=True)
            ok = self.nonfinite.loss_ok(loss, where="a PPO-ptx micro-step")
            if ok:
                self.actor_model.backward(unsup_coef * loss)
        if ok:
            self.nonfinite.step(self.actor_model, where="a PPO-ptx step")
        return loss
