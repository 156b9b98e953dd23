"""Sequence packing: the real tokens of a padded batch laid end to end in fewer rows, so that a
forward pass computes no padding (step 3's scoring passes and PPO update, ``--sequence_packing``).
Step 2's pairwise loss also reads some padding; :func:`padded_pass_inputs` packs that with the real
tokens and gives every slot the padded pass's position and attention through an explicit mask.

A step-3 rollout batch ``(B, L)`` is a left-padded prompt, the answer, and padding after the answer's
EOS; in the CPU demo about a third of its columns are padding. :func:`pack_rows` puts each row's real
tokens (one contiguous run per row) end to end into as few rows as hold them
(:data:`PACKED_ROW_TOKENS` each at most). Position ids restart at 0 for every sequence, and the
attention keeps the sequences apart:

* ``"positions"`` -- the family's own mask builder (transformers' ``masking_utils``) finds packed
  sequences from the position ids when no 2-D mask is given;
* ``"mask"`` -- OPT's mask builder ignores the position ids, so it is given the block-diagonal causal
  mask that transformers' own ``create_causal_mask`` builds from them (4-D masks are used as given);
* ``None`` -- the padded layout is kept (:func:`packing_unsupported_reason` says why in one line):
  families whose positions come from the mask (ALiBi) or that are not in :data:`~dschat.models.families.FAMILIES`,
  and attention kernels other than SDPA and eager.

The results at real tokens are the padded pass's up to floating-point reordering (measured in
``tests/rlhf/test_sequence_packing.py``: at most a few 1e-6 in fp32 logits with SDPA, exactly equal with
eager attention); filler slots at the end of a packed row (position 0 each) are one-token
sequences of their own, dropped by :meth:`PackedRows.unpack`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from transformers.masking_utils import create_causal_mask

from dschat.errors import UserError
from dschat.models.families import family_of
from dschat.runtime.dist import print_rank_0

__all__ = ["PACKED_ROW_TOKENS", "PackedRows", "pack_rows", "attention_span", "layout_cost", "packing_mode",
           "packing_unsupported_reason", "packed_model_inputs", "resolve_sequence_packing", "attention_window",
           "padded_pass_inputs"]

SETTINGS = ("auto", "on", "off")

#: Attention implementations whose masks keep packed sequences apart (checked by the tests).
PACKING_ATTENTION = ("sdpa", "eager")

#: Tokens a packed row holds at most (or the padded width, when that is larger). Attention over a
#: packed row is computed densely under its block mask, so its cost per token grows with the row's
#: width (:func:`layout_cost`); :func:`pack_rows` weighs that against the padding and filler a
#: layout computes, and keeps the padded batch when no layout is cheaper. On the CPU demo's
#: batches (8 x ~46 tokens) it picks 2-4 rows of 90-200 tokens; ``benchmarks/packing.py`` compares
#: layouts (benchmarks/results.md).
PACKED_ROW_TOKENS = 1024


@dataclass(frozen=True)
class PackedRows:
    """A padded ``(B, L)`` batch packed into ``(R, W)``: ``R <= B`` rows of ``W`` slots (at most
    ``max(L, PACKED_ROW_TOKENS)``), each a few whole sequences end to end, then filler.

    ``source[r, w]`` is the flat index ``b * L + c`` of the padded token that slot ``(r, w)`` holds,
    or -1 for a filler slot; :meth:`gather` and :meth:`unpack` move tensors between the layouts.
    """

    input_ids: torch.Tensor  # (R, W) packed ids; filler slots hold the first padded id
    position_ids: torch.Tensor  # (R, W) 0, 1, ... within each sequence; 0 on filler
    source: torch.Tensor  # (R, W) int64 flat padded index of each slot, -1 for filler
    shape: tuple[int, int]  # (B, L) of the padded batch

    @property
    def real(self) -> torch.Tensor:
        """(R, W) bool: the slot holds a real token."""
        return self.source >= 0

    @property
    def real_tokens(self) -> int:
        return int(self.real.sum())

    def gather(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) in the padded layout -> (R, W, ...) in the packed one (filler slots: the value
        at padded index 0, which nothing reads)."""
        B, L = self.shape
        flat = padded.reshape(B * L, *padded.shape[2:])
        return flat[self.source.clamp(min=0)]

    def unpack(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """(R, W, ...) in the packed layout -> (B, L, ...), ``fill`` where the padded batch has
        padding. Differentiable in ``packed``."""
        B, L = self.shape
        real = self.real
        out = packed.new_full((B * L, *packed.shape[2:]), fill)
        out = out.index_put((self.source[real],), packed[real])
        return out.reshape(B, L, *packed.shape[2:])


def _first_fit(order: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (lists of row indices) of at most ``capacity`` tokens, each taking the first with room."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for b in order:
        for r, load in enumerate(loads):
            if load + lengths[b] <= capacity:
                rows[r].append(b)
                loads[r] += lengths[b]
                break
        else:
            rows.append([b])
            loads.append(lengths[b])
    return rows


def _balanced(order: list[int], lengths: list[int], count: int) -> list[list[int]]:
    """``count`` rows, each sequence (longest first) to the least-filled row: even widths."""
    rows: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for b in order:
        r = loads.index(min(loads))
        rows[r].append(b)
        loads[r] += lengths[b]
    return rows


def attention_span(model: Any) -> int | None:
    """The row width whose dense attention costs about as much as a token's matmuls in one decoder
    layer: ``2 x hidden + MLP width`` (per token, the projections and the MLP take about
    ``4 h^2 + 2 h f`` multiply-adds, attention over a row of ``W`` tokens about ``2 W h``). ``model``:
    a model, an engine or a config; None when its config does not give the hidden size."""
    config = _config(model) if not hasattr(model, "model_type") else model
    hidden = next((getattr(config, a) for a in ("hidden_size", "n_embd", "d_model")
                   if isinstance(getattr(config, a, None), int)), None)
    if not hidden:
        return None
    mlp = next((getattr(config, a) for a in ("intermediate_size", "ffn_dim", "n_inner")
                if isinstance(getattr(config, a, None), int)), 4 * hidden)
    return 2 * hidden + mlp


def layout_cost(rows: int, width: int, span: int | None) -> float:
    """The relative cost of a forward over ``rows x width`` slots with dense attention over each row
    (:func:`attention_span`; None counts slots only)."""
    return rows * width * (1.0 + width / span) if span else float(rows * width)


def _layout(order: list[int], lengths: list[int], capacity: int) -> tuple[list[list[int]], int]:
    """Rows of at most ``capacity`` tokens, as few as first-fit decreasing needs, then spread evenly
    over that many rows when that is narrower; with the widest row's width."""
    def widest(layout: list[list[int]]) -> int:
        return max((sum(lengths[b] for b in row) for row in layout), default=1)

    rows = _first_fit(order, lengths, capacity)
    even = _balanced(order, lengths, len(rows))
    return (even, widest(even)) if widest(even) < widest(rows) else (rows, widest(rows))


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_width: int | None = None,
              span: int | None = None) -> PackedRows | None:
    """Pack a padded batch (shapes (B, L)), or None to keep it padded: when some row's real tokens
    are not one contiguous run, or when no packed layout costs less than the padded batch.

    Layouts are tried at row widths ``L, 2L, 4L, ...`` up to ``max(max_width, L)`` (default
    :data:`PACKED_ROW_TOKENS`): at each, as few rows as first-fit decreasing needs, the sequences
    spread evenly over them when that narrows the rows; the cheapest by :func:`layout_cost` with
    ``span`` (:func:`attention_span` of the model) is taken. Deterministic (ties by row index).
    """
    B, L = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    first = mask.long().argmax(-1)
    cols = torch.arange(L, device=mask.device)
    contiguous = mask == ((cols >= first[:, None]) & (cols < (first + lengths)[:, None]))
    if not bool(contiguous.all()):
        return None
    lengths_list, first_list = lengths.tolist(), first.tolist()
    order = sorted((b for b in range(B) if lengths_list[b] > 0), key=lambda i: (-lengths_list[i], i))
    limit = max(int(max_width or PACKED_ROW_TOKENS), L)
    best: tuple[float, list[list[int]]] | None = None
    capacity = L
    while True:
        layout, width = _layout(order, lengths_list, capacity)
        cost = layout_cost(max(len(layout), 1), width, span)
        if best is None or cost < best[0]:
            best = (cost, layout)
        if capacity >= limit:
            break
        capacity = min(2 * capacity, limit)
    if best[0] >= layout_cost(B, L, span):
        return None
    rows = best[1]
    bins = [[sum(lengths_list[b] for b in row), *row] for row in rows]  # per packed row: [used, b, b, ...]
    R = max(len(bins), 1)
    W = max((row[0] for row in bins), default=1)
    source = torch.full((R, W), -1, dtype=torch.long)
    # Filler keeps position 0: each filler slot is a one-token sequence of its own, and no position
    # exceeds the padded batch's (learned position tables, dynamic RoPE's largest position).
    positions = torch.zeros((R, W), dtype=torch.long)
    for r, row in enumerate(bins):
        offset = 0
        for b in row[1:]:
            n = lengths_list[b]
            source[r, offset:offset + n] = b * L + first_list[b] + torch.arange(n)
            positions[r, offset:offset + n] = torch.arange(n)
            offset += n
    source = source.to(input_ids.device)
    packed = PackedRows(input_ids=input_ids.new_zeros((R, W)), position_ids=positions.to(input_ids.device),
                        source=source, shape=(B, L))
    return PackedRows(input_ids=packed.gather(input_ids), position_ids=packed.position_ids, source=source,
                      shape=(B, L))


def _unwrap(model: Any) -> Any:
    """The ``nn.Module`` inside a DeepSpeed engine (or the module itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _config(model: Any) -> Any:
    return getattr(_unwrap(model), "config", None)


def packing_unsupported_reason(model: Any) -> str | None:
    """None when ``model`` (an HF model, a ``RewardModel`` or a DeepSpeed engine of one) computes
    packed rows correctly, else one line saying why not."""
    config = _config(model)
    if config is None:
        return f"{type(_unwrap(model)).__name__} has no Hugging Face config"
    body = _unwrap(model)
    body = getattr(body, "rwtransformer", body)  # a RewardModel's body
    if not type(body).__module__.startswith("transformers.models."):
        return (f"{type(body).__name__} is not a transformers model class (remote code or a wrapper: its forward "
                "may not read packed position ids)")
    family = family_of(config)
    model_type = getattr(config, "model_type", "?")
    if family.sequence_packing is None:
        return f"model type {model_type!r} keeps the padded layout (no packed-sequence attention checked for it)"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in PACKING_ATTENTION:
        return (f"attention implementation {attention!r} keeps the padded layout (packing is checked with "
                f"{' and '.join(PACKING_ATTENTION)})")
    return None


def packing_mode(model: Any) -> str | None:
    """How ``model`` is told where packed sequences start: "positions", "mask" or None (padded)."""
    if packing_unsupported_reason(model) is not None:
        return None
    return family_of(_config(model)).sequence_packing


def packed_model_inputs(packed: PackedRows, model: Any) -> dict[str, Any]:
    """The forward keyword arguments of ``packed`` for ``model`` (whose :func:`packing_mode` is not
    None): ids, position ids and ``use_cache=False``, and for "mask" families the block-diagonal
    causal mask."""
    mode = packing_mode(model)
    if mode is None:
        raise ValueError(f"sequence packing does not apply: {packing_unsupported_reason(model)}")
    attention_mask = None
    if mode == "mask":
        module = _unwrap(model)
        dtype = next(module.parameters()).dtype
        R, W = packed.input_ids.shape
        shape_only = torch.empty((R, W, 0), dtype=dtype, device=packed.input_ids.device)
        attention_mask = create_causal_mask(config=_config(model), inputs_embeds=shape_only, attention_mask=None,
                                            past_key_values=None, position_ids=packed.position_ids)
    # use_cache=False: with a cache, transformers builds the mask without looking for packed sequences.
    return {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "attention_mask": attention_mask,
            "use_cache": False}


def resolve_sequence_packing(setting: str, models: Mapping[str, Any]) -> dict[str, bool]:
    """Which of ``models`` (name -> engine, None for an absent one) run packed, and one printed line.

    'auto' packs every model that can; 'on' refuses a model that cannot (one line, exit 2); 'off'
    packs none.
    """
    if setting not in SETTINGS:
        raise UserError(f"--sequence_packing {setting!r} is not one of {', '.join(SETTINGS)}")
    reasons = {name: packing_unsupported_reason(model) for name, model in models.items() if model is not None}
    if setting == "off":
        print_rank_0("Sequence packing: off (--sequence_packing off): every forward pass runs on padded rows")
        return {name: False for name in reasons}
    refused = {name: why for name, why in reasons.items() if why is not None}
    if setting == "on" and refused:
        name, why = next(iter(refused.items()))
        raise UserError(f"--sequence_packing on: the {name} model cannot run packed rows: {why}; "
                        "use --sequence_packing auto (packs the models that can) or off")
    packed = [name for name, why in reasons.items() if why is None]
    line = f"Sequence packing: {', '.join(packed) if packed else 'no model'} on packed rows"
    if refused:
        line += "; padded rows for " + "; ".join(f"{name} ({why})" for name, why in refused.items())
    print_rank_0(line)
    return {name: why is None for name, why in reasons.items()}


def attention_window(config: Any) -> int | None:
    """The smallest local-attention window ``config`` declares (Mistral's ``sliding_window``,
    GPT-Neo's ``window_size``), or None."""
    windows = [getattr(config, a, None) for a in ("sliding_window", "window_size")]
    return min((w for w in windows if isinstance(w, int) and w > 0), default=None)


def padded_pass_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                       compute: torch.Tensor, model: Any) -> tuple[PackedRows, dict[str, Any]] | None:
    """Pack the ``compute`` columns of a right-padded batch (B, L), padding columns among them, so
    that the forward gives at each what the padded pass gives there: the padded pass's
    ``position_ids`` (B, L), and every query, a padding one too, attending only to the real tokens
    before it in its own row.

    For losses that read the model's output at some padding (step 2's pairwise loss reads the
    shorter answer's padding up to the longer one's end:
    docs/upstream.md#the-reward-models-pairwise-loss-reads-padding). ``compute`` (B, L) must mark a
    contiguous run from column 0 in each row. Returns the packing and the forward's keyword
    arguments (an explicit 4-D mask for either packing mode), or None to keep the padded pass: no
    cheaper layout, or a local-attention window narrower than ``L`` (the explicit mask would not
    apply it).
    """
    config = _config(model)
    B, L = input_ids.shape
    window = attention_window(config)
    if packing_mode(model) is None or (window is not None and window < L):
        return None
    packed = pack_rows(input_ids, compute, span=attention_span(config))
    if packed is None:
        return None
    real = packed.real
    positions = packed.gather(position_ids)
    # Keys: the real tokens, and each filler slot for itself (a query that sees no key gives NaN).
    visible = (packed.gather(attention_mask).bool() & real) | ~real
    slots = torch.arange(real.numel(), device=real.device).view(real.shape)
    sequence = torch.where(real, packed.source // L, -1 - slots)  # filler: a sequence of its own

    def same_sequence(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return sequence[batch_idx, q_idx] == sequence[batch_idx, kv_idx]

    module = _unwrap(model)
    R, W = packed.input_ids.shape
    shape_only = torch.empty((R, W, 0), dtype=next(module.parameters()).dtype, device=input_ids.device)
    mask = create_causal_mask(config=config, inputs_embeds=shape_only, attention_mask=visible.long(),
                              past_key_values=None, position_ids=None, and_mask_function=same_sequence)
    return packed, {"input_ids": packed.input_ids, "position_ids": positions, "attention_mask": mask,
                    "use_cache": False}
