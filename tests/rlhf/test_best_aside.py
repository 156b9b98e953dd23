"""Setting an earlier run's ``best/`` aside (dschat.rlhf.heldout.best.set_earlier_best_aside): a
failed rename leaves ``best/`` and ``best.earlier/`` as they were, and a leftover of another run with
the same process id does not get in the way."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from dschat.errors import UserError
from dschat.paths import BEST_DIR, BEST_FILE, EARLIER_BEST_DIR
from dschat.rlhf.heldout import best as best_module


def _best(folder, step: int, note: str) -> None:
    folder.mkdir()
    (folder / BEST_FILE).write_text(json.dumps({"step": step, "by": "reward", "score": 1.0}))
    (folder / "note.txt").write_text(note)


def _tree(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_older_earlier_best_is_never_replaced_and_a_failed_rename_changes_nothing(tmp_path, monkeypatch):
    _best(tmp_path / BEST_DIR, 7, "newer")
    _best(tmp_path / EARLIER_BEST_DIR, 3, "older")
    before = _tree(tmp_path)
    with pytest.raises(UserError, match=rf"move {tmp_path / EARLIER_BEST_DIR} away \(or delete it\)"):
        best_module.set_earlier_best_aside(tmp_path)  # it would lose the older best.earlier/
    assert _tree(tmp_path) == before
    shutil.rmtree(tmp_path / EARLIER_BEST_DIR)  # moved away by the user
    before = _tree(tmp_path)
    real = os.replace

    def replace(src, dst):
        if os.fspath(src) == os.fspath(tmp_path / BEST_DIR):  # best/ -> best.earlier/ fails (EBUSY, EPERM ...)
            raise PermissionError(1, "Operation not permitted")
        return real(src, dst)

    monkeypatch.setattr(best_module.os, "replace", replace)
    with pytest.raises(UserError, match=r"cannot set the earlier run's .*best aside \(Operation not permitted\); "
                                        r"move it away yourself"):
        best_module.set_earlier_best_aside(tmp_path)
    monkeypatch.undo()
    assert _tree(tmp_path) == before  # nothing hidden, nothing lost
    assert best_module.set_earlier_best_aside(tmp_path) == (
        f"{tmp_path / BEST_DIR} held an earlier run's best models: now in {tmp_path / EARLIER_BEST_DIR}")
    assert (tmp_path / EARLIER_BEST_DIR / "note.txt").read_text() == "newer" and not (tmp_path / BEST_DIR).exists()


def test_a_leftover_of_a_run_with_the_same_pid_does_not_block(tmp_path):
    (tmp_path / f".{EARLIER_BEST_DIR}-{os.getpid()}").mkdir()  # left by a killed run whose pid was reused
    (tmp_path / f".{EARLIER_BEST_DIR}-{os.getpid()}" / "x").write_text("x")
    _best(tmp_path / BEST_DIR, 7, "newer")
    assert "now in" in best_module.set_earlier_best_aside(tmp_path)
    assert (tmp_path / EARLIER_BEST_DIR / "note.txt").read_text() == "newer"
    _best(tmp_path / BEST_DIR, 0, "start")  # step 0: removed, best.earlier/ stays
    assert best_module.set_earlier_best_aside(tmp_path).startswith("removed")
    assert (tmp_path / EARLIER_BEST_DIR / "note.txt").read_text() == "newer"
