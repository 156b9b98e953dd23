"""Run a step script and SIGKILL this very process at a chosen point: the fault-injection harness
of ``tests/test_faults.py``. Test code only; nothing in dschat reads its variable.

    python tests/kill_at.py SCRIPT [ARGS ...]
    deepspeed --no_local_rank --num_gpus 2 tests/kill_at.py SCRIPT [ARGS ...]

``DSCHAT_TEST_KILL=<point>:<n>[:<rank>]`` says where (on every rank, or on global rank ``<rank>`` only):

* ``step:<n>``: right after the n-th ``engine.step()`` (micro-step) of this process;
* ``checkpoint:<n>``: midway through the n-th training checkpoint: the DeepSpeed files of the n-th
  ``engine.save_checkpoint`` are in ``checkpoints/.tmp-step_<N>``, the random states and the
  ``dschat_checkpoint.json`` marker are not (steps 1 and 2 save one engine per checkpoint);
* ``final_save:<n>``: midway through the n-th final model save: weights and config are in the hidden
  ``.<output_dir>.partial-*`` folder, the tokenizer files are not and nothing has been renamed.

Just before it dies it prints one flushed line ``[fault] rank <r>: SIGKILL ...``, so that the test
can tell when the kill happened.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any, Callable

ENV = "DSCHAT_TEST_KILL"


def _die(what: str) -> None:
    print(f"[fault] rank {os.environ.get('RANK', '0')}: SIGKILL {what}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_after_call(owner: Any, name: str, n: int, what: str) -> None:
    """Replace ``owner.name`` by a wrapper that dies right after its n-th call returns."""
    original: Callable[..., Any] = getattr(owner, name)
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        result = original(*args, **kwargs)
        calls += 1
        if calls == n:
            _die(f"{what} {n}")
        return result

    setattr(owner, name, wrapper)


def install(spec: str) -> None:
    point, n, *rank = spec.split(":")
    if rank and int(rank[0]) != int(os.environ.get("RANK", "0")):
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    import dschat.models.save

    targets = {
        "step": (DeepSpeedEngine, "step", "after micro-step"),
        "checkpoint": (DeepSpeedEngine, "save_checkpoint", "while writing checkpoint"),
        "final_save": (dschat.models.save, "_write", "while writing final model"),
    }
    if point not in targets:
        raise SystemExit(f"{ENV}={spec}: the point must be one of {', '.join(targets)}")
    owner, name, what = targets[point]
    _kill_after_call(owner, name, int(n), what)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    install(os.environ[ENV])
    script = Path(sys.argv[1]).resolve()
    sys.argv = sys.argv[1:]
    sys.path[0] = str(script.parent)  # as if the script had been run itself
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
