"""The decode model's weights in an inference layout, refreshed in place from a training module.

Per layer: the q, k and v projections as one ``(q_rows + 2 kv_rows, hidden)`` matrix, gate and up as
one ``(2 I, hidden)`` matrix (gated MLPs), every tensor contiguous, in one dtype, owned here (no
DeepSpeed hooks, no LoRA branches). :meth:`InferenceWeights.refresh` copies a module's current
weights into the same buffers every time, so anything that holds their addresses (a compiled
decode step, a captured CUDA graph) stays valid. The module's weights must be materialised while
it runs (ZeRO-3: inside the gather; LoRA: fused).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator

import torch
from torch import nn

from dschat.models.decoder.layouts import DecoderSpec

__all__ = ["LayerWeights", "InferenceWeights"]


@dataclass
class LayerWeights:
    """One decoder layer. Shapes: hidden ``E``, ``Q = heads x head_dim``, ``K = kv_heads x head_dim``,
    MLP width ``I``; ``None`` where the family has no such tensor."""

    attn_norm_w: torch.Tensor  # (E,)
    attn_norm_b: torch.Tensor | None  # (E,) LayerNorm families
    qkv_w: torch.Tensor  # (Q + 2K, E) rows: q, then k, then v
    qkv_b: torch.Tensor | None  # (Q + 2K,)
    o_w: torch.Tensor  # (E, Q)
    o_b: torch.Tensor | None  # (E,)
    mlp_norm_w: torch.Tensor  # (E,)
    mlp_norm_b: torch.Tensor | None
    up_w: torch.Tensor  # (2I, E) rows: gate, then up (gated); (I, E) otherwise
    up_b: torch.Tensor | None
    down_w: torch.Tensor  # (E, I)
    down_b: torch.Tensor | None
    q_norm_w: torch.Tensor | None = None  # (head_dim,) Qwen3
    k_norm_w: torch.Tensor | None = None

    def tensors(self) -> Iterator[torch.Tensor]:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield value


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def _param(module: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    return value.detach() if isinstance(value, torch.Tensor) else None


class _Copier:
    """Allocates a buffer on the first pass (``allocate``) or copies into the existing one."""

    def __init__(self, dtype: torch.dtype, device: torch.device, allocate: bool) -> None:
        self.dtype, self.device, self.allocate = dtype, device, allocate

    def one(self, dst: torch.Tensor | None, src: torch.Tensor | None) -> torch.Tensor | None:
        if src is None:
            return None
        if self.allocate:
            return src.to(device=self.device, dtype=self.dtype, copy=True).contiguous()
        dst.copy_(src)
        return dst

    def rows(self, dst: torch.Tensor | None, parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        """``parts`` stacked along dim 0 into one buffer (fused projections)."""
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ValueError("a fused projection has a bias on some of its parts only")
        if self.allocate:
            dst = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=self.dtype,
                              device=self.device)
        start = 0
        for p in parts:
            dst[start:start + p.shape[0]].copy_(p)
            start += p.shape[0]
        return dst


def _neox_qkv(t: torch.Tensor | None, spec: DecoderSpec) -> torch.Tensor | None:
    """GPT-NeoX's ``query_key_value`` rows are (H, 3, D) per head: reorder to (3, H, D) = q; k; v."""
    if t is None:
        return None
    H, D = spec.num_heads, spec.head_dim
    return t.reshape(H, 3, D, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class InferenceWeights:
    """Every weight of the decode model; see the module docstring."""

    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec
        self.layers: list[LayerWeights] = []
        self.embed: torch.Tensor | None = None  # (V, E_in) E_in = word_embed_proj_dim for OPT
        self.positions: torch.Tensor | None = None  # (max_positions + 2, E) OPT
        self.project_in: torch.Tensor | None = None  # (E, E_in) OPT-350m
        self.project_out: torch.Tensor | None = None  # (E_in, E)
        self.final_norm_w: torch.Tensor | None = None
        self.final_norm_b: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None  # (V, E_in); the embedding itself when tied
        self.allocations = 0  # times the buffers were (re)allocated: refreshes after the first must not add any

    @property
    def allocated(self) -> bool:
        return self.embed is not None

    def tensors(self) -> Iterator[torch.Tensor]:
        for t in (self.embed, self.positions, self.project_in, self.project_out, self.final_norm_w,
                  self.final_norm_b, self.lm_head):
            if t is not None:
                yield t
        for layer in self.layers:
            yield from layer.tensors()

    def nbytes(self) -> int:
        seen = {id(t): t.numel() * t.element_size() for t in self.tensors()}
        return sum(seen.values())

    def release(self) -> None:
        """Drop every buffer (``--release_inference_cache``); the next refresh allocates again."""
        self.layers = []
        self.embed = self.positions = self.project_in = self.project_out = None
        self.final_norm_w = self.final_norm_b = self.lm_head = None

    @torch.no_grad()
    def refresh(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        """Copy ``model``'s current weights into the buffers (allocating them the first time)."""
        allocate = not self.allocated
        if not allocate and (self.embed.dtype != dtype or self.embed.device != device):
            self.release()
            allocate = True
        c = _Copier(dtype, device, allocate)
        spec, lay = self.spec, self.spec.layout
        body = _get(model, lay.body)
        embed_src = _get(body, lay.embed).weight
        self.embed = c.one(self.embed, embed_src.detach())
        if lay.positions:
            self.positions = c.one(self.positions, _get(body, lay.positions).weight.detach())
        for name in ("project_in", "project_out"):
            path = getattr(lay, name)
            sub = getattr(body, path, None) if path else None
            setattr(self, name, c.one(getattr(self, name), _param(sub, "weight") if sub is not None else None))
        final = getattr(body, lay.final_norm, None) if spec.final_norm else None
        self.final_norm_w = c.one(self.final_norm_w, _param(final, "weight") if final is not None else None)
        self.final_norm_b = c.one(self.final_norm_b, _param(final, "bias") if final is not None else None)
        head_src = _get(model, lay.lm_head).weight
        if head_src is embed_src:  # tied: one buffer
            self.lm_head = self.embed
        else:
            self.lm_head = c.one(self.lm_head, head_src.detach())
        stack = _get(body, lay.layers)
        old = self.layers
        self.layers = [self._layer(c, block, old[i] if old else None) for i, block in enumerate(stack)]
        if allocate:
            self.allocations += 1

    def _layer(self, c: _Copier, block: nn.Module, old: LayerWeights | None) -> LayerWeights:
        spec, lay = self.spec, self.spec.layout
        attn_norm, mlp_norm = _get(block, lay.attn_norm), _get(block, lay.mlp_norm)
        qkv = [_get(block, p) for p in lay.qkv]
        up = [_get(block, p) for p in lay.up]
        o, down = _get(block, lay.o), _get(block, lay.down)
        qkv_w = [_param(m, "weight") for m in qkv]
        qkv_b = [_param(m, "bias") for m in qkv]
        if lay.qkv_interleaved:
            qkv_w, qkv_b = [_neox_qkv(qkv_w[0], spec)], [_neox_qkv(qkv_b[0], spec)]
        up_w = [_param(m, "weight") for m in up]
        up_b = [_param(m, "bias") for m in up]
        q_norm = _param(_get(block, lay.q_norm), "weight") if lay.q_norm else None
        k_norm = _param(_get(block, lay.k_norm), "weight") if lay.k_norm else None
        keep = old if old is not None else LayerWeights(*([None] * 12))
        return LayerWeights(
            attn_norm_w=c.one(keep.attn_norm_w, _param(attn_norm, "weight")),
            attn_norm_b=c.one(keep.attn_norm_b, _param(attn_norm, "bias")),
            qkv_w=c.rows(keep.qkv_w, self._qkv_part(qkv_w)), qkv_b=c.rows(keep.qkv_b, self._qkv_part(qkv_b)),
            o_w=c.one(keep.o_w, self._input_part(_param(o, "weight"))), o_b=c.one(keep.o_b, _param(o, "bias")),
            mlp_norm_w=c.one(keep.mlp_norm_w, _param(mlp_norm, "weight")),
            mlp_norm_b=c.one(keep.mlp_norm_b, _param(mlp_norm, "bias")),
            up_w=c.rows(keep.up_w, self._up_part(up_w, up_w)), up_b=c.rows(keep.up_b, self._up_part(up_b, up_w)),
            down_w=c.one(keep.down_w, self._input_part(_param(down, "weight"))),
            down_b=c.one(keep.down_b, _param(down, "bias")),
            q_norm_w=c.one(keep.q_norm_w, q_norm), k_norm_w=c.one(keep.k_norm_w, k_norm),
        )

    # The part of each projection this object keeps: the whole of it here; a tensor-parallel member
    # (models/decoder/tensor_parallel.py) keeps its rows of q/k/v and gate/up, its columns of o/down.
    def _qkv_part(self, parts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return parts

    def _up_part(self, parts: list[torch.Tensor | None], weights: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return parts

    def _input_part(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        return weight
