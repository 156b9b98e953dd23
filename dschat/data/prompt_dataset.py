"""Per-phase tokenisation, :class:`PromptDataset`, and the tokenised-dataset cache.

Tokenisation follows upstream's ``create_dataset_split`` exactly (DSE ``data_utils.py``):

* phase 1: ``prompt_and_chosen + eot``, truncated and padded to ``max_seq_len``; items are
  ``{"input_ids", "attention_mask", "labels"}`` (1-D) with ``labels = -100`` on padding only:
  prompt tokens are trained on, as upstream (DSE #301/#357).
* phase 2: ``prompt_and_chosen + eot`` and ``prompt_and_rejected + eot``, each ``[1, max_seq_len]``;
  a row is kept only if both texts exist.
* phase 3: ``get_prompt`` tokenised without truncation; prompts longer than ``max_seq_len`` (the
  max prompt length) are dropped and counted in ``filtered`` (DSE #782); items hold the prompt
  *flipped* so :class:`~dschat.data.collators.DataCollatorRLHF` can left-pad by right-padding (#457).

Texts are tokenised in batches (fast), unpadded; padding is added when an item is read. The tensors
are identical to upstream's one-call-per-sample ``padding="max_length"`` tokenisation (tested).

The cache, and how it fixes upstream (DSE #437, #558, #822, #416):

* The key is a SHA-256 over a canonical JSON of everything that changes the content: each
  dataset's name, adapter and a SHA-256 of its local files (upstream keyed on the *name*, so an
  edited JSON file kept serving stale data), the split, phase, seed, ``max_seq_len``, the
  end-of-conversation token (upstream left it out), the tokenizer's identity (class, name, vocab
  and special-token hashes, and the ids of a probe text, so a changed BOS/post-processor counts;
  upstream used only ``name_or_path``), the sft-only datasets and a format version.
* Files are ``traindata_{key}.safetensors``, ``evaldata_{key}.safetensors`` and ``meta_{key}.json``:
  token ids stored flat with row offsets, no pickles (upstream ``torch.save``-d whole ``Subset``
  objects, fragile across versions and unsafe to load). The files are written under temporary
  names and renamed into place together, the meta file last, so a reader never sees a partial
  cache, and a failed build or rebuild leaves nothing behind and any previous cache untouched.
* Building happens once under a ``filelock.FileLock`` in ``output_path``: each process takes it; the
  first builds, the others then find the files and load them. This replaces upstream's per-node
  local-rank-0 build + ``uint8`` all-reduce (which wrapped to 0 at 256 ranks) and makes a
  ``--data_output_path`` shared by ranks and nodes safe.
* The folder is the user's own (default :func:`~dschat.paths.data_cache_dir`, created 0700; upstream
  used ``/tmp/data_files``, shared by every user) and the files are 0600. A folder, cache file or
  lock that another account owns, or that group or others can write to, is never read: the run
  stops with one line naming it (:func:`check_data_output_path`), since the key is deterministic
  and anyone able to write there could plant the data a run trains on.
* ``reload=True`` (``--rebuild_data_cache``) rebuilds on processes with ``local_rank <= 0``; when a
  process group is up every rank then waits for them, and an error in a build (say, every prompt
  too long) is raised on every rank, a :class:`UserError` with the same message.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import torch
from torch.utils.data import Dataset

from dschat.data.raw_datasets import (
    DatasetSource,
    PhasePlan,
    PhaseRows,
    PromptRawDataset,
    empty_phase,
    get_raw_dataset,
    plan_phase_data,
    require_eval,
    resolve_dataset,
    select_phase_rows,
)
from dschat.data.split import get_shuffle_idx, parse_data_split
from dschat.errors import UserError
from dschat.runtime.fs import atomic_files, check_trusted, make_private_dir

#: Bump when the cache layout or tokenisation changes: old caches then miss instead of misleading.
FORMAT_VERSION = 1
#: Used when ``seed`` is None (upstream step 3's default): see :func:`create_prompt_dataset`.
DEFAULT_SEED = 1234
#: Tokenised with the tokenizer for the cache key, so BOS/EOS post-processing changes count.
PROBE_TEXT = " Human: Hello, world! 0123 caf\u00e9 \u4f60\u597d\n\nAssistant: Fine.<|endoftext|>"
#: Texts per tokenizer call.
TOKENIZE_BATCH = 1024

__all__ = [
    "TokenRows",
    "PairItem",
    "PromptItem",
    "PromptDataset",
    "create_dataset_split",
    "create_dataset",
    "create_prompt_dataset",
    "tokenizer_fingerprint",
    "cache_key",
    "cache_files",
    "check_data_output_path",
]


# ---------------------------------------------------------------------------------------------
# Storage: ragged token rows
# ---------------------------------------------------------------------------------------------


class TokenRows:
    """Variable-length token rows stored flat: ``ids``/``mask`` (total tokens) + ``offsets`` (rows + 1).

    Row ``i`` is ``ids[offsets[i]:offsets[i + 1]]``. ids are int32 on disk (int64 if a vocabulary
    ever exceeds 2**31), masks uint8; :meth:`row` returns int64 tensors like the tokenizer's.
    """

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor) -> None:
        if ids.shape != mask.shape or offsets.ndim != 1 or int(offsets[-1]) != ids.numel():
            raise ValueError("inconsistent TokenRows tensors")
        self.ids, self.mask, self.offsets = ids, mask, offsets

    @classmethod
    def from_lists(cls, ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> "TokenRows":
        lengths = torch.tensor([len(r) for r in ids], dtype=torch.long)
        offsets = torch.zeros(len(ids) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        flat_ids = [t for r in ids for t in r]
        dtype = torch.int32 if not flat_ids or max(flat_ids) < 2**31 else torch.int64
        return cls(
            torch.tensor(flat_ids, dtype=dtype),
            torch.tensor([m for r in masks for m in r], dtype=torch.uint8),
            offsets,
        )

    @classmethod
    def empty(cls) -> "TokenRows":
        return cls.from_lists([], [])

    @classmethod
    def concat(cls, parts: Sequence["TokenRows"]) -> "TokenRows":
        if not parts:
            return cls.empty()
        starts = torch.tensor([0] + [int(p.offsets[-1]) for p in parts[:-1]]).cumsum(0)
        offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
        dtype = torch.int64 if any(p.ids.dtype == torch.int64 for p in parts) else torch.int32
        return cls(torch.cat([p.ids.to(dtype) for p in parts]), torch.cat([p.mask for p in parts]), offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def take(self, index: Sequence[int] | torch.Tensor) -> "TokenRows":
        """Rows ``index`` in that order (vectorised gather)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        new_len = self.lengths()[idx]
        offsets = torch.zeros(idx.numel() + 1, dtype=torch.long)
        torch.cumsum(new_len, 0, out=offsets[1:])
        row_of = torch.repeat_interleave(torch.arange(idx.numel()), new_len)
        pos = self.offsets[:-1][idx][row_of] + (torch.arange(int(offsets[-1])) - offsets[:-1][row_of])
        return TokenRows(self.ids[pos], self.mask[pos], offsets)

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b].long(), self.mask[a:b].long()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.ids": self.ids, f"{prefix}.mask": self.mask, f"{prefix}.offsets": self.offsets}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "TokenRows":
        return cls(tensors[f"{prefix}.ids"], tensors[f"{prefix}.mask"], tensors[f"{prefix}.offsets"])


# ---------------------------------------------------------------------------------------------
# Items and the dataset
# ---------------------------------------------------------------------------------------------


class PairItem(NamedTuple):
    """Phase-2 item; indexes like upstream's ``(c_ids, c_mask, r_ids, r_mask)`` tuple.

    Shape of every field: ``(1, max_seq_len)``, int64.
    """

    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor


class PromptItem(NamedTuple):
    """Phase-3 item; indexes like upstream's ``(ids_flipped, mask_flipped, pad_token_id)`` tuple.

    Shape: ``(prompt_len,)`` int64, reversed token order (see DataCollatorRLHF).
    """

    input_ids_flipped: torch.Tensor
    attention_mask_flipped: torch.Tensor
    pad_token_id: int


class PromptDataset(Dataset):
    """Tokenised rows of one phase; item types as upstream (see the module docstring).

    Upstream's positional arguments (``prompt_dataset``, ``chosen_dataset``, ``reject_dataset``,
    ``pad_token_id``, ``train_phase``) are kept, holding :class:`TokenRows` instead of lists of
    ``BatchEncoding``, so upstream's five-argument call works. ``max_seq_len`` / ``padding_side``
    say how phase-1/2 rows are padded on read; ``max_seq_len=None`` (the default) pads to the
    longest chosen/rejected row, which for rows tokenised as upstream did (``padding="max_length"``)
    is their common length, i.e. upstream's items. ``filtered`` counts phase-3 prompts dropped for
    length.
    """

    def __init__(
        self,
        prompt_dataset: TokenRows | None,
        chosen_dataset: TokenRows | None,
        reject_dataset: TokenRows | None,
        pad_token_id: int | None,
        train_phase: int,
        *,
        max_seq_len: int | None = None,
        padding_side: str = "right",
        filtered: int = 0,
    ) -> None:
        super().__init__()
        if train_phase not in (1, 2, 3):
            raise ValueError(f"train_phase must be 1, 2 or 3, got {train_phase}")
        given = {"prompt_dataset": prompt_dataset, "chosen_dataset": chosen_dataset, "reject_dataset": reject_dataset}
        for name, rows in given.items():
            if rows is not None and not isinstance(rows, TokenRows):
                raise TypeError(
                    f"PromptDataset's {name} must be TokenRows or None, got {type(rows).__name__}; build it "
                    "from unpadded token lists with TokenRows.from_lists(ids, masks)"
                )
        self.prompt_dataset = prompt_dataset if prompt_dataset is not None else TokenRows.empty()
        self.chosen_dataset = chosen_dataset if chosen_dataset is not None else TokenRows.empty()
        self.reject_dataset = reject_dataset if reject_dataset is not None else TokenRows.empty()
        self.pad_token_id = pad_token_id
        self.train_phase = train_phase
        if max_seq_len is None:
            lengths = [int(rows.lengths().max()) for rows in (self.chosen_dataset, self.reject_dataset) if len(rows)]
            max_seq_len = max(lengths, default=0)
        self.max_seq_len = max_seq_len
        self.padding_side = padding_side
        self.filtered = filtered
        #: Set by create_prompt_dataset: the SHA-256 key of the cache this came from.
        self.cache_key: str | None = None

    def __len__(self) -> int:
        if self.train_phase == 3:
            return len(self.prompt_dataset)
        return len(self.chosen_dataset)

    def _padded(self, rows: TokenRows, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = rows.row(idx)
        pad = self.max_seq_len - ids.numel()
        if pad > 0:
            pad_ids = torch.full((pad,), int(self.pad_token_id), dtype=torch.long)
            pad_mask = torch.zeros(pad, dtype=torch.long)
            if self.padding_side == "left":
                ids, mask = torch.cat([pad_ids, ids]), torch.cat([pad_mask, mask])
            else:
                ids, mask = torch.cat([ids, pad_ids]), torch.cat([mask, pad_mask])
        return ids, mask

    def __getitem__(self, idx: int) -> Any:
        if self.train_phase == 1:
            ids, mask = self._padded(self.chosen_dataset, idx)
            # Loss on every real token, prompt included; -100 on padding only (upstream, #819).
            return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}
        if self.train_phase == 2:
            c_ids, c_mask = self._padded(self.chosen_dataset, idx)
            r_ids, r_mask = self._padded(self.reject_dataset, idx)
            return PairItem(c_ids[None], c_mask[None], r_ids[None], r_mask[None])
        ids, mask = self.prompt_dataset.row(idx)
        return PromptItem(ids.flip(0), mask.flip(0), self.pad_token_id)

    def take(self, index: Sequence[int] | torch.Tensor) -> "PromptDataset":
        """A new dataset of rows ``index`` in that order (upstream's ``Subset``, materialised)."""
        return PromptDataset(
            self.prompt_dataset.take(index) if self.train_phase == 3 else None,
            self.chosen_dataset.take(index) if self.train_phase != 3 else None,
            self.reject_dataset.take(index) if self.train_phase == 2 else None,
            self.pad_token_id, self.train_phase,
            max_seq_len=self.max_seq_len, padding_side=self.padding_side, filtered=self.filtered,
        )

    @classmethod
    def concat(cls, parts: Sequence["PromptDataset"]) -> "PromptDataset":
        """Upstream's ``ConcatDataset`` of same-phase datasets, materialised."""
        first = parts[0]
        return cls(
            TokenRows.concat([p.prompt_dataset for p in parts]),
            TokenRows.concat([p.chosen_dataset for p in parts]),
            TokenRows.concat([p.reject_dataset for p in parts]),
            first.pad_token_id, first.train_phase,
            max_seq_len=first.max_seq_len, padding_side=first.padding_side,
            filtered=sum(p.filtered for p in parts),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.train_phase == 1:
            return self.chosen_dataset.tensors("chosen")
        if self.train_phase == 2:
            return {**self.chosen_dataset.tensors("chosen"), **self.reject_dataset.tensors("rejected")}
        return self.prompt_dataset.tensors("prompt")


# ---------------------------------------------------------------------------------------------
# Tokenisation
# ---------------------------------------------------------------------------------------------


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


def _check_pad(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is None:
        raise UserError(
            "the tokenizer has no pad token; load it with dschat.models.tokenizer.load_hf_tokenizer "
            "(which sets one) or set tokenizer.pad_token"
        )
    return int(tokenizer.pad_token_id)


def create_dataset_split(
    current_dataset: Iterable[Any],
    raw_dataset: PromptRawDataset,
    train_phase: int,
    tokenizer: Any,
    end_of_conversation_token: str,
    max_seq_len: int,
) -> PromptDataset:
    """Tokenise one split of one dataset for ``train_phase`` (upstream's function, batched)."""
    padding_side = getattr(tokenizer, "padding_side", "right")
    filtered = 0
    if train_phase == 1:
        texts = [t + end_of_conversation_token for t in map(raw_dataset.get_prompt_and_chosen, current_dataset) if t is not None]
        chosen = _tokenize(tokenizer, texts, max_seq_len) if texts else TokenRows.empty()
        result = PromptDataset(None, chosen, None, _check_pad(tokenizer), 1, max_seq_len=max_seq_len, padding_side=padding_side)
        print(f"Creating dataset {raw_dataset.dataset_name_clean} for train_phase={train_phase} size={len(result)}")
    elif train_phase == 2:
        chosen_texts, rejected_texts = [], []
        for sample in current_dataset:
            chosen_sentence = raw_dataset.get_prompt_and_chosen(sample)
            reject_sentence = raw_dataset.get_prompt_and_rejected(sample)
            if chosen_sentence is not None and reject_sentence is not None:
                chosen_texts.append(chosen_sentence + end_of_conversation_token)
                rejected_texts.append(reject_sentence + end_of_conversation_token)
        chosen = _tokenize(tokenizer, chosen_texts, max_seq_len) if chosen_texts else TokenRows.empty()
        rejected = _tokenize(tokenizer, rejected_texts, max_seq_len) if rejected_texts else TokenRows.empty()
        result = PromptDataset(None, chosen, rejected, _check_pad(tokenizer), 2, max_seq_len=max_seq_len, padding_side=padding_side)
        print(f"Creating dataset {raw_dataset.dataset_name_clean} for train_phase={train_phase} size={len(result)}")
    elif train_phase == 3:
        prompts = [p for p in map(raw_dataset.get_prompt, current_dataset) if p is not None]
        rows = _tokenize(tokenizer, prompts, None) if prompts else TokenRows.empty()
        keep = (rows.lengths() <= max_seq_len).nonzero().flatten()
        filtered = len(rows) - keep.numel()
        result = PromptDataset(
            rows.take(keep), None, None, _check_pad(tokenizer), 3,
            max_seq_len=max_seq_len, padding_side=padding_side, filtered=filtered,
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
    return _tokenize_selection(sel, train_phase, tokenizer, end_of_conversation_token, max_seq_len)


def _tokenize_selection(
    sel: PhaseRows, train_phase: int, tokenizer: Any, eot: str, max_seq_len: int,
) -> tuple[PromptDataset, PromptDataset]:
    out = []
    for split, rows in (("train", sel.train), ("eval", sel.eval)):
        ds = create_dataset_split(rows, sel.raw, train_phase, tokenizer, eot, max_seq_len)
        if len(ds) == 0 and len(rows) > 0:
            if train_phase == 3:
                why = f"all {len(rows)} prompts are longer than max_seq_len={max_seq_len} tokens or empty"
                fix = "raise --max_prompt_seq_len or use shorter prompts"
            else:
                why = f"none of its {len(rows)} rows has the texts phase {train_phase} needs"
                fix = "check the prompt/chosen/rejected fields"
            empty_phase(sel.raw, split, train_phase, why, fix)
        out.append(ds)
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# Cache key and files
# ---------------------------------------------------------------------------------------------


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Everything about a tokenizer that changes token ids, as JSON-able values."""
    vocab = tokenizer.get_vocab()
    vocab_text = "\n".join(f"{i}\t{t}" for t, i in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    backend_sha = None
    if backend is not None:
        # The serialised pipeline (normaliser, pre-tokeniser, model, post-processor) minus the
        # call-time truncation/padding state that transformers sets on it per call.
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        backend_sha = _sha256_text(json.dumps(spec, sort_keys=True))
    special = {
        k: [str(t) for t in v] if isinstance(v, (list, tuple)) else str(v)
        for k, v in tokenizer.special_tokens_map.items()
    }
    return {
        "class": type(tokenizer).__name__,
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "len": len(tokenizer),
        "vocab_sha256": _sha256_text(vocab_text),
        "backend_sha256": backend_sha,
        "special_tokens": special,
        "special_ids": sorted(int(i) for i in tokenizer.all_special_ids),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "padding_side": getattr(tokenizer, "padding_side", "right"),
        "truncation_side": getattr(tokenizer, "truncation_side", "right"),
        "probe_ids": [int(i) for i in tokenizer(PROBE_TEXT)["input_ids"]],
    }


def _key_fields(
    sources: Sequence[DatasetSource],
    sft_sources: Sequence[DatasetSource],
    proportions: Sequence[float],
    train_phase: int,
    seed: int,
    tokenizer: Any,
    max_seq_len: int,
    end_of_conversation_token: str,
) -> dict[str, Any]:
    total = sum(proportions)
    return {
        "format_version": FORMAT_VERSION,
        "train_phase": train_phase,
        "data_path": [s.fingerprint() for s in sources],
        "sft_only_data_path": [s.fingerprint() for s in sft_sources],
        "data_split": [p / total for p in proportions],
        "seed": seed,
        "max_seq_len": max_seq_len,
        # Phase 3 tokenises prompts only: the eot token does not change its content.
        "end_of_conversation_token": end_of_conversation_token if train_phase in (1, 2) else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def cache_key(fields: dict[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON of ``fields``."""
    return _sha256_text(json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str))


@dataclass(frozen=True)
class _CacheFiles:
    train: Path
    eval: Path
    meta: Path
    lock: Path

    def all(self) -> tuple[Path, Path, Path]:
        return (self.train, self.eval, self.meta)


def cache_files(output_path: str | os.PathLike, key: str) -> _CacheFiles:
    """Paths of the cache for ``key`` under ``output_path``."""
    base = Path(output_path)
    return _CacheFiles(
        base / f"traindata_{key}.safetensors",
        base / f"evaldata_{key}.safetensors",
        base / f"meta_{key}.json",
        base / f".lock_{key}",
    )


#: How to get out of an untrusted cache: said in every refusal.
UNTRUSTED_FIX = ("pass a --data_output_path folder of your own that only you can write to (the default, "
                 "dschat's per-user cache, is one), or remove the other user's files and run chmod go-w on yours")


def check_data_output_path(output_path: str | os.PathLike) -> None:
    """Refuse (one line) an existing ``--data_output_path`` that is not this user's, or that group or
    others can write to: files there could have been planted. A missing folder passes (it is
    created private)."""
    if os.path.lexists(output_path):
        check_trusted(output_path, "--data_output_path", UNTRUSTED_FIX)


def _private_folder(output_path: str | os.PathLike) -> None:
    """Create ``output_path`` 0700 if needed, then require it to be a folder this user may trust."""
    make_private_dir(output_path)
    if not os.path.isdir(output_path):
        raise UserError(f"--data_output_path {output_path} is not a folder; pass a folder path")
    check_data_output_path(output_path)


def _write_cache(files: _CacheFiles, key: str, fields: dict, train: PromptDataset, held_out: PromptDataset, stats: list) -> None:
    """Write the three files under temporary names, then rename them into place, meta last.

    A failure at any point (a full disk while writing the eval file, say) removes the temporary
    files and leaves a previous cache for this key exactly as it was (``--rebuild_data_cache``
    never destroys the files it fails to replace), or no files at all.
    """
    from safetensors.torch import save_file

    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "train_phase": train.train_phase,
        "pad_token_id": train.pad_token_id,
        "max_seq_len": train.max_seq_len,
        "padding_side": train.padding_side,
        "train": {"size": len(train), "filtered": train.filtered},
        "eval": {"size": len(held_out), "filtered": held_out.filtered},
        "datasets": stats,
        "key_fields": fields,
    }
    st_meta = {"format": "dschat-prompt-dataset", "format_version": str(FORMAT_VERSION), "key": key}
    # The meta file goes last: its presence marks a complete cache.
    # 0600: tokenised data is as private as the text it came from.
    with atomic_files((files.train, files.eval, files.meta), mode=0o600) as (train_tmp, eval_tmp, meta_tmp):
        for tmp, ds in ((train_tmp, train), (eval_tmp, held_out)):
            save_file({k: v.contiguous() for k, v in ds.tensors().items()}, str(tmp), metadata=st_meta)
        meta_tmp.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")


def _load_cache(files: _CacheFiles, key: str) -> tuple[PromptDataset, PromptDataset] | None:
    """The cached pair, or None if absent, incomplete, or written by another format version.

    A file of the set that is not this user's, or that others can write to, is refused (one line).
    """
    if not all(p.is_file() for p in files.all()):
        return None
    for path in files.all():
        check_trusted(path, "data cache file", UNTRUSTED_FIX)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads(files.meta.read_text(encoding="utf-8"))
        if meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
            return None
        out = []
        phase = meta["train_phase"]
        for path, split in ((files.train, "train"), (files.eval, "eval")):
            tensors = load_file(str(path))
            prompt = TokenRows.from_tensors(tensors, "prompt") if phase == 3 else None
            chosen = TokenRows.from_tensors(tensors, "chosen") if phase != 3 else None
            rejected = TokenRows.from_tensors(tensors, "rejected") if phase == 2 else None
            out.append(PromptDataset(
                prompt, chosen, rejected, meta["pad_token_id"], phase, max_seq_len=meta["max_seq_len"],
                padding_side=meta["padding_side"], filtered=meta[split]["filtered"],
            ))
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        print(f"Warning: ignoring unreadable data cache {files.meta.parent} ({type(err).__name__}: {err}); rebuilding")
        return None
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# create_prompt_dataset
# ---------------------------------------------------------------------------------------------


def _build_datasets(
    plan: PhasePlan, train_phase: int, seed: int, tokenizer: Any, max_seq_len: int, eot: str, reload: bool,
) -> tuple[PromptDataset, PromptDataset, list[dict]]:
    """Tokenise, blend and shuffle as upstream; returns (train, eval, per-dataset stats)."""
    print(f"Creating prompt dataset {plan.data_path}, reload={reload}")
    stats = []

    def run(selections: list[PhaseRows], kind: str) -> tuple[list[PromptDataset], list[PromptDataset]]:
        trains, evals = [], []
        for sel in selections:
            tr, ev = _tokenize_selection(sel, train_phase, tokenizer, eot, max_seq_len)
            trains.append(tr)
            evals.append(ev)
            stats.append({
                "name": sel.raw.dataset_name, "role": kind,
                "train_size": len(tr), "eval_size": len(ev),
                "train_filtered": tr.filtered, "eval_filtered": ev.filtered,
            })
        return trains, evals

    trains, evals = run(plan.selections, "data_path")
    if len(trains) == 1:  # single dataset: upstream keeps its order
        train, held_out = trains[0], evals[0]
    else:  # blending: ConcatDataset, then Subset by get_shuffle_idx(seed, total)
        train = PromptDataset.concat(trains)
        train = train.take(get_shuffle_idx(seed, len(train)).astype("int64"))
        held_out = PromptDataset.concat(evals)
        held_out = held_out.take(get_shuffle_idx(seed, len(held_out)).astype("int64"))
    if train_phase == 1 and plan.sft_selections:
        sft_trains, sft_evals = run(plan.sft_selections, "sft_only_data_path")
        train = PromptDataset.concat([train] + sft_trains)
        train = train.take(get_shuffle_idx(seed, len(train)).astype("int64"))
        held_out = PromptDataset.concat([held_out] + sft_evals)
        held_out = held_out.take(get_shuffle_idx(seed, len(held_out)).astype("int64"))
    require_eval(plan.data_path, train_phase, len(held_out))
    return train, held_out, stats


def _acquire(lock: Any, path: Path, timeout: float) -> None:
    """``lock.acquire(timeout)``; a lock file this user cannot open is one line, not a traceback."""
    try:
        lock.acquire(timeout=timeout)
    except PermissionError as err:
        raise UserError(f"cannot take the data-cache lock {path} ({err.strerror}): another user's file or "
                        f"folder; {UNTRUSTED_FIX}") from err


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``filelock.FileLock(path)``, saying so when another process has it (a build is running).

    A lock file left by another account is refused (one line) rather than shared.
    """
    from filelock import FileLock, Timeout

    if os.path.lexists(path):
        check_trusted(path, "data-cache lock", UNTRUSTED_FIX)
    lock = FileLock(str(path), mode=0o600)
    try:
        _acquire(lock, path, timeout=0)
    except Timeout:
        print(f"Waiting for another process to finish building the data cache (lock {path})", flush=True)
        _acquire(lock, path, timeout=-1)
    try:
        yield
    finally:
        lock.release()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _share_build_outcome(failure: Exception | None) -> None:
    """Wait for every rank (a collective, like the barrier it replaces) and fail on all of them if a
    building rank failed.

    Under ``reload`` only local rank 0 builds; an error there that the other ranks cannot see
    (e.g. every prompt longer than ``max_prompt_seq_len``, found only while tokenising) used to leave
    them waiting at ``barrier()`` until gloo reported "Connection closed by peer" or NCCL hung. Now
    a :class:`UserError` is raised with the same message on every rank; any other error is re-raised
    where it happened and reported as a ``RuntimeError`` naming that rank elsewhere.
    """
    outcome = None
    if failure is not None:
        outcome = (isinstance(failure, UserError), type(failure).__name__, str(failure))
    outcomes: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(outcomes, outcome)
    if failure is not None:
        raise failure
    for rank, reported in enumerate(outcomes):
        if reported is not None:
            is_user_error, kind, message = reported
            if is_user_error:
                raise UserError(message)
            raise RuntimeError(f"rank {rank} failed to build the data cache ({kind}: {message}); see its log")


def create_prompt_dataset(
    local_rank: int,
    data_path: Sequence[str] | str,
    data_split: str,
    output_path: str,
    train_phase: int,
    seed: int | None,
    tokenizer: Any,
    max_seq_len: int,
    end_of_conversation_token: str = "<|endoftext|>",
    sft_only_data_path: Sequence[str] = (),
    reload: bool = False,
) -> tuple[PromptDataset, PromptDataset]:
    """(train, eval) :class:`PromptDataset` for ``train_phase``, built once and cached on disk.

    Same arguments and blending as upstream (see the module docstring for the cache). Differences:
    the phase-3 eval split is a real held-out prompt set (upstream built and discarded it);
    ``seed=None`` (upstream step 3's default) uses :data:`DEFAULT_SEED`, because a random seed would
    give step 3 a chunk that overlaps the rows steps 1 and 2 trained on.
    """
    data_path = [data_path] if isinstance(data_path, str) else list(data_path)
    if not data_path:
        raise UserError("--data_path is empty; name at least one dataset")
    if train_phase not in (1, 2, 3):
        raise UserError(f"train_phase must be 1, 2 or 3, got {train_phase}")
    if int(max_seq_len) < 1:
        raise UserError(f"max_seq_len must be a positive number of tokens, got {max_seq_len}")
    proportions = parse_data_split(data_split)
    if seed is None:
        print(f"Warning: no seed given for the data split; using {DEFAULT_SEED} (steps 1-2's default) "
              "so the phases keep disjoint rows")
        seed = DEFAULT_SEED
    # Upstream ignores --sft_only_data_path outside phase 1; so does the key.
    sft_paths = list(sft_only_data_path) if train_phase == 1 else []
    sources = [resolve_dataset(p) for p in data_path]
    sft_sources = [resolve_dataset(p) for p in sft_paths]
    fields = _key_fields(sources, sft_sources, proportions, train_phase, seed, tokenizer, max_seq_len, end_of_conversation_token)
    key = cache_key(fields)
    files = cache_files(output_path, key)
    check_data_output_path(output_path)  # before reading anything there

    def build(plan: PhasePlan) -> tuple[PromptDataset, PromptDataset]:
        train, held_out, stats = _build_datasets(
            plan, train_phase, seed, tokenizer, max_seq_len, end_of_conversation_token, reload,
        )
        _write_cache(files, key, fields, train, held_out, stats)
        return train, held_out

    def keyed(pair: tuple[PromptDataset, PromptDataset]) -> tuple[PromptDataset, PromptDataset]:
        pair[0].cache_key = pair[1].cache_key = key
        return pair

    if reload:
        # Every rank validates, so bad input fails everywhere instead of leaving ranks at the barrier.
        plan = plan_phase_data(data_path, sft_paths, data_split, train_phase, seed, output_path, local_rank)
        result, failure = None, None
        if local_rank <= 0:
            try:
                _private_folder(output_path)
                with _locked(files.lock):
                    result = build(plan)
            except Exception as err:  # re-raised below, on every rank
                if not _distributed():
                    raise
                failure = err
        if _distributed():
            _share_build_outcome(failure)  # the barrier, telling every rank how the builds went
        if result is not None:
            return keyed(result)

    cached = _load_cache(files, key)
    if cached is not None:
        return keyed(cached)
    # Validate and load the raw data before creating anything on disk: bad input leaves no files.
    plan = plan_phase_data(data_path, sft_paths, data_split, train_phase, seed, output_path, local_rank)
    _private_folder(output_path)
    with _locked(files.lock):
        cached = _load_cache(files, key)  # another process may have built it while we waited
        if cached is not None:
            return keyed(cached)
        return keyed(build(plan))
