"""The parameters of step 3's four models, read from their ``config.json`` alone.

A model is built on PyTorch's ``meta`` device from its config (no weights are read or allocated),
so every architecture transformers builds is counted exactly as the training run builds it: the
embedding rows dschat gives it (:func:`dschat.models.build.padded_vocab_size` of the config's
vocabulary, or the tokenizer length the caller passes), tied heads counted once, biases and norms.
The critic and the reward model are ``AutoModel`` bodies with dschat's value head
(``v_head``: hidden -> 1, no bias, :class:`dschat.models.reward_model.RewardModel`). LoRA is laid
over the inventory as :func:`dschat.models.lora.convert_linear_layer_to_lora` lays it over the model:
every ``nn.Linear`` whose qualified name contains the module filter gets ``lora_right_weight``
(in, r) and ``lora_left_weight`` (r, out) after its own weight and bias, and its weight is frozen;
``only_optimize_lora`` then trains only the factors (and the critic's value head).

:class:`Param` entries keep ``named_parameters()`` order, which decides where DeepSpeed's ZeRO-1/2
partition boundaries fall.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoModel, AutoModelForCausalLM

from dschat.errors import UserError
from dschat.models.build import padded_vocab_size
from dschat.models.families import FAMILIES, value_head_dim
from dschat.models.lora import refuse_tied_targets
from dschat.models.registry import load_config
from dschat.models.reward_model import VALUE_HEAD_KEY
from dschat.runtime.optim import get_optimizer_grouped_parameters

__all__ = ["Param", "Inventory", "read_config", "inventory", "with_lora", "optimizer_groups"]


@dataclass(frozen=True)
class Param:
    """One parameter: qualified name, element count, whether the optimizer trains it."""

    name: str
    numel: int
    requires_grad: bool = True


@dataclass(frozen=True)
class Inventory:
    """A model's parameters in ``named_parameters()`` order, and the config facts the phases need."""

    params: tuple[Param, ...]
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_rows: int

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.requires_grad)


def read_config(folder: str) -> Any:
    """The transformers config of a model folder (or hub id) holding at least ``config.json``.

    A missing file, one that is not a JSON object, an architecture transformers does not know and a
    config transformers refuses (a missing or mistyped field, a value its checks reject) are one
    :class:`UserError` line naming the file.
    """
    path = Path(folder)
    if path.is_dir() and not (path / "config.json").is_file():
        raise UserError(f"{folder} has no config.json; pass a model folder (a config.json alone is enough to plan)")
    if not path.is_dir():
        raise UserError(f"model folder {folder} does not exist; pass a folder holding the model's config.json")
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{file} is not readable JSON ({err}); pass the model's own config.json") from None
    if not isinstance(data, dict):
        raise UserError(f"{file} holds a JSON {type(data).__name__}, not an object of the model's settings; pass the "
                        "model's own config.json")
    model_type = data.get("model_type")
    try:
        return load_config(str(path))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers' checks raise many types; each is the file's problem
        reason = " ".join(str(err).split())[:160] or type(err).__name__
        registered = isinstance(model_type, str) and model_type in CONFIG_MAPPING
        if isinstance(err, (ValueError, KeyError)) and not registered:
            known = ", ".join(sorted(FAMILIES))
            raise UserError(f"{file}: unknown architecture {model_type!r} ({reason}); dschat plans models transformers "
                            f"builds, such as {known}") from None
        raise UserError(f"{file}: transformers cannot read this {model_type} config ({type(err).__name__}: "
                        f"{reason}); fix the file or pass the model's own config.json") from None



def _first(config: Any, *names: str, default: int = 0) -> int:
    """The first of ``names`` that ``config`` sets to a positive whole number; a negative one is a
    :class:`UserError` line (it would plan negative bytes)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            where = getattr(config, "name_or_path", "") or "the model's config"
            raise UserError(f"{where}: {name} is {value}; a count of layers, heads or widths must be positive "
                            "(fix the config.json)")
        if isinstance(value, int) and value:
            return value
    return default


def inventory(config: Any, *, critic: bool, tokenizer_len: int = 0) -> tuple[Inventory, nn.Module]:
    """The parameters of the actor/reference (``critic=False``: ``AutoModelForCausalLM``) or of the
    critic/reward model (``critic=True``: ``AutoModel`` + ``v_head``) built from ``config``."""
    config = type(config).from_dict(config.to_dict())
    if not isinstance(getattr(config, "vocab_size", None), int):  # a multimodal config nests it (text_config)
        where = getattr(config, "name_or_path", "") or "its config"
        raise UserError(f"{where} sets no top-level vocab_size (a {config.model_type} config); pass a decoder-only "
                        "causal LM config")
    rows = padded_vocab_size(config.vocab_size, tokenizer_len)
    config.vocab_size = rows
    model_class = AutoModel if critic else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = model_class.from_config(config)
    except (ValueError, TypeError, ArithmeticError, AssertionError, RuntimeError, KeyError, AttributeError) as err:
        # a config value the model's code rejects (a vocab_size of 0 fails an assert, a negative width a
        # tensor's shape, an unknown rope_scaling type a lookup, a missing field an attribute)
        where = getattr(config, "name_or_path", "") or "its config"
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
        reason = f"KeyError: {reason}" if isinstance(err, KeyError) else reason  # a bare 'key' says little
        raise UserError(f"cannot build a {config.model_type} model from {where} ({reason}); "
                        "pass a decoder-only causal LM config") from None
    prefix = "rwtransformer." if critic else ""
    # RewardModel registers v_head before the body: it comes first in named_parameters().
    params = [Param(VALUE_HEAD_KEY, value_head_dim(config))] if critic else []
    params += [Param(prefix + name, p.numel()) for name, p in model.named_parameters()]
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    return Inventory(
        params=tuple(params), model_type=config.model_type, hidden=hidden,
        layers=_first(config, "num_hidden_layers", "n_layer", "num_layers"), heads=heads,
        kv_heads=_first(config, "num_key_value_heads", default=heads),
        intermediate=_first(config, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden),
        vocab_rows=rows,
    ), model


def with_lora(inv: Inventory, model: nn.Module, lora_dim: int, module_name: str, only_optimize: bool,
              force_optimize: Sequence[str] = ()) -> Inventory:
    """``inv`` with LoRA factors on every ``nn.Linear`` of ``model`` whose name contains ``module_name``
    (``model``: the meta model :func:`inventory` built; an empty match is a :class:`UserError`)."""
    if lora_dim <= 0:
        return inv
    prefix = "rwtransformer." if inv.params[0].name == VALUE_HEAD_KEY else ""
    matched = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and module_name in prefix + name]
    if not matched:
        raise UserError(f"the LoRA module filter {module_name!r} matches no Linear layer of this {inv.model_type}; "
                        "pass the --*_lora_module_name of its decoder blocks")
    refuse_tied_targets(model, matched, [module_name])  # as the step refuses it (a tied lm_head)
    shapes = {prefix + name: (model.get_submodule(name).in_features, model.get_submodule(name).out_features)
              for name in matched}
    out: list[Param] = []
    for index, p in enumerate(inv.params):
        owner, _, leaf = p.name.rpartition(".")
        lora_layer = owner in shapes
        out.append(replace(p, requires_grad=False) if lora_layer and leaf == "weight" else p)
        last_of_layer = lora_layer and (index + 1 == len(inv.params)
                                        or inv.params[index + 1].name.rpartition(".")[0] != owner)
        if last_of_layer:
            fan_in, fan_out = shapes[owner]
            out.append(Param(f"{owner}.lora_right_weight", fan_in * lora_dim))
            out.append(Param(f"{owner}.lora_left_weight", lora_dim * fan_out))
    if only_optimize:
        out = [replace(p, requires_grad="lora_right_weight" in p.name or "lora_left_weight" in p.name
                       or p.name in force_optimize) for p in out]
    return replace(inv, params=tuple(out))


class _Named:
    """What :func:`get_optimizer_grouped_parameters` reads of a model: ``named_parameters()``."""

    def __init__(self, params: Sequence[Param]):
        self._params = params

    def named_parameters(self) -> list[tuple[str, Param]]:
        return [(p.name, p) for p in self._params]


def optimizer_groups(inv: Inventory) -> list[list[Param]]:
    """The trainable parameters in dschat's optimizer groups (decay, LoRA, no-decay; empty ones
    dropped), each in model order: the groups DeepSpeed flattens and partitions."""
    groups = get_optimizer_grouped_parameters(_Named(inv.params), weight_decay=0.0)
    return [list(g["params"]) for g in groups]
