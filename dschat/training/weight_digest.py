"""The weight digest: data-parallel ranks must end with identical weights.

Environment variables read here:

* ``DSCHAT_WEIGHT_DIGEST_DIR``: when set, every rank writes ``<tag>-rank<r>.sha256`` into that
  folder at the end of training: the SHA-256 of its full (ZeRO-3: gathered) parameters, names,
  shapes and dtypes included. Data-parallel ranks must end with identical weights; the 2-rank
  tests compare these files.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from dschat.runtime.fs import atomic_file
from dschat.runtime.zero3 import gathered_parameters


WEIGHT_DIGEST_ENV = "DSCHAT_WEIGHT_DIGEST_DIR"


def parameter_digest(model: Any) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes, in ``named_parameters`` order.

    Collective under ZeRO-3 (each parameter is gathered in turn): every rank must call it.
    """
    digest = hashlib.sha256()
    for name, param in gathered_parameters(model):
        tensor = param.to("cpu").contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_weight_digest(model: Any, tag: str) -> str | None:
    """If ``$DSCHAT_WEIGHT_DIGEST_DIR`` is set, write this rank's :func:`parameter_digest` to
    ``<dir>/<tag>-rank<r>.sha256`` and return it (collective: call on every rank)."""
    folder = os.environ.get(WEIGHT_DIGEST_ENV)
    if not folder:
        return None
    digest = parameter_digest(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    Path(folder).mkdir(parents=True, exist_ok=True)
    with atomic_file(Path(folder) / f"{tag}-rank{rank}.sha256") as tmp:
        tmp.write_text(digest + "\n", encoding="utf-8")
    return digest
