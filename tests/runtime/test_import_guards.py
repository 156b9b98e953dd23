"""DeepSpeed's autotuner no longer imports MLflow into dschat's processes, and MLflow still imports
for everything else (dschat's ``--report_to mlflow`` tracker included); the step scripts freeze
what they imported out of the garbage collector's full collections."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import types

import pytest

from dschat.runtime.import_guards import AUTOTUNER, _NoMlflowForTheAutotuner

from helpers import REPO
from helpers.steps import cli_env

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="the test extra installs MLflow (mlflow-skinny)")

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


@needs_mlflow
def test_dschat_first_keeps_mlflow_out_of_deepspeeds_import_and_mlflow_still_imports():
    assert _probe("dschat") == {"after_deepspeed": False, "autotuner_has_mlflow": False, "mlflow_imports": True}


@needs_mlflow
def test_without_dschat_deepspeed_imports_mlflow():
    """What the guard saves: DeepSpeed alone imports MLflow, where installed, at import."""
    assert _probe("deepspeed") == {"after_deepspeed": True, "autotuner_has_mlflow": True, "mlflow_imports": True}


GUARD_PROBE = """
import json, sys
import dschat
from dschat.runtime.import_guards import _NoMlflowForTheAutotuner, keep_mlflow_out_of_deepspeeds_autotuner
def guards():
    return sum(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path)
keep_mlflow_out_of_deepspeeds_autotuner()
keep_mlflow_out_of_deepspeeds_autotuner()
installed = guards()
import deepspeed
after_deepspeed = guards()
assert "wave" not in sys.modules
import wave  # after DeepSpeed's import (whose own later imports already took the guard off) imports still work
after_next_import = guards()
keep_mlflow_out_of_deepspeeds_autotuner()
print(json.dumps([installed, after_deepspeed, after_next_import, guards(), hasattr(wave, "open")]))
"""


def test_the_guard_is_installed_once_and_leaves_after_deepspeeds_autotuner_is_imported():
    """Once DeepSpeed's autotuner is imported the guard has nothing left to do: it takes itself off
    ``sys.meta_path`` at the next import (which still finds its module), and is not installed again."""
    proc = subprocess.run([sys.executable, "-c", GUARD_PROBE], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed, after_deepspeed, after_next_import, reinstalled, imported = json.loads(proc.stdout.splitlines()[-1])
    assert installed == 1
    assert after_deepspeed <= 1  # imports after the autotuner's, inside DeepSpeed's own, may already remove it
    assert after_next_import == 0 and reinstalled == 0 and imported


class _Recorder(importlib.abc.MetaPathFinder):
    """A finder that records what it is asked and finds nothing."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 -- the finder protocol
        self.asked.append(fullname)
        return None


def _autotuner_stub(initializing: bool) -> types.ModuleType:
    stub = types.ModuleType(AUTOTUNER)
    stub.__spec__ = importlib.machinery.ModuleSpec(AUTOTUNER, None)
    stub.__spec__._initializing = initializing
    return stub


def test_the_guard_leaving_during_an_import_does_not_skip_the_next_finder(monkeypatch):
    """The guard leaves ``sys.meta_path`` in the middle of an import that is iterating over it; the
    finder after it must still be asked (removing the guard from that same list would skip it)."""
    guard, recorder = _NoMlflowForTheAutotuner(), _Recorder()
    monkeypatch.setattr(sys, "meta_path", [guard, recorder, *sys.meta_path])
    monkeypatch.setitem(sys.modules, AUTOTUNER, _autotuner_stub(initializing=False))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dschat_no_such_module_for_the_guard")
    assert recorder.asked == ["dschat_no_such_module_for_the_guard"]
    assert guard not in sys.meta_path and recorder in sys.meta_path


def test_the_guard_refuses_mlflow_only_while_the_autotuner_imports(monkeypatch):
    guard, recorder = _NoMlflowForTheAutotuner(), _Recorder()
    monkeypatch.setattr(sys, "meta_path", [guard, recorder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "mlflow", raising=False)
    monkeypatch.setitem(sys.modules, AUTOTUNER, _autotuner_stub(initializing=True))
    with pytest.raises(ModuleNotFoundError, match="dschat keeps MLflow out of DeepSpeed's autotuner"):
        importlib.import_module("mlflow")
    assert recorder.asked == [] and guard in sys.meta_path  # refused before any other finder; still needed
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dschat_no_such_module_for_the_guard")
    assert recorder.asked == ["dschat_no_such_module_for_the_guard"]  # any other import goes on as usual


FREEZE_PROBE = """
import gc, weakref
import torch  # as a step script's imports: what freeze_imported is for
from dschat.runtime.import_guards import freeze_imported
freeze_imported()
frozen = gc.get_freeze_count()
class Node: pass
node = Node(); node.me = node  # a reference cycle made after the freeze
ref = weakref.ref(node); del node
gc.collect()
print(frozen, ref() is None)
"""


def test_freeze_imported_freezes_what_is_imported_and_later_garbage_is_still_collected():
    proc = subprocess.run([sys.executable, "-c", FREEZE_PROBE], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frozen, collected = proc.stdout.split()
    assert int(frozen) > 10_000 and collected == "True"  # torch alone brings far more objects


@pytest.mark.parametrize("step", ["step1_supervised_finetuning", "step2_reward_model_finetuning",
                                  "step2_dpo_finetuning", "step3_rlhf_finetuning"])
def test_each_step_script_freezes_its_imports_before_running(step):
    text = (REPO / "training" / step / "main.py").read_text()
    assert 'if __name__ == "__main__":\n    freeze_imported()' in text
