#!/usr/bin/env python3
"""Latency and throughput of ``python -m dschat.serve MODEL`` (an actor) under concurrent clients.

    python benchmarks/serve_load.py --model tiny-llama --clients 32 --requests 4 --max_tokens 32 \\
        --max_batch_size 1,8,32

For each ``--max_batch_size`` value: start the server on a free port (a subprocess, as a user would), wait
until ``GET /health`` answers, send one warm-up request, then let ``--clients`` threads start together, each
sending ``--requests`` completion requests one after the other (the same decoding settings, so the server may
batch them; greedy by default; an answer may end early at EOS). Every answer is checked (HTTP 200, one choice,
a finish reason). Printed: a markdown table, one row per ``--max_batch_size``: requests,
failures, latency p50 / p99 (seconds, from sending a request to its whole answer), throughput (requests/s and
completion tokens/s over the wall time from the first request to the last answer).
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import requests
import torch

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Hello there, how are", "The capital of France is", "Once upon a time", "One two three four five",
           "Human: What is 2 + 2? Assistant:", "def add(a, b):", "The weather today", "My favourite colour"]
_SERVING = re.compile(r"^serving actor .* on (http://\S+) ")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def start_server(model: str, max_batch_size: int, device: str, max_wait_ms: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dschat.serve", model, "--port", "0", "--device", device,
                             "--max_batch_size", str(max_batch_size), "--max_wait_ms", str(max_wait_ms),
                             "--log_level", "warning"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    found: list[str] = []
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            match = _SERVING.match(line)
            if match and not found:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if found:
            try:
                if requests.get(found[0] + "/health", timeout=5).status_code == 200:
                    return proc, found[0]
            except requests.RequestException:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up:\n" + "".join(lines[-30:]))


def load(url: str, model: str, clients: int, per_client: int, max_tokens: int, temperature: float) -> dict:
    """Run the load; the figures of one row."""
    start = threading.Barrier(clients)
    latencies: list[float] = []
    tokens: list[int] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        session = requests.Session()
        start.wait()
        for j in range(per_client):
            body = {"model": model, "prompt": PROMPTS[(i + j) % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": temperature}
            sent = time.perf_counter()
            reply = session.post(url + "/v1/completions", json=body, timeout=600)
            took = time.perf_counter() - sent
            ok = reply.status_code == 200
            data = reply.json() if ok else {}
            ok = ok and len(data["choices"]) == 1 and data["choices"][0]["finish_reason"] in ("stop", "length")
            with lock:
                if ok:
                    latencies.append(took)
                    tokens.append(data["usage"]["completion_tokens"])
                else:
                    failures.append(f"{reply.status_code}: {reply.text[:200]}")

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - began
    return {"requests": len(latencies) + len(failures), "failures": len(failures), "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99), "rps": len(latencies) / wall, "tps": sum(tokens) / wall,
            "wall": wall, "first_failure": failures[0] if failures else ""}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="MODEL served (default tiny-llama).")
    parser.add_argument("--clients", type=int, default=32, help="Concurrent client threads (default 32).")
    parser.add_argument("--requests", type=int, default=1,
                        help="Requests per client, one after the other (default 1).")
    parser.add_argument("--max_tokens", type=int, default=32, help="max_tokens of each request (default 32).")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="temperature of each request (default 0: greedy).")
    parser.add_argument("--max_batch_size", default="1,8",
                        help="Comma-separated server --max_batch_size values, one run each (default 1,8).")
    parser.add_argument("--max_wait_ms", type=float, default=5.0, help="The server's --max_wait_ms (default 5).")
    parser.add_argument("--device", default="cpu", help="The server's --device (default cpu).")
    args = parser.parse_args(argv)
    rows = []
    for size in (int(x) for x in args.max_batch_size.split(",")):
        proc, url = start_server(args.model, size, args.device, args.max_wait_ms)
        try:
            load(url, args.model, 1, 1, args.max_tokens, args.temperature)  # warm-up
            figures = load(url, args.model, args.clients, args.requests, args.max_tokens, args.temperature)
            rows.append((size, figures))
        finally:
            proc.kill()
            proc.wait(timeout=30)
    print(f"model {args.model}, {args.clients} clients x {args.requests} request(s), max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, --max_wait_ms {args.max_wait_ms}, device {args.device}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("| --max_batch_size | requests | failures | latency p50 (s) | latency p99 (s) | requests/s | "
          "completion tokens/s | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for size, r in rows:
        print(f"| {size} | {r['requests']} | {r['failures']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['rps']:.2f} | "
              f"{r['tps']:.1f} | {r['wall']:.1f} |")
    failed = [r["first_failure"] for _, r in rows if r["failures"]]
    if failed:
        print(f"first failure: {failed[0]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
