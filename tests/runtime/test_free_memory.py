"""free_memory_bytes: on a GPU the caching allocator's unused blocks are returned before the driver is
asked, so the ZeRO-3 gather decisions (fits_gathered) do not depend on whether the cache was emptied."""
from __future__ import annotations

import torch

from dschat.runtime.zero3 import free_memory_bytes

GIB = 1 << 30


def test_the_cache_is_emptied_before_the_driver_is_asked(monkeypatch):
    state = {"cached": 6 * GIB, "free": 10 * GIB}
    calls = []

    def empty_cache():
        calls.append("empty_cache")
        state["free"], state["cached"] = state["free"] + state["cached"], 0

    def mem_get_info(device=None):
        calls.append("mem_get_info")
        return state["free"], 80 * GIB

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert free_memory_bytes(torch.device("cuda", 0)) == 16 * GIB
    assert calls == ["empty_cache", "mem_get_info"]
