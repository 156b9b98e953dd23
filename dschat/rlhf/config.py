"""Step 3's typed configuration: the flat flags (upstream's names) read once into frozen parts.

:class:`Step3Config` is built by step 3's ``main`` right after the flags are checked and the ranks
are up (the batch plan needs the world size): the rollout's decoding (:class:`RolloutConfig`), the
PPO update's hyperparameters (:class:`PPOConfig`), the algorithm (``--algorithm``'s
:class:`~dschat.rlhf.algorithm.AlgorithmSettings`), the batches
(:class:`~dschat.rlhf.batch_plan.BatchPlan`) and the reward (:class:`~dschat.rewards.RewardMix`).
Each part of step 3 takes its part. Code written against upstream that hands
``DeepSpeedRLHFEngine`` / ``DeepSpeedPPOTrainer`` a Namespace of upstream's flags only gets the same
parts built from it, dschat's own flags at their defaults: this module (with
:func:`~dschat.rlhf.algorithm.resolve_algorithm`) is the only reader of such a Namespace.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from dschat.cli.step3 import step3_flag
from dschat.rewards import RewardMix
from dschat.rlhf.algorithm import AlgorithmSettings
from dschat.rlhf.batch_plan import BatchPlan
from dschat.rlhf.decoding import DecodingSettings

__all__ = ["RolloutConfig", "PPOConfig", "Step3Config", "rollout_config", "ppo_config"]


@dataclass(frozen=True)
class RolloutConfig:
    """How the actor decodes a rollout (docs/algorithms.md#decoding-why-sampling-is-the-default)."""

    decoding: DecodingSettings  # --decoding, --temperature, --top_k, --top_p
    zero3_gather: str  # --zero3_gather_for_generation: auto | on | off
    generation_loop: str  # --generation_loop: auto | dschat | hf | graphs
    cpu_decode_linear: str  # --cpu_decode_linear: onednn | off
    print_answers: bool  # --print_answers (every rank, as upstream)
    print_answers_interval: int


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
class Step3Config:
    """Step 3's parts, built once (module docstring)."""

    rollout: RolloutConfig
    ppo: PPOConfig
    algorithm: AlgorithmSettings
    batches: BatchPlan
    reward: RewardMix


def rollout_config(args: argparse.Namespace) -> RolloutConfig:
    """The rollout part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    return RolloutConfig(
        decoding=DecodingSettings(*(step3_flag(args, name) for name in ("decoding", "temperature", "top_k", "top_p"))),
        zero3_gather=str(step3_flag(args, "zero3_gather_for_generation")),
        generation_loop=str(step3_flag(args, "generation_loop")),
        cpu_decode_linear=str(step3_flag(args, "cpu_decode_linear")),
        print_answers=bool(args.print_answers),
        print_answers_interval=int(args.print_answers_interval),
    )


def ppo_config(args: argparse.Namespace) -> PPOConfig:
    """The PPO part of ``args`` (dschat's flags at their defaults where ``args`` lacks them)."""
    return PPOConfig(
        kl_ctl=step3_flag(args, "kl_ctl"),
        clip_reward_value=step3_flag(args, "clip_reward_value"),
        gamma=step3_flag(args, "gamma"),
        lam=step3_flag(args, "lam"),
        cliprange=step3_flag(args, "cliprange"),
        cliprange_value=step3_flag(args, "cliprange_value"),
        reward_at=str(step3_flag(args, "reward_at")),
        missing_eos_penalty=float(step3_flag(args, "missing_eos_penalty") or 0.0),
        compute_fp32_loss=bool(args.compute_fp32_loss),
        max_answer_seq_len=int(args.max_answer_seq_len),
        ppo_epochs=int(args.ppo_epochs),
        align_overflow=bool(args.align_overflow),
        max_nonfinite_steps=int(step3_flag(args, "max_nonfinite_steps")),
        sequence_packing=str(step3_flag(args, "sequence_packing")),
        zero3_gather_for_scoring=str(step3_flag(args, "zero3_gather_for_scoring")),
        zero3_gather_for_training=str(step3_flag(args, "zero3_gather_for_training")),
    )
