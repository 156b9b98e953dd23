"""Step-3 start-up checks: the batch arithmetic of one PPO iteration, and contradictory flags.

Upstream's README warns that PPO "diverges" unless ``per_device_generation_batch_size ==
per_device_training_batch_size`` and ``ppo_epochs == generation_batches == 1``.
The underlying rule, which TRL made explicit (PR #3493), is about *when optimizer steps happen*:

* one rollout is ``per_device_generation_batch_size x generation_batches`` prompts per rank, and is
  trained as ``M = rollout / per_device_training_batch_size`` micro-batches, ``ppo_epochs`` times:
  ``M x ppo_epochs`` micro-steps per rollout;
* the actor takes an optimizer step every ``gradient_accumulation_steps`` micro-steps;
* the PPO ratio ``pi_theta / pi_old`` is exactly 1 on every micro-step only if no optimizer step
  happens between generating a rollout and the last micro-step trained on it, i.e. iff
  ``gradient_accumulation_steps`` is a multiple of ``M x ppo_epochs`` (every optimizer step covers
  whole rollouts).

:func:`plan_batches` derives these numbers once and refuses a rollout that does not split into whole
micro-batches; :func:`validate_step3_args` turns every other contradictory flag combination into one
:class:`~dschat.errors.UserError` line before any model is loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dschat.errors import UserError
from dschat.runtime.ds_config import check_optimizer_offload, check_param_offload

__all__ = ["BatchPlan", "plan_batches", "validate_step3_args", "num_total_iters", "OFF_POLICY_WARNING"]

OFF_POLICY_WARNING = (
    "WARNING: this configuration is off-policy: an optimizer step happens before every micro-batch "
    "of a rollout has been trained (gradient_accumulation_steps={ga} is not a multiple of "
    "{micro} micro-batches per rollout x {epochs} ppo_epochs). The PPO ratio is computed against the "
    "rollout's stored log-probs and clipped at 1 +- {clip}; upstream found such runs diverge "
    "(DeepSpeed-Chat README 'Instability', TRL PR #3493). Watch ratio_max / approx_kl / clip_frac in "
    "the logs, or use per_device_generation_batch_size == per_device_training_batch_size and "
    "ppo_epochs == generation_batches == 1."
)


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of one PPO iteration on one rank (all counts per rank).

    ``micro_batches_per_rollout`` (M) micro-batches of ``training_batch_size`` rows make one rollout
    of ``rollout_size`` rows; ``micro_steps_per_rollout = M x ppo_epochs``. ``on_policy`` says every
    optimizer step covers whole rollouts. ``step_normalizable`` says every optimizer step lies inside
    one rollout (``gradient_accumulation_steps`` divides the rollout's micro-steps), so the token
    count of the whole step is known when its first micro-batch is trained.
    """

    generation_batch_size: int
    generation_batches: int
    training_batch_size: int
    ppo_epochs: int
    gradient_accumulation_steps: int
    gradient_accumulation_steps_actor: int
    world_size: int
    ptx: bool

    @property
    def rollout_size(self) -> int:
        return self.generation_batch_size * self.generation_batches

    @property
    def micro_batches_per_rollout(self) -> int:
        return self.rollout_size // self.training_batch_size

    @property
    def micro_steps_per_rollout(self) -> int:
        return self.micro_batches_per_rollout * self.ppo_epochs

    @property
    def on_policy(self) -> bool:
        return self.gradient_accumulation_steps % self.micro_steps_per_rollout == 0

    @property
    def step_normalizable(self) -> bool:
        return self.micro_steps_per_rollout % self.gradient_accumulation_steps == 0

    @property
    def drop_short_batches(self) -> bool:
        """Whether the prompt loaders drop each rank's last, short batch. With several micro-batches
        per generation batch, a short one would make a rollout of fewer micro-steps, and every later
        optimizer step would straddle two rollouts (its first micro-batches trained with the on-policy
        shortcut after the policy moved, its token normaliser wrong). With one micro-batch per
        generation batch a short batch is still one micro-step, so nothing is dropped (as upstream)."""
        return self.generation_batch_size > self.training_batch_size

    @property
    def optimizer_steps_per_rollout(self) -> float:
        return self.micro_steps_per_rollout / self.gradient_accumulation_steps

    def describe(self) -> str:
        """One line for the start-up log."""
        policy = "on-policy" if self.on_policy else "OFF-POLICY"
        return (
            f"PPO batch plan (per rank): rollout = {self.generation_batch_size} prompts x "
            f"{self.generation_batches} generation batches = {self.rollout_size} rows -> "
            f"{self.micro_batches_per_rollout} micro-batches of {self.training_batch_size} x "
            f"{self.ppo_epochs} ppo epochs = {self.micro_steps_per_rollout} micro-steps; "
            f"gradient_accumulation_steps {self.gradient_accumulation_steps} "
            f"(actor {self.gradient_accumulation_steps_actor}{', PPO-ptx' if self.ptx else ''}) -> "
            f"{self.optimizer_steps_per_rollout:g} optimizer steps per rollout; {policy}"
        )

    def off_policy_warning(self, cliprange: float) -> str:
        return OFF_POLICY_WARNING.format(
            ga=self.gradient_accumulation_steps, micro=self.micro_batches_per_rollout,
            epochs=self.ppo_epochs, clip=cliprange,
        )


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"--{name} must be a positive integer, got {value!r}")
    return value


def plan_batches(args: Any, world_size: int, *, ptx: bool = False) -> BatchPlan:
    """Derive the :class:`BatchPlan` from the step-3 flags; refuse a rollout that does not split.

    Upstream's ``MiniDataset`` silently made a short last micro-batch (and its ``num_total_iters``
    counted fractional micro-batches); here every generation batch must split exactly.
    """
    gen_bs = _positive("per_device_generation_batch_size", args.per_device_generation_batch_size)
    gen_batches = _positive("generation_batches", args.generation_batches)
    train_bs = _positive("per_device_training_batch_size", args.per_device_training_batch_size)
    epochs = _positive("ppo_epochs", args.ppo_epochs)
    ga = _positive("gradient_accumulation_steps", args.gradient_accumulation_steps)
    if gen_bs % train_bs != 0:
        # MiniDataset splits each generation batch on its own (as upstream), so a generation batch
        # that does not split would leave a short micro-batch in every one of them.
        raise UserError(
            f"a generation batch of per_device_generation_batch_size {gen_bs} prompts does not split into "
            f"micro-batches of per_device_training_batch_size {train_bs}; make the training batch size "
            f"divide {gen_bs} (recommended: equal to the generation batch size)"
        )
    return BatchPlan(gen_bs, gen_batches, train_bs, epochs, ga, ga * 2 if ptx else ga, world_size, ptx)


def validate_step3_args(args: Any, *, accelerator: str, dtype: str) -> list[str]:
    """Refuse contradictory step-3 flags with one :class:`UserError`; return warnings to print.

    ``accelerator`` is DeepSpeed's device name (``"cuda"``, ``"cpu"``, ...) and ``dtype`` the dtype
    training actually uses (``resolve_dtype``: fp16 becomes fp32 on a CPU). Checks, in the order a
    user would hit them: ZeRO stages, lengths, decoding, Hybrid Engine tensor parallelism (upstream
    asserted), upstream's unsupported ZeRO-2 + HE + offload combination (upstream raised
    ValueError), DeepSpeed's offload rules (``--offload`` needs ZeRO >= 1 for actor and critic; the
    reference / reward offload needs the actor / critic at ZeRO-3), mixed-precision LoRA (upstream
    asserted inside main), ``--align_overflow`` outside fp16 (upstream used fp16-optimizer
    internals).
    """
    warnings: list[str] = []
    for name in ("actor_zero_stage", "critic_zero_stage"):
        if getattr(args, name) not in (0, 1, 2, 3):
            raise UserError(f"--{name} must be 0, 1, 2 or 3, got {getattr(args, name)}")
    for name in ("max_prompt_seq_len", "max_answer_seq_len", "num_train_epochs", "print_answers_interval"):
        _positive(name, getattr(args, name))
    if args.max_prompt_seq_len < 2:
        raise UserError(f"--max_prompt_seq_len must be >= 2 (the reward model reads the prompt length), "
                        f"got {args.max_prompt_seq_len}")
    if args.num_warmup_steps < 0:
        raise UserError(f"--num_warmup_steps must be >= 0, got {args.num_warmup_steps}")
    if args.enable_test_mode and args.test_stop_step < 0:
        raise UserError(f"--test_stop_step must be >= 0, got {args.test_stop_step}")
    if getattr(args, "deepspeed_config", None):
        raise UserError(
            "--deepspeed_config is not used by dschat: the DeepSpeed configs of the five step-3 engines "
            "are built from the flags (--actor_zero_stage, --critic_zero_stage, --offload, --dtype, ...); drop it"
        )
    if args.decoding == "sample":
        if not args.temperature > 0:
            raise UserError(f"--temperature must be > 0 for --decoding sample, got {args.temperature}")
        if not 0 < args.top_p <= 1:
            raise UserError(f"--top_p must be in (0, 1], got {args.top_p}")
        if args.top_k < 0:
            raise UserError(f"--top_k must be >= 0, got {args.top_k}")
    for name in ("actor_lora_dim", "critic_lora_dim"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name} must be >= 0 (0: no LoRA), got {getattr(args, name)}")
    if args.inference_tp_size < 1:
        raise UserError(f"--inference_tp_size must be >= 1, got {args.inference_tp_size}")
    if args.inference_tp_size > 1 and args.actor_zero_stage != 3:
        raise UserError(
            f"--inference_tp_size {args.inference_tp_size} needs --actor_zero_stage 3 (the Hybrid Engine "
            "shards the gathered ZeRO-3 weights for tensor-parallel generation); use --actor_zero_stage 3 "
            "or --inference_tp_size 1"
        )
    if (args.actor_zero_stage == 2 and args.critic_zero_stage == 2 and args.enable_hybrid_engine
            and args.offload and args.actor_lora_dim == 0):
        # Upstream: ValueError("The combination of [actor_zero_stage==2, critic_zero_stage==2,
        # enable_hybrid_engine=True, offload=True, lora=False] is currently unsupported due to
        # training instability!"); its CI skips the same combination.
        raise UserError(
            "the combination --actor_zero_stage 2 --critic_zero_stage 2 --enable_hybrid_engine --offload "
            "without actor LoRA is unsupported due to training instability (as upstream); drop one of "
            "them or add --actor_lora_dim"
        )
    # DeepSpeed's offload rules (dschat.runtime.ds_config): --offload moves the actor's and the critic's
    # optimizer state, which needs ZeRO >= 1 for both; the reference/EMA and reward models are ZeRO-3
    # only when the actor / critic is, and parameter offload exists only under ZeRO-3.
    if args.offload:
        check_optimizer_offload(args.actor_zero_stage, "--actor_zero_stage")
        check_optimizer_offload(args.critic_zero_stage, "--critic_zero_stage")
    if args.offload_reference_model:
        check_param_offload("--offload_reference_model", args.actor_zero_stage, "--actor_zero_stage")
    if args.offload_reward_model:
        check_param_offload("--offload_reward_model", args.critic_zero_stage, "--critic_zero_stage")
    if args.enable_mixed_precision_lora:
        if args.actor_lora_dim <= 0 or args.actor_zero_stage != 3:
            raise UserError(
                "--enable_mixed_precision_lora (ZeRO++ quantised frozen weights) needs actor LoRA and "
                "ZeRO-3: add --actor_lora_dim N --actor_zero_stage 3"
            )
        if accelerator != "cuda":
            raise UserError(
                f"--enable_mixed_precision_lora needs DeepSpeed's CUDA quantisation kernels; the "
                f"accelerator here is {accelerator!r}. Drop the flag on this machine"
            )
    if args.only_optimize_lora and args.actor_lora_dim <= 0 and args.critic_lora_dim <= 0:
        raise UserError("--only_optimize_lora needs --actor_lora_dim and/or --critic_lora_dim > 0")
    if args.align_overflow and dtype != "fp16":
        warnings.append(
            f"WARNING: --align_overflow has no effect when training in {dtype}: only fp16 loss scaling "
            "overflows (upstream used fp16-optimizer internals, DSE #745)"
        )
    return warnings


def num_total_iters(plan: BatchPlan, num_prompt_batches: int, num_unsup_batches: int | None, epochs: int) -> int:
    """Optimizer steps of the whole run, for the LR schedule (upstream's formula, rounded up).

    ``epochs x min(prompt batches, ptx batches) x (gen_bs / train_bs) x ppo_epochs / GA``.
    """
    batches = num_prompt_batches if num_unsup_batches is None else min(num_prompt_batches, num_unsup_batches)
    micro_steps = batches * (plan.generation_batch_size / plan.training_batch_size) * plan.ppo_epochs
    return max(1, math.ceil(epochs * micro_steps / plan.gradient_accumulation_steps))
