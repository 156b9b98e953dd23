"""A step-2 reward model scoring texts: what ``/get_reward`` computes.

The model and its tokenizer load as the evaluation loads them (:func:`dschat.eval.scoring.load_reward`:
strict, body and value head), and score as it scores (:func:`dschat.eval.scoring.score_sequences`:
right-padded batches of similar lengths, the value at the last real token). Each text is tokenised
with the reward model's tokenizer as it is -- no end-of-conversation token is added -- and cut to
``max_len`` tokens, keeping its last ones: the score is read at the last token (as step 3's
scoring keeps a text's end). A text of no tokens (``""`` with a tokenizer that adds no BOS) has no
last token: :meth:`RewardScorer.score` refuses it (:class:`EmptyQuery`).

A step-2 LoRA output's ``lora_adapter/`` folder (the adapter and ``v_head.safetensors``, no
``config.json``) is a reward model too: its base is built, the adapter merged and the value head
loaded, as step 3 loads such a critic (:func:`dschat.models.build.create_critic_model`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from dschat.eval.scoring import load_reward, pick_device, score_sequences
from dschat.models.build import create_critic_model
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.paths import is_adapter_folder

__all__ = ["EmptyQuery", "RewardScorer", "load_reward_scorer"]


class EmptyQuery(ValueError):
    """Query ``index`` of a request tokenises to no tokens, so it has no score."""

    def __init__(self, index: int) -> None:
        super().__init__(f"query[{index}] has no tokens (an empty text, with a tokenizer that adds no BOS), so it "
                         "has no last token to score; send a non-empty text")
        self.index = index


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
        """One score per text, in order; :class:`EmptyQuery` for the first text of no tokens."""
        # The end score is read at the last token: a text too long keeps its end (as step 3's scoring does).
        rows = [self.tokenizer(text)["input_ids"][-self.max_len:] for text in texts]
        empty = next((i for i, row in enumerate(rows) if not row), None)
        if empty is not None:
            raise EmptyQuery(empty)
        with self._lock:
            return score_sequences(self.model, rows, self.tokenizer.pad_token_id, self.batch_size)


def load_reward_scorer(folder: str | Path, *, device: str = "auto", max_len: int | None = None,
                       batch_size: int = 16) -> RewardScorer:
    """The reward model of a step-2 folder (or of its LoRA ``lora_adapter/`` folder) on ``device``
    ("auto": the GPU if there is one). ``max_len`` (None: the model's ``max_position_embeddings``, else
    the tokenizer's ``model_max_length``) caps the tokens of a text."""
    if is_adapter_folder(folder):
        model, tokenizer = _load_adapter_reward(folder, pick_device(device))
    else:
        model, tokenizer = load_reward(folder, pick_device(device))
    if max_len is None:
        max_len = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    return RewardScorer(Path(folder), model, tokenizer, int(max_len), batch_size)


def _load_adapter_reward(folder: str | Path, device: torch.device) -> tuple[Any, Any]:
    """A reward model's LoRA adapter folder (with ``v_head.safetensors``) as :func:`load_reward` loads
    a step-2 folder: the critic strict (``rlhf_training``), eval mode, with the folder's tokenizer."""
    tokenizer = load_hf_tokenizer(str(folder))
    model = create_critic_model(str(folder), tokenizer, None, rlhf_training=True)
    return model.to(device).eval(), tokenizer
