"""ZeRO-3's prefetch trace across step 3's passes.

Under ZeRO-3 DeepSpeed records the order in which one pass (a forward, and the backward after it)
fetches the modules' parameters, and from the next pass on all-gathers the parameters of the modules
ahead of the one running (``stage3_prefetch_bucket_size``), overlapping the communication with the
compute. A pass that leaves the recorded order (a module the trace does not expect, or more modules
than it holds) invalidates the trace: that pass and the next fetch every module on demand (the next
one is recorded afresh), and prefetching resumes with the pass after them. A pass begins where DeepSpeed's hook on the root module's forward
resets the trace's cursor.

Step 3 alternates passes without a backward (generation, the scoring passes) with training passes.
Left to DeepSpeed, two things kept a trained engine's trace from ever covering a training pass:

* A pass without a backward recorded right after an invalidation gives a trace that ends where the
  training pass's backward begins, so every training backward invalidated it again, and the next pass
  without a backward recorded the same short trace: the actor's backward never prefetched.
* The critic's and the reward model's passes (``forward_value``) do not go through the root module's
  call, so no pass ever began for DeepSpeed: their trace was never recorded and nothing was prefetched.

:func:`zero3_pass` begins a pass the way DeepSpeed's hook does, except that a trained engine whose
trace is invalid waits for a pass with gradients to record it, so the trace it records covers the
forward and the backward and a pass without a backward follows its first part. Such a pass ends by
partitioning again what the trace kept gathered for the backward it will not run.
:func:`begin_passes_with_dschats_rule` puts those rules on a trained engine's root module, in place of
DeepSpeed's hook; :mod:`dschat.rlhf.packed_passes` wraps each ``forward_value`` pass in :func:`zero3_pass`.
(The rollout's gather keeps the trace too: :func:`~dschat.runtime.zero3.gathered_without_hooks`;
a pass inside that gather, such as a scoring pass of a model gathered whole, is no ZeRO-3 pass. An
engine whose training passes run gathered whole, ``--zero3_gather_for_training``, is ruled as a
frozen one: its passes through the hooks have no backward.)
Everything here is a no-op below ZeRO-3 and for plain modules.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

from dschat.runtime.zero3 import gathered_whole, trained_whole, zero3_offload

__all__ = ["zero3_pass", "begin_passes_with_dschats_rule"]


def _trains(engine: Any) -> bool:
    """Whether ``engine`` is a ZeRO-3 engine with an optimizer whose training passes run through
    ZeRO-3's hooks (its hooked passes have backwards); an inference engine's offload is the optimizer
    slot itself, and an engine trained gathered whole (:func:`~dschat.runtime.zero3.mark_trained_whole`)
    runs only passes without gradients through them."""
    optimizer = getattr(engine, "optimizer", None)
    return optimizer is not None and hasattr(optimizer, "parameter_offload") and not trained_whole(engine)


def _begin(coordinator: Any, trains: bool) -> None:
    if trains and not torch.is_grad_enabled() and coordinator.is_invalid_trace():
        return  # record at the next pass with a backward, not this one
    coordinator.reset_step()


def _end(offload: Any, trains: bool) -> None:
    """After a trained engine's pass without gradients: partition again what its trace kept gathered
    for the backward (DeepSpeed keeps a parameter whose next use is within ``stage3_max_reuse_distance``,
    1e9 elements by default), which this pass will never run. Left, the critic stayed whole from its
    scoring pass through the actor's training, and an actor fetched layer by layer stayed whole across
    its decode steps. Persistent parameters stay, as DeepSpeed keeps them; DeepSpeed's count of
    gathered elements, which these partitions leave high, is reset as the next pass begins."""
    coordinator = offload.get_param_coordinator()
    if not trains or torch.is_grad_enabled() or not coordinator.is_complete_trace():
        return
    coordinator._clean_inflight_param_registry()  # wait for the prefetches still in flight, release them
    for param in iter_params(offload.module, recurse=True):
        if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_persist and not param.ds_active_sub_modules:
            param.partition()


@contextmanager
def zero3_pass(engine: Any) -> Iterator[None]:
    """One pass of ``engine`` for ZeRO-3's trace (see the module's docstring), around a pass that
    does not go through the root module's call (``forward_value``); on every rank alike."""
    offload = zero3_offload(engine)
    if offload is None or gathered_whole(engine):  # whole and unhooked: nothing for the trace to see
        yield
        return
    trains = _trains(engine)
    _begin(offload.get_param_coordinator(), trains)
    yield
    _end(offload, trains)


def begin_passes_with_dschats_rule(engine: Any) -> None:
    """Put the rules of :func:`zero3_pass` on a trained ZeRO-3 engine's root module: its pass-start
    hook replaces DeepSpeed's, first in the root's hooks as DeepSpeed's was, and a pass-end hook joins
    DeepSpeed's forward hooks. Both handles sit where DeepSpeed keeps its own (``fwd_pre_hook``,
    ``forward_hooks``), so its teardown removes them and the rollout's gather detaches them."""
    offload = zero3_offload(engine)
    if offload is None or not _trains(engine):
        return

    def start_of_pass(module: torch.nn.Module, args: Any) -> None:
        _begin(offload.get_param_coordinator(), _trains(engine))

    def end_of_pass(module: torch.nn.Module, args: Any, output: Any) -> None:
        _end(offload, _trains(engine))

    offload.fwd_pre_hook.remove()
    offload.fwd_pre_hook = offload.module.register_forward_pre_hook(start_of_pass, prepend=True)
    offload.forward_hooks.append(offload.module.register_forward_hook(end_of_pass))
