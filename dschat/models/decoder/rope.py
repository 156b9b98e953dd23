"""Rotary position embedding tables, computed with transformers' own functions.

The inverse frequencies come from the family's rotary class (``compute_default_rope_parameters``)
for ``rope_type == "default"`` and from ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
otherwise (linear, llama3, yarn, ...), so every variant, partial rotary included, is the one the
training forward uses. cos/sin are then looked up per position, as the family's rotary module does.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

__all__ = ["inverse_frequencies", "rope_cos_sin", "apply_rope"]


def _default_rope_fn(config: Any) -> Any:
    """The family's ``*RotaryEmbedding.compute_default_rope_parameters`` (GPT-NeoX and Phi-3 apply
    ``partial_rotary_factor`` there, Llama does not)."""
    modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    for name, cls in vars(modeling).items():
        if name.endswith("RotaryEmbedding") and hasattr(cls, "compute_default_rope_parameters"):
            return cls.compute_default_rope_parameters
    raise ValueError(f"transformers has no rotary embedding class for {config.model_type!r}")


def inverse_frequencies(config: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq (rotary_dim / 2,) fp32, attention_scaling)`` for ``config``, on the CPU."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    fn = _default_rope_fn(config) if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = fn(config, device=torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rope_cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``positions`` (B, T) -> two (B, 1, T, rotary_dim) tensors in ``dtype``: the
    formula of the families' rotary modules (fp32 angles, ``cat(freqs, freqs)``, times the scaling)."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, rotary_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, rotary_dim)
    cos = (emb.cos() * scaling).to(dtype)
    sin = (emb.sin() * scaling).to(dtype)
    return cos[:, None], sin[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` dims of each head of ``x`` (B, H, T, D); the rest pass
    through (partial rotary, GPT-NeoX / Phi)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
