"""Reward functions the tests load by ``--reward_fn reward_fixtures:<name>`` (``tests/`` is on
``sys.path`` under pytest): well-behaved ones and each way a function can go wrong."""
from __future__ import annotations

from typing import Any


def length(prompts: list[str], answers: list[str]) -> list[float]:
    """Words in the answer / 10: no columns taken."""
    return [len(a.split()) / 10.0 for a in answers]


def chosen_overlap(prompts: list[str], answers: list[str], chosen: list[str]) -> list[float]:
    """Fraction of the answer's words found in the dataset's ``chosen`` column (takes that column only)."""
    out = []
    for answer, ref in zip(answers, chosen):
        words = answer.lower().split()
        ref_words = set(ref.lower().split())
        out.append(sum(w in ref_words for w in words) / max(len(words), 1))
    return out


def seen_columns(prompts: list[str], answers: list[str], **columns: Any) -> list[float]:
    """Records the column names it was given (``seen_columns.last``); scores 0."""
    seen_columns.last = sorted(columns)  # type: ignore[attr-defined]
    return [0.0] * len(answers)


def raises_on_boom(prompts: list[str], answers: list[str], **_: Any) -> list[float]:
    if any("boom" in a for a in answers):
        raise RuntimeError("cannot score this")
    return [0.0] * len(answers)


def always_raises(prompts: list[str], answers: list[str], **_: Any) -> list[float]:
    raise KeyError("reference")


def one_short(prompts: list[str], answers: list[str], **_: Any) -> list[float]:
    return [0.0] * (len(answers) - 1)


def nan_on_last(prompts: list[str], answers: list[str], **_: Any) -> list[float]:
    return [0.0] * (len(answers) - 1) + [float("nan")]


NOT_CALLABLE = 3
