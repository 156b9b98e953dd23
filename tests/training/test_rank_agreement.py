"""Checkpoints every rank agrees on (dschat.training.checkpoint), with two gloo processes on one
machine: a shared output folder commits, and per-rank folders (what node-local storage looks like
from two nodes) stop both ranks with the same one line. One spawn runs every scenario in turn; each
test below checks one of them.

Rank r's "node-local" folder is ``<tmp>/node<r>``: rank 1 never sees rank 0's files there.
"""
from __future__ import annotations

import json
import os
import re
import socket
import traceback
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dschat.errors import UserError
from dschat.training import checkpoint as ckpt

pytestmark = pytest.mark.slow
HOST = socket.gethostname()


def _args(output_dir: Path, **flags) -> Namespace:
    return Namespace(output_dir=str(output_dir), save_interval=flags.get("save_interval", 0),
                     resume=flags.get("resume", False), resume_from=None)


def _position(steps: int) -> ckpt.TrainingPosition:
    return ckpt.TrainingPosition(epoch=0, epoch_micro_steps=steps, micro_steps=steps, optimizer_steps=steps)


def _complete(root: Path, steps: int) -> None:
    folder = root / ckpt.checkpoint_name(steps)
    folder.mkdir(parents=True)
    (folder / ckpt.MARKER).write_text("{}")


# Each scenario runs on both ranks and returns what the rank saw (JSON); a UserError is recorded.
def _shared_commit(base: Path, rank: int) -> dict:
    root = base / "shared" / "checkpoints"
    ckpt.prepare_checkpoint_root(_args(base / "shared", save_interval=1), rank)
    final = ckpt.save_checkpoint(root, {}, _position(2), keep=2, rank=rank)
    ckpt.agree_on_resume(ckpt.latest_checkpoint(root, rank))
    return {"files": sorted(p.name for p in final.iterdir()), "left": sorted(p.name for p in root.iterdir())}


def _node_local_start(base: Path, rank: int) -> dict:
    ckpt.prepare_checkpoint_root(_args(base / f"node{rank}" / "out", save_interval=1), rank)
    return {}


def _commit_not_seen(base: Path, rank: int) -> dict:
    # Rank 1 writes into the folder rank 0 made (its temporary folder is a link to it), but the
    # committed folder is on rank 0's node only: rank 1 cannot find its files after the rename.
    roots = [base / f"commit{r}" / "checkpoints" for r in (0, 1)]
    tmp_name = f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(4)}"
    if rank == 1:
        roots[1].mkdir(parents=True)
        (roots[1] / tmp_name).symlink_to(roots[0] / tmp_name)
    dist.barrier()
    try:
        ckpt.save_checkpoint(roots[rank], {}, _position(4), keep=2, rank=rank)
    finally:
        dist.barrier()
        if rank == 0:  # what rank 0 left: no complete checkpoint
            (base / "commit0.json").write_text(json.dumps({
                "complete": [p.name for p in ckpt.complete_checkpoints(roots[0])],
                "entries": sorted(p.name for p in roots[0].iterdir())}))
    return {}


def _resume_disagreement(base: Path, rank: int) -> dict:
    root = base / f"resume{rank}" / "checkpoints"
    if rank == 0:
        _complete(root, 2)
    ckpt.agree_on_resume(ckpt.latest_checkpoint(root, rank))
    return {}


def _pruning(base: Path, rank: int) -> dict:
    # A shared folder (both ranks prune it, exactly one deletes each leftover) and one of each rank's own.
    shared, own = base / "prune" / "checkpoints", base / f"prune{rank}" / "checkpoints"
    if rank == 0:
        for steps in (3, 5):  # begun by dschat: its writing tag is in them from the start
            (shared / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(steps)}" / "model").mkdir(parents=True)
            (shared / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(steps)}" / ckpt.WRITING_TAG).touch()
    (own / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(7)}").mkdir(parents=True)
    dist.barrier()
    notices = ckpt.prune_leftovers(shared, "run1") + ckpt.prune_leftovers(own, "run1")
    dist.barrier()
    return {"notices": notices, "shared": sorted(p.name for p in shared.iterdir()),
            "own": sorted(p.name for p in own.iterdir())}


def _earlier_run(base: Path, rank: int) -> dict:
    # Only rank 1's node holds an earlier run's checkpoint: a fresh run stops on every rank.
    if rank == 1:
        _complete(base / "earlier1" / "out" / "checkpoints", 6)
    dist.barrier()
    ckpt.prepare_checkpoint_root(_args(base / f"earlier{rank}" / "out"), rank)
    return {}


def _foreign_folder(base: Path, rank: int) -> dict:
    # --resume: rank 0's node holds a save dschat began and never completed (it goes), rank 1's a
    # step_<N> another tool wrote (every rank stops, and it stays as it was).
    root = base / f"foreign{rank}" / "out" / "checkpoints"
    folder = root / ckpt.checkpoint_name(5 if rank == 0 else 3)
    folder.mkdir(parents=True)
    (folder / (ckpt.WRITING_TAG if rank == 0 else "model.pt")).write_text("x")
    dist.barrier()
    try:
        ckpt.prepare_checkpoint_root(_args(base / f"foreign{rank}" / "out", resume=True), rank)
    finally:
        dist.barrier()
        left = {"left": sorted(str(p.relative_to(root)) for p in root.rglob("*"))}
        (base / f"foreign{rank}.json").write_text(json.dumps(left))
    return {}


SCENARIOS = {"shared_commit": _shared_commit, "node_local_start": _node_local_start,
             "commit_not_seen": _commit_not_seen, "resume_disagreement": _resume_disagreement,
             "pruning": _pruning, "earlier_run": _earlier_run,
             "foreign_folder": _foreign_folder}


def _worker(rank: int, base: str, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    results = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = {"ok": scenario(Path(base), rank)}
        except UserError as err:
            results[name] = {"error": str(err)}
        except Exception:  # a bug: the test shows the traceback
            results[name] = {"bug": traceback.format_exc()}
        dist.barrier()
    (Path(base) / f"rank{rank}.json").write_text(json.dumps(results))
    from dschat.runtime.dist import destroy_gloo_group
    destroy_gloo_group()  # the steps' teardown: gc first (a bare destroy aborted now and then)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ranks")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(base), str(base / "store")), nprocs=2, join=True)
    results = [json.loads((base / f"rank{r}.json").read_text()) for r in (0, 1)]
    return base, results


def _outcome(runs, name):
    """Both ranks' results; in error lines, the rank's own folder name ``<name><r>`` becomes
    ``<name>R`` (on real nodes both ranks pass the same --output_dir)."""
    _, results = runs
    for rank, result in enumerate(results):
        assert "bug" not in result[name], f"rank {rank}: {result[name]['bug']}"
    return [json.loads(re.sub(r"/(node|commit|resume|prune|earlier|foreign)[01]/", r"/\1R/", json.dumps(result[name]))) for result in results]


def test_a_shared_folder_commits_with_every_ranks_files(runs):
    first, second = _outcome(runs, "shared_commit")
    assert first == second and "error" not in first
    assert first["ok"]["files"] == [ckpt.WRITING_TAG, "consolidated", ckpt.MARKER, "rng_rank0.json", "rng_rank1.json"]
    assert first["ok"]["left"] == [ckpt.checkpoint_name(2)]  # no probe file, no temporary folder


def test_a_folder_only_rank_0_sees_stops_every_rank_at_start_up(runs):
    first, second = _outcome(runs, "node_local_start")
    assert first == second, "every rank prints the same line"
    assert first["error"].startswith(f"rank 1 on host {HOST} cannot see the checkpoint folder ")
    assert "--output_dir (and --resume_from) must be a folder that every node sees" in first["error"]


def test_a_commit_that_a_rank_cannot_see_is_never_complete(runs):
    first, second = _outcome(runs, "commit_not_seen")
    assert first == second
    assert first["error"].startswith(f"rank 1 on host {HOST} cannot see the files it wrote for the checkpoint in ")
    left = json.loads((runs[0] / "commit0.json").read_text())
    # Rank 0's folder went back under its temporary name, without a marker: the next start prunes it.
    assert left == {"complete": [], "entries": [f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_name(4)}"]}


def test_ranks_that_would_resume_from_different_steps_stop_before_loading(runs):
    first, second = _outcome(runs, "resume_disagreement")
    assert first == second
    assert first["error"].startswith(
        f"the ranks would resume from different checkpoints (rank 0 on host {HOST}: step_00000002, "
        f"rank 1 on host {HOST}: none); --output_dir (and --resume_from) must be a folder that every node sees")


def test_every_rank_prunes_its_own_leftovers_and_shared_ones_once(runs):
    first, second = _outcome(runs, "pruning")
    assert first["ok"]["shared"] == second["ok"]["shared"] == []
    assert first["ok"]["own"] == second["ok"]["own"] == []
    notices = first["ok"]["notices"] + second["ok"]["notices"]
    shared = [n for n in notices if "/prune/" in n]
    assert len(shared) == 2 and {"step_00000003" in n for n in shared} == {True, False}  # each once
    assert sum("step_00000007" in n for n in notices) == 2  # one per rank's own folder


def test_an_earlier_run_seen_by_one_rank_stops_every_rank(runs):
    first, second = _outcome(runs, "earlier_run")
    assert first == second
    assert first["error"].startswith(f"rank 1 on host {HOST} found checkpoints of an earlier run in ")
    assert "pass --resume to continue that run" in first["error"]


def test_a_folder_dschat_did_not_write_stops_every_rank_and_stays(runs):
    first, second = _outcome(runs, "foreign_folder")
    assert first == second, "every rank prints the same line"
    assert first["error"].startswith(f"rank 1 on host {HOST} sees a step_<N> (or .tmp-step_<N>) entry in ")
    assert "that dschat did not write (named above); move it out of " in first["error"]
    left = [json.loads((runs[0] / f"foreign{rank}.json").read_text())["left"] for rank in (0, 1)]
    # Rank 0's unfinished save of its own was retired (a leftover that the next start prunes).
    assert left[0] and all(entry.startswith(ckpt.TMP_PREFIX + "step_00000005-") for entry in left[0])
    assert left[1] == ["step_00000003", "step_00000003/model.pt"]  # another tool's folder, as it was
