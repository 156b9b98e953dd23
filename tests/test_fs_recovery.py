"""dschat.utils.fs.recover_dir: a kill at any point of atomic_dir's folder swap leaves, after
recovery, either the old or the new complete folder at its path, with the carried-over entries
(logs, checkpoints/) inside it, never hidden in a sibling."""
from __future__ import annotations

import os

import pytest

from dschat.utils import fs


class Killed(BaseException):
    """Stands in for SIGKILL; ``_kill_at`` disables the cleanup a dead process would not run."""


def _old_folder(path):
    path.mkdir()
    (path / "model.safetensors").write_text("old")
    (path / "checkpoints").mkdir()
    (path / "checkpoints" / "step_2").write_text("ckpt")
    (path / "training.log").write_text("log")


def _keep(name: str) -> bool:
    return name != "model.safetensors"


def _kill_at(monkeypatch, path, call: int):
    """Kill atomic_dir at its ``call``-th os.replace, leaving what a SIGKILL would (no cleanup)."""
    real_replace, real_rmtree = os.replace, fs.shutil.rmtree
    count = {"n": 0}

    def replace(src, dst):
        count["n"] += 1
        if count["n"] == call:
            monkeypatch.setattr(fs.shutil, "rmtree", lambda *a, **k: None)  # a dead process cleans nothing
            raise Killed
        return real_replace(src, dst)

    monkeypatch.setattr(fs.os, "replace", replace)
    with pytest.raises(Killed):
        with fs.atomic_dir(path, carry_over=_keep) as tmp:
            (tmp / "model.safetensors").write_text("new")
    monkeypatch.setattr(fs.os, "replace", real_replace)
    monkeypatch.setattr(fs.shutil, "rmtree", real_rmtree)


# os.replace calls in atomic_dir: 1 = carry training.log / checkpoints (2 calls), 3 = old folder aside,
# 4 = new folder into place.
@pytest.mark.parametrize("call,model", [(1, "old"), (2, "old"), (3, "old"), (4, "new")])
def test_recovery_after_a_kill_at_each_rename(call, model, tmp_path, monkeypatch):
    path = tmp_path / "out"
    _old_folder(path)
    _kill_at(monkeypatch, path, call)
    if call == 4:
        assert not path.exists()  # the window: the old folder is aside, the new one not yet in place
    notices = fs.recover_dir(path, carry_over=_keep)
    assert notices
    assert (path / "model.safetensors").read_text() == model
    assert (path / "checkpoints" / "step_2").read_text() == "ckpt"
    assert (path / "training.log").read_text() == "log"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no hidden leftovers


def test_nothing_to_recover(tmp_path):
    _old_folder(tmp_path / "out")
    assert fs.recover_dir(tmp_path / "out", carry_over=_keep) == []
    assert fs.recover_dir(tmp_path / "missing") == []


def test_an_unfinished_first_save_is_never_moved_into_place(tmp_path, monkeypatch):
    path = tmp_path / "out"  # no folder yet: the first save, killed while writing
    monkeypatch.setattr(fs.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(Killed):
        with fs.atomic_dir(path) as tmp:
            (tmp / "config.json").write_text("{}")
            raise Killed
    monkeypatch.undo()
    assert not path.exists()
    [partial] = list(tmp_path.iterdir())
    assert fs.recover_dir(path) == [f"removed the unfinished save {partial.name} beside {path}"]
    assert list(tmp_path.iterdir()) == []


# --- atomic_files: a set of files replaced together (the tokenised-data cache) -------------------


def test_atomic_files_replace_all_in_order_or_none(tmp_path, monkeypatch):
    import errno

    from dschat.errors import UserError

    names = ["train.bin", "eval.bin", "meta.json"]
    for name in names:
        (tmp_path / name).write_text(f"old {name}")
    # A full disk while the second file is written: every previous file stays, no temp file is left.
    with pytest.raises(UserError, match=r"while writing .*\(the previous files there, if any, are unchanged\)"):
        with fs.atomic_files([tmp_path / n for n in names]) as tmps:
            tmps[0].write_text("new")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert all((tmp_path / n).read_text() == f"old {n}" for n in names)
    # Success: all replaced, in the order given (the file marking the set complete last).
    order = []
    real_replace = os.replace
    monkeypatch.setattr(fs.os, "replace", lambda src, dst: (order.append(os.path.basename(dst)), real_replace(src, dst)))
    with fs.atomic_files([tmp_path / n for n in names]) as tmps:
        for tmp, n in zip(tmps, names):
            tmp.write_text(f"new {n}")
    assert order == names
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert all((tmp_path / n).read_text() == f"new {n}" for n in names)
    assert oct((tmp_path / "meta.json").stat().st_mode & 0o777) == oct(0o666 & ~fs._umask())
