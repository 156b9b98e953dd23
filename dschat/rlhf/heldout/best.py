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

__all__ = ["earlier_best_in_the_way", "other_series_line", "same_series", "read_best", "save_best",
           "set_earlier_best_aside"]


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


def same_series(a: str, b: str) -> bool:
    """Whether two series names of ``best.json``'s ``by`` are one series: equal, or the same folder
    spelled two ways (a folder judge is named by its ``--eval_judge`` text: ``rm/``, ``./rm``, ``~/rm``);
    ``proxy`` is only itself (a judge folder ``./proxy`` is another series)."""
    if a == b:
        return True
    if "proxy" in (a, b):
        return False
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def other_series_line(best_dir: Path, kept: str, series: str, save_best_by: str) -> str:
    """The line refusing a resumed run that would go on keeping ``best_dir``'s models (kept by the
    series ``kept``) by another ``series`` (``--save_best_by save_best_by``): the two series' scores
    do not compare, so ``best/`` would be replaced by a worse model, or never."""
    same = "--save_best_by proxy" if kept == "proxy" else f"--save_best_by judge with --eval_judge {kept} first"
    return (f"--resume: the run kept its best models in {best_dir} by {kept}, and this run would keep them by "
            f"{series} (--save_best_by {save_best_by}; judge is the default with --eval_judge): the two scores do "
            f"not compare; pass {same} to go on as before, or move {best_dir} away to keep the best by {series} "
            "from here on")


def earlier_best_in_the_way(output_dir: Path) -> str | None:
    """The line refusing a run that would set ``output_dir``'s ``best/`` aside
    (:func:`set_earlier_best_aside`) while ``best.earlier/`` holds a run's best models too (that
    older folder would be lost), or None."""
    best, earlier = output_dir / BEST_DIR, output_dir / EARLIER_BEST_DIR
    saved = read_best(best) if best.exists() else None
    if not best.exists() or (saved is not None and saved["step"] == 0) or not earlier.exists():
        return None
    return (f"{best} holds an earlier run's best models and {earlier} those of one before it; this run sets "
            f"{best} aside as {earlier} before its first evaluation, which would lose the older one: move "
            f"{earlier} away (or delete it), pass --save_best_by none, or give another --output_dir")


def set_earlier_best_aside(output_dir: Path) -> str | None:
    """Before a run with no evaluation to continue (its first evaluation, of the starting models, would
    replace ``best/``): an earlier run's ``best/`` becomes ``best.earlier/``; a ``best/`` of step 0
    (the starting models of a run that stopped before a better evaluation) is removed and
    ``best.earlier/`` stays. Returns the notice (None: no ``best/``). One :class:`UserError` line,
    with ``best/`` and ``best.earlier/`` as they were, when ``best.earlier/`` is there already
    (:func:`earlier_best_in_the_way`) or a rename fails. Nothing is deleted in place: a folder goes by
    a rename (to a hidden name no other run uses) first."""
    best, earlier = output_dir / BEST_DIR, output_dir / EARLIER_BEST_DIR
    if not best.exists():
        return None
    problem = earlier_best_in_the_way(output_dir)
    if problem is not None:
        raise UserError(problem)
    gone = output_dir / f".{EARLIER_BEST_DIR}-{os.getpid()}-{secrets.token_hex(4)}"
    saved = read_best(best)
    try:
        if saved is not None and saved["step"] == 0:
            os.replace(best, gone)
            notice = f"removed {best}: the starting models of a run that stopped before a better evaluation"
        else:
            os.replace(best, earlier)
            notice = f"{best} held an earlier run's best models: now in {earlier}"
    except OSError as err:
        raise UserError(f"cannot set the earlier run's {best} aside ({err.strerror}); move it away yourself, "
                        "or pass --save_best_by none") from None
    shutil.rmtree(gone, ignore_errors=True)
    return notice
