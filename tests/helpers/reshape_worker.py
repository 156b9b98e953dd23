"""Run a step script's ``main`` (under the DeepSpeed launcher or plain ``python``), then write each
trained engine's state as dschat's consolidated checkpoint gathers it (fp32 masters and Adam
moments by parameter name, safetensors, and its JSON record) into a folder, for the tests of
resuming on another shape (tests/training/test_resume_reshape.py).

    python reshape_worker.py DUMP_DIR STEP ARGV...     (STEP: step1 or step3; or under ``deepspeed``)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder, for ``helpers``

from dschat.runtime.dist import barrier, get_rank  # noqa: E402
from dschat.training.consolidated import write_engine_state  # noqa: E402

from helpers.step3 import step3_main  # noqa: E402
from helpers.steps import load_script  # noqa: E402


def trained_engines(step: str, argv: list[str]) -> dict:
    """The trained engines of one in-process run of ``step`` (the step-1 engine as ``model``)."""
    if step == "step3":
        result = step3_main().main(argv)
        return {"actor": result.rlhf_engine.actor, "critic": result.rlhf_engine.critic}
    return {"model": load_script(step).main(argv).engine}


def dump(engines: dict, out: Path) -> None:
    """Every engine's gathered state into ``out`` (collective)."""
    rank = get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    barrier()
    records = {tag: write_engine_state(engine, out, tag, rank) for tag, engine in engines.items()}
    if rank == 0:
        (out / "records.json").write_text(json.dumps(records), encoding="utf-8")


if __name__ == "__main__":
    # The DeepSpeed launcher puts --local_rank=N right after the script: it goes to the step's flags.
    local_rank = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    folder, step, *argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    dump(trained_engines(step, argv + local_rank), Path(folder))
