"""Step 3's best models (``--save_best_by``): ``<output_dir>/best/`` written as one folder, its
``best.json`` read back, and an earlier run's ``best/`` set aside as ``best.earlier/``."""
from __future__ import annotations

import json
import os
import secrets
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import ContextManager, Mapping

from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from dschat.errors import UserError
from dschat.models.save import save_hf_model
from dschat.paths import BEST_DIR, BEST_FILE, EARLIER_BEST_DIR
from dschat.runtime.dist import barrier
from dschat.runtime.fs import atomic_dir

__all__ = ["read_best", "save_best", "set_earlier_best_aside"]


def save_best(output_dir: Path, models: Mapping[str, DeepSpeedEngine], tokenizer: PreTrainedTokenizerBase,
              info: Mapping[str, object], rank: int, save_format: str = "safetensors") -> None:
    """``<output_dir>/best/<name>`` for each model, in ``save_format`` (``--save_format``: what the step
    writes its final models in), and ``best.json``, replaced as one folder (collective: every rank
    gathers under ZeRO-3; rank 0 writes)."""
    target = output_dir / BEST_DIR
    swap: ContextManager[Path | str] = atomic_dir(target) if rank == 0 else nullcontext(target)
    with swap as folder:
        for name, model in models.items():
            save_hf_model(model, tokenizer, Path(folder) / name, save_format)
        if rank == 0:
            (Path(folder) / BEST_FILE).write_text(json.dumps(dict(info), indent=2) + "\n", encoding="utf-8")
    barrier()


def read_best(folder: Path) -> dict[str, object] | None:
    """``{"step", "by", "score", "run"}`` of ``folder/best.json`` (``run``: the id of the run that
    saved it, None in a file of a dschat that wrote none); None when it is missing or unreadable."""
    try:
        info = json.loads((folder / BEST_FILE).read_text(encoding="utf-8"))
        run = info.get("run")
        return {"step": int(info["step"]), "by": info["by"], "score": info["score"],
                "run": run if isinstance(run, str) else None}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def set_earlier_best_aside(output_dir: Path) -> str | None:
    """Before a run with no evaluation to continue (its first evaluation, of the starting models, would
    replace ``best/``): an earlier run's ``best/`` becomes ``best.earlier/``, replacing an older one;
    a ``best/`` of step 0 (the starting models of a run that stopped before a better evaluation) is
    removed and ``best.earlier/`` stays. Returns the notice (None: no ``best/``); a failed rename is
    one :class:`UserError` line, after which ``best/`` and ``best.earlier/`` are as they were. Nothing
    is deleted in place: a folder goes by a rename (to a hidden name no other run uses) first."""
    best, earlier = output_dir / BEST_DIR, output_dir / EARLIER_BEST_DIR
    if not best.exists():
        return None
    gone = output_dir / f".{EARLIER_BEST_DIR}-{os.getpid()}-{secrets.token_hex(4)}"
    saved = read_best(best)
    moved_earlier = False
    try:
        if saved is not None and saved["step"] == 0:
            os.replace(best, gone)
            notice = f"removed {best}: the starting models of a run that stopped before a better evaluation"
        else:
            if earlier.exists():
                os.replace(earlier, gone)
                moved_earlier = True
            os.replace(best, earlier)
            notice = f"{best} held an earlier run's best models: now in {earlier}"
    except OSError as err:
        kept = ""
        if moved_earlier:  # best/ did not move: the older best.earlier/ goes back
            try:
                os.replace(gone, earlier)
            except OSError:
                kept = f"; the older {earlier} is in {gone}"
        raise UserError(f"cannot set the earlier run's {best} aside ({err.strerror}{kept}); move it away yourself, "
                        "or pass --save_best_by none") from None
    shutil.rmtree(gone, ignore_errors=True)
    return notice
