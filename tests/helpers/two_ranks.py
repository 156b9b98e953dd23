"""A step script on 2 CPU ranks under the DeepSpeed launcher, with each rank's weight digest
(``DSCHAT_WEIGHT_DIGEST_DIR``: the SHA-256 of its parameters at the end of training)."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

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
    cmd = deepspeed_cmd("main.py", *argv)
    proc = run_cli(cmd, cwd=STEP_DIRS[step], DSCHAT_WEIGHT_DIGEST_DIR=str(digests))
    return TwoRankRun(proc, cmd[cmd.index("--master_port") + 1], out, digests)
