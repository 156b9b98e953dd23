"""Saving trained models as real Hugging Face folders, atomically.

A saved causal LM (steps 1, 3 and DPO) is a folder that ``AutoModelForCausalLM.from_pretrained``,
``AutoTokenizer.from_pretrained`` and ``pipeline("text-generation")`` load as it is: safetensors
weights, config, generation config, the full tokenizer files and chat template (upstream's
were not: docs/upstream.md#tokenizer-files-in-checkpoints). A saved reward model (step 2, the
step-3 critic) is the same for its body
(``AutoModel.from_pretrained`` loads it) plus ``v_head.safetensors``. ``--save_format bin`` writes
upstream's layout instead (``pytorch_model.bin``, a reward model's body and value head in one file),
``both`` both; every dschat reader takes either.

Under ZeRO-3 parameters are gathered module by module (all ranks must call :func:`save_hf_model`;
only rank 0 writes). LoRA factors are fused into the weights of the copy being saved (the live
model is left as it is, so a mid-training save does not disturb training) and dropped, so the
folder is a plain model; a 4-bit (QLoRA) base is saved dequantised, in the compute dtype.
Persistent buffers are saved too (docs/upstream.md#small-fixes).
A model with LoRA layers also gets its LoRA as a PEFT adapter in ``lora_adapter/``
(:mod:`dschat.models.peft_adapter`), written in the same atomic swap.
Writing goes through :func:`dschat.runtime.inplace.save_in_place`: the model files are written and
fsync'd in a staging folder inside the output folder, then renamed over the previous ones, so a
failure restores the previous model and a kill is finished or undone at the next start
(:func:`recover_output_dir`). The output folder itself is never renamed (a mount point, ``.`` or a
folder in a parent the user cannot write to are fine), and nothing in it that is not part of a saved
model (``training.log``, ``checkpoints/``, TensorBoard runs, step 3's ``actor/`` beside ``critic/``,
the user's own files) is moved, written or deleted.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import deepspeed
import torch
from safetensors.torch import save_file
from torch import nn

from dschat.errors import UserError, cli_main
from dschat.models.peft_adapter import ADAPTER_DIR, gather_lora_adapter, write_lora_adapter
from dschat.models.reward_model import VALUE_HEAD_FILE, VALUE_HEAD_KEY, RewardModel
from dschat.paths import SAVE_FORMATS, UPSTREAM_WEIGHTS_FILE
from dschat.runtime.dist import barrier, gather_ints
from dschat.runtime.inplace import STAGING_PREFIX, mark_set, recover_in_place, save_in_place, unmark_set
from dschat.runtime.run_lock import LOCK_NAME, hold_run_lock, run_lock
from dschat.runtime.zero3 import release_zero3_prefetch

LORA_FACTORS = ("lora_right_weight", "lora_left_weight")


# What a save writes (and so may replace), by the exact names Hugging Face gives them: the weights
# in one file or in shards ("-00001-of-00002") with their index, our value head, the configs and
# the tokenizer's files. Everything else in an output folder is carried over, also files named like
# them that no save writes (the user's "model.prev.safetensors", "model-v1.safetensors", "config.txt").
_SHARD = r"(-\d{5}-of-\d{5})?"
_WEIGHT_FILES = (
    rf"^(model{_SHARD}\.safetensors|pytorch_model{_SHARD}\.bin|tf_model{_SHARD}\.h5|flax_model{_SHARD}\.msgpack)$"
    r"|^(model\.safetensors|pytorch_model\.bin|tf_model\.h5|flax_model\.msgpack)\.index\.json$"
    r"|^v_head\.safetensors$"
)
_WEIGHTS = re.compile(_WEIGHT_FILES)
_MODEL_ARTIFACTS = re.compile(
    _WEIGHT_FILES
    + r"|^(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab)\.json$"
    r"|^(vocab|merges)\.txt$|^(chat_template\.(jinja|json)|tokenizer\.model|spiece\.model)$"
)


def is_model_artifact(name: str) -> bool:
    """True for the files a Hugging Face save (and our value head, and LoRA adapter) writes."""
    return bool(_MODEL_ARTIFACTS.match(name)) or name == ADAPTER_DIR


def is_weights_file(name: str) -> bool:
    """Whether ``name`` is a model's weights file (a shard, an index, the value head)."""
    return bool(_WEIGHTS.match(name))


def _no_entry(name: str) -> bool:
    return False


def earlier_model_files(folder: str | Path) -> Callable[[str], bool]:
    """What a save into ``folder`` removes besides the files it writes: an earlier model's other
    files (:func:`is_model_artifact`: its shards, a tokenizer file the new tokenizer does not write)
    when ``folder`` holds a model (its ``config.json``, weights or ``lora_adapter/``), so the folder
    holds one model; nothing when it holds none (a ``vocab.json`` beside no model is the user's own)."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return _no_entry
    return is_model_artifact if any(n in ("config.json", ADAPTER_DIR) or is_weights_file(n) for n in names) else _no_entry


def recover_output_dir(output_dir: str | Path, run: object | None = None) -> list[str]:
    """Finish or undo a :func:`save_hf_model` into ``output_dir``, or into one of its subfolders
    (step 3's ``actor/``, ``critic/``), that a kill interrupted
    (:func:`dschat.runtime.inplace.recover_in_place`); one notice per fix. A subfolder is recovered
    under its own run lock: one that another run holds is left as it is (a notice says so).

    One process at a time: a step's start-up passes ``run`` (its parsed arguments), and the folder's
    run lock is taken first and held while ``run`` lives (:func:`dschat.runtime.run_lock.hold_run_lock`;
    the folder is created if missing); another run holding it is one line
    (:class:`~dschat.errors.UserError`) and nothing is touched. Without ``run`` the caller holds the
    lock (:func:`main` does) or knows no other process writes there."""
    if run is not None:
        hold_run_lock(output_dir, run)
    root = Path(output_dir)
    if not root.is_dir():
        return []
    notices = recover_in_place(root, is_model_artifact)
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.is_symlink() and any(sub.glob(f"{STAGING_PREFIX}*")):
            notices += _recover_subfolder(sub)
    return notices


def _recover_subfolder(sub: Path) -> list[str]:
    """:func:`recover_in_place` of ``sub`` under its own run lock; a subfolder another run holds (a
    step whose ``--output_dir`` it is, its save in progress) is left as it is, with one notice."""
    try:
        with run_lock(sub, "the folder", fix="it finishes or undoes its own save there"):
            return recover_in_place(sub, is_model_artifact)
    except UserError as err:
        return [f"left {sub} as it is: {err}"]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def unwrap(model: Any) -> nn.Module:
    """The plain module inside a DeepSpeed engine (or the module itself)."""
    return getattr(model, "module", model)


def is_lora_layer(module: nn.Module) -> bool:
    """DeepSpeed Hybrid Engine's LoRA contract: these three attributes on a Linear-like module."""
    return all(hasattr(module, name) for name in (*LORA_FACTORS, "lora_scaling"))


def _fused_copy(module: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``local`` (CPU copies of ``module``'s parameters) with the LoRA delta added to ``weight`` (unless
    the layer is fused already) and the factors dropped.

    A 4-bit (QLoRA) base is stored as packed uint8 codes: it is dequantised first (the layer's own
    dequantisation, what its forward uses) and saved dense in the compute dtype, the LoRA factors'.
    """
    right = local.pop("lora_right_weight")  # (in, r)
    left = local.pop("lora_left_weight")  # (r, out)
    if getattr(module, "is_quantized", False):
        local["weight"] = module.dense_weight().detach().to("cpu", copy=True)
    if not getattr(module, "fuse_lora", False):
        weight = local["weight"]
        delta = module.lora_scaling * (left.t().float() @ right.t().float())  # (out, in)
        local["weight"] = (weight.float() + delta).to(weight.dtype)
    return local


def gathered_state_dict(model: Any) -> dict[str, torch.Tensor] | None:
    """The full state dict on rank 0 (``None`` on other ranks), on CPU, LoRA fused and dropped.

    A parameter shared by two modules (a tied ``lm_head``) is gathered and copied once: both keys
    hold the same tensor, so ``save_pretrained`` writes it once (a second full copy of the
    embeddings otherwise) and ``torch.save`` keeps both keys on one storage, as upstream's file has.
    Collective under ZeRO-3: every rank must call it.
    """
    release_zero3_prefetch(model)
    module = unwrap(model)
    rank = _rank()
    state: dict[str, torch.Tensor] = {}
    copied: dict[int, str] = {}  # id of a parameter copied already -> its key
    for prefix, sub in module.named_modules():
        key = f"{prefix}.{{}}" if prefix else "{}"
        params = dict(sub.named_parameters(recurse=False))
        lora = is_lora_layer(sub)  # a LoRA layer's copy is its fused weight, not the parameter's: never shared
        shared = {} if lora else {name: copied[id(p)] for name, p in params.items() if id(p) in copied}
        params = {name: p for name, p in params.items() if name not in shared}
        if not lora:
            copied.update({id(p): key.format(name) for name, p in params.items()})  # on every rank: same gathers
        # A no-op for parameters that are not ZeRO-3 partitioned.
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            if rank != 0:
                continue
            local = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        if lora:
            local = _fused_copy(sub, local)
        local.update({name: state[first] for name, first in shared.items()})
        non_persistent = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buf in sub.named_buffers(recurse=False):
            if name not in non_persistent and buf is not None:
                local[name] = buf.detach().to("cpu", copy=True)
        for name, tensor in local.items():
            state[key.format(name)] = tensor
    return state if rank == 0 else None


def _set_saved_dtype(config: Any, state: dict[str, torch.Tensor]) -> None:
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    if floats:
        config.dtype = floats[0]


def _write(module: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Write weights + config (and the value head of a reward model) into ``folder``."""
    if isinstance(module, RewardModel):
        body = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("rwtransformer.")}
        _set_saved_dtype(module.rwtransformer.config, body)
        module.rwtransformer.save_pretrained(folder, state_dict=body, safe_serialization=True)
        save_file({VALUE_HEAD_KEY: state[VALUE_HEAD_KEY].contiguous()}, str(folder / VALUE_HEAD_FILE))
    else:
        _set_saved_dtype(module.config, state)
        # a copy: save_pretrained drops a tied key from the dict it is given (upstream's bin keeps it)
        module.save_pretrained(folder, state_dict=dict(state), safe_serialization=True)


def _write_upstream_bin(module: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Upstream's ``save_hf_format`` layout: the whole state dict (a reward model's ``rwtransformer.*``
    body and ``v_head.weight`` together) in ``pytorch_model.bin``, beside ``config.json`` (and
    ``generation_config.json`` for a causal LM).

    The file holds tensors only, so ``torch.load(..., weights_only=True)`` reads it, as transformers
    and dschat's upstream-critic reader do.
    """
    hf_model = module.rwtransformer if isinstance(module, RewardModel) else module
    _set_saved_dtype(hf_model.config, state)
    # What save_pretrained writes besides the weights.
    hf_model.config.architectures = [type(hf_model).__name__]
    hf_model.config.save_pretrained(folder)
    if hf_model.can_generate():
        hf_model.generation_config.save_pretrained(folder)
    with open(folder / UPSTREAM_WEIGHTS_FILE, "wb") as handle:  # a full disk keeps its errno (ENOSPC)
        torch.save({k: v.contiguous() for k, v in state.items()}, handle)


def save_hf_model(model: Any, tokenizer: Any, output_dir: str | Path, save_format: str = "safetensors") -> Path | None:
    """Save ``model`` (causal LM or :class:`RewardModel`, possibly a DeepSpeed engine) + tokenizer, and
    a LoRA model's PEFT adapter in ``lora_adapter/``.

    ``save_format`` (``--save_format``): ``safetensors``, ``bin`` (upstream's ``pytorch_model.bin``)
    or ``both``. Collective: all ranks call it; rank 0 replaces the model files of ``output_dir`` in
    place (:func:`dschat.runtime.inplace.save_in_place`), keeping every other entry. Returns the
    folder on rank 0, ``None`` elsewhere.
    """
    if save_format not in SAVE_FORMATS:  # before the collective gather, on every rank
        raise ValueError(f"save_format must be one of {SAVE_FORMATS}, got {save_format!r}")
    module = unwrap(model)
    state = gathered_state_dict(model)
    adapter = gather_lora_adapter(model)  # collective too; None without LoRA layers
    output_dir = Path(output_dir)
    if state is not None:
        with save_in_place(output_dir, earlier_model_files(output_dir)) as tmp:
            if save_format != "bin":
                _write(module, state, tmp)
            if save_format != "safetensors":
                _write_upstream_bin(module, state, tmp)
            clear_call_state(tokenizer)  # before the model's tokenizer files and the adapter's
            tokenizer.save_pretrained(tmp)
            if adapter is not None:
                write_lora_adapter(adapter, tmp / ADAPTER_DIR, tokenizer)
    barrier()
    return output_dir if state is not None else None


def clear_call_state(tokenizer: Any) -> None:
    """Clear the truncation and padding a call such as ``tokenizer(texts, max_length=N,
    truncation=True)`` leaves set on a fast tokenizer's backend, before the tokenizer is saved: in
    ``tokenizer.json`` they would cut every text a ``tokenizers`` reader encodes at N. Both are
    call-time state (transformers sets or clears them on every call): the tokenizer works as before."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()


@contextlib.contextmanager
def saving_together(output_dir: str | Path, names: Sequence[str], rank: int) -> Iterator[None]:
    """Save a set of models into ``output_dir``'s subfolders ``names`` (step 3's ``actor/``, ``critic/``,
    ``actor_ema/``; each saved atomically by :func:`save_hf_model` inside) as one set: a marker naming
    them is written before the first (:func:`dschat.runtime.inplace.mark_set`) and removed after the
    last. A kill or an error in between leaves it, and each of those folders is then refused as a
    model (:func:`dschat.models.registry.check_local_model_path`): they may be of two runs. Collective:
    every rank enters; rank 0 writes, and a marker it cannot write stops every rank (one line each)."""
    failure: Exception | None = None
    if rank == 0:
        try:
            mark_set(output_dir, list(names))
        except Exception as err:  # noqa: BLE001 -- raised below, once every rank knows
            failure = err
    if max(row[0] for row in gather_ints([0 if failure is None else 1])):  # collective: rank 0's outcome
        if failure is not None:
            raise failure
        raise UserError(f"marking the models' save into {output_dir} failed on rank 0 (its line is in that rank's log)")
    yield
    barrier()
    if rank == 0:
        unmark_set(output_dir)


def save_hf_format(model: Any, tokenizer: Any, args: Any, sub_folder: str = "") -> Path | None:
    """Upstream's name: save into ``args.output_dir/sub_folder``.

    This one call does everything and must be made on every rank (upstream's was rank 0's only:
    docs/upstream.md#step-1-sft).
    """
    return save_hf_model(model, tokenizer, Path(args.output_dir) / sub_folder,
                         getattr(args, "save_format", "safetensors"))


def save_zero_three_model(model: Any, global_rank: int, save_dir: str | Path, zero_stage: int = 0) -> None:
    """Upstream's name: gather the weights (all ranks) and write them + config into ``save_dir``
    (rank 0). Files already there (e.g. tokenizer files) are kept; the weights are replaced."""
    del global_rank, zero_stage  # the rank comes from torch.distributed; gathering is a no-op below ZeRO-3
    module = unwrap(model)
    state = gathered_state_dict(model)
    if state is not None:
        # Keep everything already there (tokenizer files, logs) except stale weight files.
        with save_in_place(save_dir, is_weights_file) as tmp:
            _write(module, state, tmp)
    barrier()


#: The folders step 3 saves its models into under its --output_dir (and recovers at start-up).
STEP3_MODEL_FOLDERS = ("actor", "critic", "actor_ema")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dschat.models.save --recover FOLDER``: finish or undo a model save into FOLDER (or
    its ``actor/``, ``critic/``) that was stopped, as every step does at start-up for its
    ``--output_dir``. It takes FOLDER's run lock first (and that of the folder above, when that one
    has a run lock or FOLDER is named as step 3's models are, :data:`STEP3_MODEL_FOLDERS`: a step-3
    ``--output_dir`` whose ``actor/`` or ``critic/`` this is), so while a run uses the folder it is
    one line, exit code 2, and nothing is touched."""
    parser = argparse.ArgumentParser(prog="python -m dschat.models.save", description=main.__doc__)
    parser.add_argument("--recover", required=True, metavar="FOLDER", help="the model folder to finish or undo")
    folder = parser.parse_args(argv).recover
    if Path(folder).exists() and not Path(folder).is_dir():
        raise UserError(f"--recover {folder} is a file, not a folder; pass the model folder named in the error")
    if not Path(folder).is_dir():
        raise UserError(f"--recover {folder}: no such folder; pass the model folder named in the error")
    with contextlib.ExitStack() as locks:
        inside = Path(folder).resolve()
        above = inside.parent  # a step-3 --output_dir that a run there recovers too
        if os.path.lexists(above / LOCK_NAME) or (inside.name in STEP3_MODEL_FOLDERS
                                                   and os.access(above, os.W_OK)):  # else no run of ours uses it
            locks.enter_context(run_lock(above, "--output_dir"))
        locks.enter_context(run_lock(folder, "the folder"))
        notices = recover_output_dir(folder)
    for notice in notices or [f"{folder} holds no unfinished save; nothing to do"]:
        print(notice, flush=True)


if __name__ == "__main__":
    sys.exit(cli_main(main))
