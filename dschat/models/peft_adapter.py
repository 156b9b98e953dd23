"""LoRA adapters in Hugging Face PEFT's format: written beside every LoRA save, read back as a model path.

**Export.** dschat trains LoRA as upstream does (:class:`~dschat.models.lora.LinearLayer_LoRA`,
``y = x W^T + (x @ right @ left) * lora_scaling``) and saves the merged model where upstream does.
:func:`gather_lora_adapter` + :func:`write_lora_adapter` add the same update as a PEFT adapter in
``lora_adapter/`` inside that folder (``adapter_config.json`` + ``adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained(base, folder)``, vLLM and the hub read):

* factors: PEFT's layer adds ``lora_B(lora_A(x)) * scaling`` with ``lora_A.weight`` (r, in) and
  ``lora_B.weight`` (out, r), so ``lora_A.weight = right.T`` and ``lora_B.weight = left.T``, under PEFT's
  keys ``base_model.model.<module path>.lora_A.weight`` (the adapter name left out, as PEFT saves);
* scaling: dschat's ``lora_scaling`` attribute is upstream's ``lora_scaling / lora_dim`` (1/r from the
  CLI), PEFT's is ``lora_alpha / r``: so ``lora_alpha = lora_scaling * r`` (1 from the CLI);
* ``target_modules``: the LoRA layers, by their last name (``q_proj``) when that selects exactly them;
* what else the run trained: without ``--only_optimize_lora`` upstream's LoRA trains every parameter but
  the wrapped weights (embeddings, norms, biases, ``lm_head``). LoRA layers' biases go in as PEFT's
  ``bias="lora_only"`` (``<path>.base_layer.bias``), other modules as ``modules_to_save``, so that base +
  adapter is the merged model. With ``--only_optimize_lora`` the adapter holds the factors alone, the
  form LoRA servers (vLLM) accept;
* ``base_model_name_or_path``: what the LoRA model was loaded from (``config._name_or_path``, local
  folders made absolute); a reward model's adapter applies to its body (``AutoModel``) and its value
  head is saved beside it as ``v_head.safetensors``.

Under ZeRO-3 the factors and trained parameters are gathered module by module (every rank calls);
rank 0 writes, inside :func:`dschat.models.save.save_hf_model`'s atomic folder swap.

**Import.** A model flag naming an adapter folder loads the base model it names and merges the adapter
into the weights (``W += scaling * B @ A``, PEFT's ``merge_and_unload``), module by module so that ZeRO-3
partitioned weights are gathered one at a time; ``modules_to_save`` and bias tensors replace the base's.
A weight two modules share (``tie_word_embeddings``: ``lm_head`` and the input embeddings) is untied first
where the adapter changes it, as ``PeftModel`` applies it (:func:`_untie`).
Only LoRA is accepted, in safetensors, and only the variants that merge into plain weights. The folder
is untrusted, checked before anything merges (one :class:`UserError` line naming the file and the fix):
the config (:func:`dschat.models.lora.check_lora_settings`), a safetensors file that reads, factors of 2
dimensions and of the rank the config gives the layer (``rank_pattern`` by PEFT's rule), floating point
and finite. ``fan_in_fan_out`` comes from the layer type as in PEFT's ``dispatch_default``: False for
``nn.Linear``, True for transformers' ``Conv1D`` (GPT-2), the config's value ignored with PEFT's warning
where it disagrees; other layer types are refused.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from dschat.errors import UserError, first_line
from dschat.models.lora import FIX_ADAPTER_CONFIG, check_lora_settings, untie_weights
from dschat.models.adapter_card import adapter_card
from dschat.models.reward_model import VALUE_HEAD_KEY
from dschat.paths import ADAPTER_CONFIG_FILE, VALUE_HEAD_FILE, is_adapter_folder
from dschat.runtime.zero3 import full_shape, gathered, release_zero3_prefetch

__all__ = [
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS_FILE",
    "AdapterExport",
    "LoraAdapter",
    "check_adapter",
    "gather_lora_adapter",
    "is_adapter_folder",
    "merge_lora_adapter",
    "read_adapter",
    "write_lora_adapter",
]

#: The adapter's folder inside a saved model's folder.
ADAPTER_DIR = "lora_adapter"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLED_WEIGHTS_FILE = "adapter_model.bin"
#: PEFT's key prefix: the PeftModel's ``base_model`` (the LoRA tuner) and its ``model`` (the base).
KEY_PREFIX = "base_model.model."
_FACTOR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])\.weight")

# adapter_config.json entries whose (truthy) value makes a LoRA that does not merge into plain weights.
_UNMERGEABLE = {
    "use_dora": "DoRA (a learned magnitude per output)",
    "lora_bias": "LoRA with a bias on lora_B",
    "layer_replication": "layer replication (it changes the model's layers)",
    "alora_invocation_tokens": "activated LoRA (it applies only after its invocation tokens)",
    "use_qalora": "QA-LoRA",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on raw parameters",
}


# ------------------------------------------------------------------------------------------ export


@dataclass(frozen=True)
class AdapterExport:
    """What :func:`gather_lora_adapter` collects on rank 0.

    ``settings``: ``peft.LoraConfig`` keyword arguments. ``tensors``: PEFT key -> CPU tensor.
    ``value_head``: a reward model's ``v_head.weight`` (1, hidden), else None.
    """

    settings: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    value_head: torch.Tensor | None
    vocab_rows: int | None = None  # the trained model's embedding rows (more than the base's: --add_eot_token)


def _is_lora_layer(module: nn.Module) -> bool:
    """DeepSpeed Hybrid Engine's LoRA contract, as :func:`dschat.models.save.is_lora_layer` reads it."""
    return all(hasattr(module, name) for name in ("lora_right_weight", "lora_left_weight", "lora_scaling"))


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _lora_alpha(scaling: float, rank: int) -> float | int:
    """PEFT's ``lora_alpha`` for a dschat layer's ``lora_scaling`` attribute (upstream's ``lora_scaling /
    lora_dim``): the ``lora_scaling`` argument back, chosen among ``scaling * r`` and its roundings so that
    PEFT's ``alpha / r`` gives the attribute back bit for bit (``1/49 * 49`` is 0.9999999999999999)."""
    alpha = scaling * rank
    for candidate in (round(alpha), round(alpha, 12), alpha, math.nextafter(alpha, math.inf),
                      math.nextafter(alpha, -math.inf)):
        if candidate / rank == scaling:
            return int(candidate) if float(candidate).is_integer() else float(candidate)
    return alpha


def _shortest_names(selected: Iterable[str], all_names: Sequence[str],
                    matches: Callable[[str, str], bool]) -> list[str]:
    """``selected`` module names as PEFT should be told them: their last parts (``q_proj``) when, by
    PEFT's ``matches(name, entry)`` rule, those select exactly ``selected`` among ``all_names``, else
    the full names."""
    selected = sorted(set(selected))
    short = sorted({name.rsplit(".", 1)[-1] for name in selected})
    if {name for name in all_names if any(matches(name, s) for s in short)} == set(selected):
        return short
    return selected


def _is_target(name: str, entry: str) -> bool:  # PEFT's target_modules rule for a list
    return name == entry or name.endswith("." + entry)


def _is_module_to_save(name: str, entry: str) -> bool:  # PEFT's modules_to_save rule (a plain suffix)
    return name.endswith(entry)


def _base_name(config: Any) -> str:
    """The model the LoRA was trained on: ``config._name_or_path``, a local folder made absolute."""
    name = str(getattr(config, "_name_or_path", "") or "")
    local = Path(name).expanduser()
    return str(local.resolve()) if name and local.is_dir() else name


def _plain_module_names(body: nn.Module, layers: dict[str, nn.Module]) -> list[str]:
    """``body``'s module names as the plain Hugging Face model has them (LoRA layers' own children --
    their dropout -- do not exist there)."""
    return [name for name, _ in body.named_modules()
            if not any(name.startswith(layer + ".") for layer in layers)]


def _settings(body: nn.Module, layers: dict[str, nn.Module], extra: list[str], lora_biases: bool,
              reward: bool) -> dict[str, Any]:
    """``peft.LoraConfig`` arguments reproducing dschat's LoRA layers (rank, scaling, dropout, targets)."""
    ranks = {name: full_shape(layer.lora_right_weight)[1] for name, layer in layers.items()}  # (in, r)
    alphas = {name: _lora_alpha(float(layer.lora_scaling), ranks[name]) for name, layer in layers.items()}
    rank = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    dropouts = [layer.lora_dropout.p for layer in layers.values() if isinstance(layer.lora_dropout, nn.Dropout)]
    names = _plain_module_names(body, layers)
    embeddings = body.get_input_embeddings().weight
    # A trained embedding tied to lm_head (OPT): PEFT keeps the two saved copies tied on load and merge.
    tied = bool(getattr(body.config, "tie_word_embeddings", False)) and any(
        p is embeddings for name in extra for p in body.get_submodule(name).parameters(recurse=False))
    return {
        "r": rank,
        "lora_alpha": alpha,
        # Layers converted with another rank or scaling (dschat's CLI gives all the same): PEFT's patterns,
        # keyed by the full module name.
        "rank_pattern": {n: r for n, r in ranks.items() if r != rank},
        "alpha_pattern": {n: a for n, a in alphas.items() if a != alpha},
        "target_modules": _shortest_names(layers, names, _is_target),
        "modules_to_save": _shortest_names(extra, names, _is_module_to_save) if extra else None,
        "bias": "lora_only" if lora_biases else "none",
        "ensure_weight_tying": tied,
        "lora_dropout": dropouts[0] if dropouts else 0.0,
        "base_model_name_or_path": _base_name(body.config),
        # A reward model's adapter is its body's: an AutoModel, PEFT's feature-extraction task.
        "task_type": "FEATURE_EXTRACTION" if reward else "CAUSAL_LM",
        "inference_mode": True,
    }


def gather_lora_adapter(model: Any) -> AdapterExport | None:
    """The LoRA factors (and what else trained) of ``model`` as a PEFT adapter, on rank 0.

    ``model``: a causal LM or :class:`~dschat.models.reward_model.RewardModel`, or a DeepSpeed
    engine around one. None without LoRA layers, and on ranks other than 0. Collective under ZeRO-3:
    every rank must call it.
    """
    module = getattr(model, "module", model)
    body = getattr(module, "rwtransformer", module)  # a reward model: the adapter is its body's
    reward = body is not module
    layers = {name: sub for name, sub in body.named_modules() if _is_lora_layer(sub)}
    if not layers:
        return None
    release_zero3_prefetch(model)
    rank0 = _rank() == 0
    tensors: dict[str, torch.Tensor] = {}
    extra: list[str] = []  # modules other than LoRA layers with trained parameters: PEFT's modules_to_save
    lora_biases = False
    for name, sub in body.named_modules():
        if name in layers:
            bias = sub.bias if sub.bias is not None and sub.bias.requires_grad else None
            lora_biases = lora_biases or bias is not None
            with gathered([p for p in (sub.lora_right_weight, sub.lora_left_weight, bias) if p is not None]):
                if rank0:
                    tensors[f"{KEY_PREFIX}{name}.lora_A.weight"] = _cpu(sub.lora_right_weight.t())  # (r, in)
                    tensors[f"{KEY_PREFIX}{name}.lora_B.weight"] = _cpu(sub.lora_left_weight.t())  # (out, r)
                    if bias is not None:
                        tensors[f"{KEY_PREFIX}{name}.base_layer.bias"] = _cpu(bias)
            continue
        if any(name.startswith(layer + ".") for layer in layers):
            continue  # a LoRA layer's dropout
        own = dict(sub.named_parameters(recurse=False))  # a tied lm_head lists the shared weight here too
        if not any(p.requires_grad for p in own.values()):
            continue
        extra.append(name)
        with gathered(list(own.values())):
            if rank0:
                tensors.update({f"{KEY_PREFIX}{name}.{p_name}": _cpu(p) for p_name, p in own.items()})
    value_head = None
    if reward:
        with gathered([module.v_head.weight]):
            value_head = _cpu(module.v_head.weight) if rank0 else None
    if not rank0:
        return None
    return AdapterExport(_settings(body, layers, extra, lora_biases, reward), tensors, value_head,
                         full_shape(body.get_input_embeddings().weight)[0])


def write_lora_adapter(export: AdapterExport, folder: str | Path, tokenizer: Any = None) -> Path:
    """Write ``export`` into the new folder ``folder`` (call it inside an atomic folder write): the
    config through ``peft.LoraConfig`` (PEFT's own schema and version), the tensors in safetensors,
    a reward model's value head, the tokenizer and a short README."""
    from peft import LoraConfig  # lazy: 3.2 s CPU at import (python -X importtime); LoRA saves and adapter loads only
    folder = Path(folder)
    folder.mkdir(parents=True)
    known = {field.name for field in dataclasses.fields(LoraConfig)}  # older peft lacks ensure_weight_tying
    LoraConfig(**{k: v for k, v in export.settings.items() if k in known}).save_pretrained(str(folder))
    save_file(export.tensors, str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    if export.value_head is not None:
        save_file({VALUE_HEAD_KEY: export.value_head}, str(folder / VALUE_HEAD_FILE))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    (folder / "README.md").write_text(adapter_card(export), encoding="utf-8")
    return folder


# ------------------------------------------------------------------------------------------ import


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter folder, checked by :func:`read_adapter`.

    ``base``: its ``base_model_name_or_path`` as written (a folder, hub id or short name; may itself be
    an adapter folder). ``config``: ``adapter_config.json`` as read.
    """

    folder: Path
    base: str
    config: dict[str, Any]

    @property
    def weights_file(self) -> Path:
        return self.folder / ADAPTER_WEIGHTS_FILE

    @property
    def value_head_file(self) -> Path | None:
        """``v_head.safetensors`` beside a reward model's adapter, else None."""
        file = self.folder / VALUE_HEAD_FILE
        return file if file.is_file() else None


def read_adapter(folder: str | Path) -> LoraAdapter:
    """Read and check the adapter folder ``folder``: LoRA, mergeable, safetensors weights, a base named.

    Anything else is one :class:`UserError` line (the CLIs exit with code 2).
    """
    folder = Path(folder)
    config_file = folder / ADAPTER_CONFIG_FILE
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {config_file} ({type(err).__name__}: {first_line(err)}); "
                        "pass a PEFT adapter folder written by save_pretrained") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} is not a JSON object; pass a PEFT adapter folder written by save_pretrained")
    kind = config.get("peft_type")
    if str(kind).upper() != "LORA":
        raise UserError(f"{folder} is a PEFT {kind or 'unknown-kind'} adapter; dschat loads LoRA adapters only: "
                        "pass a LoRA adapter or a full model folder (peft's merge_and_unload + save_pretrained "
                        "makes one, for methods that merge)")
    unmergeable = [what for key, what in _UNMERGEABLE.items() if config.get(key)]
    if unmergeable:
        raise UserError(f"{folder} is a LoRA variant dschat does not merge ({', '.join(unmergeable)}); pass a "
                        "full model folder (peft's merge_and_unload + save_pretrained makes one)")
    if not (folder / ADAPTER_WEIGHTS_FILE).is_file():
        found = " (it has the pickled adapter_model.bin, which dschat does not unpickle)" if (
            folder / _PICKLED_WEIGHTS_FILE).is_file() else ""
        raise UserError(f"{folder} has no {ADAPTER_WEIGHTS_FILE}{found}; save the adapter in safetensors "
                        "(PeftModel.save_pretrained(folder, safe_serialization=True)) and pass that folder")
    check_lora_settings(config, config_file)
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise UserError(f"{config_file} names no base model (base_model_name_or_path is empty); set it to the "
                        "folder or hub id of the model the adapter was trained on")
    return LoraAdapter(folder, base.strip(), config)


# Adapter folders whose base is being checked right now: a chain that leads back is refused.
_CHECKING: list[Path] = []


def check_adapter(folder: str | Path, check_base: Callable[[str], Any]) -> None:
    """:func:`read_adapter` plus ``check_base(base)`` (the registry's check or resolution of a model
    path); a base it refuses becomes one line naming the base."""
    folder = Path(folder)
    key = folder.resolve()
    if key in _CHECKING:
        raise UserError(f"{folder}'s base_model_name_or_path leads back to {folder}; point it at the model "
                        "the adapter was trained on")
    adapter = read_adapter(folder)
    _CHECKING.append(key)
    try:
        check_base(adapter.base)
    except UserError as err:
        raise UserError(f"{folder} is a LoRA adapter of base model {adapter.base!r}, which cannot be loaded "
                        f"here: {err}") from None
    finally:
        _CHECKING.pop()


def _lora_config(adapter: LoraAdapter) -> Any:
    """``adapter_config.json`` as a ``peft.LoraConfig``: absent entries take PEFT's defaults, entries this
    peft does not know (a newer one wrote them) are left out, as ``LoraConfig.from_pretrained`` does."""
    from peft import LoraConfig  # lazy: 3.2 s CPU at import (python -X importtime); LoRA saves and adapter loads only

    known = {field.name for field in dataclasses.fields(LoraConfig) if field.init}
    try:
        return LoraConfig(**{k: v for k, v in adapter.config.items() if k in known})
    except (TypeError, ValueError) as err:
        raise UserError(f"{adapter.folder / ADAPTER_CONFIG_FILE} is not a LoRA config peft accepts "
                        f"({type(err).__name__}: {first_line(err)}); pass a folder written by "
                        "PeftModel.save_pretrained") from None


def _by_pattern(patterns: Mapping[str, Any] | None, names: Sequence[str], default: Any) -> Any:
    """PEFT's ``get_pattern_key`` rule: the value of the first pattern matching the end of the module's
    name (any of ``names``: in this model and in the adapter's keys)."""
    for pattern, value in (patterns or {}).items():
        if any(re.match(rf"(.*\.)?({pattern})$", name) for name in names):
            return value
    return default


def _scaling(config: Any, names: Sequence[str], rank: int) -> float:
    """PEFT's ``scaling`` of one layer: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), alpha from
    ``alpha_pattern`` by PEFT's rule (the pattern matches the module name's end)."""
    alpha = _by_pattern(config.alpha_pattern, names, config.lora_alpha)
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank


def _fan_in_fan_out(layer: nn.Module, located: str, adapter: LoraAdapter, config: Any) -> bool:
    """PEFT's ``fan_in_fan_out`` for ``layer`` (``dispatch_default``): from its type, the config's value
    ignored with PEFT's warning where it disagrees (and ``config`` set, as PEFT does); a layer that is
    neither is one line."""
    if not isinstance(layer, (nn.Linear, Conv1D)):
        raise UserError(f"{adapter.weights_file} has LoRA factors for {located}, a {type(layer).__name__}: dschat "
                        "merges LoRA into nn.Linear and Conv1D layers only; pass a full model folder (peft's "
                        "merge_and_unload + save_pretrained makes one)")
    conv1d = isinstance(layer, Conv1D)
    if bool(config.fan_in_fan_out) != conv1d:
        warnings.warn(f"{adapter.folder / ADAPTER_CONFIG_FILE}: fan_in_fan_out is set to {not conv1d} but the "
                      f"target module {located} is {'Conv1D' if conv1d else '`torch.nn.Linear`'}. Setting "
                      f"fan_in_fan_out to {conv1d} (as PEFT does).", stacklevel=3)
        config.fan_in_fan_out = conv1d  # PEFT's dispatch sets it on the config: one warning per change
    return conv1d


def _check_tensor(key: str, value: torch.Tensor, where: Path) -> None:
    if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
        problem = f"{value.dtype} values" if not value.is_floating_point() else "NaN or infinite values"
        raise UserError(f"{where} holds {problem} in {key!r}: the adapter is damaged; train or export it again")


def _locate(model: nn.Module, path: str, names: set[str]) -> str | None:
    """``path`` (a module path of the model the adapter was made on) in ``model``: as it is, with the
    body's prefix added (a body adapter on a causal LM) or removed (a causal-LM adapter on a body);
    None where it is not in ``model``."""
    if path in names:
        return path
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        candidate = f"{prefix}.{path}"
    elif prefix and path.startswith(prefix + "."):
        candidate = path[len(prefix) + 1:]
    else:
        return None
    return candidate if candidate in names else None


def _outside_body(model: nn.Module, path: str) -> bool:
    """Whether ``path`` is a causal LM's head (``lm_head``) seen from its body ``model``: what
    ``AutoModel.from_pretrained`` of a causal-LM folder drops too."""
    prefix = getattr(model, "base_model_prefix", "")
    is_body = bool(prefix) and not isinstance(getattr(model, prefix, None), nn.Module)
    return is_body and not path.startswith(prefix + ".")


def _plan(model: nn.Module, adapter: LoraAdapter, tensors: dict[str, torch.Tensor]) -> tuple[
        list[tuple[nn.Module, torch.Tensor, torch.Tensor, float, bool]], list[tuple[nn.Module, str, torch.Tensor]]]:
    """Check every adapter tensor against ``model`` (before anything is changed: the same error on every
    rank) and pair it with its target: ``(layer, A, B, scaling, fan_in_fan_out)`` per LoRA layer and
    ``(module, parameter name, value)`` per replaced parameter (a LoRA layer's ``base_layer.weight``, which
    PEFT saves for an ``lm_head`` or embedding under LoRA, included)."""
    config = _lora_config(adapter)
    names = {name for name, _ in model.named_modules()}
    where = adapter.weights_file

    def refuse(problem: str) -> UserError:
        return UserError(f"{where} does not fit the base model {adapter.base!r}: {problem}; pass the base model "
                         "the adapter was trained on (base_model_name_or_path)")

    factors: dict[str, dict[str, torch.Tensor]] = {}
    paths: dict[str, str] = {}  # located -> the module's path in the adapter's keys
    replaced: list[tuple[nn.Module, str, torch.Tensor]] = []
    for key, value in tensors.items():
        if not key.startswith(KEY_PREFIX):
            raise refuse(f"key {key!r} is not a PEFT key ({KEY_PREFIX}...)")
        _check_tensor(key, value, where)
        rest = key[len(KEY_PREFIX):]
        factor = _FACTOR_KEY.fullmatch(rest)
        if factor is None and ".lora_" in rest:
            raise UserError(f"{where} holds {key!r}, a LoRA tensor dschat does not merge (LoRA on embeddings or "
                            "convolutions, or a DoRA magnitude); pass a full model folder (peft's merge_and_unload "
                            "+ save_pretrained makes one)")
        if factor:
            module_path, param_name = factor["module"], ""
        else:  # a whole parameter: modules_to_save, or a LoRA layer's bias (PEFT names it base_layer.bias)
            module_path, _, param_name = rest.replace(".base_layer.", ".").rpartition(".")
        located = _locate(model, module_path, names)
        if located is None:
            if _outside_body(model, module_path):
                continue  # the LM head of a causal-LM adapter, loaded into a reward model's body
            raise refuse(f"it has {key!r} and the model has no module {module_path!r}")
        target = model.get_submodule(located)
        if factor:
            factors.setdefault(located, {})[factor["which"]] = value
            paths[located] = module_path
            continue
        param = getattr(target, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise refuse(f"it has {key!r} and {located!r} has no parameter {param_name!r}")
        if full_shape(param) != tuple(value.shape):
            raise refuse(f"{key!r} has shape {tuple(value.shape)}, the model's {full_shape(param)}")
        replaced.append((target, param_name, value))
    merges = []
    for located, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise refuse(f"{located} has lora_{''.join(pair)} without its partner")
        a, b = pair["A"], pair["B"]  # (r, in), (out, r)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] == 0:
            raise UserError(f"{where} holds LoRA factors of {located} shaped A {tuple(a.shape)}, B {tuple(b.shape)}: "
                            "a LoRA factor is a matrix of rank >= 1; train or export the adapter again")
        names = (located, paths[located])
        rank = _by_pattern(config.rank_pattern, names, config.r)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise UserError(f"{where} holds LoRA factors of {located} of rank {a.shape[0]} (A {tuple(a.shape)}, B "
                            f"{tuple(b.shape)}) but {ADAPTER_CONFIG_FILE} gives it r = {rank} (r, rank_pattern); "
                            f"{FIX_ADAPTER_CONFIG}")
        layer = model.get_submodule(located)
        fan_in_fan_out = _fan_in_fan_out(layer, located, adapter, config)
        weight = getattr(layer, "weight", None)
        delta_shape = (b.shape[0], a.shape[1])
        expected = delta_shape[::-1] if fan_in_fan_out else delta_shape
        if not isinstance(weight, nn.Parameter) or full_shape(weight) != expected:
            raise refuse(f"the LoRA factors of {located} (A {tuple(a.shape)}, B {tuple(b.shape)}) do not fit "
                         f"its weight {full_shape(weight) if weight is not None else None}")
        merges.append((layer, a, b, _scaling(config, names, rank), fan_in_fan_out))
    return merges, replaced


def _untie(model: nn.Module, adapter: LoraAdapter, targets: list[tuple[nn.Module, str]]) -> None:
    """Untie the shared weights the adapter changes (``targets``: module, parameter name), as ``PeftModel``
    changes only the modules the adapter names (an ``lm_head`` in ``modules_to_save`` or under LoRA leaves
    the embeddings as they were) -- unless ``ensure_weight_tying`` is set and ``modules_to_save`` names
    ``embed_tokens`` or ``lm_head`` (PEFT's EMBEDDING_LAYER_NAMES): PEFT keeps the two tied then."""
    saved = {str(m).rsplit(".", 1)[-1] for m in adapter.config.get("modules_to_save") or []}
    if not (adapter.config.get("ensure_weight_tying") and {"embed_tokens", "lm_head"} & saved):
        untie_weights(model, [getattr(m, name) for m, name in targets], str(adapter.folder))


@torch.no_grad()
def merge_lora_adapter(model: nn.Module, adapter: LoraAdapter) -> nn.Module:
    """Merge ``adapter`` into ``model`` (a causal LM or a body) in place; returns ``model``.

    The result is what ``PeftModel.from_pretrained(model, folder)`` computes: every LoRA layer's weight
    becomes ``W + scaling * B @ A`` (summed in fp32, rounded once to W's dtype), and ``modules_to_save`` /
    bias tensors replace the model's; a tied weight it changes is untied first (:func:`_untie`; PEFT's
    ``merge_and_unload`` merges LoRA on a tied ``lm_head`` into the embeddings too). Under ZeRO-3 each
    weight is gathered alone and rank 0's result is kept (every rank must call).
    """
    try:
        tensors = load_file(str(adapter.weights_file))
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"cannot read {adapter.weights_file} ({type(err).__name__}: {first_line(err)}): the file is "
                        "damaged or not safetensors; copy or export the adapter again") from None
    merges, replaced = _plan(model, adapter, tensors)
    _untie(model, adapter, [(m[0], "weight") for m in merges] + [(m, name) for m, name, _ in replaced])
    for module, name, value in replaced:  # first: a LoRA layer's saved base weight is what its factors add to
        param = getattr(module, name)
        with gathered([param], modifier_rank=0):
            param.data.copy_(value.to(param.device, param.dtype))
    for layer, a, b, scaling, fan_in_fan_out in merges:
        weight = layer.weight
        with gathered([weight], modifier_rank=0):
            delta = (b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)) * scaling  # (out, in)
            if fan_in_fan_out:  # GPT-2's Conv1D keeps its weight as (in, out)
                delta = delta.t()
            weight.data.copy_((weight.data.float() + delta).to(weight.dtype))
    return model

