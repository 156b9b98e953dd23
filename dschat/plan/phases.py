"""Per-GPU memory of each phase of a PPO step: an estimate built on the exact model states.

The model states (:mod:`dschat.plan.model_state`) are exact; what a phase adds is estimated:

* **generation**: the actor's weights gathered whole under ZeRO-3 (dschat gathers the whole engine
  for generation), the KV cache ``2 x layers x batch x (prompt + answer) x kv_heads x head_dim`` in
  the weights' dtype, and the last position's fp32 logits;
* **scoring**: one forward of each model over ``batch x (prompt + answer)``: the actor's and the
  reference's logits (weights' dtype, plus an fp32 log-softmax), the largest layer of a ZeRO-3
  model gathered;
* **actor / critic training**: activations per layer ``b s h (34 + 5 a s / h)`` bytes at 2 bytes
  per element (Korthikanti et al., 2022), scaled by the dtype; with gradient checkpointing one
  ``b s h`` per layer plus one layer's full activations; the actor's logits three times (logits,
  fp32 log-probs, their gradient); ZeRO-3 gathers one layer at a time (``stage3_max_live_parameters``
  bounds it);
* **optimizer step**: the model states alone (the step works in place on the partitions).

Every model's states stay resident through every phase (dschat keeps all four engines alive).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from dschat.plan.model_state import DTYPE_BYTES
from dschat.plan.roles import RolePlan

__all__ = ["Phase", "phases", "PHASES", "resident_bytes", "activation_bytes", "layer_gather_bytes", "host_bytes_at_load"]

PHASES = ("generation", "scoring", "actor training", "critic training", "optimizer step")


@dataclass
class Phase:
    """One phase's bytes per GPU, by consumer."""

    name: str
    consumers: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.consumers.values())

    def top(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.consumers.items(), key=lambda kv: -kv[1])[:n]


def resident_bytes(plans: dict[str, RolePlan]) -> dict[str, int]:
    """Every engine's model states on the GPU, by ``"<role> <category>"`` (what stays through every phase)."""
    out = {}
    for role, plan in plans.items():
        for key, value in plan.state.device.items():
            if value:
                out[f"{role} {key}"] = value
    return out


def _gathered(plan: RolePlan, el: int) -> int:
    """Bytes a ZeRO-3 model adds when gathered whole (its full weights minus its partitions)."""
    if plan.spec.stage != 3:
        return 0
    return max(0, plan.inventory.numel * el - plan.state.device.get("params", 0))


def layer_gather_bytes(plan: RolePlan, el: int) -> int:
    """A ZeRO-3 engine's one gathered layer (its weights over its layers), 0 under other stages."""
    if plan.spec.stage != 3:
        return 0
    inv = plan.inventory
    return int(inv.numel / max(1, inv.layers)) * el


def activation_bytes(plan: RolePlan, batch: int, seq: int, el: int, checkpointing: bool) -> int:
    """One micro-batch's activations of ``plan``'s model (the module docstring's formula)."""
    inv = plan.inventory
    per_layer_full = batch * seq * inv.hidden * (34 + 5 * inv.heads * seq / max(1, inv.hidden)) * el / 2
    if checkpointing:
        return int(inv.layers * batch * seq * inv.hidden * el + per_layer_full)
    return int(inv.layers * per_layer_full)


def _gathers_for_generation(actor: RolePlan, args: argparse.Namespace, el: int, resident: int,
                            gpu_bytes: int | None) -> bool:
    """Whether a ZeRO-3 actor is gathered whole for generation, by the run's rule
    (``--zero3_gather_for_generation``; ``auto``: the full model fits in half the memory the resident
    states leave free, :func:`dschat.runtime.zero3.fits_gathered`); without a GPU size, ``auto`` gathers."""
    mode = getattr(args, "zero3_gather_for_generation", "auto")
    if mode != "auto" or gpu_bytes is None:
        return mode != "off"
    return actor.inventory.numel * el <= max(0, gpu_bytes - resident) // 2


def phases(plans: dict[str, RolePlan], args: argparse.Namespace, dtype: str,
           gpu_bytes: int | None = None) -> list[Phase]:
    """The five phases of one PPO step for ``plans`` (:func:`dschat.plan.roles.plan_roles`) on a GPU of
    ``gpu_bytes`` (which decides ``--zero3_gather_for_generation auto``)."""
    el = DTYPE_BYTES[dtype]
    resident = resident_bytes(plans)
    actor, critic = plans["actor"], plans["critic"]
    seq = args.max_prompt_seq_len + args.max_answer_seq_len
    gen_b, train_b = args.per_device_generation_batch_size, args.per_device_training_batch_size
    inv = actor.inventory
    head_dim = inv.hidden // max(1, inv.heads)
    out = []
    generation = Phase("generation", dict(resident))
    if _gathers_for_generation(actor, args, el, sum(resident.values()), gpu_bytes):
        generation.consumers["actor gathered whole"] = _gathered(actor, el)
    else:  # fetched layer by layer for every token
        generation.consumers["ZeRO-3 layer gathers"] = layer_gather_bytes(actor, el)
    generation.consumers["KV cache"] = 2 * inv.layers * gen_b * seq * inv.kv_heads * head_dim * el
    generation.consumers["logits"] = gen_b * inv.vocab_rows * 4
    out.append(generation)
    scoring = Phase("scoring", dict(resident))
    scoring.consumers["logits"] = gen_b * seq * inv.vocab_rows * (el + 4)
    scoring.consumers["hidden states"] = gen_b * seq * max(p.inventory.hidden for p in plans.values()) * el * 4
    scoring.consumers["ZeRO-3 layer gathers"] = max(layer_gather_bytes(p, el) for p in plans.values())
    out.append(scoring)
    actor_train = Phase("actor training", dict(resident))
    actor_train.consumers["actor activations"] = activation_bytes(actor, train_b, seq, el, args.actor_gradient_checkpointing)
    actor_train.consumers["logits"] = train_b * seq * inv.vocab_rows * (2 * el + 4)
    actor_train.consumers["ZeRO-3 layer gathers"] = layer_gather_bytes(actor, el)
    out.append(actor_train)
    critic_train = Phase("critic training", dict(resident))
    critic_train.consumers["critic activations"] = activation_bytes(critic, train_b, seq, el,
                                                                args.critic_gradient_checkpointing)
    critic_train.consumers["ZeRO-3 layer gathers"] = layer_gather_bytes(critic, el)
    out.append(critic_train)
    out.append(Phase("optimizer step", dict(resident)))
    for phase in out:
        phase.consumers = {k: v for k, v in phase.consumers.items() if v}
    return out


def host_bytes_at_load(plans: dict[str, RolePlan], gpus_per_node: int) -> int:
    """Host memory while the models load, per node: every rank reads each model whole in fp32 before
    DeepSpeed takes it (ZeRO-3 models are built partitioned), plus the offloaded states."""
    per_rank = 0
    for plan in plans.values():
        if plan.spec.stage != 3:
            per_rank += plan.inventory.numel * 4
        per_rank += sum(plan.state.host.values())
    return per_rank * gpus_per_node
