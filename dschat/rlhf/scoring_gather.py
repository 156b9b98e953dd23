"""ZeRO-3 scoring passes on whole models (``--zero3_gather_for_scoring``).

Under ZeRO-3 each module's parameters are fetched as the module runs and released after it, by hooks
on every module. On one GPU the fetch moves nothing, but the hooks' bookkeeping stays: a scoring pass
of a 24-layer model spent three times the host time of the same pass at ZeRO-0
(``benchmarks/results.md``), and a GPU waits for its host. A pass without gradients needs none of it.
:class:`ScoringGather` runs a model's scoring pass inside
:func:`~dschat.runtime.zero3.gathered_without_hooks`, as the rollout runs the actor: all its
parameters gathered at once, the hooks set aside (the same ones put back, so its prefetch trace and
module ids survive), then released. Where a model does not fit in half of the free memory
(:func:`~dschat.runtime.zero3.fits_gathered`, decided once per model, the same on every rank), or
whose parameters ZeRO-3 offloads (``--offload_reference_model`` and the like: the user keeps them off
the accelerator; ``on`` gathers them anyway), its passes fetch module by module as before. The
numbers are the same either way: the same weights enter the same forward.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from dschat.runtime.dist import print_rank_0
from dschat.runtime.zero3 import fits_gathered, gathered_without_hooks, params_offloaded, zero3_offload

__all__ = ["ScoringGather"]


class ScoringGather:
    """``gather(name, engine)``: the context a scoring pass of ``engine`` (the model ``name``) runs in.

    ``setting`` is ``--zero3_gather_for_scoring``: ``"auto"`` (gather where the model fits and is not
    offloaded), ``"on"`` or ``"off"``. Collective where it gathers: every rank must score the same models.
    """

    def __init__(self, setting: str = "auto") -> None:
        if setting not in ("auto", "on", "off"):
            raise ValueError(f"--zero3_gather_for_scoring must be auto, on or off, got {setting!r}")
        self.setting = setting
        self.decided: dict[str, bool] = {}

    def __call__(self, name: str, engine: Any) -> AbstractContextManager[Any]:
        if self.setting == "off" or engine is None or zero3_offload(engine) is None:
            return nullcontext()
        if name not in self.decided:
            if self.setting == "on":
                self.decided[name], why_not = True, ""
            elif params_offloaded(engine):  # the user asked to keep it off the accelerator
                self.decided[name], why_not = False, "its parameters are offloaded; --zero3_gather_for_scoring on gathers them"
            else:
                self.decided[name] = fits_gathered(engine.module)
                why_not = "the full model does not fit in half the free memory"
            print_rank_0(f"ZeRO-3 scoring: the {name}'s parameters "
                         + ("gathered once per scoring pass" if self.decided[name] else
                            f"fetched module by module ({why_not})"))
        return gathered_without_hooks(engine) if self.decided[name] else nullcontext()
