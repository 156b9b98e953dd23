"""A model save into a folder others can write to (dschat.runtime.inplace.save_in_place): another
account that renames the staging folder away or plants a link under its name, or under the
replaced-entries folder's, while the save runs never gets a file written, moved, deleted or made
readable where the link leads. The save works through the folders it opened; a swap is one line,
and the output folder is left as it was."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dschat.errors import UserError
from dschat.models.save import is_model_artifact
from dschat.runtime import inplace
from dschat.runtime.inplace import JOURNAL, REPLACED_PREFIX, STAGING_PREFIX, recover_in_place, save_in_place


def _listing(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode)) for p in sorted(folder.iterdir())
            if p.is_file() and not p.is_symlink()}


@pytest.fixture()
def scene(tmp_path):
    """An output folder holding an earlier model, and a private folder of the user's elsewhere."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    (out / "config.json").write_text('{"old": 1}')
    (out / "model.safetensors").write_bytes(b"old weights")
    victim.mkdir(mode=0o700)
    (victim / "config.json").write_text("PRECIOUS")
    (victim / "id_rsa").write_text("SECRET")
    os.chmod(victim / "id_rsa", 0o600)
    return out, victim


def _own(out: Path, prefix: str) -> Path:
    [found] = [p for p in out.iterdir() if p.name.startswith(prefix)]
    return found


@pytest.mark.parametrize("swapped", [STAGING_PREFIX, REPLACED_PREFIX])
def test_a_folder_of_the_save_replaced_by_a_link_mid_save_writes_nothing_where_it_leads(scene, swapped):
    out, victim = scene
    before_out, before_victim = _listing(out), _listing(victim)
    with pytest.raises(UserError, match=r"\.dschat-staging-[0-9a-f]{8} was renamed or replaced while the model was "
                                        r"written into it: another account can write to .*; nothing in .* was changed"):
        with save_in_place(out, is_model_artifact) as stage:
            (stage / "config.json").write_text('{"new": 1}')
            planted = _own(out, swapped)
            planted.rename(out / "renamed-away")  # what another account may do in a folder it can write to
            planted.symlink_to(victim)
            (stage / "model.safetensors").write_bytes(b"new weights")  # after the swap: still the save's own folder
    assert _listing(victim) == before_victim  # nothing written, moved or made readable there
    assert {k: v for k, v in _listing(out).items() if k in before_out} == before_out
    assert (out / "renamed-away").is_dir() and (out / _own(out, swapped).name).is_symlink()  # left as they are


def test_a_name_planted_before_the_save_made_it_is_one_line(scene, monkeypatch):
    out, victim = scene
    monkeypatch.setattr(inplace.uuid, "uuid4", lambda: type("U", (), {"hex": "0123abcd" * 4})())
    (out / f"{STAGING_PREFIX}0123abcd").symlink_to(victim)
    with pytest.raises(UserError, match=rf"{STAGING_PREFIX}0123abcd appeared before dschat made it: another account "
                                        "can write to"):
        with save_in_place(out, is_model_artifact) as stage:
            (stage / "config.json").write_text('{"new": 1}')
    assert not (out / f"{REPLACED_PREFIX}0123abcd").exists()  # the folder it had made is gone
    assert (out / "config.json").read_text() == '{"old": 1}' and (victim / "config.json").read_text() == "PRECIOUS"


def test_recovery_moves_nothing_into_a_planted_replaced_entries_link(scene):
    """A save killed after its journal: another account plants the replaced-entries name as a link to
    a folder of the user's. Recovery moved the earlier model's files through it (overwriting the user's
    own) and then failed on every start with a traceback; now it is one line and nothing moves."""
    out, victim = scene
    stage = out / f"{STAGING_PREFIX}0123abcd"
    stage.mkdir(mode=0o700)
    (stage / "config.json").write_text('{"new": 1}')
    (stage / JOURNAL).write_text(json.dumps({"entries": ["config.json"], "removes": ["model.safetensors"]}))
    os.chmod(stage / JOURNAL, 0o600)
    (out / f"{REPLACED_PREFIX}0123abcd").symlink_to(victim)
    before_victim = _listing(victim)
    with pytest.raises(UserError, match=rf"{REPLACED_PREFIX}0123abcd is not a folder that only you own and can write "
                                        "to, so the interrupted save .* cannot put what it replaces there"):
        recover_in_place(out, is_model_artifact)
    assert _listing(victim) == before_victim
    assert (out / "config.json").read_text() == '{"old": 1}' and (out / "model.safetensors").read_bytes() == b"old weights"


def test_a_save_leaves_no_folder_of_its_own_behind(scene):
    out, _ = scene
    with save_in_place(out, is_model_artifact) as stage:
        (stage / "config.json").write_text('{"new": 1}')
        (stage / "model.safetensors").write_bytes(b"new weights")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"new weights"


@pytest.mark.parametrize("unrecorded", ["config.json", "model.safetensors"])
def test_a_signal_between_a_rename_and_its_record_loses_nothing(scene, monkeypatch, unrecorded):
    """A Ctrl-C right after a rename, before the save recorded it, so the undo cannot reverse it.
    config.json: the earlier one moved aside; the folder it went to was deleted with it (and the new
    one). model.safetensors: a new entry (the earlier save wrote a .bin) moved in; the undo put the
    rest back and dropped the journal, leaving the old config beside the new weights and nothing to
    say so. Either way the journal now stays, and recovery finishes the save."""
    out, _ = scene
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    real = inplace._Moves.move

    def move(self, src, dst):
        real(self, src, dst)
        if os.path.basename(src) == unrecorded:
            self.done.pop()  # as if the signal came before the record
            raise KeyboardInterrupt

    monkeypatch.setattr(inplace._Moves, "move", move)
    with pytest.raises(KeyboardInterrupt):
        with save_in_place(out, is_model_artifact) as stage:
            (stage / "config.json").write_text('{"new": 1}')
            (stage / "model.safetensors").write_bytes(b"new weights")
    monkeypatch.undo()
    assert inplace.unfinished_save(out) is not None
    assert recover_in_place(out, is_model_artifact) == [f"finished an interrupted save into {out}"]
    assert (out / "config.json").read_text() == '{"new": 1}' and (out / "model.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_save_killed_while_writing_is_removed_with_one_true_notice(scene):
    """The replaced-entries folder is made before the write: a kill then leaves it empty beside a
    staging folder without its journal. Recovery said it put entries back; it put none."""
    out, _ = scene
    (out / f"{STAGING_PREFIX}0123abcd").mkdir(mode=0o700)
    (out / f"{STAGING_PREFIX}0123abcd" / "config.json").write_text("half")
    (out / f"{REPLACED_PREFIX}0123abcd").mkdir(mode=0o700)
    assert recover_in_place(out, is_model_artifact) == [f"removed the unfinished save {STAGING_PREFIX}0123abcd in {out}"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_without_proc_and_rmtree_dir_fd_the_save_goes_by_its_names(scene, monkeypatch):
    """Where /proc/self/fd is missing (and Python 3.10's rmtree takes no dir_fd) the save's folders
    are removed by their names under the output folder, not the working directory."""
    import shutil

    out, _ = scene
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, dir_fd=None, **kwargs):
        if dir_fd is not None:
            raise TypeError("rmtree() got an unexpected keyword argument 'dir_fd'")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(inplace, "_through", lambda fd, fallback: fallback)
    monkeypatch.setattr(inplace.shutil, "rmtree", rmtree)
    with save_in_place(out, is_model_artifact) as stage:
        assert stage.parent == out
        (stage / "config.json").write_text('{"new": 1}')
        (stage / "model.safetensors").write_bytes(b"new weights")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == '{"new": 1}'
