"""ZeRO-3 passes on whole models: the scoring passes (``--zero3_gather_for_scoring``) and the
training passes (``--zero3_gather_for_training``).

Under ZeRO-3 each module's parameters are fetched as the module runs and released after it, by hooks
on every module, in the forward and again in the backward. On one GPU the fetch moves nothing (each
partition is the whole parameter), but the hooks' bookkeeping stays, and a GPU waits for its host:
with 24-layer models of little compute per layer, ZeRO-3's scoring passes took three times the host
time of ZeRO-0's, and its training 1.3x the time it takes with the models gathered
(``benchmarks/results.md``). A :class:`WholeModelGather` runs a model's pass inside
:func:`~dschat.runtime.zero3.gathered_without_hooks`, as the rollout runs the actor: all its
parameters gathered at once, the module hooks set aside (the same ones put back, so its prefetch trace
and module ids survive), then released. Decided once per model and the same on every rank; ``on``
gathers every ZeRO-3 model, ``off`` none, and ``auto`` never a model whose parameters ZeRO-3 offloads
(``--offload``, ``--offload_reference_model`` and the like: the user keeps them off the accelerator).

* :class:`ScoringGather`: the reference's, the reward model's and the critic's scoring passes over a
  rollout (and the actor's where generation kept no log-probs). ``auto`` gathers a model that fits in
  half of the free memory (:func:`~dschat.runtime.zero3.fits_gathered`). The numbers are the same:
  the same weights enter the same forward.
* :class:`TrainingGather`: the actor's and the critic's forward and backward of a micro-step, released
  before the optimizer step. Gradients still reach ZeRO-3 through its per-parameter hooks, which reduce
  and partition them as in a hooked pass. ``auto`` gathers where it costs no memory: one data-parallel rank
  (:func:`~dschat.runtime.zero3.whole_partitions`: a gathered parameter is a view of its partition)
  and no partition stored quantized; ``on`` also across ranks, each then holding the whole model
  through the backward. The forward is the same, to the bit; ZeRO-3's hooks wrap each module's inputs and outputs in identity autograd nodes,
  which groups some sums of gradient contributions differently, so gradients agree with the hooked
  passes' to fp32 rounding, not to the bit (``tests/rlhf/test_training_gather.py``).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from dschat.runtime.dist import print_rank_0
from dschat.runtime.zero3 import (
    fits_gathered,
    gathered_without_hooks,
    mark_trained_whole,
    params_offloaded,
    quantized_partitions,
    whole_partitions,
    zero3_offload,
)

__all__ = ["WholeModelGather", "ScoringGather", "TrainingGather"]


class WholeModelGather:
    """``gather(name, engine)``: the context a pass of ``engine`` (the model ``name``) runs in, gathered
    whole or through ZeRO-3's hooks by ``setting`` (``auto``, ``on``, ``off``) of the flag :attr:`flag`.
    A subclass says what ``auto`` decides for a model it may gather (:meth:`auto_gathers`). Collective
    where it gathers: every rank must run the same passes."""

    flag = ""  # the flag, without its dashes
    passes = ""  # the passes it gathers for, as the log line names them
    gathered = ""  # the log line's words for a model gathered

    def __init__(self, setting: str = "auto") -> None:
        if setting not in ("auto", "on", "off"):
            raise ValueError(f"--{self.flag} must be auto, on or off, got {setting!r}")
        self.setting = setting
        self.decided: dict[str, bool] = {}

    def auto_gathers(self, engine: Any) -> tuple[bool, str]:
        """``auto``'s decision for a ZeRO-3 ``engine`` whose parameters are not offloaded, and the reason
        given when it does not gather."""
        raise NotImplementedError

    def decide(self, name: str, engine: Any) -> bool:
        """Whether the passes of ``engine`` (the model ``name``) run gathered; said once per model
        (nothing is said for ``off``: the user chose the hooks)."""
        if self.setting == "off":
            return False
        if self.setting == "on":
            gather, why_not = True, ""
        elif params_offloaded(engine):
            gather, why_not = False, f"its parameters are offloaded; --{self.flag} on gathers them"
        else:
            gather, why_not = self.auto_gathers(engine)
        print_rank_0(f"ZeRO-3 {self.passes}: the {name}'s parameters "
                     + (self.gathered if gather else f"fetched module by module ({why_not})"))
        return gather

    def __call__(self, name: str, engine: Any) -> AbstractContextManager[Any]:
        if engine is None or zero3_offload(engine) is None:
            return nullcontext()
        if name not in self.decided:
            self.decided[name] = self.decide(name, engine)
        return gathered_without_hooks(engine) if self.decided[name] else nullcontext()


class ScoringGather(WholeModelGather):
    """A model's scoring pass over a rollout (``--zero3_gather_for_scoring``); ``auto``: where the
    whole model fits in half of the free memory (one all-reduce: the same answer on every rank)."""

    flag = "zero3_gather_for_scoring"
    passes = "scoring"
    gathered = "gathered once per scoring pass"

    def auto_gathers(self, engine: Any) -> tuple[bool, str]:
        return fits_gathered(engine.module), "the full model does not fit in half the free memory"


class TrainingGather(WholeModelGather):
    """The actor's or the critic's forward and backward of a micro-step (``--zero3_gather_for_training``);
    ``auto``: one data-parallel rank, and no partition stored quantized (MixZ++'s frozen weights, which a
    gather would dequantize all at once). ``models`` (name -> engine) are decided at once, as the trainer
    is built: a model it gathers is marked (:func:`~dschat.runtime.zero3.mark_trained_whole`), so
    ZeRO-3's trace rules its hooked passes (a rollout's, before any training) as a frozen model's; one
    it leaves to the hooks is unmarked. Deciding needs no collective."""

    flag = "zero3_gather_for_training"
    passes = "training"
    gathered = "gathered once per forward and backward"

    def __init__(self, setting: str = "auto", models: dict[str, Any] | None = None) -> None:
        super().__init__(setting)
        for name, engine in (models or {}).items():
            if engine is not None and zero3_offload(engine) is not None:
                self.decided[name] = self.decide(name, engine)

    def auto_gathers(self, engine: Any) -> tuple[bool, str]:
        if quantized_partitions(engine):
            return False, (f"its frozen weights are stored quantized; --{self.flag} on dequantizes them all "
                           "at once")
        return whole_partitions(engine), (f"it is partitioned over more than one rank; --{self.flag} on gathers "
                                          "it whole, at the memory of a full copy")

    def decide(self, name: str, engine: Any) -> bool:
        gather = super().decide(name, engine)
        mark_trained_whole(engine, gather)
        return gather
