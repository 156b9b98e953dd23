"""Step-3 start-up checks: :func:`validate_step3_args` turns every contradictory flag combination into
one :class:`~dschat.errors.UserError` line before any model is loaded.
The batch arithmetic of a PPO iteration (the on-policy rule, :class:`~dschat.rlhf.config.BatchPlan`)
is part of step 3's config (:mod:`dschat.rlhf.config`).
"""
from __future__ import annotations

import math
from typing import Any

from dschat.cli.step3 import flags_off_default
from dschat.errors import UserError
from dschat.rewards import reward_model_used
from dschat.rl_math.critic_free import has_critic
from dschat.rlhf.config import positive_flag
from dschat.runtime.ds_config import check_optimizer_offload, check_param_offload
from dschat.cli.shared import check_seed
from dschat.training.run_setup import check_dropouts, check_rates_and_decays

__all__ = ["validate_step3_args"]

# --decoding sample's lowest --temperature: logits / t stay finite (in fp16, whose largest number is
# 65504, the scoring passes divide the model's half-precision logits: logits up to 655 at 1e-2).
MIN_TEMPERATURE = {"fp16": 1e-2}
MIN_TEMPERATURE_DEFAULT = 1e-6


def validate_step3_args(args: Any, *, accelerator: str, dtype: str, python_reward_fn: bool = False) -> list[str]:
    """Refuse contradictory step-3 flags with one :class:`UserError`; return warnings to print.

    ``accelerator`` is DeepSpeed's device name (``"cuda"``, ``"cpu"``, ...) and ``dtype`` the dtype
    training actually uses (``resolve_dtype``: fp16 becomes fp32 on a CPU). Checks, in the order a
    user would hit them: ZeRO stages, lengths, learning rates (finite, >= 0) and dropouts (in [0, 1)),
    decoding, Hybrid Engine tensor parallelism, upstream's unsupported ZeRO-2 + HE + offload
    combination, DeepSpeed's offload rules (``--offload`` needs ZeRO >= 1 for actor and critic; the
    reference / reward offload needs the actor / critic at ZeRO-3), mixed-precision LoRA,
    ``--align_overflow`` outside fp16 (upstream asserted or failed later: docs/upstream.md#step-3-ppo).
    The flags of a model the run does not build (a critic-free algorithm's critic; the reward model of
    a run rewarded by ``--reward_fn`` / ``--reward_url`` / ``--env`` or ``main``'s Python function,
    ``python_reward_fn``) are checked as such, and such a run's ``--reward_model_name_or_path`` is refused
    (except as PPO's way of starting the critic from the actor); ``--max_turns`` / ``--env_timeout`` need
    ``--env``, ``--reward_url_*`` need ``--reward_url``, and
    ``--lam`` / ``--cliprange_value`` (``--gamma``) given to an algorithm without a critic (without
    per-token rewards) are refused.
    """
    warnings: list[str] = []
    check_seed(getattr(args, "seed", 0))
    for name in ("actor_zero_stage", "critic_zero_stage"):
        if getattr(args, name) not in (0, 1, 2, 3):
            raise UserError(f"--{name} must be 0, 1, 2 or 3, got {getattr(args, name)}")
    for name in ("max_prompt_seq_len", "max_answer_seq_len", "num_train_epochs", "print_answers_interval"):
        positive_flag(name, getattr(args, name))
    if getattr(args, "preprocessing_num_workers", None) is not None:  # unset: one process (datasets' default)
        positive_flag("preprocessing_num_workers", args.preprocessing_num_workers)
    if args.max_prompt_seq_len < 2:
        raise UserError(f"--max_prompt_seq_len must be >= 2 (the reward model reads the prompt length), "
                        f"got {args.max_prompt_seq_len}")
    if args.max_answer_seq_len < 2:  # upstream drops answers of at most one token: none would be trained on
        raise UserError(f"--max_answer_seq_len must be >= 2 (an answer of one token is dropped as too short, so "
                        f"the run would never train), got {args.max_answer_seq_len}")
    if args.num_warmup_steps < 0:
        raise UserError(f"--num_warmup_steps must be >= 0, got {args.num_warmup_steps}")
    check_rates_and_decays(args, ("actor_learning_rate", "critic_learning_rate", "actor_lora_learning_rate",
                                  "critic_lora_learning_rate", "actor_weight_decay", "critic_weight_decay"))
    check_dropouts(args, ("actor_dropout", "critic_dropout"))
    check_ppo_numbers(args)
    if args.enable_test_mode and args.test_stop_step < 0:
        raise UserError(f"--test_stop_step must be >= 0, got {args.test_stop_step}")
    if getattr(args, "deepspeed_config", None):
        raise UserError(
            "--deepspeed_config is not used by dschat: the DeepSpeed configs of the five step-3 engines "
            "are built from the flags (--actor_zero_stage, --critic_zero_stage, --offload, --dtype, ...); drop it"
        )
    if args.decoding == "sample":
        lowest = MIN_TEMPERATURE.get(dtype, MIN_TEMPERATURE_DEFAULT)
        if not (math.isfinite(args.temperature) and args.temperature >= lowest):
            # logits / 1e-300 overflow to inf and the sampler's probabilities are nan (a traceback mid-run)
            raise UserError(f"--temperature must be > 0 for --decoding sample: a finite number of at least "
                            f"{lowest:g}{' in fp16' if dtype == 'fp16' else ''} (below: --decoding greedy), "
                            f"got {args.temperature}")
        if not 0 < args.top_p <= 1:
            raise UserError(f"--top_p must be in (0, 1], got {args.top_p}")
        if args.top_k < 0:
            raise UserError(f"--top_k must be >= 0, got {args.top_k}")
    for name in ("actor_lora_dim", "critic_lora_dim"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name} must be >= 0 (0: no LoRA), got {getattr(args, name)}")
    sampling = flags_off_default(args, ("temperature", "top_p", "top_k"))
    if args.decoding == "greedy" and sampling:
        warnings.append(f"--decoding greedy takes each most likely token: {', '.join(f'--{n}' for n in sorted(sampling))} "
                        "not used")
    ptx_only = flags_off_default(args, ("unsup_coef", "unsupervised_dataset_config_name", "preprocessing_num_workers"))
    if ptx_only and not getattr(args, "unsupervised_dataset_name", None):
        warnings.append(f"{', '.join(f'--{n}' for n in sorted(ptx_only))} not used: PPO-ptx needs "
                        "--unsupervised_dataset_name")
    positive_flag("tp_gather_partition_size", args.tp_gather_partition_size)
    if getattr(args, "unpin_actor_parameters", False):
        warnings.append("--unpin_actor_parameters not used: only DeepSpeed's Hybrid Engine reads it, and it is not "
                        "built under transformers 5 (Cache objects); --release_inference_cache frees dschat's Hybrid "
                        "Engine's gathered weights and KV cache after each rollout")
    if flags_off_default(args, ("tp_gather_partition_size",)) and args.inference_tp_size == 1:
        warnings.append("--tp_gather_partition_size not used: it sizes the tensor-parallel Hybrid Engine's gathers "
                        "(--inference_tp_size > 1)")
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
    given = flags_off_default(args, ("max_turns", "env_timeout", "lam", "cliprange_value", "gamma",
                                     "reward_url_weight", "reward_url_timeout", "reward_url_retries"))
    for name in sorted(given & {"max_turns", "env_timeout"}):
        if not getattr(args, "env", None):  # as e2e's --max-turns / --env-timeout: nothing to apply them to
            raise UserError(f"--{name} applies to multi-turn episodes only; add --env MODULE:FACTORY "
                            f"(docs/environments.md) or drop --{name}")
    for name in sorted(given & {"reward_url_weight", "reward_url_timeout", "reward_url_retries"}):
        if not getattr(args, "reward_url", None):
            raise UserError(f"--{name} applies to a reward server only; add --reward_url URL or drop --{name}")
    algorithm = getattr(args, "algorithm", "ppo")
    critic = has_critic(algorithm)
    reward_path = getattr(args, "reward_model_name_or_path", None)
    # Unused: no reward model is loaded. (Without a critic folder, PPO's critic starts from the actor
    # when a reward-model folder is given: the flag is then the run's way of asking for that.)
    unused = not reward_model_used(args, python_reward_fn) and (args.critic_model_name_or_path or not critic)
    if reward_path and unused:
        why = ("--reward_model_weight 0" if getattr(args, "reward_model_weight", None) is not None else
               "its --reward_model_weight defaults to 0 beside --reward_fn, --reward_url, --env or main's reward_fn")
        raise UserError(f"--reward_model_name_or_path {reward_path}: this run loads no reward model ({why}); give a "
                        "non-zero --reward_model_weight W to add its score, or drop --reward_model_name_or_path")
    for name, what, applies in (("lam", "is GAE's lambda, over the critic's values", critic),
                                ("cliprange_value", "clips the critic's values", critic),
                                ("gamma", "discounts per-token rewards (PPO's GAE, REINFORCE++'s returns)",
                                 critic or algorithm == "reinforce_pp")):
        if name in given and not applies:
            scores = "has no critic" if name != "gamma" else "gives each answer one advantage"
            raise UserError(f"--{name} {what}; --algorithm {algorithm} {scores}: drop --{name}")
    # DeepSpeed's offload rules (dschat.runtime.ds_config): --offload moves the actor's and the critic's
    # optimizer state, which needs ZeRO >= 1 for both; the reference/EMA and reward models are ZeRO-3
    # only when the actor / critic is, and parameter offload exists only under ZeRO-3.
    if args.offload:
        check_optimizer_offload(args.actor_zero_stage, "--actor_zero_stage")
        if critic:
            check_optimizer_offload(args.critic_zero_stage, "--critic_zero_stage")
    if args.offload_reference_model:
        check_param_offload("--offload_reference_model", args.actor_zero_stage, "--actor_zero_stage")
    if args.offload_reward_model:
        if not reward_model_used(args, python_reward_fn):
            raise UserError("--offload_reward_model: this run loads no reward model (its reward comes from "
                            "--reward_fn, --reward_url or --env); drop the flag")
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
    if args.only_optimize_lora and args.actor_lora_dim <= 0 and not critic:
        ignored = ", so --critic_lora_dim adds no LoRA layer" if args.critic_lora_dim > 0 else ""
        raise UserError(f"--only_optimize_lora needs --actor_lora_dim > 0: --algorithm {args.algorithm} trains no "
                        f"critic{ignored} (the whole actor would train)")
    if args.only_optimize_lora and args.actor_lora_dim <= 0 and args.critic_lora_dim <= 0:
        raise UserError("--only_optimize_lora needs --actor_lora_dim and/or --critic_lora_dim > 0")
    if args.align_overflow and dtype != "fp16":
        warnings.append(
            f"WARNING: --align_overflow has no effect when training in {dtype}: only fp16 loss scaling "
            "overflows (upstream used fp16-optimizer internals, DSE #745)"
        )
    return warnings


# flag -> (what it must be, the test): PPO's numbers, whose wrong values train without an error
# (a negative --clip_reward_value clamps every score to the same value; a negative --cliprange stops
# every positive-advantage token from learning).
_PPO_NUMBERS = {
    "kl_ctl": ("a finite number >= 0 (0: no KL)", lambda v: math.isfinite(v) and v >= 0),
    "clip_reward_value": ("a number > 0 (scores are clipped to +-it)", lambda v: v > 0),
    "cliprange": ("a finite number > 0 (the ratio is clipped to 1 +- it)", lambda v: math.isfinite(v) and v > 0),
    "cliprange_value": ("a finite number > 0 (values are clipped to the old ones +- it)",
                        lambda v: math.isfinite(v) and v > 0),
    "gamma": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "lam": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "missing_eos_penalty": ("a finite number >= 0 (subtracted from the score; 0: off)",
                            lambda v: math.isfinite(v) and v >= 0),
    "unsup_coef": ("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
}


def check_ppo_numbers(args: Any) -> None:
    """One line for the first of PPO's numeric flags (``_PPO_NUMBERS``) outside its range; a flag
    ``args`` lacks is not checked."""
    for name, (rule, ok) in _PPO_NUMBERS.items():
        value = getattr(args, name, None)
        if value is not None and not ok(float(value)):
            raise UserError(f"--{name} must be {rule}, got {value}")
