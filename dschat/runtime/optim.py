"""Optimizer parameter groups, the Adam(W) choice, the LR scheduler and the step count.

Upstream builds ``FusedAdam`` or, with ``--offload``, ``DeepSpeedCPUAdam`` over
three parameter groups, with ``betas=(0.9, 0.95)`` and every other Adam default. Both DeepSpeed
optimizers default to *decoupled* weight decay (``FusedAdam(adam_w_mode=True)``,
``DeepSpeedCPUAdam(adamw_mode=True)``), i.e. AdamW::

    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2
    p = p - lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd * p)

``FusedAdam`` needs a CUDA-like accelerator (its kernel is compiled with the CUDA toolchain), so
on the CPU accelerator without offload :func:`create_optimizer` uses ``torch.optim.AdamW``, whose
update is the same formula (decay applied as ``p *= 1 - lr*wd`` before the Adam step; the Adam
step does not depend on ``p``, so the order does not matter). It runs torch's fused CPU kernel
(``fused=True``): one vectorised pass over each tensor instead of the default loop's seven or eight
elementwise passes and a host-side step count per tensor (its speed against the loop:
benchmarks/results.md). Its rounding differs from the loop's (tests/runtime/test_optim.py checks
that it agrees to fp32 rounding on a small model).

Two things to know. torch's fused CPU kernel reads a gradient as if it had its parameter's strides
(torch 2.13; on CUDA a mismatch is an error): code that sets ``p.grad`` itself must give it ``p``'s
layout (``torch.empty_like(p)``, ``copy_``), as autograd and ZeRO's flat partitions do. And
``load_state_dict`` restores each group's saved options: a checkpoint written with the per-tensor
loop (``fused`` off) resumes with it, and so keeps that run's numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from torch import nn

from dschat.errors import UserError
from dschat.runtime.dist import print_rank_0

__all__ = [
    "NO_DECAY_NAME_LIST",
    "LORA_NAME_LIST",
    "SCHEDULER_TYPES",
    "get_optimizer_grouped_parameters",
    "create_optimizer",
    "create_scheduler",
    "Multiplier",
    "FlagSchedule",
    "follow_flags",
    "num_update_steps",
    "relay_schedule",
    "resume_schedule",
    "schedule_settings",
]

# Upstream's defaults, matched as lower-cased substrings of parameter names.
NO_DECAY_NAME_LIST = ["bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight"]
LORA_NAME_LIST = ["lora_right_weight", "lora_left_weight"]
# The choices of upstream's --lr_scheduler_type flag.
SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                   "constant_with_warmup")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    lowered = name.lower()
    return any(p in lowered for p in patterns)


def get_optimizer_grouped_parameters(
    model: nn.Module,
    weight_decay: float,
    lora_lr: float = 5e-4,
    no_decay_name_list: Sequence[str] = tuple(NO_DECAY_NAME_LIST),
    lora_name_list: Sequence[str] = tuple(LORA_NAME_LIST),
) -> List[Dict[str, Any]]:
    """Upstream's three parameter groups over the *trainable* parameters, empty ones dropped.

    1. not no-decay, not LoRA -> ``weight_decay``;
    2. LoRA (and not no-decay) -> ``weight_decay`` with ``lr=lora_lr``;
    3. no-decay (bias, norms; LoRA or not) -> ``weight_decay=0.0``.

    Empty groups are removed because DeepSpeed's ZeRO optimizers fail on them
    (docs/upstream.md#empty-optimizer-parameter-groups).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not _matches(n, no_decay_name_list) and not _matches(n, lora_name_list)]
    lora = [p for n, p in named if not _matches(n, no_decay_name_list) and _matches(n, lora_name_list)]
    no_decay = [p for n, p in named if _matches(n, no_decay_name_list)]
    groups: List[Dict[str, Any]] = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": lora, "weight_decay": weight_decay, "lr": lora_lr},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _accelerator_name() -> str:
    return get_accelerator().device_name()


def create_optimizer(param_groups: List[Dict[str, Any]] | Iterable[nn.Parameter], *, lr: float,
                     offload: bool, betas: Tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    """Upstream's optimizer choice, with a CPU fallback.

    * ``offload`` -> ``DeepSpeedCPUAdam`` (required by ZeRO's CPU optimizer offload);
    * accelerator other than CPU -> ``FusedAdam``;
    * CPU accelerator, no offload -> ``torch.optim.AdamW(fused=True)`` (``FusedAdam`` needs CUDA), same
      math up to fp32 rounding.

    ``eps`` is 1e-8 and decay is decoupled in all three; per-group ``weight_decay``/``lr`` win.
    """
    if offload:
        return DeepSpeedCPUAdam(param_groups, lr=lr, betas=betas)
    if _accelerator_name() != "cpu":
        return FusedAdam(param_groups, lr=lr, betas=betas)
    # FusedAdam's defaults: eps=1e-8, weight_decay=0 (groups set their own), adam_w_mode=True.
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=1e-8, weight_decay=0.0, fused=True)


def create_scheduler(name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                     num_training_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """What ``transformers.get_scheduler(name, optimizer, num_warmup_steps, num_training_steps)``
    returns (upstream's call): a ``LambdaLR`` over the same formulas, with transformers' defaults
    (cosine: half a cycle; cosine with restarts: one; polynomial: linear, to 1e-7) and the same
    state dict. Written here because ``transformers.optimization`` imports
    ``transformers.trainer_utils``, which imports peft and bitsandbytes: seconds at every run's
    start-up (benchmarks/results.md, "Start-up"). tests/runtime/test_optim.py checks every
    schedule against transformers', step by step."""
    if name not in SCHEDULER_TYPES:
        raise UserError(f"unknown --lr_scheduler_type {name!r}; use one of {', '.join(SCHEDULER_TYPES)}")
    if num_warmup_steps < 0 or num_training_steps < 1:
        raise UserError(f"need num_warmup_steps >= 0 and num_training_steps >= 1, got "
                        f"{num_warmup_steps} and {num_training_steps}; check --num_warmup_steps and the data size")
    if name != "constant" and num_warmup_steps >= num_training_steps:
        print_rank_0(f"WARNING: --num_warmup_steps {num_warmup_steps} is at least the {num_training_steps} optimizer "
                     "steps the LR schedule is laid over: the learning rate never reaches its peak")
    LambdaLR = torch.optim.lr_scheduler.LambdaLR
    if name == "constant":
        return LambdaLR(optimizer, Multiplier(name))
    if name == "constant_with_warmup":
        return LambdaLR(optimizer, Multiplier(name, num_warmup_steps=num_warmup_steps))
    steps = {"num_warmup_steps": num_warmup_steps, "num_training_steps": num_training_steps}
    if name in ("linear", "cosine"):
        return LambdaLR(optimizer, Multiplier(name, **steps, **({"num_cycles": 0.5} if name == "cosine" else {})))
    if name == "cosine_with_restarts":
        return LambdaLR(optimizer, Multiplier(name, **steps, num_cycles=1))
    lr_init, lr_end = optimizer.defaults["lr"], 1e-7
    if not lr_init > lr_end:
        raise UserError(f"--lr_scheduler_type polynomial decays to {lr_end}, so the learning rate must be "
                        f"larger than that, got {lr_init}; raise it or pick another --lr_scheduler_type")
    return LambdaLR(optimizer, Multiplier(name, **steps, lr_end=lr_end, power=1.0, lr_init=lr_init))


class Multiplier:
    """A schedule's LR multiplier at a step (``LambdaLR``'s lambda): ``kind`` (a
    ``--lr_scheduler_type``) and its keywords, kept as attributes so that ``LambdaLR.state_dict``
    saves them and a checkpoint restores the plan the run was laid out on (:func:`relay_schedule`)."""

    def __init__(self, kind: str, **keywords: int | float) -> None:
        self.kind = kind
        self.__dict__.update(keywords)

    def __call__(self, step: int) -> float:
        function, names = _MULTIPLIERS[self.kind]
        return function(step, **{name: getattr(self, name) for name in names})


def schedule_settings(scheduler: Any) -> list[tuple[float, str | None, int | None]]:
    """Per parameter group: its base learning rate, schedule kind and warmup steps."""
    return [(float(base), getattr(fn, "kind", None), _warmup(getattr(fn, "kind", None), fn.__dict__))
            for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]


def _warmup(kind: str | None, settings: dict[str, Any]) -> int | None:
    """The warmup steps of a multiplier of ``kind`` (None for a kind without warmup)."""
    return _setting(kind, settings, "num_warmup_steps")


def _setting(kind: str | None, settings: dict[str, Any], name: str) -> Any:
    """The keyword ``name`` of a multiplier of ``kind``; None for a kind that has no such keyword (a
    restored multiplier keeps this run's keywords beside the checkpoint's kind: ``load_state_dict``
    updates its attributes)."""
    return settings.get(name) if kind in _MULTIPLIERS and name in _MULTIPLIERS[kind][1] else None


@dataclass(frozen=True)
class FlagSchedule:
    """What this run's flags made of a scheduler before a resume loads the checkpoint's into it:
    each group's base learning rate, each :class:`Multiplier`'s settings (None: another lambda) and
    each optimizer group's weight decay."""

    base_lrs: tuple[float, ...]
    multipliers: tuple[dict[str, Any] | None, ...]
    weight_decays: tuple[float, ...] = ()

    @classmethod
    def of(cls, scheduler: Any) -> "FlagSchedule":
        return cls(tuple(float(b) for b in scheduler.base_lrs),
                   tuple(dict(fn.__dict__) if isinstance(fn, Multiplier) else None for fn in scheduler.lr_lambdas),
                   tuple(float(g.get("weight_decay", 0.0)) for g in scheduler.optimizer.param_groups))


def follow_weight_decay(wanted: FlagSchedule, scheduler: Any) -> str | None:
    """After a resume: this run's weight decay (``wanted``, taken before the resume) for each optimizer
    group, where the checkpoint's differs (the optimizer's load restored its groups' settings); a line
    naming both, or None (they agree)."""
    groups = scheduler.optimizer.param_groups
    kept = tuple(float(g.get("weight_decay", 0.0)) for g in groups)
    if not wanted.weight_decays or kept == wanted.weight_decays or len(kept) != len(wanted.weight_decays):
        return None
    for group, decay in zip(groups, wanted.weight_decays):
        group["weight_decay"] = decay

    def say(decays: tuple[float, ...]) -> str:
        return ", ".join(f"{d:g}" for d in dict.fromkeys(decays))
    return (f"this run's weight decay ({say(wanted.weight_decays)}) applies from the step it resumes at; the "
            f"checkpoint's was {say(kept)}")


def follow_flags(wanted: FlagSchedule, scheduler: Any) -> str | None:
    """After a resume: where this run's learning rates, schedule kind or warmup (``wanted``, taken
    before the resume) differ from the checkpoint's, this run's apply from the step resumed at (a
    lower ``--learning_rate`` after a divergence); the number of steps the checkpoint's schedule was
    laid over stays for :func:`relay_schedule`, and a schedule that needs one where the checkpoint's had
    none (constant, resumed as cosine) gets None, which :func:`relay_schedule` (called next, by
    :func:`resume_schedule`) lays over the steps done and to go. Returns a line naming both, or None (they agree)."""
    kept = schedule_settings(scheduler)
    asked = [(lr, (m or {}).get("kind"), _warmup((m or {}).get("kind"), m or {}))
             for lr, m in zip(wanted.base_lrs, wanted.multipliers)]
    if kept == asked:
        return None
    for fn, settings in zip(scheduler.lr_lambdas, wanted.multipliers):
        if isinstance(fn, Multiplier) and settings is not None:
            total = _setting(getattr(fn, "kind", None), fn.__dict__, "num_training_steps")
            fn.__dict__.clear()
            fn.__dict__.update(settings)
            if "num_training_steps" in settings:
                fn.num_training_steps = total
    scheduler.base_lrs = list(wanted.base_lrs)
    for group, lr in zip(scheduler.optimizer.param_groups, wanted.base_lrs):
        group["initial_lr"] = lr
    if all(getattr(fn, "num_training_steps", 0) is not None for fn in scheduler.lr_lambdas):
        _apply_current(scheduler)  # else relay_schedule's

    def say(settings: list[tuple[float, str | None, int | None]]) -> str:
        return "; ".join(f"lr {lr:g}, {kind}" + (f", {warmup} warmup steps" if warmup is not None else "")
                         for lr, kind, warmup in dict.fromkeys(settings))

    return (f"this run's learning rates and LR schedule ({say(asked)}) apply from the step it resumes at; the "
            f"checkpoint's were {say(kept)}")


def _apply_current(scheduler: Any) -> None:
    """Each group's learning rate at the scheduler's step, from its base rate and multiplier."""
    scheduler._last_lr = [base * fn(int(scheduler.last_epoch)) for base, fn in zip(scheduler.base_lrs,
                                                                                   scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler._last_lr):
        group["lr"] = lr


def relay_schedule(scheduler: Any, planned_steps: int, remaining_steps: int) -> str | None:
    """After a resume: lay ``scheduler``'s restored schedule over the optimizer steps done plus
    ``remaining_steps`` (what this run will take) when the checkpoint's run laid it over another
    number than this run plans (``planned_steps``: another gradient accumulation, number of ranks,
    epoch count or data size), or over no number (None: :func:`follow_flags` gave it a kind the
    checkpoint's did not lay out); the step's learning rates become the new schedule's. Returns a line
    saying so, or None (the same plan: the restored schedule goes on exactly as it was)."""
    lambdas = [fn for fn in getattr(scheduler, "lr_lambdas", ()) if isinstance(fn, Multiplier)]
    saved = {getattr(fn, "num_training_steps", planned_steps) for fn in lambdas}
    if saved <= {planned_steps}:
        return None
    done = int(scheduler.last_epoch)
    total = max(1, done + remaining_steps)
    for fn in lambdas:
        if hasattr(fn, "num_training_steps"):
            fn.num_training_steps = total
    _apply_current(scheduler)
    if None in saved:
        return (f"the checkpoint's LR schedule was laid over no number of optimizer steps (a constant one): this "
                f"run's is laid over {total} ({done} done, {remaining_steps} to go)")
    was = ", ".join(str(n) for n in sorted(saved))
    return (f"the LR schedule was laid over {was} optimizer steps by the run that wrote the checkpoint and this "
            f"run plans {planned_steps}: it is laid over {total} now ({done} done, {remaining_steps} to go)")


def resume_schedule(wanted: FlagSchedule, scheduler: Any, planned_steps: int, remaining_steps: int) -> list[str]:
    """After a resume: this run's flags over the checkpoint's schedule (:func:`follow_flags`) and weight
    decay (:func:`follow_weight_decay`), then the schedule laid over the steps this run takes where its
    plan changed (:func:`relay_schedule`; the first may leave a length for the second to lay). Returns
    their lines (none: nothing changed)."""
    lines = (follow_flags(wanted, scheduler), follow_weight_decay(wanted, scheduler),
             relay_schedule(scheduler, planned_steps, remaining_steps))
    return [line for line in lines if line is not None]


# The LR multipliers of transformers.optimization, term for term (the same float arithmetic).
def _constant(_: int | None = None) -> float:
    return 1


def _constant_with_warmup(current_step: int, *, num_warmup_steps: int) -> float:
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _linear(current_step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(current_step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float) -> float:
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _cosine_with_hard_restarts(current_step: int, *, num_warmup_steps: int, num_training_steps: int,
                               num_cycles: int) -> float:
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(current_step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float,
                lr_init: float) -> float:
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    if current_step > num_training_steps:
        return lr_end / lr_init  # LambdaLR multiplies by lr_init
    decay_steps = num_training_steps - num_warmup_steps
    if decay_steps == 0:  # the last step of a run that is all warmup (transformers divides by zero)
        return lr_end / lr_init
    pct_remaining = 1 - (current_step - num_warmup_steps) / decay_steps
    return ((lr_init - lr_end) * pct_remaining**power + lr_end) / lr_init


_STEPS = ("num_warmup_steps", "num_training_steps")
_MULTIPLIERS = {  # kind -> (multiplier, its keywords)
    "constant": (_constant, ()), "constant_with_warmup": (_constant_with_warmup, ("num_warmup_steps",)),
    "linear": (_linear, _STEPS), "cosine": (_cosine, (*_STEPS, "num_cycles")),
    "cosine_with_restarts": (_cosine_with_hard_restarts, (*_STEPS, "num_cycles")),
    "polynomial": (_polynomial, (*_STEPS, "lr_end", "power", "lr_init")),
}


def num_update_steps(num_batches: int, epochs: int, grad_accum: int) -> int:
    """Optimizer steps of steps 1-2: ``epochs * ceil(num_batches / grad_accum)`` (upstream's formula)."""
    if num_batches < 0 or epochs < 0 or grad_accum < 1:
        raise UserError(f"need num_batches >= 0, epochs >= 0 and gradient_accumulation_steps >= 1, got "
                        f"{num_batches}, {epochs}, {grad_accum}")
    return epochs * math.ceil(num_batches / grad_accum)
