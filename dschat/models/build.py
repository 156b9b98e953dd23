"""Model builders with upstream's names: ``create_hf_model``, ``create_critic_model``.

Contracts (the differences from upstream: docs/upstream.md):
- ``model.config.pad_token_id`` is the tokenizer's pad id.
- The vocabulary is padded up to a multiple of 8 but never shrunk below the checkpoint's size --
  except in step 3 when the models' sizes differ: then all are resized to the tokenizer's length
  rounded up to 8 (:func:`aligned_vocab_rows`).
- A model path may be a PEFT LoRA adapter folder (dschat's ``lora_adapter/`` or any other): its base
  model is built and the adapter merged into it (:mod:`dschat.models.peft_adapter`).
- A step-3 critic/reward path must be a step-2 output -- dschat's (safetensors body +
  ``v_head.safetensors``) or upstream's (``pytorch_model.bin`` of the whole reward model) -- or a
  one-label Hugging Face sequence classifier (its body, its ``score`` row as the value head): a
  missing, unexpected or wrongly shaped key is one :class:`~dschat.errors.UserError`.
"""
from __future__ import annotations

import json
import math
import re
import time
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import deepspeed
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dschat.errors import UserError, cannot_read, first_keys, first_line
from dschat.models.peft_adapter import merge_lora_adapter, read_adapter
from dschat.models.registry import check_readable, is_adapter_folder, load_config, resolve_model_path
from dschat.models.reward_model import (
    RewardModel,
    check_classifier,
    copy_value_head,
    critic_format,
    load_upstream_state,
    load_classifier_state,
    load_value_head,
    not_a_critic_message,
    split_classifier_state,
    split_upstream_state,
    value_head_file,
)
from dschat.paths import UPSTREAM_WEIGHTS_FILE
from dschat.rl_math.logprobs import causal_lm_loss
from dschat.runtime.zero3 import any_zero3, full_shape

__all__ = [
    "DROPOUT_KEYS",
    "configure_dropout",
    "padded_vocab_size",
    "aligned_vocab_rows",
    "create_hf_model",
    "load_pretrained",
    "create_critic_model",
    "key_problems",
    "LoadReport",
    "load_state_dict_into_model",
    "causal_lm_model_to_fp32_loss",
    "model_dir_exists",
]

DROPOUT_KEYS = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout")


def configure_dropout(model_config: Any, dropout: float | None) -> None:
    """Override every dropout probability the config has (upstream's ``--dropout``)."""
    if dropout is None:
        return
    for key in DROPOUT_KEYS:
        if hasattr(model_config, key):
            print(f"Setting model_config.{key} to {dropout}")
            setattr(model_config, key, dropout)


def padded_vocab_size(config_vocab_size: int, tokenizer_len: int, multiple: int = 8) -> int:
    """Embedding rows: a multiple of 8 that covers the tokenizer, never below the checkpoint's."""
    return int(multiple * math.ceil(max(config_vocab_size, tokenizer_len) / multiple))


def aligned_vocab_rows(tokenizer: Any, configs: dict[str, Any]) -> tuple[int | None, str | None]:
    """Embedding rows for models that must read each other's token ids (step 3's actor, reference,
    critic and reward model), and the line that says so; ``(None, None)`` when they agree.

    ``configs`` maps a name for the message to a model config. Each model alone would keep its
    :func:`padded_vocab_size`, so models whose checkpoints differ in size (an actor with 50272 rows,
    an upstream critic resized to 552) would keep different ones, and the actor would sample ids the
    critic has no row for: a device-side assert on CUDA, an ``IndexError`` on a CPU. Then every model
    is resized as upstream resizes them all: to the tokenizer's length rounded up to 8.
    """
    rows = {name: padded_vocab_size(config.vocab_size, len(tokenizer)) for name, config in configs.items()}
    if len(set(rows.values())) <= 1:
        return None, None
    target = padded_vocab_size(0, len(tokenizer))
    sizes = ", ".join(f"{name} {n}" for name, n in rows.items())
    return target, (
        f"note: the models' embeddings differ in size ({sizes} rows); every model is resized to the tokenizer's "
        f"length rounded up to 8 ({target} rows), as upstream does, so the actor samples only ids every model reads"
    )


def _is_zero3(ds_config: dict | None) -> bool:
    return bool(ds_config) and ds_config.get("zero_optimization", {}).get("stage") == 3


def create_hf_model(
    model_class: Any,
    model_name_or_path: str,
    tokenizer: Any,
    ds_config: dict | None = None,
    rlhf_training: bool = False,
    dropout: float | None = None,
    *,
    vocab_rows: int | None = None,
) -> nn.Module:
    """Build an HF model (``AutoModelForCausalLM`` or ``AutoModel``) as upstream does.

    Under ZeRO-3 an ``HfDeepSpeedConfig`` is alive during construction so weights are created
    partitioned (``zero.Init``); it is dropped afterwards so later non-ZeRO-3 models are not built
    partitioned by mistake. ``rlhf_training=True`` builds from the config (weights loaded later).
    ``vocab_rows`` (:func:`aligned_vocab_rows`) sets the embedding rows instead of
    :func:`padded_vocab_size`.
    """
    path = resolve_model_path(model_name_or_path)
    if is_adapter_folder(path):
        return _adapter_model(model_class, path, tokenizer, ds_config, rlhf_training, dropout, vocab_rows)
    model_config = load_config(path)
    configure_dropout(model_config, dropout)
    # lazy (here and below): transformers (with accelerate) costs 1.0 s CPU at import (python -X
    # importtime), and step 2's --help imports this module without it.
    from transformers.integrations import HfDeepSpeedConfig

    dschf = None
    if _is_zero3(ds_config):
        dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must stay alive during the load
    if rlhf_training:
        model = model_class.from_config(model_config)
    else:
        model = load_pretrained(model_class, path, config=model_config, dtype=torch.float32)

    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    # dschf must still be alive here: transformers gathers the partitioned embeddings for the
    # resize only while it sees ZeRO-3 enabled (else: "not enough values to unpack").
    resize_vocab(model, vocab_rows or padded_vocab_size(model.config.vocab_size, len(tokenizer)))
    del dschf
    return model


def resize_vocab(model: nn.Module, rows: int) -> None:
    """Resize ``model``'s input embeddings (and a tied head) to ``rows`` where their full row count
    differs (ZeRO-3: the partitioned weight's ``ds_shape``), leaving torch's random state as it was.

    transformers initialises a fresh embedding for a resize (under ZeRO-3 even for the same size),
    which draws from the global generator: a run's dropout masks and LoRA initialisations then
    depended on the ZeRO stage for the same ``--seed``."""
    if full_shape(model.get_input_embeddings().weight)[0] == rows:
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        model.resize_token_embeddings(rows)


# transformers' OSError for a folder without weights (a missing model.safetensors / pytorch_model.bin).
_NO_WEIGHTS = re.compile(r"no file named|does not appear to have a file named")
_LOADED = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")  # the safetensors files from_pretrained reads


def load_pretrained(model_class: Any, path: str, **kwargs: Any) -> Any:
    """``model_class.from_pretrained(path, trust_remote_code=False, **kwargs)``; weights that are missing,
    damaged or truncated are one :class:`UserError` line naming the folder or file (other errors pass
    through)."""
    try:
        return model_class.from_pretrained(path, trust_remote_code=False, **kwargs)
    except SafetensorError as err:
        loaded = (f for f in sorted(Path(path).glob("*.safetensors")) if _LOADED.match(f.name))  # not a backup
        damaged = next((f for f in loaded if not _readable(f)), Path(path))
        raise UserError(f"cannot read the weights in {damaged} ({type(err).__name__}: {first_line(err)}): the file is "
                        "damaged or truncated; copy or save the model again") from None
    except FileNotFoundError as err:  # a shard its index lists is not there (or, from safetensors, not readable)
        missing = Path(err.filename or str(err).rpartition(": ")[2])
        if missing.parent.resolve() != Path(path).resolve():
            raise
        check_readable(missing)
        listed = ", which its weights index lists" if any(Path(path).glob("*.index.json")) else ""
        raise UserError(f"{path} lacks {missing.name}{listed}; copy or save the model again") from None
    except PermissionError as err:
        raise cannot_read(err.filename or path, err) from None
    except OSError as err:
        if not _NO_WEIGHTS.search(str(err)):
            raise
        raise UserError(f"{path} has no model weights (model.safetensors or pytorch_model.bin, or their sharded "
                        "index, beside config.json); copy or save the model again") from None
    except Exception as err:  # noqa: BLE001 -- only torch.load's own failure on a weights file, else re-raised
        damaged = (_unreadable_bin(Path(path)) if isinstance(err, EOFError) or _TORCH_LOAD_FAILED.search(str(err))
                   else None)
        if damaged is None:
            raise
        raise UserError(f"cannot read the weights in {damaged} ({type(err).__name__}: {first_line(err)}): the file is "
                        "damaged or truncated, or holds Python objects besides tensors (dschat loads no pickles); "
                        "copy or save the model again") from None


# torch.load's own failures (a cut zip archive; bytes that are no tensor file), not a model's (a size mismatch).
_TORCH_LOAD_FAILED = re.compile(r"PytorchStreamReader|Weights only load failed|invalid load key|unpickl|unexpected EOF|"
                                r"might be corrupted|legacy \.tar format", re.IGNORECASE)


def _unreadable_bin(folder: Path) -> Path | None:
    """The first weights file of ``folder`` that transformers reads as a ``torch.load`` file
    (``pytorch_model.bin``, or the shards its ``pytorch_model.bin.index.json`` names) and that
    ``torch.load(weights_only=True)`` refuses, or None. Other ``.bin`` files (a trainer's
    ``training_args.bin``) are not looked at."""
    index = folder / f"{UPSTREAM_WEIGHTS_FILE}.index.json"
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names = []
    for file in [folder / UPSTREAM_WEIGHTS_FILE, *(folder / name for name in names)]:
        if not file.is_file():
            continue
        try:  # memory-mapped where it can be (torch's zip format); an old-format file is read whole
            torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
        except Exception:  # noqa: BLE001 -- whatever torch.load raises: an unpickling error, a cut archive
            return file
    return None


def _readable(file: Path) -> bool:
    """Whether the safetensors ``file``'s header reads (a damaged or truncated file's does not)."""
    try:
        with safe_open(str(file), framework="pt"):
            return True
    except (SafetensorError, OSError):
        return False


def _adapter_model(model_class: Any, folder: str, tokenizer: Any, ds_config: dict | None, rlhf_training: bool,
                   dropout: float | None, vocab_rows: int | None = None) -> nn.Module:
    """The base model a LoRA adapter folder names, built by :func:`create_hf_model`, with the adapter merged."""
    adapter = read_adapter(folder)
    model = create_hf_model(model_class, adapter.base, tokenizer, ds_config, rlhf_training, dropout,
                            vocab_rows=vocab_rows)
    merge_lora_adapter(model, adapter)
    # What a LoRA trained on top of this model was trained on (its exported adapter's base): the adapter folder.
    model.config._name_or_path = str(Path(folder).resolve())
    return model


def create_critic_model(
    model_name_or_path: str,
    tokenizer: Any,
    ds_config: dict | None,
    num_padding_at_beginning: int = 0,
    rlhf_training: bool = False,
    dropout: float | None = None,
    zero_stage: int = 0,
    compute_fp32_loss: bool = False,
    *,
    vocab_rows: int | None = None,
) -> nn.Module:
    """A :class:`RewardModel` around ``AutoModel``; ``vocab_rows`` as in :func:`create_hf_model`.

    ``rlhf_training=False`` (step 2): the body comes from any causal-LM or base-model folder and the
    value head is fresh. ``rlhf_training=True`` (step 3, ``rw_eval.py``): the folder must be a step-2
    output, in dschat's format (body folder + ``v_head.safetensors``) or upstream DeepSpeed-Chat's
    (``pytorch_model.bin`` with ``rwtransformer.*`` and ``v_head.weight``), or a one-label
    ``*ForSequenceClassification`` folder (body: the keys under its ``base_model_prefix``; value head:
    its ``score.weight``, so the end score is the classifier's logit); body and value head are
    loaded with strict key checking in all three. ``zero_stage`` is upstream's argument; the ZeRO-3
    build follows ``ds_config``.
    """
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, AutoModel  # lazy: see create_hf_model

    path = resolve_model_path(model_name_or_path)
    start = time.time()
    if is_adapter_folder(path):
        return _adapter_critic(path, tokenizer, ds_config, num_padding_at_beginning, rlhf_training, dropout,
                               zero_stage, compute_fp32_loss)
    fmt = critic_format(path) if rlhf_training else None
    if rlhf_training and fmt is None:
        raise UserError(not_a_critic_message(model_name_or_path))
    head = None
    if fmt in ("upstream", "classifier"):
        body_state, head = (split_upstream_state(load_upstream_state(path), path) if fmt == "upstream"
                            else _classifier_state(path, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING))
        base = _load_base_strict(AutoModel, path, tokenizer, ds_config, dropout, state_dict=body_state,
                                 vocab_rows=vocab_rows)
        base.config._name_or_path = path  # built from a state dict: name the folder (a LoRA adapter's base)
        del body_state
    elif fmt == "dschat":
        base = _load_base_strict(AutoModel, path, tokenizer, ds_config, dropout, vocab_rows=vocab_rows)
    else:
        base = create_hf_model(AutoModel, path, tokenizer, ds_config, False, dropout, vocab_rows=vocab_rows)
    critic = RewardModel(base, tokenizer, num_padding_at_beginning, compute_fp32_loss)
    critic.reads_chat_template = fmt == "classifier"
    if fmt == "dschat":
        load_value_head(critic, path)
    elif head is not None:
        copy_value_head(critic, head, path)
    print(f">Creating critic model from {model_name_or_path} took {time.time() - start:.2f} seconds")
    return critic


def _classifier_state(path: str, mapping: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Body state (its ``base_model_prefix`` stripped) and score row of a one-label sequence classifier;
    ``mapping``: transformers' config class -> ``*ForSequenceClassification`` class."""
    check_classifier(path)
    classifier_class = mapping[type(load_config(path))]
    return split_classifier_state(load_classifier_state(path), classifier_class.base_model_prefix, path)


def _adapter_critic(folder: str, tokenizer: Any, ds_config: dict | None, num_padding_at_beginning: int,
                    rlhf_training: bool, dropout: float | None, zero_stage: int, compute_fp32_loss: bool) -> nn.Module:
    """A reward model from a LoRA adapter folder: the base it names (a step-2 output, or a model whose body
    gets a fresh value head), the adapter merged into the body, and the value head saved beside the adapter
    (dschat's export of a reward model) when there is one -- required for ``rlhf_training``."""
    adapter = read_adapter(folder)
    has_head = value_head_file(folder).is_file()
    if rlhf_training and not has_head:
        raise UserError(not_a_critic_message(folder))
    base_is_critic = critic_format(resolve_model_path(adapter.base)) is not None
    critic = create_critic_model(adapter.base, tokenizer, ds_config, num_padding_at_beginning,
                                 rlhf_training=base_is_critic, dropout=dropout, zero_stage=zero_stage,
                                 compute_fp32_loss=compute_fp32_loss)
    merge_lora_adapter(critic.rwtransformer, adapter)
    if has_head:
        load_value_head(critic, folder)
    critic.rwtransformer.config._name_or_path = str(Path(folder).resolve())
    return critic


def _load_base_strict(
    model_class: Any,
    path: str,
    tokenizer: Any,
    ds_config: dict | None,
    dropout: float | None,
    state_dict: dict[str, torch.Tensor] | None = None,
    vocab_rows: int | None = None,
) -> nn.Module:
    """``from_pretrained`` that refuses missing / unexpected / mismatched keys; then the embeddings
    get ``vocab_rows`` rows (default: :func:`padded_vocab_size`).

    With ``state_dict`` (an upstream critic's body, prefix stripped) the weights come from it and
    only ``config.json`` from ``path``; its keys are checked on every rank before anything is
    loaded (:func:`_check_body_state`), because under ZeRO-3 transformers reports neither
    unexpected keys nor, except on rank 0, shape mismatches.
    """
    from transformers import MODEL_MAPPING  # lazy: see create_hf_model
    from transformers.integrations import HfDeepSpeedConfig

    model_config = load_config(path)
    configure_dropout(model_config, dropout)
    if state_dict is not None:
        # transformers takes a state dict only without a model path, so the concrete class is needed.
        model_class = MODEL_MAPPING[type(model_config)]
        state_dict = _check_body_state(model_class, model_config, state_dict, path)
    dschf = None
    if _is_zero3(ds_config):
        dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must stay alive during the load
    if state_dict is None:
        model, info = load_pretrained(
            model_class, path, config=model_config, dtype=torch.float32, output_loading_info=True
        )
    else:
        model, info = model_class.from_pretrained(
            None, config=model_config, state_dict=state_dict, dtype=torch.float32, output_loading_info=True,
            trust_remote_code=False,
        )
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        detail = "; ".join(f"{k}: {', '.join(map(str, v[:5]))}{' ...' if len(v) > 5 else ''}" for k, v in problems.items())
        raise UserError(
            f"checkpoint {path!r} does not match its model ({detail or info['error_msgs']}); "
            "pass the step-2 output folder this run should continue from"
        )
    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    resize_vocab(model, vocab_rows or padded_vocab_size(model.config.vocab_size, len(tokenizer)))
    del dschf  # kept alive through the resize: transformers gathers ZeRO-3 embeddings only then
    return model


def _check_body_state(
    model_class: Any, model_config: Any, state_dict: dict[str, torch.Tensor], path: str
) -> dict[str, torch.Tensor]:
    """``state_dict`` minus the keys transformers itself ignores; a :class:`UserError` for any
    missing, unexpected or wrongly shaped key.

    The expected keys and shapes come from the model built on the meta device (no memory, same
    answer on every rank). Ignored as transformers ignores them: the model's
    ``_keys_to_ignore_on_load_unexpected`` / ``_on_load_missing`` patterns, and the buffers older
    transformers saved (``rotary_emb.inv_freq``, ``position_ids``) that are no longer persistent.
    """
    with torch.device("meta"):
        reference = model_class(model_config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    ignore_unexpected = set(reference._keys_to_ignore_on_load_unexpected or ()) | {
        r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    ignore_missing = set(reference._keys_to_ignore_on_load_missing or ())
    tied = set(getattr(reference, "all_tied_weights_keys", None) or ())
    del reference

    def matches(key: str, patterns: set[str]) -> bool:
        return any(re.search(p, key) for p in patterns)

    state = {k: v for k, v in state_dict.items() if k in expected or not matches(k, ignore_unexpected)}
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(k for k in set(expected) - set(state) if k not in tied and not matches(k, ignore_missing))
    mismatched = sorted(f"{k} {tuple(state[k].shape)} vs {expected[k]}" for k in set(state) & set(expected)
                        if tuple(state[k].shape) != expected[k])
    problems = key_problems(missing, unexpected, mismatched)
    if problems:
        raise UserError(
            f"{Path(path) / UPSTREAM_WEIGHTS_FILE} does not match the {model_config.model_type} model its config.json "
            f"describes (rwtransformer.* keys {'; '.join(problems)}); pass the step-2 output folder this run "
            "should continue from"
        )
    return state


def key_problems(missing: list[str], unexpected: list[str], wrong_shape: list[str]) -> list[str]:
    """``"missing: a, b"``-style parts of a key-mismatch error line, for the non-empty lists only."""
    return [f"{name}: {first_keys(keys)}" for name, keys in
            (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape)) if keys]


class LoadReport(NamedTuple):
    """What :func:`load_state_dict_into_model` found (all empty after a clean load)."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    error_msgs: list[str]  # shape mismatches


def load_state_dict_into_model(
    model_to_load: nn.Module,
    state_dict: dict[str, torch.Tensor],
    start_prefix: str = "",
    zero_stage: int = 0,
    *,
    strict: bool = True,
) -> LoadReport:
    """Upstream's ZeRO-3-aware loader (``dschat.utils.utils.load_state_dict_into_model``), made strict.

    The state dict's keys are ``start_prefix`` + the model's ``state_dict()`` keys. Under ZeRO-3
    (``zero_stage == 3``, or parameters that are already partitioned) each module's own
    parameters are gathered with ``GatheredParameters(modifier_rank=0)`` and loaded on rank 0, one
    module at a time, as upstream does; buffers, which ZeRO-3 does not partition, are
    loaded on every rank. Missing, unexpected and wrongly shaped keys are found on every rank before
    anything is loaded: with ``strict`` (the default) they raise one :class:`UserError` and nothing
    is loaded; with ``strict=False`` the matching keys are loaded and the rest is returned.
    Upstream ignored them all: docs/upstream.md#upstreams-checkpoints-load.
    """
    expected = {start_prefix + k: full_shape(v)
                for k, v in model_to_load.state_dict(keep_vars=True).items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = sorted(k for k in set(state_dict) & set(expected) if tuple(state_dict[k].shape) != expected[k])
    report = LoadReport(missing, unexpected,
                        [f"size mismatch for {k}: {tuple(state_dict[k].shape)} in the checkpoint, "
                         f"{expected[k]} in the model" for k in wrong])
    if strict and (missing or unexpected or wrong):
        problems = key_problems(missing, unexpected, wrong)
        raise UserError(
            f"state dict does not match {type(model_to_load).__name__} ({'; '.join(problems)}); "
            "pass the checkpoint that belongs to this model"
        )
    loadable = {k: v for k, v in state_dict.items() if k in expected and k not in wrong}
    partitioned = zero_stage == 3 or any_zero3(model_to_load.parameters())
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def load(module: nn.Module, prefix: str) -> None:
        params = [p for name, p in module.named_parameters(prefix=prefix[:-1], recurse=False) if name in loadable]
        buffers = [b for name, b in module.named_buffers(prefix=prefix[:-1], recurse=False) if name in loadable]
        if params or buffers:
            # strict=False here: keys of other modules are in the dict, and the checks above are ours.
            args = (loadable, prefix, {}, False, [], [], [])
            if partitioned and params:
                # Every rank gathers; rank 0's values are broadcast when the context exits. Other
                # ranks load too only when the module has buffers (kept whole on every rank).
                with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                    if rank == 0 or buffers:
                        module._load_from_state_dict(*args)
            else:
                module._load_from_state_dict(*args)
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    load(model_to_load, start_prefix)
    return report


def causal_lm_model_to_fp32_loss(model: nn.Module) -> None:
    """Make ``model(...).loss`` a shifted cross-entropy computed on fp32 logits (upstream name).

    transformers >= 4.46 already upcasts logits in its loss; this keeps upstream's explicit
    behaviour for ``--compute_fp32_loss`` whatever the model does.
    """
    original_forward = model.forward

    def forward(*args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        output = original_forward(*args, **kwargs)
        if labels is not None:
            output.loss = causal_lm_loss(output.logits, labels, fp32=True)
        return output

    model.forward = forward  # type: ignore[method-assign]


def model_dir_exists(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").exists()
