"""Per-phase tokenisation of raw rows into a :class:`~dschat.data.token_dataset.PromptDataset`.

Tokenisation follows upstream's ``create_dataset_split`` exactly (its ``data_utils.py``;
docs/upstream.md#prompts-and-padding-in-step-3):

* phase 1: ``prompt_and_chosen + eot``, truncated and padded to ``max_seq_len``; items are
  ``{"input_ids", "attention_mask", "labels"}`` (1-D) with ``labels = -100`` on padding only:
  prompt tokens are trained on, as upstream.
* phase 2: ``prompt_and_chosen + eot`` and ``prompt_and_rejected + eot``, each ``[1, max_seq_len]``;
  a row is kept only if both texts exist. A pair whose token rows do not share their first token
  (a tokenizer without BOS and an empty prompt, say), or that is one token on both sides, is dropped
  and counted in ``filtered`` (:func:`comparable_pairs`): the pairwise loss compares the two sides
  from their first difference on, after at least one shared token (upstream asserted it mid-run).
* phase 3: ``get_prompt`` tokenised without truncation; prompts longer than ``max_seq_len`` (the
  max prompt length) are dropped and counted in ``filtered``; items hold the prompt
  *flipped* so :class:`~dschat.data.collators.DataCollatorRLHF` can left-pad by right-padding.

Texts are tokenised in batches (fast), unpadded; padding is added when an item is read. The tensors
are identical to upstream's one-call-per-sample ``padding="max_length"`` tokenisation (tested).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

from dschat.data.adapters.base import PromptRawDataset
from dschat.data.dispatch import get_raw_dataset
from dschat.data.phases import PhaseRows, empty_phase, select_phase_rows
from dschat.data.token_dataset import PromptDataset, TokenRows
from dschat.errors import UserError, first_line

#: Texts per tokenizer call.
TOKENIZE_BATCH = 1024


def _tokenize(tokenizer: Any, texts: Sequence[str], max_length: int | None) -> TokenRows:
    """Batched tokenisation; with ``max_length``, truncated to it (padding is added on read)."""
    ids: list[list[int]] = []
    masks: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        batch = list(texts[start:start + TOKENIZE_BATCH])
        if max_length is None:
            enc = tokenizer(batch)
        else:
            enc = tokenizer(batch, max_length=max_length, truncation=True)
        ids.extend(enc["input_ids"])
        masks.extend(enc["attention_mask"])
    return TokenRows.from_lists(ids, masks)


def _first_ids(rows: TokenRows) -> torch.Tensor:
    """Each row's first token id, -1 for an empty row. Shape: (rows,) int64."""
    first = torch.full((len(rows),), -1, dtype=torch.long)
    nonempty = rows.lengths() > 0
    first[nonempty] = rows.ids[rows.offsets[:-1][nonempty]].long()
    return first


def comparable_pairs(chosen: TokenRows, rejected: TokenRows) -> torch.Tensor:
    """Indices of the pairs step 2's pairwise loss can compare: both sides start with the same token,
    and at least one side has a second token (a one-token pair has no position after the shared one
    once a batch is trimmed to its longest row). Shape: (kept,) int64, in order."""
    c_first, r_first = _first_ids(chosen), _first_ids(rejected)
    longest = torch.maximum(chosen.lengths(), rejected.lengths())
    return ((c_first >= 0) & (c_first == r_first) & (longest >= 2)).nonzero().flatten()


def count_identical_pairs(chosen: TokenRows, rejected: TokenRows) -> int:
    """How many pairs have the same tokens on both sides (a duplicate, or two answers the length cut
    made equal). Of stored rows; :func:`dschat.rl_math.preference.identical_pairs` is the mask of a
    padded batch's."""
    lengths = chosen.lengths()
    same = (lengths == rejected.lengths()).nonzero().flatten()
    if same.numel() == 0:
        return 0
    n = lengths[same]
    pair = torch.repeat_interleave(torch.arange(same.numel()), n)  # each compared token's pair
    within = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)
    differ = (chosen.ids[chosen.offsets[same][pair] + within].long()
              != rejected.ids[rejected.offsets[same][pair] + within].long())
    return int((torch.zeros(same.numel(), dtype=torch.long).index_add_(0, pair, differ.long()) == 0).sum())


def _check_pad(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is None:
        raise UserError(
            "the tokenizer has no pad token; load it with dschat.models.tokenizer.load_hf_tokenizer "
            "(which sets one) or set tokenizer.pad_token"
        )
    return int(tokenizer.pad_token_id)


#: What an adapter's getter raises on a row whose fields have another shape than the hub dataset's.
_ROW_SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError)


def _read_row(read: Callable[[Any], str | None], sample: Any, raw_dataset: PromptRawDataset) -> str | None:
    """``read(sample)``, an adapter's getter; a row whose fields do not have the shape the adapter reads
    (a local copy of a hub dataset with a structured field flattened, an empty list, a missing key) is
    one :class:`UserError` line showing the row."""
    try:
        return read(sample)
    except _ROW_SHAPE_ERRORS as err:
        shown = repr(sample)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise UserError(f"dataset {raw_dataset.dataset_name}: a row does not have the fields its adapter reads "
                        f"({type(err).__name__}: {first_line(err)}): {shown}; fix or drop that row") from None


def create_dataset_split(
    current_dataset: Iterable[Any],
    raw_dataset: PromptRawDataset,
    train_phase: int,
    tokenizer: Any,
    end_of_conversation_token: str,
    max_seq_len: int,
    source: tuple[int, int] | None = None,
) -> PromptDataset:
    """Tokenise one split of one dataset for ``train_phase`` (upstream's function, batched).

    Phase 3: ``source`` is ``(--data_path entry, split)`` (0 train, 1 eval); each prompt's
    :data:`~dschat.data.token_dataset.PromptSource` ends with its position in ``current_dataset``.
    Without it (upstream's call) the prompts have no sources."""
    padding_side = getattr(tokenizer, "padding_side", "right")
    filtered = 0
    if train_phase == 1:
        texts = [t + end_of_conversation_token for t in
                 (_read_row(raw_dataset.get_prompt_and_chosen, s, raw_dataset) for s in current_dataset)
                 if t is not None]
        chosen = _tokenize(tokenizer, texts, max_seq_len) if texts else TokenRows.empty()
        result = PromptDataset(None, chosen, None, _check_pad(tokenizer), 1, max_seq_len=max_seq_len, padding_side=padding_side)
        print(f"Creating dataset {raw_dataset.dataset_name_clean} for train_phase={train_phase} size={len(result)}")
    elif train_phase == 2:
        chosen_texts, rejected_texts = [], []
        for sample in current_dataset:
            chosen_sentence = _read_row(raw_dataset.get_prompt_and_chosen, sample, raw_dataset)
            reject_sentence = _read_row(raw_dataset.get_prompt_and_rejected, sample, raw_dataset)
            if chosen_sentence is not None and reject_sentence is not None:
                chosen_texts.append(chosen_sentence + end_of_conversation_token)
                rejected_texts.append(reject_sentence + end_of_conversation_token)
        chosen = _tokenize(tokenizer, chosen_texts, max_seq_len) if chosen_texts else TokenRows.empty()
        rejected = _tokenize(tokenizer, rejected_texts, max_seq_len) if rejected_texts else TokenRows.empty()
        keep = comparable_pairs(chosen, rejected)
        filtered = len(chosen) - keep.numel()
        if filtered:
            chosen, rejected = chosen.take(keep), rejected.take(keep)
        result = PromptDataset(None, chosen, rejected, _check_pad(tokenizer), 2, max_seq_len=max_seq_len,
                               padding_side=padding_side, filtered=filtered)
        print(f"Creating dataset {raw_dataset.dataset_name_clean} for train_phase={train_phase} size={len(result)}"
              + (f" filtered={filtered}" if filtered else ""))
        if filtered:
            print(f"Warning: {filtered} of {len(keep) + filtered} pairs of {raw_dataset.dataset_name} left out: their "
                  "chosen and rejected tokens differ at the first position (or are one token each), so the "
                  "pairwise loss has no shared prompt to compare them after; give every pair a prompt, or use "
                  "a tokenizer that starts every text with a BOS token")
        same = count_identical_pairs(chosen, rejected)
        if same:
            print(f"Note: {same} of {len(result)} pairs of {raw_dataset.dataset_name} have the same tokens chosen "
                  f"and rejected (duplicates, or cut equal at --max_seq_len {max_seq_len}): kept, as upstream, they "
                  "add a constant to the loss and count as wrong in the accuracy; a longer --max_seq_len keeps "
                  "answers that differ late apart")
    elif train_phase == 3:
        found = [(at, p) for at, p in enumerate(_read_row(raw_dataset.get_prompt, s, raw_dataset)
                                                for s in current_dataset) if p is not None]
        rows = _tokenize(tokenizer, [p for _, p in found], None) if found else TokenRows.empty()
        lengths = rows.lengths()
        empty = int((lengths == 0).sum())  # empty text and no BOS: nothing for the actor to answer
        keep = ((lengths > 0) & (lengths <= max_seq_len)).nonzero().flatten()
        filtered = len(rows) - keep.numel()
        if empty:
            print(f"Warning: {empty} of {len(rows)} prompts of {raw_dataset.dataset_name} have no tokens (an empty "
                  "text, and the tokenizer adds no BOS): left out, as the actor would answer a context of padding "
                  "only (upstream kept them); counted in filtered")
        sources = None
        if source is not None:  # each kept prompt's PromptSource: its position in this split
            positions = torch.tensor([at for at, _ in found], dtype=torch.long)[keep]
            sources = torch.stack([torch.full_like(positions, source[0]), torch.full_like(positions, source[1]),
                                   positions], dim=1)
        result = PromptDataset(
            rows.take(keep), None, None, _check_pad(tokenizer), 3,
            max_seq_len=max_seq_len, padding_side=padding_side, filtered=filtered, prompt_sources=sources,
        )
        print(f"Creating dataset {raw_dataset.dataset_name_clean} for train_phase={train_phase} size={len(result)} filtered={filtered}")
    else:
        raise UserError(f"train_phase must be 1, 2 or 3, got {train_phase}")
    return result


def create_dataset(
    local_rank: int,
    dataset_name: str,
    data_split: str,
    output_path: str,
    train_phase: int,
    seed: int | None,
    tokenizer: Any,
    end_of_conversation_token: str,
    max_seq_len: int,
    rebuild: bool = False,
) -> tuple[PromptDataset, PromptDataset]:
    """Tokenised (train, eval) rows of one dataset for ``train_phase`` (upstream's function)."""
    del rebuild  # upstream's .npy index rebuild flag; indices are computed in memory
    raw = get_raw_dataset(dataset_name, output_path, seed, local_rank)
    sel = select_phase_rows(raw, data_split, train_phase, seed, output_path, local_rank)
    return tokenize_selection(sel, train_phase, tokenizer, end_of_conversation_token, max_seq_len)


def tokenize_selection(
    sel: PhaseRows, train_phase: int, tokenizer: Any, eot: str, max_seq_len: int, dataset_index: int | None = None,
) -> tuple[PromptDataset, PromptDataset]:
    """(train, eval) of one dataset's selected rows (``dataset_index``: its ``--data_path`` entry, which
    phase-3 prompts' sources begin with; None: no sources); an empty split is refused or warned about
    (:func:`empty_phase`)."""
    out = []
    for part, (split, rows) in enumerate((("train", sel.train), ("eval", sel.eval))):
        ds = create_dataset_split(rows, sel.raw, train_phase, tokenizer, eot, max_seq_len,
                                  None if dataset_index is None else (dataset_index, part))
        if len(ds) == 0 and len(rows) > 0:
            if train_phase == 3:
                why = f"all {len(rows)} prompts are longer than max_seq_len={max_seq_len} tokens or have none"
                fix = "raise --max_prompt_seq_len or use shorter prompts, not empty ones"
            elif ds.filtered:
                why = (f"all {ds.filtered} pairs of its {len(rows)} rows differ at their first token (or are one "
                       "token each)")
                fix = "give every pair a prompt that starts both texts, or use a tokenizer that adds a BOS token"
            else:
                why = f"none of its {len(rows)} rows has the texts phase {train_phase} needs"
                fix = "check the prompt/chosen/rejected fields"
            empty_phase(sel.raw, split, train_phase, why, fix)
        if (train_phase == 2 and split == "train" and len(ds)
                and count_identical_pairs(ds.chosen_dataset, ds.reject_dataset) == len(ds)):
            raise UserError(f"dataset {sel.raw.dataset_name!r}: every one of its {len(ds)} phase-2 train pairs has the "
                            f"same tokens chosen and rejected (duplicates, or cut equal at --max_seq_len {max_seq_len}), "
                            "so there is nothing to learn from it; give pairs whose answers differ within the first "
                            "--max_seq_len tokens, raise --max_seq_len, or drop it from --data_path")
        out.append(ds)
    return out[0], out[1]
