"""Rollout generation: one object the trainer calls, asking each decoding path in a fixed order.

:class:`RolloutGenerator` holds one :class:`~dschat.rlhf.rollout.path.DecodingPath` per way of
decoding and, for every rollout, asks them in this order whether they can serve; the first that can
decodes:

1. ``dschat-he-tp`` -- dschat's Hybrid Engine over a tensor-parallel group
   (:mod:`dschat.rlhf.rollout.tensor_parallel`, ``--inference_tp_size`` > 1);
2. ``dschat-he`` -- dschat's Hybrid Engine (:mod:`dschat.rlhf.rollout.dschat_engine`;
   ``--enable_hybrid_engine`` for a family its decode model covers, on any accelerator);
3. ``hybrid-engine`` -- DeepSpeed's Hybrid Engine (:mod:`dschat.rlhf.rollout.deepspeed_engine`; other
   families with an inference container, on CUDA);
4. ``graphs`` -- Hugging Face ``generate`` with a static KV cache and CUDA graphs
   (:mod:`dschat.rlhf.rollout.graphs`; ``--generation_loop auto`` on CUDA, or ``graphs``);
5. ``dschat`` -- dschat's sampling loop (:mod:`dschat.rlhf.rollout.sample_loop`; ``auto`` elsewhere);
6. ``hf`` -- Hugging Face ``generate`` (:mod:`dschat.rlhf.rollout.hf_generate`), which always serves.

Paths 4-6 decode with the training module: before the first of them is asked, the generator
materialises its weights once for the rollout and puts them back after it:

* **ZeRO-3**: when the full model fits in free memory (full parameter bytes <= half of the free
  accelerator / host memory; ``--zero3_gather_for_generation on|off`` overrides), all parameters are
  gathered once per rollout with DeepSpeed's fetch/release hooks detached, then restored. Otherwise
  every layer is fetched for every token and every rank steps until all have finished
  (``synced_gpus``).
* **LoRA** layers are fused into their base weights and unfused after, bit for bit
  (:meth:`~dschat.models.lora.LinearLayer_LoRA.fuse_lora_weight`). Not fused: 4-bit (QLoRA) layers,
  and every layer when ZeRO-3 weights are fetched layer by layer.

dschat's Hybrid Engine does the same gather and fusion while it copies the weights
(:meth:`RolloutGenerator.materialised`).

**Fallbacks.** A path a flag asked for that cannot serve, or one that fails at run time for a reason
other than out of memory or bad input, says why in one line, once, and is off for the rest of the
run; the generator keeps one record of the latest (:attr:`RolloutGenerator.fallback`: which path,
why). The first rollout prints one summary line: the path that served, the reason each path before it
gave, the dtype and the inference tensor-parallel degree (:meth:`RolloutGenerator.summary_line`).

The module paths keep the **log-probs of the generated tokens** (the raw logits divided by the
sampling temperature), so the trainer need not run the actor over the rollout again for its old
log-probs (:class:`~dschat.rlhf.rollout.sampling.Rollout`); DeepSpeed's Hybrid Engine keeps none.

Each fast path is an attribute (``keep_logprobs``, ``fuse_lora``, ``generation_loop``,
``cpu_decode_linear``, ``use_dschat_engine``) so ``benchmarks/step3.py`` can turn it off for its
baseline.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch
from deepspeed import DeepSpeedEngine
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dschat.models.lora import LinearLayer_LoRA
from dschat.rlhf.rollout.deepspeed_engine import NO_CONTAINER, DeepSpeedHybridEnginePath, HybridEngineDecision
from dschat.rlhf.rollout.dschat_engine import DschatEnginePath, DschatHybridEngine
from dschat.rlhf.rollout.graphs import GraphsPath
from dschat.rlhf.rollout.hf_generate import HfGeneratePath
from dschat.rlhf.rollout.path import DecodingPath, Fallback, RolloutRequest
from dschat.rlhf.rollout.sample_loop import SampleLoopPath, onednn_decode_linears, onednn_decode_supported
from dschat.rlhf.rollout.sampling import DecodingSettings, Rollout
from dschat.rlhf.rollout.tensor_parallel import TensorParallelEnginePath
from dschat.runtime.dist import TensorParallelGroup, print_rank_0, tensor_parallel_group
from dschat.runtime.zero3 import fits_gathered, free_memory_bytes, gathered_without_hooks, parameter_offload

__all__ = ["RolloutGenerator", "PATH_ORDER", "rollout_summary_line"]

# The fixed order in which the paths are asked (the first that can serve decodes).
PATH_ORDER: tuple[type[DecodingPath], ...] = (TensorParallelEnginePath, DschatEnginePath, DeepSpeedHybridEnginePath,
                                              GraphsPath, SampleLoopPath, HfGeneratePath)

_LABELS = {path.loop: path.label for path in PATH_ORDER}


def rollout_summary_line(loop: str | None, engine: DschatHybridEngine | None, module: nn.Module,
                         why: str | None = None) -> str:
    """One line naming what decoded a rollout (``loop``: ``RolloutGenerator.last_loop``): the engine,
    the layout, ``why`` (in brackets), the dtype and the inference tensor-parallel degree (1: each
    rank decodes its own prompts; N: groups of N ranks decode their prompts together, each holding
    1/N of the weights). It ends with ``inference TP degree N``."""
    param = next(module.parameters())
    degree = 1
    if loop == "dschat-he" and engine is not None:
        what, degree = engine.summary(param.device), engine.tp_size
    else:
        what = (f"{_LABELS.get(loop or '', str(loop))}, layout {getattr(module.config, 'model_type', '?')} "
                "(the training module's)")
    because = f" [{why}]" if why else ""
    return f"Rollouts: {what}{because}, dtype {str(param.dtype).replace('torch.', '')}, inference TP degree {degree}"


class RolloutGenerator:
    """Generates answers for a batch of left-padded prompts with the actor engine (see the module docstring).

    ``zero3_gather`` is ``"auto"`` (gather when the estimate says it fits), ``"on"`` or ``"off"``;
    it matters only for an actor under ZeRO-3 without DeepSpeed's Hybrid Engine.
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
        self.fallback: Fallback | None = None  # the latest path that stopped serving, and why
        self._said: set[str] = set()
        self.hybrid_engine_active = decision.enabled and bool(getattr(actor, "_inference_containers", None))
        if decision.reason:
            self.fall_back(DeepSpeedHybridEnginePath.name, decision.reason)
        elif decision.enabled and not self.hybrid_engine_active:
            self.fall_back(DeepSpeedHybridEnginePath.name, NO_CONTAINER)
        self._gather_decided: bool | None = None
        # Fast paths, on by default (benchmarks/step3.py turns them off for its baseline).
        self.keep_logprobs = True  # return the generated tokens' log-probs (module paths only)
        self.fuse_lora = True  # fuse LoRA into the base weights for generation
        # "auto" ("graphs" where it applies, else "dschat") | "dschat" | "hf" | "graphs"
        self.generation_loop = generation_loop
        self.last_loop: str | None = None  # what the last rollout decoded with: a path's ``loop``
        self.graph_devices: tuple[str, ...] = ("cuda",)  # where "graphs" applies (tests add "cpu")
        self.graph_prompt_multiple = 64  # prompts are left-padded to a multiple of this for "graphs"
        self.cpu_decode_linear = cpu_decode_linear  # "onednn" | "off": decode-sized linears on a CPU
        self.extra_generate_kwargs: dict[str, Any] = {}  # e.g. min_new_tokens for a fixed-length benchmark
        # dschat's Hybrid Engine: --enable_hybrid_engine for a family its decode model covers
        # (benchmarks/step3.py's ours-he mode sets it too) ...
        self.use_dschat_engine = decision.dschat_engine
        # ... and --generation_loop auto on these devices: none yet. On a CPU it is as exact as dschat's
        # loop and faster (benchmarks/results.md), but the CPU demo's published figures were measured
        # with dschat's loop, and a sampled token can differ at a rounding boundary; CUDA keeps "graphs"
        # until the engine is measured there. Add "cpu" / "cuda" here once those are re-measured.
        self.auto_engine_devices: tuple[str, ...] = ()
        self.release_inference_cache = release_inference_cache  # free its KV cache and weight buffers after each rollout
        self.engine: DschatHybridEngine | None = None
        self._summary_said = False
        self._why: str | None = None  # why the last rollout's path served (the refusals before it)
        # --inference_tp_size N: dschat's Hybrid Engine decodes over groups of N ranks, gathering
        # --tp_gather_partition_size ZeRO-3 layers at a time. The groups are made here (collective).
        self.inference_tp_size = inference_tp_size
        self.tp_gather_partition_size = tp_gather_partition_size
        self.tp_group: TensorParallelGroup | None = (tensor_parallel_group(inference_tp_size)
                                                     if inference_tp_size > 1 else None)
        self.paths: tuple[DecodingPath, ...] = tuple(path(self) for path in PATH_ORDER)

    def path(self, name: str) -> DecodingPath:
        """The path called ``name`` (``DecodingPath.name``)."""
        return next(path for path in self.paths if path.name == name)

    @property
    def fallback_reason(self) -> str | None:
        """The line of the latest fallback (:attr:`fallback`), or None."""
        return self.fallback.reason if self.fallback is not None else None

    # ------------------------------------------------------------------ logging once
    def say_once(self, message: str) -> None:
        """Print ``message`` on rank 0 the first time it is given."""
        if message not in self._said:
            self._said.add(message)
            print_rank_0(message)

    def fall_back(self, path: str, reason: str) -> None:
        """Record that ``path`` stops serving for ``reason`` (one line, said once)."""
        self.fallback = Fallback(path, reason)
        self.say_once(reason)

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

    # ------------------------------------------------------------------ the training module's weights
    def lora_layers(self) -> list[LinearLayer_LoRA]:
        """The actor's LoRA layers."""
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
        return [layer for layer in self.lora_layers() if not layer.is_quantized]

    def should_gather(self) -> bool:
        """Whether a ZeRO-3 actor is gathered once per rollout (decided at the first call, said once)."""
        if self.zero_stage != 3 or self.hybrid_engine_active or self.zero3_gather == "off":
            return False
        if self._gather_decided is None:
            if self.zero3_gather == "on":
                self._gather_decided = True
            else:
                self._gather_decided = fits_gathered(self.actor.module)  # the same answer on every rank
            self.say_once(
                "ZeRO-3 generation: " + ("gathering the actor's parameters once per rollout"
                                         if self._gather_decided else
                                         "parameters are fetched layer by layer for each token (full model "
                                         "does not fit in half the free memory, or --zero3_gather_for_generation off)"))
        return self._gather_decided

    def tensor_parallel(self) -> bool:
        """Whether this rollout decodes over the tensor-parallel group (``inference_tp_size`` > 1)."""
        return self.tp_group is not None and self.inference_tp_size > 1

    @contextmanager
    def materialised(self) -> Iterator[None]:
        """For dschat's Hybrid Engine: the actor's full, LoRA-fused weights inside: ZeRO-3 gathered
        once, every LoRA layer fused (and unfused again on exit, bit for bit)."""
        with gathered_without_hooks(self.actor) if self.zero_stage == 3 else nullcontext():
            layers = self.lora_layers()
            for layer in layers:
                layer.fuse_lora_weight()
            try:
                yield
            finally:
                for layer in layers:
                    layer.unfuse_lora_weight()

    @contextmanager
    def _module_weights(self) -> Iterator[bool]:
        """For the module paths: ZeRO-3 gathered once if allowed, LoRA fused where it may be; yields
        whether the weights are materialised (not ZeRO-3 fetched layer by layer)."""
        gather: ContextManager[Any] = nullcontext()
        gathered = False
        if self.should_gather():
            try:
                parameter_offload(self.actor)
                gather = gathered_without_hooks(self.actor)
                gathered = True
            except AttributeError as err:
                self.say_once(f"ZeRO-3 generation: cannot detach DeepSpeed's hooks ({err}); fetching per layer")
        # Under ZeRO-3 without the gather, weights exist only inside each layer's forward.
        materialised = self.zero_stage != 3 or gathered
        lora = self._layers_to_fuse(materialised)
        with gather:
            for layer in lora:
                layer.fuse_lora_weight()
            try:
                yield materialised
            finally:
                for layer in lora:
                    layer.unfuse_lora_weight()

    def decode_kernels(self, module: PreTrainedModel, rows: int, materialised: bool) -> ContextManager[Any]:
        """oneDNN decode-sized linears (``--cpu_decode_linear onednn``) where they apply, else nothing."""
        if self.cpu_decode_linear == "off":
            return nullcontext()
        why_not = onednn_decode_supported(module) if materialised else "ZeRO-3 parameters are not gathered"
        if why_not is None:
            need = sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() == 2)
            if need > free_memory_bytes(torch.device("cpu")) // 2:
                why_not = "a packed copy of the actor's weights does not fit in half the free memory"
        if why_not is not None:
            if next(module.parameters()).device.type == "cpu":  # on an accelerator it is simply not for it
                self.say_once(f"--cpu_decode_linear onednn: not used ({why_not})")
            return nullcontext()
        return onednn_decode_linears(module, rows)

    # ------------------------------------------------------------------ generation
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
        """One line naming what decoded the last rollout and why (:func:`rollout_summary_line`)."""
        return rollout_summary_line(self.last_loop, self.engine, self.actor.module, self._why)

    def _rollout(self, prompts: torch.Tensor, mask: torch.Tensor) -> Rollout:
        """Ask the paths in order; the first that can serve decodes. One that fails in a way it falls
        back from is recorded (:meth:`fall_back`) and the next is asked."""
        refused: list[str] = []
        with ExitStack() as module_weights:
            materialised: bool | None = None  # entered before the first module path is asked
            for path in self.paths:
                if path.on_module and materialised is None:
                    materialised = module_weights.enter_context(self._module_weights())
                request = RolloutRequest(prompts, mask, True if materialised is None else materialised)
                reason = path.can_serve(request)
                if reason is None:
                    self.last_loop = path.loop
                    try:
                        rollout = path.generate(request)
                    except Exception as err:  # noqa: BLE001 -- the path says whether it falls back
                        reason = path.fall_back(err, request)
                        if reason is None:
                            raise
                        self.fall_back(path.name, reason)
                        reason = f"failed ({type(err).__name__}), off for the rest of the run"
                    else:
                        self._why = "after " + "; ".join(refused) if refused else "the first path asked"
                        return rollout
                refused.append(f"{path.name}: {reason}")  # the reason, not the notice: said once
        raise AssertionError(f"no decoding path served: {refused}")  # the last path always serves
