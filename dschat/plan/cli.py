"""``python -m dschat.plan``: does step 3 (or 1, or 2) fit, what takes the memory, and which
configuration fits.

It takes the planned step's own flags (``--step 3``, the default; ``--step 1`` SFT, ``--step 2`` the
reward model: :mod:`dschat.plan.training_steps`) plus the planner's (:func:`add_plan_args`) and
reads the models' ``config.json`` (step 3 also the actor's and the critic folder's tokenizer files,
to plan the critic the run builds: :func:`~dschat.plan.roles.critic_source`). Model-state bytes are
exact (tests/plan/test_exactness.py); the phases' activations, logits and caches are an estimate
(:mod:`dschat.plan.phases`). Output: a table (``notes`` first), or with ``--json`` an object with
``fits`` (``gpu_fits`` and ``host_fits`` give each reason), ``peak_bytes_per_gpu``, ``phases``,
``suggestions``, ``host_bytes_at_load``, ``notes`` and (step 3) ``critic_from_actor``. Sizes take a
unit (``80GB``; a bare number is refused).

The planned step's own flag checks run first (step 3's :func:`~dschat.rlhf.guards.validate_step3_args`,
:func:`~dschat.rlhf.config.resolve_algorithm` and :func:`~dschat.rlhf.config.plan_batches`, steps 1-2's
:func:`~dschat.training.run_setup.check_common_args` without its path checks): flags the step refuses
are the planner's :class:`UserError` too, and the search skips them, and so is a tensor-parallel
group step 3 refuses at start-up (:func:`check_tp_within_node`). Step 3 plans the engines the
run builds (:func:`~dschat.plan.roles.planned_roles`: no critic for a critic-free algorithm, no
reward model when the reward mix does not load it).

Suggestions, when the run does not fit: every combination of ZeRO stage per model (2, 3), optimizer
offload, LoRA (the actor's, or steps 1-2's model: rank 128, LoRA only), gradient checkpointing,
halved batch sizes and (step 3) one generation change that fits, then more GPUs; listed fastest
first by a fixed cost order (each change's rough slowdown: offload 4, a ZeRO-3 model 2, gradient
checkpointing 1, LoRA 0, each halving of a batch 1; generation: ``--release_inference_cache`` 1 (the
Hybrid Engine's copy and cache allocated again each rollout), ``--inference_tp_size 2`` 2 and ``4`` 3
(an all-reduce per layer and token, an eager decode step), ``--zero3_gather_for_generation off`` 4
(the ZeRO-3 actor fetched layer by layer for every token, without the Hybrid Engine)). The
generation changes are tried only where they apply: the Hybrid Engine's with
``--enable_hybrid_engine``, a tensor-parallel degree where it divides the GPUs per node (so the
world size, and no group spans nodes) and the actor's heads (``check_inference_tp``), the gather where
the actor is ZeRO-3 (after the ZeRO change); a generation change that leaves the candidate's plan as
it is without it (:func:`_inert`: ``--release_inference_cache`` where the Hybrid Engine does not
decode) is left out. A candidate whose flags come to the same configuration as the run's own, or as
a cheaper candidate already found, is left out.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import re
import sys
from typing import Sequence

from dschat.cli.shared import add_step1_args
from dschat.cli.step2 import add_step2_args
from dschat.cli.step3 import add_step3_args
from dschat.errors import UserError, cli_main
from dschat.plan.model_state import DTYPE_BYTES
from dschat.plan.phases import host_bytes_at_load, phases
from dschat.plan.roles import critic_source, model_config, plan_roles, planned_roles
from dschat.plan.training_steps import plan_step_engine, step_phases
from dschat.rlhf.config import plan_batches, resolve_algorithm
from dschat.rlhf.guards import validate_step3_args
from dschat.rlhf.rollout.tensor_parallel import check_inference_tp
from dschat.training.run_setup import check_common_args
from dschat.models.registry import check_sft_seq_len
from dschat.training.step_data import check_pair_seq_len, check_seq_len_fits_positions

__all__ = ["add_plan_args", "build_parser", "check_flag_values", "check_tp_within_node", "format_gb", "parse_size",
           "plan", "planned_step", "main", "MARGIN"]

MARGIN = 0.10  # a plan fits when its peak leaves this share of the GPU free (allocator fragmentation)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, flag: str) -> int:
    """``"80GB"`` / ``"40GiB"`` / ``"512MB"`` / ``"512B"`` -> bytes (> 0); anything else is a
    :class:`UserError`: a number without a unit (``"80"``: bytes or gigabytes?) names the fix, and
    a size of no bytes (``"0"`` in any unit, or less than a byte) says it must be more than 0."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if match and not match.group(2) and float(match.group(1)) > 0:
        raise UserError(f"{flag} {text!r} has no unit: give a unit, like {match.group(1)}GB or {match.group(1)}GiB")
    if not match or match.group(2).upper() not in _UNITS | {"": 1}:
        raise UserError(f"{flag} {text!r} is not a memory size; write it like 80GB, 40GiB or 512MB")
    size = float(match.group(1)) * _UNITS.get(match.group(2).upper(), 1)
    if not math.isfinite(size):
        raise UserError(f"{flag} {text!r} is too large to be a memory size; write it like 80GB, 40GiB or 512MB")
    size = int(size)
    if size <= 0:
        raise UserError(f"{flag} must be more than 0 bytes, got {text!r}; write the memory like 80GB, 40GiB or 512MB")
    return size


def add_plan_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The planner's own flags (ours): the machine it plans for, and the output format."""
    group = parser.add_argument_group("Memory plan")
    group.add_argument("--step", type=int, default=3, choices=(1, 2, 3),
                       help="The step to plan, with that step's own flags: 3 (RLHF with PPO, default), 1 (SFT), "
                            "2 (reward model) (ours).")
    group.add_argument("--gpu_memory", type=str, default="80GB",
                       help="Memory of one GPU, like 80GB, 40GiB (ours).")
    group.add_argument("--gpus_per_node", type=int, default=8, help="GPUs per node (ours).")
    group.add_argument("--num_nodes", type=int, default=1, help="Number of nodes (ours).")
    group.add_argument("--host_memory", type=str, default=None,
                       help="Host memory of one node, like 1TB; checked at load time when given (ours).")
    group.add_argument("--json", action="store_true", help="Print the plan as JSON (ours).")
    return group


_STEP_ARGS = {1: add_step1_args, 2: add_step2_args, 3: add_step3_args}
_STEP_NAMES = {1: "step 1 (SFT)", 2: "step 2 (reward model)", 3: "step 3 (RLHF with PPO)"}


def build_parser(step: int = 3) -> argparse.ArgumentParser:
    """Step ``step``'s flags (:func:`~dschat.cli.step3.add_step3_args` and steps 1-2's) and the planner's."""
    parser = argparse.ArgumentParser(prog="python -m dschat.plan",
                                     description=f"Memory plan of {_STEP_NAMES[step]} per GPU and host")
    _STEP_ARGS[step](parser)
    add_plan_args(parser)
    parser.set_defaults(step=step)
    return parser


def planned_step(argv: Sequence[str]) -> int:
    """The ``--step`` of ``argv`` (3 without one); an unknown one is the full parser's error."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--step", type=int, default=3, choices=(1, 2, 3))
    return probe.parse_known_args(list(argv))[0].step


def _batch_flags(step: int) -> tuple[str, ...]:
    return (("per_device_generation_batch_size", "per_device_training_batch_size") if step == 3
            else ("per_device_train_batch_size",))


def _check_args(args: argparse.Namespace) -> None:
    for flag in ("gpus_per_node", "num_nodes", *_batch_flags(args.step)):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} must be at least 1, got {getattr(args, flag)}")


def check_flag_values(args: argparse.Namespace) -> None:
    """The planned step's checks of its flags alone, no file read (a :class:`UserError` where the
    step refuses its flags): step 3's :func:`validate_step3_args` on a CUDA GPU in ``--dtype`` and
    :func:`resolve_algorithm`; steps 1-2's :func:`check_common_args` on a copy without the output,
    data-cache, TensorBoard and resume paths, whose checks look at (and may tidy) folders on this
    machine; step 2's :func:`check_pair_seq_len` (a pair's 2 positions), step 1's
    :func:`check_sft_seq_len`; step 3's batch plan (:func:`plan_batches`: a generation batch that splits
    into training micro-batches)."""
    if args.step == 3:
        validate_step3_args(args, accelerator="cuda", dtype=args.dtype)
        resolve_algorithm(args)
        plan_batches(args, 1)
        return
    flags_only = copy.copy(args)
    for name, value in (("output_dir", None), ("data_output_path", None), ("enable_tensorboard", False),
                        ("resume", False), ("resume_from", None),
                        ("save_interval", min(0, getattr(args, "save_interval", 0)))):
        setattr(flags_only, name, value)
    check_common_args(flags_only)
    (check_pair_seq_len if args.step == 2 else check_sft_seq_len)(args.max_seq_len)


def check_step_flags(args: argparse.Namespace) -> None:
    """The planned step's own flag checks (a :class:`UserError` where the step refuses its flags):
    :func:`check_flag_values`, then every step's row length against the actor's (steps 1-2: the
    model's) position table (:func:`check_seq_len_fits_positions`)."""
    check_flag_values(args)
    if args.step == 3:
        model_config(args.actor_model_name_or_path)  # a config.json it cannot read: the planner's line first
        check_seq_len_fits_positions(args.actor_model_name_or_path, args.max_prompt_seq_len + args.max_answer_seq_len,
                                     "--max_prompt_seq_len + --max_answer_seq_len")
        return
    model_config(args.model_name_or_path)
    check_seq_len_fits_positions(args.model_name_or_path, args.max_seq_len)


def _check_step3_models(args: argparse.Namespace, roles: Sequence[str]) -> None:
    if ({"critic", "reward"} & set(roles) and args.critic_model_name_or_path is None
            and getattr(args, "reward_model_name_or_path", None) is None):
        needed = "the critic" if "critic" in roles else "the reward model"
        raise UserError(f"--critic_model_name_or_path (or --reward_model_name_or_path) is needed to plan step 3 with "
                        f"{needed}; pass the step-2 output folder")


def check_tp_within_node(size: int, gpus_per_node: int, num_nodes: int) -> None:
    """Step 3's rule for a tensor-parallel group (:func:`dschat.runtime.dist.tensor_parallel_group`):
    groups of ``size`` contiguous ranks, numbered node by node, each within one node; so on more than
    one node ``size`` divides ``gpus_per_node`` (one :class:`UserError` line, in step 3's words)."""
    if size <= 1 or num_nodes <= 1 or gpus_per_node % size == 0:
        return
    start = (gpus_per_node - 1) // size * size  # the group holding the first node's last rank
    raise UserError(f"--inference_tp_size {size}: ranks {start}-{start + size - 1} span nodes 0 and 1 "
                    f"({gpus_per_node} GPUs per node); a tensor-parallel group must sit within one node "
                    f"(its all-reduces run every layer): give each node a multiple of {size} ranks")


def plan(args: argparse.Namespace, *, gpu_bytes: int | None = None, reward_model: bool | None = None,
         critic_from_actor: bool | None = None) -> dict:
    """The plan of ``args`` as a JSON-ready dict (``fits``, ``peak_bytes_per_gpu``, ``phases``, ...);
    ``gpu_bytes`` replaces ``--gpu_memory`` (a GPU's measured size); ``reward_model``: whether step 3
    loads its reward model (None: as its flags say, :func:`~dschat.rewards.reward_model_used`);
    ``critic_from_actor``: whether step 3 builds its critic from the actor with a fresh value head
    (None: decided as step 3 decides it, from the actor's and the critic folder's tokenizers,
    :func:`~dschat.plan.roles.critic_source`, whose lines are the result's ``notes``; step 3 passes
    what it resolved). Flags the step refuses are a :class:`UserError` (:func:`check_step_flags`), and
    so is a tensor-parallel degree step 3 refuses (:func:`check_tp_within_node`)."""
    world = args.gpus_per_node * args.num_nodes
    gpu = parse_size(args.gpu_memory, "--gpu_memory") if gpu_bytes is None else gpu_bytes
    dtype = args.dtype
    step = getattr(args, "step", 3)
    check_step_flags(args)
    notes: tuple[str, ...] = ()
    if step == 3:
        roles = planned_roles(args, reward_model)
        _check_step3_models(args, roles)
        check_inference_tp(args.inference_tp_size, model_config(args.actor_model_name_or_path), world,
                           args.enable_hybrid_engine)
        check_tp_within_node(args.inference_tp_size, args.gpus_per_node, args.num_nodes)
        if critic_from_actor is None:
            critic_from_actor, notes = critic_source(args) if "critic" in roles else (False, ())
        plans = plan_roles(args, world, dtype=dtype, hybrid_engine=args.enable_hybrid_engine,
                           reward_model=reward_model, critic_from_actor=critic_from_actor)
        steps = phases(plans, args, dtype, gpu_bytes=gpu)
    else:
        engine = plan_step_engine(args, world, step=step, dtype=dtype)
        plans = {engine.role: engine}
        steps = step_phases(engine, args, step=step, dtype=dtype)
    peak = max(steps, key=lambda p: p.peak)
    host = host_bytes_at_load(plans, args.gpus_per_node)
    host_limit = parse_size(args.host_memory, "--host_memory") if args.host_memory else None
    gpu_fits = peak.peak <= gpu * (1 - MARGIN)
    host_fits = None if host_limit is None else host <= host_limit
    extra = {"critic_from_actor": bool(critic_from_actor)} if step == 3 else {}
    return {
        "step": step, "notes": list(notes), **extra,
        "fits": gpu_fits and host_fits is not False, "gpu_fits": gpu_fits, "host_fits": host_fits,
        "peak_bytes_per_gpu": peak.peak, "peak_phase": peak.name, "gpu_bytes": gpu,
        "margin_bytes": int(gpu * (1 - MARGIN)) - peak.peak, "world_size": world,
        "host_bytes_at_load": host, "host_bytes": host_limit,
        "model_states": {role: {"numel": p.inventory.numel,
                                "trainable_numel": sum(x.numel for x in p.inventory.trainable),
                                "zero_stage": p.spec.stage, **p.state.counted()} for role, p in plans.items()},
        "phases": [{"name": s.name, "peak_bytes": s.peak, "top": [{"consumer": k, "bytes": v} for k, v in s.top()],
                    "consumers": s.consumers} for s in steps],
    }


_STEP3_CHANGES = {  # flag values -> cost in the documented speed order
    "zero": [((), 0), (("--actor_zero_stage", "3"), 2), (("--critic_zero_stage", "3"), 2),
             (("--actor_zero_stage", "3", "--critic_zero_stage", "3"), 4)],
    "ckpt": [((), 0), (("--actor_gradient_checkpointing", "--critic_gradient_checkpointing"), 1)],
    "lora": [((), 0), (("--actor_lora_dim", "128", "--only_optimize_lora"), 0)],
    "offload": [((), 0), (("--offload",), 4)],
    "generation": [((), 0), (("--release_inference_cache",), 1), (("--inference_tp_size", "2"), 2),
                   (("--inference_tp_size", "4"), 3), (("--zero3_gather_for_generation", "off"), 4)],
}
_STEP12_CHANGES = {  # steps 1-2: the one trained engine
    "zero": [((), 0), (("--zero_stage", "2"), 1), (("--zero_stage", "3"), 2)],
    "ckpt": [((), 0), (("--gradient_checkpointing",), 1)],
    "lora": [((), 0), (("--lora_dim", "128", "--only_optimize_lora"), 0)],
    "offload": [((), 0), (("--offload",), 4)],
}


def _with(argv: Sequence[str], extra: Sequence[str]) -> list[str]:
    return [*argv, *extra]


def _stages(flags: Sequence[str], args: argparse.Namespace, critic: bool = True) -> list[int]:
    """The ZeRO stage of every trained engine with ``flags`` added to ``args``' (step 3: the actor's,
    then the critic's where one is trained, ``critic``)."""
    def stage(flag: str, now: int) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else now

    if args.step == 3:
        return [stage("--actor_zero_stage", args.actor_zero_stage),
                *([stage("--critic_zero_stage", args.critic_zero_stage)] if critic else [])]
    return [stage("--zero_stage", args.zero_stage)]


def _applies(flags: Sequence[str], args: argparse.Namespace) -> bool:
    """Whether a generation change can change ``args``' run, from its flags alone (the module
    docstring's conditions): the gather unless it is off already; the Hybrid Engine's changes only
    with ``--enable_hybrid_engine``; a tensor-parallel degree other than the run's that divides the
    GPUs per node (so the world size, and no group spans nodes: :func:`check_tp_within_node`). Other
    degrees step 3 refuses are the plan's :class:`UserError`, skipped by the search; a change the
    candidate's own configuration makes inert is left out by :func:`_inert`."""
    if not flags:
        return True
    if flags[0] == "--zero3_gather_for_generation":
        return args.zero3_gather_for_generation != "off"
    if not args.enable_hybrid_engine:
        return False
    if flags[0] == "--release_inference_cache":
        return not args.release_inference_cache
    degree = int(flags[1])
    return degree != args.inference_tp_size and args.gpus_per_node % degree == 0


def _inert(result: dict, base: dict | None) -> bool:
    """Whether a generation change planned as ``result`` changes nothing against the same candidate
    without it (``base``; None: one the step refuses): the same model states and phases, e.g.
    ``--release_inference_cache`` where a ZeRO-3 actor is not gathered for generation, so the Hybrid
    Engine does not decode, or ``--zero3_gather_for_generation off`` where ``auto`` does not gather."""
    return base is not None and (base["model_states"], base["phases"]) == (result["model_states"], result["phases"])


def _effective(args: argparse.Namespace) -> tuple:
    """What a parsed command line comes to: every flag's value (two command lines that give the same
    are the same configuration)."""
    return tuple(sorted((name, repr(value)) for name, value in vars(args).items()))


def _without_critic_flags(flags: Sequence[str]) -> list[str]:
    """``flags`` without the critic's (``--critic_zero_stage N``, ``--critic_gradient_checkpointing``): a
    run without critic and reward model (step 3 checks ``--offload``'s stage on the engines it trains)."""
    kept: list[str] = []
    skip = False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--critic_zero_stage":
            skip = True
        elif not flag.startswith("--critic_"):
            kept.append(flag)
    return kept


def suggestions(argv: Sequence[str], args: argparse.Namespace, parser: argparse.ArgumentParser,
                limit: int | None = 5, *, gpu_bytes: int | None = None, reward_model: bool | None = None,
                critic_from_actor: bool | None = None) -> list[dict]:
    """Configurations that fit, fastest first: each ``{"flags": [...], "peak_bytes_per_gpu": n, "cost": c}``;
    none that comes to the configuration of ``args`` or of one listed before it (:func:`_effective`),
    none that the step refuses, none whose generation change changes nothing in its configuration
    (:func:`_inert`). ``critic_from_actor``: as :func:`plan`'s (None: decided once, from the
    tokenizers)."""
    if critic_from_actor is None and args.step == 3 and "critic" in planned_roles(args, reward_model):
        critic_from_actor = critic_source(args)[0]
    results: dict[tuple[str, ...], dict | None] = {}

    def planned(flags: Sequence[str]) -> dict | None:
        """The plan of ``argv`` with ``flags`` added (None: the step refuses them), planned once."""
        key = tuple(flags)
        if key not in results:
            try:
                results[key] = plan(parser.parse_args(_with(argv, flags)), gpu_bytes=gpu_bytes,
                                    reward_model=reward_model, critic_from_actor=bool(critic_from_actor))
            except UserError:  # flags the step refuses, or an option this model cannot take (a LoRA
                results[key] = None  # filter matching none of its layers)
        return results[key]

    found = []
    batches = []
    changes = _STEP3_CHANGES if args.step == 3 else _STEP12_CHANGES
    for halvings in range(0, 4):
        halved = [(f"--{flag}", str(max(1, getattr(args, flag) >> halvings))) for flag in _batch_flags(args.step)]
        batches.append(((tuple(x for pair in halved for x in pair) if halvings else ()), halvings))
    generation = [c for c in changes.get("generation", [((), 0)]) if _applies(c[0], args)]
    # A run that builds neither critic nor reward model: the critic's flags change nothing; one without a
    # critic to train (a critic-free algorithm): its checkpointing and its offload's stage change nothing.
    roles = set(planned_roles(args, reward_model)) if args.step == 3 else set()
    no_critic = args.step == 3 and not {"critic", "reward"} & roles
    trains_critic = args.step != 3 or "critic" in roles
    for choice in itertools.product(changes["zero"], changes["offload"], changes["lora"], changes["ckpt"], batches,
                                    generation):
        flags = [f for part, _ in choice for f in part]
        cost = sum(c for _, c in choice)
        if no_critic:
            flags = _without_critic_flags(flags)
        elif not trains_critic:
            flags = [f for f in flags if f != "--critic_gradient_checkpointing"]
        if not flags or ("--offload" in flags and 0 in _stages(flags, args, trains_critic)):
            continue  # DeepSpeed offloads an optimizer only under ZeRO 1-3 (the steps refuse it at 0)
        if "--zero3_gather_for_generation" in flags and _stages(flags, args)[0] != 3:
            continue  # the gather applies to a ZeRO-3 actor only
        trial = parser.parse_args(_with(argv, flags))
        if _effective(trial) == _effective(args):
            continue  # these flags change nothing
        result = planned(flags)
        if result is None or not result["fits"]:
            continue
        change = choice[-1][0]  # the generation change, the last of the flags
        if change and _inert(result, planned(flags[:len(flags) - len(change)])):
            continue  # it changes nothing here: the candidate without it is the same plan, and cheaper
        found.append({"flags": flags, "peak_bytes_per_gpu": result["peak_bytes_per_gpu"], "cost": cost,
                      "key": _effective(trial)})
    found.sort(key=lambda s: (s["cost"], s["peak_bytes_per_gpu"]))
    seen: set[tuple] = set()
    unique = []
    for s in found:  # the cheapest of the flag sets that come to one configuration
        if s["key"] not in seen:
            seen.add(s.pop("key"))
            unique.append(s)
    found = unique
    if not found:
        for nodes in (2, 4, 8, 16):
            trial = parser.parse_args(_with(argv, ("--num_nodes", str(args.num_nodes * nodes))))
            result = plan(trial, gpu_bytes=gpu_bytes, reward_model=reward_model,
                          critic_from_actor=bool(critic_from_actor))
            if result["fits"]:
                found.append({"flags": ["--num_nodes", str(args.num_nodes * nodes)],
                              "peak_bytes_per_gpu": result["peak_bytes_per_gpu"], "cost": 0})
                break
    return found[:limit]


#: What :func:`render` says when no configuration :func:`suggestions` tried fits the GPU.
NOTHING_FITS = ("nothing tried fits (ZeRO-3, offload, LoRA, gradient checkpointing and smaller batches together; "
                "up to 16 times the nodes with your flags): use GPUs with more memory")


def more_room_only(found: Sequence[dict]) -> list[dict]:
    """Of :func:`suggestions` (fastest first), each with a lower peak than every one before it that
    trains as much (LoRA or the whole model: LoRA changes what is trained, so a whole-model one with a
    higher peak stays): a slower configuration with no more room than a faster one (a ZeRO-3 critic
    on one GPU, a smaller batch where the optimizer step sets the peak) is no reason to take it."""
    kept: list[dict] = []
    lowest: dict[bool, int] = {}
    for s in found:
        lora = "--only_optimize_lora" in s["flags"]
        if lora not in lowest or s["peak_bytes_per_gpu"] < lowest[lora]:
            kept.append(s)
            lowest[lora] = s["peak_bytes_per_gpu"]
    return kept


def format_gb(n: int) -> str:
    """``n`` bytes as decimal gigabytes, two decimals (the table's and the preflight's unit)."""
    return f"{n / 1e9:.2f} GB"


def render(result: dict) -> str:
    """The printed table of :func:`plan`'s result (with ``suggestions``)."""
    lines = [*result.get("notes", []), f"{'phase':<16} {'peak/GPU':>11}  biggest consumers"]
    for phase in result["phases"]:
        top = ", ".join(f"{t['consumer']} {format_gb(t['bytes'])}" for t in phase["top"])
        lines.append(f"{phase['name']:<16} {format_gb(phase['peak_bytes']):>11}  {top}")
    gpu_verdict = "fits" if result["gpu_fits"] else "does NOT fit"
    margin = result["margin_bytes"]
    spare = f"{'margin' if margin >= 0 else 'short by'} {format_gb(abs(margin))}"
    lines.append(f"peak {format_gb(result['peak_bytes_per_gpu'])} in {result['peak_phase']} on a "
                 f"{format_gb(result['gpu_bytes'])} GPU: {gpu_verdict} ({spare} after keeping {MARGIN:.0%} free)")
    host = f"host memory at load time: {format_gb(result['host_bytes_at_load'])} per node"
    if result["host_bytes"]:
        spare = result["host_bytes"] - result["host_bytes_at_load"]
        host += (f" of {format_gb(result['host_bytes'])}: "
                 + (f"fits (margin {format_gb(spare)})" if result["host_fits"]
                    else f"does NOT fit ({format_gb(-spare)} more than the host has)"))
    lines.append(host)
    if not result["fits"] and result["gpu_fits"]:
        lines.append("the run does NOT fit: the host memory at load time is the reason, not the GPU")
    lines.append("model states are exact; activations, logits and caches are estimates")
    for s in result.get("suggestions", []):
        lines.append(f"fits with: {' '.join(s['flags'])}  (peak {format_gb(s['peak_bytes_per_gpu'])})")
    if not result["fits"] and result["gpu_fits"] is False and not result.get("suggestions"):
        lines.append(NOTHING_FITS)
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> dict:
    """Parse, plan, search when it does not fit, print; returns the result."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(planned_step(argv))
    args = parser.parse_args(argv)
    _check_args(args)
    if args.dtype not in DTYPE_BYTES:
        raise UserError(f"unknown --dtype {args.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    result = plan(args)
    result["suggestions"] = [] if result["fits"] else more_room_only(suggestions(
        argv, args, parser, limit=None, critic_from_actor=result.get("critic_from_actor", False)))[:5]
    print(json.dumps(result, indent=1) if args.json else render(result), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(run, argv)
