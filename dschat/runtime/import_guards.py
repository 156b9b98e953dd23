"""Imports that dschat keeps out of its processes' start-up, and the imported objects it keeps out
of the garbage collector's way.

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

:func:`freeze_imported`, which the step scripts call after their imports, moves what they imported
out of the garbage collector's full collections: DeepSpeed runs one at every ZeRO-3 engine's set-up.
"""
from __future__ import annotations

import gc
import importlib.abc
import sys

__all__ = ["AUTOTUNER", "freeze_imported", "keep_mlflow_out_of_deepspeeds_autotuner"]

AUTOTUNER = "deepspeed.autotuning.autotuner"  # the module whose ``import mlflow`` is refused


def _autotuner_is_importing() -> bool:
    """Whether DeepSpeed's autotuner module is in the middle of its own import."""
    module = sys.modules.get(AUTOTUNER)
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _autotuner_is_imported() -> bool:
    """Whether DeepSpeed's autotuner module has finished its import."""
    return AUTOTUNER in sys.modules and not _autotuner_is_importing()


class _NoMlflowForTheAutotuner(importlib.abc.MetaPathFinder):
    """A finder, first on ``sys.meta_path``, that refuses ``mlflow`` to the importing autotuner and
    is silent (defers to the next finders) for every other import. Once the autotuner is imported
    it has nothing left to do, and the first import after that takes it off ``sys.meta_path``, so
    later imports no longer pass through it. While the autotuner imports, a probe such as
    ``importlib.util.find_spec("mlflow")`` raises ``ModuleNotFoundError`` instead of returning None
    (nothing the autotuner imports probes for MLflow)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 -- the finder protocol
        if fullname == "mlflow" and _autotuner_is_importing():
            raise ModuleNotFoundError("dschat keeps MLflow out of DeepSpeed's autotuner", name=fullname)
        if _autotuner_is_imported():
            # A new list: the import system is iterating over the current one right now, and
            # removing an entry from it in place would skip the finder after this one.
            sys.meta_path = [finder for finder in sys.meta_path if finder is not self]
        return None


def keep_mlflow_out_of_deepspeeds_autotuner() -> None:
    """Install the finder (once per process), unless DeepSpeed's autotuner is already imported."""
    if _autotuner_is_imported():
        return
    if not any(isinstance(finder, _NoMlflowForTheAutotuner) for finder in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())


def freeze_imported() -> None:
    """For a step script's ``__main__``, after its imports: every object the garbage collector tracks
    so far (mostly the modules of torch, transformers, DeepSpeed and dschat, which live as long as the
    process) leaves its full collections for good (``gc.freeze``), so that the one DeepSpeed runs at
    every ZeRO-3 engine's set-up no longer scans them all. Not for code that runs a step's ``main``
    in-process: what is alive when it is called is never collected."""
    gc.freeze()
