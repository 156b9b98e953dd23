"""Tensor-parallel shards of dschat's decode model (``--inference_tp_size``), in Megatron-LM's layout.

Within a group of ``n`` ranks, member ``r`` holds:

* the q, k and v rows of query heads ``[r H/n, (r+1) H/n)`` and key-value heads ``[r Hkv/n, (r+1) Hkv/n)``
  (column-parallel), fused as ``(q_r; k_r; v_r)``; its KV cache holds those ``Hkv/n`` heads, and
  attention needs no communication (each query head reads its own group's KV head, as in GQA). When
  ``n`` is a multiple of ``Hkv`` (multi-query models) each member keeps the one KV head its queries read;
* the gate and up rows ``[r I/n, (r+1) I/n)`` (column-parallel), fused as ``(gate_r; up_r)``;
* the matching columns of the attention output and MLP down projections (row-parallel): each member's
  partial product is summed over the group (one all-reduce each), the bias added once after the sum;
* vocabulary rows ``[r Vs, (r+1) Vs)`` of the token embedding and of the LM head, ``Vs = ceil(V / n)``
  (vocabulary-parallel). When ``n`` does not divide ``V`` the last rows are zeros and their logits are
  masked to ``-inf``, so any vocabulary works. A lookup sums the members' rows (one all-reduce); the
  logits stay sharded, and the sampling step (:func:`greedy_shard_stats` / :func:`combine_greedy_stats`,
  or a gather of the row for sampling: :mod:`dschat.rlhf.rollout.tensor_parallel`) picks the token;
* everything else whole: norms, OPT's learned positions, OPT-350m's project_in/out, Qwen3's q/k norms.

Per decoder layer and token the group exchanges two ``(B, E)`` sums; per token one more for the embedding.
Only a shard is kept: under ZeRO-3, :meth:`ShardedInferenceWeights.refresh` gathers
``layers_per_gather`` layers at a time (``--tp_gather_partition_size``), copies this member's slices
and lets the gathered layers go.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dschat.models.decoder.forward import DecodeModel
from dschat.models.decoder.layouts import DecoderSpec, decoder_spec
from dschat.models.decoder.weights import InferenceWeights, _Copier, _get, _param

__all__ = ["Collectives", "shard_rows", "shard_columns", "split_blocks", "padded_vocab", "vocab_shard", "kv_heads_per_member",
           "tp_unsupported_reason", "greedy_shard_stats", "combine_greedy_stats", "ShardedInferenceWeights",
           "ShardedDecodeModel"]

Gather = Callable[[Sequence[nn.Module]], AbstractContextManager[Any]]


class Collectives(Protocol):
    """What a shard needs of its group (:class:`dschat.runtime.dist.TensorParallelGroup`)."""

    size: int
    index: int

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    def broadcast_(self, tensor: torch.Tensor, src_index: int = 0) -> None: ...


# ------------------------------------------------------------------------------------------------
# Slicing (pure)
# ------------------------------------------------------------------------------------------------
def shard_rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rows ``[r N/n, (r+1) N/n)`` of ``t`` (N, ...): a column-parallel shard (a view)."""
    rows = t.shape[0] // n
    return t[r * rows:(r + 1) * rows]


def shard_columns(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Columns ``[r M/n, (r+1) M/n)`` of ``t`` (N, M): a row-parallel shard (a view)."""
    cols = t.shape[-1] // n
    return t[..., r * cols:(r + 1) * cols]


def split_blocks(parts: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
    """The row blocks ``sizes`` of a fused projection given as one tensor per block (Llama's q, k, v)
    or as one fused tensor (Phi-3's qkv_proj and gate_up_proj, GPT-NeoX's reordered query_key_value)."""
    if len(parts) == len(sizes):
        return list(parts)
    if len(parts) == 1:
        return list(parts[0].split(list(sizes), dim=0))
    raise ValueError(f"{len(parts)} projection parts for {len(sizes)} blocks")


def _shard_blocks(parts: list[torch.Tensor | None], sizes: Sequence[int], n: int, r: int,
                  num_kv_heads: int = 0) -> list[torch.Tensor | None]:
    """Each block's member-``r`` rows, in block order (None parts: no bias, passed through); with
    ``num_kv_heads``, the blocks are q, k, v and k, v follow :func:`kv_heads_per_member`."""
    if any(p is None for p in parts):
        return parts
    blocks = split_blocks(parts, sizes)
    if not num_kv_heads:
        return [shard_rows(b, n, r) for b in blocks]
    return [shard_rows(blocks[0], n, r), *(_kv_rows(b, num_kv_heads, n, r) for b in blocks[1:])]


def padded_vocab(vocab: int, n: int) -> int:
    """``vocab`` rounded up to a multiple of ``n``."""
    return -(-vocab // n) * n


def vocab_shard(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Member ``r``'s ``ceil(V / n)`` rows of ``t`` (V, E); rows past V are zeros (a copy only then)."""
    vocab = t.shape[0]
    rows = padded_vocab(vocab, n) // n
    start, stop = r * rows, min((r + 1) * rows, vocab)
    if stop - start == rows:
        return t[start:stop]
    out = t.new_zeros((rows, *t.shape[1:]))
    if stop > start:
        out[:stop - start] = t[start:stop]
    return out


def _mlp_width(config: Any) -> int | None:
    return getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)


def kv_heads_per_member(num_kv_heads: int, n: int) -> int:
    """Key-value heads a member holds: ``Hkv / n``, or one (replicated) when ``n`` is a multiple of
    ``Hkv`` (multi-query and narrow GQA models, Megatron-LM's rule)."""
    return num_kv_heads // n if num_kv_heads % n == 0 else 1


def _kv_rows(t: torch.Tensor, num_kv_heads: int, n: int, r: int) -> torch.Tensor:
    """Member ``r``'s rows of a k or v block (Hkv x D, ...): its share, or the one head its queries read."""
    if num_kv_heads % n == 0:
        return shard_rows(t, n, r)
    head, rows = r * num_kv_heads // n, t.shape[0] // num_kv_heads
    return t[head * rows:(head + 1) * rows]


def tp_unsupported_reason(config: Any, n: int) -> str | None:
    """None when the decode model of ``config`` splits over ``n`` ranks, else one line with the fix:
    query heads and the MLP width must divide by ``n``, key-value heads divide by it or it by them
    (then each member keeps a copy of the one its queries read); the vocabulary need not."""
    spec = decoder_spec(config)
    width = _mlp_width(config)

    def fits(d: int) -> bool:
        return (spec.num_heads % d == 0 and (width is None or width % d == 0)
                and (spec.num_kv_heads % d == 0 or d % spec.num_kv_heads == 0))

    if fits(n):
        return None
    sizes = {"attention heads": spec.num_heads, "MLP width": width}
    bad = [f"{value} {name}" for name, value in sizes.items() if value is not None and value % n]
    if spec.num_kv_heads % n and n % spec.num_kv_heads:
        bad.append(f"{spec.num_kv_heads} key-value heads")
    degrees = [d for d in range(1, spec.num_heads + 1) if fits(d)]
    return (f"--inference_tp_size {n}: the actor's {', '.join(bad)} do not divide by {n} (each rank holds whole "
            f"heads and an equal share of the MLP); use one of {', '.join(map(str, degrees))}")


# ------------------------------------------------------------------------------------------------
# The vocabulary-parallel greedy step (pure: the collective is the caller's)
# ------------------------------------------------------------------------------------------------
def greedy_shard_stats(scores: torch.Tensor, logits: torch.Tensor, vocab_start: int, pad_token_id: int) -> torch.Tensor:
    """One shard's share of a greedy step: (B, Vs) scores (what argmax picks from) and raw logits
    (what the log-prob is of) -> (B, 5) fp64 ``[best score, its global id, logsumexp of the logits,
    logit at the best id, logit at pad_token_id (-inf off this shard)]``."""
    best, arg = scores.max(dim=-1)  # the first maximum on this shard
    lse = torch.logsumexp(logits, dim=-1)
    at_best = logits.gather(-1, arg[:, None]).squeeze(-1)
    local_pad = pad_token_id - vocab_start
    at_pad = (logits[:, local_pad] if 0 <= local_pad < logits.shape[-1]
              else torch.full_like(lse, -float("inf")))
    return torch.stack([best, (arg + vocab_start).to(best.dtype), lse, at_best, at_pad], dim=-1).double()


def combine_greedy_stats(stats: Sequence[torch.Tensor], unfinished: torch.Tensor,
                         pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's :func:`greedy_shard_stats` in member order -> (B,) tokens (``pad_token_id`` where a
    row has ended) and their (B,) fp32 log-probs: what argmax and log_softmax of the whole row give.
    Ties go to the lowest id, as ``torch.argmax`` (the first shard holding the maximum wins)."""
    table = torch.stack(list(stats))  # (n, B, 5)
    winner = table[..., 0].argmax(dim=0)  # (B,) the first member with the maximum
    picked = table.gather(0, winner[None, :, None].expand(1, -1, table.shape[-1])).squeeze(0)  # (B, 5)
    lse = torch.logsumexp(table[..., 2], dim=0)  # (B,) over the whole vocabulary
    token = torch.where(unfinished, picked[:, 1].long(), torch.full_like(unfinished, pad_token_id, dtype=torch.long))
    chosen = torch.where(unfinished, picked[:, 3], table[..., 4].max(dim=0).values)
    return token, (chosen - lse).float()


# ------------------------------------------------------------------------------------------------
# Weights and forward of one member
# ------------------------------------------------------------------------------------------------
def _no_gather(modules: Sequence[nn.Module]) -> AbstractContextManager[Any]:
    return nullcontext()


class ShardedInferenceWeights(InferenceWeights):
    """Member ``index`` of ``size``'s slices of the inference layout (see the module docstring);
    ``spec`` is the whole model's."""

    def __init__(self, spec: DecoderSpec, size: int, index: int) -> None:
        super().__init__(spec)
        self.size, self.index = size, index
        self.vocab = 0  # V: rows of the whole embedding
        self.vocab_rows = 0  # Vs = ceil(V / size): rows held here
        self.vocab_start = 0  # the first id held here

    @torch.no_grad()
    def refresh(self, model: nn.Module, dtype: torch.dtype, device: torch.device, gather: Gather | None = None,
                layers_per_gather: int = 8) -> None:
        """Copy this member's slices of ``model``'s weights into the buffers. ``gather(modules)``
        materialises those modules' weights while inside (ZeRO-3 gather, LoRA fused): first the
        embeddings, norms and head, then ``layers_per_gather`` decoder layers at a time."""
        gather = gather or _no_gather
        allocate = not self.allocated
        if not allocate and (self.embed.dtype != dtype or self.embed.device != device):
            self.release()
            allocate = True
        c = _Copier(dtype, device, allocate)
        spec, lay, n, r = self.spec, self.spec.layout, self.size, self.index
        body = _get(model, lay.body)
        optional = [lay.positions, lay.project_in, lay.project_out, lay.final_norm if spec.final_norm else None]
        extra = {name: getattr(body, name, None) if name else None for name in optional}
        head = _get(model, lay.lm_head)
        with gather([_get(body, lay.embed), head, *(m for m in extra.values() if m is not None)]):
            embed_src = _get(body, lay.embed).weight
            if head.weight is not embed_src and head.weight.shape[0] != embed_src.shape[0]:
                raise ValueError(f"the LM head has {head.weight.shape[0]} rows and the embedding {embed_src.shape[0]}")
            self.vocab = embed_src.shape[0]
            self.vocab_rows = padded_vocab(self.vocab, n) // n
            self.vocab_start = r * self.vocab_rows
            self.embed = c.one(self.embed, vocab_shard(embed_src.detach(), n, r))
            self.lm_head = self.embed if head.weight is embed_src else c.one(self.lm_head, vocab_shard(head.weight.detach(), n, r))
            if lay.positions:
                self.positions = c.one(self.positions, extra[lay.positions].weight.detach())
            for name in ("project_in", "project_out"):
                sub = extra.get(getattr(lay, name))
                setattr(self, name, c.one(getattr(self, name), _param(sub, "weight") if sub is not None else None))
            final = extra.get(lay.final_norm) if spec.final_norm else None
            self.final_norm_w = c.one(self.final_norm_w, _param(final, "weight") if final is not None else None)
            self.final_norm_b = c.one(self.final_norm_b, _param(final, "bias") if final is not None else None)
        blocks = list(_get(body, lay.layers))
        old, layers = self.layers, []
        for start in range(0, len(blocks), max(1, layers_per_gather)):
            chunk = blocks[start:start + max(1, layers_per_gather)]
            with gather(chunk):
                layers += [self._layer(c, block, old[start + j] if old else None) for j, block in enumerate(chunk)]
        self.layers = layers
        if allocate:
            self.allocations += 1

    def _qkv_part(self, parts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        spec = self.spec
        return _shard_blocks(parts, (spec.q_rows, spec.kv_rows, spec.kv_rows), self.size, self.index, spec.num_kv_heads)

    def _up_part(self, parts: list[torch.Tensor | None], weights: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        width = sum(p.shape[0] for p in weights) // (2 if self.spec.layout.gated else 1)
        return _shard_blocks(parts, (width, width) if self.spec.layout.gated else (width,), self.size, self.index)

    def _input_part(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        return shard_columns(weight, self.size, self.index)


class ShardedDecodeModel(DecodeModel):
    """One member's decode forward: its heads, its MLP share, its vocabulary rows; the row-parallel
    sums and the embedding lookup go through ``group``. :meth:`prefill` and :meth:`step` return this
    member's (B, Vs) logits, padding columns at ``-inf``."""

    def __init__(self, config: Any, group: Collectives) -> None:
        super().__init__(config)
        reason = tp_unsupported_reason(config, group.size)
        if reason is not None:
            raise ValueError(reason)
        self.group = group
        self.full_spec = self.spec
        n = group.size
        # The forward and the KV cache see this member's heads only.
        self.spec = replace(self.spec, num_heads=self.spec.num_heads // n,
                            num_kv_heads=kv_heads_per_member(self.spec.num_kv_heads, n))
        self.weights = ShardedInferenceWeights(self.full_spec, n, group.index)

    def _row_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = self._linear(x, w, None)  # this member's partial product
        self.group.all_reduce_sum_(y)
        return y if b is None else y + b

    def _token_embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weights
        local = tokens - w.vocab_start
        inside = (local >= 0) & (local < w.vocab_rows)  # (B, T) ids held here
        x = F.embedding(local.clamp(0, w.vocab_rows - 1), w.embed).masked_fill(~inside[..., None], 0)
        self.group.all_reduce_sum_(x)  # exactly one member contributes each row
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super()._logits(x)  # (B, Vs)
        w = self.weights
        padding = w.vocab_start + w.vocab_rows - w.vocab
        if padding > 0:  # rows past the vocabulary (zeros): never drawn
            logits[:, max(0, w.vocab_rows - padding):] = -float("inf")
        return logits
