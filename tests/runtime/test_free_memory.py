"""free_memory_bytes: on a GPU the caching allocator's unused blocks count as free, so the ZeRO-3
gather decisions (fits_gathered) do not depend on whether the cache was emptied."""
from __future__ import annotations

import torch

from dschat.runtime.zero3 import free_memory_bytes

GIB = 1 << 30


def test_cached_but_unused_blocks_count_as_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 24 * GIB)
    assert free_memory_bytes(torch.device("cuda", 0)) == 16 * GIB
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 24 * GIB)  # the cache emptied
    assert free_memory_bytes(torch.device("cuda", 0)) == 10 * GIB

