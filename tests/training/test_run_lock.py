"""One dschat run at a time per output folder (dschat/runtime/run_lock.py): a step started on the
--output_dir of a run that is still going stops with one line, exit code 2, before its start-up
recovery or pruning touches that run's save in progress; the same process may take the folder again
(resume tests, notebooks), and lets go when the step's arguments go."""
from __future__ import annotations

import gc
import os
import stat
import subprocess
import textwrap

import pytest
import torch

from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.models.save import recover_output_dir
from dschat.runtime import run_lock
from dschat.runtime.inplace import STAGING_PREFIX
from dschat.training import checkpoint as ckpt

from helpers import PYTHON, REPO
from helpers.steps import base_argv, load_script

# Process A: a run that holds its --output_dir and is inside a model save (no journal yet) and a
# checkpoint write, until its stdin is closed.
HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from dschat.runtime.inplace import save_in_place
    from dschat.runtime.run_lock import hold_run_lock

    class Args: pass
    out = Path(sys.argv[1])
    args = Args()
    hold_run_lock(out, args)
    (out / "checkpoints" / ".tmp-step_00000002").mkdir(parents=True)
    with save_in_place(out, lambda name: name.endswith(".safetensors")) as stage:
        (stage / "config.json").write_text("{}")
        print("writing", flush=True)
        sys.stdin.read()
        (stage / "model.safetensors").write_text("new weights")
    print("saved", flush=True)
""")


def _start_holder(out):
    """Process A on ``out`` (created, with an earlier model in it), once it is inside its save."""
    out.mkdir(parents=True)
    (out / "model.safetensors").write_text("old weights")
    proc = subprocess.Popen([PYTHON, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline() == "writing\n", proc.stderr.read()
    return proc


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture
def holder(tmp_path):
    out = tmp_path / "out"
    proc = _start_holder(out)
    yield proc, out
    _stop(proc)


@pytest.fixture
def inner_holder(tmp_path):
    """Process A using ``out/<name>`` (a step whose --output_dir is a folder inside another's)."""
    procs = []

    def start(name):
        procs.append(_start_holder(tmp_path / "out" / name))
        return procs[-1], tmp_path / "out"

    yield start
    for proc in procs:
        _stop(proc)


def _finish(proc) -> None:
    out, err = proc.communicate("", timeout=120)
    assert proc.returncode == 0 and out == "saved\n", err


def _in_flight(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(STAGING_PREFIX)) + sorted(
        p.name for p in (out / "checkpoints").iterdir())


@pytest.fixture
def rank0(monkeypatch):
    """Before distributed start-up, as the launcher's rank 0 (check_checkpoint_args' view)."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


def _args(out, **extra):
    values = {"output_dir": str(out), "resume_from": None, "resume": False, "save_interval": 0,
              "keep_checkpoints": 2, "max_nonfinite_steps": 0, **extra}
    return type("Args", (), values)()


def test_a_step_on_the_folder_of_a_running_one_stops_and_touches_nothing(holder, rank0, tmp_path, capsys):
    """The reviewer's case: run A inside a model save; B, a step on the same --output_dir (here a bad
    --resume_from, exit 2 right after start-up's recovery), removed A's staging folder. Now B stops
    first, in one line naming A; A's save and checkpoint write go on and finish."""
    proc, out = holder
    before = _in_flight(out)
    assert len(before) == 2
    step1 = load_script("step1")
    argv = ["--model_name_or_path", "tiny-llama", "--data_path", "dschat/builtin", "--output_dir", str(out),
            "--resume_from", str(tmp_path / "nothing")]
    assert cli_main(step1.main, argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.err == (f"error: another dschat run (pid {proc.pid}) is using --output_dir {out}; wait for it "
                            "to end or pick another --output_dir\n")
    assert "[checkpoint]" not in captured.out
    assert _in_flight(out) == before  # nothing recovered, nothing pruned
    _finish(proc)
    assert (out / "model.safetensors").read_text() == "new weights"
    # A has ended: the next start-up takes the folder.
    args = _args(out)
    ckpt.check_checkpoint_args(args)


def test_recover_cli_waits_for_the_run_using_the_folder_or_the_one_above(holder, tmp_path):
    """``python -m dschat.models.save --recover`` on a running run's folder, or on its ``actor/``."""
    proc, out = holder
    (out / "actor").mkdir()
    for folder in (out, out / "actor"):
        cli = subprocess.run([PYTHON, "-m", "dschat.models.save", "--recover", str(folder)], capture_output=True,
                             text=True, cwd=REPO, timeout=300)
        assert cli.returncode == EXIT_USAGE, cli.stderr
        lines = cli.stderr.strip().splitlines()
        assert len(lines) == 1 and f"another dschat run (pid {proc.pid}) is using" in lines[0], cli.stderr
    assert any(p.name.startswith(STAGING_PREFIX) for p in out.iterdir())
    _finish(proc)


def test_a_start_up_leaves_the_save_of_a_run_in_a_folder_inside_its_own_alone(inner_holder, rank0, capsys):
    """A start-up finishes or undoes unfinished saves in the subfolders of its --output_dir (step 3's
    actor/ after a kill); one that another run is saving into right now is left to that run."""
    proc, out = inner_holder("sub")
    sub = out / "sub"
    before = _in_flight(sub)
    ckpt.check_checkpoint_args(_args(out))
    assert capsys.readouterr().out == (f"[checkpoint] left {sub} as it is: another dschat run (pid {proc.pid}) is "
                                       f"using the folder {sub}; it finishes or undoes its own save there\n")
    assert _in_flight(sub) == before
    _finish(proc)
    assert (sub / "model.safetensors").read_text() == "new weights"


def test_step3_holds_the_model_folders_it_saves_into(inner_holder, rank0, tmp_path, critic_dirs, data_cache, capsys):
    """Step 3 saves into actor/ and critic/ of its --output_dir: a run using one of them stops it in one
    line (its save left alone), and while step 3 holds them another command on one is refused."""
    from helpers.step3 import base_argv as step3_argv, refused_in_process, step3_main

    proc, out = inner_holder("actor")
    before = _in_flight(out / "actor")
    argv = step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out))
    line = refused_in_process(argv, capsys)
    assert line == (f"error: another dschat run (pid {proc.pid}) is using the folder for the actor {out / 'actor'}; "
                    "wait for it to end or pick another --output_dir")
    assert _in_flight(out / "actor") == before
    _finish(proc)
    # The other way round: step 3's start-up holds them while its arguments live.
    step3 = step3_main()
    args = step3.parse_args(argv)
    step3.check_paths(args)
    for name in ("actor", "critic"):
        assert run_lock.lock_holder(out / name / run_lock.LOCK_NAME) == os.getpid()
    cli = subprocess.run([PYTHON, "-m", "dschat.models.save", "--recover", str(out / "critic")], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert cli.returncode == EXIT_USAGE and f"another dschat run (pid {os.getpid()}) is using" in cli.stderr
    run_lock.release_run_lock(args)
    assert not (out / "critic").exists()  # made for the run, which wrote nothing there
    assert not (out / "actor" / run_lock.LOCK_NAME).exists() and (out / "actor" / "model.safetensors").is_file()


def test_only_the_launchers_rank_0_holds_step3s_model_folders(tmp_path, critic_dirs, data_cache, monkeypatch):
    """Another rank taking them would find rank 0's hold and stop."""
    from helpers.step3 import base_argv as step3_argv, step3_main

    out = tmp_path / "out"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    step3 = step3_main()
    args = step3.parse_args(step3_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out)))
    step3.check_paths(args)  # args lives on: a hold taken would stay
    assert not (out / "actor").exists() and not (out / "critic").exists()
    run_lock.release_run_lock(args)


def test_step3_sets_an_earlier_model_aside_only_when_no_run_uses_its_folder(inner_holder):
    """A critic-free step 3's end renames an earlier run's critic/ to critic.earlier; not while another
    run is saving into it."""
    from dschat.training.run_setup import set_unsaved_models_aside

    proc, out = inner_holder("critic")
    critic = out / "critic"
    notices = set_unsaved_models_aside(out, ["critic"], [])
    assert notices == [f"{critic} holds an earlier run's model (this run saved none there); it stays: another dschat "
                       f"run (pid {proc.pid}) is using the folder {critic}; wait for it to end, then move the folder "
                       "yourself"]
    assert critic.is_dir() and not (out / "critic.earlier").exists()
    _finish(proc)
    assert set_unsaved_models_aside(out, ["critic"], []) == [
        f"{critic} holds an earlier run's model (this run saved none there): now in {out / 'critic.earlier'}"]
    earlier = out / "critic.earlier"
    assert (earlier / "model.safetensors").read_text() == "new weights" and not (earlier / run_lock.LOCK_NAME).exists()


def test_the_same_process_takes_its_folder_again_and_lets_go_with_the_arguments(rank0, tmp_path):
    """Two step start-ups in one process (a run, then its --resume) share the lock; it goes when the
    last one's arguments go, and then another process takes the folder."""
    out = tmp_path / "out"
    first, second = _args(out), _args(out, resume=True, save_interval=1)
    ckpt.check_checkpoint_args(first)
    ckpt.check_checkpoint_args(second)  # reentrant: no "another dschat run"
    lock = out / run_lock.LOCK_NAME
    assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600 and run_lock.lock_holder(lock) == os.getpid()
    (out / "model.safetensors").write_text("saved")  # the run wrote there: the folder stays
    del first
    gc.collect()
    assert run_lock.lock_holder(lock) == os.getpid()
    run_lock.release_run_lock(second)  # a main ending its hold itself, its arguments still alive
    run_lock.release_run_lock(second)  # once only
    assert run_lock.lock_holder(lock) is None and not lock.exists()  # a finished run leaves no lock file
    cli = subprocess.run([PYTHON, "-m", "dschat.models.save", "--recover", str(out)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert cli.returncode == 0 and "nothing to do" in cli.stdout, cli.stderr


class _Owner:
    """Stands in for a step's parsed arguments."""


def test_a_refused_run_leaves_no_folder_behind(tmp_path):
    """Bad input found after the lock was taken: the folder made for it goes with it."""
    out = tmp_path / "new" / "out"
    owner = _Owner()
    run_lock.hold_run_lock(out, owner)
    assert (out / run_lock.LOCK_NAME).is_file()
    with run_lock.run_lock(out):  # reentrant as a context manager too
        pass
    del owner
    gc.collect()
    assert not (tmp_path / "new").exists()


def test_a_step_main_lets_go_of_its_folder_when_it_ends_though_its_arguments_live(tmp_path):
    """``releasing_run_locks`` (every step's ``main``): the holds taken during the call go when it
    returns or raises, even while something still refers to the arguments (an engine in the result,
    a reference cycle); a hold taken before the call stays."""
    before, during, kept = tmp_path / "before", tmp_path / "during", []
    outer = _Owner()
    run_lock.hold_run_lock(before, outer)

    @run_lock.releasing_run_locks
    def main():
        kept.append(_Owner())
        run_lock.hold_run_lock(during, kept[-1])
        (during / "model.safetensors").write_text("saved")
        raise UserError("bad input found after start-up")

    with pytest.raises(UserError):
        main()
    assert kept and run_lock.lock_holder(during / run_lock.LOCK_NAME) is None
    assert run_lock.lock_holder(before / run_lock.LOCK_NAME) == os.getpid()
    run_lock.release_run_lock(outer)


@pytest.mark.parametrize("plant", ["group-writable", "symlink", "folder"])
def test_a_lock_file_another_account_could_have_planted_is_refused(plant, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stage = out / f"{STAGING_PREFIX}abcd"
    stage.mkdir(mode=0o700)
    lock = out / run_lock.LOCK_NAME
    if plant == "group-writable":
        lock.write_text("")
        os.chmod(lock, 0o666)
    elif plant == "symlink":
        (tmp_path / "elsewhere").write_text("")
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        lock.mkdir()
    with pytest.raises(UserError, match=rf"^--output_dir {out}: its run lock {lock} is not a plain file that only you "
                                        "own and can write to"):
        recover_output_dir(out, run=_args(out))
    assert stage.is_dir()  # nothing recovered


def test_lock_holder_reads_linux_flock_table(tmp_path):
    target = tmp_path / "f"
    target.write_text("")
    inode = os.stat(target).st_ino
    table = tmp_path / "locks"
    table.write_text(f"1: POSIX  ADVISORY  WRITE 11 00:2f:{inode} 0 EOF\n"
                     f"2: FLOCK  ADVISORY  WRITE 4242 fd:01:{inode} 0 EOF\n")
    assert run_lock.lock_holder(target, str(table)) == 4242
    table.write_text(f"1: FLOCK  ADVISORY  WRITE 4242 fd:01:{inode + 1} 0 EOF\n")
    assert run_lock.lock_holder(target, str(table)) is None
    assert run_lock.lock_holder(target, str(tmp_path / "missing")) is None



@pytest.mark.slow
def test_a_step_run_twice_in_one_process_then_another_process_takes_the_folder(tmp_path):
    """A step ``main`` and its ``--resume`` in one process on one folder, as the resume tests do; once
    ``main`` has returned, the folder is free for another process."""
    main = load_script("step1").main
    out = tmp_path / "out"
    argv = base_argv("tiny-llama", tmp_path / "data", "--output_dir", str(out), "--save_interval", "1",
                     max_train_steps=1, batch_size=2)
    assert main(argv).optimizer_steps == 1
    assert main([*argv, "--resume"]).optimizer_steps == 1
    assert run_lock.lock_holder(out / run_lock.LOCK_NAME) is None
    cli = subprocess.run([PYTHON, "-m", "dschat.models.save", "--recover", str(out)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert cli.returncode == 0 and "nothing to do" in cli.stdout, cli.stderr


def test_a_file_system_without_flock_runs_unlocked_and_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """Some network mounts refuse ``flock`` (ENOLCK): the run goes on with a notice, and the lock file
    and the folders made for it, which would protect nothing, are not left behind."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "new" / "out"
    owner = _Owner()
    run_lock.hold_run_lock(out, owner)
    assert "cannot be locked on this file system (No locks available)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
