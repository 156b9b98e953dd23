"""Checkpoint folders on disk (dschat.training.rotation) and their JSON files
(dschat.training.checkpoint_records): write order, rotation that never deletes the newest or the
resume source, a step saved again without a window, pruning that makes a folder incomplete first,
and damaged or edited markers and random states refused in one line (exit code 2)."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.training import checkpoint as ckpt
from dschat.training import checkpoint_records, rotation


def _checkpoint(root, steps: int, sequence: int | None) -> "os.PathLike":
    folder = root / ckpt.checkpoint_name(steps)
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_text(f"step {steps}")
    record = {"format": ckpt.FORMAT_VERSION, "engines": [], "weights_only": [], "meta": {},
              "position": {"epoch": 0, "epoch_micro_steps": steps, "micro_steps": steps, "optimizer_steps": steps}}
    if sequence is not None:
        record["sequence"] = sequence
    (folder / ckpt.MARKER).write_text(json.dumps(record))
    return folder


def test_rolling_back_then_saving_keeps_the_new_checkpoint_and_the_source(tmp_path):
    # step_50, 100, 200 written in that order; the user resumes from step_50 and saves step 60.
    root = tmp_path / "checkpoints"
    for seq, steps in enumerate((50, 100, 200)):
        _checkpoint(root, steps, seq)
    source = root / ckpt.checkpoint_name(50)
    assert rotation.next_sequence(root) == 3
    new = _checkpoint(root, 60, rotation.next_sequence(root))
    rotation.prune_rotated(root, keep=2, protect=[new, source])
    names = [p.name for p in ckpt.complete_checkpoints(root)]
    assert names == ["step_00000050", "step_00000200", "step_00000060"]  # write order, 100 rotated out
    assert ckpt.latest_checkpoint(root) == new  # --resume continues from step 60, not the abandoned 200
    assert sorted(p.name for p in root.iterdir()) == sorted(names)  # no leftover


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    root = tmp_path / "checkpoints"
    new = _checkpoint(root, 10, 0)  # sequence 0 (older writer) sorts first: still never deleted
    for seq, steps in enumerate((20, 30), start=1):
        _checkpoint(root, steps, seq)
    rotation.prune_rotated(root, keep=1, protect=[new])
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000010", "step_00000030"]


def test_a_checkpoint_is_made_incomplete_before_its_files_are_deleted(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 1, 0)
    _checkpoint(root, 2, 1)
    seen = []

    def rmtree(path, ignore_errors=False):  # a kill midway: what is left must not count as complete
        seen.append(path.name)
        (path / "weights.bin").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(rotation.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        rotation.prune_rotated(root, keep=1, protect=[])
    monkeypatch.undo()
    assert seen and seen[0].startswith(rotation.PRUNED_PREFIX)
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002"]
    assert rotation.prune_leftovers(root, "run") == []  # the half-deleted folder goes, silently
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]


def test_leftovers_are_pruned_only_when_dschat_left_them(tmp_path):
    """A checkpoint root's ``.tmp-*`` entries go only when they are dschat's: a checkpoint it began
    (its writing tag), an empty folder, a probe file, a folder being pruned. A folder or file of the
    user's that merely has such a name stays, with everything in it, and is no incomplete checkpoint."""
    root = tmp_path / "checkpoints"
    begun = root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(3)}"
    (begun / "model").mkdir(parents=True)
    (begun / rotation.WRITING_TAG).write_text("")
    (root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(4)}").mkdir()  # stopped before its tag
    (root / f"{rotation.PROBE_PREFIX}1f").touch()
    (root / f"{rotation.PRUNED_PREFIX}step_00000001" / "model").mkdir(parents=True)
    (root / ".tmp-mine").mkdir()
    (root / ".tmp-mine" / "notes.txt").write_text("mine")
    (root / ".tmp-backup.tar").write_text("mine too")
    assert [p.name for p in rotation.incomplete_checkpoints(root)] == sorted([
        f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(3)}", f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(4)}",
        f"{rotation.PRUNED_PREFIX}step_00000001"])
    notices = rotation.prune_leftovers(root, "run")
    assert len(notices) == 2  # the two unfinished checkpoints
    assert sorted(p.name for p in root.iterdir()) == [".tmp-backup.tar", ".tmp-mine"]
    assert (root / ".tmp-mine" / "notes.txt").read_text() == "mine"


def test_a_leftover_another_rank_claims_while_it_is_looked_at_is_passed_over(tmp_path, monkeypatch):
    """Every rank prunes a shared root at once: a ``.tmp-step_<N>`` another rank renames between two
    looks is left to that rank, not a FileNotFoundError on this one."""
    root = tmp_path / "checkpoints"
    leftover = root / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(3)}"
    (leftover / "model").mkdir(parents=True)
    claimed = root / f"{rotation.PRUNING_PREFIX}other-1"

    def claimed_meanwhile(folder):
        os.replace(folder, claimed)
        return False

    monkeypatch.setattr(rotation, "begun_by_dschat", claimed_meanwhile)
    assert rotation.prune_leftovers(root, "run") == []
    assert sorted(p.name for p in root.iterdir()) == [claimed.name]


@pytest.mark.parametrize("new_complete", [False, True])
def test_a_kill_while_replacing_a_step_keeps_a_complete_one(new_complete, tmp_path):
    root = tmp_path / "checkpoints"
    old = _checkpoint(root, 4, 0)
    aside = rotation.set_aside(old)  # the old step_4 renamed aside ...
    assert not old.exists() and aside.is_dir()
    if new_complete:  # ... and the new one renamed in and marked before the kill
        _checkpoint(root, 4, 1)
    else:  # ... the kill came before the new one was renamed in: it is still .tmp-step_4
        (root / f"{ckpt.TMP_PREFIX}{old.name}").mkdir()
    notices = rotation.restore_replaced(root)
    rotation.prune_leftovers(root, "run")
    assert [p.name for p in ckpt.complete_checkpoints(root)] == [old.name]
    record = json.loads((old / ckpt.MARKER).read_text())
    assert record.get("sequence") == (1 if new_complete else 0)
    assert (notices != []) is (not new_complete)
    assert sorted(p.name for p in root.iterdir()) == [old.name]


# --- damaged or edited checkpoint files ---------------------------------------------------------

def _edit(data: dict, path: str, value) -> dict:
    *keys, last = path.split(".")
    node = data
    for key in keys:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


MARKER_EDITS = {
    "epoch-string": ("position.epoch", "x"),
    "negative-step": ("position.optimizer_steps", -1),
    "bool-step": ("position.micro_steps", True),
    "missing-key": ("position.epoch_micro_steps", KeyError),
    "unknown-key": ("position.rank", 3),
    "engines-not-names": ("engines", [1]),
    "meta-list": ("meta", []),
    "sequence-float": ("sequence", 1.5),
}


@pytest.mark.parametrize("edit", list(MARKER_EDITS))
def test_an_edited_marker_is_one_line(edit, tmp_path):
    folder = _checkpoint(tmp_path, 3, 0)
    data = _edit(json.loads((folder / ckpt.MARKER).read_text()), *MARKER_EDITS[edit])
    (folder / ckpt.MARKER).write_text(json.dumps(data))
    with pytest.raises(UserError, match=rf"^{folder / ckpt.MARKER}: .*; the checkpoint is damaged or was edited"):
        ckpt.read_position(folder)


@pytest.mark.parametrize("content", ["", '{"format": 1, "posi', "[1, 2]", "null"])
def test_a_truncated_marker_is_one_line_exit_2(content, tmp_path, capsys):
    folder = _checkpoint(tmp_path, 3, 0)
    (folder / ckpt.MARKER).write_text(content)
    args = type("Args", (), {"output_dir": None, "resume_from": str(folder), "resume": False, "save_interval": 0,
                             "keep_checkpoints": 2, "max_nonfinite_steps": 0})()
    assert cli_main(lambda argv: ckpt.check_checkpoint_args(args)) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged or was edited" in err[0], err


@pytest.mark.parametrize("content", ['{"format": 1, "posi', "[1, 2]"])
def test_resume_refuses_a_damaged_marker_beside_good_checkpoints_instead_of_passing_over_it(content, tmp_path):
    """Its place in the write order is unknown (it may be the newest): --resume took the older good one
    without a word, and rotation would delete the damaged one first."""
    root = tmp_path / "checkpoints"
    _checkpoint(root, 2, 0)
    damaged = _checkpoint(root, 3, 1)
    assert ckpt.latest_checkpoint(root) == damaged
    (damaged / ckpt.MARKER).write_text(content)
    with pytest.raises(UserError, match=rf"^{damaged / ckpt.MARKER}: it is not .*; the checkpoint is damaged or was "
                                        r"edited, so the newest cannot be told: pass --resume_from"):
        ckpt.latest_checkpoint(root, strict=True)  # what --resume continues from
    # Elsewhere (a run's saves, the line naming the last good checkpoint) it is passed over, as before.
    assert ckpt.latest_checkpoint(root) == root / ckpt.checkpoint_name(2)


def _rng_edits():
    state = json.loads(json.dumps(ckpt.rng_state()))
    yield "not-json", None
    yield "not-object", [1]
    yield "python-short", {**state, "python": state["python"][:2]}
    yield "python-word-too-big", {**state, "python": [3, [2**32] + state["python"][1][1:], None]}
    yield "python-index-out-of-range", {**state, "python": [3, state["python"][1][:-1] + [625], None]}
    yield "numpy-name", {**state, "numpy": ["PCG64", *state["numpy"][1:]]}
    yield "numpy-position-string", {**state, "numpy": [*state["numpy"][:2], "0", *state["numpy"][3:]]}
    yield "torch-short", {**state, "torch": state["torch"][:-1]}
    yield "torch-not-bytes", {**state, "torch": [256] + state["torch"][1:]}
    yield "extra-key", {**state, "mps": []}


@pytest.mark.parametrize("name,state", list(_rng_edits()), ids=[n for n, _ in _rng_edits()])
def test_a_damaged_random_state_is_one_line(name, state, tmp_path):
    path = tmp_path / "rng_rank0.json"
    path.write_text("{\"python\": [3, [1, 2" if state is None else json.dumps(state))
    with pytest.raises(UserError, match=rf"^{path}: .*; the checkpoint is damaged or was edited"):
        ckpt.read_rng_file(path)


def test_a_sound_random_state_reads_back_and_restores():
    random.seed(5)
    state = json.loads(json.dumps(ckpt.rng_state()))
    first = random.random()
    path_state = state
    ckpt.set_rng_state(path_state)
    assert random.random() == first
    assert checkpoint_records._rng_problem(state) is None


def test_old_markers_without_a_sequence_sort_by_their_write_time(tmp_path):
    root = tmp_path / "checkpoints"
    a, b = _checkpoint(root, 9, None), _checkpoint(root, 3, None)
    os.utime(a / ckpt.MARKER, ns=(1, 1))
    os.utime(b / ckpt.MARKER, ns=(2, 2))
    assert ckpt.complete_checkpoints(root) == [a, b]
    shutil.rmtree(root)


def test_a_damaged_weights_file_or_missing_random_state_is_one_line(tmp_path):
    """The EMA actor's safetensors file cut short, and rank 0's random states gone when another shape
    derives a rank's states from them: one line each, naming the file."""
    from dschat.training.weights_file import load_weights
    from dschat.training.consolidated import derived_rng_state

    cut = tmp_path / "actor_ema.safetensors"
    cut.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match=r"cannot read .*actor_ema\.safetensors .*pass --resume_from") as err:
        load_weights(torch.nn.Linear(2, 2), cut, rank=0)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"cannot read .*rng_rank0\.json .*pass --resume_from"):
        derived_rng_state(tmp_path, rank=1)
