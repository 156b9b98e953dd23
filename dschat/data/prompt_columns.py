"""The dataset columns beside each phase-3 prompt, for reward functions (``--reward_fn``) and
environments (``--env``).

The tokenised prompt cache holds token ids only; a reward function also gets the row's other
fields (a reference answer, the chosen response, ...). :class:`PromptColumns` maps a prompt's token
ids (exactly as the phase-3 dataset tokenised them: the same adapter, split, seed and tokenizer) to
those fields, so the trainer can look them up from a generated batch's prompt rows.

A prompt that several rows share maps to the first of them. Where those rows' other fields differ
(a constant prompt with a per-row ``secret``, or a preference set's several answers to one
question), the prompt's tokens cannot tell which row a generated answer came from: those fields are
*shared* (:class:`SharedPrompt`). With ``--shared_prompt_fields refuse`` (the default) an
environment's row leaves them out and reading one raises a :class:`~dschat.errors.UserError` naming
the field and the fix (:class:`PromptRow`), and a reward or judge function that reads one of them
(:func:`dschat.rewards.columns_taken`) is refused before any model loads
(:meth:`PromptColumns.refuse_shared`); with ``first`` both get the first row's values. A function
that takes ``**kwargs`` without saying what it reads gets the first row's values either way, and
step 3 says so in one line (:meth:`PromptColumns.shared_notice`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from dschat.data.dispatch import get_raw_dataset
from dschat.data.phases import select_phase_rows
from dschat.data.tokenization import TOKENIZE_BATCH
from dschat.errors import UserError

__all__ = ["PromptColumns", "PromptRow", "SharedPrompt", "load_prompt_columns"]

#: The field that holds the prompt itself (every adapter's local form); not passed to reward
#: functions as a column, given to an environment's factory with the rest of its row.
PROMPT_FIELD = "prompt"


@dataclass(frozen=True)
class SharedPrompt:
    """A prompt that ``rows`` dataset rows share, whose ``fields`` differ between them."""

    text: str
    rows: int
    fields: frozenset[str]

    def why(self, field: str) -> str:
        """The line for reading ``field`` of this prompt's row."""
        return (f"dataset columns: the prompt {self.text[:60]!r} is in {self.rows} rows whose {field!r} differ, and "
                f"dschat finds a prompt's row by its tokens, so it cannot tell which row's {field!r} an answer "
                f"belongs to; make each prompt distinct (for example, put the row's {field} or an id in the "
                "prompt text) or drop the duplicate rows")


class PromptRow(dict):
    """A prompt's dataset row without the fields its :class:`SharedPrompt` has; reading one of those
    (``row[f]``, ``row.get(f)``) raises :class:`~dschat.errors.UserError` with the shared prompt's line.
    Other missing keys behave as in a ``dict``."""

    def __init__(self, fields: Mapping[str, Any], shared: SharedPrompt | None = None) -> None:
        super().__init__((k, v) for k, v in fields.items() if shared is None or k not in shared.fields)
        self.shared = shared

    def __missing__(self, key: str) -> Any:
        if self.shared is not None and key in self.shared.fields:
            raise UserError(self.shared.why(key))
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self and self.shared is not None and key in self.shared.fields:
            raise UserError(self.shared.why(key))
        return super().get(key, default)

    def copy(self) -> "PromptRow":
        return PromptRow(self, self.shared)


class PromptColumns:
    """``prompt token ids -> {column: value}``; :meth:`for_batch` returns one list per column.
    ``shared``: the prompts that several rows with differing fields share (module docstring)."""

    def __init__(self, rows: Mapping[tuple[int, ...], dict[str, Any]],
                 shared: Mapping[tuple[int, ...], SharedPrompt] | None = None) -> None:
        self.rows = dict(rows)
        self.shared = dict(shared or {})
        #: ``--shared_prompt_fields refuse``: an environment's row leaves a shared prompt's differing
        #: fields out (reading one raises its line); False (``first``): the first row whole.
        self.refuse = True

    def __len__(self) -> int:
        return len(self.rows)

    def for_batch(self, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                  prompt_texts: Sequence[str]) -> dict[str, list[Any]]:
        """Columns of each row of a left-padded ``(B, P)`` prompt batch (the prompt field not among
        them), one list per column common to every row: a shared prompt's first row's values (what
        :meth:`refuse_shared` and :meth:`shared_notice` are about); a prompt that is not in the data
        is refused with one line."""
        found = [self._row(key, i, prompt_texts) for i, key in enumerate(self._keys(prompts, prompt_mask))]
        names = set(found[0]) - {PROMPT_FIELD} if found else set()
        for row in found[1:]:
            names &= set(row)
        return {name: [row[name] for row in found] for name in sorted(names)}

    def rows_for_batch(self, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                       prompt_texts: Sequence[str]) -> list[PromptRow]:
        """The dataset row of each prompt of a left-padded ``(B, P)`` batch: every field, the prompt's
        own included, less a shared prompt's differing fields while :attr:`refuse` (:class:`PromptRow`;
        a copy each: an environment may keep it). One line for a prompt not in the data."""
        return [PromptRow(self._row(key, i, prompt_texts), self.shared.get(key) if self.refuse else None)
                for i, key in enumerate(self._keys(prompts, prompt_mask))]

    def _row(self, key: tuple[int, ...], i: int, prompt_texts: Sequence[str]) -> dict[str, Any]:
        """The (first) row of the prompt ``key``, batch row ``i``; one line for a prompt not in the data."""
        if key not in self.rows:
            raise UserError(f"dataset columns: prompt {prompt_texts[i][:60]!r} (row {i}) is not in the phase-3 "
                            "data; use the prompt data the run was started with")
        return self.rows[key]

    @staticmethod
    def _keys(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, ...]]:
        """Each row's prompt token ids, padding left out."""
        return [tuple(t for t, keep in zip(row, m) if keep) for row, m in zip(prompts.tolist(), prompt_mask.bool().tolist())]

    def shared_fields(self) -> frozenset[str]:
        """Every field some shared prompt's rows differ in."""
        return frozenset().union(*(shared.fields for shared in self.shared.values()))

    def refuse_shared(self, fields: Iterable[str]) -> None:
        """Raise the :class:`SharedPrompt` line of the first shared prompt whose rows differ in one of ``fields``."""
        wanted = set(fields)
        for shared in self.shared.values():
            hit = sorted(wanted & shared.fields)
            if hit:
                raise UserError(shared.why(hit[0]))

    def shared_notice(self, who: str) -> str | None:
        """One line saying how many prompts are shared and what ``who`` then gets; None when none is."""
        if not self.shared:
            return None
        fields = ", ".join(repr(f) for f in sorted(self.shared_fields()))
        return (f"note: the data has {len(self.shared)} prompt(s) that several rows share, with differing {fields}; "
                f"a prompt's row is found by its tokens, so {who}")


def load_prompt_columns(data_path: Sequence[str], data_split: str, seed: int | None, output_path: str,
                        local_rank: int, tokenizer: Any) -> PromptColumns:
    """Read the phase-3 rows (train and eval) of every ``--data_path`` entry and key their other fields
    by the prompt's token ids. A prompt that occurs twice keeps its first row's fields; where its rows'
    other fields differ, it is a :class:`SharedPrompt`."""
    rows: dict[tuple[int, ...], dict[str, Any]] = {}
    texts: dict[tuple[int, ...], str] = {}
    counts: Counter[tuple[int, ...]] = Counter()
    differing: dict[tuple[int, ...], frozenset[str]] = {}
    for name in data_path:
        raw = get_raw_dataset(name, output_path, seed, local_rank)
        sel = select_phase_rows(raw, data_split, 3, seed, output_path, local_rank)
        samples = [dict(sample) for part in (sel.train, sel.eval) for sample in part]
        prompts = [(raw.get_prompt(sample), sample) for sample in samples]
        prompts = [(p, sample) for p, sample in prompts if p is not None]
        for start in range(0, len(prompts), TOKENIZE_BATCH):  # batched, as the phase-3 cache tokenises
            chunk = prompts[start:start + TOKENIZE_BATCH]
            for ids, (text, sample) in zip(tokenizer([p for p, _ in chunk])["input_ids"], chunk):
                key = tuple(ids)
                counts[key] += 1
                first = rows.setdefault(key, sample)
                texts.setdefault(key, text)
                if first is not sample:
                    differing[key] = differing.get(key, frozenset()) | frozenset(
                        f for f in set(first) | set(sample)
                        if f != PROMPT_FIELD and not _same(first.get(f, _ABSENT), sample.get(f, _ABSENT)))
    shared = {key: SharedPrompt(texts[key], counts[key], fields) for key, fields in differing.items() if fields}
    return PromptColumns(rows, shared)


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
