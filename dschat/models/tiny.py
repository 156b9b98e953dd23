"""Tiny random-weight LLaMA / OPT models with a real BPE tokenizer, built offline.

They stand in for ``facebook/opt-*`` and ``meta-llama/*`` in tests and CPU smoke runs: real Hugging
Face folders (``model.safetensors``, ``config.json``, ``generation_config.json``, tokenizer files) that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load, so the training code cannot tell them from the real
thing. Everything is deterministic (fixed seeds, a BPE trained on the fixed builtin preference data),
so two builds anywhere give byte-identical files.

The three names cover the special-token layouts the pipeline must handle:

================  =====================  =========================================================
name              bos / eos / pad        why
================  =====================  =========================================================
tiny-llama        <s> / </s> / <pad>     LLaMA layout (unk 0, bos 1, eos 2) plus a distinct pad
tiny-opt          </s> / </s> / <pad>    real OPT: bos == eos == ``</s>`` (id 2), pad ``<pad>`` (id 1)
tiny-opt-quirk    </s> / </s> / </s>     OPT after upstream's ``pad = eos`` (create_hf_model sets
                                         ``config.pad_token_id = eos``; load_hf_tokenizer sets
                                         ``pad_token = eos_token``), so tests cover that state
================  =====================  =========================================================

``tiny-opt-quirk`` has exactly the weights and vocabulary of ``tiny-opt``: like upstream, only the pad
token (tokenizer and config) changes after the model is made.

The cache is trusted as the data cache is (docs/shared-machine.md): its folders are created 0700, and
a cache folder, model folder, model file or lock that another account owns or could write to (or
replace, through a folder above it) is refused in one line before anything reads or locks it
(:func:`trusted_cache_root`, :func:`check_cached_folder`, :func:`cache_lock`; the embedded model's
cache, dschat.models.embedded, uses them too).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

from dschat.errors import UserError
from dschat.paths import BUILTIN_DATA_DIR, cache_dir
from dschat.runtime.fs import atomic_dir, atomic_file
from dschat.runtime.file_lock import trusted_lock
from dschat.runtime.trust import check_trusted, make_trusted_dir

__all__ = [
    "TINY_NAMES",
    "MARKER_FILE",
    "FORMAT_VERSION",
    "SEED",
    "VOCAB_SIZE",
    "MAX_POSITIONS",
    "TinySpec",
    "SPECS",
    "default_root",
    "UNTRUSTED_FIX",
    "trusted_cache_root",
    "check_cached_folder",
    "cache_lock",
    "keep_to_owner",
    "corpus_texts",
    "train_tokenizer",
    "build_tiny_model",
]

logger = logging.getLogger(__name__)

TINY_NAMES: tuple[str, ...] = ("tiny-llama", "tiny-opt", "tiny-opt-quirk")

# Written last into the folder; its presence with matching fields means "complete and current".
MARKER_FILE = "dschat_tiny.json"
# Bump when the recipe changes so that old caches are rebuilt.
FORMAT_VERSION = 1
SEED = 1234
VOCAB_SIZE = 1000  # BPE target, special tokens and the 256 byte symbols included
MAX_POSITIONS = 512


@dataclass(frozen=True)
class TinySpec:
    """Special-token layout and architecture of one tiny model."""

    family: str  # "llama" | "opt"
    vocab_specials: tuple[str, ...]  # special tokens, in id order (ids 0..n-1)
    bos: str
    eos: str
    pad: str
    unk: str


_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")  # LLaMA: unk 0, bos 1, eos 2 (+ pad 3)
_OPT_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # OPT (GPT-2 BPE): <s> 0, <pad> 1, </s> 2, <unk> 3

SPECS: dict[str, TinySpec] = {
    "tiny-llama": TinySpec("llama", _LLAMA_SPECIALS, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>"),
    "tiny-opt": TinySpec("opt", _OPT_SPECIALS, bos="</s>", eos="</s>", pad="<pad>", unk="<unk>"),
    "tiny-opt-quirk": TinySpec("opt", _OPT_SPECIALS, bos="</s>", eos="</s>", pad="</s>", unk="<unk>"),
}


def default_root() -> Path:
    """``cache_dir()/tiny``."""
    return cache_dir() / "tiny"


#: How to get out of an untrusted model cache: said in every refusal.
UNTRUSTED_FIX = ("remove it (or, if it is yours, run chmod -R go-w on it or on the folder the line names), "
                 "or set DSCHAT_CACHE_DIR to a folder only you can write to")


def trusted_cache_root(root: Path, default: Path) -> Path:
    """Create ``root`` (a model cache folder) 0700 when missing and refuse it in one line unless this
    user may trust it; when it is ``default`` (under :func:`~dschat.paths.cache_dir`), ``cache_dir()``
    is made and checked first, so nothing is created inside another account's folder."""
    folders = (cache_dir(), root) if root == default else (root,)
    for folder in folders:
        try:
            make_trusted_dir(folder, "the model cache folder", UNTRUSTED_FIX)
        except PermissionError as err:
            raise UserError(f"cannot create the model cache folder {folder} ({err.strerror}); "
                            "set DSCHAT_CACHE_DIR to a folder only you can write to") from err
    return root


def check_cached_folder(folder: Path, what: str) -> None:
    """Refuse (one line) an existing cached model ``folder``, or any file in it, that this user may
    not trust: a folder another account planted, or one it could edit. A missing folder passes."""
    if not os.path.lexists(folder):
        return
    check_trusted(folder, what, UNTRUSTED_FIX)
    for parent, dirs, files in os.walk(folder):
        for entry in (*dirs, *files):
            check_trusted(Path(parent) / entry, f"a file of the {what}", UNTRUSTED_FIX)


def keep_to_owner(folder: Path) -> None:
    """Take the group's and others' write bits off ``folder`` and everything in it (a build writes
    with the user's umask: 002 with a shared group gives 0664 files that :func:`check_cached_folder`
    would refuse at the next use)."""
    for parent, dirs, files in os.walk(folder):
        for entry in (parent, *(os.path.join(parent, name) for name in files)):
            os.chmod(entry, os.stat(entry).st_mode & 0o7755)


def cache_lock(path: Path, what: str) -> ContextManager[None]:
    """:func:`~dschat.runtime.file_lock.trusted_lock` on a model cache's lock ``path``."""
    return trusted_lock(path, what, UNTRUSTED_FIX,
                        f"Waiting for another process of yours to finish building the model ({what} {path})")


def corpus_texts() -> list[str]:
    """The tokenizer's training text: prompt, chosen and rejected of every builtin train row (read
    from the package's data files directly, so this module imports nothing of dschat.data)."""
    lines = (BUILTIN_DATA_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()
    texts: list[str] = []
    for row in (json.loads(line) for line in lines if line.strip()):
        for key in ("prompt", "chosen", "rejected"):
            value = row.get(key)
            if isinstance(value, str) and value:
                texts.append(value)
    if not texts:
        raise UserError("the builtin preference data has no train rows; reinstall dschat (dschat/data/builtin_prefs)")
    return texts


def _corpus_digest(texts: list[str]) -> str:
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode("utf-8")).hexdigest()


def _marker(name: str, corpus_sha256: str) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "name": name, "seed": SEED, "vocab_target": VOCAB_SIZE,
            "corpus_sha256": corpus_sha256}


def _is_complete(folder: Path, expected: dict[str, Any]) -> bool:
    try:
        found = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return found == expected and all(
        (folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def train_tokenizer(spec: TinySpec, texts: list[str]) -> Any:
    """A byte-level BPE (``tokenizers``) trained on ``texts``, wrapped as ``PreTrainedTokenizerFast``.

    Byte-level, like OPT's GPT-2 BPE, so any text round-trips and ``<unk>`` is never produced. The
    post-processor prepends BOS to every sequence, as the OPT and LLaMA tokenizers do.
    """
    # lazy (here and in _write_model): torch and transformers cost 1.8 s CPU at import (python -X
    # importtime); dschat.models.registry imports this module, and chat.py / e2e_rlhf.py check paths through it.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(spec.vocab_specials),  # added first, so they get ids 0..n-1 in order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = backend.token_to_id(spec.bos)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{spec.bos}:0 $A:0", pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
        special_tokens=[(spec.bos, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad, unk_token=spec.unk,
        # No add_bos_token kwarg: transformers 5 does not save it and takes the post-processor in
        # tokenizer.json as the truth, so leaving it out keeps a fresh and a reloaded tokenizer alike.
        model_max_length=MAX_POSITIONS,
        padding_side="right",
        # OPT/LLaMA take no token_type_ids; the default list would pass them to forward().
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )


def _round_up(n: int, multiple: int = 8) -> int:
    return -(-n // multiple) * multiple


def _write_model(spec: TinySpec, tokenizer: Any, folder: Path) -> None:
    """Build the seeded random model for ``tokenizer`` and save it into ``folder`` (safetensors)."""
    # lazy: see train_tokenizer (torch and transformers, 1.8 s CPU at import)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, logging as hf_logging

    vocab = _round_up(len(tokenizer))
    ids = {"bos_token_id": tokenizer.convert_tokens_to_ids(spec.bos),
           "eos_token_id": tokenizer.convert_tokens_to_ids(spec.eos)}
    if spec.family == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                             pad_token_id=tokenizer.convert_tokens_to_ids(spec.pad), **ids)
        cls = LlamaForCausalLM
    else:
        # Built with OPT's own pad (<pad>, id 1) whatever spec.pad is: the quirk variant then gets
        # upstream's `pad = eos` applied afterwards, exactly as upstream does to a loaded OPT.
        config = OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                           num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=MAX_POSITIONS,
                           dropout=0.1, pad_token_id=tokenizer.convert_tokens_to_ids("<pad>"), **ids)
        cls = OPTForCausalLM
    torch.manual_seed(SEED)
    model = cls(config).to(torch.float32)
    pad_id = tokenizer.pad_token_id
    model.config.pad_token_id = pad_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.generation_config.eos_token_id = ids["eos_token_id"]
    # A first build happens inside other commands (the chatbot, a step's tiny model): its progress bar
    # would come before their own output, a one-line error's included.
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(folder), safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _build(name: str, folder: Path, texts: list[str], marker: dict[str, Any]) -> None:
    spec = SPECS[name]
    tokenizer = train_tokenizer(spec, texts)
    _write_model(spec, tokenizer, folder)
    tokenizer.save_pretrained(str(folder))
    with atomic_file(folder / MARKER_FILE) as tmp:
        tmp.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_model(name: str, root: Path | None = None, texts: list[str] | None = None) -> Path:
    """Return the folder of tiny model ``name`` under ``root`` (default ``cache_dir()/tiny``), building it once.

    ``texts`` is the tokenizer's training corpus (default :func:`corpus_texts`, the builtin train rows).

    The build runs under a file lock beside the folder and writes into an :func:`atomic_dir`, so
    concurrent callers get one build and never a half-written folder. A folder whose marker no longer
    matches (new recipe, changed builtin data) is rebuilt. ``root`` is created 0700; a ``root``,
    folder or lock that this user may not trust is refused in one line before it is read or locked.
    """
    if name not in SPECS:
        raise UserError(f"unknown tiny model {name!r}; choose one of: {', '.join(TINY_NAMES)}")
    root = trusted_cache_root(Path(root).expanduser() if root is not None else default_root(), default_root())
    folder = root / name
    texts = corpus_texts() if texts is None else texts
    marker = _marker(name, _corpus_digest(texts))
    check_cached_folder(folder, "tiny-model folder")
    if _is_complete(folder, marker):
        return folder
    with cache_lock(root / f".{name}.lock", "tiny-model lock"):
        check_cached_folder(folder, "tiny-model folder")
        if _is_complete(folder, marker):  # built by another process while we waited
            return folder
        logger.info("building tiny model %s in %s", name, folder)
        with atomic_dir(folder) as tmp:
            _build(name, tmp, texts, marker)
        keep_to_owner(folder)
    return folder
