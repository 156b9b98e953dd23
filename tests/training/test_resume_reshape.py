"""Resuming on another shape: a checkpoint written on 2 ranks resumes on 1 and the reverse, and on
another ZeRO stage, from dschat's consolidated state (dschat/training/consolidated.py). After the
load every trainable parameter's fp32 master value, both Adam moments, the step counts, the
learning rates, the LR schedule and DeepSpeed's counters equal the saved ones (gathered by the
same code from the resumed engines, under the launcher for 2 ranks); the data position is
converted exactly (checked against torch's DistributedSampler) or refused in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DistributedSampler

from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.training import checkpoint as ckpt
from dschat.training import consolidated

from helpers import PYTHON
from helpers.step3 import STEP3_DIR, base_argv as step3_argv, step3_main
from helpers.steps import STEP_DIRS, base_argv, deepspeed_cmd, load_script, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "reshape_worker.py"


def step1_argv(data: Path, out: Path, stage: int, *more: str, steps: int) -> list[str]:
    """tiny-llama, batch 2 on each rank, a checkpoint every ``steps`` optimizer steps."""
    return base_argv("tiny-llama", data, "--zero_stage", str(stage), "--output_dir", str(out), "--save_interval",
                     str(steps), "--dropout", "0.1", *more, max_train_steps=steps, batch_size=2)


def assert_same_state(saved: Path, dumped: Path, tags: tuple[str, ...]) -> None:
    """The consolidated files of a checkpoint and a dump of the resumed engines hold equal tensors
    (fp32 masters, both moments) and equal steps, learning rates, schedules and counters."""
    records = json.loads((dumped / "records.json").read_text())
    state = json.loads((saved / consolidated.STATE).read_text())
    for tag in tags:
        for kind in consolidated.KINDS:
            before = load_file(str(saved / f"{tag}.{kind}.safetensors"))
            after = load_file(str(dumped / f"{tag}.{kind}.safetensors"))
            assert sorted(before) == sorted(after) and before, (tag, kind)
            unequal = [name for name in before if not torch.equal(before[name], after[name])]
            assert not unequal, (tag, kind, unequal[:3])
            if kind != "fp32":  # training ran: the moments are not all zero
                assert any(t.abs().sum() > 0 for t in before.values()), (tag, kind)
        old, new = state["engines"][tag], records[tag]
        assert min(old["steps"].values()) > 0
        for key in ("parameters", "param_groups", "steps", "scheduler", "counters"):
            assert old[key] == new[key], (tag, key)


def resume_in_process(step: str, argv: list[str], out: Path, tags: tuple[str, ...], capsys) -> str:
    """Run ``step`` here (1 rank), dump its engines' state into ``out``; return what it printed."""
    import sys

    sys.path.insert(0, str(WORKER.parent))
    from reshape_worker import dump, trained_engines

    capsys.readouterr()
    dump(trained_engines(step, argv), out)
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def data_dir(two_rank_data):
    return two_rank_data


@pytest.fixture(scope="module")
def step1_on_two_ranks(step1_two_ranks):
    """Step 1 on 2 ranks at ZeRO-2 (step1_argv(data_dir, out, 2, steps=3), run once for the
    training tests: tests/training/conftest.py): 3 optimizer steps of 2 x 2 rows, checkpointed at step 3."""
    proc = step1_two_ranks.proc
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return step1_two_ranks.out / "checkpoints" / ckpt.checkpoint_name(3)


@pytest.mark.parametrize("stage", [2, 3, 0])
def test_step1_saved_on_two_ranks_resumes_on_one(stage, step1_on_two_ranks, data_dir, tmp_path, capsys):
    folder = step1_on_two_ranks
    argv = step1_argv(data_dir, tmp_path / "out", stage, "--resume_from", str(folder), steps=3)
    printed = resume_in_process("step1", argv, tmp_path / "dump", ("model",), capsys)
    assert_same_state(folder / consolidated.FOLDER, tmp_path / "dump", ("model",))
    # 3 batches of 2 on each of 2 ranks = the first 12 rows of the epoch's order: 6 batches of 2 here.
    assert (f"[checkpoint] resumed on another shape: saved on 2 rank(s) (model ZeRO 2), resumed on 1 rank(s) "
            f"(model ZeRO {stage}); ") in printed
    assert "3 batches of epoch 0 done there are 6 on each rank here" in printed


def test_saved_on_one_rank_at_zero3_resumes_on_two_at_zero0(data_dir, tmp_path):
    main = load_script("step1").main
    main(step1_argv(data_dir, tmp_path / "one", 3, steps=2))
    folder = tmp_path / "one" / "checkpoints" / ckpt.checkpoint_name(2)
    argv = step1_argv(data_dir, tmp_path / "two", 0, "--resume_from", str(folder), steps=2)
    proc = run_cli(deepspeed_cmd(str(WORKER), str(tmp_path / "dump"), "step1", *argv), cwd=STEP_DIRS["step1"])
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert_same_state(folder / consolidated.FOLDER, tmp_path / "dump", ("model",))
    assert ("resumed on another shape: saved on 1 rank(s) (model ZeRO 3), resumed on 2 rank(s) (model ZeRO 0)"
            in proc.stdout)
    assert "2 batches of epoch 0 done there are 1 on each rank here" in proc.stdout


class Interrupted(Exception):
    """Stands in for a crash right after a checkpoint."""


def test_a_run_resumed_at_another_stage_trains_on_like_the_uninterrupted_one(data_dir, tmp_path, monkeypatch):
    """What the load restores is what training needs: the losses after the resume are the
    uninterrupted run's (ZeRO-2 then ZeRO-3 against ZeRO-2 throughout, one rank, fp32)."""
    main = load_script("step1").main
    save = ckpt.Checkpointer.maybe_save

    def crash_after_step_2(self, position):
        saved = save(self, position)
        if position.optimizer_steps == 2:
            raise Interrupted
        return saved

    def argv(out, stage, *more):
        return base_argv("tiny-llama", data_dir, "--zero_stage", str(stage), "--output_dir", str(out),
                         "--save_interval", "2", "--gradient_accumulation_steps", "2", *more,
                         max_train_steps=4, batch_size=2)

    full = main(argv(tmp_path / "full", 2))
    monkeypatch.setattr(ckpt.Checkpointer, "maybe_save", crash_after_step_2)
    with pytest.raises(Interrupted):
        main(argv(tmp_path / "cut", 2))
    monkeypatch.undo()
    resumed = main(argv(tmp_path / "resumed", 3, "--resume_from",
                        str(tmp_path / "cut" / "checkpoints" / ckpt.checkpoint_name(2))))
    assert resumed.optimizer_steps == 4
    torch.testing.assert_close(torch.tensor(resumed.train_losses), torch.tensor(full.train_losses[4:]),
                               rtol=0, atol=1e-5)


def test_step3_saved_on_two_ranks_resumes_on_one(critic_dirs, data_cache, tmp_path, capsys):
    """Actor and critic of a PPO run on 2 ranks (ZeRO-2) resume on 1 rank (actor ZeRO-3, critic ZeRO-0)."""
    def argv(out, actor_stage, critic_stage, *more):
        return step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--actor_zero_stage", str(actor_stage),
                          "--critic_zero_stage", str(critic_stage), "--save_interval", "1",
                          "--output_dir", str(out), *more, steps=2)

    proc = run_cli(deepspeed_cmd("main.py", *argv(tmp_path / "two", 2, 2)), cwd=STEP3_DIR)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    [folder] = ckpt.complete_checkpoints(ckpt.checkpoint_root(tmp_path / "two"))[-1:]
    printed = resume_in_process("step3", argv(tmp_path / "one", 3, 0, "--resume_from", str(folder)),
                                tmp_path / "dump", ("actor", "critic"), capsys)
    assert_same_state(folder / consolidated.FOLDER, tmp_path / "dump", ("actor", "critic"))
    assert ("resumed on another shape: saved on 2 rank(s) (actor ZeRO 2, critic ZeRO 2), resumed on 1 rank(s) "
            "(actor ZeRO 3, critic ZeRO 0)") in printed


def test_a_checkpoint_without_consolidated_state_is_refused_on_another_shape(step1_on_two_ranks, data_dir,
                                                                              tmp_path, capsys):
    folder = tmp_path / ckpt.checkpoint_name(3)
    shutil.copytree(step1_on_two_ranks, folder)
    shutil.rmtree(folder / consolidated.FOLDER)
    capsys.readouterr()
    code = cli_main(load_script("step1").main,
                    step1_argv(data_dir, tmp_path / "out", 2, "--resume_from", str(folder), steps=3))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == EXIT_USAGE and "Traceback" not in err, err[-2000:]
    assert lines == [f"error: {folder} was written on 2 rank(s) without dschat's consolidated state, so it loads "
                     "only on the same shape; resume with 2 rank(s) and the ZeRO stage that wrote it"]


# ------------------------------------------------------------------------------------------------
# The data position, against torch's DistributedSampler
# ------------------------------------------------------------------------------------------------
class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loader(n: int, world: int, rank: int, batch: int, drop_last: bool = False) -> torch.utils.data.DataLoader:
    sampler = DistributedSampler(Rows(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
    sampler.set_epoch(3)
    return torch.utils.data.DataLoader(Rows(n), batch_size=batch, sampler=sampler, drop_last=drop_last)


def rows(n: int, world: int, batch: int, first: int, last: int | None = None, drop_last: bool = False) -> list[int]:
    """The rows every rank trains in batches ``first`` .. ``last`` (exclusive) of the epoch."""
    return sorted(int(i) for rank in range(world)
                  for b, batch_rows in enumerate(loader(n, world, rank, batch, drop_last))
                  if first <= b < (last if last is not None else 10**9) for i in batch_rows)


@pytest.mark.parametrize("n,old,new,done", [
    (23, (2, 2), (1, 2), 3),  # 2 ranks -> 1, same batch
    (23, (1, 4), (2, 2), 2),  # 1 rank -> 2, half the batch
    (40, (2, 2), (4, 1), 5),
    (23, (2, 2), (1, 2), 6),  # the epoch was finished
])
def test_converted_position_continues_the_epoch_exactly(n, old, new, done):
    shapes = [consolidated.loader_order(loader(n, w, 0, b)) for w, b in (old, new)]
    skip = consolidated.convert_batches_done(done, [shapes[0]], [shapes[1]])
    trained = rows(n, *old, 0, done)
    rest = rows(n, *new, skip)
    if done >= len(loader(n, old[0], 0, old[1])):  # nothing of this epoch is left on either shape
        assert skip == len(loader(n, new[0], 0, new[1])) and rest == []
        return
    # Every row of the epoch, each once; the new shape's sampler repeats the first rows of the
    # order to even out its ranks (ceil(n / W') * W' rows in all), as in an uninterrupted run.
    assert set(trained) | set(rest) == set(range(n))
    assert len(trained) + len(rest) == -(-n // new[0]) * new[0]


def test_a_position_that_is_not_whole_batches_here_is_one_line():
    old = consolidated.loader_order(loader(23, 1, 0, 2))
    new = consolidated.loader_order(loader(23, 2, 0, 2))
    with pytest.raises(UserError) as err:
        consolidated.convert_batches_done(3, [old], [new])
    assert str(err.value).startswith("the checkpoint is 3 batches of 2 into its epoch on 1 rank(s) (6 samples), not a "
                                      "whole number of batches of 2 on 2 rank(s)")
    other = dict(new, seed=8)
    with pytest.raises(UserError, match="the training data's seed is 8 here but was 7"):
        consolidated.convert_batches_done(2, [old], [other])


def test_on_the_same_shape_the_data_position_is_checked_and_converted_too(tmp_path):
    """A checkpoint that DeepSpeed's own files can load (same world size and ZeRO stage) still
    carries its data order: another seed or dataset size is one line, another batch size converted."""
    from types import SimpleNamespace

    folder = tmp_path / "step_4"
    (folder / consolidated.FOLDER).mkdir(parents=True)
    saved = consolidated.loader_order(loader(23, 1, 0, 2))
    (folder / consolidated.FOLDER / consolidated.STATE).write_text(json.dumps(
        {"format": consolidated.FORMAT_VERSION, "world_size": 1, "data": [saved], "engines": {"e": {"zero_stage": 0}}}))
    engines = {"e": SimpleNamespace(zero_optimization_stage=lambda: 0, gradient_accumulation_steps=lambda: 1)}

    def resumed(now: torch.utils.data.DataLoader, done: int = 4) -> int:
        position = SimpleNamespace(epoch=0, epoch_micro_steps=done, micro_steps=4, optimizer_steps=4)
        assert consolidated.resume_on_new_shape(folder, engines, 0, position, [now]) is None  # DeepSpeed's files fit
        return position.epoch_micro_steps

    assert resumed(loader(23, 1, 0, 2)) == 4
    assert resumed(loader(23, 1, 0, 4)) == 2  # 8 rows done: two batches of 4
    with pytest.raises(UserError, match="the training data's dataset_size is 30 here but was 23"):
        resumed(loader(30, 1, 0, 2))
    other = loader(23, 1, 0, 2)
    other.sampler.seed = 8
    with pytest.raises(UserError, match="the training data's seed is 8 here but was 7"):
        resumed(other)
    assert resumed(other, done=0) == 0  # at an epoch's start nothing is skipped
