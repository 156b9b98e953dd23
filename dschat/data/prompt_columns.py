"""The dataset columns beside each phase-3 prompt, for reward functions (``--reward_fn``), judges
(``--eval_judge``) and environments (``--env``).

The tokenised prompt cache holds each prompt's token ids and its source
(:data:`~dschat.data.token_dataset.PromptSource`: the ``--data_path`` entry, the split, the row's
position in that split's phase-3 rows), and step 3's batches carry the sources
(``prompt_sources``, :class:`~dschat.data.collators.DataCollatorRLHF`). :class:`PromptColumns` maps a
source to its row's other fields (a reference answer, the chosen response, a secret ...), so every
answer gets its own row's fields, also where several rows share one prompt (a constant "Guess my
number." with a per-row ``secret``; a preference set's several answers to one question). Each lookup
checks that the source's prompt tokens are the batch row's: the columns and the cache came from the
same adapter, split, seed and tokenizer.

A batch without sources (an upstream-style ``generate_experience(prompts, mask, step)`` call) finds
a prompt's row by its tokens. A prompt that several rows with differing fields share
(:class:`SharedPrompt`) is then one :class:`~dschat.errors.UserError` line naming the fix, never a
silent choice of one of its rows.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from dschat.data.dispatch import get_raw_dataset
from dschat.data.phases import select_phase_rows
from dschat.data.prompt_dataset import DEFAULT_SEED
from dschat.data.token_dataset import PromptSource
from dschat.data.tokenization import TOKENIZE_BATCH
from dschat.errors import UserError

__all__ = ["PromptColumns", "PromptRecord", "SharedPrompt", "load_prompt_columns"]

#: The field that holds the prompt itself (every adapter's local form); not passed to reward
#: functions as a column, given to an environment's factory with the rest of its row.
PROMPT_FIELD = "prompt"


class PromptRecord(NamedTuple):
    """One phase-3 row: its prompt's token ids (as the phase-3 cache tokenised them), its prompt text
    and its fields."""

    ids: tuple[int, ...]
    text: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class SharedPrompt:
    """A prompt that ``rows`` dataset rows share, whose ``fields`` differ between them."""

    text: str
    rows: int
    fields: frozenset[str]

    def why(self) -> str:
        """The line for finding this prompt's row by its tokens."""
        names = ", ".join(repr(f) for f in sorted(self.fields))
        return (f"dataset columns: the prompt {self.text[:60]!r} is in {self.rows} rows whose {names} differ, and the "
                "batch carries no prompt sources to tell which row an answer belongs to; pass the batch's "
                "'prompt_sources' (DataCollatorRLHF gives them) as generate_experience(prompts, mask, step, "
                "sources=...)")


class PromptColumns:
    """``PromptSource -> PromptRecord`` over the phase-3 rows (train and eval) of a run's data;
    :meth:`for_batch` gives one list per column, :meth:`rows_for_batch` one row per prompt.
    ``shared``: the prompts that several rows with differing fields share (found by tokens, they are
    refused: module docstring)."""

    def __init__(self, records: Mapping[PromptSource, PromptRecord]) -> None:
        self.records = dict(records)
        self._first: dict[tuple[int, ...], PromptSource] = {}  # a prompt's first row, for batches without sources
        counts: Counter[tuple[int, ...]] = Counter()
        differing: dict[tuple[int, ...], set[str]] = {}
        for source, record in self.records.items():
            counts[record.ids] += 1
            first = self.records[self._first.setdefault(record.ids, source)].fields
            if first is not record.fields:
                differing.setdefault(record.ids, set()).update(
                    f for f in set(first) | set(record.fields)
                    if f != PROMPT_FIELD and not _same(first.get(f, _ABSENT), record.fields.get(f, _ABSENT)))
        self.shared = {ids: SharedPrompt(self.records[self._first[ids]].text, counts[ids], frozenset(fields))
                       for ids, fields in differing.items() if fields}

    def __len__(self) -> int:
        return len(self.records)

    def for_batch(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, prompt_texts: Sequence[str],
                  sources: torch.Tensor | None = None) -> dict[str, list[Any]]:
        """Columns of each row of a left-padded ``(B, P)`` prompt batch (the prompt field not among
        them), one list per column common to every row. ``sources``: the batch's ``(B, 3)``
        ``prompt_sources``; without them each row is found by its prompt's tokens (module docstring)."""
        found = self._found(prompts, prompt_mask, prompt_texts, sources)
        names = set(found[0]) - {PROMPT_FIELD} if found else set()
        for row in found[1:]:
            names &= set(row)
        return {name: [copy.deepcopy(row[name]) for row in found] for name in sorted(names)}

    def rows_for_batch(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, prompt_texts: Sequence[str],
                       sources: torch.Tensor | None = None) -> list[dict[str, Any]]:
        """The dataset row of each prompt of a left-padded ``(B, P)`` batch, every field (the prompt's
        own included), a deep copy each: an environment may keep or change it. ``sources`` as in
        :meth:`for_batch`."""
        return [copy.deepcopy(dict(row)) for row in self._found(prompts, prompt_mask, prompt_texts, sources)]

    def _found(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, prompt_texts: Sequence[str],
               sources: torch.Tensor | None) -> list[dict[str, Any]]:
        keys = [tuple(t for t, keep in zip(row, m) if keep)
                for row, m in zip(prompts.tolist(), prompt_mask.bool().tolist())]
        if sources is None:
            return [self._by_tokens(key, i, prompt_texts) for i, key in enumerate(keys)]
        if tuple(sources.shape) != (len(keys), 3):
            raise UserError(f"dataset columns: prompt_sources must be ({len(keys)}, 3) for {len(keys)} prompts, got "
                            f"{tuple(sources.shape)}; pass the batch's own prompt_sources")
        return [self._by_source(key, tuple(source), i, prompt_texts)
                for i, (key, source) in enumerate(zip(keys, sources.tolist()))]

    def _by_source(self, key: tuple[int, ...], source: PromptSource, i: int, prompt_texts: Sequence[str]) -> dict[str, Any]:
        record = self.records.get(source)
        if record is None or record.ids != key:
            where = "not in" if record is None else f"not the prompt of row {list(source)} of"
            raise UserError(f"dataset columns: prompt {prompt_texts[i][:60]!r} (batch row {i}) is {where} the phase-3 "
                            "data; use the prompt data, split, seed and tokenizer the run was started with")
        return record.fields

    def _by_tokens(self, key: tuple[int, ...], i: int, prompt_texts: Sequence[str]) -> dict[str, Any]:
        if key in self.shared:
            raise UserError(self.shared[key].why())
        source = self._first.get(key)
        if source is None:
            raise UserError(f"dataset columns: prompt {prompt_texts[i][:60]!r} (batch row {i}) is not in the phase-3 "
                            "data; use the prompt data the run was started with")
        return self.records[source].fields


def load_prompt_columns(data_path: Sequence[str] | str, data_split: str, seed: int | None, output_path: str,
                        local_rank: int, tokenizer: Any) -> PromptColumns:
    """Read the phase-3 rows (train and eval) of every ``--data_path`` entry, each under its
    :data:`~dschat.data.token_dataset.PromptSource` (the numbering of
    :func:`dschat.data.tokenization.create_dataset_split`: a row without a prompt keeps its position)."""
    if isinstance(data_path, str):
        data_path = [data_path]
    seed = DEFAULT_SEED if seed is None else seed  # as create_prompt_dataset
    records: dict[PromptSource, PromptRecord] = {}
    for index, name in enumerate(data_path):
        raw = get_raw_dataset(name, output_path, seed, local_rank)
        sel = select_phase_rows(raw, data_split, 3, seed, output_path, local_rank)
        for part, rows in enumerate((sel.train, sel.eval)):
            found = [(at, text, dict(sample)) for at, sample in enumerate(rows)
                     if (text := raw.get_prompt(sample)) is not None]
            for start in range(0, len(found), TOKENIZE_BATCH):  # batched, as the phase-3 cache tokenises
                chunk = found[start:start + TOKENIZE_BATCH]
                for ids, (at, text, sample) in zip(tokenizer([t for _, t, _ in chunk])["input_ids"], chunk):
                    records[(index, part, at)] = PromptRecord(tuple(ids), text, sample)
    return PromptColumns(records)


_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    """Whether two field values are equal (two NaNs are; values whose comparison is not a plain bool,
    such as arrays, count as different)."""
    if a is _ABSENT or b is _ABSENT:
        return a is b
    try:
        return bool(a == b) or (bool(a != a) and bool(b != b))  # x != x: NaN
    except Exception:  # noqa: BLE001 -- e.g. arrays, whose == is elementwise
        return False
