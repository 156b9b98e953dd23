"""What the report evaluates: the held-out prompts and pairs of the embedded dataset, and how both
actors decode (:class:`EvalSettings`, identical for the two)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from dschat.data.builtin import distinct_prompts, read_rows
from dschat.errors import UserError


@dataclass
class EvalSettings:
    """What the report evaluates and how both actors decode (identical for the two)."""

    max_prompts: int | None = None  # None: all 96 distinct held-out prompts
    max_pairs: int | None = None  # None: all 300 held-out pairs
    batch_size: int = 16  # scoring batch, and the generation batch unless generation_batch_size is set
    generation_batch_size: int | None = None
    max_new_tokens: int = 64
    max_seq_len: int = 512  # truncation of the reward model's pair texts, as step 2
    seed: int = 1234
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    device: str = "auto"
    n_examples: int = 3


def heldout_prompts(limit: int | None = None) -> list[str]:
    """Distinct prompts of the builtin eval split, in first-appearance order (the file is shuffled)."""
    prompts = distinct_prompts("eval")
    return prompts[:limit] if limit else prompts


def heldout_pairs(limit: int | None = None) -> list[dict]:
    """The builtin eval split's (prompt, chosen, rejected) rows."""
    rows = read_rows("eval")
    return rows[:limit] if limit else rows


# The lowest sampling temperature: logits / t stay finite in float32.
MIN_TEMPERATURE = 1e-6


def check_sampling(temperature: float, top_p: float, top_k: int | None = None, *, greedy: str = "pass --greedy") -> None:
    """Sampling settings ``generate`` accepts: a finite ``--temperature`` of at least ``MIN_TEMPERATURE``
    (generate divides float32 logits by it: 1e-300 overflows them to inf and sampling fails on NaN
    probabilities), 0 < ``--top_p`` <= 1 and, when given, ``--top_k`` >= 0 (0: off); else one
    :class:`UserError` line naming the option, ending with ``greedy`` (how this tool decodes greedily
    instead). Shared by the report and inference/chatbot.py."""
    if not temperature > 0:  # NaN fails too
        raise UserError(f"--temperature must be > 0 when sampling, got {temperature}; or {greedy} (greedy decoding)")
    if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise UserError(f"--temperature must be a finite number of at least {MIN_TEMPERATURE:g} when sampling, "
                        f"got {temperature}; or {greedy} (greedy decoding)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1] when sampling (1: off), got {top_p}; or {greedy} (greedy decoding)")
    if top_k is not None and top_k < 0:
        raise UserError(f"--top_k must be >= 0 when sampling (0: off), got {top_k}; or {greedy} (greedy decoding)")
