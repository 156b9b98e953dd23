"""dschat's Hybrid Engine path: weights in, prompts in, a :class:`~dschat.rlhf.rollout.sampling.Rollout` out.

:class:`DschatHybridEngine` decodes rollouts with dschat's own decode model
(:mod:`dschat.models.decoder`): at each rollout the actor's current weights are copied, in place,
into an inference layout (q/k/v and gate/up fused, contiguous, in the rollout dtype, no DeepSpeed
hooks), the prompt is prefilled into a static KV cache, and tokens are drawn one decode step at a
time with the sampling of dschat's loop (:func:`dschat.rlhf.rollout.sampling.next_token_scores`,
:func:`~dschat.rlhf.rollout.sampling.draw`), keeping each token's log-prob for the old-log-prob shortcut.

* On CUDA the decode step is compiled (``torch.compile(mode="reduce-overhead")``: CUDA graphs). Its
  shapes do not depend on the prompt width (the cache has a fixed capacity, the write column is a
  tensor), and the weights and cache keep their addresses from rollout to rollout, so it is compiled
  and captured once; :attr:`DschatHybridEngine.compiles` and ``captures`` count both.
* On a CPU it runs eagerly in fp32, attending only to the filled cache columns, with its B-row
  matmuls on oneDNN-packed weights (``cpu_decode_linear="onednn"``), as dschat's CPU loop does; the
  packed copies are taken at each decode, or, with ``keep_packed`` (weights that do not change between
  decodes: a server), kept until the batch size changes or the weights are refreshed.
* ``release_cache`` (``--release_inference_cache``) frees the KV cache and the weight buffers after
  each rollout; the next one allocates (and, on CUDA, captures) again.

The caller materialises the weights while :meth:`DschatHybridEngine.rollout` refreshes from them
(``materialise``: the ZeRO-3 gather and LoRA fusion of
:class:`~dschat.rlhf.rollout.generator.RolloutGenerator`); decoding itself needs nothing of the module.

:class:`DschatEnginePath` serves ``--enable_hybrid_engine`` (and ``--generation_loop auto`` on a device
in the generator's ``auto_engine_devices``, none by default) for a family the decode model covers,
at ``--inference_tp_size 1``, unless a ``generate`` argument other than ``min_new_tokens`` is passed,
the ZeRO-3 weights are fetched layer by layer, or the base weights are 4-bit; asked by the flag, it
says why once. A failure of the compiled decode step (CUDA) turns it off for the rest of the run;
an eager failure (a bug, non-finite logits) is re-raised, as the module paths would raise it.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn
from torch._dynamo.utils import counters

from dschat.errors import raised
from dschat.models.decoder.forward import DecodeModel
from dschat.models.decoder.kv_cache import StaticKVCache
from dschat.models.decoder.layouts import layout_name, unsupported_reason
from dschat.rlhf.rollout.conversation import Conversation, compact_columns, why_not_kept
from dschat.rlhf.rollout.path import DecodingPath, RolloutRequest, fall_back, not_a_fallback
from dschat.rlhf.rollout.sampling import (DecodingSettings, EndIds, Rollout, StepCallback, draw, end_rows, loop_rollout,
                                          next_token_scores)
from dschat.rlhf.rollout.weights import lora_layers, materialised, should_gather
from dschat.runtime.compile_cache import use_private_compile_cache

__all__ = ["DschatHybridEngine", "DschatEnginePath", "ENGINE_NAME"]

ENGINE_NAME = "dschat Hybrid Engine"


def _cuda_graph_count(device: torch.device) -> int:
    """CUDA graphs recorded so far on ``device`` by torch.compile's graph trees (0 if none)."""
    # lazy: torch._inductor costs 2.5 s at import (measured on this project's CPU), and only CUDA runs need it
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    if manager is None:
        return 0
    # itertools.count has no getter; its repr is "count(N)" with N the next graph id.
    return int(repr(manager.graph_counter)[len("count("):-1])


class DschatHybridEngine:
    """Rollouts of one actor (one model config) with dschat's decode model; see the module docstring."""

    def __init__(self, config: Any, *, decoding: DecodingSettings, max_new_tokens: int, eos_token_id: EndIds,
                 pad_token_id: int, release_cache: bool = False, cpu_decode_linear: str = "onednn",
                 compile_step: bool | None = None, cache_multiple: int = 64) -> None:
        self.model = self._decode_model(config)
        self.decoding = decoding
        self.max_new_tokens = max_new_tokens
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.release_cache = release_cache
        self.cpu_decode_linear = cpu_decode_linear
        # Weights that do not change between decodes (a server): the oneDNN-packed copies are kept
        # while the batch size stays, instead of being taken at every decode; refresh drops them.
        self.keep_packed = False
        self.compile_step = compile_step  # None: on CUDA only
        # torch.compile's options for the decode step (tests trace it on a CPU with {"backend": "aot_eager"}).
        self.compile_options: dict[str, Any] = {"mode": "reduce-overhead"}
        self.cache_multiple = cache_multiple
        self.cache: StaticKVCache | None = None
        self._continued: Conversation | None = None  # the conversation whose turn the cache holds
        self._step: Any = None  # the compiled decode step (CUDA)
        self.rollouts = 0
        self.compiles = 0  # graphs Dynamo compiled during this engine's rollouts
        self.captures = 0  # CUDA graphs recorded during them
        self.cache_allocations = 0
        self.compactions = 0  # multi-turn turns that closed the holes of the kept cache (Conversation.make_room)
        self.restarts = 0  # multi-turn turns that prefilled the conversations again (compacting would not do)
        self.compiles_per_rollout: list[int] = []

    tp_size = 1  # ranks that decode one batch together (dschat.rlhf.rollout.tensor_parallel: more)

    def _decode_model(self, config: Any) -> DecodeModel:
        return DecodeModel(config)

    # ------------------------------------------------------------------ state
    @property
    def spec(self) -> Any:
        return self.model.spec

    @property
    def weight_allocations(self) -> int:
        return self.model.weights.allocations

    def summary(self, device: torch.device) -> str:
        """What decodes and in which layout, for the rollout summary line."""
        how = "compiled decode step, CUDA graphs" if self._compiled(device) else "eager decode step"
        return f"{ENGINE_NAME} ({how}), layout {layout_name(self.spec)}"

    def release(self) -> None:
        """Free the KV cache and the inference weights (``--release_inference_cache``)."""
        self.model.weights.release()
        self.model.unpack()
        self.cache = None

    def _compiled(self, device: torch.device) -> bool:
        return self.compile_step if self.compile_step is not None else device.type == "cuda"

    def compiled_on(self, device: torch.device) -> bool:
        """Whether the decode step is compiled on ``device`` (CUDA unless ``compile_step`` says otherwise)."""
        return self._compiled(device)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def refresh(self, module: nn.Module) -> None:
        """Copy ``module``'s current (materialised) weights into the inference layout, in place."""
        param = next(module.parameters())
        self.model.unpack()  # packed copies of the old weights
        self.model.weights.refresh(module, param.dtype, param.device)

    # ------------------------------------------------------------------ the calls
    @torch.no_grad()
    def rollout(self, module: nn.Module, prompts: torch.Tensor, mask: torch.Tensor, *,
                materialise: AbstractContextManager[Any] | None = None, min_new_tokens: int = 0,
                keep_logprobs: bool = True, on_step: StepCallback | None = None) -> Rollout:
        """Refresh the weights from ``module`` (inside ``materialise``), then decode ``(B, P)``
        left-padded prompts as :func:`dschat.rlhf.rollout.sample_loop.sample_loop` does (``on_step``:
        see :meth:`decode`)."""
        with self._counted(module, materialise, prompts.device):
            return self.decode(prompts, mask, min_new_tokens=min_new_tokens, keep_logprobs=keep_logprobs,
                               on_step=on_step)

    @torch.no_grad()
    def continue_turn(self, module: nn.Module, conversation: Conversation, *,
                      materialise: AbstractContextManager[Any] | None = None, min_new_tokens: int = 0,
                      keep_logprobs: bool = True) -> Rollout:
        """One turn of multi-turn episodes on the conversation's kept cache: refresh the weights as
        :meth:`rollout` does, feed each row's tokens not yet cached after the kept columns, decode.
        The rollout has a row per conversation, its answers from column ``conversation.width``
        (:class:`~dschat.rlhf.rollout.conversation.Conversation`). A conversation whose cache is not
        this engine's current one (the first turn, or another rollout used the cache since) prefills
        every row's whole conversation. Before a turn would take the cache past the size of the
        conversation's ``limit`` (a prompt and an answer of the run), the holes of its kept columns
        are closed (:meth:`~dschat.rlhf.rollout.conversation.Conversation.compact`) where that is
        enough, else the conversations are prefilled again, compact; one that outgrows the cache even
        so moves to a larger one (the old one freed as the columns are copied). Which of these, is
        decided before anything moves (:meth:`~dschat.rlhf.rollout.conversation.Conversation.make_room`)."""
        device = next(module.parameters()).device
        with self._counted(module, materialise, device):
            if conversation.cache is not None and (conversation.cache is not self.cache
                                                   or self._continued is not conversation):
                conversation.drop()
            ids, mask = conversation.inputs(device)  # (B, N): the new columns
            try:
                # The cache outlives the episodes: it should not grow past what a prompt and answer of
                # the run take, so before it would, the kept columns' holes are closed or the
                # conversations prefilled again.
                if conversation.limit is not None and self.cache is not None:
                    bound = StaticKVCache.capacity_for(conversation.limit, self.cache_multiple)
                    step = conversation.make_room(ids.shape[1], self.max_new_tokens, bound)
                    if step in ("compact", "past"):  # past: the cache then moves to a larger one
                        source = conversation.compact()
                        for tensor in [*self.cache.keys, *self.cache.values]:
                            compact_columns(tensor, source)
                        self.compactions += 1
                    elif step == "prefill":  # the rows' kept and new columns do not line up
                        conversation.drop()
                        ids, mask = conversation.inputs(device)
                        self.restarts += 1
                active = torch.tensor(conversation.active, dtype=torch.bool, device=device)
                conversation.cache = None  # the engine holds it (and frees it if it moves to a larger one)
                rollout = self.decode(ids, mask, min_new_tokens=min_new_tokens, keep_logprobs=keep_logprobs,
                                      past_mask=conversation.mask, active=active)
            except BaseException:
                conversation.drop()  # its mask no longer says what the cache holds
                raise
            conversation.cache, self._continued = self.cache, conversation
            conversation.decoded(mask, rollout.sequences.shape[1] - ids.shape[1])
            return rollout

    @contextmanager
    def _counted(self, module: nn.Module, materialise: AbstractContextManager[Any] | None,
                 device: torch.device) -> Iterator[None]:
        """Refresh the weights from ``module`` (inside ``materialise``); around the decoding inside,
        count the rollout and its compiles and captures, and release the cache after it when asked."""
        graphs_before = compiled_before = 0
        if self._compiled(device):
            compiled_before = counters["stats"]["unique_graphs"]
            graphs_before = _cuda_graph_count(device) if device.type == "cuda" else 0
        with materialise if materialise is not None else nullcontext():
            self.refresh(module)
        try:
            yield
        finally:
            self.rollouts += 1
            if self._compiled(device):
                new = counters["stats"]["unique_graphs"] - compiled_before
                self.compiles += new
                self.compiles_per_rollout.append(new)
                if device.type == "cuda":
                    self.captures += _cuda_graph_count(device) - graphs_before
            if self.release_cache:
                self.release()

    # ------------------------------------------------------------------ decoding
    def _prepare(self, whole: torch.Tensor, kept: int = 0) -> StaticKVCache:
        """The cache for a rollout whose (B, C + P) mask is ``whole``: the ``kept`` = C columns of the
        current cache (a continued conversation), then the P prompt columns; room for the answer after."""
        B, width = whole.shape
        weights = self.model.weights
        dtype, device = weights.embed.dtype, weights.embed.device
        if self.cache is None or not self.cache.fits(B, width + self.max_new_tokens, dtype, device):
            capacity = StaticKVCache.capacity_for(width + self.max_new_tokens, self.cache_multiple)
            grown = StaticKVCache(self.spec, B, capacity, dtype, device)
            if kept:
                assert self.cache is not None and self.cache.batch == B
                grown.keep_columns(self.cache, kept)
            self.cache = grown
            self.cache_allocations += 1
        if self._compiled(device):
            for t in [*weights.tensors(), *self.cache.keys, *self.cache.values, self.cache.key_valid]:
                torch._dynamo.mark_static_address(t)  # refreshed in place: a captured graph reads them directly
            if self._step is None:
                use_private_compile_cache()  # not torch's default, /tmp/torchinductor_<user>
                self._step = torch.compile(self.model.step, fullgraph=True, **self.compile_options)
        elif device.type == "cpu" and self.cpu_decode_linear == "onednn" and self._onednn_usable(dtype):
            if not (self.keep_packed and self.model.packed_rows == B):
                self.model.pack_for_cpu(B)
        self.cache.start(whole)
        self._continued = None  # the cache is this rollout's now
        return self.cache

    @staticmethod
    def _onednn_usable(dtype: torch.dtype) -> bool:
        return torch.backends.mkldnn.is_available() and dtype == torch.float32

    def _decode_step(self, token: torch.Tensor, position: torch.Tensor, index: int, cache: StaticKVCache) -> torch.Tensor:
        column = torch.full((1,), index, dtype=torch.long, device=token.device)
        if self._step is not None and self._compiled(token.device):
            return self._step(token, position, column, cache, cache.capacity)
        return self.model.step(token, position, column, cache, index + 1)

    def _draw(self, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) processed scores -> (B,) tokens: a draw from their softmax, or the argmax (greedy)."""
        return draw(torch.softmax(scores, dim=-1)) if self.decoding.sample else torch.argmax(scores, dim=-1)

    def _select(self, logits: torch.Tensor, suppress_eos: bool, unfinished: torch.Tensor, pad: torch.Tensor,
                keep_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step's (B, V) fp32 logits -> the (B,) tokens (``pad`` where a row has ended) and, with
        ``keep_logprobs``, their (B,) log-probs under ``logits / logit_temperature``."""
        settings, temperature = self.decoding, self.decoding.logit_temperature
        scores = next_token_scores(logits, settings, self.eos_token_id, suppress_eos=suppress_eos)
        token = torch.where(unfinished, self._draw(scores), pad)  # (B,)
        if not keep_logprobs:
            return token, None
        scaled = logits / temperature if temperature != 1.0 else logits
        return token, torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1)

    def decode(self, prompts: torch.Tensor, mask: torch.Tensor, *, min_new_tokens: int = 0,
               keep_logprobs: bool = True, on_step: StepCallback | None = None,
               past_mask: torch.Tensor | None = None, active: torch.Tensor | None = None) -> Rollout:
        """Decode with the current inference weights: the semantics of
        :func:`~dschat.rlhf.rollout.sample_loop.sample_loop` (positions from the mask, the same logits
        processing, EOS then padding, log-probs under ``logits / logit_temperature``, ``on_step``: a
        :data:`~dschat.rlhf.rollout.sampling.StepCallback` that sees each step's tokens and may end rows
        there as an EOS would). Continuing the cache, as ``sample_loop`` does: its first C columns are
        kept, ``past_mask`` (B, C) their mask, holes included; positions count the mask over all the
        columns; ``active`` (B,) bool: the rows that decode (the others give padding)."""
        B, P = prompts.shape
        mask = mask.to(prompts.device)
        kept = 0 if past_mask is None else past_mask.shape[1]
        whole = mask if past_mask is None else torch.cat([past_mask.to(mask), mask], dim=-1)  # (B, C + P)
        cache = self._prepare(whole, kept)
        positions = (whole.long().cumsum(-1) - 1).masked_fill(whole == 0, 0)[:, kept:]  # (B, P)
        try:
            logits = self.model.prefill(prompts, positions, cache, start=kept).float()  # (B, V)
            position = positions[:, -1]  # (B,)
            unfinished = (torch.ones(B, dtype=torch.bool, device=prompts.device) if active is None
                          else active.to(device=prompts.device, dtype=torch.bool).clone())
            pad = torch.full((B,), self.pad_token_id, dtype=prompts.dtype, device=prompts.device)
            tokens: list[torch.Tensor] = []
            logprobs: list[torch.Tensor] = []
            for t in range(self.max_new_tokens):
                token, logprob = self._select(logits, t < min_new_tokens, unfinished, pad, keep_logprobs)  # (B,) each
                if logprob is not None:
                    logprobs.append(logprob)
                tokens.append(token)
                end_rows(unfinished, token, self.eos_token_id, on_step)
                if t == self.max_new_tokens - 1 or not bool(unfinished.any()):
                    break
                position = position + 1
                logits = self._decode_step(token, position, kept + P + t, cache).float()
        finally:
            if not self.keep_packed:
                self.model.unpack()  # the packed copies are per rollout (the weights change between rollouts)
        return loop_rollout(prompts, tokens, logprobs if keep_logprobs else None)


class DschatEnginePath(DecodingPath):
    """dschat's Hybrid Engine, each rank decoding its own prompts (see the module docstring)."""

    name = loop = "dschat-he"
    falls_back = True
    label = ENGINE_NAME
    tensor_parallel = False  # serves at --inference_tp_size 1 (dschat.rlhf.rollout.tensor_parallel: > 1)
    continues = True

    def can_serve(self, request: RolloutRequest) -> str | None:
        gen = self.gen
        if request.tensor_parallel != self.tensor_parallel:
            return f"--inference_tp_size {gen.inference_tp_size}"
        asked = gen.use_dschat_engine  # --enable_hybrid_engine: say why when it cannot be used
        if not asked and not self._auto():
            return "no --enable_hybrid_engine, and the auto loop does not take it on this device"
        why_not = self._why_not(request)
        if why_not is not None and asked:
            fall_back(gen, self.name, f"{ENGINE_NAME}: not used ({why_not}); decoding with the training module")
        return why_not

    def _why_not(self, request: RolloutRequest) -> str | None:
        """None when dschat's Hybrid Engine can decode this rollout, else why not (one line)."""
        gen = self.gen
        family = unsupported_reason(gen.actor.module.config)  # use_dschat_engine may be set by hand
        if family is not None:
            return family
        if set(gen.extra_generate_kwargs) - {"min_new_tokens"}:
            return f"{sorted(gen.extra_generate_kwargs)} need Hugging Face generate()"
        if gen.zero_stage == 3 and not request.tensor_parallel and not should_gather(gen):
            return ("the actor's ZeRO-3 weights are fetched layer by layer (the full model does not fit in half "
                    "the free memory, or --zero3_gather_for_generation off), so no inference copy fits either")
        if any(layer.is_quantized for layer in lora_layers(gen)):
            return "the actor has 4-bit (QLoRA) base weights"
        return None

    def _auto(self) -> bool:
        """``--generation_loop auto`` takes dschat's Hybrid Engine: a device in ``auto_engine_devices``
        (and not one where ``auto`` means CUDA graphs), a family its decode model covers."""
        gen = self.gen
        if gen.generation_loop != "auto" or gen.hybrid_engine_active:
            return False
        device = next(gen.actor.module.parameters()).device.type
        if device not in gen.auto_engine_devices or device in gen.graph_devices:
            return False
        return unsupported_reason(gen.actor.module.config) is None

    def generate(self, request: RolloutRequest) -> Rollout:
        gen, module = self.gen, self.gen.actor.module
        if gen.engine is None or type(gen.engine) is not DschatHybridEngine:
            gen.engine = DschatHybridEngine(
                module.config, decoding=gen.decoding, max_new_tokens=gen.max_answer_seq_len,
                eos_token_id=gen.end_ids, pad_token_id=gen.tokenizer.pad_token_id,
                release_cache=gen.release_inference_cache, cpu_decode_linear=gen.cpu_decode_linear)
        gen.engine.decoding = gen.decoding  # this rollout's (ReMax's greedy baseline changes it per call)
        gen.engine.max_new_tokens = gen.max_answer_seq_len  # this rollout's (an episode's turn has less room)
        min_new_tokens = int(gen.extra_generate_kwargs.get("min_new_tokens", 0))
        conversation = request.conversation
        if conversation is not None:
            conversation.why_not = self._why_not_continue(module)
            if conversation.why_not is None:
                conversation.claim(self.name)
                return gen.engine.continue_turn(module, conversation, materialise=materialised(gen),
                                                min_new_tokens=min_new_tokens, keep_logprobs=gen.keep_logprobs)
        return gen.engine.rollout(module, request.prompts, request.mask, materialise=materialised(gen),
                                  min_new_tokens=min_new_tokens, keep_logprobs=gen.keep_logprobs)

    def _why_not_continue(self, module: nn.Module) -> str | None:
        """None when a multi-turn batch's turns can continue the engine's KV cache, else why not."""
        if self.gen.release_inference_cache:
            return "--release_inference_cache frees the KV cache after each turn"
        return why_not_kept(module.config)

    def fall_back(self, err: Exception, request: RolloutRequest) -> str | None:
        """A failure of the compiled step (CUDA) falls back for good; eagerly, an error is a bug or bad
        weights (non-finite logits), which the module paths would raise as well."""
        gen = self.gen
        if not_a_fallback(err) or gen.engine is None or not gen.engine.compiled_on(request.prompts.device):
            return None
        gen.use_dschat_engine = False
        gen.auto_engine_devices = ()
        return f"{ENGINE_NAME} failed ({raised(err)}); decoding with the training module from now on"
