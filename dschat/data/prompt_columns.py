"""The dataset columns beside each phase-3 prompt, for reward functions (``--reward_fn``) and
environments (``--env``).

The tokenised prompt cache holds token ids only; a reward function also gets the row's other
fields (a reference answer, the chosen response, ...). :class:`PromptColumns` maps a prompt's token
ids (exactly as the phase-3 dataset tokenised them: the same adapter, split, seed and tokenizer) to
those fields, so the trainer can look them up from a generated batch's prompt rows.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from dschat.data.dispatch import get_raw_dataset
from dschat.data.phases import select_phase_rows
from dschat.data.tokenization import TOKENIZE_BATCH
from dschat.errors import UserError

__all__ = ["PromptColumns", "load_prompt_columns"]

#: The field that holds the prompt itself (every adapter's local form); not passed to reward
#: functions as a column, given to an environment's factory with the rest of its row.
PROMPT_FIELD = "prompt"


class PromptColumns:
    """``prompt token ids -> {column: value}``; :meth:`for_batch` returns one list per column."""

    def __init__(self, rows: Mapping[tuple[int, ...], dict[str, Any]]) -> None:
        self.rows = dict(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def for_batch(self, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                  prompt_texts: Sequence[str]) -> dict[str, list[Any]]:
        """Columns of each row of a left-padded ``(B, P)`` prompt batch (the prompt field not among
        them), one list per column common to every row; a prompt that is not in the data is refused
        with one line."""
        found = self.rows_for_batch(prompts, prompt_mask, prompt_texts)
        names = set(found[0]) - {PROMPT_FIELD} if found else set()
        for row in found[1:]:
            names &= set(row)
        return {name: [row[name] for row in found] for name in sorted(names)}

    def rows_for_batch(self, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                       prompt_texts: Sequence[str]) -> list[dict[str, Any]]:
        """The dataset row of each prompt of a left-padded ``(B, P)`` batch: every field, the prompt's
        own included (a copy each: an environment may keep it). One line for a prompt not in the data."""
        found = []
        for i, (row, m) in enumerate(zip(prompts.tolist(), prompt_mask.bool().tolist())):
            key = tuple(t for t, keep in zip(row, m) if keep)
            if key not in self.rows:
                raise UserError(f"dataset columns: prompt {prompt_texts[i][:60]!r} (row {i}) is not in the phase-3 "
                                "data; use the prompt data the run was started with")
            found.append(dict(self.rows[key]))
        return found


def load_prompt_columns(data_path: Sequence[str], data_split: str, seed: int | None, output_path: str,
                        local_rank: int, tokenizer: Any) -> PromptColumns:
    """Read the phase-3 rows (train and eval) of every ``--data_path`` entry and key their other fields
    by the prompt's token ids. A prompt that occurs twice keeps its first row's fields."""
    rows: dict[tuple[int, ...], dict[str, Any]] = {}
    for name in data_path:
        raw = get_raw_dataset(name, output_path, seed, local_rank)
        sel = select_phase_rows(raw, data_split, 3, seed, output_path, local_rank)
        samples = [dict(sample) for part in (sel.train, sel.eval) for sample in part]
        prompts = [(raw.get_prompt(sample), sample) for sample in samples]
        prompts = [(p, sample) for p, sample in prompts if p is not None]
        for start in range(0, len(prompts), TOKENIZE_BATCH):  # batched, as the phase-3 cache tokenises
            chunk = prompts[start:start + TOKENIZE_BATCH]
            for ids, (_, sample) in zip(tokenizer([p for p, _ in chunk])["input_ids"], chunk):
                rows.setdefault(tuple(ids), sample)
    return PromptColumns(rows)
