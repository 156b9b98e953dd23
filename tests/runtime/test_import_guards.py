"""DeepSpeed's autotuner no longer imports MLflow into dschat's processes, and MLflow still imports
for everything else (dschat's ``--report_to mlflow`` tracker included)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO
from helpers.steps import cli_env

pytest.importorskip("mlflow")  # the test extra installs it (mlflow-skinny)

PROBE = """
import json, sys
first = sys.argv[1]
if first == "dschat":
    import dschat
import deepspeed
from deepspeed.autotuning import autotuner
after_deepspeed = "mlflow" in sys.modules
import mlflow
from dschat.training.trackers import Trackers
print(json.dumps({"after_deepspeed": after_deepspeed, "autotuner_has_mlflow": autotuner.has_mlflow,
                  "mlflow_imports": hasattr(mlflow, "log_metric")}))
"""


def _probe(first: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, first], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dschat_first_keeps_mlflow_out_of_deepspeeds_import_and_mlflow_still_imports():
    assert _probe("dschat") == {"after_deepspeed": False, "autotuner_has_mlflow": False, "mlflow_imports": True}


def test_without_dschat_deepspeed_imports_mlflow():
    """What the guard saves: DeepSpeed alone imports MLflow, where installed, at import."""
    assert _probe("deepspeed") == {"after_deepspeed": True, "autotuner_has_mlflow": True, "mlflow_imports": True}


def test_the_guard_is_installed_once():
    import dschat  # noqa: F401 -- installs it
    from dschat.runtime.import_guards import _NoMlflowForTheAutotuner, keep_mlflow_out_of_deepspeeds_autotuner

    keep_mlflow_out_of_deepspeeds_autotuner()
    keep_mlflow_out_of_deepspeeds_autotuner()
    assert sum(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path) == 1
