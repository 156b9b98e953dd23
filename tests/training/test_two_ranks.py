"""Two data-parallel CPU ranks under the DeepSpeed launcher (ZeRO-2): steps 1 and 2 end with
identical weights on both ranks, seen through ``DSCHAT_WEIGHT_DIGEST_DIR`` (each rank writes the
SHA-256 of its parameters at the end of training), and their checkpoint holds both ranks' files.
With one output folder per rank (``DSCHAT_TEST_RANK_OUTPUT_ROOT``: node-local storage on two nodes)
a run that checkpoints stops at start-up, on both ranks, with one line."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from dschat.training import checkpoint as ckpt

from helpers.steps import STEP_DIRS, base_argv, deepspeed_cmd, run_cli
from helpers.two_ranks import run_two_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("step,model", [("step1", "tiny-llama"), ("step2", "tiny-opt-quirk")])
def test_two_ranks_end_with_identical_weights(request, tmp_path, step, model):
    if step == "step1":  # 2 x 2 sequences a step, the run test_resume_reshape.py resumes (conftest.py)
        run = request.getfixturevalue("step1_two_ranks")
    else:  # 2 x 4 pairs a step
        argv = base_argv(model, tmp_path / "data", "--learning_rate", "1e-3", "--zero_stage", "2", "--output_dir",
                         str(tmp_path / "out"), "--save_interval", "3", max_train_steps=3)
        run = run_two_ranks(step, argv, tmp_path / "out", tmp_path / "digests")
    proc, out = run.proc, run.out
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    # DeepSpeed's CPU shared-memory all-reduce buffers (69 MB a rank) are not left in /dev/shm.
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{run.port}_*"))
    rank0 = (run.digests / f"{step}-rank0.sha256").read_text().strip()
    rank1 = (run.digests / f"{step}-rank1.sha256").read_text().strip()
    assert len(rank0) == 64 and rank0 == rank1
    assert "Reached --max_train_steps 3; stopping" in proc.stdout
    # Rank 0 prints the log lines once; both ranks train.
    assert proc.stdout.count("***** Running training *****") == 1
    # ... and training moved them (identical untouched weights would also hash equal).
    from safetensors.torch import load_file

    from dschat.models.registry import resolve_model_path

    saved = load_file(str(out / "model.safetensors"))
    start = load_file(str(Path(resolve_model_path(model)) / "model.safetensors"))
    common = [k for k in saved if k in start or f"model.{k}" in start]
    assert common and any(not saved[k].equal(start.get(k, start.get(f"model.{k}"))) for k in common)
    # The checkpoint is complete with both ranks' parts: random states and ZeRO optimizer shards.
    [folder] = ckpt.complete_checkpoints(ckpt.checkpoint_root(out))
    assert folder.name == "step_00000003"
    for rank in (0, 1):
        assert (folder / f"rng_rank{rank}.json").is_file()
        assert (folder / "model" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()


def test_output_only_one_node_sees_stops_every_rank_with_one_line(tmp_path):
    argv = base_argv("tiny-llama", tmp_path / "data", "--zero_stage", "2", "--output_dir", str(tmp_path / "out"),
                     "--save_interval", "1", max_train_steps=1)
    proc = run_cli(deepspeed_cmd("main.py", *argv), cwd=STEP_DIRS["step1"],
                   DSCHAT_TEST_RANK_OUTPUT_ROOT=str(tmp_path / "nodes"))
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # One line per rank, each naming rank 1 and its host (the folder as that rank sees it); the
    # launcher may kill the second rank before it prints its line.
    assert 1 <= len(errors) <= 2, proc.stderr[-3000:]
    for line in errors:
        assert any(line.startswith(
            f"error: rank 1 on host {socket.gethostname()} cannot see the checkpoint folder "
            f"{tmp_path / 'nodes' / f'rank{rank}' / 'out' / 'checkpoints'} that rank 0 made; "
            "--output_dir (and --resume_from) must be a folder that every node sees") for rank in (0, 1)), line
    assert "Traceback" not in proc.stderr
    # Nothing trained, nothing saved: the model is never loaded.
    assert "***** Running training *****" not in proc.stdout
    assert not list((tmp_path / "nodes").rglob("model.safetensors"))
