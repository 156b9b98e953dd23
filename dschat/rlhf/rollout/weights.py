"""The training module's weights during a rollout: the ZeRO-3 gather decision and LoRA fusion.

* **ZeRO-3** (:func:`should_gather`): Hugging Face ``generate`` under ZeRO-3 all-gathers every layer's
  weights for every generated token. When the full model fits in free memory (full parameter bytes
  <= half of the free accelerator / host memory; ``--zero3_gather_for_generation on|off`` overrides),
  all parameters are gathered once per rollout with DeepSpeed's fetch/release hooks detached for the
  duration, then restored. Decided at the first rollout (the same answer on every rank), said once.
* **LoRA** layers are fused into their base weights for the rollout (one matmul per layer instead of
  three) and unfused after it, which puts the frozen base weights back bit for bit
  (:meth:`~dschat.models.lora.LinearLayer_LoRA.fuse_lora_weight`).

:func:`module_weights` is what the module paths decode inside; :func:`materialised` is what dschat's
Hybrid Engine copies its inference weights inside (every LoRA layer fused, ZeRO-3 gathered).
The functions read and write the generator's attributes (``zero_stage``, ``zero3_gather``,
``fuse_lora``, ``hybrid_engine_active``, ``_gather_decided``); they call nothing of it.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Iterator

from dschat.models.lora import LinearLayer_LoRA
from dschat.rlhf.rollout.path import say_once
from dschat.runtime.zero3 import fits_gathered, gathered_without_hooks, parameter_offload

if TYPE_CHECKING:
    from dschat.rlhf.rollout.generator import RolloutGenerator

__all__ = ["lora_layers", "layers_to_fuse", "should_gather", "materialised", "module_weights"]


def lora_layers(gen: RolloutGenerator) -> list[LinearLayer_LoRA]:
    """The actor's LoRA layers."""
    return [m for m in gen.actor.module.modules() if isinstance(m, LinearLayer_LoRA)]


def layers_to_fuse(gen: RolloutGenerator, materialised: bool) -> list[LinearLayer_LoRA]:
    """The LoRA layers to fuse for this rollout (each holds one extra copy of its weight while fused).

    * None when ZeRO-3 weights are not materialised (fetched layer by layer for every token): the
      fused weight would have to be written into the partitions, with a saved copy of each one
      (the whole weight on one rank) -- memory this path is taken to save, for a gain that the
      per-token all-gathers swamp. The unfused LoRA branch gives the same policy.
    * Not 4-bit (QLoRA) layers: fusing needs their dense weight, and keeping it for every layer
      during generation costs the memory the 4-bit base saves (and would leave them dense for
      good). They run unfused: correct, just slower.
    """
    if not gen.fuse_lora or not materialised:
        return []
    return [layer for layer in lora_layers(gen) if not layer.is_quantized]


def should_gather(gen: RolloutGenerator) -> bool:
    """Whether a ZeRO-3 actor is gathered once per rollout (decided at the first call, said once)."""
    if gen.zero_stage != 3 or gen.hybrid_engine_active or gen.zero3_gather == "off":
        return False
    if gen._gather_decided is None:
        if gen.zero3_gather == "on":
            gen._gather_decided = True
        else:
            gen._gather_decided = fits_gathered(gen.actor.module)  # the same answer on every rank
        say_once(gen, "ZeRO-3 generation: " + (
            "gathering the actor's parameters once per rollout" if gen._gather_decided else
            "parameters are fetched layer by layer for each token (full model "
            "does not fit in half the free memory, or --zero3_gather_for_generation off)"))
    return gen._gather_decided


@contextmanager
def materialised(gen: RolloutGenerator) -> Iterator[None]:
    """For dschat's Hybrid Engine: the actor's full, LoRA-fused weights inside: ZeRO-3 gathered
    once, every LoRA layer fused (and unfused again on exit, bit for bit)."""
    with gathered_without_hooks(gen.actor) if gen.zero_stage == 3 else nullcontext():
        layers = lora_layers(gen)
        for layer in layers:
            layer.fuse_lora_weight()
        try:
            yield
        finally:
            for layer in layers:
                layer.unfuse_lora_weight()


@contextmanager
def module_weights(gen: RolloutGenerator) -> Iterator[bool]:
    """For the module paths: ZeRO-3 gathered once if allowed, LoRA fused where it may be; yields
    whether the weights are materialised (not ZeRO-3 fetched layer by layer)."""
    gather: ContextManager[Any] = nullcontext()
    gathered = False
    if should_gather(gen):
        try:
            parameter_offload(gen.actor)
            gather = gathered_without_hooks(gen.actor)
            gathered = True
        except AttributeError as err:
            say_once(gen, f"ZeRO-3 generation: cannot detach DeepSpeed's hooks ({err}); fetching per layer")
    # Under ZeRO-3 without the gather, weights exist only inside each layer's forward.
    whole = gen.zero_stage != 3 or gathered
    lora = layers_to_fuse(gen, whole)
    with gather:
        for layer in lora:
            layer.fuse_lora_weight()
        try:
            yield whole
        finally:
            for layer in lora:
                layer.unfuse_lora_weight()
