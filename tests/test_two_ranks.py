"""Two data-parallel CPU ranks under the DeepSpeed launcher (ZeRO-2): steps 1 and 2 end with
identical weights on both ranks, seen through ``DSCHAT_WEIGHT_DIGEST_DIR`` (each rank writes the
SHA-256 of its parameters at the end of training)."""
from __future__ import annotations

from pathlib import Path

import pytest
from _step_helpers import STEP_DIRS, base_argv, deepspeed_cmd, run_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("step,tag,model,extra", [
    ("step1", "step1", "tiny-llama", []),
    ("step2", "step2", "tiny-opt-quirk", ["--learning_rate", "1e-3"]),
])
def test_two_ranks_end_with_identical_weights(tmp_path, step, tag, model, extra):
    digests = tmp_path / "digests"
    out = tmp_path / "out"
    argv = base_argv(model, tmp_path / "data", *extra, "--zero_stage", "2", "--output_dir", str(out),
                     max_train_steps=3)
    proc = run_cli(deepspeed_cmd("main.py", *argv), cwd=STEP_DIRS[step],
                   DSCHAT_WEIGHT_DIGEST_DIR=str(digests))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    rank0 = (digests / f"{tag}-rank0.sha256").read_text().strip()
    rank1 = (digests / f"{tag}-rank1.sha256").read_text().strip()
    assert len(rank0) == 64 and rank0 == rank1
    assert "Reached --max_train_steps 3; stopping" in proc.stdout
    # Rank 0 prints the log lines once; both ranks train (2 x 4 pairs or sequences per step).
    assert proc.stdout.count("***** Running training *****") == 1
    # ... and training moved them (identical untouched weights would also hash equal).
    from safetensors.torch import load_file

    from dschat.models.registry import resolve_model_path

    saved = load_file(str(out / "model.safetensors"))
    start = load_file(str(Path(resolve_model_path(model)) / "model.safetensors"))
    common = [k for k in saved if k in start or f"model.{k}" in start]
    assert common and any(not saved[k].equal(start.get(k, start.get(f"model.{k}"))) for k in common)
