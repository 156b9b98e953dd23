"""Step 3's typed configuration: the flat flags (upstream's names) read once into frozen parts.

:class:`Step3Config` is built by step 3's ``main`` right after the flags are checked and the ranks
are up (the batch plan needs the world size), by :func:`step3_config`. Its parts, one per reader:

* ``models`` (:class:`ModelsConfig`): the actor's and critic's folders, dropout, optimizer and LoRA
  settings (:class:`ModelSpec` each), EMA, dtype -- what :class:`~dschat.rlhf.rlhf_engine.DeepSpeedRLHFEngine`
  builds;
* ``zero`` (:class:`ZeroConfig`): ZeRO stages, offload, the Hybrid Engine and the DeepSpeed batch
  keys -- the engines' DeepSpeed configs;
* ``rollout`` (:class:`RolloutConfig`): how the actor decodes;
* ``ppo`` (:class:`PPOConfig`): the PPO update's hyperparameters and the scoring passes' settings;
* ``algorithm`` (:class:`AlgorithmSettings`, :func:`resolve_algorithm`): ``--algorithm`` and its
  family of flags, every ``auto`` resolved and contradictions refused;
* ``batches`` (:class:`BatchPlan`, :func:`plan_batches`): the batch arithmetic and the on-policy rule;
* ``reward`` (:class:`~dschat.rewards.RewardMix`): the reward model's and functions' weights;
* ``evaluation`` (:class:`EvalConfig`): the held-out evaluation;
* ``checkpoint`` (:class:`CheckpointConfig`): checkpoints and resume (the attribute names
  :class:`~dschat.training.checkpoint.Checkpointer` reads).

Code written against upstream hands ``DeepSpeedRLHFEngine`` / ``DeepSpeedPPOTrainer`` a Namespace of
upstream's flags only. :func:`~dschat.cli.step3.complete_step3_args` fills dschat's flags in at the step-3 parser's
defaults, once, and the part builders read the completed Namespace: this module is the only reader
of such a Namespace.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from dschat.cli.step3 import complete_step3_args
from dschat.data.unsupervised import unsupervised_training_enabled
from dschat.errors import UserError
from dschat.rewards import RewardMix, check_timeout
from dschat.rl_math.critic_free import ALGORITHMS, GROUP_ALGORITHMS, IMPORTANCE_SAMPLING_LEVELS, has_critic
from dschat.rlhf.rollout.sampling import DecodingSettings

__all__ = [
    "AlgorithmSettings", "BatchPlan", "CheckpointConfig", "EvalConfig", "ModelSpec", "ModelsConfig",
    "OFF_POLICY_WARNING", "PPOConfig", "RolloutConfig", "Step3Config", "ZeroConfig", "checkpoint_config",
    "eval_config", "models_config", "num_total_iters", "plan_batches", "positive_flag",
    "ppo_config", "resolve_algorithm", "rollout_config", "step3_config", "zero_config",
]


# ================================================================== the algorithm
@dataclass(frozen=True)
class AlgorithmSettings:
    """What the trainer does, per algorithm (docs/algorithms.md)."""

    algorithm: str  # one of rl_math.critic_free.ALGORITHMS
    num_generations: int  # K answers per prompt, consecutive rows of a generation batch
    kl_in_reward: bool  # -kl_ctl x KL in the reward (else kl_ctl x KL as a loss term)
    kl_estimator: str  # k1 | k2 | k3
    loss_aggregation: str  # token | sequence | token_sum
    scale_by_std: bool  # GRPO divides by the group's std (not Dr.GRPO)
    whiten_advantages: bool  # whiten over the rollout's tokens, all ranks (REINFORCE++ always)
    tis_cap: float  # truncated importance sampling cap, 0 = off
    # DAPO / GSPO options (docs/algorithms.md#dapo-and-gspo-options); the defaults are off
    cliprange_high: float | None = None  # upper ratio clip 1 + this (None: --cliprange)
    dual_clip: float = 0.0  # a negative advantage's loss is at most C x |A| (0: off)
    overlong_buffer_len: int = 0  # soft overlong punishment over the last L answer tokens (0: off)
    overlong_penalty_factor: float = 1.0  # its largest penalty
    mask_truncated_answers: bool = False  # answers without EOS leave the loss
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    dynamic_sampling: bool = False  # drop groups of equal rewards, sample more (grpo, rloo)
    max_sampling_rounds: int = 4  # generation batches one batch may draw with dynamic_sampling

    @property
    def critic(self) -> bool:
        """Whether a critic (value model) is built, trained, checkpointed and saved."""
        return has_critic(self.algorithm)

    @property
    def upstream_ppo_loss(self) -> bool:
        """PPO exactly as upstream computes its actor loss (no TIS, KL in the reward, token mean, none of
        the DAPO / GSPO options)."""
        return (self.algorithm == "ppo" and self.tis_cap == 0.0 and self.kl_in_reward
                and self.cliprange_high is None and not self.dual_clip and not self.overlong_buffer_len
                and not self.mask_truncated_answers and self.importance_sampling_level == "token")

    def describe(self) -> str:
        """One line for the start-up log."""
        kl = "in the reward" if self.kl_in_reward else "as a loss term"
        extra = f", TIS cap {self.tis_cap:g}" if self.tis_cap else ""
        if self.cliprange_high is not None:
            extra += f", clip-higher {self.cliprange_high:g}"
        if self.dual_clip:
            extra += f", dual-clip {self.dual_clip:g}"
        if self.overlong_buffer_len:
            extra += f", overlong penalty {self.overlong_penalty_factor:g} over the last {self.overlong_buffer_len} tokens"
        if self.mask_truncated_answers:
            extra += ", answers without EOS masked out of the loss"
        if self.importance_sampling_level != "token":
            extra += ", sequence-level importance ratio (GSPO)"
        extra += f", dynamic sampling (at most {self.max_sampling_rounds} rounds)" if self.dynamic_sampling else ""
        if not self.kl_in_reward and self.kl_estimator == "k1":
            # d/dtheta of (log pi - log pi_ref) is the score function, whose mean over the policy's own
            # samples is 0: as a loss term k1 pulls nowhere on average. k2's expected gradient is that of
            # KL(pi || pi_ref), k3's that of the reverse KL(pi_ref || pi): both pull toward the reference.
            extra += ("; WARNING: the k1 estimator as a loss term has zero expected gradient on-policy, so it does "
                      "not hold the actor near the reference: use --kl_estimator k3 (the default here) or k2")
        return (f"algorithm {self.algorithm}: {self.num_generations} answer(s) per prompt, KL ({self.kl_estimator}) "
                f"{kl}, loss aggregation {self.loss_aggregation}"
                f"{', no critic' if not self.critic else ''}{extra}")


def resolve_algorithm(args: object) -> AlgorithmSettings:
    """The :class:`AlgorithmSettings` of the ``--algorithm`` family of flags (``--algorithm``,
    ``--num_generations``, ``--dr_grpo``, ``--loss_aggregation``, ``--kl_in_reward``, ``--kl_estimator``,
    ``--tis_cap``, ``--whiten_advantages``, and the DAPO / GSPO options ``--cliprange_high``, ``--dual_clip``,
    ``--overlong_buffer_len``, ``--overlong_penalty_factor``, ``--mask_truncated_answers``,
    ``--importance_sampling_level``, ``--dynamic_sampling``, ``--max_sampling_rounds``), every ``auto`` resolved per algorithm; refuses
    contradictory flags (one :class:`~dschat.errors.UserError` line each). An upstream-style
    Namespace without these flags gets upstream's PPO."""
    args = complete_step3_args(args)
    algorithm = args.algorithm
    if algorithm not in ALGORITHMS:
        raise UserError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    k = args.num_generations
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"--num_generations must be a positive integer, got {k!r}")
    if algorithm in GROUP_ALGORITHMS and k < 2:
        raise UserError(f"--algorithm {algorithm} compares answers to the same prompt: give --num_generations 2 "
                        "or more (e.g. 4)")
    gen_bs = args.per_device_generation_batch_size
    if isinstance(gen_bs, int) and gen_bs % k != 0:
        raise UserError(f"--num_generations {k} does not divide --per_device_generation_batch_size {gen_bs}: a "
                        "generation batch holds whole groups of K answers to a prompt; make the batch a multiple "
                        f"of {k}")
    if algorithm in (*GROUP_ALGORITHMS, "remax") and (args.decoding == "greedy" or args.top_k == 1):
        compared = "the K answers to a prompt" if algorithm in GROUP_ALGORITHMS else "the answer with the greedy one"
        raise UserError(f"--algorithm {algorithm} compares {compared}, which greedy decoding (--decoding greedy or "
                        "--top_k 1) makes identical: every advantage would be 0; use --decoding sample")
    dr_grpo = bool(args.dr_grpo)
    if dr_grpo and algorithm != "grpo":
        raise UserError(f"--dr_grpo is a GRPO variant; use it with --algorithm grpo (not {algorithm})")

    kl_in_reward = algorithm != "grpo" if args.kl_in_reward == "auto" else args.kl_in_reward == "on"
    if algorithm == "ppo" and not kl_in_reward:
        raise UserError("--algorithm ppo keeps the KL in the reward (its GAE needs per-token rewards); drop "
                        "--kl_in_reward off")
    estimator = args.kl_estimator
    if estimator == "auto":
        estimator = "k1" if kl_in_reward else "k3"

    level = args.importance_sampling_level
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise UserError(f"--importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, "
                        f"got {level!r}")
    if level == "sequence" and algorithm == "ppo":
        raise UserError("--importance_sampling_level sequence (GSPO) is for the critic-free algorithms; --algorithm "
                        "ppo clips each token's ratio against its own GAE advantage: drop the flag or pick one of "
                        "grpo, rloo, reinforce_pp, remax")
    aggregation = args.loss_aggregation
    if aggregation == "auto":
        if dr_grpo:
            aggregation = "token_sum"
        elif algorithm == "grpo" or level == "sequence":  # GSPO's objective is a mean over answers
            aggregation = "sequence"
        else:
            aggregation = "token"
    if algorithm == "ppo" and aggregation != "token":
        raise UserError(f"--algorithm ppo normalises its loss over the step's tokens (upstream's); --loss_aggregation "
                        f"{aggregation} is for the critic-free algorithms")

    tis_cap = float(args.tis_cap)
    if not (math.isfinite(tis_cap) and tis_cap >= 0):
        raise UserError(f"--tis_cap must be a finite number >= 0 (0: off), got {tis_cap}")
    whiten = bool(args.whiten_advantages) or algorithm == "reinforce_pp"
    return AlgorithmSettings(algorithm, k, kl_in_reward, estimator, aggregation, not dr_grpo, whiten, tis_cap,
                             **_dapo_options(args, algorithm))


def _dapo_options(args: argparse.Namespace, algorithm: str) -> dict[str, object]:
    """The DAPO / GSPO options of :class:`AlgorithmSettings`, checked (one UserError line each).
    ``--overlong_penalty_factor`` (None: 1.0) and ``--max_sampling_rounds`` (None: 4), when given, need
    ``--overlong_buffer_len`` > 0 and ``--dynamic_sampling``: alone they would change nothing."""
    high = args.cliprange_high
    if high is not None and not (math.isfinite(high) and high >= 0):
        raise UserError(f"--cliprange_high must be a finite number >= 0 (the ratio's upper bound is 1 + it), got {high}")
    dual = args.dual_clip
    if dual is not None and not (math.isfinite(dual) and dual > 1):
        raise UserError(f"--dual_clip must be a finite number > 1 (a negative advantage's loss is at most C x |A|), "
                        f"got {dual}")
    buffer, factor, longest = args.overlong_buffer_len, args.overlong_penalty_factor, args.max_answer_seq_len
    if not isinstance(buffer, int) or isinstance(buffer, bool) or not 0 <= buffer <= longest:
        raise UserError(f"--overlong_buffer_len must be an integer from 0 (off) to --max_answer_seq_len {longest}, "
                        f"got {buffer!r}")
    if factor is not None and not buffer:  # None: not given (1.0); a factor without a buffer would do nothing
        raise UserError("--overlong_penalty_factor scales the soft overlong punishment, off without it: add "
                        "--overlong_buffer_len L (L > 0) or drop --overlong_penalty_factor")
    factor = 1.0 if factor is None else factor
    if not (math.isfinite(factor) and factor >= 0):
        raise UserError(f"--overlong_penalty_factor must be a finite number >= 0, got {factor}")
    if args.max_sampling_rounds is not None and not args.dynamic_sampling:  # None: not given (4)
        raise UserError("--max_sampling_rounds bounds the draws of --dynamic_sampling, off without it: add "
                        "--dynamic_sampling or drop --max_sampling_rounds")
    rounds = positive_flag("max_sampling_rounds", 4 if args.max_sampling_rounds is None else args.max_sampling_rounds)
    if args.dynamic_sampling and algorithm not in GROUP_ALGORITHMS:
        raise UserError(f"--dynamic_sampling drops groups whose answers all got the same reward, which carry no signal "
                        f"only under a group baseline: use it with --algorithm grpo or rloo, not {algorithm}")
    return {"cliprange_high": None if high is None else float(high), "dual_clip": 0.0 if dual is None else float(dual),
            "overlong_buffer_len": buffer, "overlong_penalty_factor": float(factor),
            "mask_truncated_answers": bool(args.mask_truncated_answers),
            "importance_sampling_level": args.importance_sampling_level,
            "dynamic_sampling": bool(args.dynamic_sampling), "max_sampling_rounds": rounds}


# ================================================================== the batches
# The batch arithmetic of one PPO iteration: how a rollout is cut into micro-batches, and when
# optimizer steps happen.
#
# Upstream's README warns that PPO "diverges" unless ``per_device_generation_batch_size ==
# per_device_training_batch_size`` and ``ppo_epochs == generation_batches == 1``.
# The underlying rule, which TRL's PPO trainer follows too, is about *when optimizer steps happen*:
#
# * one rollout is ``per_device_generation_batch_size x generation_batches`` prompts per rank, and is
#   trained as ``M = rollout / per_device_training_batch_size`` micro-batches, ``ppo_epochs`` times:
#   ``M x ppo_epochs`` micro-steps per rollout;
# * the actor takes an optimizer step every ``gradient_accumulation_steps`` micro-steps;
# * the PPO ratio ``pi_theta / pi_old`` is exactly 1 on every micro-step only if no optimizer step
#   happens between generating a rollout and the last micro-step trained on it, i.e. iff
#   ``gradient_accumulation_steps`` is a multiple of ``M x ppo_epochs`` (every optimizer step covers
#   whole rollouts).
#
# :func:`plan_batches` derives these numbers once (a :class:`BatchPlan`) and refuses a rollout that
# does not split into whole micro-batches; :func:`num_total_iters` counts the run's optimizer steps.
OFF_POLICY_WARNING = (
    "WARNING: this configuration is off-policy: an optimizer step happens before every micro-batch "
    "of a rollout has been trained (gradient_accumulation_steps={ga} is not a multiple of "
    "{micro} micro-batches per rollout x {epochs} ppo_epochs). The PPO ratio is computed against the "
    "rollout's stored log-probs and clipped to [{low:g}, {high:g}]; upstream found such runs diverge "
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

    def describe(self, answers_per_prompt: int = 1) -> str:
        """One line for the start-up log (``answers_per_prompt``: ``--num_generations``)."""
        policy = "on-policy" if self.on_policy else "OFF-POLICY"
        k = answers_per_prompt
        batch = (f"{self.generation_batch_size} prompts" if k == 1
                 else f"{self.generation_batch_size // k} prompts x {k} answers")
        return (
            f"PPO batch plan (per rank): rollout = {batch} x "
            f"{self.generation_batches} generation batches = {self.rollout_size} rows -> "
            f"{self.micro_batches_per_rollout} micro-batches of {self.training_batch_size} x "
            f"{self.ppo_epochs} ppo epochs = {self.micro_steps_per_rollout} micro-steps; "
            f"gradient_accumulation_steps {self.gradient_accumulation_steps} "
            f"(actor {self.gradient_accumulation_steps_actor}{', PPO-ptx' if self.ptx else ''}) -> "
            f"{self.optimizer_steps_per_rollout:g} optimizer steps per rollout; {policy}"
        )

    def off_policy_warning(self, cliprange: float, cliprange_high: float | None = None) -> str:
        """The warning, with the ratio's clip range ``[1 - cliprange, 1 + (cliprange_high or cliprange)]``."""
        high = 1 + (cliprange if cliprange_high is None else cliprange_high)
        return OFF_POLICY_WARNING.format(ga=self.gradient_accumulation_steps, micro=self.micro_batches_per_rollout,
                                         epochs=self.ppo_epochs, low=1 - cliprange, high=high)


def positive_flag(name: str, value: object) -> int:
    """``value`` of flag ``--name`` if it is a positive integer; else one :class:`UserError` line."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"--{name} must be a positive integer, got {value!r}")
    return value


def plan_batches(args: argparse.Namespace, world_size: int, *, ptx: bool = False) -> BatchPlan:
    """Derive the :class:`BatchPlan` from the step-3 flags; refuse a rollout that does not split.

    Every generation batch must split exactly (docs/upstream.md#step-3-batches).
    """
    gen_bs = positive_flag("per_device_generation_batch_size", args.per_device_generation_batch_size)
    gen_batches = positive_flag("generation_batches", args.generation_batches)
    train_bs = positive_flag("per_device_training_batch_size", args.per_device_training_batch_size)
    epochs = positive_flag("ppo_epochs", args.ppo_epochs)
    ga = positive_flag("gradient_accumulation_steps", args.gradient_accumulation_steps)
    if gen_bs % train_bs != 0:
        # RolloutBuffer (upstream's MiniDataset) splits each generation batch on its own (as upstream), so a generation batch
        # that does not split would leave a short micro-batch in every one of them.
        raise UserError(
            f"a generation batch of per_device_generation_batch_size {gen_bs} rows does not split into "
            f"micro-batches of per_device_training_batch_size {train_bs}; make the training batch size "
            f"divide {gen_bs} (recommended: equal to the generation batch size)"
        )
    return BatchPlan(gen_bs, gen_batches, train_bs, epochs, ga, ga * 2 if ptx else ga, world_size, ptx)


def num_total_iters(plan: BatchPlan, batches: int, epochs: int, *, epoch: int = 0, batches_done: int = 0) -> int:
    """Optimizer steps of the run for the LR schedule (upstream's formula, rounded up, at least 1):
    ``epochs x batches x (gen_bs / train_bs) x ppo_epochs / GA``, with ``batches`` per epoch
    (:func:`dschat.rlhf.ppo_loop.batches_per_epoch`). After a resume in ``epoch`` with ``batches_done``
    batches of it trained: the steps left."""
    left = max(0, (epochs - epoch) * batches - batches_done)
    steps = math.ceil(left * (plan.generation_batch_size / plan.training_batch_size) * plan.ppo_epochs
                      / plan.gradient_accumulation_steps)
    return steps if epoch or batches_done else max(1, steps)


# ================================================================== the other parts
@dataclass(frozen=True)
class ModelSpec:
    """One trainable model of step 3 (``--actor_*`` / ``--critic_*`` flags)."""

    path: str | None  # the step-1 (actor) or step-2 (critic and reward model) folder or hub name
    dropout: float | None
    learning_rate: float
    weight_decay: float
    lora_dim: int
    lora_module_name: str
    lora_learning_rate: float
    gradient_checkpointing: bool


@dataclass(frozen=True)
class ModelsConfig:
    """The models :class:`~dschat.rlhf.rlhf_engine.DeepSpeedRLHFEngine` builds and how they train."""

    actor: ModelSpec
    critic: ModelSpec  # the reward model loads from the same folder
    dtype: str  # --dtype as given (``auto`` resolved by the engine)
    num_padding_at_beginning: int
    compute_fp32_loss: bool
    only_optimize_lora: bool
    enable_ema: bool
    lr_scheduler_type: str
    num_warmup_steps: int


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO, offload, the Hybrid Engine and the batch keys of the engines' DeepSpeed configs."""

    actor_zero_stage: int
    critic_zero_stage: int
    offload: bool  # the actor's and critic's optimizers (and parameters at stage 3)
    offload_reference_model: bool  # the reference and the EMA
    offload_reward_model: bool
    enable_hybrid_engine: bool
    inference_tp_size: int
    tp_gather_partition_size: int
    release_inference_cache: bool
    pin_parameters: bool  # not --unpin_actor_parameters
    enable_mixed_precision_lora: bool  # ZeRO++ quantises the actor's frozen weights
    micro_batch_size: int  # --per_device_training_batch_size
    gradient_accumulation_steps: int  # critic and reward model
    gradient_accumulation_steps_actor: int  # actor, reference, EMA: doubled with PPO-ptx
    max_out_tokens: int  # prompt + answer: the Hybrid Engine's inference cache
    enable_tensorboard: bool
    tensorboard_path: str


@dataclass(frozen=True)
class RolloutConfig:
    """How the actor decodes a rollout (docs/algorithms.md#decoding-why-sampling-is-the-default)."""

    decoding: DecodingSettings  # --decoding, --temperature, --top_k, --top_p
    zero3_gather: str  # --zero3_gather_for_generation: auto | on | off
    generation_loop: str  # --generation_loop: auto | dschat | hf | graphs
    cpu_decode_linear: str  # --cpu_decode_linear: onednn | off
    print_answers: bool  # --print_answers (every rank, as upstream)
    print_answers_interval: int
    env: str | None = None  # --env module:factory: multi-turn episodes (None: one answer per prompt)
    max_turns: int = 4  # --max_turns: actor turns per episode
    env_timeout: float = 600.0  # --env_timeout: seconds one factory or step call may take (0: no limit)


@dataclass(frozen=True)
class PPOConfig:
    """The PPO update's hyperparameters and the passes' settings (upstream hard-coded the first six)."""

    kl_ctl: float  # KL coefficient (in the reward, or as a loss term)
    clip_reward_value: float  # reward scores clipped to +-this
    gamma: float  # GAE discount
    lam: float  # GAE lambda
    cliprange: float  # PPO's ratio clip
    cliprange_value: float  # the value loss's clip around the old values
    reward_at: str  # after_last (upstream) | last: the token the score is put on
    missing_eos_penalty: float  # subtracted from an answer's score when it never ends (0: off)
    compute_fp32_loss: bool  # log-probs and losses of half-precision logits in fp32
    max_answer_seq_len: int
    ppo_epochs: int  # passes over a rollout
    align_overflow: bool  # fp16: both models skip a step either overflowed
    max_nonfinite_steps: int  # NaN/inf rollouts and micro-steps skipped before the run stops
    sequence_packing: str  # auto | on | off
    zero3_gather_for_scoring: str  # auto | on | off
    zero3_gather_for_training: str  # auto | on | off


@dataclass(frozen=True)
class EvalConfig:
    """The held-out evaluation (``--eval_*``; docs/evaluation.md), after ``check_eval_args`` resolved
    ``--eval_interval`` and ``--save_best_by``; with the data and run flags it reads."""

    eval_interval: int | str  # PPO steps between evaluations; 0 off; "auto"
    eval_prompts: int
    eval_alarm_sigmas: float
    stop_on_overoptimization: bool
    save_best_by: str  # none | judge | proxy
    output_dir: str | None
    data_path: list[str]
    data_split: str
    data_output_path: str
    seed: int
    local_rank: int
    max_prompt_seq_len: int
    inference_tp_size: int
    per_device_generation_batch_size: int
    generation_batches: int
    enable_test_mode: bool
    test_stop_step: int
    save_format: str = "safetensors"  # --save_format of the best/ models


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints and resume (docs/checkpoints.md), under the attribute names
    :class:`~dschat.training.checkpoint.Checkpointer` reads."""

    output_dir: str | None
    save_interval: int  # PPO iterations between checkpoints (0: none)
    keep_checkpoints: int
    resume: bool
    resume_from: str | None


@dataclass(frozen=True)
class Step3Config:
    """Step 3's parts, built once (module docstring)."""

    models: ModelsConfig
    zero: ZeroConfig
    rollout: RolloutConfig
    ppo: PPOConfig
    algorithm: AlgorithmSettings
    batches: BatchPlan
    reward: RewardMix
    evaluation: EvalConfig
    checkpoint: CheckpointConfig


def _model(args: argparse.Namespace, role: str) -> ModelSpec:
    flag = {name: getattr(args, f"{role}_{name}") for name in (
        "dropout", "learning_rate", "weight_decay", "lora_dim", "lora_module_name", "lora_learning_rate",
        "gradient_checkpointing")}
    return ModelSpec(path=getattr(args, f"{role}_model_name_or_path"), **flag)


def models_config(args: object) -> ModelsConfig:
    """The models part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    args = complete_step3_args(args)
    return ModelsConfig(
        actor=_model(args, "actor"), critic=_model(args, "critic"), dtype=args.dtype,
        num_padding_at_beginning=args.num_padding_at_beginning, compute_fp32_loss=bool(args.compute_fp32_loss),
        only_optimize_lora=bool(args.only_optimize_lora), enable_ema=bool(args.enable_ema), lr_scheduler_type=args.lr_scheduler_type, num_warmup_steps=args.num_warmup_steps)


def zero_config(args: object) -> ZeroConfig:
    """The ZeRO part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    args = complete_step3_args(args)
    ga = args.gradient_accumulation_steps
    return ZeroConfig(
        actor_zero_stage=args.actor_zero_stage, critic_zero_stage=args.critic_zero_stage, offload=bool(args.offload),
        offload_reference_model=bool(args.offload_reference_model), offload_reward_model=bool(args.offload_reward_model),
        enable_hybrid_engine=bool(args.enable_hybrid_engine), inference_tp_size=args.inference_tp_size,
        tp_gather_partition_size=args.tp_gather_partition_size, release_inference_cache=bool(args.release_inference_cache),
        pin_parameters=not args.unpin_actor_parameters,
        enable_mixed_precision_lora=bool(args.enable_mixed_precision_lora), micro_batch_size=args.per_device_training_batch_size,
        gradient_accumulation_steps=ga, gradient_accumulation_steps_actor=ga * 2 if unsupervised_training_enabled(args) else ga,
        max_out_tokens=args.max_prompt_seq_len + args.max_answer_seq_len,
        enable_tensorboard=bool(args.enable_tensorboard), tensorboard_path=args.tensorboard_path)


def rollout_config(args: object) -> RolloutConfig:
    """The rollout part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    args = complete_step3_args(args)
    return RolloutConfig(
        decoding=DecodingSettings(args.decoding, args.temperature, args.top_k, args.top_p),
        zero3_gather=str(args.zero3_gather_for_generation), generation_loop=str(args.generation_loop),
        cpu_decode_linear=str(args.cpu_decode_linear), print_answers=bool(args.print_answers),
        print_answers_interval=int(args.print_answers_interval), env=args.env or None,
        max_turns=positive_flag("max_turns", args.max_turns), env_timeout=check_timeout(args.env_timeout, "--env_timeout"))


def ppo_config(args: object) -> PPOConfig:
    """The PPO part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    args = complete_step3_args(args)
    return PPOConfig(
        kl_ctl=args.kl_ctl, clip_reward_value=args.clip_reward_value, gamma=args.gamma, lam=args.lam,
        cliprange=args.cliprange, cliprange_value=args.cliprange_value, reward_at=str(args.reward_at),
        missing_eos_penalty=float(args.missing_eos_penalty or 0.0), compute_fp32_loss=bool(args.compute_fp32_loss),
        max_answer_seq_len=int(args.max_answer_seq_len), ppo_epochs=int(args.ppo_epochs),
        align_overflow=bool(args.align_overflow), max_nonfinite_steps=int(args.max_nonfinite_steps),
        sequence_packing=str(args.sequence_packing), zero3_gather_for_scoring=str(args.zero3_gather_for_scoring),
        zero3_gather_for_training=str(args.zero3_gather_for_training))


def eval_config(args: object) -> EvalConfig:
    """The evaluation part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    args = complete_step3_args(args)
    return EvalConfig(
        eval_interval=args.eval_interval or 0, eval_prompts=args.eval_prompts,
        eval_alarm_sigmas=float(args.eval_alarm_sigmas), stop_on_overoptimization=bool(args.stop_on_overoptimization),
        save_best_by=args.save_best_by or "none", output_dir=args.output_dir, data_path=args.data_path,
        data_split=args.data_split, data_output_path=args.data_output_path, seed=args.seed, local_rank=args.local_rank,
        max_prompt_seq_len=args.max_prompt_seq_len, inference_tp_size=args.inference_tp_size,
        per_device_generation_batch_size=args.per_device_generation_batch_size,
        generation_batches=args.generation_batches, enable_test_mode=bool(args.enable_test_mode),
        test_stop_step=args.test_stop_step, save_format=str(args.save_format))


def checkpoint_config(args: object) -> CheckpointConfig:
    """The checkpoint part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    args = complete_step3_args(args)
    return CheckpointConfig(output_dir=args.output_dir, save_interval=int(args.save_interval or 0),
                            keep_checkpoints=int(args.keep_checkpoints), resume=bool(args.resume),
                            resume_from=args.resume_from)


def step3_config(args: object, world_size: int, reward: RewardMix | None = None, *,
                 algorithm: AlgorithmSettings | None = None, batches: BatchPlan | None = None) -> Step3Config:
    """Every part of ``args`` (module docstring), built once; ``reward`` defaults to the reward model
    alone, ``algorithm`` to :func:`resolve_algorithm` of ``args`` (step 3's ``main`` resolves it
    before the ranks are up, to check the paths), ``batches`` to :func:`plan_batches` of ``args`` on
    ``world_size`` ranks. Refuses contradictory or malformed flags with one
    :class:`~dschat.errors.UserError` line."""
    args = complete_step3_args(args)
    if algorithm is None:
        algorithm = resolve_algorithm(args)
    if batches is None:
        batches = plan_batches(args, world_size, ptx=unsupervised_training_enabled(args))
    return Step3Config(
        models=models_config(args), zero=zero_config(args), rollout=rollout_config(args), ppo=ppo_config(args),
        algorithm=algorithm, batches=batches,
        reward=RewardMix() if reward is None else reward, evaluation=eval_config(args),
        checkpoint=checkpoint_config(args))
