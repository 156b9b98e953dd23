"""When step 3 writes a due checkpoint (:class:`dschat.training.ppo_counters.CheckpointTiming`): only
between optimizer steps, and, once a skipped micro-step has shifted an engine's accumulation for good,
after waiting at most the accumulation period. The engines' counters stand in for DeepSpeed's (the
real runs: tests/rlhf/test_step3_checkpoint.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from dschat.training.checkpoint import TrainingPosition
from dschat.training.ppo_counters import CheckpointTiming


@dataclass
class Counters:
    """A DeepSpeed engine's micro-step count and accumulation steps."""

    gas: int
    micro_steps: int = 0

    def gradient_accumulation_steps(self) -> int:
        return self.gas


@dataclass
class Saves:
    """The checkpointer's interval rule and the iterations it wrote."""

    interval: int
    engines: dict[str, Counters]
    written: list[int] = field(default_factory=list)

    def due(self, iterations: int) -> bool:
        return iterations % self.interval == 0

    def save(self, position: TrainingPosition) -> None:
        self.written.append(position.optimizer_steps)


def run(iterations: int, *, gas: int, micro_per_iteration: int, interval: int,
        skipped_at: int | None = None) -> list[int]:
    actor, critic = Counters(gas), Counters(gas)
    saves = Saves(interval, {"actor": actor, "critic": critic})
    timing = CheckpointTiming(saves)
    for iteration in range(1, iterations + 1):
        actor.micro_steps += micro_per_iteration - (iteration == skipped_at)  # a skipped micro-step is not counted
        critic.micro_steps += micro_per_iteration
        timing.maybe_save(TrainingPosition(epoch=0, epoch_micro_steps=iteration, micro_steps=0, optimizer_steps=iteration))
    return saves.written


def test_a_due_checkpoint_waits_for_the_end_of_an_optimizer_step():
    # Two iterations per optimizer step: a checkpoint due after an odd iteration waits one.
    assert run(12, gas=2, micro_per_iteration=1, interval=3) == [4, 6, 10, 12]
    assert run(12, gas=1, micro_per_iteration=3, interval=3) == [3, 6, 9, 12]  # every iteration ends a step


def test_after_a_skipped_micro_step_checkpoints_are_still_written(capsys):
    """The actor's accumulation is shifted for good at iteration 7: no iteration ends an optimizer step
    of both models again, so each due checkpoint is written after waiting the accumulation period."""
    written = run(32, gas=2, micro_per_iteration=2, interval=5, skipped_at=7)
    assert written == [5, 12, 17, 22, 27, 32]  # each due checkpoint after waiting lcm(2, 2) iterations
    out = capsys.readouterr().out
    assert out.count("waits") == 1 and out.count("a skipped (NaN/inf) micro-step shifted the accumulation") == 1
