"""Faults, as real processes meet them: step 1 SIGKILLed at a random step, in the middle of a
checkpoint, in the middle of the final model save; step 3 SIGKILLed at a random PPO iteration and
in the middle of a checkpoint; and a two-rank run in which rank 1 dies.

Every run is a subprocess of a step script. The kills inside a save are placed exactly (not a
timing race) by ``tests/fixtures/kill_at.py``, which wraps the script and SIGKILLs its own process right
after a chosen call. After each kill the test checks that the kill happened (exit status -9), what
is on disk, and that ``--resume`` ends with the weights of a run that was never interrupted, bit
for bit (exact on a CPU with ZeRO 0 and 2, see ``dschat/training/checkpoint.py``).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dschat.models.save import is_model_artifact
from dschat.runtime.run_lock import LOCK_NAME
from dschat.training import checkpoint as ckpt

from helpers import FIXTURES, PYTHON, REPO
from helpers.step3 import STEP3_DIR, base_argv as step3_argv, make_critic_folder
from helpers.steps import STEP_DIRS, base_argv, cli_env, free_port

pytestmark = pytest.mark.slow

KILL_AT = FIXTURES / "kill_at.py"
DEEPSPEED = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
STEPS = 8  # optimizer steps of every run (gradient accumulation 1: one micro-step each)
RUN_TIMEOUT_S = 300  # no run may hang the test suite
RANK_DEATH_EXIT_LIMIT_S = 120


@dataclass
class Run:
    """A finished subprocess: exit status and its output lines (stdout and stderr merged), each
    with the ``time.monotonic()`` at which the test read it."""

    returncode: int
    lines: list[tuple[float, str]]
    ended: float

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def when(self, needle: str) -> float:
        return next(t for t, line in self.lines if needle in line)

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-40:])


def watch(cmd: list[str], *, kill_on: str | None = None, cwd: Path = STEP_DIRS["step1"], **env: str) -> Run:
    """Run ``cmd`` in the step-1 folder in a process group of its own, reading its output as it
    comes; SIGKILL the process as soon as a line contains ``kill_on``. A run that outlives
    ``RUN_TIMEOUT_S`` has its whole group killed and fails the test."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if kill_on is not None and kill_on in line:
                proc.send_signal(signal.SIGKILL)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(10)
        pytest.fail(f"{cmd[:4]} ... was still running after {RUN_TIMEOUT_S} s; last output:\n"
                    + "\n".join(line for _, line in lines[-40:]))
    ended = time.monotonic()
    reader.join(10)
    return Run(proc.returncode, lines, ended)


def step1_argv(data_dir: Path, out: Path, *extra: str, steps: int = STEPS) -> list[str]:
    # A constant learning rate: with the default cosine schedule the rate is 0 at the last step,
    # and one extra step after a resume would go unseen in the weights.
    return ["main.py", *base_argv("tiny-llama", data_dir, "--zero_stage", "2", "--lr_scheduler_type", "constant",
                                  "--save_interval", "2", "--keep_checkpoints", "2", "--print_loss",
                                  "--output_dir", str(out), *extra, max_train_steps=steps, batch_size=2)]


def run_step1(data_dir: Path, out: Path, *extra: str, kill: str | None = None, kill_on: str | None = None,
              steps: int = STEPS) -> Run:
    """Step 1 as ``python main.py ...``; ``kill`` is a ``DSCHAT_TEST_KILL`` spec for kill_at.py."""
    argv = step1_argv(data_dir, out, *extra, steps=steps)
    if kill is None:
        return watch([PYTHON, *argv], kill_on=kill_on)
    return watch([PYTHON, str(KILL_AT), *argv], kill_on=kill_on, DSCHAT_TEST_KILL=kill)


def assert_killed(run: Run) -> None:
    assert run.returncode == -signal.SIGKILL, f"the run was not killed (exit {run.returncode}):\n{run.tail()}"


def assert_finished(run: Run) -> None:
    assert run.returncode == 0, f"the resumed run failed (exit {run.returncode}):\n{run.tail()}"


def assert_same_weights(folder: Path, reference: Path) -> None:
    got, expected = load_file(str(folder / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run's, e.g. {different[:3]}"


def trained_steps(run: Run) -> list[int]:
    """The micro-steps (0-based, within the epoch) the run trained, from its ``--print_loss`` lines."""
    return [int(m.group(1)) for m in re.finditer(r"^Epoch: 0, Step: (\d+), Rank: 0,", run.text, re.M)]


def resumed_at(run: Run) -> int:
    found = re.search(r"\[checkpoint\] resumed from \S+ \(epoch 0, (\d+) optimizer steps done\)", run.text)
    assert found, f"the run did not resume from a checkpoint:\n{run.tail()}"
    return int(found.group(1))


def names(folders: list[Path]) -> list[str]:
    return [p.name for p in folders]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults_data")


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    """The uninterrupted run every resumed run must match; its weights moved away from the start."""
    from dschat.models.registry import resolve_model_path

    out = tmp_path_factory.mktemp("faults_reference") / "out"
    run = run_step1(data_dir, out)
    assert run.returncode == 0, run.tail()
    assert trained_steps(run) == list(range(STEPS))
    saved = load_file(str(out / "model.safetensors"))
    start = load_file(str(Path(resolve_model_path("tiny-llama")) / "model.safetensors"))
    assert any(k in start and not torch.equal(v, start[k]) for k, v in saved.items()), "training changed no weight"
    return out


def test_kill_at_a_random_step_then_resume(data_dir, reference, tmp_path):
    # Checkpoints follow optimizer steps 2, 4, 6, 8; step k's loss line comes after k steps, so
    # from k = 2 on at least one checkpoint exists when the kill lands.
    k = random.Random(20241122).randint(2, STEPS - 1)
    out = tmp_path / "out"
    killed = run_step1(data_dir, out, kill_on=f"Epoch: 0, Step: {k}, Rank: 0,")
    assert_killed(killed)
    assert not (out / "model.safetensors").exists(), "the run finished before the kill"
    last = trained_steps(killed)[-1]  # k, or a step later if the kill took a moment to land
    assert last >= k

    resumed = run_step1(data_dir, out, "--resume")
    assert_finished(resumed)
    done = resumed_at(resumed)
    assert 2 <= done <= last + 1
    assert trained_steps(resumed) == list(range(done, STEPS)), f"killed at step {k}, resumed after {done}"
    assert_same_weights(out, reference)


def test_kill_while_writing_a_checkpoint_then_resume(data_dir, reference, tmp_path):
    out = tmp_path / "out"
    root = ckpt.checkpoint_root(out)
    killed = run_step1(data_dir, out, kill="checkpoint:3")  # the 3rd checkpoint: step 6
    assert_killed(killed)
    assert "[fault] rank 0: SIGKILL while writing checkpoint 3" in killed.text
    # The half-written one is left under its temporary name, with DeepSpeed's files but no marker;
    # the two before it are complete.
    partial = root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(6)}"
    assert partial.is_dir() and any(p.is_file() for p in partial.rglob("*"))
    assert not (partial / ckpt.MARKER).exists()
    assert names(ckpt.complete_checkpoints(root)) == ["step_00000002", "step_00000004"]

    resumed = run_step1(data_dir, out, "--resume")
    assert_finished(resumed)
    notices = [line for _, line in resumed.lines if "ignoring incomplete checkpoint" in line]
    assert len(notices) == 1 and partial.name in notices[0], notices
    assert resumed_at(resumed) == 4 and trained_steps(resumed) == list(range(4, STEPS))
    assert_same_weights(out, reference)
    assert names(ckpt.complete_checkpoints(root)) == ["step_00000006", "step_00000008"]
    assert not partial.exists()


def partial_saves(out: Path) -> list[Path]:
    """The hidden folders inside ``out`` that ``save_in_place`` writes a model into before renaming
    its entries into ``out``."""
    return sorted(out.glob(".dschat-staging-*"))


def test_kill_while_writing_the_final_model_then_resume(data_dir, reference, tmp_path):
    out = tmp_path / "out"
    killed = run_step1(data_dir, out, kill="final_save:1")
    assert_killed(killed)
    # No half-written model where the model belongs: output_dir holds the checkpoints only, the
    # weights written so far are in a hidden sibling that no loader looks at.
    assert [p.name for p in out.iterdir() if is_model_artifact(p.name)] == []
    [partial] = partial_saves(out)
    assert (partial / "model.safetensors").is_file() and not (partial / "tokenizer.json").exists()
    assert names(ckpt.complete_checkpoints(ckpt.checkpoint_root(out))) == ["step_00000006", "step_00000008"]

    # Training was over: the resumed run only saves (no extra step), and the result is the same.
    resumed = run_step1(data_dir, out, "--resume")
    assert_finished(resumed)
    assert resumed_at(resumed) == STEPS and trained_steps(resumed) == []
    assert_same_weights(out, reference)


def test_kill_while_replacing_a_model_leaves_the_old_one_intact(data_dir, reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoints"))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # A shorter run into the same folder, killed while its (different) model is being written.
    killed = run_step1(data_dir, out, "--save_interval", "0", kill="final_save:1", steps=2)
    assert_killed(killed)
    [partial] = partial_saves(out)
    assert (partial / "model.safetensors").read_bytes() != before["model.safetensors"]
    # the killed run's lock file stays behind, harmless (dschat/runtime/run_lock.py)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_NAME} == before
    AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)


def test_a_dying_rank_ends_the_two_rank_run_in_bounded_time(data_dir, tmp_path):
    out = tmp_path / "out"
    # --no_local_rank: the launcher would put --local_rank=N before kill_at.py's script argument.
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--no_local_rank", "--num_gpus", "2", str(KILL_AT),
           *step1_argv(data_dir, out, "--save_interval", "0")]
    run = watch(cmd, DSCHAT_TEST_KILL="step:3:1")  # rank 1 dies after its 3rd micro-step
    fault = "[fault] rank 1: SIGKILL after micro-step 3"
    assert fault in run.text, f"rank 1 was not killed:\n{run.tail()}"
    assert "Epoch: 0, Step: 2, Rank: 1," in run.text  # both ranks were training
    assert run.returncode != 0, f"the launcher reported success after a rank died:\n{run.tail()}"
    took = run.ended - run.when(fault)
    print(f"launcher exited with {run.returncode} {took:.1f} s after rank 1 was killed")
    assert took < RANK_DEATH_EXIT_LIMIT_S
    assert not (out / "model.safetensors").exists()
    # No rank outlives the launcher (the pids are in the launcher's "process N spawned" lines).
    pids = [int(p) for p in re.findall(r"process (\d+) spawned with command", run.text)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ------------------------------------------------------------------------------------------ step 3
PPO_ITERATIONS = 5


def run_step3(data_dir: Path, critic: Path, out: Path, *extra: str, kill: str | None = None,
              kill_on: str | None = None) -> Run:
    # EMA on and dropout in the actor: every saved state and the random states matter.
    argv = ["main.py", *step3_argv("tiny-opt", critic, data_dir, "--enable_ema", "--actor_dropout", "0.1",
                                   "--save_interval", "1", "--output_dir", str(out), *extra, steps=PPO_ITERATIONS)]
    if kill is None:
        return watch([PYTHON, *argv], kill_on=kill_on, cwd=STEP3_DIR)
    return watch([PYTHON, str(KILL_AT), *argv], kill_on=kill_on, cwd=STEP3_DIR, DSCHAT_TEST_KILL=kill)


def ppo_steps(run: Run) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^Epoch: 0 \| Step: (\d+) \| PPO Epoch", run.text, re.M)]


def assert_same_step3_weights(out: Path, reference: Path) -> None:
    for name in ("actor", "critic", "actor_ema"):
        got, expected = load_file(str(out / name / "model.safetensors")), load_file(str(reference / name / "model.safetensors"))
        assert all(torch.equal(got[k], expected[k]) for k in expected), f"{name} differs from the uninterrupted run's"


@pytest.fixture(scope="module")
def step3_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_step3")
    critic = make_critic_folder("tiny-opt", root / "critic")
    data = root / "data"
    reference = root / "reference"
    run = run_step3(data, critic, reference)
    assert run.returncode == 0, run.tail()
    assert ppo_steps(run) == list(range(PPO_ITERATIONS))
    return data, critic, reference


@pytest.mark.parametrize("how", ["at_a_random_iteration", "while_writing_a_checkpoint"])
def test_step3_killed_then_resumed_matches_the_uninterrupted_run(how, step3_setup, tmp_path):
    data, critic, reference = step3_setup
    out = tmp_path / "out"
    if how == "at_a_random_iteration":
        k = random.Random(7).randint(1, PPO_ITERATIONS - 2)
        killed = run_step3(data, critic, out, kill_on=f"Epoch: 0 | Step: {k} | PPO Epoch")
    else:  # each checkpoint saves the actor, then the critic: the 3rd call is the 2nd checkpoint's actor
        killed = run_step3(data, critic, out, kill="checkpoint:3")
        assert "[fault] rank 0: SIGKILL while writing checkpoint 3" in killed.text
        partial = ckpt.checkpoint_root(out) / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(2)}"
        assert partial.is_dir() and not (partial / ckpt.MARKER).exists()
    assert_killed(killed)
    # No final save: actor/ holds at most what its start-up made (the run lock of the folder it saves into).
    assert not (out / "actor").exists() or set(os.listdir(out / "actor")) <= {LOCK_NAME}
    done = len(ppo_steps(killed))

    resumed = run_step3(data, critic, out, "--resume")
    assert_finished(resumed)
    start = int(re.search(r"\[checkpoint\] resumed from \S+ \(epoch 0, (\d+) PPO steps done\)",
                          resumed.text).group(1))
    assert 1 <= start <= done
    assert ppo_steps(resumed) == list(range(start, PPO_ITERATIONS))
    assert_same_step3_weights(out, reference)
