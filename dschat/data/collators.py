"""Batch collators for steps 2 and 3, a sampler-epoch helper and the padding-column trim.

Step 1 (and the PPO-ptx loader) use ``transformers.default_data_collator``, as upstream.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

__all__ = [
    "DataCollatorReward", "DataCollatorRLHF", "SOURCES_KEY", "drop_padding_columns", "set_epoch_if_distributed",
]


class DataCollatorReward:
    """Step 2: stack pairs as ``[chosen_1 .. chosen_B; rejected_1 .. rejected_B]``.

    Input: B phase-2 items ``(c_ids, c_mask, r_ids, r_mask)``, each ``(1, L)``.
    Returns ``{"input_ids", "attention_mask"}``, each ``(2B, L)``: the reward model splits the batch
    in half (first half chosen). No labels (upstream).
    """

    def __call__(self, data: Sequence[Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.cat([f[0] for f in data] + [f[2] for f in data], dim=0),
            "attention_mask": torch.cat([f[1] for f in data] + [f[3] for f in data], dim=0),
        }


#: The step-3 batch's key of each prompt's dataset row (``PromptItem.source``), ``(B, 3)`` int64.
SOURCES_KEY = "prompt_sources"


class DataCollatorRLHF:
    """Step 3: left-padded prompts exactly ``max_token_len`` wide (upstream's flip trick,
    docs/upstream.md#prompts-and-padding-in-step-3).

    Items hold *reversed* prompts (``PromptItem``). Right-padding the reversed rows and flipping the
    batch back yields left-padded, right-aligned prompts, so every generated answer starts at the
    same column. The tokenizer itself stays right-padded for steps 1-2.

    Returns ``{"prompt", "prompt_att_mask"}``, each ``(B, max_token_len)`` (wider only if a prompt
    is longer, which phase-3 filtering prevents), and ``"prompt_sources"`` ``(B, 3)`` int64 when
    every item knows its dataset row (``PromptItem.source``, what reward functions and environments
    get the row's fields by). ``inference_tp_size`` is stored but unused, as upstream.
    """

    def __init__(self, max_token_len: int, inference_tp_size: int = 1) -> None:
        self.max_token_len = max_token_len
        self.inference_tp_size = inference_tp_size

    def __call__(self, data: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
        pad_token_id = data[-1][-1]
        prompt = pad_sequence([f[0] for f in data], padding_value=pad_token_id, batch_first=True)
        prompt_mask = pad_sequence([f[1] for f in data], padding_value=0, batch_first=True)
        pad_length = self.max_token_len - prompt.size(-1)
        if pad_length > 0:
            prompt = F.pad(prompt, pad=(0, pad_length), mode="constant", value=pad_token_id)
            prompt_mask = F.pad(prompt_mask, pad=(0, pad_length), mode="constant", value=0)
        batch = {"prompt": prompt.flip(1), "prompt_att_mask": prompt_mask.flip(1)}
        sources = [getattr(f, "source", None) for f in data]
        if data and all(source is not None for source in sources):
            batch[SOURCES_KEY] = torch.tensor(sources, dtype=torch.long)
        return batch


def set_epoch_if_distributed(loader_or_sampler: Any, epoch: int) -> bool:
    """Call ``set_epoch(epoch)`` on a DataLoader's sampler (or a sampler) if it has one.

    Step scripts call this at the start of each epoch, so each epoch has its own order (upstream never
    called it: docs/upstream.md#data-cache). Returns whether a sampler took the epoch.
    """
    candidates: Iterable[Any] = (
        loader_or_sampler,
        getattr(loader_or_sampler, "sampler", None),
        getattr(getattr(loader_or_sampler, "batch_sampler", None), "sampler", None),
    )
    for obj in candidates:
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)
            return True
    return False


def drop_padding_columns(batch: dict[str, Any], mask_key: str = "attention_mask", side: str = "right") -> dict[str, Any]:
    """Drop the columns that are padding in every row of a padded batch.

    Upstream pads every SFT / reward batch to ``max_seq_len`` and every step-3 prompt batch to
    ``max_prompt_seq_len``; columns that are padding in all rows change no real token's output (the
    attention mask hides them, labels there are -100, positions come from the mask), so dropping them
    gives the same losses for less compute. ``side`` is where the padding is: "right" (steps 1-2,
    DPO) or "left" (step-3 prompts). Tensors whose second dimension matches the mask's are sliced,
    except ``prompt_sources`` (one ``(data path, split, row)`` triple per row, not columns).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    mask = batch[mask_key]
    width = mask.shape[1]
    real = mask.bool().any(0).nonzero()
    if real.numel() == 0:
        return batch
    keep = slice(0, int(real[-1]) + 1) if side == "right" else slice(int(real[0]), width)
    return {
        k: v[:, keep] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == width and k != SOURCES_KEY
        else v
        for k, v in batch.items()
    }
