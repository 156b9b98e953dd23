"""Step 3's four models as the run builds them: inventories and DeepSpeed configs, per role.

The configs come from :func:`dschat.rlhf.rlhf_engine.ds_config_for` (the run's own builder), so the
ZeRO stage of each model, its offload and its buckets are the run's: the reference is ZeRO-3 only
when the actor is, the reward model only when the critic is; LoRA is the actor's on the actor, the
critic's on the critic (its value head stays trained with ``--only_optimize_lora``), none on the
frozen two. With ``--enable_ema`` a fifth engine, ``ema``: the actor's model with the actor's LoRA
layout, built with the EMA's own config (ZeRO-3 only when the actor is, ``--offload_reference_model``
offloads it), frozen (no optimizer), resident in every phase.

Only the engines the run builds are planned (:func:`planned_roles`): no critic for a critic-free
``--algorithm`` (:func:`~dschat.rlhf.config.resolve_algorithm`), no reward model when the reward
mix gives it no weight (:func:`~dschat.rewards.reward_model_used`).

The critic is planned from the model the run builds it from
(:func:`~dschat.rlhf.rlhf_engine.resolve_model_sources`): ``--critic_model_name_or_path``'s when
its tokenizer is the actor's, else the actor's body with a fresh value head (``critic_from_actor``;
step 3 passes what it resolved, ``python -m dschat.plan`` compares the two folders' tokenizers with
step 3's own function, :func:`critic_source`). The reward model stays the critic folder's (or
``--reward_model_name_or_path``'s) either way.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import lru_cache

from dschat.errors import UserError
from dschat.models.registry import resolve_model_path
from dschat.plan.inventory import Inventory, inventory, read_config, with_lora
from dschat.plan.model_state import EngineSpec, ModelState, model_state
from dschat.rewards import reward_model_used
from dschat.rlhf.config import resolve_algorithm, zero_config
from dschat.rlhf.rlhf_engine import ds_config_for, resolve_model_sources
from dschat.training.step_data import load_tokenizer

__all__ = ["PLANNED_ROLES", "RolePlan", "critic_source", "model_config", "plan_roles", "planned_roles",
           "reward_model_used"]

PLANNED_ROLES = ("actor", "ref", "critic", "reward")


@dataclass(frozen=True)
class RolePlan:
    """One engine: its parameters, how DeepSpeed holds them, and the bytes that makes."""

    role: str
    inventory: Inventory
    spec: EngineSpec
    state: ModelState


def planned_roles(args: argparse.Namespace, reward_model: bool | None = None) -> tuple[str, ...]:
    """The engines step 3 builds for ``args``: actor and reference always, the critic unless the
    algorithm is critic-free, the reward model where it is loaded (``reward_model``; None: from the
    flags, :func:`reward_model_used`), ``ema`` with ``--enable_ema``."""
    roles = ["actor", "ref"]
    if resolve_algorithm(args).critic:
        roles.append("critic")
    if reward_model_used(args) if reward_model is None else reward_model:
        roles.append("reward")
    if getattr(args, "enable_ema", False):
        roles.append("ema")
    return tuple(roles)


@lru_cache(maxsize=8)
def model_config(name: str):
    """The transformers config of model ``name`` (a folder, or a name of dschat's registry), read once."""
    return read_config(resolve_model_path(name))


@lru_cache(maxsize=8)
def _inventory(name: str, critic: bool):
    """The meta-device build of a model (cached: the search plans the same models many times)."""
    return inventory(model_config(name), critic=critic)


def critic_source(args: argparse.Namespace) -> tuple[bool, tuple[str, ...]]:
    """Whether step 3 would build ``args``' critic from the actor (``critic_from_actor``), and the
    lines that say so, decided as step 3 decides it: the actor's tokenizer (:func:`load_tokenizer`
    with ``--add_eot_token``) against the critic folder's (:func:`resolve_model_sources`). Tokenizer
    files only, no weights. ``(False, ())`` without a critic folder (the planner then plans the
    actor's, as step 3 builds it) or when it is the actor's folder (the same model either way);
    where a tokenizer cannot be read (a folder holding only ``config.json``) ``False`` and one note:
    the critic folder's model is planned."""
    critic = args.critic_model_name_or_path
    actor = args.actor_model_name_or_path
    if not critic:
        return False, ()
    try:
        if resolve_model_path(critic) == resolve_model_path(actor):
            return False, ()
        tokenizer = load_tokenizer(actor, getattr(args, "add_eot_token", False))
        sources = resolve_model_sources(actor, critic, None, tokenizer, needs_critic=True, needs_reward=False)
    except (UserError, OSError, ValueError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0].split(";")[0]
        return False, (f"note: the critic is planned from {critic}'s config.json; step 3 starts it from the actor "
                       f"{actor} with a fresh value head where their tokenizers differ, which the planner cannot "
                       f"compare here ({reason})",)
    return sources.critic_from_actor, sources.notes


def plan_roles(args: argparse.Namespace, world: int, *, dtype: str, cpu_accelerator: bool = False,
               hybrid_engine: bool = False, reward_model: bool | None = None,
               critic_from_actor: bool = False) -> dict[str, RolePlan]:
    """Every engine of a step-3 run of ``args`` on ``world`` ranks (``dtype``: the resolved one), those
    of :func:`planned_roles` (``reward_model``: whether the reward model is loaded; None: from the
    flags), in :data:`PLANNED_ROLES` order, ``ema`` last. ``critic_from_actor``: the run builds its
    critic from the actor with a fresh value head (another tokenizer than the critic folder's,
    :func:`critic_source`); the critic folder's model otherwise."""
    plans = {}
    for role in planned_roles(args, reward_model):
        critic = role in ("critic", "reward")
        # The critic starts from the actor without a critic folder or when its tokenizer is not the
        # actor's; the reward model is --reward_model_name_or_path's when given, else the critic folder's.
        folder = args.critic_model_name_or_path
        critic_path = args.actor_model_name_or_path if critic_from_actor or not folder else folder
        reward_path = getattr(args, "reward_model_name_or_path", None) or folder or args.actor_model_name_or_path
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
