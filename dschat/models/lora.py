"""LoRA as upstream DeepSpeed-Chat implements it (no PEFT), plus an optional 4-bit base (QLoRA).

``LinearLayer_LoRA`` keeps upstream's attribute names, initialisation and fuse formula,
because DeepSpeed's Hybrid Engine reads them directly (checked against deepspeed 0.19.8):

* ``maybe_get_lora(p)`` (``deepspeed/module_inject/policy.py``) returns
  ``[p.lora_right_weight, p.lora_left_weight, p.lora_scaling]`` when ``p`` has
  ``lora_right_weight``, and ``HybridEngineContainer.fuse_lora`` then does
  ``W += lora_scaling * left.T @ right.T`` before generation (``-=`` after, which rounds twice and
  does not give ``W`` back exactly; dschat's own :meth:`LinearLayer_LoRA.fuse_lora_weight` keeps
  ``W`` and puts it back bit for bit).
* The OPT/GPT-J/GPT-Neo/GPT-NeoX/BLOOM containers pass the *module* (``self_attn.q_proj``) as
  ``p``, but the LLaMA, LLaMA-2 and InternLM containers pass its *weight*
  (``self_attn.q_proj.weight``). The three attributes are attached to the module and to its base
  weight Parameter, so both forms find them (docs/upstream.md#small-fixes).

Shapes: ``weight`` (out, in); ``lora_right_weight`` (in, r); ``lora_left_weight`` (r, out);
``forward(x)``: (..., in) -> (..., out).
"""
from __future__ import annotations

import math
import re
from re import _parser as regex_parser  # the stdlib's own parse tree: how a pattern repeats
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from torch import nn
from transformers.pytorch_utils import Conv1D

from dschat.errors import UserError, first_line
from dschat.models.families import family_of
from dschat.runtime.zero3 import full_shape, gathered_to_read, in_zero3_gather, is_resident, is_zero3_param

__all__ = [
    "QUANT_TYPES",
    "LinearLayer_LoRA",
    "convert_linear_layer_to_lora",
    "convert_lora_to_linear_layer",
    "unfuse_lora",
    "only_optimize_lora_parameters",
    "make_model_gradient_checkpointing_compatible",
    "lora_target_modules_for",
    "check_lora_settings",
    "parameter_holders",
    "untie_weights",
    "FIX_ADAPTER_CONFIG",
]

QUANT_TYPES = ("nf4", "fp4")


class _Unfused(NamedTuple):
    """What :meth:`LinearLayer_LoRA.fuse_lora_weight` kept to undo itself bit for bit.

    ``weight``: the base weight's own ``.data`` tensor, put back by ``unfuse`` (swap mode), or None.
    ``partitions``: in partition mode, ``(tensor, saved copy)`` pairs -- the ZeRO-3 partition (and
    its ZeRO++ hierarchical secondary copy where there is one) and their values before the fused
    weight was written into them.
    """

    weight: Optional[torch.Tensor]
    partitions: Tuple[Tuple[torch.Tensor, torch.Tensor], ...] = ()


# --------------------------------------------------------------------------------------- 4-bit base


def _import_bnb() -> Any:
    try:  # lazy: bitsandbytes costs 2.2 s CPU at import (python -X importtime), for QLoRA only
        import bitsandbytes as bnb
    except ImportError as err:  # pragma: no cover - bitsandbytes is a hard dependency of dschat
        raise UserError(f"QLoRA needs bitsandbytes (pip install 'bitsandbytes>=0.45'): {err}") from err
    return bnb


def _quantize_4bit(weight: torch.Tensor, quant_type: str, blocksize: int) -> nn.Parameter:
    """``weight`` (out, in) -> a frozen ``bnb.nn.Params4bit`` holding the packed 4-bit codes."""
    if quant_type not in QUANT_TYPES:
        raise UserError(f"unknown 4-bit quant type {quant_type!r}; use one of {', '.join(QUANT_TYPES)}")
    if is_zero3_param(weight):
        raise UserError("QLoRA cannot quantize ZeRO-3 partitioned weights; use --zero_stage 0, 1 or 2 "
                        "with a 4-bit base, or drop the 4-bit option")
    if not weight.dtype.is_floating_point:
        raise UserError(f"QLoRA expects a floating-point base weight, got {weight.dtype}; "
                        "load the model unquantized and let convert_linear_layer_to_lora quantize it")
    bnb = _import_bnb()
    # No nested ("double") quantisation of the absmax statistics: it saves ~0.37 bit/param but
    # complicates the CPU dequantisation path below.
    packed, state = bnb.functional.quantize_4bit(weight.detach().contiguous(), blocksize=blocksize,
                                                 compress_statistics=False, quant_type=quant_type)
    return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=blocksize,
                             compress_statistics=False, quant_type=quant_type, bnb_quantized=True)


def _dequantize_4bit(weight: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit ``Params4bit`` -> dense (out, in) tensor in the original dtype.

    bitsandbytes 0.50.2's native CPU kernel mis-scales blocks that straddle a row boundary
    (``in_features % blocksize != 0``): on a (64, 32) weight its mean error is ~4x the NF4
    rounding error. That case is decoded here in plain torch (code-book lookup x block absmax),
    which is what the kernel should compute; every other case goes through bitsandbytes.
    """
    bnb = _import_bnb()
    state = weight.quant_state
    rows_straddle = state.shape[-1] % state.blocksize != 0
    if weight.device.type != "cpu" or not rows_straddle:
        return bnb.functional.dequantize_4bit(weight.data, state)
    packed = weight.data.reshape(-1)
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=1).reshape(-1).long()  # high nibble first
    n = math.prod(state.shape)
    values = state.code.to(packed.device)[codes][:n]
    scales = state.absmax.float().repeat_interleave(state.blocksize)[:n]
    return (values * scales).reshape(state.shape).to(state.dtype)


# ----------------------------------------------------------------------------------------- the layer


class LinearLayer_LoRA(nn.Module):
    """``y = x W^T + b + (dropout(x) @ right @ left) * lora_scaling``; ``W`` frozen.

    Reuses the wrapped Linear's own ``weight``/``bias`` Parameters (so state-dict keys and ZeRO-3
    partitioning carry over). ``lora_scaling`` is stored as ``lora_scaling / lora_dim`` (upstream;
    with the CLI's fixed ``lora_scaling=1`` the effective alpha/r is 1/r, hence the high LoRA LR).
    With ``quantize_base="nf4"|"fp4"`` the base weight is stored in 4 bits (bitsandbytes) and
    dequantised per forward; the LoRA factors stay in the original dtype (QLoRA).
    """

    def __init__(self,
                 weight: nn.Parameter,
                 lora_dim: int = 0,
                 lora_scaling: float = 1,
                 lora_droppout: float = 0,
                 bias: Optional[nn.Parameter] = None,
                 *,
                 quantize_base: Optional[str] = None,
                 quant_blocksize: int = 64) -> None:
        super().__init__()
        if lora_dim <= 0:
            raise UserError(f"LoRA needs lora_dim >= 1, got {lora_dim}; set --lora_dim to a positive rank")
        # ZeRO-3 leaves an empty placeholder in weight.data; the full shape is in ds_shape.
        rows, columns = full_shape(weight)  # (out, in)
        if quantize_base is not None:
            weight = _quantize_4bit(weight, quantize_base, quant_blocksize)
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.quantize_base = quantize_base

        # Factors created in fp32 on CPU and initialised there, like upstream (same values for the
        # same seed); convert_linear_layer_to_lora then moves/casts the module.
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))  # (in, r): x @ right
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))     # (r, out)
        self.lora_scaling = lora_scaling / lora_dim
        self.lora_dropout: nn.Module = nn.Dropout(lora_droppout) if lora_droppout > 0 else nn.Identity()
        self.reset_parameters()
        self.weight.requires_grad = False
        self.fuse_lora = False
        self._unfused: Optional[_Unfused] = None  # set while fused: what unfuse_lora_weight puts back
        self.tag_weight_for_hybrid_engine()

    # From the full shapes: under ZeRO-3 a partitioned parameter's ``shape`` is (0,) and the real one
    # is ``ds_shape`` (DeepSpeed's inference containers read these on a ZeRO-3 model).
    @property
    def in_features(self) -> int:
        return full_shape(self.lora_right_weight)[0]

    @property
    def out_features(self) -> int:
        return full_shape(self.lora_left_weight)[1]

    @property
    def is_quantized(self) -> bool:
        """True while the base weight is stored in 4 bits (an explicit fuse dequantises it for good)."""
        return self.quantize_base is not None

    def reset_parameters(self) -> None:
        """right ~ kaiming_uniform(a=sqrt(5)) (nn.Linear's init), left = 0: the delta starts at 0."""
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_left_weight)

    def tag_weight_for_hybrid_engine(self) -> None:
        """Attach the LoRA triple to the base weight for DeepSpeed's LLaMA-style HE containers.

        Those call ``maybe_get_lora(q_proj.weight)``; see the module docstring. ``copy.deepcopy``
        drops Parameter attributes, so call this again on a deep-copied model.
        """
        if self.is_quantized:
            return  # the Hybrid Engine cannot fuse into a 4-bit weight anyway
        self.weight.lora_right_weight = self.lora_right_weight
        self.weight.lora_left_weight = self.lora_left_weight
        self.weight.lora_scaling = self.lora_scaling

    def train(self, mode: bool = True) -> "LinearLayer_LoRA":
        """Standard ``nn.Module.train`` (recurses, returns self).

        Upstream overrode it to toggle only the dropout and return None.
        """
        return super().train(mode)

    def eval(self) -> "LinearLayer_LoRA":
        """``train(False)``; returns self."""
        return self.train(False)

    def lora_delta(self) -> torch.Tensor:
        """``lora_scaling * left.T @ right.T`` -- the (out, in) update the Hybrid Engine fuses."""
        return self.lora_scaling * torch.matmul(self.lora_left_weight.t(), self.lora_right_weight.t())

    def _dequantize_base_for_good(self) -> None:
        """Replace the 4-bit base by its dense dequantisation (what an explicit fuse needs)."""
        self.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
        self.quantize_base = None
        self.tag_weight_for_hybrid_engine()

    def dense_weight(self) -> torch.Tensor:
        """The base weight (out, in) as a dense tensor: dequantised from 4 bits into the compute dtype
        (the LoRA factors' dtype; convert casts them to the original weight dtype) when it is stored
        quantized, else the weight's own data (gather it first under ZeRO-3)."""
        if self.is_quantized:
            return _dequantize_4bit(self.weight).to(self.lora_left_weight.dtype)
        return self.weight.data

    def _fused_value(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight + lora_scaling * left.T @ right.T`` as a new tensor of ``weight``'s dtype, summed in
        fp32 and rounded once (the factors must be readable: gathered under ZeRO-3)."""
        delta = self.lora_scaling * torch.matmul(self.lora_left_weight.t().float(), self.lora_right_weight.t().float())
        return (weight.float() + delta).to(weight.dtype)

    @torch.no_grad()
    def fuse_lora_weight(self) -> None:
        """Make the base weight ``W + lora_scaling * left.T @ right.T``; forward then skips the LoRA branch.

        Exactly undone by :meth:`unfuse_lora_weight`: ``W``'s own values are never overwritten, so a
        fuse / unfuse pair around every rollout leaves the frozen base weight bit-identical, in any
        dtype (adding the delta in place and subtracting it again, as upstream, rounds twice:
        docs/upstream.md#half-precision-where-the-fix-changes-numbers). Two modes:

        * **swap** (no ZeRO-3, or a ZeRO-3 weight held gathered by an open
          ``deepspeed.zero.GatheredParameters``, as :class:`~dschat.rlhf.rollout.generator.RolloutGenerator`
          does): ``weight.data`` is pointed at a new tensor ``W + delta`` and the original tensor is
          kept, to be put back. The cost is one extra weight per layer while fused. It is a swap, not
          an in-place write, because on a single rank DeepSpeed's "gathered" ZeRO-3 tensor *is* the
          partition (``_no_gather_coalesced``), so writes into it would outlive the gather. Under
          ZeRO-3, unfuse inside the same gather.
        * **partition** (a ZeRO-3 weight that is partitioned away): the fused weight must live in the
          partition, since every forward re-gathers it from there. The partition (1/world of the
          weight, the whole weight on one rank -- unavoidable: the fused and the original values must
          both exist) is copied first, ``W + delta`` is written through a ``GatheredParameters`` with
          ``modifier_rank=0``, and unfuse copies the saved partition back (no collective).

        A 4-bit base is dequantised first, for good: unfuse restores the dense weight, not the 4-bit
        one (a rollout leaves 4-bit layers unfused instead).
        """
        if self.fuse_lora:
            return
        if self.is_quantized:
            self._dequantize_base_for_good()
        weight = self.weight
        zero3 = is_zero3_param(weight)
        if zero3:
            held = in_zero3_gather(weight)
            if held is None:  # no count of gather contexts: a gathered weight is taken to be held by one
                held = is_resident(weight)
        with gathered_to_read([self.lora_left_weight, self.lora_right_weight]):
            if not zero3 or held:
                self._unfused = _Unfused(weight.data)
                weight.data = self._fused_value(weight.data)
            else:
                self._unfused = _Unfused(None, self._save_partitions(weight))
                with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
                    weight.data = self._fused_value(weight.data)
        self.fuse_lora = True

    @staticmethod
    def _save_partitions(weight: torch.Tensor) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
        """Copies of everything DeepSpeed keeps of a partitioned ZeRO-3 ``weight``."""
        part = weight.ds_tensor
        if getattr(part, "final_location", None) == OffloadDeviceEnum.nvme:
            raise UserError("cannot fuse LoRA into ZeRO-3 weights offloaded to NVMe (the partition is swapped "
                            "out); keep the LoRA layers unfused, or offload parameters to the CPU instead")
        secondary = getattr(weight, "ds_secondary_tensor", None)  # ZeRO++ hierarchical partition
        if any(hasattr(t, "ds_quant_scale") for t in (part, secondary)):
            # DeepSpeed would copy the fused floats into the int8 codes as they are.
            raise UserError("cannot fuse LoRA into ZeRO++ quantized frozen weights (--enable_mixed_precision_lora) "
                            "while they are partitioned; fuse inside deepspeed.zero.GatheredParameters, or keep "
                            "the LoRA layers unfused")
        return tuple((t, t.detach().clone()) for t in (part, secondary) if t is not None)

    @torch.no_grad()
    def unfuse_lora_weight(self) -> None:
        """Put back the base weight :meth:`fuse_lora_weight` kept, bit for bit."""
        if not self.fuse_lora:
            return
        weight, saved = self.weight, getattr(self, "_unfused", None)
        if saved is None:
            raise RuntimeError("unfuse_lora_weight: this layer is marked fused but holds no unfused weight "
                               "(was fuse_lora set by hand?)")
        if is_zero3_param(weight):
            available = is_resident(weight)
            if saved.weight is not None and not available:
                raise RuntimeError("unfuse_lora_weight: the ZeRO-3 gather that held this weight at fuse_lora_weight "
                                   "has ended; call fuse_lora_weight and unfuse_lora_weight inside the same "
                                   "deepspeed.zero.GatheredParameters")
            if saved.weight is None and available:
                if in_zero3_gather(weight):
                    raise RuntimeError("unfuse_lora_weight: this weight was fused while partitioned and is now held "
                                       "by a deepspeed.zero.GatheredParameters; unfuse outside that gather")
                # Gathered since (a forward fetched it; small weights stay resident): drop the fused
                # full copy, the next forward gathers the restored partitions.
                weight.partition()
        if saved.weight is not None:
            weight.data = saved.weight
        for tensor, copy in saved.partitions:
            tensor.data.copy_(copy)
        self._unfused = None
        self.fuse_lora = False

    def _base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.is_quantized:
            return _dequantize_4bit(self.weight).to(dtype)
        return self.weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        out = F.linear(input, self._base_weight(input.dtype), self.bias)
        if self.fuse_lora:
            return out
        return out + (self.lora_dropout(input) @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling

    def extra_repr(self) -> str:
        quant = f", quantize_base={self.quantize_base}" if self.is_quantized else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"lora_dim={self.lora_right_weight.shape[1]}, lora_scaling={self.lora_scaling}, "
                f"fused={self.fuse_lora}{quant}")


# ---------------------------------------------------------------------------------- model helpers


def _lora_layers(model: nn.Module) -> List[LinearLayer_LoRA]:
    return [m for m in model.modules() if isinstance(m, LinearLayer_LoRA)]


def lora_target_modules_for(model: nn.Module) -> str:
    """Default ``--lora_module_name`` for ``model``'s family.

    Read from the one model-family table (:data:`dschat.models.families.FAMILIES`):
    OPT ``"decoder.layers."``, LLaMA-style ``"layers."``, BLOOM/GPT-J/GPT-Neo ``"h."``. The values
    are substrings, not prefixes, so they also match inside upstream's reward wrapper
    (``rwtransformer.decoder.layers.N...``). A DeepSpeed engine is unwrapped first.
    """
    return family_of(getattr(model, "module", model)).lora_module_name


def convert_linear_layer_to_lora(model: nn.Module,
                                 part_module_name: Union[str, Sequence[str]],
                                 lora_dim: int = 0,
                                 lora_scaling: float = 1,
                                 lora_droppout: float = 0,
                                 *,
                                 quantize_base: Optional[str] = None,
                                 quant_blocksize: int = 64) -> nn.Module:
    """Wrap every ``nn.Linear`` whose qualified name contains ``part_module_name`` (or any of a
    list of substrings) in :class:`LinearLayer_LoRA`, in place; returns ``model``.

    Each new layer is moved to its weight's device and cast to its weight's dtype, as upstream.
    Matching nothing is an error (it would silently train nothing with ``--only_optimize_lora``), and so
    is matching a Linear whose weight another module shares (a tied ``lm_head``: the LoRA layer would
    freeze the embeddings and its fuse would change them); both are checked before anything changes.
    ``quantize_base="nf4"|"fp4"`` stores the base weights in 4 bits.
    """
    patterns = [part_module_name] if isinstance(part_module_name, str) else list(part_module_name)
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and any(p in name for p in patterns)]
    if not names:
        conv = [n for n, m in model.named_modules() if isinstance(m, Conv1D) and any(p in n for p in patterns)]
        if conv:  # GPT-2: upstream's LoRA matched nothing there and trained no LoRA
            raise UserError(f"--lora_module_name {patterns} matches only transformers Conv1D layers (GPT-2's, like "
                            f"{conv[0]}), which dschat's LoRA, upstream's LinearLayer_LoRA, does not wrap; train this "
                            "model without LoRA (its LoRA dim 0)")
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise UserError(f"--lora_module_name {patterns} matches no nn.Linear layer; "
                        f"Linear layers are named like {linears[:3]}")
    refuse_tied_targets(model, names, patterns)
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child_name)
        device, dtype = linear.weight.device, linear.weight.dtype
        lora = LinearLayer_LoRA(linear.weight, lora_dim, lora_scaling, lora_droppout, linear.bias,
                                quantize_base=quantize_base, quant_blocksize=quant_blocksize)
        # A 4-bit (uint8) base is left alone by .to(dtype): only floating tensors are cast.
        lora = lora.to(device).to(dtype)
        lora.tag_weight_for_hybrid_engine()
        setattr(parent, child_name, lora)
    return model


def refuse_tied_targets(model: nn.Module, names: Sequence[str], patterns: Sequence[str]) -> None:
    """One :class:`UserError` line where a Linear of ``model`` named in ``names`` (what the LoRA filter
    ``patterns`` matched) has a weight another module shares: a tied ``lm_head``, whose LoRA layer
    would freeze the embeddings and whose fuse would change them. The memory planner asks it too."""
    holders = parameter_holders(model)
    for name in names:
        others = [n for n in holders.get(id(model.get_submodule(name).weight), []) if n != name]
        if others:
            raise UserError(f"--lora_module_name {list(patterns)} matches {name}, whose weight is tied to {others[0]} "
                            "(tie_word_embeddings): LoRA on it would freeze and change both; leave it out of "
                            f"--lora_module_name (the default for this model: {lora_target_modules_for(model)!r})")


def parameter_holders(model: nn.Module) -> Dict[int, List[str]]:
    """``id(parameter)`` -> the names of ``model``'s modules that hold it as their own parameter, in
    ``named_modules`` order; a parameter with several holders is tied (an ``lm_head`` sharing the input
    embeddings' weight under ``tie_word_embeddings``)."""
    holders: Dict[int, List[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    return holders


def untie_weights(model: nn.Module, params: Sequence[torch.Tensor], what: str) -> bool:
    """Untie each of ``params`` that several of ``model``'s modules share: every holder but the first
    (:func:`parameter_holders`) gets its own copy (same values and ``requires_grad``), and the config
    says ``tie_word_embeddings=False`` so the model saves and reloads untied; True when something was
    untied. A shared ZeRO-3 partitioned weight is not copied: one :class:`UserError` line naming
    ``what`` (the folder that asks for the change), checked before anything changes."""
    holders = parameter_holders(model)
    shared = {id(p): p for p in params if len(holders.get(id(p), ())) > 1}
    for key, param in shared.items():
        if is_zero3_param(param):
            raise UserError(f"{what} changes {' and '.join(holders[key])}, which share one weight; dschat unties "
                            "them only without ZeRO-3: load it with a ZeRO stage below 3, or pass a model folder "
                            "with the change merged")
    for key, param in shared.items():
        for name in holders[key][1:]:
            module = model.get_submodule(name)
            for attr in [a for a, p in module.named_parameters(recurse=False) if p is param]:
                setattr(module, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
    if shared:
        model.config.tie_word_embeddings = False
        model.config.get_text_config(decoder=True).tie_word_embeddings = False
    return bool(shared)


def convert_lora_to_linear_layer(model: nn.Module) -> nn.Module:
    """Fuse every LoRA layer in place (modules stay ``LinearLayer_LoRA``); returns ``model``.

    After this, ``state_dict()`` minus the ``"lora"`` keys loads into the plain HF model.
    """
    for layer in _lora_layers(model):
        layer.fuse_lora_weight()
    return model


def unfuse_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_lora_to_linear_layer` (e.g. to keep training after saving)."""
    for layer in _lora_layers(model):
        layer.unfuse_lora_weight()
    return model


def only_optimize_lora_parameters(model: nn.Module, force_optimize_params: Sequence[str] = ()) -> nn.Module:
    """Train only ``lora_right_weight``/``lora_left_weight`` and the exactly-named extras
    (e.g. ``["v_head.weight"]`` for the reward model); freeze everything else."""
    for name, param in model.named_parameters():
        param.requires_grad = ("lora_right_weight" in name or "lora_left_weight" in name
                               or name in force_optimize_params)
    return model


def make_model_gradient_checkpointing_compatible(model: nn.Module) -> nn.Module:
    """Make the embedding output require grad so reentrant checkpointing back-propagates to LoRA.

    With frozen embeddings, a reentrant checkpointed block sees no input that requires grad and
    returns outputs without a graph, so LoRA factors inside it get no gradient
    (docs/upstream.md#lora-the-value-head-and-gradient-checkpointing).
    """
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    elif hasattr(model, "get_input_embeddings"):
        def make_inputs_require_grad(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            output.requires_grad_(True)

        model.get_input_embeddings().register_forward_hook(make_inputs_require_grad)
    return model


# ------------------------------------------------------------------------------------------------
# A PEFT adapter's LoRA settings (adapter_config.json), read as untrusted input
# ------------------------------------------------------------------------------------------------
#: Bounds on adapter_config.json's regular expressions (see the module docstring).
MAX_PATTERN_CHARS, MAX_PATTERN_REPEATS = 200, 3
_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}
FIX_ADAPTER_CONFIG = "correct it in adapter_config.json, or save the adapter again with PeftModel.save_pretrained"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _repeats(items: Any, inside: bool) -> int:
    """Repetitions (``*``, ``+``, ``{m,n}`` with n > 1) in a parsed pattern; ValueError for a repetition
    inside another or over an alternation, or a back-reference."""
    count = 0
    for op, arg in items:
        name = str(op)
        if name in _REPEATS:
            _, high, body = arg
            if high > 1 and inside:
                raise ValueError("a repetition inside a repetition")
            count += (high > 1) + _repeats(body, inside or high > 1)
        elif name == "BRANCH":
            if inside:
                raise ValueError("a repetition over an alternation")
            count += sum(_repeats(branch, inside) for branch in arg[1])
        elif name == "SUBPATTERN":
            count += _repeats(arg[3], inside)
        elif name in ("ASSERT", "ASSERT_NOT"):
            count += _repeats(arg[1], inside)
        elif name == "ATOMIC_GROUP":
            count += _repeats(arg, inside)
        elif name.startswith("GROUPREF"):
            raise ValueError("a back-reference")
    return count


def _check_pattern(pattern: Any, key: str, file: Any) -> None:
    """One regular expression of the config: a string, short, compiling, of bounded matching time."""
    if not isinstance(pattern, str):
        raise UserError(f"{file}: {key} has {pattern!r}, not a string pattern; {FIX_ADAPTER_CONFIG}")
    problem = f"{len(pattern)} characters (at most {MAX_PATTERN_CHARS})" if len(pattern) > MAX_PATTERN_CHARS else ""
    try:
        repeats = 0 if problem else _repeats(regex_parser.parse(pattern), False)
        if repeats > MAX_PATTERN_REPEATS:
            problem = f"{repeats} repetitions (at most {MAX_PATTERN_REPEATS})"
    except (re.error, ValueError, OverflowError, RecursionError) as err:
        problem = first_line(err)
    if problem:
        raise UserError(f"{file}: {key} pattern {pattern[:60]!r} is refused ({problem}): its matching time could "
                        f"explode; name the modules plainly (q_proj) or by a simple pattern; {FIX_ADAPTER_CONFIG}")


def check_lora_settings(config: dict[str, Any], file: Any) -> None:
    """A PEFT adapter's ``adapter_config.json`` (``config``, read from ``file``), untrusted: ``r`` a
    positive integer, ``lora_alpha`` a finite number, ``rank_pattern`` / ``alpha_pattern`` objects of
    such numbers, module lists of strings, flags true or false (absent or null entries take PEFT's
    defaults); every regular expression (pattern keys, a string ``target_modules`` /
    ``exclude_modules``) at most 200 characters and 3 repetitions, with no repetition inside a
    repetition or over an alternation and no back-reference: patterns whose matching time cannot
    explode. Anything else is one :class:`UserError` line naming ``file`` and the fix."""
    for key, ok, what in (("r", _is_count, "a positive integer"), ("lora_alpha", _is_number, "a finite number")):
        if key in config and not ok(config[key]):
            raise UserError(f"{file}: {key} is {config[key]!r}, not {what}; {FIX_ADAPTER_CONFIG}")
    for key, ok, what in (("rank_pattern", _is_count, "positive integers"), ("alpha_pattern", _is_number,
                                                                              "finite numbers")):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise UserError(f"{file}: {key} is a {type(patterns).__name__}, not an object of module pattern -> {what}; "
                            f"{FIX_ADAPTER_CONFIG}")
        for pattern, value in patterns.items():
            _check_pattern(pattern, key, file)
            if not ok(value):
                raise UserError(f"{file}: {key}[{pattern!r}] is {value!r}, not one of {what}; {FIX_ADAPTER_CONFIG}")
    for key in ("target_modules", "exclude_modules", "modules_to_save"):
        value = config.get(key)
        if isinstance(value, str) and key != "modules_to_save":
            _check_pattern(value, key, file)  # a string is PEFT's re.fullmatch pattern
        elif value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise UserError(f"{file}: {key} is {value!r}, not a list of module names; {FIX_ADAPTER_CONFIG}")
    for key in ("fan_in_fan_out", "use_rslora"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise UserError(f"{file}: {key} is {config[key]!r}, not true or false; {FIX_ADAPTER_CONFIG}")
