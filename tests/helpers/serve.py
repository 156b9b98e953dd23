"""``python -m dschat.serve`` started by a test: a subprocess on a free port (``--port 0``, the bound
port read from its ``serving ...`` line), waited for on ``GET /health``, stopped (and reaped) at the end;
and the scores a server's rewards are checked against (:func:`own_scores`)."""
from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import requests
import torch
import uvicorn

from dschat.eval.scoring import load_reward
from dschat.serve.cli import bind

from helpers import PYTHON, REPO
from helpers.step3 import subprocess_env

_SERVING = re.compile(r"^serving (?:reward model|actor) .* on (http://\S+) ")


class ServedModel:
    """A running server: ``url`` (``http://127.0.0.1:PORT``), ``reward_url`` (its ``/get_reward``),
    ``api_url`` (an actor's OpenAI base URL, ``.../v1``), ``proc`` and the lines it printed so far
    (``output``)."""

    def __init__(self, proc: subprocess.Popen, url: str, output: list[str]) -> None:
        self.proc, self.url, self.output = proc, url, output
        self.reward_url = url + "/get_reward"
        self.api_url = url + "/v1"


@contextlib.contextmanager
def served_model(folder: Path | str, *extra: str, start_timeout: float = 300.0,
                 api_key: str | None = None) -> Iterator[ServedModel]:
    """``python -m dschat.serve folder --port 0 *extra`` (a reward model or an actor), up and healthy,
    killed on exit; ``api_key``: its ``DSCHAT_SERVE_API_KEY`` (none without)."""
    env = subprocess_env()
    env["PYTHONPATH"] = str(REPO)
    env.pop("DSCHAT_SERVE_API_KEY", None)
    if api_key is not None:
        env["DSCHAT_SERVE_API_KEY"] = api_key
    proc = subprocess.Popen([PYTHON, "-m", "dschat.serve", str(folder), "--host", "127.0.0.1", "--port", "0",
                             "--log_level", "warning", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    found: list[str] = []

    def read() -> None:  # drains the pipe for the server's whole life (a full pipe would block it)
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            match = _SERVING.match(line)
            if match and not found:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                time.sleep(0.2)  # let the reader take the last lines
                raise AssertionError(f"dschat.serve exited {proc.returncode}:\n" + "\n".join(output[-30:]))
            if found:
                with contextlib.suppress(requests.RequestException):
                    if requests.get(found[0] + "/health", timeout=5).status_code == 200:
                        break
            if time.monotonic() > deadline:
                raise AssertionError("dschat.serve did not come up:\n" + "\n".join(output[-30:]))
            time.sleep(0.2)
        yield ServedModel(proc, found[0], output)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


served_reward_model = served_model


@contextlib.contextmanager
def serving_in_process(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port, in a thread of this process."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def own_scores(folder: Path, texts: Sequence[str], max_len: int | None = None) -> list[float]:
    """Each text scored alone (no padding, no batch) by dschat's reward model: the value at its last token."""
    model, tokenizer = load_reward(folder, torch.device("cpu"))
    scores = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        ids = ids[:, -max_len:] if max_len else ids  # a long text keeps its end (the score's token)
        with torch.no_grad():
            values = model.forward_value(input_ids=ids, attention_mask=torch.ones_like(ids), return_value_only=True)
        scores.append(float(values[0, -1]))
    return scores
