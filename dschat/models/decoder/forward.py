"""dschat's decode forward: a prefill pass over the prompt and a one-token decode step.

Plain PyTorch over explicit tensors (:class:`~dschat.models.decoder.weights.InferenceWeights`, a
:class:`~dschat.models.decoder.kv_cache.StaticKVCache`), shapes in the comments: ``B`` rows, ``P``
prompt columns, ``S`` cache capacity, ``E`` hidden size, ``H`` / ``Hkv`` query / key-value heads,
``D`` head size, ``V`` vocabulary. Attention is SDPA with a boolean mask (left padding, causality,
sliding windows) and GQA. The decode step has static shapes and no data-dependent Python control
flow, so on CUDA it can be compiled with CUDA graphs; its write position is a tensor. On a CPU the
step runs eagerly, attends only to the filled part of the cache (``kv_len``), and its B-row linears
can run with oneDNN on weights packed once per rollout (``packed``), as dschat's CPU loop does.

Each operation follows the family's Hugging Face forward (norms in fp32 where it computes them so,
OPT's pre-scaled queries, GPT-NeoX's parallel residual, Gemma's scaled embeddings), so an fp32
rollout gives the training forward's tokens and log-probs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from dschat.models.decoder.kv_cache import StaticKVCache
from dschat.models.decoder.layouts import DecoderSpec, decoder_spec
from dschat.models.decoder.rope import apply_rope, inverse_frequencies, rope_cos_sin
from dschat.models.decoder.weights import InferenceWeights, LayerWeights

__all__ = ["DecodeModel"]


class DecodeModel:
    """The decode forward of one model family over :class:`InferenceWeights`."""

    def __init__(self, config: Any) -> None:
        self.spec: DecoderSpec = decoder_spec(config)
        self.weights = InferenceWeights(self.spec)
        self.act = ACT2FN[self.spec.act]
        self.inv_freq: torch.Tensor | None = None
        self.rope_scaling = 1.0
        if self.spec.rotary_dim:
            self.inv_freq, self.rope_scaling = inverse_frequencies(config)  # (rotary_dim / 2,) fp32
        self.embed_scale = float(config.hidden_size) ** 0.5 if self.spec.layout.embed_scale else None
        self.packed: dict[int, torch.Tensor] = {}  # id(weight) -> oneDNN-packed copy for B-row inputs
        self.packed_rows = 0

    # ------------------------------------------------------------------ pieces
    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        packed = self.packed.get(id(w)) if self.packed else None
        if packed is not None and x.numel() == self.packed_rows * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        return F.linear(x, w, b)

    def _row_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The attention output and MLP down projections. One rank: :meth:`_linear`; a tensor-parallel
        shard (:class:`~dschat.models.decoder.tensor_parallel.ShardedDecodeModel`) sums partial products."""
        return self._linear(x, w, b)

    def _token_embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, E_in); a tensor-parallel shard looks up its vocabulary rows only."""
        return F.embedding(tokens, self.weights.embed)

    def _norm(self, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        kind, eps = self.spec.layout.norm, self.spec.norm_eps
        if kind == "layer":
            return F.layer_norm(x, (x.shape[-1],), w, b, eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if kind == "rms_plus_one":  # Gemma: (1 + w) in fp32, then the dtype
            return (h * (1.0 + w.float())).type_as(x)
        return w * h.to(x.dtype)  # Llama & co.: normalised in fp32, scaled in the dtype

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) ids and positions -> (B, T, E)."""
        w = self.weights
        x = self._token_embedding(tokens)  # (B, T, E_in)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if w.project_in is not None:
            x = F.linear(x, w.project_in)  # (B, T, E)
        if w.positions is not None:  # OPT's learned positions, offset by 2
            x = x + F.embedding(positions + 2, w.positions)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, E) last hidden states -> (B, V) logits in the weights' dtype."""
        w = self.weights
        if self.spec.final_norm:  # a LayerNorm without elementwise affine has neither weight nor bias
            x = self._norm(x, w.final_norm_w, w.final_norm_b)
        if w.project_out is not None:
            x = F.linear(x, w.project_out)
        return self._linear(x, w.lm_head, None)

    def _attention(self, i: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   cache: StaticKVCache, mask: torch.Tensor, index: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        """(B, T, E) normed input -> (B, T, E). Prefill (``index`` None) writes the T keys/values at
        columns [kv_len - T, kv_len) and attends to [0, kv_len); a step writes column ``index`` and
        attends to [0, kv_len)."""
        spec = self.spec
        B, T, _ = h.shape
        H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qkv = self._linear(h, lw.qkv_w, lw.qkv_b)  # (B, T, H*D + 2*Hkv*D)
        q, k, v = qkv.split((spec.q_rows, spec.kv_rows, spec.kv_rows), dim=-1)
        scale = spec.attn_scale
        if spec.layout.scale_q_before_attention:  # OPT: q_proj(x) * scaling, then attention unscaled
            q, scale = q * spec.attn_scale, 1.0
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if lw.q_norm_w is not None:  # Qwen3: RMSNorm over D before RoPE
            q, k = self._norm(q, lw.q_norm_w, None), self._norm(k, lw.k_norm_w, None)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|Hkv, T, D)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if index is None:
            cache.keys[i][:, :, kv_len - T:kv_len] = k
            cache.values[i][:, :, kv_len - T:kv_len] = v
            if kv_len > T:  # a continued conversation: the kept columns before these
                k, v = cache.keys[i][:, :, :kv_len], cache.values[i][:, :, :kv_len]  # (B, Hkv, L, D)
        else:
            cache.keys[i].index_copy_(2, index, k)
            cache.values[i].index_copy_(2, index, v)
            k, v = cache.keys[i][:, :, :kv_len], cache.values[i][:, :, :kv_len]  # (B, Hkv, L, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=spec.grouped_kv)  # (B, H, T, D)
        return self._row_linear(out.transpose(1, 2).reshape(B, T, spec.q_rows), lw.o_w, lw.o_b)

    def _mlp(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        up = self._linear(h, lw.up_w, lw.up_b)  # (B, T, 2I) gated, (B, T, I) plain
        if self.spec.layout.gated:
            gate, up = up.chunk(2, dim=-1)
            return self._row_linear(self.act(gate) * up, lw.down_w, lw.down_b)
        return self._row_linear(self.act(up), lw.down_w, lw.down_b)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: StaticKVCache,
                masks: list[torch.Tensor], index: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        spec = self.spec
        for i, lw in enumerate(self.weights.layers):
            mask = masks[i]
            if spec.post_norm:  # OPT-350m: attention and MLP on the raw stream, norms after the residuals
                x = self._norm(x + self._attention(i, lw, x, cos, sin, cache, mask, index, kv_len),
                               lw.attn_norm_w, lw.attn_norm_b)
                x = self._norm(x + self._mlp(lw, x), lw.mlp_norm_w, lw.mlp_norm_b)
                continue
            attn = self._attention(i, lw, self._norm(x, lw.attn_norm_w, lw.attn_norm_b), cos, sin, cache, mask,
                                   index, kv_len)
            if spec.parallel_residual:  # GPT-NeoX: mlp(ln2(x)) + attn(ln1(x)) + x
                x = self._mlp(lw, self._norm(x, lw.mlp_norm_w, lw.mlp_norm_b)) + attn + x
            else:
                x = x + attn
                x = x + self._mlp(lw, self._norm(x, lw.mlp_norm_w, lw.mlp_norm_b))
        return x

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.inv_freq is None:
            return None, None
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return rope_cos_sin(self.inv_freq, self.rope_scaling, positions, dtype)  # (B, 1, T, rot) each

    def _window_masks(self, allowed: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, ``allowed`` (B, 1, Tq, L) narrowed to the layer's sliding window (keys with
        ``k > q - window``, the Hugging Face rule; indices are cache columns)."""
        out, by_window = [], {}
        for window in self.spec.sliding_windows:
            if window not in by_window:
                by_window[window] = allowed if window is None else allowed & (k_index > q_index - window)
            out.append(by_window[window])
        return out

    # ------------------------------------------------------------------ the two passes
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                start: int = 0) -> torch.Tensor:
        """(B, P) left-padded prompt ids and positions -> (B, V) logits of the last column; fills the
        cache's columns [start, start + P), attending to the ``start`` columns before them as well
        (a continued conversation; 0: a new prompt). ``cache.start(mask)`` must have been called,
        with the mask of all ``start + P`` columns."""
        B, P = tokens.shape
        x = self._embed(tokens, positions)  # (B, P, E)
        cos, sin = self._rope(positions, x.dtype)
        q_index = torch.arange(start, start + P, device=tokens.device)[:, None]  # (P, 1)
        k_index = torch.arange(start + P, device=tokens.device)[None, :]  # (1, L), L = start + P
        valid = cache.key_valid[:, None, None, :start + P]  # (B, 1, 1, L)
        # A padding query sees itself (the diagonal), so its softmax has a term and no NaN reaches the cache.
        allowed = ((k_index <= q_index) & valid) | (k_index == q_index)  # (B, 1, P, L)
        x = self._layers(x, cos, sin, cache, self._window_masks(allowed, q_index, k_index), None, start + P)
        return self._logits(x[:, -1])

    def step(self, token: torch.Tensor, position: torch.Tensor, index: torch.Tensor, cache: StaticKVCache,
             kv_len: int) -> torch.Tensor:
        """One decode step: (B,) tokens at (B,) positions, written at cache column ``index`` (a (1,)
        long tensor) -> (B, V) logits. Attends to columns [0, kv_len): ``cache.capacity`` for a static
        shape (compiled), ``index + 1`` eagerly."""
        cache.key_valid.index_fill_(1, index, True)
        x = self._embed(token[:, None], position[:, None])  # (B, 1, E)
        cos, sin = self._rope(position[:, None], x.dtype)
        k_index = torch.arange(kv_len, device=token.device)[None, :]  # (1, L)
        allowed = cache.key_valid[:, None, None, :kv_len]  # (B, 1, 1, L); columns after index are still False
        x = self._layers(x, cos, sin, cache, self._window_masks(allowed, index[:, None], k_index), index, kv_len)
        return self._logits(x[:, -1])

    # ------------------------------------------------------------------ CPU decode kernels
    def pack_for_cpu(self, rows: int) -> None:
        """oneDNN-packed copies of every matrix the decode step multiplies by ``rows``-row inputs
        (taken after each refresh: they are copies, not the buffers)."""
        w = self.weights
        mats = [w.lm_head] + [t for lw in w.layers for t in (lw.qkv_w, lw.o_w, lw.up_w, lw.down_w)]
        self.packed = {id(t): torch.ops.mkldnn._reorder_linear_weight(t, rows) for t in mats}
        self.packed_rows = rows

    def unpack(self) -> None:
        self.packed, self.packed_rows = {}, 0
