"""The contract every decoding path keeps, and what a path that falls back records.

:class:`~dschat.rlhf.rollout.generator.RolloutGenerator` holds one :class:`DecodingPath` per way of
decoding a rollout and asks them in a fixed order. For each rollout:

* :meth:`DecodingPath.can_serve` answers ``None`` (it serves) or one line saying why not. It reads
  the generator's settings and may change them for good when a flag asked for this path and it
  cannot serve (it then records a :class:`Fallback` through the generator).
* :meth:`DecodingPath.generate` decodes ``(B, P)`` left-padded prompts into a
  :class:`~dschat.rlhf.rollout.sampling.Rollout`.
* :meth:`DecodingPath.fall_back` is asked when ``generate`` raised: one line when the failure is one
  to fall back from (the path turns itself off for the rest of the run), ``None`` to re-raise it.
  Out of memory and :class:`~dschat.errors.UserError` are never fallen back from. A path that can
  fall back (``falls_back``) does so on every rank or on none: with more than one rank, the ranks
  agree after each of its rollouts (one all-reduce), and a rank whose rollout succeeded drops it and
  falls back too, so that no rank is left in another collective than the others.

Paths with ``on_module`` decode with the training module, inside the generator's ZeRO-3 gather and
LoRA fusion (``RolloutRequest.materialised``); the others bring their own weights.

A path reads the generator's attributes and calls none of its methods: what it says goes through
:func:`say_once` and :func:`fall_back` here, which keep the generator's notices and its one
fallback record.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from dschat.errors import UserError
from dschat.rlhf.rollout.sampling import Rollout
from dschat.runtime.dist import print_rank_0

if TYPE_CHECKING:
    from dschat.rlhf.rollout.generator import RolloutGenerator
    from dschat.rlhf.rollout.conversation import Conversation

__all__ = ["DecodingPath", "Fallback", "RolloutRequest", "fall_back", "not_a_fallback", "say_once"]


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout's input: ``(B, P)`` left-padded prompts and their mask; ``materialised``: the
    training module's weights are whole (not ZeRO-3 fetched layer by layer) while the paths with
    ``on_module`` are asked (True for the others); ``tensor_parallel``: the rollout is decoded over
    the generator's tensor-parallel group (``--inference_tp_size`` > 1); ``conversation``: the KV cache
    of multi-turn episodes, which a path that can continues instead of decoding ``prompts`` (the
    conversations so far, re-prefilled by any other path; see
    :class:`~dschat.rlhf.rollout.conversation.Conversation`)."""

    prompts: torch.Tensor  # (B, P)
    mask: torch.Tensor  # (B, P)
    materialised: bool = True
    tensor_parallel: bool = False
    conversation: Conversation | None = None


@dataclass(frozen=True)
class Fallback:
    """A path that a flag or the set-up asked for and that does not serve for the rest of the run:
    its ``path`` name and the line ``reason`` that was printed."""

    path: str
    reason: str


class DecodingPath(ABC):
    """One way of decoding a rollout; see the module docstring for the contract."""

    name: ClassVar[str]  # unique among the generator's paths
    loop: ClassVar[str]  # what ``RolloutGenerator.last_loop`` reports when this path served
    label: ClassVar[str]  # what the rollout summary line calls it
    on_module: ClassVar[bool] = False  # decodes with the training module inside the generator's gather
    continues: ClassVar[bool] = False  # continues a multi-turn batch's kept KV cache (a Conversation)
    falls_back: ClassVar[bool] = False  # fall_back may return a line (the ranks then agree on each rollout)

    def __init__(self, generator: RolloutGenerator) -> None:
        self.gen = generator

    @abstractmethod
    def can_serve(self, request: RolloutRequest) -> str | None:
        """``None`` when this path decodes ``request``, else why not (one line)."""

    @abstractmethod
    def generate(self, request: RolloutRequest) -> Rollout:
        """``(B, P)`` prompts -> ``(B, P + A')`` sequences, ``A' <= max_answer_seq_len``, with the
        answer tokens' log-probs where this path keeps them."""

    def fall_back(self, err: Exception, request: RolloutRequest) -> str | None:
        """After :meth:`generate` raised ``err``: the line saying why the run falls back (this path is
        then off for good), or ``None`` to re-raise ``err``."""
        return None


def say_once(gen: RolloutGenerator, message: str) -> None:
    """Print ``message`` on rank 0 the first time the generator is given it."""
    if message not in gen._said:
        gen._said.add(message)
        print_rank_0(message)


def fall_back(gen: RolloutGenerator, path: str, reason: str) -> None:
    """Record on the generator that ``path`` stops serving for ``reason`` (one line, said once); the
    record is the latest fallback."""
    gen.fallback = Fallback(path, reason)
    say_once(gen, reason)


def not_a_fallback(err: BaseException) -> bool:
    """Out of memory is never a reason to fall back to another decoding path, nor is a user error (a
    compile cache folder that is not the user's own): both are re-raised."""
    return (isinstance(err, (torch.OutOfMemoryError, UserError))
            or "out of memory" in str(err).lower())
