"""A step-2 reward model scoring texts: what ``/get_reward`` computes.

The model and its tokenizer load as the evaluation loads them (:func:`dschat.eval.scoring.load_reward`:
strict, body and value head), and score as it scores (:func:`dschat.eval.scoring.score_sequences`:
right-padded batches of similar lengths, the value at the last real token). Each text is tokenised
with the reward model's tokenizer as it is -- no end-of-conversation token is added -- and cut to
``max_len`` tokens, keeping its last ones: the score is read at the last token (as step 3's
scoring keeps a text's end). A text of no tokens (``""`` with a tokenizer that adds no BOS) has no
last token: :meth:`RewardScorer.score` refuses it (:class:`EmptyQuery`), as it refuses a text the
tokenizer cannot encode (:class:`UnencodableQuery`: a lone surrogate, which JSON's ``"\\ud800"``
decodes to, is no Unicode text). Both are a :class:`BadQuery`, the client's to fix. :func:`encode_text`
is that tokenisation, shared with the actor's prompts (:mod:`dschat.serve.actor`). ``max_len`` past
a model's position table is refused before any weight loads
(:func:`~dschat.models.registry.check_seq_len_fits_positions`).

A step-2 LoRA output's ``lora_adapter/`` folder (the adapter and ``v_head.safetensors``, no
``config.json``) is a reward model too: its base is built, the adapter merged and the value head
loaded, as step 3 loads such a critic (:func:`dschat.models.build.create_critic_model`).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from dschat.eval.scoring import load_reward, pick_device, score_sequences
from dschat.models.build import create_critic_model
from dschat.models.registry import check_seq_len_fits_positions
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.paths import is_adapter_folder

__all__ = ["BadQuery", "EmptyQuery", "NonFiniteScore", "RewardScorer", "UnencodableQuery", "UnencodableText",
           "check_unicode", "encode_text", "load_reward_scorer"]


class UnencodableText(ValueError):
    """Text the tokenizer cannot encode; the message says why in one line, without naming the text
    (its caller does: ``query[0]``, ``prompt``)."""


def check_unicode(text: str) -> None:
    """:class:`UnencodableText` naming the first lone surrogate of ``text`` (a JSON ``\\uD800``-``\\uDFFF``
    escape without its pair: no Unicode scalar value, no UTF-8; a fast tokenizer raises a ``TypeError``
    on it); nothing for text that is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UnencodableText(f"holds a lone surrogate, U+{ord(text[err.start]):04X} at character {err.start} "
                              "(a JSON \\u escape without its pair), which is not Unicode text the tokenizer can "
                              "encode; send valid Unicode") from None


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer(text)["input_ids"]``, or :class:`UnencodableText` for a text the tokenizer cannot
    encode: one holding a lone surrogate (:func:`check_unicode`), or any other ``TypeError`` /
    ``ValueError`` of the tokenizer on it (named in the message)."""
    check_unicode(text)
    try:
        return list(tokenizer(text)["input_ids"])
    except (TypeError, ValueError) as err:
        why = " ".join(str(err).split())
        raise UnencodableText(f"cannot be encoded by the tokenizer ({type(err).__name__}: {why})") from None


class BadQuery(ValueError):
    """Query ``index`` of a request cannot be scored (the client's to fix: a 422 naming it)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class EmptyQuery(BadQuery):
    """Query ``index`` of a request tokenises to no tokens, so it has no score."""

    def __init__(self, index: int) -> None:
        super().__init__(index, f"query[{index}] has no tokens (an empty text, with a tokenizer that adds no BOS), "
                                "so it has no last token to score; send a non-empty text")


class NonFiniteScore(RuntimeError):
    """The model scored query ``index`` as NaN or infinite: the model's fault, not the query's (weights
    gone non-finite in training, an overflow in its dtype). The server answers 500 naming it, rather
    than a ``null`` where a float is promised."""

    def __init__(self, index: int, score: float) -> None:
        super().__init__(f"the reward model scored query[{index}] as {score} (non-finite weights, or an overflow "
                         "in its dtype); no query of the request is answered: check the model")
        self.index = index


class UnencodableQuery(BadQuery):
    """Query ``index`` of a request is text the tokenizer cannot encode (:func:`encode_text`)."""

    def __init__(self, index: int, why: UnencodableText) -> None:
        super().__init__(index, f"query[{index}] {why}")


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
        """One finite score per text, in order; nothing is scored when a text is bad: :class:`UnencodableQuery`
        for the first text the tokenizer cannot encode, else :class:`EmptyQuery` for the first of no tokens.
        :class:`NonFiniteScore` for the first text the model scores NaN or infinite."""
        # The end score is read at the last token: a text too long keeps its end (as step 3's scoring does).
        rows: list[list[int]] = []
        for index, text in enumerate(texts):
            try:
                rows.append(encode_text(self.tokenizer, text)[-self.max_len:])
            except UnencodableText as why:
                raise UnencodableQuery(index, why) from None
        empty = next((i for i, row in enumerate(rows) if not row), None)
        if empty is not None:
            raise EmptyQuery(empty)
        with self._lock:
            scores = score_sequences(self.model, rows, self.tokenizer.pad_token_id, self.batch_size)
        bad = next((i for i, score in enumerate(scores) if not math.isfinite(score)), None)
        if bad is not None:
            raise NonFiniteScore(bad, scores[bad])
        return scores


def load_reward_scorer(folder: str | Path, *, device: str = "auto", max_len: int | None = None,
                       batch_size: int = 16) -> RewardScorer:
    """The reward model of a step-2 folder (or of its LoRA ``lora_adapter/`` folder) on ``device``
    ("auto": the GPU if there is one). ``max_len`` (None: the model's ``max_position_embeddings``, else
    the tokenizer's ``model_max_length``) caps the tokens of a text; one longer than the model's
    position table (a family whose positions are a table, OPT, GPT-2, ...) is a
    :class:`~dschat.errors.UserError` line, read from the config before any weight loads (a longer text
    would index past the table)."""
    if max_len is not None:
        check_seq_len_fits_positions(str(folder), max_len, "max_len")
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
