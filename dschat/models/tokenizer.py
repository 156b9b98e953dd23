"""Tokenizer loading with upstream's conventions and a safe pad policy.

Upstream's ``load_hf_tokenizer`` re-reads the tokenizer named in ``config.json['_name_or_path']``
(docs/upstream.md#tokenizer-files-in-checkpoints). We save full tokenizer folders, so a folder is
loaded as it is (a PEFT adapter folder without tokenizer files: its base model's tokenizer). A
folder without ``tokenizer.json`` and ``tokenizer_config.json`` -- an upstream output, which holds bare vocabulary files
(``save_vocabulary``) -- is loaded upstream's way, from its ``_name_or_path``: the bare files
would give the tokenizer class's default special tokens (``<|endoftext|>`` and no BOS for OPT's
GPT-2 vocabulary, where the model uses ``</s>``).

Pad policy. The tokenizer keeps its own pad token; ``pad = eos`` only when it has none (as
upstream). No mask is derived from the pad id: masks come from the tokenizer (steps 1-2) and from
generation lengths (step 3), so ``pad == eos`` hides no EOS, and token ids match upstream's.
Upstream's ``ids != pad`` masks: docs/upstream.md#pad-and-eos.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dschat.errors import UserError, cannot_read, first_line
from dschat.models.registry import TOKENIZER_FILES, custom_code_error, is_adapter_folder, resolve_model_path
from dschat.runtime.dist import print_rank_0

# Either makes a folder's tokenizer complete (special tokens included); without both, a folder
# holds at most bare vocabulary files.
FULL_TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
# What --add_eot_token adds in steps 2 and 3 (upstream: this literal, as a special token).
EOT_SPECIAL_TOKEN = "<|endoftext|>"
_MAX_REDIRECTS = 8  # a step-3 actor names its step-1 folder, which names the base model, ...


def _name_or_path_of(path: str) -> str | None:
    """The ``_name_or_path`` of a local folder that has no full tokenizer files, else None."""
    folder = Path(path)
    if not folder.is_dir() or any((folder / name).is_file() for name in FULL_TOKENIZER_FILES):
        return None
    try:
        name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or not name.strip():
        return None
    if Path(name).expanduser().exists() and Path(name).expanduser().resolve() == folder.resolve():
        return None  # names itself: nothing else to load
    return name.strip()


def _has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds any file a tokenizer loads from (the usual names, or another vocabulary:
    ``sentencepiece.bpe.model``, ``*.tiktoken``, ``vocab.*``)."""
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return True
    return any(p.is_file() for pattern in ("*.model", "*.tiktoken", "vocab*", "*vocab.*", "merges*")
               for p in folder.glob(pattern))


def _copy_files_error(folder: str, original: str, why: str) -> UserError:
    return UserError(
        f"{folder} has no tokenizer.json or tokenizer_config.json (an upstream DeepSpeed-Chat output saves "
        f"only the vocabulary), and the tokenizer its config.json names in _name_or_path, {original!r}, cannot "
        f"be loaded ({why}); copy the original model's tokenizer files (tokenizer.json, tokenizer_config.json, "
        f"special_tokens_map.json) into {folder}"
    )


def _tokenizer_source(resolved: str) -> str:
    """The folder or hub id to load the tokenizer from: ``resolved`` itself, or, for an upstream
    output without tokenizer files, the model its ``_name_or_path`` names (followed as far as it
    leads: a step-3 actor names its step-1 folder, which names the base model)."""
    path = resolved
    while is_adapter_folder(path) and not any((Path(path) / name).is_file() for name in FULL_TOKENIZER_FILES):
        # lazy: it imports deepspeed, +0.4 s CPU at import (python -X importtime), which chat.py and
        # the data preparation never need but for an adapter folder.
        from dschat.models.peft_adapter import read_adapter

        path = resolve_model_path(read_adapter(path).base)  # a PEFT adapter without a tokenizer: its base's
    seen = {str(Path(path).resolve())}
    while (original := _name_or_path_of(path)) is not None:
        try:
            target = resolve_model_path(original)
        except UserError as err:
            raise _copy_files_error(path, original, str(err)) from None
        if str(Path(target).resolve()) in seen or len(seen) > _MAX_REDIRECTS:
            raise _copy_files_error(path, original, "its _name_or_path entries lead in a circle or through more than "
                                    f"{_MAX_REDIRECTS} folders")
        print_rank_0(f"{path} has no tokenizer files (an upstream DeepSpeed-Chat output): loading the tokenizer "
                     f"of {original}, named by its config.json _name_or_path")
        seen.add(str(Path(target).resolve()))
        path = target
    folder = Path(path)
    if folder.is_dir() and not _has_tokenizer_files(folder):
        raise UserError(
            f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...), so it would load as an empty "
            "tokenizer; copy the tokenizer files of the model it was trained from (tokenizer.json, "
            "tokenizer_config.json, special_tokens_map.json) into it, or set \"_name_or_path\" in its config.json "
            "to that model's folder or hub id")
    if (folder.is_dir() and not any((folder / name).is_file() for name in FULL_TOKENIZER_FILES)
            and any((folder / name).is_file() for name in TOKENIZER_FILES)):
        print_rank_0(f"warning: {path} has only vocabulary files (no tokenizer.json or tokenizer_config.json): "
                     "its special tokens are the tokenizer class's defaults, which may not be the model's; copy "
                     "the original tokenizer files into it if they differ")
    return path


def check_tokenizer_files(model_name_or_path: str) -> None:
    """Refuse, in one :class:`UserError` line, a local model folder whose tokenizer would not load
    (no tokenizer files, nor a ``_name_or_path`` that leads to them): what :func:`load_hf_tokenizer`
    refuses, checked without loading (e2e checks every step's model before step 1 trains)."""
    _tokenizer_source(resolve_model_path(model_name_or_path))


def load_hf_tokenizer(
    model_name_or_path: str,
    fast_tokenizer: bool = True,
    add_special_tokens: str | Sequence[str] | None = None,
) -> Any:
    """Load a right-padded tokenizer for ``model_name_or_path`` (folder, hub id or short name)."""
    # lazy: transformers' tokenizer classes cost 0.3 s CPU at import (python -X importtime), and the
    # step scripts import this module before parsing --help.
    from transformers import AutoTokenizer

    resolved = resolve_model_path(model_name_or_path)
    path = _tokenizer_source(resolved)
    try:
        # trust_remote_code=False: never run a tokenizer's own code (transformers' default asks on stdin).
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=fast_tokenizer, trust_remote_code=False)
    except PermissionError as err:
        raise cannot_read(err.filename or path, err) from None
    except (OSError, ValueError) as err:
        refused = custom_code_error(model_name_or_path, err)
        if refused is not None:
            raise refused from None
        if path != resolved:
            raise _copy_files_error(resolved, path, f"{type(err).__name__}: {first_line(err)}") from err
        raise UserError(
            f"cannot load a tokenizer from {model_name_or_path!r} ({type(err).__name__}: "
            f"{first_line(err)}); pass a folder with tokenizer files "
            "(tokenizer.json or tokenizer_config.json)"
        ) from err
    if len(tokenizer) <= 1:  # e.g. a tokenizer class's defaults over vocabulary files that hold nothing
        raise UserError(f"the tokenizer loaded from {path} has {len(tokenizer)} token(s): its tokenizer files are "
                        "empty or damaged; copy the tokenizer files of the model it was trained from into it")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
    # Steps 1-2 pad on the right (the reward model's end score relies on it); step-3 prompts are
    # left-padded by DataCollatorRLHF's flip trick, not by the tokenizer.
    tokenizer.padding_side = "right"
    if add_special_tokens is not None:
        tokens = [add_special_tokens] if isinstance(add_special_tokens, str) else list(add_special_tokens)
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


def tokenizer_differences(a: Any, b: Any) -> list[str]:
    """What differs between two tokenizers as a model sees them: the vocabulary (every token's id)
    and the bos / eos / pad ids. Empty when a model trained on one reads the other's ids rightly."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    out = []
    if len(vocab_a) != len(vocab_b):
        out.append(f"vocabulary size {len(vocab_a)} vs {len(vocab_b)}")
    else:
        moved = sorted((i, t) for t, i in vocab_a.items() if vocab_b.get(t) != i)
        if moved:
            i, token = moved[0]
            out.append(f"vocabulary: {len(moved)} of {len(vocab_a)} tokens have other ids (e.g. {token!r}: "
                       f"{i} vs {vocab_b.get(token)})")
    for name in ("bos", "eos", "pad"):
        id_a, id_b = getattr(a, f"{name}_token_id"), getattr(b, f"{name}_token_id")
        if id_a != id_b:
            out.append(f"{name} id {id_a} vs {id_b}")
    return out


def end_id_tuple(ids: int | Sequence[int | None] | None) -> tuple[int, ...]:
    """End ids given as one id, several (as ``generate``'s ``eos_token_id``) or None, as a tuple."""
    if ids is None:
        return ()
    return (int(ids),) if isinstance(ids, int) else tuple(int(i) for i in ids if i is not None)


def end_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The token ids that end an answer, without repeats: ``tokenizer.eos_token_id`` first, then each
    id of ``model.generation_config.eos_token_id`` (one id or a list, e.g. an instruct model's
    end-of-turn and end-of-text ids), which is what Hugging Face ``generate`` -- and so upstream's
    step 3 -- stops on. Empty when neither is set."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return tuple(dict.fromkeys([*end_id_tuple(tokenizer.eos_token_id), *end_id_tuple(configured)]))


def end_of_conversation_text(tokenizer: Any, given: str | None, model_path: str) -> str:
    """The end-of-conversation text appended to every phase-1/2 training text: ``given``
    (``--end_of_conversation_token``) if set, else the tokenizer's EOS; one line naming the fix when the
    tokenizer has none."""
    eot = given or tokenizer.eos_token
    if not eot:
        raise UserError(f"the tokenizer of {model_path} has no EOS token; pass --end_of_conversation_token "
                        "(e.g. '<|endoftext|>')")
    return eot


def template_turn_end_id(tokenizer: Any) -> int | None:
    """The special token the tokenizer's chat template closes an assistant turn with (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``): a model chatting through the template ends its answer there,
    also where that token is neither the tokenizer's EOS nor in the generation config (a base model's
    tokenizer with a ChatML template). None without a template, where the turn is closed by plain text,
    or where the template refuses a one-question conversation."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    sentinel = "\x00dschat-turn\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                              {"role": "assistant", "content": sentinel}], tokenize=False)
    except Exception:  # noqa: BLE001 -- a template's own refusal (jinja's raise_exception and the like)
        return None
    if not isinstance(text, str) or sentinel not in text:
        return None
    after = text.rsplit(sentinel, 1)[1].lstrip()
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    return ids[0] if ids and ids[0] in special | set(tokenizer.all_special_ids) else None


def generate_eos(end_ids: Sequence[int]) -> int | list[int] | None:
    """``generate``'s ``eos_token_id`` for ``end_ids``: the one id, a list of several, or None."""
    if not end_ids:
        return None
    return end_ids[0] if len(end_ids) == 1 else list(end_ids)


# Upstream's older name.
get_tokenizer = load_hf_tokenizer
