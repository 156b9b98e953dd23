"""Start-up: the seconds a fresh Python process takes to import step 3's spine, with DeepSpeed's
autotuner kept from importing MLflow (dschat's import guard) and without it.

    DS_ACCELERATOR=cpu python benchmarks/startup.py
    DS_ACCELERATOR=cpu python benchmarks/startup.py --module deepspeed --repeats 9

Two modes, each a fresh ``python -c`` process (the time of the whole process, as a rank or a launcher
pays it at start-up):

* ``guarded``: ``import dschat``, then ``<module>``: dschat is imported before DeepSpeed, so its
  guard (:mod:`dschat.runtime.import_guards`) keeps MLflow out of DeepSpeed's autotuner;
* ``unguarded``: ``import deepspeed`` first, then ``<module>``: DeepSpeed's autotuner imports MLflow
  where it is installed (what every dschat process paid before the guard).

The modes take turns, ``--warmup`` + ``--repeats`` processes each. It prints per mode the median
seconds and whether MLflow ended up imported, and the ratio of the medians (from the same run).
Without MLflow installed the two modes do the same work. Results are appended to
``benchmarks/results.md`` (``--results``).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from step3 import publish  # noqa: E402  (one results format for every benchmark)

MODES = ("guarded", "unguarded")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="dschat.rlhf.ppo_trainer", help="the module each process imports")
    parser.add_argument("--warmup", type=int, default=1, help="untimed processes per mode first")
    parser.add_argument("--repeats", type=int, default=5, help="timed processes per mode")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results.md"),
                        help="file the results are appended to ('' for none)")
    return parser.parse_args(argv)


def probe(mode: str, module: str) -> str:
    """The ``python -c`` text of one process: the imports of ``mode``, then whether MLflow is in."""
    first = "import deepspeed; " if mode == "unguarded" else "import dschat; "
    return f"{first}import {module}; import sys; print('mlflow' in sys.modules)"


def run_once(mode: str, module: str) -> tuple[float, bool]:
    """One fresh process of ``mode``: (wall seconds, MLflow imported)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe(mode, module)], cwd=REPO, env=env, capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} import of {module} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return seconds, proc.stdout.strip().splitlines()[-1] == "True"


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = parse_args(argv)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    mlflow_in: dict[str, bool] = {}
    for i in range(args.warmup + args.repeats):
        for mode in MODES:
            seconds, imported = run_once(mode, args.module)
            mlflow_in[mode] = imported
            if i >= args.warmup:
                times[mode].append(seconds)
    median = {mode: statistics.median(times[mode]) for mode in MODES}
    installed = importlib.util.find_spec("mlflow") is not None
    command = "python benchmarks/startup.py " + shlex.join(a for a in (argv if argv is not None else sys.argv[1:]))
    lines = [f"### Start-up: importing {args.module} in a fresh process, "
             f"{datetime.date.today().isoformat()}, {platform.machine()} CPU ({os.cpu_count()} cores)",
             "",
             f"command: `{command.strip()}`; MLflow {'installed' if installed else 'not installed'}; "
             f"{args.repeats} processes per mode, taking turns, after {args.warmup} untimed",
             "",
             "| mode | median s | MLflow imported |",
             "|---|---|---|"]
    lines += [f"| {mode} | {median[mode]:.2f} | {'yes' if mlflow_in[mode] else 'no'} |" for mode in MODES]
    lines += ["", f"unguarded / guarded: {median['unguarded'] / median['guarded']:.2f}x, "
                  f"{median['unguarded'] - median['guarded']:.2f} s saved per process", ""]
    return publish(lines, args.results)


if __name__ == "__main__":
    main()
