"""Model builders with upstream's names: ``create_hf_model``, ``create_critic_model``.

Differences from upstream (each fixes a reported problem):
- ``model.config.pad_token_id`` is the tokenizer's pad id (upstream forced eos, DSE #719).
- The vocabulary is padded up to a multiple of 8 but never shrunk below the checkpoint's size.
- A step-3 critic/reward path must be a step-2 output: missing or unexpected keys fail loudly
  (upstream's loader swallowed them, so a wrong path trained a random critic, bug §10.7).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dschat.errors import UserError
from dschat.models.registry import load_config, resolve_model_path

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


def _is_zero3(ds_config: dict | None) -> bool:
    return bool(ds_config) and ds_config.get("zero_optimization", {}).get("stage") == 3


def create_hf_model(
    model_class: Any,
    model_name_or_path: str,
    tokenizer: Any,
    ds_config: dict | None = None,
    rlhf_training: bool = False,
    dropout: float | None = None,
) -> nn.Module:
    """Build an HF model (``AutoModelForCausalLM`` or ``AutoModel``) as upstream does.

    Under ZeRO-3 an ``HfDeepSpeedConfig`` is alive during construction so weights are created
    partitioned (``zero.Init``); it is dropped afterwards so later non-ZeRO-3 models are not built
    partitioned by mistake. ``rlhf_training=True`` builds from the config (weights loaded later).
    """
    path = resolve_model_path(model_name_or_path)
    model_config = load_config(path)
    configure_dropout(model_config, dropout)

    dschf = None
    if _is_zero3(ds_config):
        from transformers.integrations import HfDeepSpeedConfig

        dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must stay alive during the load
    if rlhf_training:
        model = model_class.from_config(model_config)
    else:
        model = model_class.from_pretrained(path, config=model_config, dtype=torch.float32, trust_remote_code=False)

    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    new_size = padded_vocab_size(model.config.vocab_size, len(tokenizer))
    if new_size != model.get_input_embeddings().weight.shape[0] or _is_zero3(ds_config):
        # Under ZeRO-3 the local weight shape is partitioned; resize always (a no-op when equal).
        # dschf must still be alive here: transformers gathers the partitioned embeddings for the
        # resize only while it sees ZeRO-3 enabled (else: "not enough values to unpack").
        model.resize_token_embeddings(new_size)
    del dschf
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
) -> nn.Module:
    """A :class:`RewardModel` around ``AutoModel``.

    ``rlhf_training=False`` (step 2): the body comes from any causal-LM or base-model folder and the
    value head is fresh. ``rlhf_training=True`` (step 3, ``rw_eval.py``): the folder must be a step-2
    output; body and value head are loaded with strict key checking.
    """
    from transformers import AutoModel

    from dschat.utils.model.reward_model import RewardModel, load_value_head, value_head_file

    path = resolve_model_path(model_name_or_path)
    start = time.time()
    if rlhf_training:
        if not value_head_file(path).exists():
            raise UserError(
                f"critic/reward path {model_name_or_path!r} is not a step-2 reward model output "
                f"(no {value_head_file(path).name}); pass the --output_dir of "
                "training/step2_reward_model_finetuning/main.py"
            )
        base = _load_base_strict(AutoModel, path, tokenizer, ds_config, dropout)
    else:
        base = create_hf_model(AutoModel, path, tokenizer, ds_config, False, dropout)
    critic = RewardModel(base, tokenizer, num_padding_at_beginning, compute_fp32_loss)
    if rlhf_training:
        load_value_head(critic, path)
    print(f">Creating critic model from {model_name_or_path} took {time.time() - start:.2f} seconds")
    return critic


def _load_base_strict(
    model_class: Any, path: str, tokenizer: Any, ds_config: dict | None, dropout: float | None
) -> nn.Module:
    """``from_pretrained`` that refuses missing / unexpected / mismatched keys."""
    model_config = load_config(path)
    configure_dropout(model_config, dropout)
    dschf = None
    if _is_zero3(ds_config):
        from transformers.integrations import HfDeepSpeedConfig

        dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must stay alive during the load
    model, info = model_class.from_pretrained(
        path, config=model_config, dtype=torch.float32, output_loading_info=True, trust_remote_code=False
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
    if padded_vocab_size(model.config.vocab_size, len(tokenizer)) != model.config.vocab_size:
        model.resize_token_embeddings(padded_vocab_size(model.config.vocab_size, len(tokenizer)))
    del dschf  # kept alive through the resize: transformers gathers ZeRO-3 embeddings only then
    return model


def causal_lm_model_to_fp32_loss(model: nn.Module) -> None:
    """Make ``model(...).loss`` a shifted cross-entropy computed on fp32 logits (upstream name).

    transformers >= 4.46 already upcasts logits in its loss; this keeps upstream's explicit
    behaviour for ``--compute_fp32_loss`` whatever the model does.
    """
    from dschat.rl_math import causal_lm_loss

    original_forward = model.forward

    def forward(*args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        output = original_forward(*args, **kwargs)
        if labels is not None:
            output.loss = causal_lm_loss(output.logits, labels, fp32=True)
        return output

    model.forward = forward  # type: ignore[method-assign]


def model_dir_exists(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").exists()
