"""benchmarks/serve_load.py: its percentiles by hand, and a short run against a real server."""
from __future__ import annotations

import importlib.util

import pytest

from helpers import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("dschat_bench_serve_load", REPO / "benchmarks" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_percentile_by_hand():
    percentile = _bench().percentile
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(values, 50) == 2.5  # halfway between ranks 1 and 2
    assert percentile(values, 99) == pytest.approx(3.97)  # 3 + 0.97 * (4 - 3)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_the_benchmark_runs_against_a_served_tiny_model(capsys):
    assert _bench().main(["--model", "tiny-opt", "--clients", "4", "--requests", "2", "--max_tokens", "4",
                          "--max_batch_size", "1,4"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert [r[0].strip() for r in rows] == ["1", "4"]
    assert all(r[1].strip() == "8" and r[2].strip() == "0" for r in rows)  # 4 clients x 2 requests, none failed
