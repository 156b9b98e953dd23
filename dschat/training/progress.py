"""A run's progress: the optimizer-step counter, the step timer, the ``--print_loss`` line, and the
:class:`RunResult` a step ``main`` returns. Scalars go to :class:`~dschat.training.trackers.Trackers`
(``TensorBoardLogger``, the same class, is importable from here too)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dschat.training.trackers import TensorBoardLogger, Trackers  # noqa: F401 (re-exported)


class OptimizerStepCounter:
    """Counts micro-steps and optimizer steps (every ``gradient_accumulation_steps`` micro-steps,
    across epochs, as DeepSpeed does) and knows when ``--max_train_steps`` is reached."""

    def __init__(self, gradient_accumulation_steps: int, max_train_steps: int = 0):
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_train_steps = max_train_steps
        self.micro_steps = 0

    def micro_step(self) -> bool:
        """Record one micro-step; True when it completed an optimizer step."""
        self.micro_steps += 1
        return self.micro_steps % self.gradient_accumulation_steps == 0

    @property
    def optimizer_steps(self) -> int:
        return self.micro_steps // self.gradient_accumulation_steps

    @property
    def done(self) -> bool:
        return self.max_train_steps > 0 and self.optimizer_steps >= self.max_train_steps


class StepTimer:
    """Wall time of one training micro-step (``time.time`` as upstream; on an accelerator the
    ``engine.step()`` call ends with a synchronising loss/grad reduction)."""

    def __init__(self) -> None:
        self.start = time.time()

    def elapsed(self) -> float:
        return max(time.time() - self.start, 1e-9)


def print_loss_line(epoch: int, step: int, loss: torch.Tensor) -> None:
    """Upstream's ``--print_loss`` line (every rank prints its own loss)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print(f"Epoch: {epoch}, Step: {step}, Rank: {rank}, loss = {loss.item()}")


@dataclass
class RunResult:
    """What a step ``main`` returns when called in-process (tests, notebooks).

    ``evals``: one dict per evaluation (``epoch``, ``step`` and the metrics); ``train_losses``:
    the loss of every micro-step on this rank; ``step_times``: the wall time of every micro-step
    (forward, backward, optimizer step) in seconds; ``step_shapes``: the (rows, columns) each
    micro-step fed the model after padding trimming; ``engine``: the trained DeepSpeed engine.
    """

    output_dir: Path | None
    evals: list[dict] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_shapes: list[tuple[int, int]] = field(default_factory=list)
    optimizer_steps: int = 0
    engine: Any = None
    tokenizer: Any = None
    weight_digest: str | None = None
    skipped_nonfinite: int = 0  # micro-steps and optimizer steps the non-finite guard skipped
