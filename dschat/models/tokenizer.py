"""Tokenizer loading with upstream's conventions and a safe pad policy.

Upstream (``load_hf_tokenizer``) re-reads the tokenizer named in ``config.json['_name_or_path']``
because its checkpoints did not save tokenizer files (DSE #460, #467). We save full tokenizer
folders, so a folder is loaded as it is.

Pad policy. Upstream sets ``pad = eos`` and then derives masks with ``ids != pad``, which makes
every EOS (and OPT's BOS, which is the same id) invisible: the SFT model never learns to stop and
the PPO actor never receives gradient for emitting EOS (upstream bug list §10.10). dschat keeps the
tokenizer's own pad token, falls back to ``pad = eos`` only when there is none (as upstream), and
never derives a mask from the pad id: masks come from the tokenizer (steps 1-2) and from generation
lengths (step 3). So ``pad == eos`` is harmless, and token ids match upstream's.
"""
from __future__ import annotations

from typing import Any, Sequence

from dschat.errors import UserError
from dschat.models.registry import custom_code_error, resolve_model_path


def load_hf_tokenizer(
    model_name_or_path: str,
    fast_tokenizer: bool = True,
    add_special_tokens: str | Sequence[str] | None = None,
) -> Any:
    """Load a right-padded tokenizer for ``model_name_or_path`` (folder, hub id or short name)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model_name_or_path)
    try:
        # trust_remote_code=False: never run a tokenizer's own code (transformers' default asks on stdin).
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=fast_tokenizer, trust_remote_code=False)
    except (OSError, ValueError) as err:
        refused = custom_code_error(model_name_or_path, err)
        if refused is not None:
            raise refused from None
        raise UserError(
            f"cannot load a tokenizer from {model_name_or_path!r} ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); pass a folder with tokenizer files "
            "(tokenizer.json or tokenizer_config.json)"
        ) from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
    # Steps 1-2 pad on the right (the reward model's end score relies on it); step-3 prompts are
    # left-padded by DataCollatorRLHF's flip trick, not by the tokenizer (DSE #457, #601).
    tokenizer.padding_side = "right"
    if add_special_tokens is not None:
        tokens = [add_special_tokens] if isinstance(add_special_tokens, str) else list(add_special_tokens)
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


# Upstream's older name.
get_tokenizer = load_hf_tokenizer
