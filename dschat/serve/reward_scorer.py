"""A step-2 reward model scoring texts: what ``/get_reward`` computes.

The model and its tokenizer load as the evaluation loads them (:func:`dschat.eval.scoring.load_reward`:
strict, body and value head), and score as it scores (:func:`dschat.eval.scoring.score_sequences`:
right-padded batches of similar lengths, the value at the last real token). Each text is tokenised
with the reward model's tokenizer as it is -- no end-of-conversation token is added -- and cut to
``max_len`` tokens, keeping its last ones: the score is read at the last token (as step 3's
scoring keeps a text's end).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dschat.eval.scoring import load_reward, pick_device, score_sequences

__all__ = ["RewardScorer", "load_reward_scorer"]


@dataclass
class RewardScorer:
    """A loaded reward model: :meth:`score` maps texts to one float each, in order. One scoring at a
    time (a lock): concurrent requests queue rather than hold several batches of activations."""

    folder: Path
    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    max_len: int
    batch_size: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def score(self, texts: Sequence[str]) -> list[float]:
        # The end score is read at the last token: a text too long keeps its end (as step 3's scoring does).
        rows = [self.tokenizer(text)["input_ids"][-self.max_len:] for text in texts]
        with self._lock:
            return score_sequences(self.model, rows, self.tokenizer.pad_token_id, self.batch_size)


def load_reward_scorer(folder: str | Path, *, device: str = "auto", max_len: int | None = None,
                       batch_size: int = 16) -> RewardScorer:
    """The reward model of a step-2 folder on ``device`` ("auto": the GPU if there is one). ``max_len``
    (None: the model's ``max_position_embeddings``, else the tokenizer's ``model_max_length``) caps the
    tokens of a text."""
    model, tokenizer = load_reward(folder, pick_device(device))
    if max_len is None:
        max_len = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return RewardScorer(Path(folder), model, tokenizer, int(max_len), batch_size)
