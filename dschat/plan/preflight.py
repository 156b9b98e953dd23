"""Step 3's preflight: the plan of a run's own command line before any model is loaded.

On an accelerator other than the CPU a run that cannot fit stops with one line naming the phase, the
shortfall and the first configuration that fits (:class:`UserError`, exit 2); on the CPU the plan is
printed and not enforced (the CPU's memory is the host's, shared with everything else).
"""
from __future__ import annotations

from typing import Callable, Sequence

from dschat.errors import UserError
from dschat.plan.cli import MARGIN, build_parser, plan, render, suggestions

__all__ = ["preflight"]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def preflight(argv: Sequence[str], *, world: int, gpus_per_node: int, accelerator: str, gpu_bytes: int,
              echo: Callable[[str], None] = print) -> dict:
    """Plan step 3's ``argv`` on ``world`` ranks of ``gpu_bytes`` each; returns the plan.

    ``accelerator == "cpu"``: the table is printed (``echo``), nothing is enforced. Otherwise a plan
    that does not fit raises :class:`UserError` with the peak phase, the shortfall and the first
    suggestion.
    """
    parser = build_parser()
    node_args = ["--gpus_per_node", str(gpus_per_node), "--num_nodes", str(max(1, world // gpus_per_node))]
    full = [*argv, *node_args]
    args = parser.parse_args(full)
    result = plan(args, gpu_bytes=gpu_bytes)
    if accelerator == "cpu":
        echo(render(result))
        return result
    if result["fits"]:
        return result
    found = suggestions(full, args, parser, limit=1, gpu_bytes=gpu_bytes)
    fix = f"add {' '.join(found[0]['flags'])}" if found else "use GPUs with more memory"
    raise UserError(
        f"step 3 does not fit: {result['peak_phase']} needs {_gb(result['peak_bytes_per_gpu'])} per GPU, "
        f"{_gb(-result['margin_bytes'])} more than the {_gb(gpu_bytes)} GPU allows with {MARGIN:.0%} kept free; "
        f"{fix} (python -m dschat.plan with the same flags shows the whole plan)")
