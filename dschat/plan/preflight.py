"""The preflight: the plan of a step's own command line before any model is loaded (step 3 runs it
itself; ``e2e_rlhf.py`` runs it for each step before step 1).

On an accelerator other than the CPU a run that cannot fit stops with one line naming the phase, the
shortfall and the first configuration that fits (:class:`UserError`, exit 2); on the CPU the plan is
printed and not enforced (the CPU's memory is the host's, shared with everything else).

The planner's gaps never stop a run: a model it cannot plan (an architecture it cannot build on the
meta device, a folder without ``config.json`` such as a PEFT adapter it does not read) gets one note
and the run goes on unplanned. Flags the step itself refuses on a model the planner can read (a row
longer than its position table, ``--freeze_layers`` above its number of blocks) stop it: they are
the user's to fix, and the step would stop on them anyway. A run that builds fewer than PPO's four models (a critic-free
algorithm, a reward given without the reward model) is planned with the engines it builds.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, Sequence

import torch
from deepspeed.accelerator import get_accelerator

from dschat.errors import UserError, first_line
from dschat.models.freeze import freeze_lower_layers
from dschat.plan.cli import (MARGIN, build_parser, check_flag_values, check_step_flags, format_gb, plan, render,
                             suggestions)
from dschat.plan.inventory import inventory
from dschat.plan.roles import model_config, reward_model_used
from dschat.rlhf.config import resolve_algorithm
from dschat.runtime.dist import collective_device, print_rank_0
from dschat.training.run_setup import RunContext

__all__ = ["preflight", "step3_preflight", "device_memory", "gpus_per_node"]


def _skip(step: int = 3) -> str:
    """The clause of a note on a run the preflight does not plan: it goes on, and how to see its plan."""
    return f"step {step} goes on without it (python -m dschat.plan with the same flags shows the plan)"


def _check_model_flags(args: argparse.Namespace) -> None:
    """The step's own checks of its flags against its model, as the step runs them: the row length
    against the position table (:func:`~dschat.plan.cli.check_step_flags`) and step 2's
    ``--freeze_layers`` against the blocks of the model built on the meta device
    (:func:`~dschat.models.freeze.freeze_lower_layers`); a :class:`UserError` where the step refuses
    them. A model the planner cannot read or build is not checked here: the plan's note says so."""
    step = getattr(args, "step", 3)
    freeze = getattr(args, "freeze_layers", 0) if step == 2 else 0
    try:
        config = model_config(args.actor_model_name_or_path if step == 3 else args.model_name_or_path)
        meta_model = inventory(config, critic=True)[1] if freeze else None
    except Exception:  # noqa: BLE001 - the planner's gap, noted where the plan fails on it
        return
    check_step_flags(args)
    if meta_model is not None:
        freeze_lower_layers(meta_model, freeze)


def preflight(argv: Sequence[str], *, world: int, gpus_per_node: int, accelerator: str, gpu_bytes: int,
              echo: Callable[[str], None] = print, step: int = 3, table: bool = True,
              skip_hint: str = "--preflight off skips this check", reward_model: bool | None = None,
              critic_from_actor: bool | None = None, refusal_prefix: str = "") -> dict | None:
    """Plan step ``step``'s ``argv`` on ``world`` ranks of ``gpu_bytes`` each; returns the plan, or None
    when the planner cannot plan it (one note through ``echo``, nothing raised). Flags the step itself
    refuses (:func:`~dschat.plan.cli.check_flag_values`, and on a model the planner reads
    :func:`_check_model_flags`) are its :class:`UserError`, not a note, its line after ``refusal_prefix``.
    ``reward_model``: whether step 3 loads its reward model (None: as the flags say);
    ``critic_from_actor``: whether step 3 builds its critic from the actor with a fresh value head
    (step 3 passes what it resolved; None: decided from the tokenizers, as :func:`~dschat.plan.cli.plan`).

    ``accelerator == "cpu"``: the table (one line without ``table``) is printed (``echo``), nothing is
    enforced. Otherwise a plan that does not fit raises :class:`UserError` with the peak phase, the
    shortfall, the first suggestion and ``skip_hint``; one that fits is one line.
    """
    parser = build_parser(step)
    node_args = ["--gpus_per_node", str(gpus_per_node), "--num_nodes", str(max(1, world // gpus_per_node))]
    full = [*argv, *node_args]
    args = parser.parse_args(full)
    try:  # flags the step refuses are the user's to fix: raised, never a note
        check_flag_values(args)
        _check_model_flags(args)
    except UserError as err:
        if not refusal_prefix:
            raise
        raise UserError(refusal_prefix + first_line(err)) from None
    try:
        result = plan(args, gpu_bytes=gpu_bytes, reward_model=reward_model, critic_from_actor=critic_from_actor)
    except Exception as err:  # noqa: BLE001 - the planner's gap on a model the run can train never stops it
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        what = "this run" if step == 3 else f"step {step}"
        echo(f"note: the memory preflight cannot plan {what} ({reason}); {_skip(step)}")
        return None
    peak = f"peak {format_gb(result['peak_bytes_per_gpu'])} per GPU in {result['peak_phase']}"
    if accelerator == "cpu":
        if table:
            echo("memory preflight (printed, not enforced on the CPU; --preflight off skips it):\n" + render(result))
        else:
            echo(f"memory preflight, step {step}: {peak.replace('per GPU', 'per rank')} (not enforced on the CPU)")
        return result
    if result["fits"]:
        echo(f"memory preflight{'' if step == 3 else f', step {step}'}: {peak}, fits the {format_gb(gpu_bytes)} GPU "
             f"with {MARGIN:.0%} kept free")
        return result
    found = suggestions(full, args, parser, limit=1, gpu_bytes=gpu_bytes, reward_model=reward_model,
                        critic_from_actor=result.get("critic_from_actor", False))
    fix = f"add {' '.join(found[0]['flags'])}" if found else "use GPUs with more memory"
    same = "the same flags" if step == 3 else f"--step {step} and the same flags"
    raise UserError(
        f"step {step} does not fit: {result['peak_phase']} needs {format_gb(result['peak_bytes_per_gpu'])} per GPU, "
        f"{format_gb(-result['margin_bytes'])} more than the {format_gb(gpu_bytes)} GPU allows with "
        f"{MARGIN:.0%} kept free; "
        f"{fix} (python -m dschat.plan with {same} shows the whole plan; {skip_hint})")


def device_memory() -> tuple[str, int]:
    """This rank's accelerator name and the memory of its device in bytes (DeepSpeed's accelerator:
    on CUDA ``torch.cuda.get_device_properties(...).total_memory``, on the CPU the host's memory)."""
    accelerator = get_accelerator()
    return accelerator.device_name(), int(accelerator.total_memory())


def gpus_per_node(world: int) -> int:
    """Ranks per node: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (deepspeed),
    else the whole world (plain ``python``); the world when it does not divide it."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            local = int(value)
            return local if world % local == 0 else world
    return world


def _loads_reward_model(args: argparse.Namespace, four_models: bool, reward_model: bool | None) -> bool | None:
    """Whether the run loads its reward model: ``reward_model`` when the caller says; else read from
    ``four_models`` (critic and reward model both built) and the flags; None where they cannot tell
    (a critic-free run whose flags leave the reward model's weight at its default: a Python
    ``reward_fn`` handed to step 3's ``main`` replaces the model, and the flags do not show one)."""
    if reward_model is not None:
        return reward_model
    if four_models:
        return True
    if resolve_algorithm(args).critic:  # the critic is built, so the reward model is not
        return False
    if not reward_model_used(args) or getattr(args, "reward_model_weight", None) is not None:
        return reward_model_used(args)
    return None


def step3_preflight(args: argparse.Namespace, argv: Sequence[str] | None, ctx: RunContext, *,
                    four_models: bool = True, reward_model: bool | None = None,
                    critic_from_actor: bool | None = None) -> dict | None:
    """Step 3's preflight of its own command line (``argv``; None: ``sys.argv[1:]``) as the run
    resolved it (``ctx``: world size, the dtype actually used); skipped with ``--preflight off``.

    It plans the engines the run builds: the critic where the algorithm has one, from the model the
    run builds it from (``critic_from_actor``: the actor's body with a fresh value head, as
    :func:`~dschat.rlhf.rlhf_engine.resolve_model_sources` decided; None: decided again from the
    tokenizers), the reward model where ``reward_model`` (the run's reward mix loads it) says so;
    without ``reward_model``, ``four_models`` (the run builds the critic and the reward model) and the
    flags decide, and where they cannot tell (:func:`_loads_reward_model`) one note and no plan.
    Printing is rank 0's.
    Collective (two all-reduces): every rank plans for the smallest device of the run, and when any
    rank refuses, every rank raises, so no rank is left waiting for the others.
    """
    if args.preflight == "off":
        return None
    echo = functools.partial(print_rank_0, rank=ctx.rank)
    reward_model = _loads_reward_model(args, four_models, reward_model)
    if reward_model is None:
        echo("note: the memory preflight cannot tell whether this critic-free run loads its reward model (a reward "
             f"function passed to step 3's main replaces it); {_skip()}")
        return None
    accelerator, gpu_bytes = device_memory()
    gpu_bytes = int(_over_ranks(gpu_bytes, torch.distributed.ReduceOp.MIN))
    argv = list(sys.argv[1:] if argv is None else argv)
    refused: UserError | None = None
    result = None
    try:
        result = preflight([*argv, "--dtype", ctx.dtype], world=ctx.world_size,
                           gpus_per_node=gpus_per_node(ctx.world_size), accelerator=accelerator,
                           gpu_bytes=gpu_bytes, echo=echo, reward_model=reward_model,
                           critic_from_actor=critic_from_actor)
    except UserError as err:
        refused = err
    if _over_ranks(1.0 if refused is not None else 0.0, torch.distributed.ReduceOp.MAX) > 0:
        raise refused or UserError("step 3 does not fit: another rank's memory preflight refused the run (its "
                                   "error line says why); --preflight off skips this check")
    return result


def _over_ranks(value: float, op: torch.distributed.ReduceOp) -> float:
    """``value`` reduced with ``op`` over every rank (itself without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    host = torch.tensor([float(value)], dtype=torch.float64)
    tensor = host.to(collective_device(host))  # NCCL reduces only CUDA tensors
    torch.distributed.all_reduce(tensor, op=op)
    return float(tensor.item())
