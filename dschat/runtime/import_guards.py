"""Imports that dschat keeps out of its processes' start-up.

DeepSpeed imports its autotuner whenever it is imported (through its config module), and the
autotuner imports MLflow at module level when MLflow is installed, only to log autotuning trials.
dschat never runs DeepSpeed's autotuner, yet with MLflow installed (``pip install 'dschat[mlflow]'``,
``--report_to mlflow``) every one of its processes paid for that import at start-up: every rank of a
step script, ``e2e_rlhf.py``, the chatbot (benchmarks/results.md, "Start-up"). The ``deepspeed``
launcher's own processes import DeepSpeed without dschat, and still import MLflow.

:func:`keep_mlflow_out_of_deepspeeds_autotuner` makes ``import mlflow`` fail, as if MLflow were not
installed, only while DeepSpeed's autotuner module is being imported; the autotuner then runs
without its MLflow logging, as it does where MLflow is absent. Any other ``import mlflow`` -- dschat's
own tracker (:mod:`dschat.training.trackers`) included -- imports it as usual.
"""
from __future__ import annotations

import importlib.abc
import sys

__all__ = ["AUTOTUNER", "keep_mlflow_out_of_deepspeeds_autotuner"]

AUTOTUNER = "deepspeed.autotuning.autotuner"  # the module whose ``import mlflow`` is refused


def _autotuner_is_importing() -> bool:
    """Whether DeepSpeed's autotuner module is in the middle of its own import."""
    module = sys.modules.get(AUTOTUNER)
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _NoMlflowForTheAutotuner(importlib.abc.MetaPathFinder):
    """A finder, first on ``sys.meta_path``, that refuses ``mlflow`` to the importing autotuner and
    is silent (defers to the next finders) for every other import."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 -- the finder protocol
        if fullname == "mlflow" and _autotuner_is_importing():
            raise ModuleNotFoundError("dschat keeps MLflow out of DeepSpeed's autotuner", name=fullname)
        return None


def keep_mlflow_out_of_deepspeeds_autotuner() -> None:
    """Install the finder (once per process). Has no effect once DeepSpeed is imported."""
    if not any(isinstance(finder, _NoMlflowForTheAutotuner) for finder in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())
