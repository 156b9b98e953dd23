#!/usr/bin/env python3
"""Run the DeepSpeed-Chat pipeline end to end: step 1 (SFT), step 2 (reward model), step 3 (PPO).

Without a GPU, and with no --deployment-type given, this runs the CPU demo: the embedded
SmolLM2-135M-Instruct on the embedded preference data, then a report comparing the SFT and the
RLHF actor (``OUTPUT/report.json``, ``OUTPUT/ppo_curves.png``).

Examples (upstream's, corrected so that they run)::

    python e2e_rlhf.py                                    # all steps, default models
    python e2e_rlhf.py --actor-model 6.7b --deployment-type single_node
    python e2e_rlhf.py --actor-zero-stage 3 --reward-zero-stage 3
    python e2e_rlhf.py --step 1 2                         # a subset of the steps
    python e2e_rlhf.py --step 3 --actor-model 1.3b --reward-model 350m   # reuse steps 1-2 outputs
    python e2e_rlhf.py --actor-model facebook/opt-350m --reward-model facebook/opt-125m
    python e2e_rlhf.py --deployment-type multi_node --hostfile /job/hostfile --actor-model 66b
    python e2e_rlhf.py --deployment-type cpu --actor-model tiny-llama --reward-model tiny-llama
    python e2e_rlhf.py --algorithm grpo                   # step 3 with GRPO (4 answers per prompt)
    python e2e_rlhf.py --algorithm grpo --reward-fn dschat.rewards:gold   # the RLVR demo (docs/algorithms.md)
    python e2e_rlhf.py --step 3 --env mytools:make_env --max-turns 3   # multi-turn episodes (docs/environments.md)

Each step is launched through the ``deepspeed`` launcher with the argument list of a recipe in
``configs/`` (see ``configs/e2e.yaml`` for how models and deployment types map to recipes); its
output goes to the terminal and to ``<its output dir>/training.log``. Output folders are upstream's:
``OUTPUT/actor-models/<actor>``, ``OUTPUT/reward-models/<reward>``, ``OUTPUT/step3-models/<actor>``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # run from a checkout without installing: use its dschat
    sys.path.insert(0, str(ROOT))

from dschat.cli.step3 import ALGORITHM_CHOICES  # noqa: E402
from dschat.errors import EXIT_USAGE, UserError, cli_main, first_line  # noqa: E402
from dschat.launch import LaunchResult, flag_value, oom_advice, plan, run  # noqa: E402
from dschat.multinode import DEFAULT_HOSTFILE  # noqa: E402
from dschat.paths import SAVE_FORMATS, UPSTREAM_WEIGHTS_FILE, VALUE_HEAD_FILE  # noqa: E402
from dschat.recipes.e2e_config import Deployment, E2EConfig, load_e2e_config as _load_e2e_config  # noqa: E402
from dschat.recipes.loading import get_recipe  # noqa: E402
from dschat.recipes.recipe import Recipe, split_flag_groups  # noqa: E402
from dschat.runtime.fs import check_writable_dir, refuse_foreign_link_on_the_way  # noqa: E402
from dschat.runtime.run_lock import hold_run_lock, releasing_run_locks  # noqa: E402

STEP_KEYS = {1: "step1", 2: "step2", 3: "step3"}
MODEL_TYPE = {1: "actor", 2: "reward", 3: "step3"}  # upstream's output folder prefixes
OPT_SIZES = ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b", "175b")
UPSTREAM_ACTOR_SIZES = ("1.3b", "6.7b", "13b", "66b")
UPSTREAM_REWARD_SIZES = ("350m",)
TIMINGS_FILE = "e2e_timings.json"
STEPS_FILE = "e2e_steps.json"  # each step's main.py flags, and whether it finished: read by --resume
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
REWARD_FILES = (VALUE_HEAD_FILE, UPSTREAM_WEIGHTS_FILE)  # dschat's / upstream's step-2 output


# -------------------------------------------------------------------------------------------------
# configs/e2e.yaml
# -------------------------------------------------------------------------------------------------
def load_e2e_config(root: Path = ROOT) -> E2EConfig:
    """``configs/e2e.yaml`` of this checkout, checked (:mod:`dschat.recipes.e2e_config`)."""
    return _load_e2e_config(root)


# -------------------------------------------------------------------------------------------------
# Models and recipes
# -------------------------------------------------------------------------------------------------
def strip_opt(value: str) -> str:
    """Upstream's argument type: ``facebook/opt-1.3b`` -> ``1.3b``. Only a leading ``facebook/opt-``
    followed by one of :data:`OPT_SIZES` is stripped; any other value (``facebook/opt-iml-max-1.3b``, a
    folder ``/x/facebook/opt-tiny``) is kept as it is."""
    value = value.strip()
    size = value.removeprefix("facebook/opt-")
    return size if size != value and size in OPT_SIZES else value


def model_id(value: str) -> str:
    """What main.py loads: an OPT size becomes ``facebook/opt-<size>``, anything else is kept."""
    return f"facebook/opt-{value}" if value in OPT_SIZES else value


def model_label(value: str) -> str:
    """The folder name under actor-models/ etc.: the size for OPT, a readable name otherwise."""
    if value in OPT_SIZES:
        return value
    path = Path(value).expanduser()
    if path.is_dir():
        return path.resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "--", value).strip("-") or "model"


def _family(model: str) -> tuple[Any, Any]:
    """The model family (dschat.models.families) and the config of a model, or (None, None) if its
    config is unreachable."""
    try:
        from dschat.models.families import family_of
        from dschat.models.registry import load_config, resolve_model_path

        config = load_config(resolve_model_path(model))
        return family_of(config), config
    except (OSError, ValueError, UserError):
        return None, None


def _read_here(model: str) -> bool:
    """Whether ``model``'s config is read without the hub: a local folder or a short name."""
    from dschat.models.registry import SHORT_NAMES  # lazy, as _family's: e2e's --help does not import it

    return Path(model).expanduser().is_dir() or model in SHORT_NAMES


#: Step 3's --num_padding_at_beginning when its recipe does not set it (upstream's, OPT's).
STEP3_NUM_PADDING_DEFAULT = "1"


def _lora_adjustments(recipe: Recipe, model: str, prefix: str = "") -> list[str]:
    """Flags that adapt a recipe written for one model (OPT for the GPU recipes, LLaMA for
    ``cpu/tiny``, SmolLM2-135M for ``cpu/smollm2-135m``) to ``model``: the LoRA scope of its family;
    the leading pads of its family (steps 1-2 with ``prefix`` "" where the recipe sets them, step 3
    with ``prefix`` "critic_": its critic's); and a ``--freeze_layers`` of all its blocks or more
    lowered to half of them."""
    fam, config = _family(model)
    if fam is None:
        return []
    extra: list[str] = []
    dim = recipe.flag(f"{prefix}lora_dim")
    if isinstance(dim, str) and dim.isdigit() and int(dim) > 0:
        current = recipe.flag(f"{prefix}lora_module_name", "decoder.layers.")
        if current != fam.lora_module_name:
            extra += [f"--{prefix}lora_module_name", fam.lora_module_name]
    if (not prefix and recipe.has_flag("num_padding_at_beginning")) or prefix == "critic_":
        if recipe.flag("num_padding_at_beginning", STEP3_NUM_PADDING_DEFAULT) != str(fam.num_padding_at_beginning):
            extra += ["--num_padding_at_beginning", str(fam.num_padding_at_beginning)]
    freeze, blocks = recipe.flag("freeze_layers"), getattr(config, "num_hidden_layers", None)
    if (not prefix and isinstance(freeze, str) and freeze.isdigit() and isinstance(blocks, int)
            and int(freeze) >= blocks):
        extra += ["--freeze_layers", str(blocks // 2)]  # the recipe's lower half (15 of SmolLM2's 30), not all
    return extra


@dataclass
class StepRun:
    """One step as e2e will launch it."""

    number: int
    recipe: Recipe
    params: dict[str, str | None]
    extra: list[str]
    output_dir: Path
    note: str | None = None


def choose_recipe(dep: Deployment, step: int, model: str) -> tuple[str, bool]:
    """(recipe id, whether no recipe is listed for ``model``, so that the deployment's generic one is used
    with the model replaced) for step ``step``. A listed recipe that names another model gets the
    model replaced too (:func:`build_steps`)."""
    table, other, kind = (dep.reward, dep.other_reward, "reward") if step == 2 else (dep.actor, dep.other_actor, "actor")
    if model in table:
        return table[model], False
    if step != 2 and model in dep.unavailable:
        raise UserError(f"no {dep.name} recipe for a {model} {kind}: {dep.unavailable[model]}")
    return other, True


def output_dir(out: Path, step: int, label: str) -> Path:
    return out / f"{MODEL_TYPE[step]}-models" / label


def build_steps(args: argparse.Namespace, dep: Deployment) -> list[StepRun]:
    """The three steps' recipes, parameters and output folders for these arguments."""
    out = Path(args.output_dir)
    actor_label, reward_label = model_label(args.actor_model), model_label(args.reward_model)
    dirs = {1: output_dir(out, 1, actor_label), 2: output_dir(out, 2, reward_label), 3: output_dir(out, 3, actor_label)}
    # Flags e2e passes to every step.
    every_step = ["--seed", str(args.seed)] if args.seed is not None else []
    every_step += ["--save_format", args.save_format] if args.save_format is not None else []
    runs: list[StepRun] = []
    for number in (1, 2, 3):
        model = args.reward_model if number == 2 else args.actor_model
        rid, substitute = choose_recipe(dep, number, model)
        recipe = get_recipe(STEP_KEYS[number], rid, ROOT)
        extra: list[str] = []
        note = None
        if number in (1, 2):
            params: dict[str, str | None] = {"output_dir": str(dirs[number]),
                                             "zero_stage": args.actor_zero_stage if number == 1 else args.reward_zero_stage}
            # a recipe shared by several models names one of them
            if substitute or recipe.flag("model_name_or_path") != model_id(model):
                extra += ["--model_name_or_path", model_id(model)] + _lora_adjustments(recipe, model_id(model))
            if substitute:
                note = (f"no {dep.name} recipe names {model!r}: using recipe {rid} with "
                        f"--model_name_or_path {model_id(model)}")
        else:
            params = {"actor_model": str(dirs[1]), "critic_model": str(dirs[2]),
                      "actor_zero_stage": args.actor_zero_stage, "critic_zero_stage": args.reward_zero_stage,
                      "output_dir": str(dirs[3])}
            # the recipe's LoRA scopes and leading pads, where the models' families differ from them (a
            # listed recipe's hub ids are the recipe's own: no config is fetched for them)
            for prefix, given in (("actor_", model_id(args.actor_model)), ("critic_", model_id(args.reward_model))):
                if substitute or _read_here(given):
                    extra += _lora_adjustments(recipe, given, prefix)
            if substitute:
                note = f"no {dep.name} recipe names {args.actor_model!r}: using recipe {rid}"
            extra += step3_algorithm_flags(args) + step3_environment_flags(args)
        runs.append(StepRun(number, recipe, params, extra + every_step, dirs[number], note))
    return runs


#: --num-generations when --algorithm needs groups and none is given.
DEFAULT_NUM_GENERATIONS = 4
#: The reward function that is the embedded data's own judge: training on it is the RLVR demo.
GOLD_REWARD_FN = "dschat.rewards:gold"


def step3_algorithm_flags(args: argparse.Namespace) -> list[str]:
    """Step 3's --algorithm, --num_generations and --reward_fn flags from e2e's options."""
    flags: list[str] = []
    if args.algorithm is not None:
        flags += ["--algorithm", args.algorithm]
    k = args.num_generations
    if k is None and args.algorithm in ("grpo", "rloo"):
        k = DEFAULT_NUM_GENERATIONS
    if k is not None:
        flags += ["--num_generations", str(k)]
    for spec in args.reward_fn or []:
        flags += ["--reward_fn", spec]
    return flags


def step3_environment_flags(args: argparse.Namespace) -> list[str]:
    """Step 3's --env, --max_turns and --env_timeout flags from e2e's --env, --max-turns, --env-timeout
    (each only when given: step 3's defaults otherwise)."""
    flags: list[str] = []
    if args.env is not None:
        flags += ["--env", args.env]
    if args.max_turns is not None:
        flags += ["--max_turns", str(args.max_turns)]
    if args.env_timeout is not None:
        flags += ["--env_timeout", str(args.env_timeout)]
    return flags


def check_environment_options(args: argparse.Namespace) -> None:
    """--max-turns is at least 1, --env-timeout a number of seconds from 0 to 1e9, and both come with
    --env; else one UserError line."""
    for flag, value in (("--max-turns", args.max_turns), ("--env-timeout", args.env_timeout)):
        if value is not None and args.env is None:
            raise UserError(f"{flag} applies to multi-turn episodes only; add --env MODULE:FACTORY "
                            f"(docs/environments.md) or drop {flag}")
    if args.max_turns is not None and args.max_turns < 1:
        raise UserError(f"--max-turns must be a whole number >= 1, got {args.max_turns}")
    if args.env_timeout is not None:
        from dschat.rewards import check_timeout  # lazy: torch

        check_timeout(args.env_timeout, "--env-timeout")  # as step 3's --env_timeout: 0 to 1e9 seconds


def check_environment_spec(args: argparse.Namespace, dep: Deployment) -> None:
    """--env and each --reward-fn name an importable callable, checked here as step 3 will check them
    (the same lines), so a bad spec stops the run before step 1. On several nodes each node imports
    them from its own files (and DeepSpeed adds the working directory to their path): only a spec's
    form is checked there."""
    specs = [(spec, "--reward-fn", GOLD_REWARD_FN) for spec in args.reward_fn or []]
    if args.env is not None:
        specs.append((args.env, "--env", "dschat.envs_examples:calculator"))
    for spec, flag, example in specs:
        module, sep, attr = spec.partition(":")
        if dep.name == "multi_node" and sep and module and attr:
            continue
        # lazy: dschat.rewards imports torch, which e2e itself never needs; only --env / --reward-fn pay for it
        from dschat.rewards import load_callable

        load_callable(spec, flag, example)


# -------------------------------------------------------------------------------------------------
# Output checks
# -------------------------------------------------------------------------------------------------
def folder_problem(folder: Path, kind: str) -> str | None:
    """Why ``folder`` is not a usable ``kind`` ('actor' or 'reward') model folder, or None."""
    if not folder.is_dir():
        return "the folder does not exist"
    if not (folder / "config.json").is_file():
        return "it has no config.json"
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        return "it has no model weights (model.safetensors or pytorch_model.bin)"
    # A reward model is dschat's (v_head.safetensors beside the body) or upstream DeepSpeed-Chat's
    # (pytorch_model.bin holding body and value head; step 3 checks its keys).
    if kind == "reward" and not any((folder / name).is_file() for name in REWARD_FILES):
        return (f"it has neither {VALUE_HEAD_FILE} (a dschat step-2 output) nor {UPSTREAM_WEIGHTS_FILE} (an "
                "upstream DeepSpeed-Chat step-2 output): not a step-2 reward model")
    return None


#: e2e options a rerun hint never repeats: the hint names its own step and its resolved models,
#: deployment and output folder, and a dry run never fails a step.
_HINT_OWN = {"help", "step", "dry_run", "actor_model", "reward_model", "deployment_type", "output_dir"}


def reproduce_command(args: argparse.Namespace, dep: Deployment, step: int,
                      parser: argparse.ArgumentParser | None = None) -> str:
    """The e2e command that runs step ``step`` alone exactly as this run ran it: ``--step``, the
    step's resolved models (step 1 the actor, step 2 the reward model, step 3 both), the deployment
    and the output folder, then every other option of ``parser`` (default: e2e's) whose value is not
    its default -- read from the parser's actions, so an option added later is repeated too. Parsing
    the command again gives the same step settings (flags, folders, launcher options, --seed)."""
    parser = parser or build_parser()
    cmd = ["python", "e2e_rlhf.py", "--step", str(step)]
    if step in (1, 3):
        cmd += ["--actor-model", args.actor_model]
    if step in (2, 3):
        cmd += ["--reward-model", args.reward_model]
    cmd += ["--deployment-type", dep.name, "--output-dir", str(args.output_dir)]
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        value = getattr(args, action.dest, action.default)
        if action.dest in _HINT_OWN or not action.option_strings or value == action.default:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true
            cmd.append(flag)
        elif isinstance(value, list):  # append
            for item in value:
                cmd += [flag, str(item)]
        else:
            cmd += [flag, str(value)]
    return shlex.join(cmd)


def check_inputs_of_step3(args: argparse.Namespace, dep: Deployment, runs: Sequence[StepRun],
                          steps: Sequence[int] = (1, 2)) -> None:
    """Step 3 starts only if the step-1 actor and the step-2 reward model are there (``steps``: of those
    two, the ones to look at)."""
    for number, kind, what in ((1, "actor", "the step-1 actor"), (2, "reward", "the step-2 reward model")):
        if number not in steps:
            continue
        folder = runs[number - 1].output_dir
        problem = folder_problem(folder, kind)
        if problem:
            raise UserError(
                f"step 3 needs {what} in {folder}, but {problem}; produce it with: "
                f"{reproduce_command(args, dep, number)}"
            )


def output_problem(run_: StepRun) -> str | None:
    """Why ``run_``'s output is not a finished step, or None (final folders are written atomically,
    so a usable folder is a finished one)."""
    if run_.number == 3:
        if "--algorithm" in run_.extra and run_.extra[run_.extra.index("--algorithm") + 1] != "ppo":
            return folder_problem(run_.output_dir / "actor", "actor")  # critic-free: no critic folder
        return folder_problem(run_.output_dir / "actor", "actor") or folder_problem(run_.output_dir / "critic", "reward")
    return folder_problem(run_.output_dir, "reward" if run_.number == 2 else "actor")


def check_inputs(args: argparse.Namespace) -> None:
    """Bad paths fail before any step starts or any folder is created: the output folder, and the
    local model folders the selected steps start from, their tokenizer files included (hub ids and short
    names are the steps' job)."""
    from dschat.models.registry import check_local_model_path

    check_writable_dir(args.output_dir, "--output-dir")
    refuse_foreign_link_on_the_way(args.output_dir, "--output-dir")  # e2e's records and every step's folder
    for name in (STEPS_FILE, TIMINGS_FILE):  # e2e's records, replaced as each step starts and ends
        path = Path(args.output_dir) / name
        if path.exists() and not path.is_file():
            raise UserError(f"--output-dir: {path} is not a file, and e2e keeps its records there; move it away "
                            "or pass another --output-dir")
    for step, flag, model in ((1, "--actor-model", args.actor_model), (2, "--reward-model", args.reward_model)):
        if step in args.step:
            try:
                check_local_model_path(model_id(model))
                if Path(model).expanduser().is_dir():  # found by step 2 after step 1 trained, else
                    from dschat.models.tokenizer import check_tokenizer_files  # lazy: torch

                    check_tokenizer_files(str(Path(model).expanduser()))
            except UserError as err:
                raise UserError(f"{flag}: {err}") from None


def check_output_of(run_: StepRun) -> None:
    kind = {1: "actor", 2: "reward"}.get(run_.number)
    folder = run_.output_dir / "actor" if run_.number == 3 else run_.output_dir
    problem = folder_problem(folder, kind or "actor")
    if problem:
        raise UserError(
            f"step {run_.number} exited successfully but its model folder {folder} is not usable ({problem}); "
            f"see {run_.output_dir / 'training.log'}"
        )


# -------------------------------------------------------------------------------------------------
# Timing
# -------------------------------------------------------------------------------------------------
def hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def load_timings(out: Path) -> dict[str, float]:
    """The seconds each step took, from ``out``'s timings file; ``{}`` for a file missing or damaged (it
    only feeds the estimates and the report, and is written again as steps finish)."""
    try:
        data = json.loads((out / TIMINGS_FILE).read_text(encoding="utf-8"))
        return {str(k): float(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        return {}


def write_json(path: Path, data: object) -> None:
    """``data`` as indented JSON in ``path``, written atomically."""
    from dschat.runtime.fs import atomic_file

    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def save_timings(out: Path, timings: dict[str, float]) -> None:
    write_json(out / TIMINGS_FILE, timings)


# -------------------------------------------------------------------------------------------------
# The flags each step was trained with (--resume)
# -------------------------------------------------------------------------------------------------
OUTPUT_DIR_TOKEN = "<output-dir>"  # --output-dir in a recorded flag: a moved output folder still matches


def step_flags(run_: StepRun, out: Path) -> list[str]:
    """The flags e2e gives ``run_``'s main.py, less those that change no trained weight (``--resume``,
    ``--save_interval``, ``--save_format``), with ``out`` (e2e's --output-dir) written as
    :data:`OUTPUT_DIR_TOKEN`."""
    prefix = str(out)
    kept = [token for name, group in split_flag_groups(run_.recipe.render(run_.params, run_.extra))
            if name != "save_format" for token in group]
    return [OUTPUT_DIR_TOKEN + token[len(prefix):] if token == prefix or token.startswith(prefix + os.sep) else token
            for token in kept]


def step_key(run_: StepRun, out: Path) -> str:
    """A step's entry in :data:`STEPS_FILE`: its model folder under ``out`` (one per model label)."""
    return os.path.relpath(run_.output_dir, out)


def load_step_records(out: Path) -> dict[str, dict[str, Any]]:
    """{model folder: {"flags": [...], "finished": bool}} of the steps e2e started in ``out``; {} when
    there is no readable file. An entry that is not such a record counts as none."""
    try:
        data = json.loads((out / STEPS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep
        return {}
    records = {}
    for key, record in (data.items() if isinstance(data, dict) else ()):
        try:
            flags = record["flags"]
            if isinstance(record["finished"], bool) and all(isinstance(t, str) for t in flags):
                split_flag_groups(flags)
                records[str(key)] = {"flags": list(flags), "finished": record["finished"]}
        except (TypeError, KeyError, UserError):
            continue
    return records


def write_step_records(out: Path, records: dict[str, dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / STEPS_FILE, records)


def save_step_record(out: Path, run_: StepRun, finished: bool) -> None:
    """Record that ``run_`` started (``finished`` False: before it runs) or finished, with its flags."""
    records = load_step_records(out)
    records[step_key(run_, out)] = {"flags": step_flags(run_, out), "finished": finished}
    write_step_records(out, records)


def undo_step_record(out: Path, run_: StepRun, before: dict[str, Any] | None, out_existed: bool) -> None:
    """A step that refused its input changed nothing: its record goes back to ``before`` (None: none),
    and ``out`` goes again when this run made it for that record alone (and it is empty)."""
    records = load_step_records(out)
    if before is None:
        records.pop(step_key(run_, out), None)
    else:
        records[step_key(run_, out)] = before
    if records:
        write_step_records(out, records)
        return
    (out / STEPS_FILE).unlink(missing_ok=True)  # it held this step's record alone
    if not out_existed:
        with contextlib.suppress(OSError):
            out.rmdir()


def flags_difference(before: Sequence[str], now: Sequence[str]) -> str | None:
    """The first flag whose values differ between two flag lists (a repeated flag: all its values, in
    order), as "--name: then X, now Y"; None when they are the same flags."""
    def values(tokens: Sequence[str]) -> dict[str, list[list[str]]]:
        found: dict[str, list[list[str]]] = {}
        for name, group in split_flag_groups(tokens):
            found.setdefault(name, []).append([t for token in group for t in token.split("=", 1)][1:])
        return found

    def shown(groups: list[list[str]] | None) -> str:
        return "not given" if groups is None else " / ".join(shlex.join(g) or "set" for g in groups)

    then, current = values(before), values(now)
    for name in dict.fromkeys([*then, *current]):
        if then.get(name) != current.get(name):
            return f"--{name}: then {shown(then.get(name))}, now {shown(current.get(name))}"
    return None


def earlier_checkpoints(run_: StepRun) -> Path | None:
    """``run_``'s ``checkpoints/`` folder when it holds checkpoints of an earlier run, which the step
    refuses to start afresh beside (the step's own rule,
    :func:`~dschat.training.rotation.earlier_run_checkpoints`); else None. Nothing is changed."""
    from dschat.training.rotation import earlier_run_checkpoints

    root = run_.output_dir / "checkpoints"
    return root if earlier_run_checkpoints(root) else None


def _delete_first(runs: Sequence[StepRun], always: Path | None = None) -> str:
    """'delete A and B and ' for the checkpoint folders of an earlier run among ``runs`` (``always``:
    named whether it holds any or not), or ''."""
    found = list(dict.fromkeys([*([always] if always else []), *filter(None, map(earlier_checkpoints, runs))]))
    return f"delete {' and '.join(map(str, found))} and " if found else ""


def _refuse_other_flags(run_: StepRun, out: Path, record: dict[str, Any], selected: Sequence[StepRun],
                        state: str) -> None:
    """--resume: one line when ``run_`` was started (``record``) with other flags than this run's, naming
    the difference; nothing is changed. ``state`` says what became of that run: ``"finished"`` (its
    model would be taken as this run's), or ``"did not finish"`` / ``"its model is gone"`` (its
    checkpoints would finish a model trained partly with each set, recorded as this run's)."""
    difference = flags_difference(record["flags"], step_flags(run_, out))
    if not difference:
        return
    later = [r for r in selected if r.number >= run_.number]  # the steps a fresh run trains again
    steps = " ".join(str(r.number) for r in later)
    if state == "finished":
        raise UserError(
            f"--resume: step {run_.number}'s model in {run_.output_dir} was trained with other flags ({difference}); "
            f"to train it again with these, {_delete_first(later)}run without --resume and with --step {steps} "
            "(it replaces that model), or pass another --output-dir")
    raise UserError(
        f"--resume: step {run_.number} in {run_.output_dir} started with other flags ({difference}) and {state}; "
        f"to start it again with these, {_delete_first(later, run_.output_dir / 'checkpoints')}run without "
        f"--resume and with --step {steps}, or give the old flags")


def finished_step(run_: StepRun, out: Path, records: dict[str, dict[str, Any]], selected: Sequence[StepRun]) -> bool:
    """--resume: whether ``run_`` is finished (its folder holds a usable model) with this run's flags
    (``selected``: the steps this run was asked for, named in the fix with the checkpoints of an
    earlier run that a fresh run of them would refuse).

    A step that e2e started and that did not finish is not (it resumes). A step started or finished
    with other flags is refused in one line (nothing is replaced), and so is one without a model whose
    checkpoints were trained with other flags; one whose flags are not on record (a step run by hand,
    or by an e2e that kept no record) counts as finished, with a note.
    """
    record = records.get(step_key(run_, out))
    if output_problem(run_) is not None:  # no model (yet): the step resumes from its checkpoints, if any
        if record is not None and earlier_checkpoints(run_) is not None:
            _refuse_other_flags(run_, out, record, selected,
                                "its model is gone" if record["finished"] else "did not finish")
        return False
    if record is None:
        print(f"note: step {run_.number}'s flags are not on record in {out / STEPS_FILE} (run by hand or by an "
              f"older e2e); taking the model in {run_.output_dir} as this run's", flush=True)
        return True
    if not record["finished"]:
        _refuse_other_flags(run_, out, record, selected, "did not finish")
        print(f"note: step {run_.number} started in {run_.output_dir} and did not finish; resuming it", flush=True)
        return False
    _refuse_other_flags(run_, out, record, selected, "finished")
    return True


def step_actions(args: argparse.Namespace, selected: Sequence[StepRun], out: Path,
                 records: dict[str, dict[str, Any]]) -> dict[int, str]:
    """What each selected step will do, decided before any runs: ``"fresh"`` (trained from the start),
    ``"resume"`` (--resume: from its newest checkpoint) or ``"skip"`` (--resume: finished with these
    flags, :func:`finished_step`, whose refusals so come before step 1). Step 3 trains on the models
    of steps 1 and 2, so a step 1 or 2 that runs makes it ``"fresh"``; steps 1 and 2 do not depend on
    each other."""
    actions: dict[int, str] = {}
    for run_ in selected:
        if not args.resume or (run_.number == 3 and any(actions.get(n, "skip") != "skip" for n in (1, 2))):
            actions[run_.number] = "fresh"
        else:
            actions[run_.number] = "skip" if finished_step(run_, out, records, selected) else "resume"
    return actions


def check_earlier_checkpoints(args: argparse.Namespace, fresh: Sequence[StepRun]) -> None:
    """The steps of ``fresh`` (to be trained from the start) find no checkpoints of an earlier run in
    their output folders, which each would refuse when it starts; else one :class:`UserError` line,
    before step 1, naming every such folder and what to do."""
    roots = {r.number: root for r in fresh if (root := earlier_checkpoints(r)) is not None}
    if not roots:
        return
    found, numbers = [str(root) for root in roots.values()], [str(number) for number in roots]
    steps = (f"step {numbers[0]} refuses" if len(numbers) == 1
             else f"steps {', '.join(numbers[:-1])} and {numbers[-1]} refuse")
    resume = "" if args.resume else "pass --resume to continue that run, or "
    if args.resume and 3 in roots:
        resume = "step 3 trains afresh on the models of the step 1 or 2 that runs again; "
    raise UserError(f"found checkpoints of an earlier run in {' and '.join(found)}, which {steps} to train afresh "
                    f"beside; {resume}delete {'them' if len(found) > 1 else 'it'} to start over, or pass another "
                    "--output-dir")


def eta_line(runs: Sequence[StepRun], index: int, speed: float = 1.0, extra_seconds: float = 0.0) -> str | None:
    """'estimated 0:03:00 for this step, ~0:12:00 left (done around 14:05)' from the recipes' eta_seconds.

    ``speed`` scales the estimates by how the finished steps of this run compared with theirs
    (1.0 before any step finished); ``extra_seconds`` covers work after the steps (the report).
    """
    this = runs[index].recipe.eta_seconds
    if this is None:
        return None
    left = speed * sum(r.recipe.eta_seconds or 0 for r in runs[index:]) + extra_seconds
    done = (datetime.datetime.now() + datetime.timedelta(seconds=left)).strftime("%H:%M")
    scaled = f" (x{speed:.1f} from the steps so far)" if abs(speed - 1.0) > 0.05 else ""
    return (f"estimated {hms(speed * this)} for this step, ~{hms(left)} until the end{scaled} "
            f"(done around {done})")


# -------------------------------------------------------------------------------------------------
# Main
# -------------------------------------------------------------------------------------------------
def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def build_parser(config: E2EConfig | None = None) -> argparse.ArgumentParser:
    """e2e's options (upstream's, then dschat's additions); ``config`` (default: configs/e2e.yaml)
    names the deployment types and default models in the help."""
    config = config or load_e2e_config()
    parser = argparse.ArgumentParser(
        description="Run steps 1-3 of DeepSpeed-Chat (SFT, reward model, PPO) with the recipes in configs/.",
        epilog="Models: upstream's OPT sizes (actor 1.3b, 6.7b, 13b, 66b; reward 350m; other OPT sizes map to "
               "facebook/opt-<size>), any Hugging Face id, a local folder, or a dschat short name "
               "(smollm2-135m, tiny-llama, tiny-opt). See configs/e2e.yaml and docs/launching.md.",
    )
    parser.add_argument("--step", type=int, nargs="+", choices=(1, 2, 3), default=(1, 2, 3),
                        help="Which steps of the ChatGPT example to run")
    parser.add_argument("--actor-model", type=strip_opt, default=None,
                        help="Actor (step 1) model: an OPT size, a hub id, a folder or a short name "
                             f"(default: {config.default_actor}; on CPU: smollm2-135m)")
    parser.add_argument("--reward-model", type=strip_opt, default=None,
                        help="Reward (step 2) model, same forms "
                             f"(default: {config.default_reward}; on CPU: smollm2-135m)")
    parser.add_argument("--actor-zero-stage", type=str, default="", choices=("", "0", "1", "2", "3"),
                        help="ZeRO stage for step 1 (Actor) training (and the actor in step 3)")
    parser.add_argument("--reward-zero-stage", type=str, default="", choices=("", "0", "1", "2", "3"),
                        help="ZeRO stage for step 2 (Critic) training (and the critic in step 3)")
    parser.add_argument("--output-dir", type=lambda x: os.path.abspath(x), default="./output",
                        help="Directory for output of each step")
    parser.add_argument("--deployment-type", type=str, default=None, metavar="{" + ",".join(config.choices()) + "}",
                        help="single_gpu, single_node (singlenode), multi_node (multinode: deepspeed launcher "
                             "with a hostfile) or cpu (default: single_gpu with a GPU, cpu without)")
    dschat = parser.add_argument_group("dschat additions")
    launch = parser.add_argument_group("launcher (dschat additions; passed to the deepspeed launcher of every step)")
    launch.add_argument("--hostfile", default=None, help="deepspeed hostfile for multi_node (default: /job/hostfile)")
    launch.add_argument("--num-gpus", "--num_gpus", dest="num_gpus", type=int, default=None,
                        help="override the recipes' deepspeed --num_gpus (GPUs per node)")
    launch.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=None,
                        help="deepspeed --num_nodes: the first N hosts of the hostfile")
    launch.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                        help="deepspeed --master_addr: an address of the first host that the others reach (default: "
                             "the launcher asks the first host with `hostname -I`)")
    launch.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                        help="deepspeed --master_port (default: a free port on one node; on several nodes the "
                             "recipe's port or 29500, which must be free on the first host)")
    dschat.add_argument("--seed", type=int, default=None, help="pass --seed to every step (and the report)")
    dschat.add_argument("--report", choices=("auto", "always", "never"), default="auto",
                        help="evaluate after step 3 (auto: when step 3 trained on dschat/builtin)")
    dschat.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    dschat.add_argument("--resume", action="store_true",
                        help="continue an interrupted run: skip the steps whose model folders are complete (a "
                             "finished step trained with other flags is refused), resume the unfinished ones from "
                             "their newest checkpoints (step 3 runs afresh after a step 1 or 2 that ran)")
    dschat.add_argument("--save-format", choices=SAVE_FORMATS, default=None,
                        help="pass --save_format to every step: the weight files of each step's model, safetensors "
                             "(the steps' default), bin (upstream's pytorch_model.bin layout) or both")
    dschat.add_argument("--save-interval", type=int, default=None, metavar="N",
                        help="pass --save_interval N to every step: a resumable checkpoint every N optimizer "
                             "steps (step 3: PPO iterations)")
    dschat.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default=None,
                        help="step 3's algorithm (default: the recipe's, PPO); grpo, rloo, reinforce_pp and remax "
                             "train no critic (docs/algorithms.md)")
    dschat.add_argument("--num-generations", type=int, default=None, metavar="K",
                        help=f"answers per prompt in step 3 (default {DEFAULT_NUM_GENERATIONS} for grpo and rloo, "
                             "else 1); must divide the recipe's per_device_generation_batch_size")
    dschat.add_argument("--reward-fn", action="append", default=None, metavar="MODULE:FUNCTION",
                        help="pass --reward_fn to step 3 (repeatable); it then replaces the reward model. "
                             f"{GOLD_REWARD_FN} is the RLVR demo: step 3 optimises the judge that grades it")
    dschat.add_argument("--env", default=None, metavar="MODULE:FACTORY",
                        help="pass --env to step 3: it plays multi-turn episodes with this environment "
                             "(docs/environments.md); the recipe's data must hold the columns the environment reads")
    dschat.add_argument("--max-turns", type=int, default=None, metavar="N",
                        help="pass --max_turns N to step 3 (with --env): the most actor turns per episode "
                             "(default: step 3's, 4)")
    dschat.add_argument("--env-timeout", type=float, default=None, metavar="SECONDS",
                        help="pass --env_timeout to step 3 (with --env): the longest one factory or step call may "
                             "take (default: step 3's, 600; 0: no limit)")
    dschat.add_argument("--preflight", choices=("on", "off"), default="on",
                        help="plan every step's memory before step 1 (docs/memory-plan.md): on a GPU a step that "
                             "cannot fit stops e2e in one line with the first fix; on the CPU one line per step, "
                             "not enforced; off: skip")
    return parser


def parse_args(argv: Sequence[str] | None, config: E2EConfig) -> argparse.Namespace:
    """The checked e2e options of ``argv``; a bad combination is one :class:`UserError` line."""
    args = build_parser(config).parse_args(argv)
    if args.actor_zero_stage != "" or args.reward_zero_stage != "":
        warnings.warn("Non-default zero stages may result in OOM errors or worse performance.", stacklevel=1)
    args.step = sorted(set(args.step))
    for flag, value in (("--save-interval", args.save_interval), ("--num-gpus", args.num_gpus),
                        ("--num-nodes", args.num_nodes), ("--num-generations", args.num_generations)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    check_environment_options(args)
    return args


def _launch_world(launch_argv: Sequence[str]) -> int:
    """Ranks a step's launch runs on one node: its ``--num_gpus``, else the GPUs its ``--include
    localhost:<ids>`` names (what ``--num_gpus`` under ``CUDA_VISIBLE_DEVICES`` becomes), else every
    visible GPU, else 1."""
    num_gpus = flag_value(launch_argv, "num_gpus")
    if num_gpus is not None:
        return int(num_gpus)
    include = flag_value(launch_argv, "include")
    if include and include.startswith("localhost:") and "@" not in include:
        return len(include.split(":", 1)[1].split(","))
    import torch  # lazy: only when the steps are planned

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def step_flags_checked(args: argparse.Namespace, runs: Sequence[StepRun],
                       selected: Sequence[StepRun]) -> list[tuple[StepRun, list[str]]]:
    """Each selected step with the flags it will run with (step 3's model flags name the base
    models where steps 1 and 2 have not written their folders yet, which the plan reads), checked as
    the step checks them (:func:`~dschat.plan.cli.check_flag_values`, no file read): flags a step
    refuses are one :class:`UserError` line naming the step, before anything is written."""
    from dschat.plan.cli import build_parser as plan_parser, check_flag_values  # lazy: torch (seconds)

    checked = []
    for run_ in selected:
        flags = run_.recipe.render(run_.params, run_.extra)
        if run_.number == 3:
            for flag, base, done in (("--actor_model_name_or_path", args.actor_model, runs[0].output_dir),
                                     ("--critic_model_name_or_path", args.reward_model, runs[1].output_dir)):
                if flag in flags and not (done / "config.json").is_file():
                    flags[flags.index(flag) + 1] = model_id(base)
        parsed = plan_parser(run_.number).parse_args(flags)
        if run_.number == 3:
            check_num_generations(args, run_, parsed)
        try:
            check_flag_values(parsed)
        except UserError as err:
            raise UserError(f"step {run_.number} refuses its flags: {first_line(err)}") from None
        checked.append((run_, flags))
    return checked


def check_num_generations(args: argparse.Namespace, run_: StepRun, parsed: argparse.Namespace) -> None:
    """Step 3's answers per prompt (e2e's --num-generations, or its default for grpo and rloo) divide
    the recipe's --per_device_generation_batch_size, which e2e cannot change; else one
    :class:`UserError` line naming the --num-generations values that do."""
    k, batch = parsed.num_generations, parsed.per_device_generation_batch_size
    if not (isinstance(k, int) and isinstance(batch, int)) or k < 1 or batch % k == 0:
        return
    given = (f"--num-generations {k}" if args.num_generations is not None
             else f"--algorithm {args.algorithm} answers {k} times per prompt by default (--num-generations), and {k}")
    fits = [str(d) for d in range(2, batch + 1) if batch % d == 0]
    if not fits:  # a batch of 1 holds no group of two or more
        raise UserError(f"{given} does not divide step 3's --per_device_generation_batch_size {batch} (recipe "
                        f"{run_.recipe.id}), which holds no group of answers: pass --algorithm ppo, or use a "
                        "recipe with a larger generation batch")
    raise UserError(f"{given} does not divide step 3's --per_device_generation_batch_size {batch} (recipe "
                    f"{run_.recipe.id}); pass --num-generations {' or '.join(fits[:4])}")


def preflight_steps(args: argparse.Namespace, dep: Deployment, checked: Sequence[tuple[StepRun, list[str]]],
                    launcher: dict[str, object]) -> None:
    """Plan every step of ``checked`` (:func:`step_flags_checked`) before step 1
    (docs/memory-plan.md). On a GPU a step that cannot fit is one :class:`UserError` line; on the
    CPU one line per step. Step 3 is planned with the engines its flags build (no critic for a
    critic-free algorithm, no reward model for a reward given without it). Multi-node runs are not
    planned here."""
    if args.preflight == "off" or args.dry_run:
        return
    if dep.name == "multi_node":
        print("note: e2e's memory preflight plans one node; each step's own checks run on the nodes", flush=True)
        return
    from dschat.plan.preflight import device_memory, preflight  # lazy: torch and DeepSpeed (seconds)

    accelerator, gpu_bytes = device_memory()
    for run_, flags in checked:
        launch = plan(run_.recipe, run_.params, run_.extra, launcher_overrides=launcher, repo_root=ROOT,
                      require_main=False)
        world = _launch_world(launch.argv)
        preflight(flags, world=world, gpus_per_node=world, accelerator=accelerator, gpu_bytes=gpu_bytes,
                  echo=lambda line: print(line, flush=True), step=run_.number, table=False,
                  skip_hint="e2e's --preflight off skips this check",
                  refusal_prefix=f"step {run_.number} refuses its flags: ")


def pick_deployment(args: argparse.Namespace, config: E2EConfig) -> Deployment:
    """The deployment type; without a GPU and without --deployment-type, the CPU demo (said once)."""
    has_gpu = gpu_available()
    if args.deployment_type is None:
        if has_gpu or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
            return config.deployment(config.default_deployment)
        dep = config.deployment("cpu")
        actor = f"--actor-model {args.actor_model}" if args.actor_model else f"the embedded {dep.default_actor}"
        print(f"No GPU found: running the CPU demo (--deployment-type cpu) with {actor} and the dschat/builtin "
              "data; pass --deployment-type to choose.", flush=True)
        return dep
    dep = config.deployment(args.deployment_type)
    if dep.name != "cpu" and not has_gpu and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu" and not args.dry_run:
        raise UserError(f"--deployment-type {dep.name} needs a CUDA GPU and none is visible; "
                        "use --deployment-type cpu (or run on a GPU machine)")
    return dep


def fail_step(run_: StepRun, result: LaunchResult, command: str, e2e_cmd: str) -> int:
    """Print why a step failed (with memory advice for an OOM) and return the exit code to use."""
    recipe = f"Recipe: {run_.recipe.step.key} {run_.recipe.id} in {run_.recipe.source}"
    if result.refused:  # exit 2 before it started up: its one-line error is above, and it kept no log
        print("\n".join([f"Step {run_.number} refused its input (exit status {EXIT_USAGE}; its error line is "
                         "above) and wrote nothing", f"Launch command: {command}", recipe]), file=sys.stderr, flush=True)
        return EXIT_USAGE
    lines = [
        f"Step {run_.number} exited with non-zero status {result.returncode}",
        f"Launch command: {command}",
        f"Log output: {result.log_path or run_.output_dir / 'training.log'}",
        recipe,
    ]
    if result.oom:
        cpu = run_.recipe.env.get("DS_ACCELERATOR") == "cpu"
        lines += [f"It looks like the step ran out of memory ({result.oom}).", oom_advice(run_.recipe.step, cpu=cpu, e2e=True)]
    else:
        lines.append(f"To rerun only this step: {e2e_cmd}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return result.returncode or 1


def should_report(args: argparse.Namespace, runs: Sequence[StepRun]) -> bool:
    if 3 not in args.step or args.report == "never":
        return False
    if args.report == "always":
        return True
    data = runs[2].recipe.flag("data_path")
    values = data if isinstance(data, tuple) else (data,)
    return "dschat/builtin" in values


def run_report(args: argparse.Namespace, runs: Sequence[StepRun], config: E2EConfig, timings: dict[str, float],
               start: float) -> None:
    from dschat.eval.report import EvalSettings, build_report, summary_text

    step3 = runs[2].recipe
    rep = config.report

    def flag(name: str, default: str) -> str:
        value = step3.flag(name)
        return value if isinstance(value, str) else default

    settings = EvalSettings(
        max_prompts=rep.max_prompts, max_pairs=rep.max_pairs, batch_size=rep.batch_size,
        generation_batch_size=rep.generation_batch_size,
        # The same answer budget and decoding the PPO rollouts used.
        max_new_tokens=int(flag("max_answer_seq_len", "256")),
        max_seq_len=int(runs[1].recipe.flag("max_seq_len") or 512),
        seed=args.seed if args.seed is not None else rep.seed,
        do_sample=flag("decoding", "sample") == "sample",
        temperature=float(flag("temperature", "1.0")),
        top_k=int(flag("top_k", "0")),
        top_p=float(flag("top_p", "1.0")),
    )
    print("---=== Evaluating: SFT actor vs RLHF actor on held-out prompts ===---", flush=True)
    if GOLD_REWARD_FN in (args.reward_fn or []):
        print(f"note: RLVR demo -- step 3 was trained on the gold judge itself (--reward-fn {GOLD_REWARD_FN}); the "
              "gold gain below is how well it optimised its own reward, not an independent judgement", flush=True)
    report = build_report(
        runs[0].output_dir, runs[2].output_dir / "actor", runs[1].output_dir, args.output_dir, settings,
        metrics=runs[2].output_dir / "metrics.jsonl", step_seconds=timings, run_started=start,
        log=lambda m: print(m, flush=True),
    )
    print(summary_text(report), flush=True)


@releasing_run_locks  # --output-dir is free again when main ends, in-process too
def main(argv: Sequence[str] | None = None) -> int:
    start = time.monotonic()
    config = load_e2e_config()
    args = parse_args(argv, config)
    dep = pick_deployment(args, config)
    if args.actor_model is None:
        args.actor_model = dep.default_actor or config.default_actor
    if args.reward_model is None:
        args.reward_model = dep.default_reward or config.default_reward
    check_environment_spec(args, dep)
    check_inputs(args)
    runs = build_steps(args, dep)
    launcher = {"hostfile": args.hostfile, "num_gpus": args.num_gpus, "num_nodes": args.num_nodes,
                "master_addr": args.master_addr, "master_port": args.master_port}
    if args.hostfile and dep.name != "multi_node":
        print(f"note: --hostfile is used with --deployment-type {dep.name} too (deepspeed reads it)", flush=True)
    if args.hostfile and not Path(args.hostfile).is_file():
        problem = "is not a file" if Path(args.hostfile).exists() else "does not exist"
        raise UserError(f"--hostfile {args.hostfile} {problem}; write one line per host: '<host> slots=<gpus>'")
    if dep.name == "multi_node" and not args.hostfile and not Path(DEFAULT_HOSTFILE).is_file():
        print(f"note: no --hostfile and no {DEFAULT_HOSTFILE}: the deepspeed launcher will use this machine only",
              flush=True)
    out = Path(args.output_dir)
    selected = [r for r in runs if r.number in args.step]
    checked = step_flags_checked(args, runs, selected)  # before the lock makes --output-dir
    if not args.dry_run:  # one e2e run per --output-dir: a second would retrain and replace the first's models
        hold_run_lock(out, args, "--output-dir")
    timings = load_timings(out)
    records = load_step_records(out)
    actions = step_actions(args, selected, out, records)
    check_earlier_checkpoints(args, [r for r in selected if actions[r.number] == "fresh"])
    if actions.get(3, "skip") != "skip" and not args.dry_run:  # what it needs of steps this run does not train
        check_inputs_of_step3(args, dep, runs, [n for n in (1, 2) if actions.get(n, "skip") == "skip"])
    report_eta = config.report.eta_seconds if should_report(args, runs) else 0.0
    spent = estimated = 0.0  # this run's finished steps: actual and estimated seconds

    preflight_steps(args, dep, checked, launcher)
    save = ["--save_interval", str(args.save_interval)] if args.save_interval else []
    for index, run_ in enumerate(selected):
        if actions[run_.number] == "skip":
            print(f"---=== Step {run_.number} is complete in {run_.output_dir}; skipping it (--resume) ===---",
                  flush=True)
            continue
        # --resume: the newest checkpoint in its output folder, or from scratch with a notice
        resume = ["--resume"] if actions[run_.number] == "resume" else []
        print(f"---=== Running Step {run_.number} ===---", flush=True)
        if run_.note:
            print(f"note: {run_.note}", flush=True)
        if run_.number == 3 and not args.dry_run:
            check_inputs_of_step3(args, dep, runs)
        launch = plan(run_.recipe, run_.params, run_.extra + save + resume, launcher_overrides=launcher,
                      repo_root=ROOT, require_main=not args.dry_run)
        print(f"Step {run_.number} of {selected[-1].number}: {run_.recipe.step.title}, recipe {run_.recipe.id} "
              f"({run_.recipe.source}); output {run_.output_dir}", flush=True)
        speed = spent / estimated if estimated else 1.0  # this run's pace against the recipes' so far
        eta = eta_line(selected, index, speed, report_eta)
        if eta:
            print(eta, flush=True)
        if args.dry_run:
            env = " ".join(f"{k}={v}" for k, v in launch.env.items() if k != "PYTHONUNBUFFERED")
            print((env + " " if env else "") + launch.command_line(), flush=True)
            continue
        step_start = time.monotonic()
        out_existed, before = out.exists(), load_step_records(out).get(step_key(run_, out))
        save_step_record(out, run_, finished=False)  # its folder is this run's only once it finishes
        result = run(launch)
        if result.refused:
            undo_step_record(out, run_, before, out_existed)
        if result.returncode != 0:
            return fail_step(run_, result, launch.command_line(), reproduce_command(args, dep, run_.number))
        check_output_of(run_)
        seconds = time.monotonic() - step_start
        if run_.recipe.eta_seconds:
            spent, estimated = spent + seconds, estimated + run_.recipe.eta_seconds
        timings[str(run_.number)] = seconds
        save_timings(out, timings)
        save_step_record(out, run_, finished=True)
        # the estimate printed before the step (the recipe's, scaled by the pace of the steps before it)
        estimate = f" (estimated {hms(speed * run_.recipe.eta_seconds)})" if run_.recipe.eta_seconds else ""
        print(f"---=== Finished Step {run_.number} in {hms(seconds)} ===---{estimate}", flush=True)

    if len(args.step) > 1 and not args.dry_run:
        print(f"---=== Finished Steps {args.step} in {hms(time.monotonic() - start)} ===---", flush=True)
    if not args.dry_run:
        if should_report(args, runs):
            run_report(args, runs, config, timings, start)
        elif 3 in args.step:
            print("Evaluate the result with: " + shlex.join([
                "python", "-m", "dschat.eval.report", "--sft", str(runs[0].output_dir),
                "--rlhf", str(runs[2].output_dir / "actor"), "--reward", str(runs[1].output_dir),
                "--out", str(out)]) + "   (the gold judge knows only the dschat/builtin task)", flush=True)
        if 3 in args.step:
            print(f"Chat with the RLHF actor: python chat.py --path {runs[2].output_dir / 'actor'}", flush=True)
    return 0


def _entry(argv: Sequence[str] | None = None) -> int:
    code = [0]

    def wrapped(a: Sequence[str] | None) -> None:
        code[0] = main(a)

    usage = cli_main(wrapped, argv)
    return usage if usage else code[0]


if __name__ == "__main__":
    raise SystemExit(_entry())
