"""A symbolic link another account planted in an output folder it can write to (a team folder, one
made 0777) is never written through: ``metrics.jsonl``, ``training.log``, the started stamp,
``checkpoints/`` and step 3's model folders are refused in one line, and the link's target (a file or
folder of this user's) is untouched. The user's own links keep working.

Another account's link is simulated with ``os.lchown`` (needs root; a link's owner is its own).
"""
from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.runtime import fs, trust
from dschat.runtime.inplace import save_in_place

from helpers.steps import base_argv, load_script

OTHER_UID = 65534  # "nobody"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another uid (lchown) needs root")


def plant(link: Path, target: Path) -> Path:
    """``link`` -> ``target``, made by the other account."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    return link


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` (links not followed): a file's bytes, None for a folder or a link."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))}


def refusal(link: Path) -> str:
    """The one line for ``link``, planted by the other account."""
    return (f"{link} is a symbolic link another account (nobody, uid {OTHER_UID}) made; dschat would write through "
            "it: remove it, or use an --output_dir only you can write to")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """This user's files the other account points its links at."""
    folder = tmp_path / "victim"
    (folder / "model").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "model" / "config.json").write_text('{"model_type": "opt"}')
    (folder / "model" / "model.safetensors").write_bytes(b"weights")
    (folder / "model" / "v_head.safetensors").write_bytes(b"value head")
    return folder


def test_foreign_link_names_the_owner_and_spares_the_users_own(tmp_path, victim):
    own = tmp_path / "own"
    own.symlink_to(victim / "notes.txt")
    assert trust.foreign_link(own) is None and trust.foreign_link(victim / "notes.txt") is None
    assert trust.foreign_link(tmp_path / "missing") is None
    planted = plant(tmp_path / "planted", victim / "notes.txt")
    assert trust.foreign_link(planted) == f"a symbolic link another account (nobody, uid {OTHER_UID}) made"
    assert fs.foreign_link_line(planted) == refusal(planted)


@pytest.mark.parametrize("mode", ["w", "a", "wb", "w+b"])
def test_open_own_refuses_another_accounts_link_and_writes_through_the_users_own(tmp_path, victim, mode):
    before = snapshot(victim)
    planted = plant(tmp_path / "out" / "metrics.jsonl", victim / "notes.txt")
    with pytest.raises(UserError) as err:
        fs.open_own(planted, mode)
    assert str(err.value) == refusal(planted)
    dangling = plant(tmp_path / "out" / "training.log", victim / "new.txt")  # would create the file
    with pytest.raises(UserError):
        fs.open_own(dangling, mode)
    chain = tmp_path / "out" / "chain"  # the user's own link to another account's: refused at that one
    chain.symlink_to(planted)
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link another account"):
        fs.open_own(chain, mode)
    assert snapshot(victim) == before
    own = tmp_path / "out" / "own.log"
    own.symlink_to(tmp_path / "elsewhere.log")
    with fs.open_own(own, mode) as f:
        f.write(b"x" if "b" in mode else "x")
    assert (tmp_path / "elsewhere.log").read_text() == "x" and own.is_symlink()


def test_metrics_are_never_written_through_another_accounts_link(tmp_path, victim):
    from dschat.rlhf.heldout.evaluation import StepThreeEvaluation
    from dschat.rlhf.ppo_loop import append_metrics

    before = snapshot(victim)
    out = tmp_path / "out"
    metrics = plant(out / "metrics.jsonl", victim / "notes.txt")
    for fresh in (True, False):
        with pytest.raises(UserError) as err:
            append_metrics(metrics, {"global_step": 1, "loss": 0.5}, fresh=fresh)
        assert str(err.value) == refusal(metrics)
    evaluation = object.__new__(StepThreeEvaluation)  # only what its metrics record reads
    evaluation.rank, evaluation.best, evaluation.tb, evaluation.output_dir = 0, None, None, out
    evaluation.save_best_by = "none"
    record = {"global_step": 0, "proxy": 0.5, "proxy_se": 0.1, "judges": {}, "judges_se": {}, "kl_to_ref": 0.0,
              "response_length": 4.0, "eos_rate": 1.0, "entropy": 1.0, "seconds": 1.0, "eval_share": 0.1,
              "new_best": False}
    for step in (0, 3):
        with pytest.raises(UserError, match="metrics.jsonl is a symbolic link another account"):
            evaluation._log({**record, "global_step": step}, None)
    assert snapshot(victim) == before
    # The user's own link: written through, fresh then appended.
    metrics.unlink()
    metrics.symlink_to(tmp_path / "kept.jsonl")
    append_metrics(metrics, {"global_step": 0}, fresh=True)
    evaluation._log({**record, "global_step": 1}, None)
    assert [json.loads(x)["global_step"] for x in (tmp_path / "kept.jsonl").read_text().splitlines()] == [0, 1]


def test_the_launchers_log_is_never_written_through_another_accounts_link(tmp_path, victim):
    from dschat.launch_log import LogTee

    before = snapshot(victim)
    out = tmp_path / "out"
    for target in (victim / "notes.txt", victim / "new.log"):  # an existing file, and one it would create
        log = plant(out / "training.log", target)
        with pytest.raises(UserError) as err:
            LogTee(log)
        assert str(err.value) == refusal(log)
        assert sorted(p.name for p in out.iterdir()) == ["training.log"] and log.is_symlink()
        log.unlink()
    # Planted while the run goes (the step replaced the log's folder): close refuses, the handle is closed.
    tee = LogTee(out / "training.log")
    tee.write(b"the run's log\n")
    (out / "training.log").unlink()
    plant(out / "training.log", victim / "notes.txt")
    with pytest.raises(UserError, match="training.log is a symbolic link another account"):
        tee.close()
    assert tee.handle.closed
    assert snapshot(victim) == before
    # The user's own link to a log elsewhere is written through.
    (out / "training.log").unlink()
    (out / "training.log").symlink_to(tmp_path / "logs" / "run.log")
    (tmp_path / "logs").mkdir()
    tee = LogTee(out / "training.log")
    tee.write(b"mine\n")
    tee.close()
    assert (tmp_path / "logs" / "run.log").read_bytes() == b"mine\n"


def test_the_launcher_refuses_a_planted_training_log_in_one_line(tmp_path, victim, capsys, monkeypatch):
    """``python -m dschat.launch ...``: exit 2, one line, before the step runs; nothing created."""
    from dschat import launch as L
    from dschat import multinode as M
    from dschat.recipes import loading as recipe_loading
    from dschat.recipes import steps as recipe_steps

    from helpers import REPO

    monkeypatch.setattr(M, "DEFAULT_HOSTFILE", str(tmp_path / "no-job-hostfile"))
    root = tmp_path / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    for spec in recipe_steps.STEPS.values():
        (root / spec.folder).mkdir(parents=True)
        (root / spec.main_py).write_text(textwrap.dedent("""
            import sys
            open(sys.argv[sys.argv.index("--output_dir") + 1] + "/ran", "w").close()
            """))
    recipe_loading._CACHE.clear()
    out = tmp_path / "out"
    log = plant(out / "training.log", victim / "created-by-the-log")
    before = snapshot(victim)
    code = L._entry(["--repo-root", str(root), "--launcher", "python", "step1", "cpu/tiny", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err == f"error: {refusal(log)}\n"
    assert snapshot(victim) == before and sorted(p.name for p in out.iterdir()) == ["training.log"]


def test_the_started_stamp_is_not_made_through_another_accounts_link(tmp_path, victim, monkeypatch):
    from dschat.paths import STARTED_FILE_VAR
    from dschat.training.run_setup import setup_run

    stamp = plant(tmp_path / "out" / ".training.log.started-1", victim / "stamp")
    monkeypatch.setenv(STARTED_FILE_VAR, str(stamp))
    setup_run(SimpleNamespace(output_dir=None, dtype="fp32", seed=1))
    assert not (victim / "stamp").exists()
    monkeypatch.setenv(STARTED_FILE_VAR, str(tmp_path / "out" / "mine"))
    setup_run(SimpleNamespace(output_dir=None, dtype="fp32", seed=1))
    assert (tmp_path / "out" / "mine").is_file()


def test_a_save_in_place_never_goes_into_another_accounts_link(tmp_path, victim):
    from dschat.models.save import is_model_artifact

    before = snapshot(victim)
    actor = plant(tmp_path / "out" / "actor", victim / "model")
    with pytest.raises(UserError) as err:
        with save_in_place(actor, is_model_artifact) as stage:
            (stage / "model.safetensors").write_bytes(b"the other account's weights")
    assert str(err.value) == refusal(actor)
    assert snapshot(victim) == before
    best = plant(tmp_path / "out" / "best", victim / "model")  # step 3's best models: swapped in whole
    with pytest.raises(UserError, match="best is a symbolic link another account"):
        with fs.atomic_dir(best) as tmp:
            (tmp / "model.safetensors").write_bytes(b"the other account's weights")
    (victim / ".model.partial-1234abcd").mkdir()  # a leftover recovery would remove through the link
    before = snapshot(victim)
    assert fs.recover_dir(best) == [f"left {best} alone: {refusal(best)}"]
    assert snapshot(victim) == before
    own = tmp_path / "out" / "critic"  # the user's own link to a folder on a bigger disk: saved through
    (tmp_path / "bigdisk" / "critic").mkdir(parents=True)
    own.symlink_to(tmp_path / "bigdisk" / "critic")
    with save_in_place(own, is_model_artifact) as stage:
        (stage / "model.safetensors").write_bytes(b"new")
    assert (tmp_path / "bigdisk" / "critic" / "model.safetensors").read_bytes() == b"new"


def other_run(folder: Path) -> Path:
    """Another run's checkpoints that start-up recovery would rearrange: a step dschat began and never
    completed (retired, then pruned) and a leftover of a stopped save (pruned)."""
    for name in ("step_4", ".tmp-step_2"):
        (folder / name).mkdir(parents=True)
        (folder / name / ".dschat-checkpoint-writing").write_text("writing\n")
        (folder / name / "rng_rank0.json").write_text("{}")
    return folder


def test_checkpoint_recovery_and_saves_never_go_into_another_accounts_link(tmp_path, victim):
    from dschat.training.checkpoint import TrainingPosition, prepare_checkpoint_root, save_checkpoint

    other = other_run(victim / "otherrun" / "checkpoints")
    before = snapshot(victim)
    out = tmp_path / "out"
    link = plant(out / "checkpoints", other)
    args = SimpleNamespace(output_dir=str(out), save_interval=1, keep_checkpoints=1, resume=True, resume_from=None)
    with pytest.raises(UserError) as err:
        prepare_checkpoint_root(args, 0)
    assert str(err.value) == refusal(link)
    with pytest.raises(UserError, match="checkpoints is a symbolic link another account"):
        save_checkpoint(link, {}, TrainingPosition(0, 0, 0, 6), keep=1, rank=0)
    assert snapshot(victim) == before
    # The user's own link (checkpoints on a bigger disk): recovered through as before.
    link.unlink()
    link.symlink_to(other_run(tmp_path / "bigdisk" / "ckpts"))
    prepare_checkpoint_root(args, 0)
    assert sorted(os.listdir(tmp_path / "bigdisk" / "ckpts")) == []


@pytest.mark.parametrize("entry", ["checkpoints", "training.log", "metrics.jsonl"])
def test_start_up_refuses_another_accounts_link_in_the_output_folder(tmp_path, victim, entry):
    from dschat.training.run_setup import check_output_paths

    out = tmp_path / "out"
    link = plant(out / entry, victim / ("model" if entry == "checkpoints" else "notes.txt"))
    args = SimpleNamespace(output_dir=str(out))
    with pytest.raises(UserError) as err:
        check_output_paths(args)
    assert str(err.value) == refusal(link)
    link.unlink()
    link.symlink_to(victim / ("model" if entry == "checkpoints" else "notes.txt"))  # the user's own
    check_output_paths(args)


def test_step1_stops_before_anything_when_another_account_planted_checkpoints(tmp_path, victim, capsys):
    other = other_run(victim / "otherrun" / "checkpoints")
    out = tmp_path / "out"
    link = plant(out / "checkpoints", other)
    before, out_before = snapshot(victim), snapshot(out)
    code = cli_main(load_script("step1").main, base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(out),
                                                         "--save_interval", "1"))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [f"error: {refusal(link)}"]
    assert snapshot(victim) == before and snapshot(out) == out_before


@pytest.mark.parametrize("folder", ["actor", "critic"])
def test_step3_stops_before_anything_when_another_account_planted_a_model_folder(tmp_path, victim, folder,
                                                                                critic_dirs, data_cache, capsys):
    from helpers.step3 import base_argv as step3_argv, refused_in_process

    out = tmp_path / "out"
    link = plant(out / folder, victim / "model")
    before = snapshot(victim)
    line = refused_in_process(step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out)),
                              capsys)
    assert line == f"error: {refusal(link)}"
    assert snapshot(victim) == before  # no run lock made in it either


def test_an_output_folder_that_is_or_passes_through_another_accounts_link_is_refused_at_parsing(tmp_path, victim):
    """``--output_dir team/run1`` where the other account made ``team/run1`` (or ``team/actor-models``,
    a folder e2e puts a step's output under) a link to this user's folder: every write of the run
    would land there. Refused when the flag is read; the user's own link is followed as before."""
    import e2e_rlhf

    team = tmp_path / "team"
    team.mkdir()
    plant(team / "run1", victim)
    plant(team / "actor-models", victim)
    with pytest.raises(UserError, match=rf"^--output_dir {team / 'run1'}: {team / 'run1'} is a symbolic link another "
                                        r"account \(nobody, uid 65534\) made; dschat would write through it"):
        fs.resolve_output_dir(str(team / "run1"))
    with pytest.raises(UserError, match=rf"{team / 'actor-models'} is a symbolic link another account"):
        fs.resolve_output_dir(str(team / "actor-models" / "tiny-opt"))
    args = e2e_rlhf.parse_args(["--output-dir", str(team / "run1"), "--step", "1"], e2e_rlhf.load_e2e_config())
    with pytest.raises(UserError, match=r"^--output-dir .*run1 is a symbolic link another account"):
        e2e_rlhf.check_inputs(args)
    (team / "mine").symlink_to(victim)  # the user's own link: its target
    assert fs.resolve_output_dir(str(team / "mine")) == str(victim.resolve())
    assert snapshot(victim) == {"model": None, "model/config.json": b'{"model_type": "opt"}',
                                "model/model.safetensors": b"weights", "model/v_head.safetensors": b"value head",
                                "notes.txt": b"my notes\n"}


@pytest.mark.parametrize("flags", [{"enable_tensorboard": True}, {"report_to": ("mlflow",)}])
def test_a_tensorboard_path_through_another_accounts_link_is_refused_at_start_up(tmp_path, victim, flags):
    """``--tensorboard_path team/tb`` where the other account made ``team/tb`` a link to this user's
    folder: the event files (and W&B / MLflow's, without ``--output_dir``) would be written there."""
    from dschat.training.run_setup import check_output_paths

    team = tmp_path / "team"
    link = plant(team / "tb", victim)
    args = SimpleNamespace(tensorboard_path=str(link / "step1"), **flags)
    with pytest.raises(UserError, match=rf"^--tensorboard_path {link / 'step1'}: {link} is a symbolic link another "
                                        r"account \(nobody, uid 65534\) made; dschat would write through it: remove "
                                        r"it, or use an --tensorboard_path only you can write to$"):
        check_output_paths(args)
    link.unlink()
    link.symlink_to(victim)  # the user's own link
    check_output_paths(args)
    check_output_paths(SimpleNamespace(tensorboard_path=str(tmp_path / "x"), report_to=("mlflow",),
                                       output_dir=str(tmp_path / "out")))  # the trackers write under --output_dir
