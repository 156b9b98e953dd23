"""dschat.runtime.fs.recover_dir: a kill at any point of atomic_dir's folder swap leaves, after
recovery, either the old or the new complete folder at its path, with the carried-over entries
(logs, checkpoints/) inside it, never hidden in a sibling. Leftovers another user planted (or that
others can write to, or without dschat's completion marker) are left alone; a symlinked output
folder stays a link and the output lands where it points."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from dschat.runtime import fs, trust

from helpers.steps import load_script

pytestmark = pytest.mark.forks  # kills forked children: run in a fresh interpreter (tests/conftest.py)


class Killed(BaseException):
    """Stands in for a crash while writing, before any rename (the process's cleanup runs)."""


def _old_folder(path):
    path.mkdir()
    (path / "model.safetensors").write_text("old")
    (path / "checkpoints").mkdir()
    (path / "checkpoints" / "step_2").write_text("ckpt")
    (path / "training.log").write_text("log")


def _keep(name: str) -> bool:
    return name != "model.safetensors"


def _kill_at(path, call: int) -> None:
    """A forked child runs atomic_dir and is SIGKILLed just before its ``call``-th os.replace."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest cleanup, no atexit
        count = 0
        real_replace = os.replace

        def replace(src, dst):
            nonlocal count
            count += 1
            if count == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst)

        fs.os.replace = replace
        try:
            with fs.atomic_dir(path, carry_over=_keep) as tmp:
                (tmp / "model.safetensors").write_text("new")
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


# os.replace calls in atomic_dir: 1 = carry checkpoints / training.log (2 calls), 3 = old folder aside,
# 4 = new folder into place.
@pytest.mark.parametrize("call,model", [(1, "old"), (2, "old"), (3, "old"), (4, "new")])
def test_recovery_after_a_kill_at_each_rename(call, model, tmp_path):
    path = tmp_path / "out"
    _old_folder(path)
    _kill_at(path, call)
    if call == 4:
        assert not path.exists()  # the window: the old folder is aside, the new one not yet in place
    notices = fs.recover_dir(path, carry_over=_keep)
    assert notices
    assert (path / "model.safetensors").read_text() == model
    assert (path / "checkpoints" / "step_2").read_text() == "ckpt"
    assert (path / "training.log").read_text() == "log"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no hidden leftovers


# os.replace calls as above, then the undo's own renames.
@pytest.mark.parametrize("call", [1, 2, 3, 4])
def test_a_failed_rename_puts_every_carried_entry_back(call, tmp_path, monkeypatch):
    path = tmp_path / "out"
    _old_folder(path)
    (path / "notes.txt").write_text("mine")
    before = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    real_replace = os.replace
    count = {"n": 0}

    def replace(src, dst):
        count["n"] += 1
        if count["n"] == call:  # EXDEV / EBUSY / EPERM: a mount point, a team folder in a sticky parent
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return real_replace(src, dst)

    monkeypatch.setattr(fs.os, "replace", replace)
    with pytest.raises(OSError):
        with fs.atomic_dir(path, carry_over=_keep) as tmp:
            (tmp / "model.safetensors").write_text("new")
    monkeypatch.undo()
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing carried over was deleted, no leftover beside it


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


# --- leftovers someone else planted (issue: recovery adopted other users' folders) ---------------


def _plant(folder, *, marker: bool = True) -> None:
    """A leftover that looks like dschat's: a complete checkpoint at a huge step, and the marker."""
    step = folder / "checkpoints" / "step_99999999"
    step.mkdir(parents=True)
    (step / "dschat_checkpoint.json").write_text('{"format": 1}')
    (folder / "model.safetensors").write_text("poisoned")
    if marker:
        (folder / fs.SAVED_MARKER).write_text("complete")


def _assert_left_alone(notices, planted, path) -> None:
    from dschat.training.checkpoint import checkpoint_root, latest_checkpoint

    assert any(n.startswith(f"left {planted} alone") for n in notices), notices
    assert planted.is_dir() and (planted / "checkpoints" / "step_99999999").is_dir()
    assert latest_checkpoint(checkpoint_root(path)) is None  # --resume would not load it
    assert not (path / "model.safetensors").exists()


@pytest.mark.parametrize("tag", ["partial", "old"])
def test_a_leftover_another_user_owns_is_left_alone(tag, tmp_path, monkeypatch):
    path = tmp_path / "run"
    path.mkdir()
    (path / "training.log").write_text("log")
    planted = tmp_path / f".run.{tag}-x"
    _plant(planted)
    me = os.geteuid()
    monkeypatch.setattr(fs.os, "geteuid", lambda: me + 1)  # every file here now belongs to someone else
    notices = fs.recover_dir(path, carry_over=_keep)
    _assert_left_alone(notices, planted, path)
    assert (path / "training.log").read_text() == "log"


def test_a_group_or_other_writable_leftover_is_left_alone(tmp_path):
    path = tmp_path / "new"  # no output yet: the planted old folder would have been moved into place
    planted = tmp_path / ".new.old-1234"
    _plant(planted)
    os.chmod(planted, 0o777)
    notices = fs.recover_dir(path)
    _assert_left_alone(notices, planted, path)
    assert not path.exists()


def test_a_leftover_without_the_completion_marker_is_never_moved_into_place(tmp_path):
    path = tmp_path / "new"
    old = tmp_path / ".new.old-1234"  # the user's own, but not written by atomic_dir (no marker)
    _plant(old, marker=False)
    notices = fs.recover_dir(path)
    assert notices == [f"left {old} alone: it has no dschat completion marker ({fs.SAVED_MARKER}); "
                       f"rename it to {path} if it holds the output you want back"]
    assert not path.exists() and old.is_dir()


def test_a_symlinked_leftover_is_left_alone(tmp_path):
    target = tmp_path / "elsewhere"
    _plant(target)
    path = tmp_path / "run"
    path.mkdir()
    link = tmp_path / ".run.partial-x"
    link.symlink_to(target)
    notices = fs.recover_dir(path, carry_over=_keep)
    assert any(n.startswith(f"left {link} alone") for n in notices)
    assert link.is_symlink() and not (path / "checkpoints").exists()


def _second_uid_available() -> str | None:
    if os.geteuid() != 0:
        return "planting as a second user needs root (setpriv --reuid)"
    if shutil.which("setpriv") is None:
        return "setpriv is not installed"
    return None


@pytest.mark.skipif(_second_uid_available() is not None, reason=str(_second_uid_available()))
def test_a_leftover_planted_by_a_real_second_user_is_left_alone():
    # A world-writable sticky folder, as /tmp: user 65534 plants, this process (root) recovers.
    shared = Path(tempfile.mkdtemp(prefix="dschat-shared-", dir="/tmp"))
    try:
        os.chmod(shared, 0o1777)
        path = shared / "run"
        path.mkdir()
        planted = shared / ".run.partial-x"
        step = planted / "checkpoints" / "step_99999999"
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        subprocess.run([*as_nobody, "mkdir", "-m", "755", "-p", str(step)], check=True)
        for name in (step / "dschat_checkpoint.json", planted / fs.SAVED_MARKER):
            subprocess.run([*as_nobody, "sh", "-c", 'umask 022; echo "{}" > "$1"', "sh", str(name)], check=True)
        assert planted.stat().st_uid == 65534
        notices = fs.recover_dir(path, carry_over=_keep)
        _assert_left_alone(notices, planted, path)
        ghost = shared / ".ghost.old-x"  # no output folder yet: the planted one must not take its place
        subprocess.run([*as_nobody, "mkdir", "-m", "755", str(ghost)], check=True)
        subprocess.run([*as_nobody, "touch", str(ghost / fs.SAVED_MARKER)], check=True)
        assert fs.recover_dir(shared / "ghost")[0].startswith(f"left {ghost} alone")
        assert not (shared / "ghost").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_atomic_dir_marks_its_folder_complete_and_private(tmp_path):
    with fs.atomic_dir(tmp_path / "out") as tmp:
        (tmp / "config.json").write_text("{}")
    assert trust.owned_privately(tmp_path / "out") and trust.owned_privately(tmp_path / "out" / fs.SAVED_MARKER)


# --- a symlinked output folder stays a link --------------------------------------------------------


def test_a_symlinked_output_folder_is_written_through(tmp_path):
    big = tmp_path / "big"
    (big / "out").mkdir(parents=True)
    (big / "out" / "training.log").write_text("log")
    link = tmp_path / "out"
    link.symlink_to(big / "out")
    with fs.atomic_dir(link, carry_over=_keep) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert link.is_symlink() and os.readlink(link) == str(big / "out")
    assert (big / "out" / "model.safetensors").read_text() == "new"
    assert (big / "out" / "training.log").read_text() == "log"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "out"]  # no dangling .out.old-* link
    assert sorted(p.name for p in big.iterdir()) == ["out"]


def test_output_dir_flag_resolves_a_symlink_once(tmp_path, monkeypatch):
    (tmp_path / "big" / "out").mkdir(parents=True)
    (tmp_path / "out").symlink_to(tmp_path / "big" / "out")
    args = load_script("step1").parse_args(["--model_name_or_path", "tiny-llama", "--output_dir",
                                            str(tmp_path / "out")])
    assert args.output_dir == str(tmp_path / "big" / "out")
    assert fs.resolve_output_dir(f"{tmp_path / 'out'}/") == str(tmp_path / "big" / "out")
    monkeypatch.setenv(fs.RANK_OUTPUT_ROOT_ENV, str(tmp_path / "nodes"))  # the test hook: one root per rank
    monkeypatch.setenv("RANK", "1")
    assert fs.resolve_output_dir(str(tmp_path / "out")) == str(tmp_path / "nodes" / "rank1" / "out")


def test_a_folder_that_cannot_be_fsynced_is_passed_over_but_a_file_is_not(tmp_path, monkeypatch):
    """Some FUSE and object-store mounts answer EINVAL / ENOTSUP to fsync on a folder: a save goes on
    there; the same answer for a file's data is an error."""
    (tmp_path / "f").write_text("x")

    def no_fsync(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", no_fsync)
    fs.fsync_path(tmp_path)  # a folder: passed over
    with pytest.raises(OSError):
        fs.fsync_path(tmp_path / "f")
    with pytest.raises(OSError):  # the data files are fsync'd: EINVAL there fails the write
        with fs.atomic_files([tmp_path / "a", tmp_path / "b"]) as (a, b):
            a.write_text("new a")
            b.write_text("new b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # nothing half-written is left


def test_a_set_of_files_is_replaced_and_put_back_on_a_file_system_without_hard_links(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("old a")
    b.write_text("old b")

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with fs.atomic_files([a, b]) as (ta, tb):
        ta.write_text("new a")
        tb.write_text("new b")
    assert (a.read_text(), b.read_text()) == ("new a", "new b")
    real_replace, calls = os.replace, []

    def second_rename_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError):
        with fs.atomic_files([a, b]) as (ta, tb):
            ta.write_text("newer a")
            tb.write_text("newer b")
    monkeypatch.setattr(os, "replace", real_replace)
    assert (a.read_text(), b.read_text()) == ("new a", "new b")  # the previous set, put back from its copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_the_folders_a_call_made_go_innermost_first_and_stop_at_anothers_files(tmp_path):
    """remove_made_folders: empty made folders go; one already gone is passed over; a folder holding
    someone else's file stays, and so does every folder around it."""
    inner = tmp_path / "a" / "b" / "c"
    made = trust.missing_ancestors(inner)
    assert made == [inner, inner.parent, inner.parent.parent]
    inner.mkdir(parents=True)
    inner.rmdir()  # already gone (removed by its own cleanup, say)
    trust.remove_made_folders(made)
    assert not (tmp_path / "a").exists()
    inner.mkdir(parents=True)
    (inner.parent / "theirs.txt").write_text("x")  # another run's file in b
    trust.remove_made_folders(made)
    assert not inner.exists() and (inner.parent / "theirs.txt").exists() and (tmp_path / "a").is_dir()
