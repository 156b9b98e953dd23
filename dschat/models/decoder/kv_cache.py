"""A static KV cache: one preallocated (B, kv_heads, S, head_dim) key and value tensor per layer.

Its shape is fixed for a batch size and a capacity ``S`` (prompt width + answer length, rounded up),
so a compiled decode step sees the same tensors every step and every rollout; a new prompt width
reuses it as long as it fits. ``key_valid`` (B, S) marks the columns a query may attend to: the
prompt's non-padding tokens, then each generated token as it is written. A multi-turn conversation
continues it: its kept columns come first, holes (columns no query may see) included, and a cache
it outgrows is replaced by a larger one that keeps them (:meth:`StaticKVCache.keep_columns`).
"""
from __future__ import annotations

import torch

from dschat.models.decoder.layouts import DecoderSpec

__all__ = ["StaticKVCache"]


class StaticKVCache:
    """Keys, values and the key mask of one rollout batch; see the module docstring."""

    def __init__(self, spec: DecoderSpec, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.key_valid = torch.zeros((batch, capacity), dtype=torch.bool, device=device)  # (B, S)
        self.batch, self.capacity, self.dtype, self.device = batch, capacity, dtype, device

    def fits(self, batch: int, length: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (batch, dtype, device) == (self.batch, self.dtype, self.device) and length <= self.capacity

    def keep_columns(self, other: StaticKVCache, columns: int) -> None:
        """Copy ``other``'s keys and values of its first ``columns`` columns (the same batch, a
        capacity of at least ``columns``); the mask is set by :meth:`start`."""
        for mine, theirs in zip([*self.keys, *self.values], [*other.keys, *other.values]):
            mine[:, :, :columns] = theirs[:, :, :columns]

    def start(self, prompt_mask: torch.Tensor) -> None:
        """A new rollout: the prompt's (B, P) mask in the first P columns, nothing after (for a
        continued conversation, P covers its kept columns and the new ones)."""
        P = prompt_mask.shape[1]
        self.key_valid.zero_()
        self.key_valid[:, :P] = prompt_mask.bool()

    def nbytes(self) -> int:
        per = self.keys[0].numel() * self.keys[0].element_size()
        return 2 * per * len(self.keys) + self.key_valid.numel()

    @staticmethod
    def capacity_for(length: int, multiple: int = 64) -> int:
        """``length`` rounded up to a multiple, so nearby prompt widths share one cache (and graph)."""
        return -(-length // multiple) * multiple
