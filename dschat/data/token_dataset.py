"""Tokenised rows and the dataset over them: :class:`TokenRows`, :class:`PromptDataset` and its item types.

Rows are stored unpadded and flat (safetensors-friendly); padding is added when an item is read, so
the items are upstream's (see :mod:`dschat.data.tokenization` for what each phase holds).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple, Sequence

import torch
from torch.utils.data import Dataset

# ---------------------------------------------------------------------------------------------
# Storage: ragged token rows
# ---------------------------------------------------------------------------------------------


class TokenRows:
    """Variable-length token rows stored flat: ``ids``/``mask`` (total tokens) + ``offsets`` (rows + 1).

    Row ``i`` is ``ids[offsets[i]:offsets[i + 1]]``. ids are int32 on disk (int64 if a vocabulary
    ever exceeds 2**31), masks uint8; :meth:`row` returns int64 tensors like the tokenizer's.
    """

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor) -> None:
        if ids.shape != mask.shape or offsets.ndim != 1 or int(offsets[-1]) != ids.numel():
            raise ValueError("inconsistent TokenRows tensors")
        self.ids, self.mask, self.offsets = ids, mask, offsets

    @classmethod
    def from_lists(cls, ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> "TokenRows":
        lengths = torch.tensor([len(r) for r in ids], dtype=torch.long)
        offsets = torch.zeros(len(ids) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        flat_ids = [t for r in ids for t in r]
        dtype = torch.int32 if not flat_ids or max(flat_ids) < 2**31 else torch.int64
        return cls(
            torch.tensor(flat_ids, dtype=dtype),
            torch.tensor([m for r in masks for m in r], dtype=torch.uint8),
            offsets,
        )

    @classmethod
    def empty(cls) -> "TokenRows":
        return cls.from_lists([], [])

    @classmethod
    def concat(cls, parts: Sequence["TokenRows"]) -> "TokenRows":
        if not parts:
            return cls.empty()
        starts = torch.tensor([0] + [int(p.offsets[-1]) for p in parts[:-1]]).cumsum(0)
        offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
        dtype = torch.int64 if any(p.ids.dtype == torch.int64 for p in parts) else torch.int32
        return cls(torch.cat([p.ids.to(dtype) for p in parts]), torch.cat([p.mask for p in parts]), offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def take(self, index: Sequence[int] | torch.Tensor) -> "TokenRows":
        """Rows ``index`` in that order (vectorised gather)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        new_len = self.lengths()[idx]
        offsets = torch.zeros(idx.numel() + 1, dtype=torch.long)
        torch.cumsum(new_len, 0, out=offsets[1:])
        row_of = torch.repeat_interleave(torch.arange(idx.numel()), new_len)
        pos = self.offsets[:-1][idx][row_of] + (torch.arange(int(offsets[-1])) - offsets[:-1][row_of])
        return TokenRows(self.ids[pos], self.mask[pos], offsets)

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b].long(), self.mask[a:b].long()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.ids": self.ids, f"{prefix}.mask": self.mask, f"{prefix}.offsets": self.offsets}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "TokenRows":
        return cls(tensors[f"{prefix}.ids"], tensors[f"{prefix}.mask"], tensors[f"{prefix}.offsets"])


# ---------------------------------------------------------------------------------------------
# Items and the dataset
# ---------------------------------------------------------------------------------------------


class PairItem(NamedTuple):
    """Phase-2 item; indexes like upstream's ``(c_ids, c_mask, r_ids, r_mask)`` tuple.

    Shape of every field: ``(1, max_seq_len)``, int64.
    """

    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor


class _PromptFields(NamedTuple):
    input_ids_flipped: torch.Tensor
    attention_mask_flipped: torch.Tensor
    pad_token_id: int


#: A phase-3 prompt's dataset row: ``(--data_path entry, split (0 train, 1 eval), position in that
#: split's phase-3 rows)``, the key of :class:`~dschat.data.prompt_columns.PromptColumns`.
PromptSource = tuple[int, int, int]


class PromptItem(_PromptFields):
    """Phase-3 item; indexes like upstream's ``(ids_flipped, mask_flipped, pad_token_id)`` tuple.

    Shape: ``(prompt_len,)`` int64, reversed token order (see DataCollatorRLHF). ``source`` (an
    attribute, not a fourth field, so upstream's three-field indexing holds) is the prompt's
    :data:`PromptSource`, or None where the dataset does not know it.
    """

    source: PromptSource | None = None

    def __new__(cls, input_ids_flipped: torch.Tensor, attention_mask_flipped: torch.Tensor, pad_token_id: int,
                source: PromptSource | None = None) -> "PromptItem":
        item = super().__new__(cls, input_ids_flipped, attention_mask_flipped, pad_token_id)
        item.source = source
        return item

    def _replace(self, **changes: Any) -> "PromptItem":
        item = super()._replace(**changes)
        item.source = self.source
        return item


class PromptDataset(Dataset):
    """Tokenised rows of one phase; item types as upstream (see the module docstring).

    Upstream's positional arguments (``prompt_dataset``, ``chosen_dataset``, ``reject_dataset``,
    ``pad_token_id``, ``train_phase``) are kept, holding :class:`TokenRows` instead of lists of
    ``BatchEncoding``, so upstream's five-argument call works. ``max_seq_len`` / ``padding_side``
    say how phase-1/2 rows are padded on read; ``max_seq_len=None`` (the default) pads to the
    longest chosen/rejected row, which for rows tokenised as upstream did (``padding="max_length"``)
    is their common length, i.e. upstream's items. ``filtered`` counts the rows left out: phase-3 prompts
    dropped for length, phase-2 pairs without a shared first token. ``prompt_sources`` (phase 3, ``(N, 3)`` int64, or None) is each prompt's
    :data:`PromptSource`; its items carry it.
    """

    def __init__(
        self,
        prompt_dataset: TokenRows | None,
        chosen_dataset: TokenRows | None,
        reject_dataset: TokenRows | None,
        pad_token_id: int | None,
        train_phase: int,
        *,
        max_seq_len: int | None = None,
        padding_side: str = "right",
        filtered: int = 0,
        prompt_sources: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if train_phase not in (1, 2, 3):
            raise ValueError(f"train_phase must be 1, 2 or 3, got {train_phase}")
        given = {"prompt_dataset": prompt_dataset, "chosen_dataset": chosen_dataset, "reject_dataset": reject_dataset}
        for name, rows in given.items():
            if rows is not None and not isinstance(rows, TokenRows):
                raise TypeError(
                    f"PromptDataset's {name} must be TokenRows or None, got {type(rows).__name__}; build it "
                    "from unpadded token lists with TokenRows.from_lists(ids, masks)"
                )
        self.prompt_dataset = prompt_dataset if prompt_dataset is not None else TokenRows.empty()
        self.chosen_dataset = chosen_dataset if chosen_dataset is not None else TokenRows.empty()
        self.reject_dataset = reject_dataset if reject_dataset is not None else TokenRows.empty()
        self.pad_token_id = pad_token_id
        self.train_phase = train_phase
        if max_seq_len is None:
            lengths = [int(rows.lengths().max()) for rows in (self.chosen_dataset, self.reject_dataset) if len(rows)]
            max_seq_len = max(lengths, default=0)
        self.max_seq_len = max_seq_len
        self.padding_side = padding_side
        self.filtered = filtered
        if prompt_sources is not None and tuple(prompt_sources.shape) != (len(self.prompt_dataset), 3):
            raise ValueError(f"prompt_sources must be ({len(self.prompt_dataset)}, 3), got {tuple(prompt_sources.shape)}")
        self.prompt_sources = prompt_sources.long() if prompt_sources is not None else None
        #: Set by create_prompt_dataset: the SHA-256 key of the cache this came from.
        self.cache_key: str | None = None
        self._digest: str | None = None

    def digest(self) -> str:
        """SHA-256 of the rows (every token id and mask, the phase, the pad id and the prompts'
        sources; not the padded width), computed once: what a checkpoint records so that a resume on
        other rows of the same count (another --data_path order, an edited file, another tokenizer) is
        refused."""
        if self._digest is None:
            h = hashlib.sha256(json.dumps([self.train_phase, self.pad_token_id]).encode())
            for rows in (self.prompt_dataset, self.chosen_dataset, self.reject_dataset):
                for tensor in (rows.ids, rows.mask, rows.offsets):
                    h.update(str((tensor.dtype, tensor.numel())).encode())
                    h.update(tensor.contiguous().numpy())
            if self.prompt_sources is not None:
                h.update(self.prompt_sources.contiguous().numpy())
            self._digest = h.hexdigest()
        return self._digest

    def __len__(self) -> int:
        if self.train_phase == 3:
            return len(self.prompt_dataset)
        return len(self.chosen_dataset)

    def _padded(self, rows: TokenRows, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = rows.row(idx)
        pad = self.max_seq_len - ids.numel()
        if pad > 0:
            pad_ids = torch.full((pad,), int(self.pad_token_id), dtype=torch.long)
            pad_mask = torch.zeros(pad, dtype=torch.long)
            if self.padding_side == "left":
                ids, mask = torch.cat([pad_ids, ids]), torch.cat([pad_mask, mask])
            else:
                ids, mask = torch.cat([ids, pad_ids]), torch.cat([mask, pad_mask])
        return ids, mask

    def __getitem__(self, idx: int) -> Any:
        if self.train_phase == 1:
            ids, mask = self._padded(self.chosen_dataset, idx)
            # Loss on every real token, prompt included; -100 on padding only, as upstream.
            return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}
        if self.train_phase == 2:
            c_ids, c_mask = self._padded(self.chosen_dataset, idx)
            r_ids, r_mask = self._padded(self.reject_dataset, idx)
            return PairItem(c_ids[None], c_mask[None], r_ids[None], r_mask[None])
        ids, mask = self.prompt_dataset.row(idx)
        source = None if self.prompt_sources is None else tuple(self.prompt_sources[idx].tolist())
        return PromptItem(ids.flip(0), mask.flip(0), self.pad_token_id, source)

    def take(self, index: Sequence[int] | torch.Tensor) -> "PromptDataset":
        """A new dataset of rows ``index`` in that order (upstream's ``Subset``, materialised)."""
        return PromptDataset(
            self.prompt_dataset.take(index) if self.train_phase == 3 else None,
            self.chosen_dataset.take(index) if self.train_phase != 3 else None,
            self.reject_dataset.take(index) if self.train_phase == 2 else None,
            self.pad_token_id, self.train_phase,
            max_seq_len=self.max_seq_len, padding_side=self.padding_side, filtered=self.filtered,
            prompt_sources=(self.prompt_sources[torch.as_tensor(index, dtype=torch.long)]
                            if self.prompt_sources is not None else None),
        )

    @classmethod
    def concat(cls, parts: Sequence["PromptDataset"]) -> "PromptDataset":
        """Upstream's ``ConcatDataset`` of same-phase datasets, materialised."""
        first = parts[0]
        return cls(
            TokenRows.concat([p.prompt_dataset for p in parts]),
            TokenRows.concat([p.chosen_dataset for p in parts]),
            TokenRows.concat([p.reject_dataset for p in parts]),
            first.pad_token_id, first.train_phase,
            max_seq_len=first.max_seq_len, padding_side=first.padding_side,
            filtered=sum(p.filtered for p in parts),
            prompt_sources=(torch.cat([p.prompt_sources for p in parts])
                            if all(p.prompt_sources is not None for p in parts) else None),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.train_phase == 1:
            return self.chosen_dataset.tensors("chosen")
        if self.train_phase == 2:
            return {**self.chosen_dataset.tensors("chosen"), **self.reject_dataset.tensors("rejected")}
        out = self.prompt_dataset.tensors("prompt")
        if self.prompt_sources is not None:
            out["prompt.sources"] = self.prompt_sources
        return out
