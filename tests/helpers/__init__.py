"""Helpers shared by the test folders (imported as ``helpers``: pytest.ini puts ``tests/`` on the path).

- :mod:`helpers.steps`: the step scripts of steps 1, 2 and DPO imported from their files, their
  argument lists, checks of the folders they save, and subprocess runs (``cli_env``, ``run_cli``,
  ``deepspeed_cmd``).
- :mod:`helpers.step3`: the step-3 ``main`` module, critic and LoRA input folders, argument lists,
  weight comparisons and a crash right after a checkpoint.
- :mod:`helpers.data`: a small real tokenizer, preference rows and file writers for the data tests.
- :mod:`helpers.two_ranks`: a step script on 2 ranks under the DeepSpeed launcher, with each rank's
  weight digest; a Python script on two gloo ranks of its own (`run_gloo_ranks`).

Fixtures shared across folders live in ``tests/conftest.py``; files that subprocesses or
``--reward_fn`` load live in ``tests/fixtures/``.
"""
from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
PYTHON = sys.executable
