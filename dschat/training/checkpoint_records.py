"""The JSON files of a checkpoint (no pickles), read back with every field checked: the random
states (``rng_rank<r>.json``: Python, NumPy, torch and CUDA generators) and the marker
(``dschat_checkpoint.json``: format, data position, engines, caller state, write order).

A truncated, damaged or hand-edited file -- bad JSON, a missing key, a string where a number
belongs, a negative step, a state of the wrong length -- is refused with one line naming the file
(:class:`~dschat.errors.UserError`, exit code 2), never a traceback from deep inside a loader.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from dschat.errors import UserError
from dschat.models.registry import weights_fingerprint
from dschat.runtime.dist import gather_json
from dschat.training.rotation import MARKER

FORMAT_VERSION = 1
#: What a checkpoint's ``meta.step`` (the step that wrote it) says in a line.
STEP_NAMES = {"step1": "step 1 (fine-tuning)", "step2": "step 2 (reward model)", "dpo": "DPO", "step3": "step 3"}


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _is_int(value: Any, low: int = 0, high: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def _ints(values: Any, length: int | None, high: int) -> bool:
    return (isinstance(values, list) and (length is None or len(values) == length)
            and all(_is_int(v, 0, high) for v in values))


def _rng_problem(state: Any) -> str | None:
    """What is wrong with a random-state record (:func:`rng_state`'s layout), or None."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state) <= {"python", "numpy", "torch",
                                                                                        "cuda"}:
        return "it is not an object with the keys python, numpy, torch (and cuda)"
    py = state["python"]
    if not (isinstance(py, list) and len(py) == 3 and _is_int(py[0]) and _ints(py[1], 625, 2**32 - 1)
            and py[1][-1] <= 624 and (py[2] is None or isinstance(py[2], float))):
        return "its python state is not [version, 625 32-bit words, gauss]"
    npy = state["numpy"]
    if not (isinstance(npy, list) and len(npy) == 5 and npy[0] == "MT19937" and _ints(npy[1], 624, 2**32 - 1)
            and _is_int(npy[2], 0, 624) and _is_int(npy[3], 0, 1) and isinstance(npy[4], (int, float))
            and not isinstance(npy[4], bool)):
        return "its numpy state is not ['MT19937', 624 32-bit words, position, has_gauss, cached]"
    if not _ints(state["torch"], torch.get_rng_state().numel(), 255):
        return f"its torch state is not {torch.get_rng_state().numel()} bytes"
    if "cuda" in state and not _ints(state["cuda"], None, 255):
        return "its cuda state is not a list of bytes"
    return None


def read_rng_file(path: Path) -> dict[str, Any]:
    """A rank's ``rng_rank<r>.json``, checked (types, lengths, ranges); a damaged or edited one is
    one line naming it."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        state, problem = None, f"it is not readable JSON ({type(err).__name__})"
    else:
        problem = _rng_problem(state)
    if problem is not None:
        raise UserError(f"{path}: {problem}; the checkpoint is damaged or was edited: pass --resume_from with "
                        "another checkpoint")
    return state


_POSITION_KEYS = ("epoch", "epoch_micro_steps", "micro_steps", "optimizer_steps")


def _record_problem(data: Any) -> str | None:
    """What is wrong with a marker record, or None (the format version is checked apart)."""
    if not isinstance(data, dict):
        return "it is not a JSON object"
    position = data.get("position")
    if not isinstance(position, dict) or not set(_POSITION_KEYS) <= set(position) <= {*_POSITION_KEYS, "extra"}:
        return f"its position is not an object with {', '.join(_POSITION_KEYS)} (and extra)"
    bad = [key for key in _POSITION_KEYS if not _is_int(position[key])]
    if bad:
        return f"position.{bad[0]} is {position[bad[0]]!r}, not a whole number >= 0"
    if not isinstance(position.get("extra", {}), dict):
        return "position.extra is not an object"
    for key in ("engines", "weights_only"):
        if not (isinstance(data.get(key, []), list) and all(isinstance(t, str) for t in data.get(key, []))):
            return f"{key} is not a list of names"
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        return "meta is not an object"
    if not isinstance(meta.get("step", ""), str):
        return "meta.step is not a name"
    offload = meta.get("offload", {})
    if not (isinstance(offload, dict) and all(isinstance(v, bool) for v in offload.values())):
        return "meta.offload is not an object of true/false"
    trainable = data.get("trainable", {})
    if not (isinstance(trainable, dict) and all(isinstance(v, list) and all(isinstance(n, str) for n in v)
                                                for v in trainable.values())):
        return "trainable is not an object of name lists"
    if "sequence" in data and not _is_int(data["sequence"]):
        return f"sequence is {data['sequence']!r}, not a whole number >= 0"
    return None


def read_record(folder: Path) -> dict[str, Any]:
    """The marker of the checkpoint ``folder``, checked (types, keys, ranges); a damaged or edited
    one, or another format's, is one line naming it."""
    path = folder / MARKER
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        data, problem = None, f"it is not readable JSON ({type(err).__name__})"
    else:
        problem = None if isinstance(data, dict) and data.get("format") != FORMAT_VERSION else _record_problem(data)
    if problem is not None:
        raise UserError(f"{path}: {problem}; the checkpoint is damaged or was edited: pass --resume_from with "
                        "another checkpoint")
    if data.get("format") != FORMAT_VERSION:
        raise UserError(f"{folder} was written by another dschat checkpoint format ({data.get('format')!r}); "
                        "start a new run or use the dschat version that wrote it")
    return data


def trainable_parameters(engine: Any, every: bool = False) -> list[str]:
    """``"name [shape]"`` of every parameter ``engine`` trains (its optimizer's state follows them;
    ZeRO-3: the full shape, not the partition's); with ``every``, of all its parameters."""
    module = getattr(engine, "module", engine)
    return [f"{name} {list(getattr(param, 'ds_shape', param.shape))}"
            for name, param in module.named_parameters() if every or param.requires_grad]


def _of_another_model(saved: list[str], engine: Any) -> tuple[str, str | None] | None:
    """The first entry of ``saved`` (a checkpoint's trainable ``"name [shape]"`` list) that no flag
    choosing what trains explains on ``engine``'s model, with this model's shape of that name (None:
    it has no such parameter): a parameter it lacks, or one of another shape (not with LoRA: 4-bit
    base weights have packed shapes); a LoRA factor, when its layer's weight is missing. None: the
    model is the checkpoint's."""
    own = dict(entry.split(" [", 1) for entry in trainable_parameters(engine, every=True))
    lora = any(".lora_" in name for name in own)
    for entry in saved:
        name = entry.split(" [")[0]
        if ".lora_" in name:
            if f"{name.rsplit('.', 1)[0]}.weight" not in own:
                return entry, None
        elif name not in own:
            return entry, None
        elif not lora and entry != f"{name} [{own[name]}":
            return entry, f"[{own[name]}"
    return None


def check_trainable(folder: Path, record: Mapping[str, Any], engines: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose engines trained other parameters than this run's do (its optimizer
    state would not fit): of another model or step, or with other flags choosing what trains;
    checkpoints written before the record existed are not checked."""
    for tag, saved in record.get("trainable", {}).items():
        now = trainable_parameters(engines[tag]) if tag in engines else saved
        if saved == now:
            continue
        foreign = _of_another_model(saved, engines[tag])
        if foreign is not None and foreign[1] is None:
            raise UserError(f"{folder} is a checkpoint of another model or step: its '{tag}' trained {foreign[0]}, "
                            "which this run's model lacks; resume from a checkpoint of this step and model, or start "
                            "afresh")
        if foreign is not None:
            raise UserError(f"{folder}: its '{tag}' trained {foreign[0]}, shaped {foreign[1]} in this run's model: a "
                            "checkpoint of another model size, or of a run whose vocabulary differed "
                            "(--add_eot_token); resume with its model and flags, or start afresh")
        first = next((f"{a} there, {b} here" for a, b in zip(saved, now) if a != b), None)
        if first is None:  # one list starts the other
            first = f"{saved[len(now)]} there only" if len(saved) > len(now) else f"{now[len(saved)]} here only"
        raise UserError(f"{folder}: its '{tag}' trained {len(saved)} parameter tensors, this run trains {len(now)} "
                        f"(first difference: {first}); the flags that choose what trains (--freeze_layers, LoRA "
                        "flags) differ from the run that wrote it: resume with its flags")


def model_record(models: Mapping[str, tuple[str, str | None]]) -> dict[str, Any]:
    """What a checkpoint records of the models a run starts from, by role: ``models`` maps a role
    (``actor``) to its flag and value (``("--actor_model_name_or_path", path)``, None: not given); each
    given one gets its path and :func:`~dschat.models.registry.weights_fingerprint` (None: a hub id
    not in the local cache)."""
    return {role: {"flag": flag, "path": str(value), "weights": weights_fingerprint(value)}
            for role, (flag, value) in models.items() if value is not None}


def _models_problem(folder: Path, record: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    saved = record.get("meta", {}).get("models")
    for role, then in (saved if isinstance(saved, dict) else {}).items():
        here = now.get(role)
        if isinstance(then, dict) and here is not None and None not in (then.get("weights"), here["weights"]) \
                and then["weights"] != here["weights"]:
            return (f"{folder} is of a run whose {role} started from other weights ({then.get('path')}) than "
                    f"{here['flag']} {here['path']}; the reference and reward models and a LoRA adapter's base come "
                    "from that flag, not from the checkpoint: resume with that run's model, or start afresh in "
                    "another --output_dir")
    return None


def check_models(folder: Path, record: Mapping[str, Any], now: Mapping[str, Any], rank: int) -> None:
    """Refuse, on every rank (collective), a checkpoint whose run started from other weights than this
    run's flags name (``now``: :func:`model_record` of this run, compared on rank 0 only): what a
    checkpoint does not hold comes from those flags, so a resumed run would go on against other
    models, silently. A role only one of the two runs has, a hub id not in the local cache, and
    checkpoints written before the record existed are not checked (a flag given or left out is
    checked by the engines the checkpoint holds)."""
    problem = gather_json(_models_problem(folder, record, now) if rank == 0 else None)[0]
    if problem is not None:  # rank 0's line, on every rank
        raise UserError(str(problem))


def check_written_like(folder: Path, record: Mapping[str, Any], engines: Mapping[str, Any], step: str | None) -> None:
    """One line when the checkpoint ``folder`` (its marker ``record``) cannot go on here: another step
    wrote it (``meta.step``; DPO and step 1 both train the engine ``model`` on the same parameters, so
    nothing else tells them apart), or an engine's optimizer was offloaded there and not here, or the
    reverse (``meta.offload``: DeepSpeedCPUAdam's state does not load into another optimizer). A
    checkpoint written before these records existed is not checked."""
    meta = record.get("meta", {})
    written_by = meta.get("step")
    if step is not None and written_by is not None and written_by != step:
        raise UserError(f"{folder} was written by {STEP_NAMES.get(written_by, repr(written_by))}, and this is "
                        f"{STEP_NAMES.get(step, step)}: it would go on with another step's weights, optimizer "
                        "state and position; pass another --output_dir (or --resume_from a checkpoint of this step)")
    for tag, offload in meta.get("offload", {}).items():
        if tag in engines and offload != bool(engines[tag].zero_use_cpu_optimizer()):
            raise UserError(f"{folder} was written {'with' if offload else 'without'} optimizer offload (--offload) "
                            f"for '{tag}', and this run {'does not offload' if offload else 'offloads'} it: the "
                            "optimizer state would not load; resume with the --offload setting that wrote it")
