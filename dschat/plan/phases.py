"""Per-GPU memory of each phase of a PPO step: an estimate built on the exact model states.

The model states (:mod:`dschat.plan.model_state`) are exact; what a phase adds is estimated:

* **generation** with dschat's Hybrid Engine (:func:`hybrid_engine_used`: ``--enable_hybrid_engine``,
  a family its decode model covers, and under ZeRO-3 at ``--inference_tp_size 1`` the actor gathered
  whole): its inference copy of the weights, its KV cache, the last position's logits and the ZeRO-3
  gather that refreshes the copy (:func:`inference_copy`, formulas below). Otherwise the training module
  decodes: the actor gathered whole under ZeRO-3 where the run gathers it
  (``--zero3_gather_for_generation``, else one layer at a time), the KV cache ``2 x layers x batch x
  (prompt + answer) x kv_heads x head_dim`` in the weights' dtype (``head_dim``: the config's, else
  ``hidden / heads``, as the Hybrid Engine's), and the last position's fp32 logits;
* **scoring**: one forward of each model over ``batch x (prompt + answer)``: the actor's and the
  reference's logits (weights' dtype) and their log-probs' fp32 working set (:func:`logits_bytes`); per
  ZeRO-3 model, the whole model
  where ``--zero3_gather_for_scoring`` gathers it (``auto``: the full model fits in half the memory the
  resident states and a kept Hybrid Engine copy leave free, and its parameters are not offloaded),
  else its largest layer; the
  largest of the models (the passes run one after the other);
* **actor / critic training**: activations per layer ``b s h (34 + 5 a s / h)`` bytes at 2 bytes
  per element (Korthikanti et al., 2022), scaled by the dtype; with gradient checkpointing one
  ``b s h`` per layer plus one layer's full activations; the actor's logits twice (logits, their
  gradient) and their log-probs' fp32 working set (:func:`logits_bytes`); ZeRO-3: the whole model where ``--zero3_gather_for_training``
  gathers it (``auto``: one data-parallel rank, parameters neither offloaded nor quantized, where the
  gather costs nothing), else one layer at a time (``stage3_max_live_parameters`` bounds it); a
  ZeRO-1/2 engine's reduction buckets (:attr:`~dschat.plan.model_state.ModelState.buckets`: allocated
  at each backward's start, released after its reduction);
  under ZeRO-1 with gradient accumulation, every trained parameter's whole ``.grad`` between
  boundaries (:attr:`~dschat.plan.model_state.ModelState.accumulation`);
* **optimizer step**: the model states and the fp32 gradient copies DeepSpeed makes while stepping
  (:attr:`~dschat.plan.model_state.ModelState.step_working`), of the larger of the actor's and the
  critic's steps (they run one after the other).

Only the engines the run builds are planned (:func:`dschat.plan.roles.planned_roles`): a critic-free
algorithm has no critic and no critic-training phase, a reward given without the reward model no
reward model. Every planned model's states stay resident through every phase (dschat keeps all its
engines alive, the ``--enable_ema`` copy of the actor included), and so do the Hybrid Engine's
weights and cache unless ``--release_inference_cache`` frees them after each rollout.

**The Hybrid Engine's bytes** per GPU, with ``N = --inference_tp_size``
(:mod:`dschat.rlhf.rollout.dschat_engine`, :mod:`dschat.rlhf.rollout.tensor_parallel`):

* inference weights: every weight of the actor except the LoRA factors (fused into their base
  weights), in the actor's dtype; with ``N > 1`` the decoder layers' tensors larger than ``hidden``
  (the q/k/v, output, gate/up and down matrices, the MLP's column-parallel bias) split ``1/N``, the
  embedding and an untied LM head ``ceil(V / N)`` rows, everything else whole;
* KV cache: ``2 x layers x (N x batch) x kv_heads_per_member x capacity x head_dim`` elements in the
  actor's dtype plus a ``(N x batch, capacity)`` bool mask, ``capacity = capacity_for(prompt +
  answer, 64)`` (the engine's rounding), ``kv_heads_per_member = kv_heads / N`` (1 where ``N`` is a
  multiple of ``kv_heads``): a tensor-parallel group decodes its members' prompts as one batch;
* logits: ``(N x batch, ceil(V / N))`` fp32;
* ZeRO-3 gather while the copy is refreshed: at ``N = 1`` the whole actor; at ``N > 1``
  ``--tp_gather_partition_size`` decoder layers at a time (or the embeddings, norms and head, gathered
  first, if larger), less this rank's partitions. Counted with the cache: a kept cache is there
  while the next rollout refreshes.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from typing import Any

from dschat.models.decoder.kv_cache import StaticKVCache
from dschat.models.decoder.layouts import decoder_spec, unsupported_reason
from dschat.models.decoder.tensor_parallel import kv_heads_per_member, padded_vocab
from dschat.plan.inventory import Inventory
from dschat.plan.model_state import DTYPE_BYTES
from dschat.plan.roles import RolePlan, model_config

__all__ = ["Phase", "phases", "PHASES", "resident_bytes", "activation_bytes", "layer_gather_bytes",
           "host_bytes_at_load", "InferenceCopy", "hybrid_engine_used", "inference_copy", "inference_weight_numel",
           "kv_cache_bytes", "head_dim", "logits_bytes", "step_working_set", "LOAD_ORDER"]

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


CACHE_MULTIPLE = 64  # DschatHybridEngine's default cache_multiple
_LAYER = re.compile(r"\.\d+\.")  # a parameter of a numbered decoder block


@dataclass(frozen=True)
class InferenceCopy:
    """The Hybrid Engine's bytes per GPU during generation (see the module docstring)."""

    weights: int
    cache: int
    logits: int
    gather: int
    kept: bool


def hybrid_engine_used(actor: RolePlan, config: Any, args: argparse.Namespace, gathers_whole: bool) -> bool:
    """Whether the run decodes with dschat's Hybrid Engine (``DschatEnginePath._why_not``'s rule)."""
    if not args.enable_hybrid_engine or unsupported_reason(config) is not None:
        return False
    tp = max(1, int(getattr(args, "inference_tp_size", 1)))
    return tp > 1 or actor.spec.stage != 3 or gathers_whole


def inference_weight_numel(inv: Inventory, n: int) -> int:
    """Elements of the inference layout held by one of ``n`` tensor-parallel members."""
    total = 0
    for p in inv.params:
        if "lora_right_weight" in p.name or "lora_left_weight" in p.name:
            continue  # fused into the base weight
        if n <= 1:
            total += p.numel
        elif _LAYER.search(p.name):
            total += p.numel // n if p.numel > inv.hidden else p.numel
        elif p.numel % inv.vocab_rows == 0:  # the token embedding, an untied LM head
            total += padded_vocab(inv.vocab_rows, n) // n * (p.numel // inv.vocab_rows)
        else:
            total += p.numel
    return total


def kv_cache_bytes(config: Any, batch: int, length: int, el: int, n: int = 1) -> int:
    """One member's StaticKVCache for ``batch`` rows of its own (the group decodes ``n x batch``)."""
    spec = decoder_spec(config)
    rows = n * batch
    capacity = StaticKVCache.capacity_for(length, CACHE_MULTIPLE)
    kv = kv_heads_per_member(spec.num_kv_heads, n)
    return 2 * spec.num_layers * rows * kv * capacity * spec.head_dim * el + rows * capacity


def logits_bytes(batch: int, seq: int, vocab: int, el: int, copies: int) -> int:
    """``copies`` ``(batch, seq, vocab)`` tensors in the logits' dtype (``el`` bytes: the logits, and in
    training their gradient) plus the float32 working set of their log-probs
    (:func:`dschat.rl_math.logprobs.gather_log_probs`): for fp32 logits, ``logsumexp``'s whole
    ``(batch, seq, vocab)`` temporary; for fp16/bf16 ones, computed one batch row at a time, a row's
    float32 copy and its exponentials, ``2 x (seq, vocab)``."""
    return copies * batch * seq * vocab * el + (batch if el >= 4 else 2) * seq * vocab * 4


def head_dim(config: Any) -> int:
    """The attention head width: the config's ``head_dim`` (Qwen3's differs from ``hidden / heads``),
    else ``hidden / heads`` (the Hybrid Engine's ``decoder_spec`` rule, for any family)."""
    heads = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1)
    hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0)
    return int(getattr(config, "head_dim", None) or hidden // max(1, heads))


def _partial_gather(actor: RolePlan, layers_per_gather: int, el: int) -> int:
    """Bytes of the largest piece the tensor-parallel refresh gathers, less this rank's partitions."""
    if actor.spec.stage != 3:
        return 0
    inv = actor.inventory
    in_layers = sum(p.numel for p in inv.params if _LAYER.search(p.name))
    outside = inv.numel - in_layers
    piece = max(outside, in_layers * min(max(1, layers_per_gather), inv.layers) // max(1, inv.layers))
    return piece * el - math.ceil(piece / actor.spec.world) * el


def inference_copy(actor: RolePlan, config: Any, args: argparse.Namespace, el: int, whole_gather: int) -> InferenceCopy:
    """The Hybrid Engine's generation bytes for ``actor`` (``whole_gather``: the whole actor gathered)."""
    n = max(1, int(getattr(args, "inference_tp_size", 1)))
    batch = args.per_device_generation_batch_size
    length = args.max_prompt_seq_len + args.max_answer_seq_len
    gather = whole_gather if n == 1 else _partial_gather(actor, args.tp_gather_partition_size, el)
    return InferenceCopy(weights=inference_weight_numel(actor.inventory, n) * el,
                         cache=kv_cache_bytes(config, batch, length, el, n),
                         logits=n * batch * (padded_vocab(actor.inventory.vocab_rows, n) // n) * 4,
                         gather=gather, kept=not args.release_inference_cache)


def _scoring_gathers(plan: RolePlan, args: argparse.Namespace, el: int, free: int | None) -> bool:
    """Whether ``--zero3_gather_for_scoring`` gathers ``plan``'s ZeRO-3 model whole for its scoring pass
    (``ScoringGather``: ``auto`` never an offloaded model, else where it fits in half the free memory)."""
    mode = getattr(args, "zero3_gather_for_scoring", "auto")
    if plan.spec.stage != 3 or mode == "off":
        return False
    if mode == "on":
        return True
    if plan.spec.offload_param:
        return False
    return free is None or plan.inventory.numel * el <= max(0, free) // 2


def _training_gathers(plan: RolePlan, args: argparse.Namespace) -> bool:
    """Whether ``--zero3_gather_for_training`` runs ``plan``'s ZeRO-3 passes gathered whole
    (``TrainingGather``: ``auto`` on one data-parallel rank, parameters neither offloaded nor quantized)."""
    mode = getattr(args, "zero3_gather_for_training", "auto")
    if plan.spec.stage != 3 or mode == "off":
        return False
    if mode == "on":
        return True
    quantized = bool(getattr(args, "enable_mixed_precision_lora", False)) and plan.role == "actor"
    return plan.spec.world == 1 and not plan.spec.offload_param and not quantized


def _training_working_set(plan: RolePlan, args: argparse.Namespace, el: int) -> dict[str, int]:
    """The ZeRO gathers and buckets of ``plan``'s forward and backward."""
    role = plan.role
    out = {f"{role} gathered whole" if _training_gathers(plan, args) else "ZeRO-3 layer gathers":
           _gathered(plan, el) if _training_gathers(plan, args) else layer_gather_bytes(plan, el)}
    if plan.spec.stage in (1, 2):
        out[f"{role} reduction buckets"] = plan.state.buckets
    out[f"{role} gradients between accumulation boundaries"] = plan.state.accumulation
    return out


def step_working_set(plans: dict[str, RolePlan]) -> dict[str, int]:
    """The optimizer step's working set: the largest of the trained engines' fp32 gradient copies
    (:attr:`~dschat.plan.model_state.ModelState.step_working`; the steps run one after the other)."""
    trained = [p for p in plans.values() if p.spec.trained and p.state.step_working]
    if not trained:
        return {}
    largest = max(trained, key=lambda p: p.state.step_working)
    return {f"{largest.role} step's fp32 gradients": largest.state.step_working}


def phases(plans: dict[str, RolePlan], args: argparse.Namespace, dtype: str,
           gpu_bytes: int | None = None) -> list[Phase]:
    """The phases of one PPO step for ``plans`` (:func:`dschat.plan.roles.plan_roles`) on a GPU of
    ``gpu_bytes`` (which decides the ``--zero3_gather_*`` flags' ``auto``): those of :data:`PHASES`,
    without critic training when ``plans`` has no critic."""
    el = DTYPE_BYTES[dtype]
    resident = resident_bytes(plans)
    actor, critic = plans["actor"], plans.get("critic")
    seq = args.max_prompt_seq_len + args.max_answer_seq_len
    gen_b, train_b = args.per_device_generation_batch_size, args.per_device_training_batch_size
    inv = actor.inventory
    config = model_config(args.actor_model_name_or_path)
    gathers = _gathers_for_generation(actor, args, el, sum(resident.values()), gpu_bytes)
    generation = Phase("generation", dict(resident))
    kept: dict[str, int] = {}
    if hybrid_engine_used(actor, config, args, gathers):
        he = inference_copy(actor, config, args, el, _gathered(actor, el))
        generation.consumers.update({"HE inference weights": he.weights, "HE KV cache": he.cache,
                                     "ZeRO-3 gathers for the HE copy": he.gather, "logits": he.logits})
        if he.kept:
            kept = {"HE inference weights (kept)": he.weights, "HE KV cache (kept)": he.cache}
    else:
        if gathers:
            generation.consumers["actor gathered whole"] = _gathered(actor, el)
        else:  # fetched layer by layer for every token
            generation.consumers["ZeRO-3 layer gathers"] = layer_gather_bytes(actor, el)
        generation.consumers["KV cache"] = 2 * inv.layers * gen_b * seq * inv.kv_heads * head_dim(config) * el
        generation.consumers["logits"] = gen_b * inv.vocab_rows * 4
    out = [generation]
    free = None if gpu_bytes is None else gpu_bytes - sum(resident.values()) - sum(kept.values())
    scoring = Phase("scoring", {**resident, **kept})
    scoring.consumers["logits"] = logits_bytes(gen_b, seq, inv.vocab_rows, el, copies=1)
    scoring.consumers["hidden states"] = gen_b * seq * max(p.inventory.hidden for p in plans.values()) * el * 4
    scored = {role: p for role, p in plans.items() if role != "ema"}  # the EMA copy runs no pass
    working = {role: (_gathered(p, el), f"{role} gathered whole") if _scoring_gathers(p, args, el, free)
               else (layer_gather_bytes(p, el), "ZeRO-3 layer gathers") for role, p in scored.items()}
    largest, name = max(working.values(), key=lambda w: w[0])  # the first of the largest
    scoring.consumers[name] = largest
    out.append(scoring)
    actor_train = Phase("actor training", {**resident, **kept})
    actor_train.consumers["actor activations"] = activation_bytes(actor, train_b, seq, el, args.actor_gradient_checkpointing)
    actor_train.consumers["logits"] = logits_bytes(train_b, seq, inv.vocab_rows, el, copies=2)
    actor_train.consumers.update(_training_working_set(actor, args, el))
    if critic is not None and dtype == "fp16" and getattr(args, "align_overflow", False):
        # --align_overflow: the critic's forward and backward run while the actor's graph is alive
        # (both losses are checked before either backward).
        actor_train.consumers["critic activations"] = activation_bytes(critic, train_b, seq, el,
                                                                       args.critic_gradient_checkpointing)
        for key, value in _training_working_set(critic, args, el).items():
            actor_train.consumers[key] = actor_train.consumers.get(key, 0) + value
    out.append(actor_train)
    if critic is not None:
        critic_train = Phase("critic training", {**resident, **kept})
        critic_train.consumers["critic activations"] = activation_bytes(critic, train_b, seq, el,
                                                                    args.critic_gradient_checkpointing)
        critic_train.consumers.update(_training_working_set(critic, args, el))
        out.append(critic_train)
    out.append(Phase("optimizer step", {**resident, **kept, **step_working_set(plans)}))
    for phase in out:
        phase.consumers = {k: v for k, v in phase.consumers.items() if v}
    return out


LOAD_ORDER = ("actor", "ref", "ema", "critic", "reward")  # DeepSpeedRLHFEngine builds them in this order


def host_bytes_at_load(plans: dict[str, RolePlan], gpus_per_node: int) -> int:
    """Peak host memory while the models load, per node. The run builds its engines one at a time
    (:data:`LOAD_ORDER`): every rank reads a model whole in fp32 (ZeRO-3 models are built
    partitioned), and DeepSpeed moves it to the GPU before the next is read; the offloaded states
    of the engines built so far stay. The peak is the largest, over the models, of the offloaded
    states up to and including it plus its own fp32 read."""
    peak = kept = 0
    for role in sorted(plans, key=lambda r: LOAD_ORDER.index(r) if r in LOAD_ORDER else len(LOAD_ORDER)):
        plan = plans[role]
        kept += sum(plan.state.host.values())
        peak = max(peak, kept + (plan.inventory.numel * 4 if plan.spec.stage != 3 else 0))
    return peak * gpus_per_node
