"""The non-finite guard (``--max_nonfinite_steps``): skip, count, log, and stop after N in a row.

Two things can go non-finite in a training step, and each is skipped where it is seen:

* **the loss** of a micro-step, on any rank (checked by an all-reduce, so every rank agrees): the
  micro-step is not trained (no backward, no ``engine.step()``, not counted as a micro-step), so the
  gradient accumulation just continues with the next batch;
* **the gradients** of an optimizer step with a finite loss. Under ZeRO 1-3 and with bf16 DeepSpeed
  itself checks the gradient norm and skips the step (``engine.was_step_applied()`` is False); in fp32
  at ZeRO 0 it does not (the clipping turns every gradient into NaN), so the guard checks the
  gradients before ``engine.step()`` and drops them without stepping: that micro-step then counts
  as not trained, like one with a non-finite loss (weights, optimizer moments and LR schedule
  untouched; the gradients accumulated since the last optimizer step are dropped with it).

A fp16 step skipped by DeepSpeed's dynamic loss scaler is normal loss-scale search, not a failure: it
is not counted. A good optimizer step resets the count (``--align_overflow``'s steps, taken outside
:meth:`NonFiniteGuard.step`, report theirs to :meth:`NonFiniteGuard.applied`); after ``limit``
skipped steps in a row the run stops with :class:`TrainingDiverged` (one line naming the last
complete checkpoint; exit code 2).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import deepspeed.comm
import torch

from dschat.errors import UserError
from dschat.runtime.dist import get_all_reduce_mean, print_rank_0


class TrainingDiverged(UserError):
    """Too many non-finite steps in a row."""


def _all_ranks_true(flag: bool, device: torch.device | str) -> bool:
    """True on every rank iff ``flag`` is True on every rank (collective): the mean of 1.0 / 0.0 over
    the ranks is exactly 1.0 only then."""
    return get_all_reduce_mean(torch.tensor([1.0 if flag else 0.0], device=device)).item() == 1.0


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of ``tensors`` is finite.

    A finite sum proves it: a NaN or an infinity among the elements makes any sum of them NaN or
    infinite. Only a sum that is not finite, which finite values can also give by overflowing, needs
    the element-wise test. One vectorised pass per tensor and one host sync, instead of an
    element-wise ``isfinite(...).all()`` and a sync per tensor (timings: benchmarks/results.md).
    """
    if not tensors:
        return True
    sums = [t.detach().sum() for t in tensors]
    if bool(torch.isfinite(torch.stack([x.to(device=sums[0].device, dtype=torch.float32) for x in sums])).all()):
        return True
    return all(bool(torch.isfinite(t.detach()).all()) for t in tensors)


def _checks_own_gradients(engine: Any) -> bool:
    """True where DeepSpeed applies NaN/inf gradients instead of skipping (fp32 at ZeRO 0)."""
    return engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()


def check_weights_finite(engines: Mapping[str, Any], optimizer_steps: int, last: Callable[[], Path | None]) -> None:
    """Refuse to save weights that hold NaN or inf (:class:`TrainingDiverged`, naming ``last()``, the
    newest complete checkpoint): an optimizer step with a finite loss and finite gradients can still
    make them so (a learning rate far too high), and a checkpoint of them would rotate good ones out.
    Each rank checks what it holds (ZeRO-3: its partitions); collective: one all-reduce."""
    engine = next(iter(engines.values()))
    held = [_held(p) for e in engines.values() for p in e.module.parameters()]
    if _all_ranks_true(all_finite(*held), engine.device):
        return
    newest = last()
    where = (f"the last good checkpoint is {newest}: resume with --resume_from {newest}" if newest is not None
             else "no good checkpoint was saved")
    raise TrainingDiverged(f"training stopped: the weights hold NaN/inf after {optimizer_steps} optimizer steps (their "
                           f"loss and gradients were finite), and are not saved; {where}, with a lower "
                           "--learning_rate")


def _held(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: all of it, or under ZeRO-3 the real elements of its
    partition (a partition is padded to the same size on every rank, and the padding at the end of
    the last ranks' is uninitialised memory, NaN bit patterns included)."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return param
    start = part.ds_numel * _partition_rank(param)
    return part.narrow(0, 0, max(0, min(part.ds_numel, param.ds_numel - start)))


def _partition_rank(param: torch.Tensor) -> int:
    """This rank's place in ``param``'s ZeRO-3 partition group."""
    return deepspeed.comm.get_rank(group=param.ds_process_group)


class NonFiniteGuard:
    """Call :meth:`loss_ok` before ``engine.backward`` and :meth:`step` instead of ``engine.step()``.

    ``last_checkpoint()`` names the newest complete checkpoint (or None) for the stop message.
    """

    def __init__(self, limit: int, rank: int, device: torch.device | str,
                 last_checkpoint: Callable[[], Path | None] = lambda: None) -> None:
        if limit < 0:
            raise UserError(f"--max_nonfinite_steps must be >= 0 (0: never stop), got {limit}")
        self.limit = limit
        self.rank = rank
        self.device = device
        self.last_checkpoint = last_checkpoint
        self.consecutive = 0
        self.skipped = 0  # micro-steps and optimizer steps skipped over the whole run

    def loss_ok(self, *losses: torch.Tensor, where: str = "") -> bool:
        """True when every loss is finite on every rank (collective); otherwise count and log a skip."""
        return self.check(*losses, message=f"non-finite loss{' at ' + where if where else ''}; micro-step skipped")

    def check(self, *tensors: torch.Tensor, message: str) -> bool:
        """True when every tensor is finite on every rank (collective); otherwise count the skip and
        log ``message``."""
        if _all_ranks_true(all_finite(*tensors), self.device):
            return True
        self._skip(message)
        return False

    def step(self, engine: Any, where: str = "") -> bool:
        """``engine.step()`` that never applies NaN/inf gradients. Returns whether the micro-step
        counts: False only where the guard dropped the gradients itself (fp32 at ZeRO 0) and did not
        call ``engine.step()``, so DeepSpeed's micro-step count stays where it was, as for a skipped loss."""
        message = f"non-finite gradients{' at ' + where if where else ''}; optimizer step skipped"
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and _checks_own_gradients(engine):
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            if not _all_ranks_true(all_finite(*grads), self.device):
                for p in engine.module.parameters():
                    p.grad = None  # this step's accumulated gradients are dropped
                self._skip(message)
                return False
        engine.step()
        if boundary:
            if engine.was_step_applied():
                self.consecutive = 0
            elif not engine.fp16_enabled():  # fp16: the loss scaler's own overflow handling
                self._skip(message)
        return True

    def applied(self, *engines: Any) -> None:
        """After optimizer steps taken without :meth:`step` (``--align_overflow``'s fp16 steps, which
        DeepSpeed's loss scaler decides): a step every engine applied ends a run of skips, as in
        :meth:`step`; a loss-scale overflow neither counts nor ends it. Call it only at a gradient
        accumulation boundary."""
        if all(engine.was_step_applied() for engine in engines):
            self.consecutive = 0

    def _skip(self, what: str) -> None:
        self.consecutive += 1
        self.skipped += 1
        print_rank_0(f"[non-finite] {what} ({self.consecutive} in a row, {self.skipped} in this run)", self.rank)
        if self.limit and self.consecutive >= self.limit:
            last = self.last_checkpoint()
            where = (f"the last good checkpoint is {last}: resume with --resume_from {last}" if last is not None
                     else "no checkpoint was saved (pass --save_interval N to keep some)")
            raise TrainingDiverged(
                f"training stopped: {self.consecutive} steps in a row had NaN/inf loss or gradients "
                f"(--max_nonfinite_steps {self.limit}); {where}, with a lower --learning_rate or another "
                "--dtype (bf16/fp32), or raise --max_nonfinite_steps")
