"""Where each family keeps its decoder weights, and what its forward does differently: one table.

:data:`LAYOUTS` maps a Hugging Face ``config.model_type`` to a :class:`FamilyLayout` -- module paths
inside the ``*ForCausalLM`` model and the switches of the decode forward (norm kind, gated MLP,
parallel residual, learned positions, q/k-norm, ...). :func:`decoder_spec` reads the sizes from the
config and returns a :class:`DecoderSpec`, or :func:`unsupported_reason` says in one line why a model
keeps the module path. STYLE habit 7: no ``if "llama" in name`` anywhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["FamilyLayout", "LAYOUTS", "DecoderSpec", "decoder_spec", "unsupported_reason", "layout_name"]

_LLAMA_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class FamilyLayout:
    """Module paths (relative to the causal-LM model; per-layer paths relative to one layer) and
    forward switches of one model family."""

    body: str  # the decoder stack's parent module
    embed: str  # token embedding, under ``body``
    final_norm: str | None  # under ``body``
    lm_head: str  # under the causal-LM model
    attn_norm: str
    mlp_norm: str
    qkv: tuple[str, ...]  # concatenated in this order into one (q; k; v) projection
    o: str
    up: tuple[str, ...]  # gated: (gate, up) or one fused gate_up; plain: (fc1,)
    down: str
    act_attr: str  # config attribute naming the activation (``transformers.activations.ACT2FN``)
    layers: str = "layers"  # under ``body``
    norm: str = "rms"  # "rms" | "rms_plus_one" (Gemma: weight stored as w - 1) | "layer"
    gated: bool = True  # MLP is down(act(gate(x)) * up(x))
    qkv_interleaved: bool = False  # GPT-NeoX: one (H, 3, D) block per head, reordered to (3, H, D)
    q_norm: str | None = None  # Qwen3: RMSNorm over head_dim of q and k before RoPE
    k_norm: str | None = None
    rope: bool = True
    positions: str | None = None  # OPT: learned position embedding (index = position + 2), under ``body``
    project_in: str | None = None  # OPT-350m: word_embed_proj_dim -> hidden, under ``body``
    project_out: str | None = None
    parallel_residual_attr: str | None = None  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    post_norm_attr: str | None = None  # OPT: ``do_layer_norm_before`` False (350m) -> norms after residuals
    scale_q_before_attention: bool = False  # OPT: q_proj(x) * scaling, attention with scale 1 (its rounding)
    embed_scale: bool = False  # Gemma: embeddings * sqrt(hidden), rounded to the dtype


LAYOUTS: dict[str, FamilyLayout] = {
    "llama": FamilyLayout("model", "embed_tokens", "norm", "lm_head", "input_layernorm", "post_attention_layernorm",
                          _LLAMA_QKV, "self_attn.o_proj", _LLAMA_GATE_UP, "mlp.down_proj", "hidden_act"),
    "mistral": FamilyLayout("model", "embed_tokens", "norm", "lm_head", "input_layernorm", "post_attention_layernorm",
                            _LLAMA_QKV, "self_attn.o_proj", _LLAMA_GATE_UP, "mlp.down_proj", "hidden_act"),
    "qwen2": FamilyLayout("model", "embed_tokens", "norm", "lm_head", "input_layernorm", "post_attention_layernorm",
                          _LLAMA_QKV, "self_attn.o_proj", _LLAMA_GATE_UP, "mlp.down_proj", "hidden_act"),
    "qwen3": FamilyLayout("model", "embed_tokens", "norm", "lm_head", "input_layernorm", "post_attention_layernorm",
                          _LLAMA_QKV, "self_attn.o_proj", _LLAMA_GATE_UP, "mlp.down_proj", "hidden_act",
                          q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    "gemma": FamilyLayout("model", "embed_tokens", "norm", "lm_head", "input_layernorm", "post_attention_layernorm",
                          _LLAMA_QKV, "self_attn.o_proj", _LLAMA_GATE_UP, "mlp.down_proj", "hidden_act",
                          norm="rms_plus_one", embed_scale=True),
    "phi3": FamilyLayout("model", "embed_tokens", "norm", "lm_head", "input_layernorm", "post_attention_layernorm",
                         ("self_attn.qkv_proj",), "self_attn.o_proj", ("mlp.gate_up_proj",), "mlp.down_proj",
                         "hidden_act"),
    "opt": FamilyLayout("model.decoder", "embed_tokens", "final_layer_norm", "lm_head", "self_attn_layer_norm",
                        "final_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                        "self_attn.out_proj", ("fc1",), "fc2", "activation_function", norm="layer", gated=False,
                        rope=False, positions="embed_positions", project_in="project_in", project_out="project_out",
                        post_norm_attr="do_layer_norm_before", scale_q_before_attention=True),
    "gpt_neox": FamilyLayout("gpt_neox", "embed_in", "final_layer_norm", "lm_head", "input_layernorm",
                             "post_attention_layernorm", ("attention.query_key_value",), "attention.dense",
                             ("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h", "hidden_act", norm="layer", gated=False,
                             qkv_interleaved=True, parallel_residual_attr="use_parallel_residual"),
}

# RoPE types whose frequencies are fixed for a model (computed once with transformers' own
# ROPE_INIT_FUNCTIONS); "dynamic" and "longrope" change them with the sequence length.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class DecoderSpec:
    """The sizes and switches the decode forward needs, read once from a config."""

    family: str
    layout: FamilyLayout
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that RoPE rotates (GPT-NeoX, Phi: partial); 0 without RoPE
    norm_eps: float
    act: str
    attn_scale: float
    sliding_windows: tuple[int | None, ...]  # per layer: keys within this many positions, or all
    parallel_residual: bool
    post_norm: bool
    final_norm: bool  # OPT with _remove_final_layer_norm has none
    # Fewer key-value heads than query heads (attention's enable_gqa). A field, not a property of the
    # two counts: when a second engine's model recompiles the decode step, Dynamo makes the changed
    # counts dynamic, and a comparison of them would be a SymBool, which SDPA refuses.
    grouped_kv: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grouped_kv", self.num_kv_heads != self.num_heads)

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" in params or "rope_theta" in params:
        return dict(params)
    return {}  # per-layer-type RoPE (Gemma-3 style): not a layout this table knows


def unsupported_reason(config: Any) -> str | None:
    """None when dschat's decode model covers ``config``, else one line saying why not."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in LAYOUTS:
        return (f"model type {model_type!r} has no inference layout in dschat's decode model "
                f"(supported: {', '.join(sorted(LAYOUTS))})")
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not decoded by dschat's decode model"
    layout = LAYOUTS[model_type]
    if layout.rope:
        rope_type = _rope_parameters(config).get("rope_type")
        if rope_type not in _STATIC_ROPE_TYPES:
            return (f"RoPE type {rope_type!r} changes its frequencies with the sequence length; dschat's decode "
                    f"model has static ones ({', '.join(_STATIC_ROPE_TYPES)})")
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, attr, None):
            return f"{model_type}'s {attr} is not implemented in dschat's decode model"
    return None


def _sliding_windows(config: Any) -> tuple[int | None, ...]:
    """Per layer, the sliding window or None: ``layer_types`` where the config has them (Qwen2/3:
    only layers from ``max_window_layers`` on, when ``use_sliding_window``), else every layer when
    ``sliding_window`` is set (Mistral, Phi-3), as the family's own mask builder does."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return (None,) * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return (int(window),) * n


def decoder_spec(config: Any) -> DecoderSpec:
    """The :class:`DecoderSpec` of a supported config (see :func:`unsupported_reason`)."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(reason)
    model_type = config.model_type
    layout = LAYOUTS[model_type]
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rotary_dim = 0
    if layout.rope:
        rotary_dim = int(head_dim * _rope_parameters(config).get("partial_rotary_factor", 1.0))
    eps = next((getattr(config, a) for a in ("rms_norm_eps", "layer_norm_eps") if getattr(config, a, None)), 1e-5)
    scale = head_dim ** -0.5
    if getattr(config, "query_pre_attn_scalar", None):
        scale = float(config.query_pre_attn_scalar) ** -0.5
    return DecoderSpec(
        family=model_type, layout=layout, num_layers=int(config.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=head_dim,
        rotary_dim=rotary_dim, norm_eps=float(eps), act=str(getattr(config, layout.act_attr)), attn_scale=scale,
        sliding_windows=_sliding_windows(config),
        parallel_residual=bool(layout.parallel_residual_attr and getattr(config, layout.parallel_residual_attr)),
        post_norm=bool(layout.post_norm_attr and not getattr(config, layout.post_norm_attr)),
        final_norm=not (model_type == "opt" and (getattr(config, "_remove_final_layer_norm", False)
                                                  or not config.do_layer_norm_before)),
    )


def layout_name(spec: DecoderSpec) -> str:
    """A short description for the rollout summary line, e.g. ``llama (fused qkv, gate_up; GQA 4/2)``."""
    mlp = "gate_up" if spec.layout.gated else "fc1"
    gqa = f"; GQA {spec.num_heads}/{spec.num_kv_heads}" if spec.num_kv_heads != spec.num_heads else ""
    return f"{spec.family} (fused qkv, {mlp}{gqa})"
