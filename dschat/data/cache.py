"""The tokenised-dataset cache: its key, its files, and the lock that builds it once.

Upstream's cache and what this one fixes: docs/upstream.md#data-cache.

* The key is a SHA-256 over a canonical JSON of everything that changes the content: each
  dataset's name, adapter and a SHA-256 of its local files, the split, phase, seed,
  ``max_seq_len``, the end-of-conversation token, the tokenizer's identity (class, vocab, pipeline
  and special-token hashes, and the ids of a probe text, so a changed BOS/post-processor counts; not
  the path it was loaded from),
  the sft-only datasets and a format version.
* Files are ``traindata_{key}.safetensors``, ``evaldata_{key}.safetensors`` and ``meta_{key}.json``:
  token ids stored flat with row offsets, no pickles. The files are written under temporary
  names, fsync'd and renamed into place together, the meta file last, so a reader never sees a
  partial cache, and a failed build or rebuild leaves nothing behind and any previous cache
  untouched; a kill during the renames is finished by the next process that takes the lock.
* Building happens once under a ``filelock.FileLock`` in ``output_path``: each process takes it; the
  first builds, the others then find the files and load them, so a ``--data_output_path`` shared
  by ranks and nodes is safe.
* The folder is the user's own (default :func:`~dschat.paths.data_cache_dir`, created 0700; not
  upstream's shared ``/tmp/data_files``: docs/upstream.md#data-cache-default) and the files are
  0600. A folder, cache file or
  lock that another account owns, or that group or others can write to, is never read: the run
  stops with one line naming it (:func:`check_data_output_path`), since the key is deterministic
  and anyone able to write there could plant the data a run trains on.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

# safetensors.torch.save_file / load_file are looked up when called: tests replace them to make a write fail.
import safetensors.torch
from safetensors import SafetensorError

from dschat.data.dispatch import DatasetSource
from dschat.data.local_files import expand
from dschat.data.token_dataset import PromptDataset, TokenRows
from dschat.errors import UserError
from dschat.runtime.fs import atomic_files, pending_files, recover_files
from dschat.runtime.file_lock import trusted_lock
from dschat.runtime.trust import check_trusted, make_trusted_dir, missing_ancestors, remove_made_folders

#: Bump when the cache layout or tokenisation changes: old caches then miss instead of misleading.
FORMAT_VERSION = 4
#: Tokenised with the tokenizer for the cache key, so BOS/EOS post-processing changes count.
PROBE_TEXT = " Human: Hello, world! 0123 caf\u00e9 \u4f60\u597d\n\nAssistant: Fine.<|endoftext|>"


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Everything about a tokenizer that changes token ids, as JSON-able values.

    Not where it was loaded from (``name_or_path``): the same tokenizer given as ``tiny-llama``,
    ``./folder`` or ``/abs/folder/`` has one key; two tokenizers whose vocabulary, pipeline, special
    tokens or probe ids differ have two."""
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


def key_fields(
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
class CacheFiles:
    train: Path
    eval: Path
    meta: Path
    lock: Path

    def all(self) -> tuple[Path, Path, Path]:
        return (self.train, self.eval, self.meta)


def cache_files(output_path: str | os.PathLike, key: str) -> CacheFiles:
    """Paths of the cache for ``key`` under ``output_path`` (a leading ``~`` expanded, as
    :func:`check_data_output_path` and :func:`private_folder` do)."""
    base = expand(output_path)
    return CacheFiles(
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
    created private). A leading ``~`` is the home folder, as everywhere in this module."""
    output_path = os.path.expanduser(os.fspath(output_path))
    if os.path.lexists(output_path):
        check_trusted(output_path, "--data_output_path", UNTRUSTED_FIX)


def private_folder(output_path: str | os.PathLike) -> None:
    """Create ``output_path`` 0700 if needed, then require it to be a folder this user may trust."""
    make_trusted_dir(output_path, "--data_output_path", UNTRUSTED_FIX, not_a_folder_fix="pass a folder path")


def write_cache(files: CacheFiles, key: str, fields: dict, train: PromptDataset, held_out: PromptDataset, stats: list) -> None:
    """Write the three files under temporary names, then rename them into place, meta last.

    A failure at any point (a full disk while writing the eval file, say) removes the temporary
    files and leaves a previous cache for this key exactly as it was (``--rebuild_data_cache``
    never destroys the files it fails to replace), or no files at all.
    """
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
            safetensors.torch.save_file({k: v.contiguous() for k, v in ds.tensors().items()}, str(tmp), metadata=st_meta)
        meta_tmp.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")


def load_cache(files: CacheFiles, key: str) -> tuple[PromptDataset, PromptDataset] | None:
    """The cached pair, or None if absent, incomplete, or written by another format version.

    A file of the set that is not this user's, or that others can write to, is refused (one line).
    A set whose replacement a kill stopped midway is not read (None): :func:`locked` finishes it.
    """
    if pending_files(files.all()) or not all(p.is_file() for p in files.all()):
        return None
    for path in files.all():
        check_trusted(path, "data cache file", UNTRUSTED_FIX)
    try:
        meta = json.loads(files.meta.read_text(encoding="utf-8"))
        if meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
            return None
        out = []
        phase = meta["train_phase"]
        for path, split in ((files.train, "train"), (files.eval, "eval")):
            tensors = safetensors.torch.load_file(str(path))
            prompt = TokenRows.from_tensors(tensors, "prompt") if phase == 3 else None
            chosen = TokenRows.from_tensors(tensors, "chosen") if phase != 3 else None
            rejected = TokenRows.from_tensors(tensors, "rejected") if phase == 2 else None
            out.append(PromptDataset(
                prompt, chosen, rejected, meta["pad_token_id"], phase, max_seq_len=meta["max_seq_len"],
                padding_side=meta["padding_side"], filtered=meta[split]["filtered"],
                prompt_sources=tensors.get("prompt.sources") if phase == 3 else None,
            ))
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        print(f"Warning: ignoring unreadable data cache {files.meta.parent} ({type(err).__name__}: {err}); rebuilding")
        return None
    return out[0], out[1]


@contextlib.contextmanager
def building(files: CacheFiles) -> Iterator[None]:
    """Create the cache's folder (:func:`private_folder`) and hold its lock (:func:`locked`) for a build.

    Bad data the build refuses (a :class:`~dschat.errors.UserError`: every pair the same tokens, a row
    of the wrong shape) leaves nothing behind: the lock file is removed, and so are the folders this
    call created, when nothing else was put in them meanwhile (another run's lock, say). A lock file
    that was there before the call is kept."""
    created = missing_ancestors(files.lock.parent)  # innermost first
    lock_was_there = files.lock.exists()
    private_folder(files.lock.parent)
    try:
        with locked(files.lock):
            try:
                yield
            except UserError:
                if not lock_was_there:  # removed while still held
                    with contextlib.suppress(FileNotFoundError):
                        files.lock.unlink()
                raise
    except UserError:
        remove_made_folders(created)  # not those holding someone else's files
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``filelock.FileLock(path)``, saying so when another process has it (a build is running).

    A lock file left by another account is refused (one line) rather than shared
    (:func:`~dschat.runtime.file_lock.trusted_lock`). Once held, a cache write that a kill stopped midway
    (the cache files of the lock's key) is finished (:func:`dschat.runtime.fs.recover_files`), so the
    set is the complete new one.
    """
    with trusted_lock(path, "data-cache lock", UNTRUSTED_FIX,
                      f"Waiting for another process to finish building the data cache (lock {path})"):
        if path.name.startswith(".lock_"):
            for notice in recover_files(cache_files(path.parent, path.name[len(".lock_"):]).all()):
                print(f"[data cache] {notice}", flush=True)
        yield
