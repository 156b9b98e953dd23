"""Experiment trackers: a run's scalars and its flags, from rank 0, to TensorBoard, Weights & Biases
and MLflow (``--report_to``; docs/metrics.md#experiment-trackers).

:class:`Trackers` fans ``scalars(step, **values)`` out to one sink per tracker, all at the same x
(steps 1-2: the optimizer step; step 3: the global PPO iteration). ``TensorBoardLogger`` is the same
class: ``TensorBoardLogger(enabled, path, name)`` is TensorBoard alone, as ``--enable_tensorboard``.

* TensorBoard: ``<tensorboard_path>/<name>`` (event files). A resumed run calls :meth:`Trackers.resume_at`
  with the checkpoint's step: TensorBoard then hides what an earlier attempt logged from that step on.
* W&B: ``wandb.init`` under ``<root>/wandb/`` (``$WANDB_DIR`` when set), offline unless ``$WANDB_MODE``
  is set; project ``$WANDB_PROJECT`` or ``dschat``; every scalar is plotted against ``global_step``. A set
  ``$WANDB_DIR`` is checked as the run's other folders are (W&B itself would fall back to a temporary folder).
* MLflow: ``$MLFLOW_TRACKING_URI``, else the file store ``file:<root>/mlruns``; experiment
  ``$MLFLOW_EXPERIMENT_NAME`` or ``dschat``; the flags are the run's parameters; a process that exits
  without :meth:`Trackers.close` (an error) ends the run ``FAILED``; a single-process run stopped by
  SIGTERM (a scheduler, ``kill``) ends it ``KILLED``, then the signal's own handling goes on. With
  several ranks no SIGTERM handler is set: a rank blocked in a collective could not run it, and it
  would hold up the launcher stopping the ranks (their runs stay ``RUNNING``, as after SIGKILL).

``<root>`` is ``--output_dir``, else ``--tensorboard_path``. W&B and MLflow are optional extras: a
tracker asked for and not installed is a :class:`~dschat.errors.UserError` on every rank, raised by
the constructor (which the step scripts call before any model is loaded). A sink whose ``log`` raises
mid-run is dropped with one warning; the run and the other sinks go on. A resumed run is a new W&B and
MLflow run, from the checkpoint's step on (docs/metrics.md#resumed-runs).
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

import torch

from dschat.errors import UserError, first_line, shown_url
from dschat.runtime.fs import check_writable_dir

__all__ = ["EXTRAS", "Trackers", "TensorBoardLogger", "trackers_of", "run_config", "mlflow_name"]

#: tracker -> (module imported, setup.py extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
#: What MLflow accepts in a metric or parameter name; anything else becomes "_" (:func:`mlflow_name`).
_MLFLOW_NAME = re.compile(r"[^\w./\- :]")
_MLFLOW_BATCH = 100  # MLflow's most parameters or metrics in one log_batch call
_MLFLOW_PARAM_CHARS = 6000  # MLflow's longest parameter value
# A tracking server that is down must not hold rank 0 (and every rank waiting for it in a collective)
# for many minutes per call, as MLflow's own defaults do (7 retries, backoff factor 2, a long wait for
# each answer). These bound one call to under a minute; a variable the user set wins.
MLFLOW_HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                      "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


def _import_extra(tracker: str) -> ModuleType:
    """The optional package of ``tracker``, or one line naming the extra that installs it."""
    module, extra = EXTRAS[tracker]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserError(f"--report_to {tracker} needs the {extra} extra, which is not installed "
                        f"({first_line(err)}): pip install 'dschat[{extra}]'") from err


def trackers_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The trackers a step's flags ask for: ``--report_to``'s list (default: none), with
    ``tensorboard`` added by ``--enable_tensorboard`` (upstream's spelling of it)."""
    names = tuple(getattr(args, "report_to", None) or ())
    if getattr(args, "enable_tensorboard", False) and "tensorboard" not in names:
        names = ("tensorboard", *names)
    return names


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags as a tracker's config: numbers, strings, booleans, ``None`` and lists of them
    as parsed; anything else (a path) as its ``str``; ``--reward_url`` without its user, password and query."""
    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return str(value)

    config = {key: plain(value) for key, value in sorted(vars(args).items())}
    if isinstance(config.get("reward_url"), str):  # a password or token in it stays out of the tracker
        config["reward_url"] = shown_url(config["reward_url"])
    return config


class _TensorBoardSink:
    label = "TensorBoard"

    def __init__(self, path: str, name: str) -> None:
        self.folder = str(Path(path) / name)
        self.writer = self._open(None)

    def _open(self, purge_step: int | None) -> Any:
        # lazy: the tensorboard writer costs 0.07 s at import and most runs do not log to it
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(self.folder, purge_step=purge_step)

    def resume_at(self, step: int) -> None:
        """Reopen the writer with ``purge_step=step``: a new event file whose first event tells
        TensorBoard to hide the events of ``step`` and later that earlier files of the folder hold."""
        self.writer.close()
        self.writer = self._open(step)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()

    def abandon(self) -> None:
        """After a failed ``log``: close what can be closed (one warning if that fails too)."""
        _close_quietly(self)


class _WandbSink:
    label = "W&B"

    @staticmethod
    def store(root: Path) -> str:
        """Where the run is written, for a line saying it could not start."""
        return f"under {os.environ.get('WANDB_DIR') or root}"

    def __init__(self, wandb: ModuleType, root: Path, run_name: str, config: Mapping[str, Any]) -> None:
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "dschat", name=os.environ.get("WANDB_NAME") or run_name,
            dir=os.environ.get("WANDB_DIR") or str(root),  # explicit: W&B reads its variables once per process
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            config=dict(config), reinit="create_new",
            settings=wandb.Settings(console="off"))  # stdout stays the run's own
        # Every scalar against the run's own step, whatever order evaluation and training log in.
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({"global_step": step, **values})

    def close(self, failed: bool = False) -> None:
        self.run.finish(**({"exit_code": 1} if failed else {}))

    def abandon(self) -> None:
        """After a failed ``log``: finish the run as far as W&B can (one warning if that fails too)."""
        _close_quietly(self)


def mlflow_name(key: str) -> str:
    """``key`` as a metric or parameter name MLflow accepts: characters it refuses become ``_``, and the
    name is a plain relative path (no empty, ``.`` or ``..`` parts), since MLflow refuses one that
    normalises to another (``eval/judge/<--eval_judge>`` with an absolute or ``./`` folder)."""
    parts = [{".": "_", "..": "__"}.get(part, part) for part in _MLFLOW_NAME.sub("_", key).split("/") if part]
    return "/".join(parts) or "_"


class _MlflowSink:
    label = "MLflow"

    @staticmethod
    def store(root: Path) -> str:
        """The store the run goes to (``MLFLOW_TRACKING_URI`` without its user, password or query), for a
        line saying it could not start."""
        from_env = os.environ.get("MLFLOW_TRACKING_URI")
        return f"in MLFLOW_TRACKING_URI {shown_url(from_env)}" if from_env else f"under {root / 'mlruns'}"

    def __init__(self, mlflow: ModuleType, root: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from_env = os.environ.get("MLFLOW_TRACKING_URI")
        uri = from_env or (root / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses its file store unless this is set; a local file store is what this run asked for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        else:
            for name, value in MLFLOW_HTTP_LIMITS.items():
                os.environ.setdefault(name, value)
        self.metric, self.param = mlflow.entities.Metric, mlflow.entities.Param
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dschat"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [self.param(mlflow_name(key), str(value)[:_MLFLOW_PARAM_CHARS])
                  for key, value in config.items()]
        for i in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _MLFLOW_BATCH])
        atexit.register(self._end_failed)  # a process that exits without close() (a crash) ends it FAILED
        self._open = True  # until the run is ended, one way or another
        self._previous_sigterm = None
        self._pid = os.getpid()  # a forked child inherits the handler, not the run
        single = not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1)
        if (single and threading.current_thread() is threading.main_thread()  # handlers live in the main thread
                and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN):
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._end_killed)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(mlflow_name(key), value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_BATCH])

    def close(self, failed: bool = False) -> None:
        self._forget_exit_hooks()
        self._end("FAILED" if failed else "FINISHED")

    def abandon(self) -> None:
        """After a failed ``log``: stop, without asking the server that just failed to end the run (it
        stays ``RUNNING`` there)."""
        self._forget_exit_hooks()
        self._open = False

    def _forget_exit_hooks(self) -> None:
        atexit.unregister(self._end_failed)
        if (self._previous_sigterm is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == self._end_killed):
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    def _end(self, status: str) -> None:
        if self._open:
            self._open = False
            self.client.set_terminated(self.run_id, status=status)

    def _end_failed(self) -> None:
        self._end("FAILED")

    def _end_killed(self, signum: int, frame: Any) -> None:
        """SIGTERM: the run ends ``KILLED``; then the handler that was there before runs (the default
        one ends the process by the same signal, as if this hook were not there)."""
        previous = self._previous_sigterm
        self._forget_exit_hooks()
        if os.getpid() == self._pid:  # not in a forked child (a worker pool's, stopped by SIGTERM)
            try:
                self._end("KILLED")
            except Exception:  # noqa: BLE001 -- the process is being stopped; the tracker must not prevent it
                pass
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


class Trackers:
    """Rank-0 scalars to every tracker asked for, at a step that never resets across epochs
    (docs/upstream.md#step-3-ppo); on other ranks (and with no tracker) ``scalars`` does nothing.

    ``report_to``: tracker names (``tensorboard``, ``wandb``, ``mlflow``), or a bool for TensorBoard
    alone. ``path`` / ``name``: TensorBoard's folder ``<path>/<name>``. ``run_name``: the W&B / MLflow
    run's name (default ``name``); ``config``: its flags; ``root``: the folder under which W&B and a
    default MLflow store write (default ``path``). Raises :class:`~dschat.errors.UserError` on every
    rank when an extra is missing, and on rank 0 when a tracker cannot start or ``$WANDB_DIR`` (set,
    with ``wandb``) is not a folder it can create or write.
    """

    def __init__(self, report_to: bool | Sequence[str], path: str, name: str, *, run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, root: str | None = None) -> None:
        names = (("tensorboard",) if report_to else ()) if isinstance(report_to, bool) else tuple(report_to)
        modules = {tracker: _import_extra(tracker) for tracker in names if tracker in EXTRAS}  # every rank
        self.sinks: list[_TensorBoardSink | _WandbSink | _MlflowSink] = []
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        run_name, config = run_name or name, dict(config or {})
        for tracker in names:
            if tracker == "tensorboard":
                self.sinks.append(_TensorBoardSink(path, name))
                continue
            folder = Path(os.path.expanduser(root or path))
            check_writable_dir(folder, "--output_dir" if root else "--tensorboard_path")
            if tracker == "wandb" and os.environ.get("WANDB_DIR"):  # else W&B falls back to a temporary folder
                check_writable_dir(os.environ["WANDB_DIR"], "WANDB_DIR")
            folder.mkdir(parents=True, exist_ok=True)
            sink_class = _WandbSink if tracker == "wandb" else _MlflowSink
            try:
                self.sinks.append(sink_class(modules[tracker], folder, run_name, config))
            except Exception as err:  # a tracker's own failure, whatever its type: one line, before training
                self.close(failed=True)  # the runs already started end failed: nothing was trained
                detail, uri = first_line(err), os.environ.get("MLFLOW_TRACKING_URI")
                if tracker == "mlflow" and uri:  # MLflow's message quotes the URI, a password in it too
                    detail = detail.replace(uri, shown_url(uri))
                raise UserError(f"--report_to {tracker}: {sink_class.label} could not start a run "
                                f"{sink_class.store(folder)} ({type(err).__name__}: {detail}); fix its settings or "
                                "drop it from --report_to") from err

    @classmethod
    def from_args(cls, args: argparse.Namespace, name: str, run_name: str) -> Trackers:
        """The trackers a step's flags ask for (:func:`trackers_of`), with its flags as their config."""
        return cls(trackers_of(args), args.tensorboard_path, name, run_name=run_name, config=run_config(args),
                   root=getattr(args, "output_dir", None))

    def scalars(self, step: int, **values: float) -> None:
        """Log ``values`` at ``step`` to every sink still running. A sink whose call raises is dropped
        with one warning on stderr (the exception's type and first line) and abandoned: TensorBoard and
        W&B close what they can; an MLflow run is left as it is, its server not asked again."""
        if not self.sinks:
            return
        values = {key: float(value) for key, value in values.items()}
        for sink in list(self.sinks):
            try:
                sink.log(step, values)
            except Exception as err:  # any tracker failure: the run matters more than one tracker
                self._drop(sink, err, step)

    def resume_at(self, step: int) -> None:
        """A resumed run, before its first scalar: ``step`` is the first x it logs (step 3: the
        checkpoint's global PPO iteration). TensorBoard's writer is reopened with ``purge_step=step``, so
        TensorBoard hides what an earlier attempt logged at ``step`` and after in the same folder (the
        event files keep it). W&B and MLflow runs are new runs already (their earlier runs keep those
        steps). A failure drops TensorBoard as in :meth:`scalars`."""
        for sink in list(self.sinks):
            if isinstance(sink, _TensorBoardSink):
                try:
                    sink.resume_at(step)
                except Exception as err:  # as a failed log: the run goes on without TensorBoard
                    self._drop(sink, err, step)

    def _drop(self, sink: _TensorBoardSink | _WandbSink | _MlflowSink, err: Exception, step: int) -> None:
        """Stop using ``sink`` after ``err`` at ``step``: one warning on stderr, then its ``abandon``."""
        self.sinks.remove(sink)
        print(f"WARNING: {sink.label} logging failed at step {step} ({type(err).__name__}: "
              f"{first_line(err)}); the run goes on without {sink.label}", file=sys.stderr, flush=True)
        sink.abandon()

    def close(self, failed: bool = False) -> None:
        """Finish every sink's run (files flushed; ``failed``: marked failed, as W&B and MLflow can); a
        sink that fails to close is named in one warning."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            _close_quietly(sink, failed)


def _close_quietly(sink: Any, failed: bool = False) -> None:
    try:
        sink.close(failed)
    except Exception as err:  # closing a broken tracker must not end the run either
        print(f"WARNING: {sink.label} could not close its run ({type(err).__name__}: {first_line(err)})",
              file=sys.stderr, flush=True)


#: Upstream-era name: ``TensorBoardLogger(enabled, path, name)`` is TensorBoard alone.
TensorBoardLogger = Trackers
