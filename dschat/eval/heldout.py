"""What the report evaluates: the held-out prompts and pairs of the embedded dataset, and how both
actors decode (:class:`EvalSettings`, identical for the two)."""
from __future__ import annotations

from dataclasses import dataclass

from dschat.data.builtin import distinct_prompts, read_rows

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
