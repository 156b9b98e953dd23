"""Model-family quirks in one table, looked up by ``config.model_type``.

Upstream scatters these as ``if "llama" in path`` / ``if "opt" in path`` checks through the code.
Here every per-family choice lives in :data:`FAMILIES`; unknown families get :data:`GENERIC`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    # Substring that selects the decoder blocks' Linear layers for LoRA.
    lora_module_name: str
    # Config attribute holding the width the value head reads (OPT projects to word_embed_proj_dim).
    value_head_dim_attr: str = "hidden_size"
    # Whether DeepSpeed's Hybrid Engine has an inference container for this family (CUDA only).
    hybrid_engine_container: bool = False
    # Number of pad-id tokens the tokenizer puts at the start of every text: OPT's BOS is also
    # its pad after upstream's ``pad = eos`` (docs/upstream.md#step-2-reward-model), which is what
    # --num_padding_at_beginning counts. Used only for upstream's pad-based end rule when no attention mask is given.
    num_padding_at_beginning: int = 0
    # Final layer norm that upstream resets before reward training (BLOOM's).
    reset_final_norm_for_reward: str | None = None
    # How packed rows (--sequence_packing, models/packing.py) are kept apart: "positions" (the family's
    # mask builder reads packed position ids), "mask" (it is given the block-diagonal mask) or None
    # (padded layout: positions from the mask, such as ALiBi, or not checked).
    sequence_packing: str | None = "positions"


FAMILIES: dict[str, Family] = {
    "opt": Family("opt", "decoder.layers.", "word_embed_proj_dim", True, 1, sequence_packing="mask"),
    "llama": Family("llama", "layers.", hybrid_engine_container=True),
    "mistral": Family("mistral", "layers."),
    "qwen2": Family("qwen2", "layers."),
    "qwen3": Family("qwen3", "layers."),
    "gemma": Family("gemma", "layers."),
    "phi3": Family("phi3", "layers."),
    "bloom": Family("bloom", "h.", hybrid_engine_container=True, reset_final_norm_for_reward="ln_f",
                    sequence_packing=None),
    "gpt2": Family("gpt2", "h.", "n_embd"),
    "gpt_neox": Family("gpt_neox", "layers.", hybrid_engine_container=True),
    "gptj": Family("gptj", "h.", "n_embd", hybrid_engine_container=True),
    "gpt_neo": Family("gpt_neo", "h.", hybrid_engine_container=True),
    "internlm": Family("internlm", "layers.", hybrid_engine_container=True, sequence_packing=None),
}

GENERIC = Family("generic", "layers.", sequence_packing=None)


def family_of(config_or_model: Any) -> Family:
    """The :class:`Family` for a config, an HF model, or anything with ``.config``."""
    config = getattr(config_or_model, "config", config_or_model)
    return FAMILIES.get(getattr(config, "model_type", ""), GENERIC)


def value_head_dim(config: Any) -> int:
    """Width of the hidden states the reward model's value head reads."""
    fam = family_of(config)
    for attr in (fam.value_head_dim_attr, "hidden_size", "n_embd", "d_model"):
        value = getattr(config, attr, None)
        if value:
            return int(value)
    raise ValueError(f"cannot find the hidden size of a {getattr(config, 'model_type', '?')} config")


#: ``model_type`` of the families whose position embedding is a table of ``max_position_embeddings``
#: rows that transformers' modeling code indexes by position (learned: OPT, GPT-2, GPT-Neo,
#: GPTBigCode, BioGPT, GPT-1; CTRL's fixed sinusoid table; GPT-J's and CodeGen's rotary sin/cos
#: table): a longer sequence is an ``IndexError``. Rotary families that compute their sin/cos from
#: the positions (Llama, Qwen, GPT-NeoX, ...) and ALiBi (BLOOM) run longer sequences, so they are
#: not refused.
POSITION_TABLE_MODEL_TYPES: frozenset[str] = frozenset(
    {"opt", "gpt2", "gpt_neo", "gpt_bigcode", "biogpt", "openai-gpt", "ctrl", "gptj", "codegen"})
