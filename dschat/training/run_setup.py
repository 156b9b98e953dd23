"""A step's start: its flags checked (contradictions, paths) before anything is loaded or written,
then distributed start-up, the dtype and the seed (:func:`setup_run`), giving the :class:`RunContext`."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from dschat.data.cache import check_data_output_path
from dschat.data.dispatch import resolve_dataset
from dschat.errors import UserError
from dschat.models.registry import resolve_model_path
from dschat.models.reward_model import is_reward_model_folder, refuse_reward_model
from dschat.models.save import is_model_artifact, is_weights_file
from dschat.cli.shared import check_seed
from dschat.paths import METRICS_FILE, STARTED_FILE_VAR, adapter_base, is_short_name
from dschat.remote_reward import worst_case_seconds
from dschat.runtime.dist import DEFAULT_DIST_TIMEOUT_MINUTES, barrier, gather_json, get_rank, init_distributed
from dschat.runtime.ds_config import check_optimizer_offload, check_param_offload, resolve_dtype
from dschat.runtime.fs import check_writable_dir, open_own, refuse_foreign_link_on_the_way, refuse_foreign_links
from dschat.runtime.run_lock import LOCK_NAME, run_lock
from dschat.runtime.trust import check_trusted
from dschat.training.checkpoint import check_checkpoint_args, prepare_checkpoint_root
from dschat.training.loaders import set_random_seed


def check_rates_and_decays(args: object, names: Iterable[str]) -> None:
    """One line for the first flag of ``names`` (learning rates and weight decays: attributes of
    ``args``; a missing one is skipped) that is not a finite number >= 0 (torch's optimizers refuse a
    negative rate only once the model is built, and a negative LoRA rate or weight decay, or a NaN
    one, trains without an error until the loss is NaN)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UserError(f"--{name} must be a finite number >= 0, got {value}")


def check_dropouts(args: object, names: Iterable[str]) -> None:
    """One line for the first flag of ``names`` (attributes of ``args``; None: the model's own
    dropout, not checked) outside [0, 1), the probabilities torch's dropout layers take."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and not 0 <= value < 1:
            raise UserError(f"--{name} must be in [0, 1) (a probability; omit it to keep the model's), got {value}")


def check_common_args(args: argparse.Namespace) -> None:
    """Reject contradictory or impossible flags before anything is loaded or written."""
    if getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None):
        raise UserError(
            "--deepspeed_config is not used: dschat builds the DeepSpeed config from the flags "
            "(--zero_stage, --dtype, --offload, --per_device_train_batch_size, ...); drop it"
        )
    check_seed(getattr(args, "seed", 0))
    if getattr(args, "add_eot_token", False) and not getattr(args, "eot_token", "x").strip():
        raise UserError("--add_eot_token adds --eot_token as a special token, which is empty here; give a token "
                        "such as --eot_token '<|endoftext|>' (its default)")
    if getattr(args, "lora_dim", 0) < 0:
        raise UserError(f"--lora_dim must be >= 0, got {args.lora_dim}")
    if getattr(args, "only_optimize_lora", False) and getattr(args, "lora_dim", 0) <= 0:
        raise UserError("--only_optimize_lora needs LoRA layers; also pass --lora_dim > 0 (e.g. --lora_dim 128)")
    if getattr(args, "zero_stage", 0) not in (0, 1, 2, 3):
        raise UserError(f"--zero_stage must be 0, 1, 2 or 3, got {args.zero_stage}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "num_train_epochs", "max_seq_len"):
        value = getattr(args, name, 1)
        if value < 1:
            raise UserError(f"--{name} must be >= 1, got {value}")
    for name in ("max_train_steps", "num_warmup_steps", "eval_interval", "eval_iters", "freeze_layers"):
        value = getattr(args, name, 0)
        if value < 0:
            raise UserError(f"--{name} must be >= 0, got {value}")
    check_rates_and_decays(args, ("learning_rate", "lora_learning_rate", "weight_decay"))
    check_dropouts(args, ("dropout",))
    if getattr(args, "offload", False):
        check_optimizer_offload(args.zero_stage, "--zero_stage")
    if getattr(args, "offload_reference_model", False):  # DPO: the reference is ZeRO-3 iff the policy is
        check_param_offload("--offload_reference_model", args.zero_stage, "--zero_stage")
    check_output_paths(args)
    check_checkpoint_args(args)


#: The entries of ``--output_dir`` every step writes into in place (beside its model): a symbolic link
#: another account made at one of them is refused at start-up (:func:`check_output_paths`).
OUTPUT_ENTRIES = ("checkpoints", "training.log", METRICS_FILE)


def check_output_paths(args: argparse.Namespace) -> None:
    """``--output_dir``, ``--data_output_path`` and (when enabled) ``--tensorboard_path`` must be
    folders this process can create, and a data cache folder one this user may trust: refused at
    start-up, not after training (steps 1-3). So is a symbolic link another account made at one of
    ``--output_dir``'s :data:`OUTPUT_ENTRIES` (:func:`~dschat.runtime.fs.refuse_foreign_links`), or on
    the way to ``--tensorboard_path`` when a tracker writes there (TensorBoard; W&B and MLflow without
    ``--output_dir``): planted in a folder others can write to, it would lead the run's writes into
    another place; an existing ``--tensorboard_path`` must be the user's own (:func:`check_trusted`): the
    writers below it (TensorBoard's, DeepSpeed's monitor) open what they find there."""
    for name in ("output_dir", "data_output_path"):
        if getattr(args, name, None):
            check_writable_dir(getattr(args, name), f"--{name}")
    if getattr(args, "output_dir", None):
        refuse_foreign_links(args.output_dir, OUTPUT_ENTRIES)
    if getattr(args, "data_output_path", None):
        check_data_output_path(args.data_output_path)
    if getattr(args, "enable_tensorboard", False) or (getattr(args, "report_to", None)
                                                      and not getattr(args, "output_dir", None)):
        check_writable_dir(args.tensorboard_path, "--tensorboard_path")
        refuse_foreign_link_on_the_way(args.tensorboard_path, "--tensorboard_path")
        if os.path.lexists(os.path.expanduser(args.tensorboard_path)):  # else created by this run, the user's
            check_trusted(os.path.expanduser(args.tensorboard_path), "--tensorboard_path",
                          "pass a --tensorboard_path folder of your own that only you can write to (another "
                          "account could plant links there that lead the event files elsewhere, and read them)")


# What a run saves -> (the folder, ``owns``: the entry names the save replaces there; None: it
# replaces the whole folder).
ModelOutputs = Mapping[str, tuple[str | Path, Callable[[str], bool] | None]]


def model_outputs(args: argparse.Namespace) -> ModelOutputs:
    """Steps 1 and 2's one output: the model in ``--output_dir`` (none without one)."""
    return {"the model": (args.output_dir, is_model_artifact)} if getattr(args, "output_dir", None) else {}


def check_paths(args: argparse.Namespace, model_flags: Iterable[str] = ("model_name_or_path",),
                outputs: ModelOutputs | None = None, causal_lm: bool = True) -> None:
    """Bad model and dataset paths fail here: before distributed start-up, before anything is loaded
    or written (the rows themselves are checked when the data is read, still before any model). With
    ``causal_lm`` (a step that trains a language model from them), a reward model (a step-2 output or
    a sequence classifier: no language-model head, so one would be drawn at random) is refused. No
    model is saved over an input model (:func:`refuse_saving_over_inputs`; ``outputs`` default:
    :func:`model_outputs`)."""
    for flag in model_flags:
        name = getattr(args, flag)
        path = resolve_model_path(name)
        if causal_lm:
            refuse_reward_model(path, f"--{flag} {name}", "pass a causal LM: a base model or a step-1 output",
                                mapped_only=True)
    for name in [*args.data_path, *getattr(args, "sft_only_data_path", [])]:
        resolve_dataset(name)
    outputs = model_outputs(args) if outputs is None else outputs
    refuse_saving_over_inputs({f"--{flag}": getattr(args, flag) for flag in model_flags}, outputs)
    refuse_replacing_another_kind(outputs, reward=not causal_lm)


def refuse_replacing_another_kind(outputs: ModelOutputs, *, reward: bool) -> None:
    """One :class:`UserError` line when a folder this run saves its model into holds a finished model
    (``config.json`` and weights) of the other kind: a reward model where this run saves a language
    model (``reward`` False: steps 1 and DPO), or a language model where it saves a reward model
    (step 2). The save would replace it, and another step's output is lost without a word (an
    earlier model of the same kind is this step's own, replaced as upstream does). Outputs replaced
    as a whole (``owns`` None) are not looked at."""
    for _what, (folder, owns) in outputs.items():
        local = Path(folder).expanduser()
        try:
            names = os.listdir(local)
        except OSError:  # none yet (or unreadable: the writability check names it)
            continue
        if owns is None or "config.json" not in names or not any(is_weights_file(n) for n in names):
            continue
        holds_reward = is_reward_model_folder(local, mapped_only=True)
        if holds_reward != reward:
            held = ("a reward model (a step-2 output)" if holds_reward
                    else "a language model (a step-1 or DPO output, or a base model)")
            raise UserError(f"--output_dir {folder} holds {held}, and this run would save its "
                            f"{'reward' if reward else 'language'} model over it, losing it; pass another "
                            "--output_dir, or move that model out first")


def foreign_config_problem(outputs: ModelOutputs) -> str | None:
    """The line saying that a folder the run saves a model into holds a ``config.json`` that is no
    model's (not a JSON object with ``model_type`` or ``architectures``: a project's own settings
    file, with ``--output_dir .``), which the save would replace; None when there is none. Outputs
    replaced as a whole (``owns`` None, dschat's own folders) are not looked at."""
    for what, (folder, owns) in outputs.items():
        config = Path(folder).expanduser() / "config.json"
        if owns is None or not config.is_file():
            continue
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            data = None
        if not (isinstance(data, dict) and ("model_type" in data or "architectures" in data)):
            return (f"{config} is not a model's config (no JSON object with model_type or architectures), "
                    f"and this run saves {what} into {folder}, replacing its config.json; give another "
                    "--output_dir, or move that file")
    return None


def refuse_replacing_foreign_config(outputs: ModelOutputs) -> None:
    """Stop every rank with :func:`foreign_config_problem`'s line, as global rank 0 sees the folders
    (the rank that saves: another node's own folder of that name is never written). Collective after
    distributed start-up (rank 0's line is shared, so no rank waits for one that stopped); without a
    process group, this process looks."""
    problem = gather_json(foreign_config_problem(outputs) if get_rank() == 0 else None)[0]
    if problem:
        raise UserError(str(problem))


def _local_folder(name: str | None) -> Path | None:
    """The resolved folder a model flag's value names, or None for none, a hub id or a short name (a
    short name wins over a same-named folder, as in ``resolve_model_path``)."""
    local = Path(str(name)).expanduser() if name and not is_short_name(str(name)) else None
    return local.resolve() if local is not None and local.is_dir() else None


def _input_folders(name: str | None) -> list[tuple[Path, str | None]]:
    """The local folders a model flag's value loads: its folder (with None) and, for a LoRA adapter
    folder, its base model's down the chain (8 deep at most; each with the base as the adapter names it)."""
    found: list[tuple[Path, str | None]] = []
    src, base = _local_folder(name), None
    while src is not None and len(found) < 8 and all(src != seen for seen, _ in found):
        found.append((src, base))
        base = adapter_base(src)
        src = None if base is None else _local_folder(base)
    return found


def refuse_saving_over_inputs(inputs: Mapping[str, str | None], outputs: ModelOutputs) -> None:
    """One line when a folder the run saves a model into would replace one of its input models (the
    run would read the input, then destroy it). ``inputs``: flag -> model name or path (hub ids and
    short names, which are not the user's folders, are skipped; a LoRA adapter folder's base model, down
    the chain, counts as an input too); ``outputs``: what is saved -> (folder, ``owns``, the
    entry names the save replaces there; None: it replaces the whole folder). Refused: an input that
    is an output folder, or lies inside an entry of one that the save replaces."""
    for flag, name in inputs.items():
        for src, base in _input_folders(name):
            for what, (folder, owns) in outputs.items():
                out = Path(folder).expanduser().resolve()
                inside = out in src.parents and (owns is None or owns(src.relative_to(out).parts[0]))
                if src == out or inside:
                    where = "is the folder" if src == out else "is inside the folder"
                    input_is = f"{name}" if base is None else f"{name} is a LoRA adapter whose base model {base}"
                    raise UserError(f"{flag} {input_is} {where} this run saves {what} into ({folder}), so the save "
                                    "would replace the model it trains from; give another --output_dir")


def set_unsaved_models_aside(output_dir: str | Path, folders: Iterable[str], inputs: Iterable[str | None]) -> list[str]:
    """After step 3's final save, so that every model folder in ``output_dir`` is this run's: each of
    ``folders`` (where this run saved no model: ``critic`` of a critic-free run, ``actor_ema`` without
    EMA) holding an earlier run's model files is renamed to ``<name>.earlier``. Nothing is deleted: a
    folder that is (or holds) one of this run's ``inputs``, whose ``.earlier`` name is taken, or that
    another run uses (its run lock, :mod:`dschat.runtime.run_lock`), stays where it is; so does a link
    (with a notice). Returns one notice per folder that stays or moves.
    Rank 0 only."""
    notices = []
    sources = [src for src in map(_local_folder, inputs) if src is not None]
    for name in folders:
        folder = Path(output_dir) / name
        if folder.is_symlink():
            notices.append(f"{folder} is a link, left as it is: the model it leads to is not this run's")
            continue
        if not folder.is_dir() or not any(is_model_artifact(p.name) for p in folder.iterdir()):
            continue
        earlier = folder.with_name(f"{name}.earlier")
        what = f"{folder} holds an earlier run's model (this run saved none there)"
        if any(src == folder.resolve() or folder.resolve() in src.parents for src in sources):
            notices.append(f"{what}; it is an input of this run, so it stays")
        elif os.path.lexists(earlier):
            notices.append(f"{what}; {earlier} exists already, so it stays: move one of them yourself")
        else:
            try:
                with run_lock(folder, "the folder", fix="wait for it to end, then move the folder yourself"):
                    os.replace(folder, earlier)
                    with contextlib.suppress(OSError):
                        (earlier / LOCK_NAME).unlink()  # the lock file moved with it; held, so no one else's
                notices.append(f"{what}: now in {earlier}")
            except UserError as err:  # another run uses it (or its lock file is not trusted)
                notices.append(f"{what}; it stays: {err}")
            except OSError as err:
                notices.append(f"{what}; it stays (cannot rename it: {err.strerror or err})")
    return notices


@dataclass(frozen=True)
class RunContext:
    """Where this process runs: global rank, world size, device, and the dtype actually used."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dtype: str


def quiet_transformers() -> None:
    """Silence per-load progress bars; keep warnings."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lazy: transformers costs 0.75 s CPU at import (python -X importtime), and step 2's --help,
    # which imports this module, never needs it.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


#: Minutes a collective waits beyond the longest stretch of user code one rank may run alone (an
#: environment's step, the reward functions of a batch): the rank whose call times out reaches the
#: next collective with its line before the others' wait there runs out.
USER_CALL_MARGIN_MINUTES = 5.0
_MOST_MINUTES = 30 * 24 * 60.0  # a bound the backends' timeouts hold


def _seconds(value: object) -> float | None:
    """``value`` as a limit in seconds: None for no limit (0, or not a finite number > 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def longest_user_call_seconds(args: argparse.Namespace) -> float:
    """The most seconds one rank may spend in user code between two collectives before a timeout of
    its own stops it: one ``--env`` call (``--env_timeout``); a batch's reward terms, which run one
    after another (``--reward_fn_timeout`` for each ``--reward_fn``, plus the ``--reward_url``
    client's worst case, :func:`~dschat.remote_reward.worst_case_seconds`); the ``--eval_judge``
    functions of an evaluation (``--reward_fn_timeout`` each; 'gold' and reward-model folders run no
    user code). 0 when there is none (steps 1 and 2) or a stretch has a term without a limit (0), which
    nothing bounds. Read with ``getattr``, so any step's flags will do."""
    reward_fn_limit = _seconds(getattr(args, "reward_fn_timeout", 0.0))
    stretches: list[list[float | None]] = []
    if getattr(args, "env", None):
        stretches.append([_seconds(getattr(args, "env_timeout", 0.0))])
    rewards: list[float | None] = [reward_fn_limit for _ in getattr(args, "reward_fn", None) or []]
    if getattr(args, "reward_url", None):
        timeout, retries = _seconds(getattr(args, "reward_url_timeout", 0.0)), getattr(args, "reward_url_retries", 0)
        rewards.append(worst_case_seconds(timeout, retries) if timeout and isinstance(retries, int) else None)
    stretches.append(rewards)
    stretches.append([reward_fn_limit for judge in getattr(args, "eval_judge", None) or [] if ":" in str(judge)])
    bounded = [sum(s) for s in stretches if s and all(x is not None for x in s)]  # type: ignore[arg-type]
    return max(bounded, default=0.0)


def collective_timeout_minutes(args: argparse.Namespace) -> float:
    """The least minutes a collective waits (:func:`~dschat.runtime.dist.init_distributed`'s
    ``collective_minutes``; start-up keeps ``--dist_timeout``): the longest stretch of user code
    (:func:`longest_user_call_seconds`) plus :data:`USER_CALL_MARGIN_MINUTES`, so that healthy ranks
    waiting in a collective outwait the rank whose environment or reward function is stuck, and
    that rank's line stops the run; 0 without such code."""
    longest = longest_user_call_seconds(args)
    return min(longest / 60.0 + USER_CALL_MARGIN_MINUTES, _MOST_MINUTES) if longest else 0.0


def setup_run(args: argparse.Namespace, outputs: ModelOutputs | None = None) -> RunContext:
    """Initialise distributed (launcher or plain ``python``), check the output folders (collective:
    every rank stops with the same line), pick the dtype, seed everything.

    ``outputs``: the models the run saves (default :func:`model_outputs`), whose folders must hold no
    ``config.json`` that is not a model's (:func:`refuse_replacing_foreign_config`). On a CPU
    accelerator an fp16 request trains in fp32 (one warning): upstream recipes run unchanged there.
    The ranks wait ``--dist_timeout`` for each other at start-up, and in collectives at least
    :func:`collective_timeout_minutes`.
    """
    quiet_transformers()
    info = init_distributed(timeout_minutes=getattr(args, "dist_timeout", DEFAULT_DIST_TIMEOUT_MINUTES),
                            collective_minutes=collective_timeout_minutes(args))
    refuse_replacing_foreign_config(model_outputs(args) if outputs is None else outputs)
    prepare_checkpoint_root(args, info.rank)  # every rank's view of --output_dir, before any model loads
    started = os.environ.get(STARTED_FILE_VAR)
    if started:  # past the start-up refusals: the launcher keeps this run's log whatever its exit code
        with contextlib.suppress(OSError, UserError):  # not through another account's link: no stamp then
            open_own(started, "a").close()
    dtype = resolve_dtype(args.dtype)
    set_random_seed(args.seed)
    barrier()
    return RunContext(info.rank, info.local_rank, info.world_size, info.device, dtype)
