"""The CUDA-graphs path: Hugging Face ``generate`` with a static KV cache, its decode step compiled.

``--generation_loop graphs``, and ``auto`` where it applies (an accelerator in the generator's
``graph_devices``, CUDA by default; the weights resident, i.e. not ZeRO-3 fetched layer by layer;
a decoder-only model): ``generate`` with ``cache_implementation="static"`` and
``torch.compile(mode="reduce-overhead")`` (CUDA graphs). Prompts are left-padded to a multiple of
``graph_prompt_multiple`` (64) so one captured graph serves the rollouts of a prompt width.

Where it does not apply, ``auto`` goes on to dschat's loop without a word; an explicit ``graphs`` says
why once and turns into ``dschat`` for the rest of the run. A compiler failure does the same (for
``auto`` too); out of memory and a compile cache folder that is not the user's own are re-raised.

Multi-turn episodes continue their :class:`~dschat.rlhf.rollout.conversation.Conversation` in a
``StaticCache`` of their own: ``generate`` gets the kept columns' ids and holed mask followed by the
turn's new columns, and prefills only the columns past the cache's length (positions from the mask,
as for any left padding). The cache's capacity is the conversation's ``limit`` (the episodes'
``max_context``), rounded up to ``graph_prompt_multiple``, so the turns of a batch share one
captured graph; before a turn would pass it, the holes of the kept columns are closed in the
cache's own tensors (their addresses stay) where that is enough, else the conversations are
prefilled again into the same cache (a larger one if even they do not fit compact); one decision
made before anything moves (:meth:`~dschat.rlhf.rollout.conversation.Conversation.make_room`). Rows whose episode has
ended are made to end at once (EOS), so they do not keep the others decoding.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.cache_utils import StaticLayer

from dschat.errors import raised
from dschat.rlhf.rollout.conversation import Conversation, compact_columns, why_not_kept
from dschat.rlhf.rollout.hf_generate import hf_generate
from dschat.rlhf.rollout.path import DecodingPath, RolloutRequest, fall_back, not_a_fallback
from dschat.rlhf.rollout.sampling import Rollout
from dschat.runtime.compile_cache import use_private_compile_cache

if TYPE_CHECKING:
    from dschat.rlhf.rollout.generator import RolloutGenerator

__all__ = ["GraphsPath"]


class GraphsPath(DecodingPath):
    """``generate`` with a static KV cache and CUDA graphs on the training module (see the module docstring)."""

    name = loop = "graphs"
    falls_back = True
    on_module = True
    continues = True
    label = "graphs (Hugging Face generate, static KV cache, CUDA graphs)"

    def __init__(self, generator: RolloutGenerator) -> None:
        super().__init__(generator)
        self._compile_config: CompileConfig | None = None  # one object: generate recompiles when it changes
        self.compactions = 0  # multi-turn turns that closed the holes of the kept cache (Conversation.make_room)
        self.restarts = 0  # multi-turn turns that prefilled the conversations again (compacting would not do)

    def can_serve(self, request: RolloutRequest) -> str | None:
        """CUDA graphs where they apply: weights resident (graphs cannot capture ZeRO-3's per-layer
        fetches), an accelerator in ``graph_devices``, a decoder-only model. An explicit ``graphs``
        that does not apply says once why not and gives up for good."""
        gen = self.gen
        if gen.generation_loop not in ("auto", "graphs"):
            return f"generation loop {gen.generation_loop!r}"
        module = gen.actor.module
        device = next(module.parameters()).device.type
        why_not = None
        if device not in gen.graph_devices:
            why_not = f"CUDA graphs need a CUDA device, the actor is on {device!r}"
        elif not request.materialised:
            why_not = "the actor's ZeRO-3 weights are fetched layer by layer (not gathered)"
        elif getattr(module.config, "is_encoder_decoder", False):
            why_not = "encoder-decoder models are not supported"
        if why_not is not None and gen.generation_loop == "graphs":
            fall_back(gen, self.name, f"--generation_loop graphs: not used ({why_not}); decoding with dschat's loop, or "
                                       "Hugging Face generate() where that loop cannot serve")
            gen.generation_loop = "dschat"
        return why_not

    def generate(self, request: RolloutRequest) -> Rollout:
        """Prompts are left-padded to a multiple of ``graph_prompt_multiple`` so the cache, and with it
        the captured graph, keeps one shape from rollout to rollout (the trimmed prompt width varies);
        the extra columns are padding (masked, position ids from the mask), cut off again before
        returning."""
        gen, module = self.gen, self.gen.actor.module
        prompts, mask = request.prompts, request.mask
        if self._compile_config is None:
            use_private_compile_cache()  # not torch's default, /tmp/torchinductor_<user>
            self._compile_config = CompileConfig(mode="reduce-overhead")
            if "cpu" in gen.graph_devices:
                self._compile_config._compile_all_devices = True
        if request.conversation is not None:
            request.conversation.why_not = why_not_kept(module.config)
            if request.conversation.why_not is None:
                return self._continue(request.conversation, prompts.device)
        B, P = prompts.shape
        extra = -P % gen.graph_prompt_multiple
        if extra:
            prompts = torch.cat([prompts.new_full((B, extra), gen.tokenizer.pad_token_id), prompts], dim=1)
            mask = torch.cat([mask.new_zeros((B, extra)), mask.to(prompts.device)], dim=1)
        # The weights are resident (never fetched inside the forward), so no rank needs the others to
        # keep stepping: no ``synced_gpus``, and a rank whose compile failed (dschat's loop, no
        # collectives) cannot leave the others waiting.
        rollout = hf_generate(gen, module, prompts, mask, cache_implementation="static",
                              compile_config=self._compile_config, synced_gpus=False)
        return Rollout(rollout.sequences[:, extra:], rollout.logprobs)

    def _continue(self, conversation: Conversation, device: torch.device) -> Rollout:
        """One turn of ``conversation`` on its ``StaticCache`` (see the module docstring)."""
        gen, module = self.gen, self.gen.actor.module
        conversation.claim(self.name)
        ids, mask = conversation.inputs(device)  # (B, N): the new columns
        kept = 0 if conversation.mask is None else conversation.mask.shape[1]
        cache = conversation.cache
        room, capacity = gen.max_answer_seq_len, conversation.capacity
        step = "fits"
        if cache is not None:
            assert isinstance(cache, StaticCache)
            movable = all(type(layer) is StaticLayer and layer.is_initialized for layer in cache.layers)
            step = conversation.make_room(ids.shape[1], room, capacity, movable=movable)
        if step == "compact":
            source = conversation.compact()  # close the kept columns' holes, in the cache's own tensors
            kept = source.shape[1]
            for layer in cache.layers:
                compact_columns(layer.keys, source)
                compact_columns(layer.values, source)
                layer.cumulative_length.fill_(kept)  # where generate writes next
            self.compactions += 1
        elif step in ("prefill", "past"):
            # Every conversation is prefilled again: into the same cache (its addresses, and the captured
            # graph, stay) where they fit compact, else into a larger one.
            again = cache if step == "prefill" else None
            self.restarts += 1
            conversation.drop()
            ids, mask = conversation.inputs(device)
            kept, cache = 0, None
            if again is not None:
                again.reset()
                cache = conversation.cache = again
                conversation.capacity = capacity
        if cache is None:
            # Room for the conversation's limit (every turn of the batch on one cache, one graph).
            need = max(ids.shape[1] + gen.max_answer_seq_len, conversation.limit or 0)
            capacity = -(-need // gen.graph_prompt_multiple) * gen.graph_prompt_multiple
            cache = conversation.cache = StaticCache(config=module.config, max_cache_len=capacity)
            conversation.capacity = capacity
        assert isinstance(cache, StaticCache)  # claimed: this path's own
        if kept:
            assert conversation.mask is not None
            ids = torch.cat([conversation.past_ids(device), ids], dim=1)
            mask = torch.cat([conversation.mask.to(mask), mask], dim=1)
        ended = torch.tensor([not a for a in conversation.active], dtype=torch.bool, device=device)
        only = gen.end_ids[0] if gen.end_ids else gen.tokenizer.pad_token_id  # what an ended row draws
        processors = LogitsProcessorList([*gen.extra_generate_kwargs.get("logits_processor", []),
                                          _EndRows(ended, only)])
        # An ended row feeds nothing; its last column is shown to generate as a token (a pad id seen by
        # that row alone, a hole in the conversation's mask), or generate takes it for right padding.
        shown = mask.clone()
        shown[ended, -1] = 1
        rollout = hf_generate(gen, module, ids, shown, past_key_values=cache, compile_config=self._compile_config,
                              synced_gpus=False, logits_processor=processors)
        conversation.decoded(mask[:, kept:], rollout.sequences.shape[1] - ids.shape[1])
        return Rollout(rollout.sequences[:, kept:], rollout.logprobs)

    def fall_back(self, err: Exception, request: RolloutRequest) -> str | None:
        """A compiler failure: dschat's loop from now on (within this rollout's gather)."""
        if not_a_fallback(err):
            return None
        flag = self.gen.generation_loop
        self.gen.generation_loop = "dschat"
        return (f"--generation_loop {flag}: CUDA graphs failed ({raised(err)}); decoding with dschat's loop (or Hugging "
                "Face generate() where that loop cannot serve) from now on")


class _EndRows(LogitsProcessor):
    """The rows of ``ended`` (B,) bool: ``token_id`` is their only token -- the generator's first end
    id, so ``generate`` ends them at once; the pad id when there is none -- after generate's own
    processors and the user's (the sampling warpers after it keep it the only choice)."""

    def __init__(self, ended: torch.Tensor, token_id: int) -> None:
        self.ended, self.token_id = ended, token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        only = torch.full_like(scores, -float("inf"))
        only[:, self.token_id] = 0.0
        return torch.where(self.ended[:, None], only, scores)
