"""The PPO update of step 3 (upstream's ``train_rlhf`` half of ``ppo_trainer.py``): the schedule of
micro-steps over a prepared rollout, the actor and critic steps, the PPO-ptx step, fp16 overflow
alignment. Its passes run through the :class:`~dschat.rlhf.scoring_passes.ScoringPasses` the experience
maker uses too; its losses are the trainer's :class:`~dschat.rlhf.ppo_formulas.PPOFormulas`.

The contract (the upstream differences are explained in docs/upstream.md#step-3-ppo):

* **Off-policy guard** (:class:`~dschat.rlhf.config.BatchPlan`): when every optimizer step covers whole rollouts
  the PPO ratio is exactly 1 and the update uses the current log-probs as the old ones (TRL's
  shortcut); otherwise the ratio is taken against the stored behaviour log-probs. Either way the
  measured ratio, approx-KL and clip fraction against the stored log-probs are recorded.
* Losses are normalised over the **whole optimizer step** (token mean over all its micro-batches
  and ranks, OpenRLHF-style) when each step lies inside one rollout; else per micro-batch as
  upstream.
* **Beyond PPO** (``--algorithm``): the critic-free algorithms step the actor alone, with the loss
  aggregation, KL term and truncated importance sampling of :mod:`dschat.rl_math.critic_free`.
* ``--align_overflow`` works only with fp16 and a DeepSpeed that exposes upstream's external
  overflow check (fp16-optimizer internals); elsewhere it is refused or a no-op with a warning. Under
  it the actor and critic train each micro-step together or not at all (a NaN/inf loss of either
  skips both), so their gradient accumulations stay aligned.
"""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, replace

import torch
from deepspeed import DeepSpeedEngine

from dschat.rl_math.logprobs import causal_lm_loss
from dschat.rl_math.ppo import PolicyStats, ppo_policy_stats
from dschat.rl_math.stats import masked_mean, masked_whiten
from dschat.errors import UserError
from dschat.models.packing import PackedRows
from dschat.rlhf.config import BatchPlan
from dschat.rlhf.experience import Experience, sum_over_ranks
from dschat.rlhf.ppo_formulas import PPOFormulas
from dschat.rlhf.scoring_passes import ScoringPasses
from dschat.runtime.dist import get_world_size, print_rank_0
from dschat.training.nonfinite import NonFiniteGuard

__all__ = ["MicroStepStats", "PPOUpdate", "Schedule"]

#: The micro-steps of one rollout in training order: ``(ppo_epoch, experience, ptx batch or None)``.
Schedule = list[tuple[int, Experience, "dict[str, torch.Tensor] | None"]]


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


class PPOUpdate:
    """The update on the actor and critic engines of ``passes`` (``critic`` None for the critic-free
    algorithms): :meth:`schedule`, then one :meth:`train_rlhf` per micro-step (and
    :meth:`train_unsupervised` with PPO-ptx). ``plan`` is the run's batch plan, ``ppo_epochs`` the
    passes over a rollout. A NaN/inf loss or gradient skips that model's step (``nonfinite``);
    ``align_overflow`` (fp16 with a critic) makes both models skip a step either overflowed, and a
    micro-step either model's loss is NaN/inf in (both losses are checked before either backward)."""

    def __init__(self, passes: ScoringPasses, formulas: PPOFormulas, plan: BatchPlan, *, ppo_epochs: int,
                 nonfinite: NonFiniteGuard, dtype: str, align_overflow: bool) -> None:
        self.passes = passes
        self.formulas = formulas
        self.plan = plan
        self.ppo_epochs = ppo_epochs
        self.nonfinite = nonfinite
        self.dtype = dtype
        self.actor_model: DeepSpeedEngine = passes.models["actor"]
        self.critic_model: DeepSpeedEngine | None = passes.models["critic"]
        self.micro_stats: list[MicroStepStats] = []
        self._said_unaligned = False
        # The actor's optimizer steps when the current rollout was prepared (the on-policy check).
        self._rollout_actor_steps: int | None = None
        # Critic-free: there is no second model to align with; the actor steps on its own.
        self.align_overflow = align_overflow and dtype == "fp16" and self.critic_model is not None
        if self.align_overflow:
            self._check_align_overflow_support()

    # ---------------------------------------------------------------- schedule
    def mark_rollout(self) -> None:
        """A rollout is being prepared: the on-policy shortcut of :meth:`train_rlhf` holds only
        while the actor takes no optimizer step after this."""
        self._rollout_actor_steps = getattr(self.actor_model, "global_steps", None)

    def _step_count(self, exp: Experience) -> float:
        """What this micro-batch adds to its optimizer step's loss normaliser: tokens ('token'
        aggregation) or answers with tokens ('sequence', 'token_sum')."""
        mask = exp.action_mask[:, exp.start:]
        if self.formulas.settings.loss_aggregation == "token":
            return float(mask.sum())
        return float((mask.sum(1) > 0).sum())

    def schedule(self, exp_dataset: list[Experience], unsup_dataset: list[dict] | None) -> Schedule:
        """The micro-steps of one rollout in training order: ``(ppo_epoch, experience, ptx batch)``.

        Upstream's order: the first PPO epoch in rollout order, then each epoch after an independent
        ``random.shuffle`` of both lists. With step normalisation each entry carries the token count
        of its optimizer step (all micro-batches, all ranks) divided by ``GA x world``: DeepSpeed divides
        each backward by its GA and averages over ranks, so the step's gradient is the token mean over
        the step. With PPO-ptx the actor's GA is ``2 x GA`` (PPO and ptx backward passes), so its PPO
        gradient is half that, weighted against the ptx loss as upstream's. Collective where it
        normalises (one all-reduce).
        """
        exp_list = list(exp_dataset)
        unsup_list = list(unsup_dataset) if unsup_dataset is not None else [None] * len(exp_list)
        steps: Schedule = []
        for ppo_ep in range(self.ppo_epochs):
            if ppo_ep > 0:
                random.shuffle(exp_list)
                random.shuffle(unsup_list)
            steps.extend((ppo_ep, e, u) for e, u in zip(exp_list, unsup_list))
        if not self.plan.step_normalizable or not self._at_optimizer_step_start():
            return steps
        ga, world = self.plan.gradient_accumulation_steps, get_world_size()
        tokens = [self._step_count(exp) for _, exp, _ in steps]
        groups = [sum(tokens[i:i + ga]) for i in range(0, len(tokens), ga)]
        groups = sum_over_ranks(groups, self.passes.device)
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
        """No actor optimizer step since :meth:`mark_rollout` (True for a caller that never called
        it: the batch plan's word is then all there is)."""
        before = self._rollout_actor_steps
        now = getattr(self.actor_model, "global_steps", None)
        return before is None or now is None or now == before

    # ---------------------------------------------------------------- training
    def train_rlhf(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """One PPO micro-step: actor update, then critic update. Returns (actor_loss, critic_loss)."""
        formulas, passes = self.formulas, self.passes
        if not self.actor_model.module.training:
            self.train()  # an upstream-style caller may go straight from generate_experience
        start = exp.start
        mask = exp.action_mask[:, start:]
        with torch.no_grad():
            old_values = formulas._old_values(exp)  # the value loss clips around them
            if exp.advantages is not None:  # stored by prepare_rollout (the step-3 loop always calls it)
                advantages, returns = exp.advantages, exp.returns
            else:  # an upstream-style caller (no prepare_rollout): per micro-batch, as upstream
                advantages, returns = formulas.advantages_and_returns(exp, old_values, formulas._old_rewards(exp),
                                                                      critic=self.critic_model is not None)
                if formulas.whiten_advantages and int(mask.sum()) > 1:  # REINFORCE++, --whiten_advantages:
                    advantages = masked_whiten(advantages, mask.bool())  # over this micro-batch only
        normalizer = exp.loss_normalizer
        if normalizer is None and float(mask.sum()) == 0:
            normalizer = 1.0  # a micro-batch of dropped rows only: zero loss, not 0/0

        batch = (exp.seq, exp.attention_mask, exp.position_ids)
        packed = passes.packed(exp.seq, exp.attention_mask, "actor", "critic")
        stored = exp.logprobs[:, start:]
        # On-policy (every optimizer step covers whole rollouts): the ratio is 1 by construction,
        # so use the current log-probs as the old ones (as TRL's PPO trainer does); dropout noise cannot inflate it.
        # Checked, not assumed: once the actor has stepped since the rollout, the stored ones.
        unchanged = self._policy_unchanged_since_rollout()
        on_policy = self.plan.on_policy and unchanged
        # A non-finite loss skips that model's backward and step (--max_nonfinite_steps); with more
        # than one micro-step per optimizer step, its accumulation then continues on the next one.
        # --align_overflow: both losses are checked before either backward, so both models train
        # this micro-step or neither (a lone backward would carry its gradient into the next one).
        aligned = self.align_overflow
        critic_loss = torch.tensor(float("nan"))  # critic-free: there is none
        with passes.training_gather("actor", self.actor_model):  # forward and backward; the step after it
            actor_log_prob = passes.token_log_probs("actor", self.actor_model, *batch, packed)[:, start:]
            old_logprobs = actor_log_prob.detach() if on_policy else stored
            actor_loss = formulas.policy_loss(actor_log_prob, old_logprobs, advantages, exp, normalizer, on_policy)
            if aligned:
                with passes.training_gather("critic", self.critic_model):
                    critic_loss = self._critic_loss(exp, batch, packed, old_values, returns, mask, normalizer)
                    actor_ok = critic_ok = self.nonfinite.loss_ok(actor_loss, critic_loss,
                                                                  where="a PPO micro-step (actor and critic)")
                    if critic_ok:
                        self.critic_model.backward(critic_loss)
            else:
                actor_ok = self.nonfinite.loss_ok(actor_loss, where="a PPO actor micro-step")
            if actor_ok:
                self.actor_model.backward(actor_loss)
        policy = ppo_policy_stats(actor_log_prob.detach(), stored, mask, cliprange=formulas.cliprange,
                                  cliprange_high=formulas.settings.cliprange_high,
                                  level=formulas.settings.importance_sampling_level)
        gap = (float(masked_mean((actor_log_prob.detach() - stored).abs().float(), mask))
               if unchanged and float(mask.sum()) > 0 else float("nan"))
        if aligned:  # fp16: both models step together, DeepSpeed's loss scaler decides
            if actor_ok:
                self._aligned_steps()
        elif actor_ok:
            self.nonfinite.step(self.actor_model, where="a PPO actor step")

        if self.critic_model is None:  # critic-free: the actor's step is the whole update
            self.micro_stats.append(self._micro_stats(actor_loss, float("nan"), policy, mask, gap))
            return actor_loss, critic_loss
        if not aligned:
            with passes.training_gather("critic", self.critic_model):
                critic_loss = self._critic_loss(exp, batch, packed, old_values, returns, mask, normalizer)
                critic_ok = self.nonfinite.loss_ok(critic_loss, where="a PPO critic micro-step")
                if critic_ok:
                    self.critic_model.backward(critic_loss)
            if critic_ok:
                self.nonfinite.step(self.critic_model, where="a PPO critic step")

        self.micro_stats.append(self._micro_stats(actor_loss, critic_loss.item(), policy, mask, gap))
        return actor_loss, critic_loss

    def _critic_loss(self, exp: Experience, batch: tuple[torch.Tensor, ...], packed: PackedRows | None,
                     old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                     normalizer: float | None) -> torch.Tensor:
        """The critic's forward and value loss of a micro-step (inside its training gather)."""
        start = exp.start
        value = self.passes.token_values(*batch, packed)[:, :-1]
        return self.formulas.critic_loss_fn(value[:, start:], old_values[:, start:], returns, mask, normalizer)

    @staticmethod
    def _micro_stats(actor_loss: torch.Tensor, critic_loss: float, policy: PolicyStats,
                     mask: torch.Tensor, gap: float) -> MicroStepStats:
        return MicroStepStats(
            actor_loss=actor_loss.item(), critic_loss=critic_loss,
            ratio_mean=float(policy.ratio_mean), ratio_max=float(policy.ratio_max),
            ratio_min=float(policy.ratio_min), approx_kl=float(policy.approx_kl),
            clip_frac=float(policy.clip_frac), tokens=int(mask.sum()), logprob_gap=gap,
        )

    def train_unsupervised(self, inputs: dict[str, torch.Tensor], unsup_coef: float) -> torch.Tensor:
        """PPO-ptx (InstructGPT eq. 2): a language-model step of the actor on a pretraining batch,
        weighted by ``unsup_coef``. Returns the (unweighted) loss."""
        self._validate_training_mode()
        with self.passes.training_gather("actor", self.actor_model):
            outputs = self.actor_model(**inputs, use_cache=False)
            loss = outputs.loss
            if self.formulas.compute_fp32_loss:
                loss = causal_lm_loss(outputs.logits, inputs["labels"], fp32=True)
            ok = self.nonfinite.loss_ok(loss, where="a PPO-ptx micro-step")
            if ok:
                self.actor_model.backward(unsup_coef * loss)
        if ok:
            self.nonfinite.step(self.actor_model, where="a PPO-ptx step")
        return loss

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
        """Upstream's rule: if either model overflowed, both skip their step (fp16 only). An
        optimizer step both models applied ends a run of non-finite skips, as
        :meth:`~dschat.training.nonfinite.NonFiniteGuard.step` does for a model stepping alone."""
        boundary = (self.actor_model.is_gradient_accumulation_boundary()
                    and self.critic_model.is_gradient_accumulation_boundary())
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
        self.critic_model.step()
        if boundary:
            self.nonfinite.applied(self.actor_model, self.critic_model)

    def get_overflow(self) -> tuple[bool, bool]:
        """(actor, critic) fp16 loss-scale overflow of the last step; never with bf16 / fp32."""
        if self.dtype != "fp16":
            return False, False
        critic = self.critic_model
        return (bool(getattr(self.actor_model.optimizer, "overflow", False)),
                critic is not None and bool(getattr(critic.optimizer, "overflow", False)))

    # ---------------------------------------------------------------- modes and summaries
    def _validate_training_mode(self) -> None:
        assert self.actor_model.module.training
        assert self.critic_model is None or self.critic_model.module.training

    def train(self) -> None:
        self.actor_model.train()
        if self.critic_model is not None:
            self.critic_model.train()

    def pop_micro_stats(self) -> list[MicroStepStats]:
        stats, self.micro_stats = self.micro_stats, []
        return stats
