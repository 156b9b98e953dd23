"""Reading step 3's ``metrics.jsonl``: the per-step PPO records and the held-out evaluation records.

Tolerant of what a crash or a rename leaves: blank, truncated or non-object lines and non-finite
values are skipped.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from dschat.errors import UserError
from dschat.paths import BEST_DIR, METRICS_FILE

# The "kind" of step 3's held-out evaluation records in metrics.jsonl (dschat.rlhf.heldout.evaluation writes them).
EVAL_KIND = "eval"

# Names accepted for each field read from metrics.jsonl (the first is the documented one).
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    # global_step first: step 3's per-epoch "step" restarts every epoch.
    "step": ("global_step", "step", "ppo_step", "iteration"),
    "reward": ("reward", "average_reward", "reward_score", "mean_reward", "reward_mean"),
    "kl_to_ref": ("kl_to_ref", "kl_ref", "ref_kl", "kl", "mean_kl"),
    "response_length": ("response_length", "mean_response_length", "response_len", "answer_length"),
    # Multi-turn episodes (step 3's --env) only: mean actor turns and environment tokens per episode,
    # the share of episodes cut, the seconds spent in the environments per iteration.
    **{name: (name,) for name in ("turns", "observation_tokens", "cut_share", "time_env")},
}


def finite_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def read_eval_records(path: str | Path, keep: Callable[[dict], bool] | None = None) -> list[dict[str, Any]]:
    """The evaluation records of a ``metrics.jsonl`` (``"kind": "eval"``), by step; unreadable lines skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = record.get("global_step", 0) if isinstance(record, dict) else None  # a damaged step: skipped
        good = (isinstance(step, int) and not isinstance(step, bool)) or (isinstance(step, float) and math.isfinite(step))
        if good and record.get("kind") == EVAL_KIND and (keep is None or keep(record)):
            by_step[int(step)] = record
    return [by_step[k] for k in sorted(by_step)]


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Per-PPO-step records from ``metrics.jsonl``, tolerant of what a crash or a rename leaves.

    Reads ``global_step`` (else ``step``), ``reward``, ``kl_to_ref`` and ``response_length`` (or an
    alias in :data:`METRIC_ALIASES`), and with ``--env`` ``turns``, ``observation_tokens``,
    ``cut_share`` and ``time_env``; other keys are ignored. Blank, truncated or non-object lines and
    non-finite values are skipped; a missing step is the line's position; a repeated step keeps its
    last record. Sorted by step.
    """
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[float, dict[str, float]] = {}
    for index, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(raw, dict) or raw.get("kind") == "eval":  # held-out evaluations: read_eval_records
            continue
        record: dict[str, float] = {}
        for name, aliases in METRIC_ALIASES.items():
            for alias in aliases:
                value = finite_number(raw.get(alias))
                if value is not None:
                    record[name] = value
                    break
        record.setdefault("step", float(index))
        if len(record) > 1:
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]


def find_metrics_file(rlhf: str | Path) -> Path | None:
    """Step 3 writes ``metrics.jsonl`` in its --output_dir: the parent of ``actor/``, the folder itself
    (a step-3 output root given as the actor), or two levels up from the best actor (``<out>/best/actor``).
    None when none of those holds one."""
    rlhf = Path(rlhf)
    candidates = [rlhf.parent / METRICS_FILE, rlhf / METRICS_FILE]
    if rlhf.parent.name == BEST_DIR:
        candidates.append(rlhf.parent.parent / METRICS_FILE)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    return None


def metrics_argument(metrics: str | Path) -> Path:
    """The file ``--metrics`` names: the file itself, or the ``metrics.jsonl`` of a step-3 output folder.
    A folder without one, or a path that does not exist, is one :class:`UserError` line."""
    metrics = Path(metrics)
    if metrics.is_dir() and (metrics / METRICS_FILE).is_file():  # step 3's output folder
        return metrics / METRICS_FILE
    if metrics.is_dir():
        raise UserError(f"--metrics {metrics} is a folder without a {METRICS_FILE}; pass step 3's "
                        f"<output_dir>/{METRICS_FILE}")
    if not metrics.is_file():
        raise UserError(f"--metrics {metrics} does not exist; pass step 3's <output_dir>/{METRICS_FILE}")
    return metrics
