"""Step 3's algorithm settings: the ``--algorithm`` family of flags resolved once, and checked.

:func:`resolve_algorithm` turns the flags (``--algorithm``, ``--num_generations``, ``--dr_grpo``,
``--loss_aggregation``, ``--kl_in_reward``, ``--kl_estimator``, ``--tis_cap``,
``--whiten_advantages``) into one frozen :class:`AlgorithmSettings`, resolving every ``auto`` per
algorithm, and refuses contradictions with one :class:`~dschat.errors.UserError` line. An
upstream-style Namespace without these flags gets upstream's PPO.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dschat.cli.step3 import step3_flag
from dschat.errors import UserError
from dschat.rl_algorithms import ALGORITHMS, CRITIC_FREE, GROUP_ALGORITHMS

__all__ = ["AlgorithmSettings", "resolve_algorithm"]


@dataclass(frozen=True)
class AlgorithmSettings:
    """What the trainer does, per algorithm (docs/algorithms.md)."""

    algorithm: str  # one of rl_algorithms.ALGORITHMS
    num_generations: int  # K answers per prompt, consecutive rows of a generation batch
    kl_in_reward: bool  # -kl_ctl x KL in the reward (else kl_ctl x KL as a loss term)
    kl_estimator: str  # k1 | k2 | k3
    loss_aggregation: str  # token | sequence | token_sum
    scale_by_std: bool  # GRPO divides by the group's std (not Dr.GRPO)
    whiten_advantages: bool  # whiten over the rollout's tokens, all ranks (REINFORCE++ always)
    tis_cap: float  # truncated importance sampling cap, 0 = off

    @property
    def critic(self) -> bool:
        """Whether a critic (value model) is built, trained, checkpointed and saved."""
        return self.algorithm not in CRITIC_FREE

    @property
    def upstream_ppo_loss(self) -> bool:
        """PPO exactly as upstream computes its actor loss (no TIS, KL in the reward, token mean)."""
        return self.algorithm == "ppo" and self.tis_cap == 0.0 and self.kl_in_reward

    def describe(self) -> str:
        """One line for the start-up log."""
        kl = "in the reward" if self.kl_in_reward else "as a loss term"
        extra = f", TIS cap {self.tis_cap:g}" if self.tis_cap else ""
        if not self.kl_in_reward and self.kl_estimator == "k1":
            # d/dtheta of (log pi - log pi_ref) is the score function, whose mean over the policy's own
            # samples is 0: as a loss term k1 pulls nowhere on average (k3's gradient is KL's).
            extra += ("; WARNING: the k1 estimator as a loss term has zero expected gradient on-policy, so it does "
                      "not hold the actor near the reference: use --kl_estimator k3 (the default here) or k2")
        return (f"algorithm {self.algorithm}: {self.num_generations} answer(s) per prompt, KL ({self.kl_estimator}) "
                f"{kl}, loss aggregation {self.loss_aggregation}"
                f"{', no critic' if not self.critic else ''}{extra}")


def resolve_algorithm(args: Any) -> AlgorithmSettings:
    """The :class:`AlgorithmSettings` of ``args``; refuses contradictory flags (one line each)."""
    algorithm = step3_flag(args, "algorithm")
    if algorithm not in ALGORITHMS:
        raise UserError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    k = step3_flag(args, "num_generations")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"--num_generations must be a positive integer, got {k!r}")
    if algorithm in GROUP_ALGORITHMS and k < 2:
        raise UserError(f"--algorithm {algorithm} compares answers to the same prompt: give --num_generations 2 "
                        "or more (e.g. 4)")
    gen_bs = step3_flag(args, "per_device_generation_batch_size")
    if isinstance(gen_bs, int) and gen_bs % k != 0:
        raise UserError(f"--num_generations {k} does not divide --per_device_generation_batch_size {gen_bs}: a "
                        "generation batch holds whole groups of K answers to a prompt; make the batch a multiple "
                        f"of {k}")
    if algorithm in (*GROUP_ALGORITHMS, "remax") and (step3_flag(args, "decoding") == "greedy"
                                                       or step3_flag(args, "top_k") == 1):
        compared = "the K answers to a prompt" if algorithm in GROUP_ALGORITHMS else "the answer with the greedy one"
        raise UserError(f"--algorithm {algorithm} compares {compared}, which greedy decoding (--decoding greedy or "
                        "--top_k 1) makes identical: every advantage would be 0; use --decoding sample")
    dr_grpo = bool(step3_flag(args, "dr_grpo"))
    if dr_grpo and algorithm != "grpo":
        raise UserError(f"--dr_grpo is a GRPO variant; use it with --algorithm grpo (not {algorithm})")

    kl_flag = step3_flag(args, "kl_in_reward")
    kl_in_reward = algorithm != "grpo" if kl_flag == "auto" else kl_flag == "on"
    if algorithm == "ppo" and not kl_in_reward:
        raise UserError("--algorithm ppo keeps the KL in the reward (its GAE needs per-token rewards); drop "
                        "--kl_in_reward off")
    estimator = step3_flag(args, "kl_estimator")
    if estimator == "auto":
        estimator = "k1" if kl_in_reward else "k3"

    aggregation = step3_flag(args, "loss_aggregation")
    if aggregation == "auto":
        aggregation = ("token_sum" if dr_grpo else "sequence") if algorithm == "grpo" else "token"
    if algorithm == "ppo" and aggregation != "token":
        raise UserError(f"--algorithm ppo normalises its loss over the step's tokens (upstream's); --loss_aggregation "
                        f"{aggregation} is for the critic-free algorithms")

    tis_cap = float(step3_flag(args, "tis_cap"))
    if not (math.isfinite(tis_cap) and tis_cap >= 0):
        raise UserError(f"--tis_cap must be a finite number >= 0 (0: off), got {tis_cap}")
    whiten = bool(step3_flag(args, "whiten_advantages")) or algorithm == "reinforce_pp"
    return AlgorithmSettings(algorithm, k, kl_in_reward, estimator, aggregation, not dr_grpo, whiten, tis_cap)
