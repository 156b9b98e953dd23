"""Phase selection: the raw rows of each dataset that one training phase uses (before tokenising).

Upstream's ``create_dataset`` takes chunk ``train_phase - 1`` of both the train and the eval split
(``--data_split``); :func:`plan_phase_data` loads every dataset and selects its rows, so every
input error surfaces before anything is tokenised or written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from dschat.data.adapters.base import PromptRawDataset, _subset
from dschat.data.dispatch import get_raw_dataset
from dschat.data.split import get_raw_dataset_split_index
from dschat.errors import UserError


@dataclass
class PhaseRows:
    """One dataset's raw rows for one phase: the chunk of its train split and of its eval split."""

    raw: PromptRawDataset
    train: Any
    eval: Any


def empty_phase(raw: PromptRawDataset, split: str, phase: int, why: str, fix: str) -> None:
    """A dataset that adds no rows to a phase: an error for train, a warning for eval.

    An empty eval chunk of one dataset is tolerated (small sets round to zero rows); an empty eval
    set overall is an error in phases 1-2 (:func:`require_eval`).
    """
    message = f"dataset {raw.dataset_name!r}, phase {phase}, {split} split is empty: {why}; {fix}"
    if split == "eval":
        print(f"Warning: {message}")
        return
    raise UserError(message)


def require_eval(names: Sequence[str], phase: int, size: int) -> None:
    """An empty eval set is an error in phases 1-2.

    Upstream's step-1/2 evaluation divides by the number of eval batches, so an empty eval set
    crashes there, after the models are built. Phase 3 never evaluates on it.
    """
    if size == 0 and phase in (1, 2):
        raise UserError(
            f"phase {phase} eval split is empty for --data_path {' '.join(names)}: no dataset has held-out "
            "rows for this phase; add rows (or an eval.*/test.* file) or give the phase a larger --data_split share"
        )


def select_phase_rows(
    raw: PromptRawDataset,
    data_split: str,
    train_phase: int,
    seed: int | None,
    output_path: str = "",
    local_rank: int = -1,
) -> PhaseRows:
    """Chunk ``train_phase - 1`` of BOTH the raw train and raw eval splits (upstream's create_dataset)."""
    parts = {}
    for split_name, data in (("train", raw.get_train_data()), ("eval", raw.get_eval_data())):
        index = get_raw_dataset_split_index(
            local_rank, output_path, raw.dataset_name_clean, seed, split_name, data_split, train_phase - 1, len(data),
        )
        parts[split_name] = (_subset(data, index), len(data))
    for split_name, (rows, total) in parts.items():
        if len(rows) == 0:
            empty_phase(
                raw, split_name, train_phase,
                f"--data_split {data_split} gives phase {train_phase} 0 of its {total} {split_name} rows",
                "give that phase a larger share or add rows",
            )
    return PhaseRows(raw, parts["train"][0], parts["eval"][0])


@dataclass
class PhasePlan:
    """Validated inputs of one phase's build: every dataset loaded and its rows selected."""

    data_path: list[str]
    selections: list[PhaseRows]
    sft_selections: list[PhaseRows]


def check_data_path(data_path: Sequence[str]) -> None:
    """``--data_path`` must name at least one dataset."""
    if not data_path:
        raise UserError("--data_path is empty; name at least one dataset")


def plan_phase_data(
    data_path: Sequence[str],
    sft_only_data_path: Sequence[str],
    data_split: str,
    train_phase: int,
    seed: int | None,
    output_path: str = "",
    local_rank: int = -1,
) -> PhasePlan:
    """Load every dataset and select its rows for ``train_phase``; every input error surfaces here.

    ``sft_only_data_path`` datasets use split ``"10,0,0"`` (callers pass them in phase 1 only).
    Needs no torch: ``python -m dschat.data.prepare`` validates data with it before loading a model.
    """
    check_data_path(data_path)

    def select(name: str, split: str) -> PhaseRows:
        raw = get_raw_dataset(name, output_path, seed, local_rank)
        if train_phase == 2 and not raw.has_rejected:
            use = ("use it in step 1 via --sft_only_data_path" if raw.has_chosen else
                   "it holds prompts only (no chosen answers either), for step 3's --data_path")
            raise UserError(f"dataset {name!r} has no rejected responses, so it cannot train the reward model "
                            f"(phase 2); drop it from --data_path for step 2 ({use})")
        return select_phase_rows(raw, split, train_phase, seed, output_path, local_rank)

    plan = PhasePlan(
        list(data_path),
        [select(name, data_split) for name in data_path],
        [select(name, "10,0,0") for name in sft_only_data_path],
    )
    names = list(data_path) + list(sft_only_data_path)
    require_eval(names, train_phase, sum(len(s.eval) for s in plan.selections + plan.sft_selections))
    return plan
