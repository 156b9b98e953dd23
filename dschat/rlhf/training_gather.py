"""ZeRO-3 training passes on whole models (``--zero3_gather_for_training``).

Under ZeRO-3 each module's parameters are fetched as the module runs, in the forward and again in
the backward, and released after it, by hooks on every module. With one data-parallel rank the
fetch moves nothing (each partition is the whole parameter, and a gathered parameter is a view of
it), but the hooks' bookkeeping stays, and a GPU waits for its host: on models with the 24 layers of
OPT-1.3B and OPT-350m and little compute per layer, ZeRO-3's update took 2.1x the time it took with
the models gathered (``benchmarks/results.md``). :class:`TrainingGather` runs the actor's and the
critic's forward and backward of a micro-step inside
:func:`~dschat.runtime.zero3.gathered_without_hooks`: all the model's parameters gathered at once,
the module hooks set aside, released after the backward, before the optimizer step. Gradients still
reach ZeRO-3 through its per-parameter hooks, which reduce and partition them as before.

``auto`` does it where it costs no memory: every partition is whole (one data-parallel rank) and
ZeRO-3 does not offload the parameters. ``on`` does it for every ZeRO-3 model; with more than one
rank each then holds the whole model through the backward, beside its partitions. The forward is the
same, to the bit; the backward adds the same gradient contributions, but ZeRO-3's hooks wrap every
module's inputs and outputs in identity autograd nodes, which groups some of those sums differently,
so gradients can differ from the hooked pass's in the last bits (measured in the tests and
``benchmarks/results.md``).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from dschat.runtime.dist import print_rank_0
from dschat.runtime.zero3 import gathered_without_hooks, mark_trained_whole, params_offloaded, whole_partitions, zero3_offload

__all__ = ["TrainingGather"]


class TrainingGather:
    """``gather(name, engine)``: the context a training pass (forward and backward) of ``engine``, the
    model ``name``, runs in. ``setting`` is ``--zero3_gather_for_training`` (``auto``, ``on``,
    ``off``); decided once per model, the same on every rank (it depends on the configuration only)."""

    def __init__(self, setting: str = "auto") -> None:
        if setting not in ("auto", "on", "off"):
            raise ValueError(f"--zero3_gather_for_training must be auto, on or off, got {setting!r}")
        self.setting = setting
        self.decided: dict[str, bool] = {}

    def __call__(self, name: str, engine: Any) -> AbstractContextManager[Any]:
        if engine is None or zero3_offload(engine) is None:
            return nullcontext()
        if name not in self.decided:
            if self.setting != "auto":
                self.decided[name], why_not = self.setting == "on", "--zero3_gather_for_training off"
            elif params_offloaded(engine):
                self.decided[name], why_not = False, "its parameters are offloaded; --zero3_gather_for_training on gathers them"
            else:
                self.decided[name] = whole_partitions(engine)
                why_not = ("it is partitioned over more than one rank; --zero3_gather_for_training on gathers it "
                           "whole, at the memory of a full copy")
            mark_trained_whole(engine, self.decided[name])
            print_rank_0(f"ZeRO-3 training: the {name}'s parameters "
                         + ("gathered once per forward and backward" if self.decided[name] else
                            f"fetched module by module ({why_not})"))
        return gathered_without_hooks(engine) if self.decided[name] else nullcontext()
