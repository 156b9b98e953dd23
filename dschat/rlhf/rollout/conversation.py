"""A multi-turn batch's KV cache, kept between its turns by the decoding paths that can continue it.

:class:`Conversation` is what :class:`~dschat.rlhf.episodes.EpisodePlayer` hands the
:class:`~dschat.rlhf.rollout.generator.RolloutGenerator` with each turn. Three paths continue it: the
sample loop (:class:`~dschat.rlhf.rollout.sample_loop.SampleLoopPath`, a Hugging Face
``DynamicCache``), dschat's Hybrid Engine at ``--inference_tp_size 1``
(:class:`~dschat.rlhf.rollout.dschat_engine.DschatEnginePath`, its
:class:`~dschat.models.decoder.kv_cache.StaticKVCache`) and the CUDA-graphs path
(:class:`~dschat.rlhf.rollout.graphs.GraphsPath`, a Hugging Face ``StaticCache``); every other path
decodes the conversations from scratch and the cache is dropped.
"""
from __future__ import annotations

from typing import Literal, Sequence, Union

import torch
from transformers import DynamicCache, StaticCache

from dschat.models.decoder.kv_cache import StaticKVCache
from dschat.models.packing import attention_window

__all__ = ["Conversation", "KeptCache", "Room", "compact_columns", "why_not_kept"]

KeptCache = Union[DynamicCache, StaticKVCache, StaticCache]  # the sample loop's, dschat's Hybrid Engine's, graphs'
Room = Literal["fits", "compact", "prefill", "past"]  # what Conversation.make_room says a path does


class Conversation:
    """The KV cache of ``B`` conversations (multi-turn episodes) kept between their turns, which a
    path that can (see the module docstring) continues instead of prefilling each conversation again.

    Layout: the cache's ``C`` columns are shared by the rows; :attr:`mask` (B, C) is 1 on the columns
    that hold a conversation's token, in the conversation's order, and 0 on holes (a row's left
    padding, the padding before a row's shorter new tokens, a turn's tokens after the row's answer
    ended, every column of a row that no longer decodes). ``cached[i]`` is the number of row ``i``'s
    tokens whose keys and values are in the cache (the ones in its row of the mask). The position ids
    are ``cumsum - 1`` of the mask, so every token has the position it has in its compact conversation.

    A turn: :meth:`next_turn` gives each row's whole conversation so far and whether it decodes
    (``active``); the path feeds each active row's tokens past ``cached[i]``, left-padded among
    themselves (:meth:`inputs`: at least its last token, whose logits give the next one), decodes,
    and records the new columns (:meth:`decoded`); then :meth:`keep` says how many of each row's
    answer tokens its conversation took. :attr:`reused` says whether the last turn went through the
    cache (its rollout then has ``B`` rows, answers from column :attr:`width`); a turn another path
    decoded leaves it False, and the generator then :meth:`drop` s the cache (the next turn that can
    continue prefills every row's whole conversation again).

    :attr:`owner` names the path whose cache it holds; a path continues only its own (:meth:`claim`
    drops another's, so that turn prefills every row's whole conversation). A path that feeds the
    kept columns' ids again (Hugging Face ``generate`` skips the cached ones) gets them from
    :meth:`past_ids`.

    Memory: every row, active or not, has a cache column for every column of the batch: each turn
    adds the longest row's new tokens plus the turn's decoded tokens, minus one, for all ``B`` rows.
    A path whose cache outlives the episodes or has a fixed size bounds it from :attr:`limit` (the
    episode player's ``max_context``: what the decoding engines are sized for): before a turn that
    would pass the bound it closes the holes (:meth:`compact`) where that is enough, else, while the
    conversations fit compact (:meth:`fits_compact`), it drops the cache and prefills them again
    (:meth:`make_room` decides which).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # the longest conversation and answer room a turn may need (None: not said)
        self.cache: KeptCache | None = None
        self.owner: str | None = None  # the name of the path whose cache this is
        self.capacity = 0  # the columns a fixed-size cache holds (its path sets it)
        self.mask: torch.Tensor | None = None  # (B, C)
        self.cached: list[int] = []
        self.contexts: list[list[int]] = []
        self.active: list[bool] = []
        self.pad_id = 0
        self.reused = False
        self.width = 0  # the last turn's input width: its rollout's answers start at this column
        self.fed = 0  # answer columns of the last turn in the cache (its decoded tokens less one)
        self.why_not: str | None = None  # why a path that can continue a cache prefilled the turn again

    def next_turn(self, contexts: Sequence[Sequence[int]], active: Sequence[bool], pad_id: int) -> None:
        """Each of the ``B`` rows' whole conversation so far, and whether it decodes this turn."""
        self.contexts = [list(c) for c in contexts]
        self.active = [bool(a) for a in active]
        self.pad_id = pad_id
        self.reused = False

    def claim(self, path: str) -> None:
        """``path`` continues this turn: a cache another path made is dropped first."""
        if self.owner != path:
            self.drop()
            self.owner = path

    def drop(self) -> None:
        """Free the cache (another path decoded the turn, or the episodes are played): the next
        continued turn prefills every row's whole conversation."""
        self.cache, self.mask, self.cached, self.fed, self.capacity = None, None, [], 0, 0

    def compact(self) -> torch.Tensor:
        """Close the holes of the kept columns: each row's cached columns move, in order, to the right
        end of the first ``C'`` columns (``C'``: the most any row has; a row that decodes no more keeps
        only its first column). Returns ``source`` (B, C'): the old column each new one takes (the
        path moves its cache's keys and values the same way: :func:`compact_columns`). Exact: a
        cached key already holds its token's position, and the columns after them (the turn's new
        ones, the answer) still come after every one of them."""
        assert self.mask is not None
        keep = self.mask.bool()
        for i, active in enumerate(self.active):
            if not active:  # decodes no more: only its first column stays (a row needs one key)
                first = keep[i].nonzero()[:1]
                keep[i] = False
                keep[i, first] = True
                self.cached[i] = len(first)
        width = self.compact_width()
        order = torch.argsort(keep.int(), dim=1, stable=True)  # holes first, then the row's columns in order
        source = order[:, -width:]  # (B, C')
        self.mask = keep.gather(1, source).to(self.mask.dtype)
        return source

    def compact_width(self) -> int:
        """``C'``: the kept columns :meth:`compact` leaves, computed without moving anything."""
        assert self.mask is not None
        counts = [n if active else min(n, 1) for n, active in zip(self.mask.bool().sum(1).tolist(), self.active)]
        return max(1, max(counts, default=1))

    def make_room(self, new: int, room: int, bound: int, *, movable: bool = True) -> Room:
        """What a path whose cache holds at most ``bound`` columns does before a turn that feeds
        ``new`` columns (from :meth:`inputs`) and decodes up to ``room`` tokens, decided before anything
        moves:

        * ``"fits"``: continue as it is (also when nothing is kept yet);
        * ``"compact"``: closing the kept columns' holes is enough (``movable``: the path can move its
          cache's columns): :meth:`compact`, then move the keys and values (:func:`compact_columns`);
        * ``"prefill"``: it is not, but the conversations prefilled again, compact, fit: :meth:`drop`,
          then :meth:`inputs` again;
        * ``"past"``: neither fits: the turn goes past ``bound``, as the path sees fit (dschat's
          engine closes the holes and moves to a larger cache; the graphs path prefills again into
          a larger one)."""
        if self.mask is None or self.mask.shape[1] + new + room <= bound:
            return "fits"
        if movable and self.compact_width() + new + room <= bound:
            return "compact"
        if self.fits_compact(room, bound):
            return "prefill"
        return "past"

    def fits_compact(self, room: int, columns: int) -> bool:
        """Whether the decoding rows' whole conversations, prefilled again, and ``room`` answer
        columns fit in ``columns``."""
        return max((len(c) for c, a in zip(self.contexts, self.active) if a), default=1) + room <= columns

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The turn's new columns (ids, mask), (B, N), N >= 1, left-padded; counts them as cached."""
        if self.cache is None:
            self.cached = [0] * len(self.contexts)  # a fresh cache: every row's whole conversation
        else:
            for i, active in enumerate(self.active):
                if active and self.cached[i] >= len(self.contexts[i]):
                    # Nothing new (an empty observation after a fed EOS): the last token is fed again
                    # for its logits, and its cached column becomes a hole.
                    assert self.mask is not None
                    last = int(torch.nonzero(self.mask[i]).max())
                    self.mask[i, last] = 0
                    self.cached[i] -= 1
        # A fresh cache: an active row's whole conversation; a row that decodes no more, its first token
        # (a row of only holes would have no key to attend to).
        rows = [(c if active else c[:1]) if self.cache is None else (c[k:] if active else [])
                for c, k, active in zip(self.contexts, self.cached, self.active)]
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            if row:
                ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
                mask[i, width - len(row):] = 1
            self.cached[i] += len(row)
        self.width = width
        return ids.to(device), mask.to(device)

    def past_ids(self, device: torch.device) -> torch.Tensor:
        """(B, C) the token id of each kept column (after :meth:`inputs`): a row's columns of the mask
        hold the first tokens of its conversation, in order; holes hold the padding id."""
        assert self.mask is not None
        ids = torch.full(self.mask.shape, self.pad_id, dtype=torch.long)
        mask = self.mask.bool().cpu()
        for i, context in enumerate(self.contexts):
            n = int(mask[i].sum())
            ids[i, mask[i]] = torch.tensor(context[:n], dtype=torch.long)
        return ids.to(device)

    def decoded(self, new_mask: torch.Tensor, answer_width: int) -> None:
        """After the path decoded ``answer_width`` tokens from the new columns ``new_mask``."""
        self.fed = answer_width - 1
        parts = [new_mask, new_mask.new_ones((new_mask.shape[0], self.fed))]
        if self.mask is not None:
            parts.insert(0, self.mask.to(new_mask))
        self.mask = torch.cat(parts, dim=-1)
        self.reused = True

    def keep(self, kept: Sequence[int]) -> None:
        """After a continued turn: row ``i``'s conversation took its first ``kept[i]`` answer tokens
        (those after them, and every one of a row that did not decode, become holes)."""
        if not self.reused or self.mask is None:
            return
        if self.fed:
            taken = torch.tensor([k if a else 0 for k, a in zip(kept, self.active)], device=self.mask.device)
            columns = torch.arange(self.fed, device=self.mask.device)
            self.mask[:, -self.fed:] = (columns[None] < taken[:, None]).to(self.mask)
        for i, a in enumerate(self.active):
            if a:
                self.cached[i] += min(kept[i], self.fed)


def why_not_kept(config: object) -> str | None:
    """Why a model's turns cannot continue a kept cache (its attention slides over a window, and the
    window counts cache columns: a kept cache's holes would shorten it), or None."""
    window = attention_window(config)
    if window is None:
        return None
    return f"the model attends over a sliding window of {window} tokens, which a kept cache's holes would shorten"


def compact_columns(tensor: torch.Tensor, source: torch.Tensor) -> None:
    """In place: ``tensor`` (B, H, S, D) keys or values take, in their first ``C'`` columns, the
    columns ``source`` (B, C') names (:meth:`Conversation.compact`); its storage does not move."""
    B, H, _, D = tensor.shape
    index = source.to(tensor.device)[:, None, :, None].expand(B, H, source.shape[1], D)
    tensor[:, :, :source.shape[1]] = tensor.gather(2, index)
