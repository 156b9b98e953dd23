"""The sample-loop path: dschat's own decoding loop on the training module, and decode-sized CPU matmuls.

* :func:`sample_loop` (``--generation_loop dschat``, and ``auto`` where CUDA graphs do not apply) --
  the decoding loop of Hugging Face ``generate`` for the settings PPO uses (greedy or sampling with
  temperature / top-k / top-p, ``min_new_tokens``, EOS then padding), written out: one forward per
  token with a ``DynamicCache`` and ``logits_to_keep=1``, the same logits processing
  (:func:`~dschat.rlhf.rollout.sampling.next_token_scores`), the sampled tokens' log-probs taken at
  each step (no per-step (B, V) logits are held), and an inverse-CDF draw
  (:func:`~dschat.rlhf.rollout.sampling.draw`).
* :func:`onednn_decode_linears` (``--cpu_decode_linear onednn``) -- on a CPU, every linear layer of
  the actor runs its decode steps (as many rows as the batch) with oneDNN on a copy of its weight
  repacked once per rollout (measurements: benchmarks/results.md, "Decoding on a CPU"); prefill and
  the training passes (many rows) keep the stock kernels. The price: one extra copy of the actor's
  linear weights while a rollout is generated, and logits that differ from MKL's in the last bits
  (another summation order). The copies are taken at the start of every rollout, so they hold the
  current weights. The plain ``generate`` path uses them too.
* :class:`SampleLoopPath` serves when the weights are materialised, the model is decoder-only and
  nothing but ``min_new_tokens`` is passed beyond the decoding settings.
"""
from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Iterator

import torch
from torch import nn
from transformers import DynamicCache

from dschat.models.lora import LinearLayer_LoRA
from dschat.rlhf.rollout.conversation import Conversation, why_not_kept
from dschat.rlhf.rollout.path import DecodingPath, RolloutRequest, say_once
from dschat.rlhf.rollout.sampling import (DecodingSettings, EndIds, Rollout, StepCallback, draw, end_rows, loop_rollout,
                                          next_token_scores)
from dschat.runtime.zero3 import free_memory_bytes

if TYPE_CHECKING:
    from dschat.rlhf.rollout.generator import RolloutGenerator

__all__ = ["decode_kernels", "onednn_decode_linears", "onednn_decode_supported", "sample_loop",
           "SampleLoopPath"]


# ------------------------------------------------------------------------------------------------
# Decode-sized linears (CPU)
# ------------------------------------------------------------------------------------------------
def onednn_decode_supported(module: nn.Module) -> str | None:
    """``None`` when :func:`onednn_decode_linears` can run on ``module``, else why not (one line)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    params = list(module.parameters())
    if not params or params[0].device.type != "cpu":
        return "the actor is not on a CPU (oneDNN decode kernels are for CPU decoding)"
    if any(p.dtype != torch.float32 for p in params if p.dim() == 2):
        return "the actor's weights are not all fp32 (only fp32 decoding was measured)"
    return None


def _decode_linear_layers(module: nn.Module) -> list[nn.Module]:
    """The layers whose forward is exactly ``F.linear(x, weight, bias)`` with materialised weights."""
    layers = []
    for m in module.modules():
        # Exactly nn.Linear: subclasses (bitsandbytes' 4-bit Linear, ...) have their own forward.
        plain = type(m) is nn.Linear or (isinstance(m, LinearLayer_LoRA) and m.fuse_lora and not m.is_quantized)
        if plain and m.weight.dim() == 2 and m.weight.numel() > 0:
            layers.append(m)
    return layers


def _packed_forward(layer: nn.Module, packed: torch.Tensor, rows: int, x: torch.Tensor) -> torch.Tensor:
    if x.numel() == rows * x.shape[-1] and x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
    return type(layer).forward(layer, x)


@contextmanager
def onednn_decode_linears(module: nn.Module, rows: int) -> Iterator[int]:
    """Inside, the linear layers of ``module`` run inputs of exactly ``rows`` rows with oneDNN on
    weights repacked now; other inputs take the layer's own forward. Yields the number of layers.

    The packed copies are taken on entry, so the weights must not change inside (generation), and
    must be materialised (ZeRO-3: inside the gather).
    """
    layers = _decode_linear_layers(module)
    for layer in layers:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), rows)
        # An instance attribute shadows the class's forward; nn.Module.__call__ (hooks included) calls it.
        layer.forward = functools.partial(_packed_forward, layer, packed, rows)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward


def decode_kernels(gen: RolloutGenerator, module: nn.Module, rows: int, materialised: bool) -> ContextManager[Any]:
    """oneDNN decode-sized linears (``--cpu_decode_linear onednn``) where they apply, else nothing
    (on a CPU saying once why not)."""
    if gen.cpu_decode_linear == "off":
        return nullcontext()
    why_not = onednn_decode_supported(module) if materialised else "ZeRO-3 parameters are not gathered"
    if why_not is None:
        need = sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() == 2)
        if need > free_memory_bytes(torch.device("cpu")) // 2:
            why_not = "a packed copy of the actor's weights does not fit in half the free memory"
    if why_not is not None:
        if next(module.parameters()).device.type == "cpu":  # on an accelerator it is simply not for it
            say_once(gen, f"--cpu_decode_linear onednn: not used ({why_not})")
        return nullcontext()
    return onednn_decode_linears(module, rows)


# ------------------------------------------------------------------------------------------------
# The sampling loop
# ------------------------------------------------------------------------------------------------
def _forward_kwargs(module: nn.Module) -> set[str]:
    return set(inspect.signature(module.forward).parameters)


def sample_loop(module: nn.Module, prompts: torch.Tensor, mask: torch.Tensor, *, decoding: DecodingSettings,
                max_new_tokens: int, eos_token_id: EndIds, pad_token_id: int, min_new_tokens: int = 0,
                keep_logprobs: bool = True, sampler: str = "inverse_cdf", on_step: StepCallback | None = None,
                cache: DynamicCache | None = None, past_mask: torch.Tensor | None = None,
                active: torch.Tensor | None = None) -> Rollout:
    """Decode ``(B, P)`` left-padded prompts with ``module`` (a decoder-only Hugging Face model).

    Decodes as ``module.generate(prompts, attention_mask=mask, max_new_tokens=..., min_new_tokens=...,
    eos_token_id=..., pad_token_id=..., **decoding.generate_kwargs())`` does: position ids from the
    attention mask (``cumsum - 1``, 0 on padding), the same logits processing
    (:func:`next_token_scores`), an EOS ends a row (any id of ``eos_token_id``, one id or several:
    :data:`~dschat.rlhf.rollout.sampling.EndIds`) and later tokens of that row are ``pad_token_id``,
    decoding stops when every row has ended or after ``max_new_tokens``. Greedy decoding gives
    generate's tokens; sampling draws from the same distribution with :func:`draw` (``sampler``;
    ``"multinomial"`` reproduces generate's draws for a seed). ``Rollout.logprobs``: (B, A') log-probs
    of the tokens under ``logits / decoding.logit_temperature`` (what :func:`generated_token_logprobs`
    computes from generate's logits).

    ``on_step`` (a :data:`~dschat.rlhf.rollout.sampling.StepCallback`) sees each step's ``(B,)`` tokens
    and may end rows there, as an EOS would (a server's per-row ``max_tokens``, stop strings, streaming
    and cancelled requests); without it the loop is ``generate``'s.

    Continuing a cache (:class:`Conversation`): ``cache`` already holds ``C`` columns whose 2-D mask is
    ``past_mask`` (B, C), with holes (0) anywhere; ``prompts``/``mask`` are the new columns. The
    attention mask is ``past_mask`` then ``mask`` then 1 per decoded column, and the position ids
    ``cumsum - 1`` over all of it, so a token's position counts only the ones before it. ``active``
    (B,) bool: the rows that decode (the others give ``pad_token_id`` from the first token on).
    After the call the cache holds ``C + P + A' - 1`` columns (the last sampled token is not fed).
    """
    B, P = prompts.shape
    accepted = _forward_kwargs(module)
    mask = mask.to(prompts.device)
    extra: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in accepted:
        extra["logits_to_keep"] = 1
    if past_mask is not None:
        mask = torch.cat([past_mask.to(mask), mask], dim=-1)
    positions = None
    if "position_ids" in accepted:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -P:]
    if cache is None:
        cache = DynamicCache(config=module.config)
    out = module(input_ids=prompts, attention_mask=mask, past_key_values=cache,
                 **({"position_ids": positions} if positions is not None else {}), **extra)
    logits = out.logits[:, -1].float()
    del out
    last_position = positions[:, -1:] if positions is not None else None
    unfinished = (torch.ones(B, dtype=torch.bool, device=prompts.device) if active is None
                  else active.to(device=prompts.device, dtype=torch.bool).clone())
    pad = torch.full((B,), pad_token_id, dtype=prompts.dtype, device=prompts.device)
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    temperature = decoding.logit_temperature
    for t in range(max_new_tokens):
        scores = next_token_scores(logits, decoding, eos_token_id, suppress_eos=t < min_new_tokens)
        if decoding.sample:
            token = draw(torch.softmax(scores, dim=-1), sampler)
        else:
            token = torch.argmax(scores, dim=-1)
        token = torch.where(unfinished, token, pad)
        if keep_logprobs:
            scaled = logits / temperature if temperature != 1.0 else logits
            logprobs.append(torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1))
        tokens.append(token)
        end_rows(unfinished, token, eos_token_id, on_step)
        if t == max_new_tokens - 1 or not bool(unfinished.any()):
            break
        mask = torch.cat([mask, mask.new_ones((B, 1))], dim=-1)
        step_kwargs: dict[str, Any] = dict(extra)
        if last_position is not None:
            last_position = last_position + 1
            step_kwargs["position_ids"] = last_position
        out = module(input_ids=token[:, None], attention_mask=mask, past_key_values=cache, **step_kwargs)
        logits = out.logits[:, -1].float()
        del out
    return loop_rollout(prompts, tokens, logprobs if keep_logprobs else None)



class SampleLoopPath(DecodingPath):
    """dschat's loop (:func:`sample_loop`) on the training module, inside the generator's gather."""

    name = loop = "dschat"
    on_module = True
    continues = True
    label = "dschat loop (dschat.rlhf.rollout.sample_loop on the training module)"

    def can_serve(self, request: RolloutRequest) -> str | None:
        """dschat's loop covers the decoding settings and ``min_new_tokens``; anything else passed in
        ``extra_generate_kwargs`` (a logits processor, ...) goes to HF ``generate``. Without the ZeRO-3
        gather every rank must keep stepping until all are done (``synced_gpus``): HF ``generate``."""
        gen = self.gen
        if gen.generation_loop not in ("auto", "dschat"):
            return f"generation loop {gen.generation_loop!r}"
        if not request.materialised:
            return "the actor's ZeRO-3 weights are fetched layer by layer; generate keeps every rank stepping"
        if getattr(gen.actor.module.config, "is_encoder_decoder", False):
            return "encoder-decoder models are not supported"
        if set(gen.extra_generate_kwargs) - {"min_new_tokens"}:
            return f"{sorted(gen.extra_generate_kwargs)} need Hugging Face generate()"
        return None

    def generate(self, request: RolloutRequest) -> Rollout:
        gen, module, prompts = self.gen, self.gen.actor.module, request.prompts
        if request.conversation is not None:
            # HF limits a sliding layer's keys to the last `window` cache columns, holes included.
            request.conversation.why_not = why_not_kept(module.config)
            if request.conversation.why_not is None:
                return self._continue(request.conversation, prompts.device)
        with decode_kernels(gen, module, prompts.shape[0], request.materialised):
            return sample_loop(module, prompts, request.mask, decoding=gen.decoding,
                               max_new_tokens=gen.max_answer_seq_len,
                               min_new_tokens=int(gen.extra_generate_kwargs.get("min_new_tokens", 0)),
                               eos_token_id=gen.end_ids, pad_token_id=gen.tokenizer.pad_token_id,
                               keep_logprobs=gen.keep_logprobs)

    def _continue(self, conversation: Conversation, device: torch.device) -> Rollout:
        """One turn of ``conversation``: its rows' new tokens through :func:`sample_loop` on its cache."""
        gen, module = self.gen, self.gen.actor.module
        conversation.claim(self.name)
        ids, mask = conversation.inputs(device)  # unbounded: the DynamicCache is freed with the episodes
        if conversation.cache is None:
            conversation.cache = DynamicCache(config=module.config)
        cache = conversation.cache
        assert isinstance(cache, DynamicCache)  # claimed: this path's own
        past = conversation.mask
        with decode_kernels(gen, module, ids.shape[0], True):
            rollout = sample_loop(module, ids, mask, decoding=gen.decoding, max_new_tokens=gen.max_answer_seq_len,
                                  min_new_tokens=int(gen.extra_generate_kwargs.get("min_new_tokens", 0)),
                                  eos_token_id=gen.end_ids, pad_token_id=gen.tokenizer.pad_token_id,
                                  keep_logprobs=gen.keep_logprobs, cache=cache, past_mask=past,
                                  active=torch.tensor(conversation.active, dtype=torch.bool, device=device))
        conversation.decoded(mask, rollout.sequences.shape[1] - ids.shape[1])
        return rollout
