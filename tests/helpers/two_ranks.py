"""A step script on 2 CPU ranks under the DeepSpeed launcher, with each rank's weight digest
(``DSCHAT_WEIGHT_DIGEST_DIR``: the SHA-256 of its parameters at the end of training); and a Python
script on two gloo ranks of its own (:func:`run_gloo_ranks`)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers.step3 import subprocess_env
from helpers.steps import STEP_DIRS, deepspeed_cmd, run_cli


@dataclass(frozen=True)
class TwoRankRun:
    """The finished launcher run: its output, master port, ``--output_dir`` and digest folder."""

    proc: subprocess.CompletedProcess
    port: str
    out: Path
    digests: Path


def run_two_ranks(step: str, argv: list[str], out: Path, digests: Path) -> TwoRankRun:
    """Run ``step``'s ``main.py`` with ``argv`` (whose ``--output_dir`` is ``out``) on 2 ranks."""
    proc = run_cli(deepspeed_cmd("main.py", *argv), cwd=STEP_DIRS[step], DSCHAT_WEIGHT_DIGEST_DIR=str(digests))
    return TwoRankRun(proc, proc.args[proc.args.index("--master_port") + 1], out, digests)


def run_gloo_ranks(script_text: str, folder: Path, *args: str) -> list:
    """Run ``script_text`` as two processes, ranks 0 and 1, each with argv ``rank store folder *args``
    (``store``: a file in ``folder`` for ``init_method="file://..."``); each must exit 0 and write
    ``folder/rank<N>.json``. Returns those two JSON values, rank 0's first."""
    script = folder / "ranks.py"
    script.write_text(script_text)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(folder / "store"), str(folder), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                              cwd=Path(__file__).resolve().parents[2])
             for rank in (0, 1)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (stdout[-3000:], stderr[-3000:])
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
