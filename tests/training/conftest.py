"""Fixtures of the training tests: one step-1 run on 2 ranks under the DeepSpeed launcher, which
test_two_ranks.py checks as a run and test_resume_reshape.py resumes from on other shapes (under
pytest-xdist the two files run on one worker, tests/conftest.py's ``SAME_WORKER``, so the run is made
once)."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.steps import base_argv
from helpers.two_ranks import TwoRankRun, run_two_ranks


@pytest.fixture(scope="session")
def two_rank_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--data_output_path`` of the shared 2-rank run and of the runs that resume from it."""
    return tmp_path_factory.mktemp("two_rank_data")


@pytest.fixture(scope="session")
def step1_two_ranks(two_rank_data: Path, tmp_path_factory: pytest.TempPathFactory) -> TwoRankRun:
    """Step 1 of tiny-llama on 2 ranks at ZeRO-2: 3 optimizer steps of 2 x 2 rows (dropout 0.1),
    a checkpoint at step 3, the final model in ``out`` and each rank's weight digest."""
    root = tmp_path_factory.mktemp("step1_two_ranks")
    argv = base_argv("tiny-llama", two_rank_data, "--zero_stage", "2", "--output_dir", str(root / "out"),
                     "--save_interval", "3", "--dropout", "0.1", max_train_steps=3, batch_size=2)
    return run_two_ranks("step1", argv, root / "out", root / "digests")
