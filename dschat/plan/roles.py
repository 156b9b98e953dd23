"""Step 3's four models as the run builds them: inventories and DeepSpeed configs, per role.

The configs come from :func:`dschat.rlhf.rlhf_engine.ds_config_for` (the run's own builder), so the
ZeRO stage of each model, its offload and its buckets are the run's: the reference is ZeRO-3 only
when the actor is, the reward model only when the critic is; LoRA is the actor's on the actor, the
critic's on the critic (its value head stays trained with ``--only_optimize_lora``), none on the
frozen two. With ``--enable_ema`` a fifth engine, ``ema``: the actor's model with the actor's LoRA
layout, built with the EMA's own config (ZeRO-3 only when the actor is, ``--offload_reference_model``
offloads it), frozen (no optimizer), resident in every phase.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import lru_cache

from dschat.models.registry import resolve_model_path
from dschat.plan.inventory import Inventory, inventory, read_config, with_lora
from dschat.plan.model_state import EngineSpec, ModelState, model_state
from dschat.rlhf.config import zero_config
from dschat.rlhf.rlhf_engine import ds_config_for

__all__ = ["PLANNED_ROLES", "RolePlan", "model_config", "plan_roles"]

PLANNED_ROLES = ("actor", "ref", "critic", "reward")


@dataclass(frozen=True)
class RolePlan:
    """One engine: its parameters, how DeepSpeed holds them, and the bytes that makes."""

    role: str
    inventory: Inventory
    spec: EngineSpec
    state: ModelState


@lru_cache(maxsize=8)
def model_config(name: str):
    """The transformers config of model ``name`` (a folder, or a name of dschat's registry), read once."""
    return read_config(resolve_model_path(name))


@lru_cache(maxsize=8)
def _inventory(name: str, critic: bool):
    """The meta-device build of a model (cached: the search plans the same models many times)."""
    return inventory(model_config(name), critic=critic)


def plan_roles(args: argparse.Namespace, world: int, *, dtype: str, cpu_accelerator: bool = False,
               hybrid_engine: bool = False) -> dict[str, RolePlan]:
    """Every engine of a step-3 run of ``args`` on ``world`` ranks (``dtype``: the resolved one): the four of
    :data:`PLANNED_ROLES`, and ``ema`` with ``--enable_ema``."""
    plans = {}
    roles = (*PLANNED_ROLES, "ema") if getattr(args, "enable_ema", False) else PLANNED_ROLES
    for role in roles:
        critic = role in ("critic", "reward")
        # The critic starts from the actor without a critic folder; the reward model is
        # --reward_model_name_or_path's when given, else the critic's.
        critic_path = args.critic_model_name_or_path or args.actor_model_name_or_path
        reward_path = getattr(args, "reward_model_name_or_path", None) or critic_path
        name = {"critic": critic_path, "reward": reward_path}.get(role, args.actor_model_name_or_path)
        inv, meta_model = _inventory(name, critic)
        if role in ("actor", "ema"):
            inv = with_lora(inv, meta_model, args.actor_lora_dim, args.actor_lora_module_name, args.only_optimize_lora)
        elif role == "critic":
            inv = with_lora(inv, meta_model, args.critic_lora_dim, args.critic_lora_module_name,
                            args.only_optimize_lora, force_optimize=("v_head.weight",))
        ds_config = ds_config_for(role, zero_config(args), dtype=dtype, hybrid_engine=hybrid_engine, world_size=world)
        spec = EngineSpec.from_ds_config(ds_config, world=world, trained=role in ("actor", "critic"),
                                         cpu_accelerator=cpu_accelerator)
        plans[role] = RolePlan(role, inv, spec, model_state(inv, spec))
    return plans
