"""Rollout generation: dschat's Hybrid Engine, DeepSpeed's where it works, the module's ``generate`` elsewhere.

The trainer calls one object, :class:`RolloutGenerator`, whatever the set-up:

* ``--enable_hybrid_engine`` with a family dschat's decode model covers (Llama, Mistral, Qwen2/3,
  Phi-3, Gemma, OPT, GPT-NeoX -- :data:`dschat.models.decoder.LAYOUTS`), on any accelerator, and
  ``--generation_loop auto`` on a CPU: **dschat's Hybrid Engine**
  (:class:`dschat.rlhf.rollout_engine.DschatHybridEngine`): the weights, gathered and LoRA-fused as
  below, are copied into an inference layout, and dschat's own decode forward samples the rollout.
  Where it cannot run (4-bit LoRA bases, ZeRO-3 weights fetched per layer, logits processors; a compile
  failure on CUDA) the module path below decodes, saying why once when the flag asked for it.
* ``--enable_hybrid_engine`` with another family that has a DeepSpeed inference container (BLOOM,
  GPT-J, ... -- :data:`dschat.models.families.FAMILIES`) on a CUDA accelerator:
  the actor engine is built as a ``DeepSpeedHybridEngine`` (inference kernels, ZeRO-3 gathering
  and LoRA fusion done by DeepSpeed). :func:`decide_hybrid_engine` makes that decision *before*
  ``deepspeed.initialize``, so an unusable Hybrid Engine is never built.
* Everywhere else (CPU; a family without a container; a Hybrid Engine that fails at run time) the
  engine is a plain DeepSpeed engine and generation calls ``engine.module.generate`` -- the
  Hugging Face method. The reason is printed once. Note that with DeepSpeed 0.19.8 calling
  ``engine.generate`` on a Hybrid Engine that found no inference container raises
  ``AttributeError: ... '_generate'`` (it only sets ``_generate`` when containers exist); this
  module never calls ``engine.generate``: DeepSpeed installs its fast path as ``module.generate``.

Without the Hybrid Engine two things upstream's HE did are done here instead:

* **LoRA** layers are fused into their base weights for generation (one matmul per layer instead of
  three) and unfused afterwards, which puts the frozen base weights back bit for bit
  (:meth:`~dschat.models.lora.LinearLayer_LoRA.fuse_lora_weight`). Not fused: 4-bit (QLoRA)
  layers, and every layer when ZeRO-3 weights are fetched layer by layer (see
  :meth:`RolloutGenerator._layers_to_fuse`).
* **ZeRO-3**: Hugging Face ``generate`` under ZeRO-3 all-gathers every layer's weights for every
  generated token (DSE #764: "ZeRO-3 generation is slow"). When the full model fits in free memory
  (a simple estimate: full parameter bytes <= half of the free accelerator / host memory;
  ``--zero3_gather_for_generation on|off`` overrides), all parameters are gathered once per rollout
  and DeepSpeed's fetch/release hooks are detached for the duration (TRL's
  ``unwrap_model_for_generation`` does the same), then restored.

And one thing neither did: the module path keeps the **log-probs of the generated tokens** (the raw
logits divided by the sampling temperature), so the trainer need not run the actor over the rollout
again for its old log-probs (:class:`Rollout`). Through ``generate`` (``--generation_loop hf``) the
price is that it holds the fp32 logits of every step until it returns: B x A' x V x 4 bytes (16 x
256 x 50272 x 4 = 0.8 GB for upstream's OPT protocol), freed right after; dschat's loop does not.

On the module path the decoding itself is dschat's (:mod:`dschat.rlhf.decoding`): its own sampling
loop instead of ``generate`` (``--generation_loop``; it takes each step's log-probs as it goes, so
no per-step logits are held), and on a CPU the decode steps' linear layers run with oneDNN on weights
repacked once per rollout (``--cpu_decode_linear``; measured in ``benchmarks/results.md``).

On CUDA the default ``--generation_loop auto`` decodes with ``generate``, a static KV cache and CUDA
graphs (``torch.compile(mode="reduce-overhead")``; ``graphs``), prompts left-padded to a multiple of 64
so one captured graph serves the rollouts of a prompt width; dschat's eager loop on a GPU spends
most of its step launching kernels (measured in ``benchmarks/results.md``). Where graphs do not
apply (a CPU, ZeRO-3 weights fetched per layer, encoder-decoders) ``auto`` is dschat's loop,
without a word; an explicit ``graphs`` says why.

Each fast path is an attribute of :class:`RolloutGenerator` (``keep_logprobs``, ``fuse_lora``,
``generation_loop``, ``cpu_decode_linear``) so ``benchmarks/step3.py`` can turn it off for its baseline.
"""
from __future__ import annotations

import importlib
import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator

import torch
import transformers
from deepspeed import DeepSpeedEngine
from transformers import CompileConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from dschat.errors import UserError, first_line
from dschat.models.decoder.layouts import unsupported_reason
from dschat.models.families import family_of
from dschat.models.lora import LinearLayer_LoRA
from dschat.rlhf import decoding as decoding_loop  # its functions called through the module: tests spy on them
from dschat.rlhf.decoding import DecodingSettings, Rollout, generated_token_logprobs
from dschat.rlhf.rollout_engine import ENGINE_NAME, DschatHybridEngine, rollout_summary_line
from dschat.rlhf.tensor_parallel import TensorParallelHybridEngine, materialised_part
from dschat.runtime.compile_cache import use_private_compile_cache
from dschat.runtime.dist import TensorParallelGroup, print_rank_0, tensor_parallel_group
from dschat.runtime.zero3 import full_parameter_bytes as zero3_full_parameter_bytes
from dschat.runtime.zero3 import (fits_gathered, free_memory_bytes, gathered_without_hooks, parameter_offload,
                                  release_zero3_prefetch)

__all__ = [
    "HybridEngineDecision",
    "DecodingSettings",
    "decide_hybrid_engine",
    "cache_object_decoder_layer",
    "RolloutGenerator",
    "zero3_full_parameter_bytes",
]


@dataclass(frozen=True)
class HybridEngineDecision:
    """Whether the actor's DeepSpeed config enables the Hybrid Engine, and if not, why not."""

    requested: bool
    enabled: bool  # DeepSpeed's Hybrid Engine is built (families dschat's engine does not cover)
    reason: str | None = None
    dschat_engine: bool = False  # dschat's own Hybrid Engine decodes the rollouts (dschat.rlhf.rollout_engine)


def decide_hybrid_engine(requested: bool, model_config: PretrainedConfig, accelerator: str) -> HybridEngineDecision:
    """``--enable_hybrid_engine``: dschat's own Hybrid Engine for the families its decode model covers
    (:data:`dschat.models.decoder.LAYOUTS`), on any accelerator. For other families, DeepSpeed's
    Hybrid Engine only where it can work: a CUDA accelerator and a model family with an inference
    container (DeepSpeed's HE kernels are CUDA-only; other families crash or produce gibberish under
    HE, DSE #821/#864, DeepSpeed #4954)."""
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


def _not_a_fallback(err: BaseException) -> bool:
    """Out of memory is never a reason to fall back to another decoding path, nor is a user error (a
    compile cache folder that is not the user's own): both are re-raised."""
    return (isinstance(err, (torch.OutOfMemoryError, UserError))
            or "out of memory" in str(err).lower())


def _one_line(err: BaseException, limit: int | None = None) -> str:
    """``Type: first line of the message`` (cut to ``limit`` characters), for a fallback notice."""
    return f"{type(err).__name__}: {first_line(err)[:limit]}"


class RolloutGenerator:
    """Generates answers for a batch of left-padded prompts with the actor engine.

    ``zero3_gather`` is ``"auto"`` (gather when the estimate says it fits), ``"on"`` or ``"off"``;
    it matters only for an actor under ZeRO-3 without the Hybrid Engine.
    """

    def __init__(
        self,
        actor: DeepSpeedEngine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        decision: HybridEngineDecision,
        decoding: DecodingSettings,
        max_answer_seq_len: int,
        zero_stage: int,
        zero3_gather: str = "auto",
        generation_loop: str = "auto",
        cpu_decode_linear: str = "onednn",
        release_inference_cache: bool = False,
        inference_tp_size: int = 1,
        tp_gather_partition_size: int = 8,
    ) -> None:
        self.actor = actor
        self.tokenizer = tokenizer
        self.decision = decision
        self.decoding = decoding
        self.max_answer_seq_len = max_answer_seq_len
        self.zero_stage = zero_stage
        self.zero3_gather = zero3_gather
        self.synced_gpus = zero_stage == 3  # upstream: every rank steps until all have finished
        self.fallback_reason: str | None = None
        self._said: set[str] = set()
        self.hybrid_engine_active = decision.enabled and bool(getattr(actor, "_inference_containers", None))
        if decision.reason:
            self._fallback(decision.reason)
        elif decision.enabled and not self.hybrid_engine_active:
            self._fallback("--enable_hybrid_engine: DeepSpeed matched no inference container in this model; "
                           "generating with the actor module's own generate()")
        self._gather_decided: bool | None = None
        # Fast paths, on by default (benchmarks/step3.py turns them off for its baseline).
        self.keep_logprobs = True  # return the generated tokens' log-probs (module path only)
        self.fuse_lora = True  # fuse LoRA into the base weights for generation
        # "auto" ("graphs" where it applies, else "dschat") | "dschat" (dschat.rlhf.decoding.sample_loop)
        # | "hf" (generate) | "graphs" (generate, static cache, CUDA graphs)
        self.generation_loop = generation_loop
        self.last_loop: str | None = None  # what the last rollout decoded with: hybrid-engine|graphs|dschat|hf
        self.graph_devices: tuple[str, ...] = ("cuda",)  # where "graphs" applies (tests add "cpu")
        self.graph_prompt_multiple = 64  # prompts are left-padded to a multiple of this for "graphs"
        self._graph_compile_config: CompileConfig | None = None
        self.cpu_decode_linear = cpu_decode_linear  # "onednn" | "off": decode-sized linears on a CPU
        self.extra_generate_kwargs: dict[str, Any] = {}  # e.g. min_new_tokens for a fixed-length benchmark
        # dschat's Hybrid Engine (dschat.rlhf.rollout_engine): --enable_hybrid_engine for a family its
        # decode model covers (benchmarks/step3.py's ours-he mode sets it too) ...
        self.use_dschat_engine = decision.dschat_engine
        # ... and --generation_loop auto on these devices: none yet. On a CPU it is as exact as dschat's
        # loop and faster (benchmarks/results.md), but the CPU demo's published figures were measured
        # with dschat's loop, and a sampled token can differ at a rounding boundary; CUDA keeps "graphs"
        # until the engine is measured there. Add "cpu" / "cuda" here once those are re-measured.
        self.auto_engine_devices: tuple[str, ...] = ()
        self.release_inference_cache = release_inference_cache  # free its KV cache and weight buffers after each rollout
        self.engine: DschatHybridEngine | None = None
        self._summary_said = False
        # --inference_tp_size N: dschat's Hybrid Engine decodes over groups of N ranks (dschat.rlhf.tensor_parallel),
        # gathering --tp_gather_partition_size ZeRO-3 layers at a time. The groups are made here (collective).
        self.inference_tp_size = inference_tp_size
        self.tp_gather_partition_size = tp_gather_partition_size
        self.tp_group: TensorParallelGroup | None = (tensor_parallel_group(inference_tp_size)
                                                     if inference_tp_size > 1 else None)

    # ------------------------------------------------------------------ logging once
    def _say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            print_rank_0(message)

    def _fallback(self, reason: str) -> None:
        self.fallback_reason = reason
        self._say_once(reason)

    # ------------------------------------------------------------------ mode switches
    def eval(self) -> None:
        """Put the actor in inference mode (the Hybrid Engine swaps in its kernels here)."""
        if self.hybrid_engine_active:
            self.actor.eval()
        else:
            # A plain ``nn.Module.eval``: no dropout. (After a Hybrid Engine failure, ``actor.eval()``
            # would swap the inference kernels back in.)
            self.actor.module.eval()

    def scoring_mode(self) -> None:
        """After generation: the training-mode forwards (what the PPO update will run), dropout off.

        The Hybrid Engine swaps its inference kernels in on ``eval()``; scoring the rollout with them
        would give old log-probs from different kernels than the update's (docs/upstream.md#step-3-ppo:
        eval mode). ``engine.train()`` restores the training forwards,
        ``module.eval()`` turns dropout off without swapping kernels back.
        """
        if self.hybrid_engine_active:
            self.actor.train(True)
        self.actor.module.eval()

    # ------------------------------------------------------------------ generation
    def _lora_layers(self) -> list[LinearLayer_LoRA]:
        return [m for m in self.actor.module.modules() if isinstance(m, LinearLayer_LoRA)]

    def _layers_to_fuse(self, materialised: bool) -> list[LinearLayer_LoRA]:
        """The LoRA layers to fuse for this rollout (each holds one extra copy of its weight while fused).

        * None when ZeRO-3 weights are not materialised (fetched layer by layer for every token): the
          fused weight would have to be written into the partitions, with a saved copy of each one
          (the whole weight on one rank) -- memory this path is taken to save, for a gain that the
          per-token all-gathers swamp. The unfused LoRA branch gives the same policy.
        * Not 4-bit (QLoRA) layers: fusing needs their dense weight, and keeping it for every layer
          during generation costs the memory the 4-bit base saves (and would leave them dense for
          good). They run unfused: correct, just slower.
        """
        if not self.fuse_lora or not materialised:
            return []
        return [layer for layer in self._lora_layers() if not layer.is_quantized]

    @contextmanager
    def _decoding_only_generation_config(self, module: PreTrainedModel) -> Iterator[None]:
        """Inside, ``module.generation_config`` is :meth:`DecodingSettings.generation_config` (the model's
        own is put back after): ``generate`` fills every knob not passed to it from that attribute."""
        original = getattr(module, "generation_config", None)
        module.generation_config = self.decoding.generation_config(original)
        try:
            yield
        finally:
            module.generation_config = original

    def _should_gather(self) -> bool:
        if self.zero_stage != 3 or self.hybrid_engine_active or self.zero3_gather == "off":
            return False
        if self._gather_decided is None:
            if self.zero3_gather == "on":
                self._gather_decided = True
            else:
                self._gather_decided = fits_gathered(self.actor.module)  # the same answer on every rank
            self._say_once(
                "ZeRO-3 generation: " + ("gathering the actor's parameters once per rollout"
                                         if self._gather_decided else
                                         "parameters are fetched layer by layer for each token (full model "
                                         "does not fit in half the free memory, or --zero3_gather_for_generation off)"))
        return self._gather_decided

    def _module_generate(self, prompts: torch.Tensor, mask: torch.Tensor) -> Rollout:
        """The actor module decodes: LoRA fused, ZeRO-3 gathered once if allowed, dschat's sampling
        loop or HF ``generate``, decode-sized CPU linears where they apply."""
        module = self.actor.module
        gather: ContextManager[Any] = nullcontext()
        gathered = False
        if self._should_gather():
            try:
                parameter_offload(self.actor)
                gather = gathered_without_hooks(self.actor)
                gathered = True
            except AttributeError as err:
                self._say_once(f"ZeRO-3 generation: cannot detach DeepSpeed's hooks ({err}); fetching per layer")
        # Under ZeRO-3 without the gather, weights exist only inside each layer's forward.
        materialised = self.zero_stage != 3 or gathered
        lora = self._layers_to_fuse(materialised)
        with gather:
            for layer in lora:
                layer.fuse_lora_weight()
            try:
                if self._use_graphs(module, materialised):
                    try:
                        self.last_loop = "graphs"
                        return self._graph_generate(module, prompts, mask)
                    except Exception as err:  # noqa: BLE001 -- a compiler failure: fall back, say why, once
                        if _not_a_fallback(err):
                            raise
                        flag = self.generation_loop
                        self.generation_loop = "dschat"
                        self._say_once(f"--generation_loop {flag}: CUDA graphs failed ({_one_line(err, 200)}); "
                                       "decoding with dschat's loop from now on")
                with self._decode_kernels(module, prompts.shape[0], materialised):
                    if self._use_sample_loop(module, materialised):
                        self.last_loop = "dschat"
                        return self._loop_generate(module, prompts, mask)
                    self.last_loop = "hf"
                    return self._hf_generate(module, prompts, mask)
            finally:
                for layer in lora:
                    layer.unfuse_lora_weight()

    def _use_graphs(self, module: PreTrainedModel, materialised: bool) -> bool:
        """CUDA graphs where they apply: weights resident (graphs cannot capture ZeRO-3's per-layer
        fetches), an accelerator in ``graph_devices``, a decoder-only model. ``auto`` otherwise decodes
        with dschat's loop for this rollout; an explicit ``graphs`` says once why not and gives up."""
        if self.generation_loop not in ("auto", "graphs"):
            return False
        device = next(module.parameters()).device.type
        why_not = None
        if device not in self.graph_devices:
            why_not = f"CUDA graphs need a CUDA device, the actor is on {device!r}"
        elif not materialised:
            why_not = "the actor's ZeRO-3 weights are fetched layer by layer (not gathered)"
        elif getattr(module.config, "is_encoder_decoder", False):
            why_not = "encoder-decoder models are not supported"
        if why_not is not None:
            if self.generation_loop == "graphs":
                self._say_once(f"--generation_loop graphs: not used ({why_not}); decoding with dschat's loop")
                self.generation_loop = "dschat"
            return False
        return True

    def _graph_generate(self, module: PreTrainedModel, prompts: torch.Tensor, mask: torch.Tensor) -> Rollout:
        """Hugging Face ``generate`` with a static KV cache, its decode step compiled with
        ``torch.compile(mode="reduce-overhead")`` (CUDA graphs). Prompts are left-padded to a multiple
        of ``graph_prompt_multiple`` so the cache, and with it the captured graph, keeps one shape
        from rollout to rollout (the trimmed prompt width varies); the extra columns are padding
        (masked, position ids from the mask), and are cut off again before returning."""
        if self._graph_compile_config is None:  # one object: generate recompiles when the config changes
            use_private_compile_cache()  # not torch's default, /tmp/torchinductor_<user>
            self._graph_compile_config = CompileConfig(mode="reduce-overhead")
            if "cpu" in self.graph_devices:
                self._graph_compile_config._compile_all_devices = True
        B, P = prompts.shape
        extra = -P % self.graph_prompt_multiple
        if extra:
            prompts = torch.cat([prompts.new_full((B, extra), self.tokenizer.pad_token_id), prompts], dim=1)
            mask = torch.cat([mask.new_zeros((B, extra)), mask.to(prompts.device)], dim=1)
        # The weights are resident (never fetched inside the forward), so no rank needs the others to
        # keep stepping: no ``synced_gpus``, and a rank whose compile failed (dschat's loop, no
        # collectives) cannot leave the others waiting.
        rollout = self._hf_generate(module, prompts, mask, cache_implementation="static",
                                    compile_config=self._graph_compile_config, synced_gpus=False)
        return Rollout(rollout.sequences[:, extra:], rollout.logprobs)

    def _use_sample_loop(self, module: PreTrainedModel, materialised: bool) -> bool:
        """dschat's loop covers the decoding settings and ``min_new_tokens``; anything else passed in
        ``extra_generate_kwargs`` (a logits processor, ...) goes to HF ``generate``. Without the ZeRO-3
        gather every rank must keep stepping until all are done (``synced_gpus``): HF ``generate``."""
        return (self.generation_loop in ("auto", "dschat") and materialised
                and not getattr(module.config, "is_encoder_decoder", False)
                and set(self.extra_generate_kwargs) <= {"min_new_tokens"})

    def _decode_kernels(self, module: PreTrainedModel, rows: int, materialised: bool) -> ContextManager[Any]:
        """oneDNN decode-sized linears (``--cpu_decode_linear onednn``) where they apply, else nothing."""
        if self.cpu_decode_linear == "off":
            return nullcontext()

        why_not = decoding_loop.onednn_decode_supported(module) if materialised else "ZeRO-3 parameters are not gathered"
        if why_not is None:
            need = sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() == 2)
            if need > free_memory_bytes(torch.device("cpu")) // 2:
                why_not = "a packed copy of the actor's weights does not fit in half the free memory"
        if why_not is not None:
            if next(module.parameters()).device.type == "cpu":  # on an accelerator it is simply not for it
                self._say_once(f"--cpu_decode_linear onednn: not used ({why_not})")
            return nullcontext()
        return decoding_loop.onednn_decode_linears(module, rows)

    def _loop_generate(self, module: PreTrainedModel, prompts: torch.Tensor, mask: torch.Tensor) -> Rollout:

        return decoding_loop.sample_loop(module, prompts, mask, decoding=self.decoding, max_new_tokens=self.max_answer_seq_len,
                           min_new_tokens=int(self.extra_generate_kwargs.get("min_new_tokens", 0)),
                           eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                           keep_logprobs=self.keep_logprobs)

    def _hf_generate(self, module: PreTrainedModel, prompts: torch.Tensor, mask: torch.Tensor,
                     **generate_kwargs: Any) -> Rollout:
        kwargs = {**self._kwargs(mask), **generate_kwargs}
        if self.keep_logprobs:
            kwargs.update(return_dict_in_generate=True, output_logits=True)
        # The class method, not ``module.generate``: a Hybrid Engine that failed at run time leaves
        # its own generate installed on the instance.
        with self._decoding_only_generation_config(module):
            out = type(module).generate(module, prompts, **kwargs)
        if not self.keep_logprobs:
            return Rollout(out, None)
        seq = out.sequences
        logprobs = generated_token_logprobs(getattr(out, "logits", None), seq[:, prompts.shape[1]:],
                                            self.decoding.logit_temperature)
        return Rollout(seq, logprobs)

    def _kwargs(self, mask: torch.Tensor) -> dict[str, Any]:
        return {
            "attention_mask": mask,
            "max_new_tokens": self.max_answer_seq_len,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.tokenizer.eos_token_id,
            "synced_gpus": self.synced_gpus,
            "use_cache": True,
            **self.decoding.generate_kwargs(),
            **self.extra_generate_kwargs,
        }

    def generate(self, prompts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B, P)`` left-padded prompts -> ``(B, P + A')`` sequences, ``A' <= max_answer_seq_len``."""
        return self.rollout(prompts, mask).sequences

    @torch.no_grad()
    def rollout(self, prompts: torch.Tensor, mask: torch.Tensor) -> Rollout:
        """Generate answers for ``(B, P)`` left-padded prompts; see :class:`Rollout`."""
        rollout = self._rollout(prompts, mask)
        if not self._summary_said:
            self._summary_said = True
            print_rank_0(self.summary_line())
        return rollout

    def summary_line(self) -> str:
        """One line naming what decoded the last rollout (:func:`rollout_summary_line`)."""
        return rollout_summary_line(self.last_loop, self.engine, self.actor.module)

    # ------------------------------------------------------------------ dschat's Hybrid Engine
    def _engine_why_not(self) -> str | None:
        """None when dschat's Hybrid Engine can decode this rollout, else why not (one line)."""
        if set(self.extra_generate_kwargs) - {"min_new_tokens"}:
            return f"{sorted(self.extra_generate_kwargs)} need Hugging Face generate()"
        if self.zero_stage == 3 and not self._tensor_parallel() and not self._should_gather():
            return ("the actor's ZeRO-3 weights are fetched layer by layer (the full model does not fit in half "
                    "the free memory, or --zero3_gather_for_generation off), so no inference copy fits either")
        if any(layer.is_quantized for layer in self._lora_layers()):
            return "the actor has 4-bit (QLoRA) base weights"
        return None

    @contextmanager
    def _materialised(self) -> Iterator[None]:
        """The actor's full, LoRA-fused weights inside: ZeRO-3 gathered once, every LoRA layer fused
        (and unfused again on exit, bit for bit)."""
        with gathered_without_hooks(self.actor) if self.zero_stage == 3 else nullcontext():
            layers = self._lora_layers()
            for layer in layers:
                layer.fuse_lora_weight()
            try:
                yield
            finally:
                for layer in layers:
                    layer.unfuse_lora_weight()

    def _tensor_parallel(self) -> bool:
        """Whether this rollout decodes over the tensor-parallel group (``inference_tp_size`` > 1)."""
        return self.tp_group is not None and self.inference_tp_size > 1

    def _engine_rollout(self, prompts: torch.Tensor, mask: torch.Tensor) -> Rollout:
        module = self.actor.module
        min_new_tokens = int(self.extra_generate_kwargs.get("min_new_tokens", 0))
        tensor_parallel = self._tensor_parallel()
        if tensor_parallel and not isinstance(self.engine, TensorParallelHybridEngine):
            self.engine = TensorParallelHybridEngine(
                module.config, self.tp_group, layers_per_gather=self.tp_gather_partition_size,
                decoding=self.decoding, max_new_tokens=self.max_answer_seq_len,
                eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                release_cache=self.release_inference_cache, cpu_decode_linear=self.cpu_decode_linear)
        elif not tensor_parallel and (self.engine is None or isinstance(self.engine, TensorParallelHybridEngine)):
            self.engine = DschatHybridEngine(
                module.config, decoding=self.decoding, max_new_tokens=self.max_answer_seq_len,
                eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                release_cache=self.release_inference_cache, cpu_decode_linear=self.cpu_decode_linear)
        self.engine.decoding = self.decoding  # this rollout's (ReMax's greedy baseline changes it per call)
        self.last_loop = "dschat-he"
        if tensor_parallel:
            if self.zero_stage == 3:
                release_zero3_prefetch(self.actor, collect=False)  # nothing may be in flight when gathering outside a pass
            return self.engine.rollout(module, prompts, mask, gather=materialised_part,
                                       min_new_tokens=min_new_tokens, keep_logprobs=self.keep_logprobs)
        return self.engine.rollout(module, prompts, mask, materialise=self._materialised(),
                                   min_new_tokens=min_new_tokens, keep_logprobs=self.keep_logprobs)

    def _auto_engine(self) -> bool:
        """``--generation_loop auto`` takes dschat's Hybrid Engine: a device in ``auto_engine_devices``
        (and not one where ``auto`` means CUDA graphs), a family its decode model covers."""
        if self.generation_loop != "auto" or self.hybrid_engine_active:
            return False
        device = next(self.actor.module.parameters()).device.type
        if device not in self.auto_engine_devices or device in self.graph_devices:
            return False
        return unsupported_reason(self.actor.module.config) is None

    def _rollout(self, prompts: torch.Tensor, mask: torch.Tensor) -> Rollout:
        asked = self.use_dschat_engine  # --enable_hybrid_engine: say why when it cannot be used
        if asked or self._auto_engine():
            why_not = self._engine_why_not()
            if why_not is None:
                try:
                    return self._engine_rollout(prompts, mask)
                except Exception as err:  # noqa: BLE001 -- a compiler failure: fall back, say why, once
                    # Only where the step is compiled (CUDA); eagerly, an error is a bug or bad weights
                    # (non-finite logits), which the module path would raise as well.
                    if _not_a_fallback(err) or self.engine is None or not self.engine.compiled_on(prompts.device):
                        raise
                    self.use_dschat_engine = False
                    self.auto_engine_devices = ()
                    self._say_once(f"{ENGINE_NAME} failed ({_one_line(err, 200)}); decoding with the training "
                                   "module from now on")
            elif asked:
                self._say_once(f"{ENGINE_NAME}: not used ({why_not}); decoding with the training module")
        if self.hybrid_engine_active:
            try:
                # DeepSpeed installed its inference-kernel generate as ``module.generate``.
                self.last_loop = "hybrid-engine"
                with self._decoding_only_generation_config(self.actor.module):
                    return Rollout(self.actor.module.generate(prompts, **self._kwargs(mask)), None)
            except Exception as err:  # noqa: BLE001 -- any failure of DeepSpeed's kernels: fall back, say why
                if _not_a_fallback(err):
                    raise
                self.hybrid_engine_active = False
                self._fallback(f"--enable_hybrid_engine: DeepSpeed's Hybrid Engine failed to generate "
                               f"({_one_line(err)}); generating with the actor module's own generate() from now on")
                # Restore the training-mode forwards the Hybrid Engine swapped out, keep dropout off.
                self.actor.train(True)
                self.actor.module.eval()
        return self._module_generate(prompts, mask)
