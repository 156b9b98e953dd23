"""Moving batches between devices."""
from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor of a (nested) batch to ``device``; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(item, device) for item in batch)
    return batch
