"""DeepSpeed's Hybrid Engine path, and the decision made before ``deepspeed.initialize``.

:func:`decide_hybrid_engine` (``--enable_hybrid_engine``): dschat's own Hybrid Engine for the families
its decode model covers (:data:`dschat.models.decoder.layouts.LAYOUTS`), on any accelerator; for another
family, DeepSpeed's ``DeepSpeedHybridEngine`` only where it can work (a CUDA accelerator, an inference
container for the family, decoder layers that take tuple KV caches), so an unusable one is never
built. Elsewhere the actor is a plain DeepSpeed engine and the decision carries the line saying why.

:class:`DeepSpeedHybridEnginePath` serves while the engine is a Hybrid Engine with inference
containers: DeepSpeed installs its inference-kernel generate as ``module.generate``, which is called
with the rollout's decoding settings only (no log-probs are kept). ``engine.generate`` is never
called: with DeepSpeed 0.19.8 it raises ``AttributeError: ... '_generate'`` on a Hybrid Engine that
found no container. Any failure of DeepSpeed's kernels (but out of memory or a user error) turns the
path off for the rest of the run: the training-mode forwards are put back, dropout stays off, and
the training module's paths decode.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch
import transformers
from transformers import PretrainedConfig

from dschat.errors import raised
from dschat.models.decoder.layouts import unsupported_reason
from dschat.models.families import family_of
from dschat.rlhf.rollout.hf_generate import decoding_only_generation_config, generate_kwargs
from dschat.rlhf.rollout.path import DecodingPath, RolloutRequest, not_a_fallback
from dschat.rlhf.rollout.sampling import Rollout

__all__ = ["HybridEngineDecision", "decide_hybrid_engine", "cache_object_decoder_layer", "DeepSpeedHybridEnginePath",
           "NO_CONTAINER"]

NO_CONTAINER = ("--enable_hybrid_engine: DeepSpeed matched no inference container in this model; "
                "generating with the actor module's own generate()")


@dataclass(frozen=True)
class HybridEngineDecision:
    """Whether the actor's DeepSpeed config enables the Hybrid Engine, and if not, why not."""

    requested: bool
    enabled: bool  # DeepSpeed's Hybrid Engine is built (families dschat's engine does not cover)
    reason: str | None = None
    dschat_engine: bool = False  # dschat's own Hybrid Engine decodes the rollouts (dschat.rlhf.rollout.dschat_engine)


def decide_hybrid_engine(requested: bool, model_config: PretrainedConfig, accelerator: str) -> HybridEngineDecision:
    """``--enable_hybrid_engine``: dschat's own Hybrid Engine for the families its decode model covers
    (:data:`dschat.models.decoder.layouts.LAYOUTS`), on any accelerator. For other families, DeepSpeed's
    Hybrid Engine only where it can work: a CUDA accelerator and a model family with an inference
    container (DeepSpeed's HE kernels are CUDA-only; other families crash or produce gibberish under
    HE: docs/upstream.md#deepspeeds-hybrid-engine-and-model-families)."""
    if not requested:
        return HybridEngineDecision(False, False)
    why_not_dschat = unsupported_reason(model_config)
    if why_not_dschat is None:
        return HybridEngineDecision(True, False, dschat_engine=True)
    family = family_of(model_config)
    model_type = getattr(model_config, "model_type", "?")
    not_ours = f"--enable_hybrid_engine: dschat's Hybrid Engine does not cover this model ({why_not_dschat}), and "
    if accelerator != "cuda":
        return HybridEngineDecision(True, False, (
            f"{not_ours}DeepSpeed's Hybrid Engine needs CUDA inference kernels and the "
            f"accelerator is {accelerator!r}; generating with the actor module's own generate()"))
    if not family.hybrid_engine_container:
        return HybridEngineDecision(True, False, (
            f"{not_ours}DeepSpeed has no inference container for model type "
            f"{model_type!r}; generating with the actor module's own generate()"))
    layer = cache_object_decoder_layer(model_type)
    if layer is not None:
        return HybridEngineDecision(True, False, (
            f"{not_ours}DeepSpeed's inference layers keep the legacy tuple KV cache, and "
            f"transformers {transformers.__version__}'s {layer} passes Cache objects (DeepSpeed itself keeps "
            f"OPT off its Hybrid Engine for this reason; for LLaMA it fails to generate or aborts the "
            f"process); generating with the actor module instead"))
    return HybridEngineDecision(True, True)


def cache_object_decoder_layer(model_type: str) -> str | None:
    """The name of ``model_type``'s transformers decoder layer if it is handed Cache objects, else None:
    always from transformers 5 on (tuple caches were removed), before that when its ``forward`` takes
    ``past_key_values`` / ``cache_position`` (DeepSpeed's own test for OPT).

    DeepSpeed's injected inference layers implement only the tuple ``layer_past`` contract.
    DeepSpeed 0.19.8 checks this for OPT and then builds no container (so ``engine.generate`` has
    nothing to run); for LLaMA it does not check, and on an H100 with transformers 5 its kernels
    failed with a shape error or aborted the whole process inside ``softmax_context``, which no
    fallback can catch. Hence this check is made before the engine is built.
    """
    try:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return None
    layers = [cls for name, cls in vars(modeling).items()
              if inspect.isclass(cls) and issubclass(cls, torch.nn.Module) and cls.__module__ == modeling.__name__
              and name.endswith(("DecoderLayer", "Layer", "Block"))]
    if not layers:
        return None
    layer = min(layers, key=lambda cls: (not cls.__name__.endswith("DecoderLayer"), cls.__name__))
    params = inspect.signature(layer.forward).parameters
    if int(transformers.__version__.split(".")[0]) >= 5 or "past_key_values" in params or "cache_position" in params:
        return layer.__name__
    return None


class DeepSpeedHybridEnginePath(DecodingPath):
    """DeepSpeed's Hybrid Engine: its generate, installed on the module (see the module docstring)."""

    name = loop = "hybrid-engine"
    falls_back = True
    label = "DeepSpeed's Hybrid Engine"

    def can_serve(self, request: RolloutRequest) -> str | None:
        gen = self.gen
        if gen.hybrid_engine_active:
            return None
        decision = gen.decision
        if not decision.requested:
            return "no --enable_hybrid_engine"
        if decision.dschat_engine:
            return "dschat's Hybrid Engine covers this model; DeepSpeed's is not built"
        if decision.reason:  # the notice said at start-up, without its flag prefix
            return decision.reason.removeprefix("--enable_hybrid_engine: ")
        if getattr(gen.actor, "_inference_containers", None):
            return "DeepSpeed's Hybrid Engine failed to generate; off for the rest of the run"
        return "DeepSpeed found no inference container in this model"

    def generate(self, request: RolloutRequest) -> Rollout:
        gen, module = self.gen, self.gen.actor.module
        with decoding_only_generation_config(module, gen.decoding):
            return Rollout(module.generate(request.prompts, **generate_kwargs(gen, request.mask)), None)

    def fall_back(self, err: Exception, request: RolloutRequest) -> str | None:
        if not_a_fallback(err):
            return None
        gen = self.gen
        gen.hybrid_engine_active = False
        # Restore the training-mode forwards the Hybrid Engine swapped out, keep dropout off.
        gen.actor.train(True)
        gen.actor.module.eval()
        return (f"--enable_hybrid_engine: DeepSpeed's Hybrid Engine failed to generate "
                f"({raised(err)}); generating with the actor module's own generate() from now on")
