"""Steps 1 and 2 planned: the one trained engine of SFT and of reward-model training, and its phases.

The engine is built as the step's ``main.py`` builds it, from the model's ``config.json`` alone:

* **step 1**: the causal LM (``AutoModelForCausalLM``), LoRA as ``--lora_dim`` /
  ``--lora_module_name`` / ``--only_optimize_lora`` lay it;
* **step 2**: the reward model (body + value head); the families whose final norm is reset train it
  always (:func:`dschat.training.engine_setup.reset_final_norm_for_reward`), the value head trains
  with ``--only_optimize_lora``, and ``--freeze_layers N`` freezes the embeddings and the ``N``
  lowest blocks (their LoRA factors too), as :func:`dschat.models.freeze.freeze_lower_layers` does.

Its DeepSpeed config is the step's own (:func:`dschat.training.engine_setup.step_ds_config`), so the
model-state bytes are exact as for step 3 (tests/plan/test_training_steps.py). The phases:

* **training**: the resident states, one micro-batch's activations (step 2: chosen and rejected
  rows, twice the batch) at ``--max_seq_len``, with or without ``--gradient_checkpointing``
  (:mod:`dschat.plan.phases`' formula), step 1's logits three times (logits, fp32 log-probs, their
  gradient), under ZeRO-3 one layer gathered, under ZeRO-1/2 the reduction buckets, under ZeRO-1
  with ``--gradient_accumulation_steps`` above 1 every trained parameter's whole ``.grad``;
* **optimizer step**: the resident states and the fp32 gradient copies DeepSpeed makes while
  stepping (:attr:`~dschat.plan.model_state.ModelState.step_working`).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from dschat.models.families import family_of
from dschat.models.freeze import freeze_lower_layers
from dschat.models.reward_model import VALUE_HEAD_KEY
from dschat.plan.inventory import inventory, with_lora
from dschat.plan.model_state import DTYPE_BYTES, EngineSpec, model_state
from dschat.plan.phases import Phase, activation_bytes, layer_gather_bytes, resident_bytes, step_working_set
from dschat.plan.roles import RolePlan, model_config
from dschat.training.engine_setup import step_ds_config

__all__ = ["STEP_ROLES", "plan_step_engine", "step_phases"]

#: The engine each step trains, named as in step 3's table.
STEP_ROLES = {1: "actor", 2: "reward"}

_BODY = "rwtransformer."


def plan_step_engine(args: argparse.Namespace, world: int, *, step: int, dtype: str,
                     cpu_accelerator: bool = False) -> RolePlan:
    """The trained engine of step ``step`` (1 or 2) of ``args`` on ``world`` ranks."""
    critic = step == 2
    config = model_config(args.model_name_or_path)
    inv, meta_model = inventory(config, critic=critic)  # a fresh meta build: freezing marks its parameters
    force: list[str] = []
    if critic:
        norm = family_of(config).reset_final_norm_for_reward
        if norm is not None:
            force += [f"{_BODY}{norm}.weight", f"{_BODY}{norm}.bias"]
        if args.lora_dim > 0 and args.only_optimize_lora:
            force.append(VALUE_HEAD_KEY)
    inv = with_lora(inv, meta_model, args.lora_dim, args.lora_module_name, args.only_optimize_lora, force)
    if critic and getattr(args, "freeze_layers", 0):
        frozen = freeze_lower_layers(meta_model, args.freeze_layers)
        owners = {_BODY + name.rpartition(".")[0] for name in frozen}
        inv = replace(inv, params=tuple(
            replace(p, requires_grad=False) if p.name.rpartition(".")[0] in owners else p for p in inv.params))
    ds_config = step_ds_config(args, dtype=dtype, world_size=world)
    spec = EngineSpec.from_ds_config(ds_config, world=world, trained=True, cpu_accelerator=cpu_accelerator)
    return RolePlan(STEP_ROLES[step], inv, spec, model_state(inv, spec))


def step_phases(engine: RolePlan, args: argparse.Namespace, *, step: int, dtype: str) -> list[Phase]:
    """The training and optimizer-step phases of step ``step`` for ``engine`` (:func:`plan_step_engine`)."""
    el = DTYPE_BYTES[dtype]
    plans = {engine.role: engine}
    rows = args.per_device_train_batch_size * (2 if step == 2 else 1)  # step 2: chosen and rejected rows
    seq = args.max_seq_len
    training = Phase("training", resident_bytes(plans))
    training.consumers[f"{engine.role} activations"] = activation_bytes(engine, rows, seq, el,
                                                                         args.gradient_checkpointing)
    if step == 1:
        training.consumers["logits"] = rows * seq * engine.inventory.vocab_rows * (2 * el + 4)
    training.consumers["ZeRO-3 layer gathers"] = layer_gather_bytes(engine, el)
    if engine.spec.stage in (1, 2):  # allocated as the backward starts, freed after its reduction
        training.consumers["reduction buckets"] = engine.state.buckets
    training.consumers["gradients between accumulation boundaries"] = engine.state.accumulation
    out = [training, Phase("optimizer step", {**resident_bytes(plans), **step_working_set(plans)})]
    for phase in out:
        phase.consumers = {k: v for k, v in phase.consumers.items() if v}
    return out
