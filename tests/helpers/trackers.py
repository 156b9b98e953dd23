"""Reading back what the experiment trackers wrote (dschat/training/trackers.py): an offline W&B
run's ``.wandb`` file and a file-store MLflow run, plus an environment with no tracker settings."""
from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_API_KEY", "MLFLOW_TRACKING_URI",
               "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT")


def clean_tracker_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """No tracker variable of the user's reaches the run; W&B's config and cache under ``home``. What
    the run sets itself (``MLFLOW_ALLOW_FILE_STORE``, the HTTP limits) is undone after the test."""
    for name in TRACKER_ENV:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))


@dataclass
class WandbRun:
    """An offline W&B run as its ``.wandb`` file holds it: the config (flag -> value) and the
    logged rows (key -> value, W&B's own ``_step`` / ``_runtime`` / ``_timestamp`` left out)."""

    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    exited: bool = False


_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc32c, length, type) records
_HEADER = 7


def read_wandb_run(root: Path, timeout: float = 30.0) -> WandbRun:
    """The one offline run under ``root/wandb``, decoded with W&B's own protobuf messages. W&B's
    service process may still be writing the file's tail when ``finish()`` returns: read again (a
    record cut mid-write too) until the run's exit record is there; after ``timeout`` seconds without
    it, fail with what was read."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            read: WandbRun | Exception = _read_wandb_file(root)
        except (DecodeError, struct.error) as err:
            read = err
        if isinstance(read, WandbRun) and read.exited:
            return read
        if time.monotonic() > deadline:
            raise AssertionError(f"no complete W&B run under {root} after {timeout} s; last read: {read!r}")
        time.sleep(0.2)


def _read_wandb_file(root: Path) -> WandbRun:
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    assert data[:4] == b":W&B", data[:7]
    run, pos, pending = WandbRun(), _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + _HEADER + length > len(data):  # a record still being written
            break
        pending += data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind not in (1, 4):  # FIRST / MIDDLE pieces of a record spanning blocks
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        pending = b""
        which = record.WhichOneof("record_type")
        if which == "run":
            run.config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif which == "config":
            run.config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif which == "history":
            row = {(u.key or "/".join(u.nested_key)): json.loads(u.value_json) for u in record.history.item}
            run.history.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif which == "exit":
            run.exited = True
    return run


def mlflow_run(store: Path, run_name: str) -> tuple[Any, Any]:
    """``(client, run)``: the one MLflow run named ``run_name`` in the file store ``store``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("dschat")
    assert experiment is not None, list(store.iterdir())
    runs = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == run_name]
    assert len(runs) == 1, runs
    return client, runs[0]


def mlflow_series(client: Any, run: Any, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every logged value of ``key``, in step order."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
