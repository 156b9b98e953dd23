"""Rollout decoding for the module path: decode-sized CPU matmuls and a plain sampling loop.

Two fast paths that :class:`dschat.rlhf.hybrid_engine.RolloutGenerator` uses around the actor
module (each has a flag; ``benchmarks/step3.py`` turns both off for its baseline):

* :func:`onednn_decode_linears` (``--cpu_decode_linear onednn``) -- on a CPU, every linear layer of
  the actor runs its decode steps (as many rows as the batch) with oneDNN on a copy of its weight
  repacked once per rollout: with a few rows MKL's fp32 GEMM reads the weights well below the
  memory bandwidth, and decoding reads every weight once per token (measurements:
  benchmarks/results.md, "Decoding on a CPU"). Prefill and the training passes (many rows)
  keep the stock kernels. The price: one extra copy of the actor's linear weights while a rollout
  is generated, and logits that differ from MKL's in the last bits (another summation order), as a
  KV-cached forward's already do. The copies are taken at the start of every rollout, so they
  always hold the current weights.
* :func:`sample_loop` (``--generation_loop dschat``) -- the decoding loop of Hugging Face
  ``generate`` for the settings PPO uses (greedy or sampling with temperature / top-k / top-p,
  ``min_new_tokens``, EOS then padding), written out: one forward per token with a
  ``DynamicCache`` and ``logits_to_keep=1``, the same logits processing, the sampled tokens'
  log-probs taken at each step (generate keeps every step's (B, V) logits until it returns), and an
  inverse-CDF draw (:func:`draw`) instead of ``torch.multinomial``, which draws one variate per
  vocabulary entry.

``torch.compile`` with a static KV cache was measured on a CPU and is not used there (see
benchmarks/results.md, "Analyses"); on CUDA it is ``RolloutGenerator``'s ``graphs`` loop, the default there.
"""
from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import torch
from torch import nn
from transformers import DynamicCache, GenerationConfig

from dschat.models.lora import LinearLayer_LoRA


__all__ = ["DecodingSettings", "Rollout", "generated_token_logprobs", "loop_rollout", "check_probability_sums", "draw", "next_token_scores", "onednn_decode_linears",
           "onednn_decode_supported", "sample_loop"]


# ------------------------------------------------------------------------------------------------
# What a rollout is decoded with, and what it gives back
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodingSettings:
    """Rollout decoding (``--decoding``, ``--temperature``, ``--top_k``, ``--top_p``)."""

    decoding: str = "sample"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def sample(self) -> bool:
        return self.decoding == "sample"

    def generate_kwargs(self) -> dict[str, Any]:
        """These settings as ``generate`` keyword arguments. They override only the knobs they name:
        ``generate`` still fills every other one (``repetition_penalty``, ``no_repeat_ngram_size``,
        ``min_p``, ``typical_p``, ``bad_words_ids``, ...) from the model's ``generation_config``, so
        :class:`RolloutGenerator` also swaps that for :meth:`generation_config` during the call."""
        if not self.sample:
            return {"do_sample": False, "num_beams": 1}
        return {"do_sample": True, "num_beams": 1, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "repetition_penalty": 1.0}

    def generation_config(self, model_config: Any = None) -> Any:
        """A fresh ``GenerationConfig`` with these decoding settings and nothing else but the special-token
        ids (pad / bos / eos / decoder start) of ``model_config``, the model's own generation config.

        A checkpoint's ``generation_config.json`` (``temperature 0.6``, ``repetition_penalty``,
        ``no_repeat_ngram_size``, ``min_p``, ...) must not shape the rollouts: the PPO ratio assumes the
        answers were drawn from ``softmax(logits / temperature)`` with top-k / top-p only, which is what
        dschat's own loop (:func:`dschat.rlhf.decoding.sample_loop`) draws from and what the log-probs
        are computed under."""
        ids = {name: getattr(model_config, name, None)
               for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")}
        return GenerationConfig(**{k: v for k, v in ids.items() if v is not None}, **self.generate_kwargs())

    @property
    def logit_temperature(self) -> float:
        """Divide logits by this when scoring rollouts, so log-probs are those of the sampling
        distribution (TRL's convention); 1 for greedy decoding."""
        return self.temperature if self.sample else 1.0


class Rollout(NamedTuple):
    """One generated batch."""

    sequences: torch.Tensor  # (B, P + A') left-padded prompts, answers, padding after EOS
    # (B, A') fp32 log-probs of sequences[:, P:] under logits / temperature, as sampled; None when
    # the generator could not keep them (Hybrid Engine, or turned off).
    logprobs: torch.Tensor | None



def generated_token_logprobs(step_logits: Sequence[torch.Tensor] | None, answer: torch.Tensor,
                             temperature: float) -> torch.Tensor | None:
    """Log-probs of ``answer`` (B, A') from ``generate``'s per-step raw logits (A' tensors of (B, V)).

    The same numbers the trainer would get from a forward pass over the sequence (up to the
    rounding of a KV-cached forward), computed once per step so no (B, A', V) tensor is built.
    ``None`` when the logits do not cover the answer (then the trainer recomputes them).
    """
    if step_logits is None or len(step_logits) != answer.shape[1]:
        return None
    columns = []
    for j, logits in enumerate(step_logits):
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        columns.append(torch.log_softmax(logits, dim=-1).gather(-1, answer[:, j:j + 1]).squeeze(-1))
    if not columns:
        return answer.new_zeros((answer.shape[0], 0), dtype=torch.float32)
    return torch.stack(columns, dim=1)


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


# ------------------------------------------------------------------------------------------------
# The sampling loop
# ------------------------------------------------------------------------------------------------
def next_token_scores(logits: torch.Tensor, decoding: DecodingSettings, eos_token_id: int,
                      suppress_eos: bool) -> torch.Tensor:
    """``generate``'s logits processing for ``decoding`` (B, V) fp32 -> (B, V): EOS masked while the
    answer is shorter than ``min_new_tokens``, then temperature, top-k, top-p -- the same order and
    formulas as ``MinNewTokensLengthLogitsProcessor``, ``TemperatureLogitsWarper``,
    ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (transformers 5.23), so a seed draws the same tokens."""
    scores = logits
    if suppress_eos:
        scores = scores.clone()
        scores[:, eos_token_id] = -float("inf")
    if not decoding.sample:
        return scores
    if decoding.temperature != 1.0:
        scores = scores / decoding.temperature
    if decoding.top_k:
        k = min(decoding.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if decoding.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - decoding.top_p)
        remove[..., -1:] = 0  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores


def check_probability_sums(total: torch.Tensor) -> None:
    """Refuse rows whose probabilities do not sum to a finite positive number (non-finite logits)."""
    if not bool(torch.isfinite(total).all() and (total > 0).all()):
        raise ValueError("probability tensor contains inf, nan or sums to 0 (the actor's logits are not finite)")


def draw(probs: torch.Tensor, sampler: str = "inverse_cdf") -> torch.Tensor:
    """One token per row from ``probs`` (B, V) -> (B,).

    ``"inverse_cdf"``: one uniform number per row against the fp64 running sum of the row (exact up
    to fp64 rounding; a zero-probability token is never drawn). ``"multinomial"``:
    ``torch.multinomial``, what ``generate`` calls; it draws an exponential variate for every
    vocabulary entry (O(V) random numbers per row against one).
    """
    if sampler == "multinomial":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    if sampler != "inverse_cdf":
        raise ValueError(f"sampler must be 'inverse_cdf' or 'multinomial', got {sampler!r}")
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    check_probability_sums(total)
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total
    # Strictly below the total, so the first entry of the running sum above u is a token with p > 0.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _forward_kwargs(module: nn.Module) -> set[str]:
    return set(inspect.signature(module.forward).parameters)


@torch.no_grad()
def loop_rollout(prompts: torch.Tensor, tokens: Sequence[torch.Tensor],
                 logprobs: Sequence[torch.Tensor] | None) -> Rollout:
    """The :class:`Rollout` of a decoding loop: the ``(B, P)`` prompts followed by the A' sampled
    columns ``tokens`` (each ``(B,)``), with their per-token log-probs (each ``(B,)``) unless ``None``."""
    rows = prompts.shape[0]
    answer = torch.stack(list(tokens), dim=1) if tokens else prompts.new_zeros((rows, 0))
    seq = torch.cat([prompts, answer], dim=1)  # (B, P + A')
    if logprobs is None:
        return Rollout(seq, None)
    kept = torch.stack(list(logprobs), dim=1) if logprobs else torch.zeros((rows, 0), device=prompts.device)
    return Rollout(seq, kept)


def sample_loop(module: nn.Module, prompts: torch.Tensor, mask: torch.Tensor, *, decoding: DecodingSettings,
                max_new_tokens: int, eos_token_id: int, pad_token_id: int, min_new_tokens: int = 0,
                keep_logprobs: bool = True, sampler: str = "inverse_cdf") -> Rollout:
    """Decode ``(B, P)`` left-padded prompts with ``module`` (a decoder-only Hugging Face model).

    Decodes as ``module.generate(prompts, attention_mask=mask, max_new_tokens=..., min_new_tokens=...,
    eos_token_id=..., pad_token_id=..., **decoding.generate_kwargs())`` does: position ids from the
    attention mask (``cumsum - 1``, 0 on padding), the same logits processing
    (:func:`next_token_scores`), an EOS ends a row and later tokens of that row are ``pad_token_id``,
    decoding stops when every row has ended or after ``max_new_tokens``. Greedy decoding gives
    generate's tokens; sampling draws from the same distribution with :func:`draw` (``sampler``;
    ``"multinomial"`` reproduces generate's draws for a seed). ``Rollout.logprobs``: (B, A') log-probs
    of the tokens under ``logits / decoding.logit_temperature`` (what :func:`generated_token_logprobs`
    computes from generate's logits).
    """
    B, P = prompts.shape
    accepted = _forward_kwargs(module)
    mask = mask.to(prompts.device)
    extra: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in accepted:
        extra["logits_to_keep"] = 1
    positions = None
    if "position_ids" in accepted:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = DynamicCache(config=module.config)
    out = module(input_ids=prompts, attention_mask=mask, past_key_values=cache,
                 **({"position_ids": positions} if positions is not None else {}), **extra)
    logits = out.logits[:, -1].float()
    del out
    last_position = positions[:, -1:] if positions is not None else None
    unfinished = torch.ones(B, dtype=torch.bool, device=prompts.device)
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
        unfinished &= token != eos_token_id
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
