"""dschat.launch: the deepspeed command from a recipe, streaming to terminal + training.log, exit
codes, out-of-memory detection, and the generated shell scripts driven with a fake launcher."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dschat import launch as L
from dschat import multinode as M
from dschat.recipes import loading as recipe_loading
from dschat.recipes import scripts as recipe_scripts
from dschat.recipes import steps as recipe_steps
from dschat.errors import UserError

from helpers import REPO


# A stand-in for a step's main.py: prints its argv, a progress bar with carriage returns, writes to
# stderr, optionally replaces its --output_dir as dschat's atomic save does, exits with $FAKE_RC.
FAKE_MAIN = textwrap.dedent(
    """
    import json, os, shutil, sys, time
    argv = sys.argv[1:]
    print("ARGV " + json.dumps(argv), flush=True)
    for i in range(3):
        sys.stderr.write(f"\\rprogress {i}/3"); sys.stderr.flush()
    sys.stderr.write("\\n")
    if os.environ.get("FAKE_REPLACE_OUTPUT"):
        out = argv[argv.index("--output_dir") + 1]
        os.replace(out, out + ".old"); os.makedirs(out)
        open(os.path.join(out, "config.json"), "w").write("{}")
        shutil.rmtree(out + ".old")
    if os.environ.get("FAKE_STARTED"):  # as dschat.training.run_setup.setup_run does
        open(os.environ["DSCHAT_STARTED_FILE"], "w").close()
    for i in range(int(os.environ.get("FAKE_LINES", "0"))):
        print(f"filler {i}", flush=True)
    print(os.environ.get("FAKE_MESSAGE", "done"), flush=True)
    sys.exit(int(os.environ.get("FAKE_RC", "0")))
    """
)

# A stand-in for the deepspeed launcher: records its argv in $FAKE_ARGV_FILE (and the .deepspeed_env
# that $DS_ENV_FILE names, as the real one would read it, in $FAKE_ARGV_FILE.env), exits with $FAKE_RC.
FAKE_LAUNCHER = textwrap.dedent(
    """
    import json, os, sys
    with open(os.environ["FAKE_ARGV_FILE"], "w") as fh:
        json.dump(sys.argv[1:], fh)
    if os.environ.get("DS_ENV_FILE"):
        with open(os.environ["DS_ENV_FILE"]) as src, open(os.environ["FAKE_ARGV_FILE"] + ".env", "w") as dst:
            dst.write(src.read())
    print("fake deepspeed launcher", flush=True)
    sys.exit(int(os.environ.get("FAKE_RC", "0")))
    """
)


@pytest.fixture(autouse=True)
def no_job_hostfile(tmp_path: Path, monkeypatch) -> None:
    """A /job/hostfile on the test machine would make every launch multi-node."""
    monkeypatch.setattr(M, "DEFAULT_HOSTFILE", str(tmp_path / "no-job-hostfile"))


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """A checkout with the real configs/ and fake main.py files."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    for spec in recipe_steps.STEPS.values():
        (root / spec.folder).mkdir(parents=True)
        (root / spec.main_py).write_text(FAKE_MAIN, encoding="utf-8")
    recipe_loading._CACHE.clear()
    return root


class Sink:
    def __init__(self) -> None:
        self.data = b""

    def __call__(self, chunk: bytes) -> None:
        self.data += chunk


def _hostfile(tmp_path: Path, *hosts: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\n" + "".join(f"{h} slots=1\n" for h in hosts), encoding="utf-8")
    return str(path)


def test_plan_builds_the_deepspeed_argument_list(fake_root, tmp_path, monkeypatch):
    monkeypatch.delenv(L.LAUNCHER_ENV, raising=False)
    recipe = recipe_loading.get_recipe("step3", "opt/single_node/1.3b", fake_root)
    hostfile = _hostfile(tmp_path, "node1.invalid", "node2.invalid")
    plan = L.plan(recipe, {"actor_model": "/a", "critic_model": "/c", "output_dir": "/o"}, ["--seed", "7"],
                  launcher_overrides={"hostfile": hostfile, "num_gpus": None}, repo_root=fake_root)
    assert Path(plan.argv[0]).name in ("deepspeed", sys.executable.split("/")[-1])
    i = plan.argv.index(str(fake_root / "training/step3_rlhf_finetuning/main.py"))
    # Several nodes keep the recipe's port: every host must agree on it.
    assert plan.argv[1:i] in (["--hostfile", hostfile, "--master_port", "12346"],
                              ["-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--master_port", "12346"])
    assert plan.hosts.names == ("node1.invalid", "node2.invalid")
    flags = plan.argv[i + 1:]
    assert flags[:6] == ["--data_path", "Dahoas/rm-static", "--data_split", "2,4,4", "--actor_model_name_or_path", "/a"]
    assert flags[-2:] == ["--seed", "7"] and flags.count("--seed") == 1
    assert plan.log_path == Path("/o/training.log")
    assert plan.env["PYTHONUNBUFFERED"] == "1"


def test_num_gpus_on_one_node_takes_the_gpus_cuda_visible_devices_shows(fake_root, monkeypatch):
    """DeepSpeed's launcher drops CUDA_VISIBLE_DEVICES under --num_gpus (GPU 0 whatever the user chose)."""
    import dataclasses

    from dschat.recipes.recipe import Launcher

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    recipe = recipe_loading.get_recipe("step1", "opt/single_gpu/1.3b", fake_root)

    def launcher_argv(**overrides):
        argv = L.plan(recipe, {"output_dir": "/o"}, launcher_overrides=overrides, repo_root=fake_root).argv
        return argv[:argv.index(str(fake_root / recipe.step.main_py))]

    argv = launcher_argv()
    assert argv[argv.index("--include") + 1] == "localhost:2" and "--num_gpus" not in argv
    argv = launcher_argv(num_gpus=2)
    assert argv[argv.index("--include") + 1] == "localhost:2,3"
    argv = launcher_argv(num_gpus=2, num_nodes=1)  # DeepSpeed refuses --num_nodes beside --include
    assert "--num_nodes" not in argv and argv[argv.index("--include") + 1] == "localhost:2,3"
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import e2e_rlhf

    assert e2e_rlhf._launch_world(argv) == 2  # the memory plan's ranks: the GPUs included
    with pytest.raises(UserError, match="--num_gpus 3 but CUDA_VISIBLE_DEVICES=2,3 shows 2 GPU"):
        launcher_argv(num_gpus=3)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # no GPUs to choose: as given
    argv = launcher_argv()
    assert argv[argv.index("--num_gpus") + 1] == "1" and "--include" not in argv
    both = dataclasses.replace(recipe, launcher=Launcher(num_gpus=1, include="localhost:1"))
    with pytest.raises(UserError, match="include/exclude and num_gpus/num_nodes, which DeepSpeed's launcher refuses"):
        L.plan(both, {"output_dir": "/o"}, repo_root=fake_root)


def test_launcher_options_with_the_python_launcher_are_one_line(fake_root, capsys):
    code = L._entry(["--repo-root", str(fake_root), "--dry-run", "--launcher", "python", "step1", "cpu/tiny",
                     "--num_gpus", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--launcher python runs main.py as one process here; --num_gpus are the deepspeed launcher's" in err


def test_plan_without_main_py_is_a_clear_error(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    (root / "training").mkdir()
    recipe_loading._CACHE.clear()
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", root)
    with pytest.raises(UserError, match="main.py does not exist"):
        L.plan(recipe, repo_root=root)


def test_run_streams_to_terminal_and_log_and_returns_the_exit_code(fake_root, tmp_path, monkeypatch):
    out = tmp_path / "out"
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    plan = L.plan(recipe, {"output_dir": str(out)}, kind="python", repo_root=fake_root)
    monkeypatch.setenv("FAKE_RC", "3")
    monkeypatch.setenv("FAKE_MESSAGE", "last words")
    sink = Sink()
    result = L.run(plan, sink=sink)
    assert result.returncode == 3
    assert result.oom is None
    log = (out / "training.log").read_bytes()
    assert log == sink.data  # the same bytes on the terminal and in the log
    text = sink.data.decode()
    assert text.startswith("[dschat.launch] ")
    assert "\rprogress 1/3\rprogress 2/3" in text  # carriage returns pass through (live progress bars)
    assert "last words" in text
    argv = json.loads(text.split("ARGV ", 1)[1].splitlines()[0])
    assert argv == recipe.render({"output_dir": str(out)})


def test_a_reward_urls_password_and_query_never_reach_the_terminal_or_the_log(fake_root, tmp_path, monkeypatch):
    """The step gets the URL as given; the header, DeepSpeed's echo of the command (here the fake step's
    own, in pieces) and training.log show it without its user, password and query."""
    out = tmp_path / "out"
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    url = "http://user:SECRETPW@127.0.0.1:9/get_reward?key=QSECRET"
    plan = L.plan(recipe, {"output_dir": str(out)}, kind="python", repo_root=fake_root)
    plan.argv = [sys.executable, "-c", "import sys; [print(c, end='', flush=True) for a in sys.argv[1:] for c in a]",
                 "--reward_url", url, "x", f"--reward_url={url}"]
    sink = Sink()
    assert L.run(plan, sink=sink).returncode == 0
    log = (out / "training.log").read_bytes()
    assert log == sink.data and b"SECRET" not in log
    assert log.count(b"http://***@127.0.0.1:9/get_reward?***") == 4  # the header twice, the echo twice
    assert "SECRET" not in plan.command_line() and url in plan.argv


def test_the_redactor_hides_a_secret_split_across_any_two_chunks():
    from dschat.launch_log import Redactor

    url = "https://h/r?k=SECRET"
    text = f"cmd = ['--reward_url', '{url}'] and again --reward_url={url}.".encode()
    for cut in range(1, len(text)):
        redact = Redactor(["--reward_url", url])
        shown = redact.feed(text[:cut]) + redact.feed(text[cut:]) + redact.flush()
        assert shown == text.replace(url.encode(), b"https://h/r?***"), cut
    # One secret that begins another: the longer one is hidden whole.
    redact = Redactor(["--reward_url", "http://h/r?k=AB", "--reward_url", "http://h/r?k=ABCDEF"])
    assert redact.feed(b"x http://h/r?k=ABCDEF y http://h/r?k=AB z") + redact.flush() == (
        b"x http://h/r?*** y http://h/r?*** z")


def test_recipe_env_is_a_default_not_an_override(fake_root, tmp_path, monkeypatch):
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    plan = L.plan(recipe, {"output_dir": str(tmp_path / "o")}, kind="python", repo_root=fake_root)
    monkeypatch.setenv("FAKE_MESSAGE", "x")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    script = "import os; print('ACC', os.environ['DS_ACCELERATOR']); print('PP', os.environ['PYTHONPATH'])"
    plan.argv = [sys.executable, "-c", script]
    sink = Sink()
    L.run(plan, sink=sink, log=False)
    assert b"ACC cuda" in sink.data
    # The step's `import dschat` resolves to this checkout first.
    assert f"PP {fake_root}".encode() in sink.data
    monkeypatch.delenv("DS_ACCELERATOR")
    sink = Sink()
    L.run(plan, sink=sink, log=False)
    assert b"ACC cpu" in sink.data


def test_log_survives_an_output_folder_replaced_by_an_atomic_save(fake_root, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    recipe = recipe_loading.get_recipe("step2", "cpu/tiny", fake_root)
    plan = L.plan(recipe, {"output_dir": str(out)}, kind="python", repo_root=fake_root)
    monkeypatch.setenv("FAKE_REPLACE_OUTPUT", "1")
    monkeypatch.setenv("FAKE_MESSAGE", "after the save")
    sink = Sink()
    assert L.run(plan, sink=sink).returncode == 0
    assert (out / "config.json").is_file()  # the new folder
    log = (out / "training.log").read_bytes()
    assert log == sink.data and b"after the save" in log and b"ARGV" in log


def test_a_step_refusing_its_input_leaves_the_output_folder_as_it_was(fake_root, tmp_path, monkeypatch):
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    monkeypatch.setenv("FAKE_RC", "2")  # the step's exit code for bad input: it wrote nothing
    monkeypatch.setenv("FAKE_MESSAGE", "error: bad flag")
    fresh = tmp_path / "new" / "out"
    result = L.run(L.plan(recipe, {"output_dir": str(fresh)}, kind="python", repo_root=fake_root), sink=Sink())
    assert result.returncode == 2 and result.log_path is None
    assert not (tmp_path / "new").exists()  # the folders made for the log are gone again
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "training.log").write_text("the previous run's log\n")
    sink = Sink()
    result = L.run(L.plan(recipe, {"output_dir": str(previous)}, kind="python", repo_root=fake_root), sink=sink)
    assert result.returncode == 2 and b"error: bad flag" in sink.data  # shown on the terminal
    assert sorted(p.name for p in previous.iterdir()) == ["training.log"]
    assert (previous / "training.log").read_text() == "the previous run's log\n"
    monkeypatch.setenv("FAKE_RC", "1")  # any other failure keeps the new log, and the previous one as .1
    assert L.run(L.plan(recipe, {"output_dir": str(previous)}, kind="python", repo_root=fake_root),
                 sink=Sink()).returncode == 1
    assert sorted(p.name for p in previous.iterdir()) == ["training.log", "training.log.1"]
    assert "error: bad flag" in (previous / "training.log").read_text()
    assert (previous / "training.log.1").read_text() == "the previous run's log\n"


def test_a_step_failing_with_exit_2_after_it_started_keeps_its_log_and_earlier_logs_are_kept(fake_root, tmp_path,
                                                                                               monkeypatch):
    """Exit code 2 is also a full disk at the final save, or a run that diverged: after the step started
    up (it said so through DSCHAT_STARTED_FILE) its log stays. Earlier logs shift up to training.log.5."""
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    out = tmp_path / "out"
    monkeypatch.setenv("FAKE_STARTED", "1")
    for run in range(7):
        monkeypatch.setenv("FAKE_MESSAGE", f"run {run}")
        monkeypatch.setenv("FAKE_RC", "2" if run == 6 else "0")
        assert L.run(L.plan(recipe, {"output_dir": str(out)}, kind="python", repo_root=fake_root),
                     sink=Sink()).returncode == (2 if run == 6 else 0)
    assert sorted(p.name for p in out.iterdir()) == ["training.log"] + [f"training.log.{n}" for n in range(1, 6)]
    assert "run 6" in (out / "training.log").read_text()
    assert ["run 5" in (out / f"training.log.{n}").read_text() for n in range(1, 6)] == [True] + [False] * 4
    assert "run 1" in (out / "training.log.5").read_text()
    # A launcher killed mid-run left its previous log set aside and the step's stamp: the next launch
    # keeps that log (.1 after the one just set aside) and removes the stamp.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a launcher's pid that is no longer running
    (out / f".training.log.previous-{dead}").write_text("set aside by a killed launcher\n")
    (out / f".training.log.started-{dead}").write_text("")
    # A launcher still running on the folder (this test's parent process): its set-aside log and stamp
    # stay theirs.
    live = os.getppid()
    (out / f".training.log.previous-{live}").write_text("set aside by a running launcher\n")
    (out / f".training.log.started-{live}").write_text("")
    monkeypatch.setenv("FAKE_RC", "0")
    assert L.run(L.plan(recipe, {"output_dir": str(out)}, kind="python", repo_root=fake_root), sink=Sink()).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f".training.log.previous-{live}", f".training.log.started-{live}", "training.log"]
        + [f"training.log.{n}" for n in range(1, 6)])
    assert "run 6" in (out / "training.log.1").read_text()
    assert (out / "training.log.2").read_text() == "set aside by a killed launcher\n"


def test_leftovers_named_with_this_launchers_own_pid_are_an_earlier_launchers(fake_root, tmp_path, monkeypatch):
    """In a container a relaunch often gets the killed launcher's pid: leftovers named with this
    process's own pid are an earlier launcher's, kept as an older log, its stamp removed (a refused
    step must not look as if it had started)."""
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    out = tmp_path / "out"
    out.mkdir()
    (out / "training.log").write_text("the killed run\n")
    (out / f".training.log.previous-{os.getpid()}").write_text("the run before it\n")
    (out / f".training.log.started-{os.getpid()}").write_text("")
    monkeypatch.setenv("FAKE_MESSAGE", "refused")
    monkeypatch.setenv("FAKE_RC", "2")  # refused before start-up: it never creates its stamp
    assert L.run(L.plan(recipe, {"output_dir": str(out)}, kind="python", repo_root=fake_root), sink=Sink()).returncode == 2
    assert sorted(p.name for p in out.iterdir()) == ["training.log", "training.log.1"]
    assert (out / "training.log").read_text() == "the killed run\n"  # the refused run's log discarded
    assert (out / "training.log.1").read_text() == "the run before it\n"


def test_another_accounts_leftovers_in_a_sticky_folder_are_one_line(tmp_path, monkeypatch):
    from dschat.launch_log import LogTee

    (tmp_path / ".training.log.started-999999999").write_text("")  # a launcher gone, another account's
    real_unlink = Path.unlink

    def sticky(self, *args, **kwargs):
        if self.name.startswith(".training.log.started-"):
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", sticky)
    with pytest.raises(UserError, match=r"^cannot tidy .*\.training\.log\.started-999999999 \(Operation not "
                                        r"permitted\): another account's launch left it"):
        LogTee(tmp_path / "training.log")
    assert not (tmp_path / "training.log").exists()


def test_a_later_launch_on_the_same_folder_and_the_earlier_one_keep_both_logs_whole(tmp_path):
    """A second launcher on a folder whose launcher still runs moves the live log aside (kept as
    training.log.1); the first, ending first, must not write its log over the second's."""
    from dschat.launch_log import LogTee

    path = tmp_path / "out" / "training.log"
    first = LogTee(path)
    first.write(b"A1\n")
    second = LogTee(path)
    second.write(b"B1\n")
    first.write(b"A2\n")
    first.close()
    second.write(b"B2\n")
    second.close()
    assert path.read_bytes() == b"B1\nB2\n"
    assert (path.parent / "training.log.1").read_bytes() == b"A1\nA2\n"


@pytest.mark.parametrize("name", ["training.log", "training.log.2"])
def test_a_folder_where_a_log_goes_is_refused_before_the_step_runs(name, fake_root, tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / "training.log.1").write_text("older\n")
    if name != "training.log":
        (out / "training.log").write_text("old\n")
    before = sorted(p.name for p in out.iterdir())
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    sink = Sink()
    with pytest.raises(UserError, match=f"{out / name} is not a file, and the launcher keeps its logs there"):
        L.run(L.plan(recipe, {"output_dir": str(out)}, kind="python", repo_root=fake_root), sink=sink)
    assert b"ARGV" not in sink.data and sorted(p.name for p in out.iterdir()) == before


def test_another_accounts_log_in_a_sticky_shared_folder_is_one_line(tmp_path, monkeypatch):
    """A launcher that may not move the log another account left in a sticky folder (as /tmp) aside:
    the kernel's EPERM, stood in for here (root may move it, and a second account cannot read a
    checkout in a private folder)."""
    from dschat.launch_log import LogTee

    (tmp_path / "training.log").write_text("another account's run\n")
    real_replace = os.replace

    def sticky(src, dst, *args, **kwargs):
        if Path(src) == tmp_path / "training.log":
            raise PermissionError(1, "Operation not permitted", str(src))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", sticky)
    with pytest.raises(UserError) as err:
        LogTee(tmp_path / "training.log")
    assert str(err.value) == (f"cannot move the previous {tmp_path / 'training.log'} aside (Operation not permitted): "
                              "it is another account's log in a folder others can write to; pass an --output_dir "
                              "of your own")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["training.log"]


def test_a_tilde_output_dir_flag_puts_the_log_beside_the_model(fake_root, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    plan = L.plan(recipe, {}, ["--output_dir=~/out"], kind="python", repo_root=fake_root)
    assert plan.log_path == tmp_path / "out" / "training.log"


def test_output_dir_under_a_file_is_refused_before_the_log_is_opened(fake_root, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    code = L._entry(["--repo-root", str(fake_root), "--launcher", "python", "step1", "cpu/tiny",
                     "--output_dir", str(tmp_path / "file.txt" / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--output_dir {tmp_path / 'file.txt' / 'out'} cannot be created" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "repo"]


@pytest.mark.parametrize(
    ("tail", "code", "expected"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1, "CUDA out of memory"),
        ("RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory", 1,
         "CPU allocator failed"),
        ("[launch.py:259:sigkill_handler] [...] exits with return code = -9", 247, "a rank was killed"),
        ("", 137, "SIGKILL"),
        ("", -9, "SIGKILL"),
        ("ValueError: bad flag", 1, None),
        ("CUDA out of memory", 0, None),  # a successful run is never an OOM
    ],
)
def test_detect_oom(tail, code, expected):
    found = L.detect_oom(tail, code)
    if expected is None:
        assert found is None
    else:
        assert found is not None and expected in found


def test_run_reports_oom_and_cli_prints_advice(fake_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_RC", "1")
    monkeypatch.setenv("FAKE_MESSAGE", "torch.OutOfMemoryError: CUDA out of memory.")
    code = L._entry(["--repo-root", str(fake_root), "--launcher", "python", "step3", "cpu/tiny",
                     "--actor_model", "/a", "--critic_model", "/c", "--output_dir", str(tmp_path / "o")])
    assert code == 1
    err = capsys.readouterr().err
    assert "looks like out of memory" in err
    assert "--actor_gradient_checkpointing --critic_gradient_checkpointing" in err
    assert "--offload_reference_model" in err


def test_oom_advice_names_each_steps_flags():
    assert "--gradient_checkpointing" in L.oom_advice("step1")
    assert "--lora_dim 128 --only_optimize_lora" in L.oom_advice("step2")
    step3 = L.oom_advice("step3", cpu=True, e2e=True)
    assert "--per_device_generation_batch_size" in step3 and "(GPU memory in GB / 6)" in step3
    assert "--actor-zero-stage 3" in step3 and "RAM" in step3
    assert "--zero3_gather_for_scoring off" in step3 and "--zero3_gather_for_scoring" not in L.oom_advice("step1")


def test_cli_dry_run_and_parameters(fake_root, capsys):
    code = L._entry(["--repo-root", str(fake_root), "step1", "opt/single_node/1.3b", "--output_dir", "/x",
                     "--zero_stage", "3", "--num_gpus", "4", "--dry-run", "--", "--learning_rate", "1e-4"])
    assert code == 0
    line = capsys.readouterr().out.strip()
    assert "--num_gpus 4 " in line and "--zero_stage 3" in line and line.endswith("--output_dir /x --learning_rate 1e-4")
    assert "--learning_rate 9.65e-6" not in line


def test_cli_bad_input_is_one_line_and_exit_2(fake_root, capsys):
    assert L._entry(["--repo-root", str(fake_root), "step1", "no/such", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no step1 recipe 'no/such'") and "\n" not in err
    assert L._entry(["--repo-root", str(fake_root), "step1", "cpu/tiny", "--actor_model", "x", "--dry-run"]) == 2
    assert "takes --output_dir, --zero_stage" in capsys.readouterr().err


def test_script_args_split_positionals_from_flags(fake_root, capsys):
    code = L._entry(["--repo-root", str(fake_root), "--dry-run", "step3", "opt/single_gpu/1.3b", "--script-args",
                     "/a", "/c", "", "3", "--max_answer_seq_len", "16"])
    assert code == 0
    line = capsys.readouterr().out
    assert "--actor_model_name_or_path /a --critic_model_name_or_path /c --actor_zero_stage 0 --critic_zero_stage 3" in line
    assert line.strip().endswith("--output_dir ./output --max_answer_seq_len 16")


# ------------------------------------------------------------------------------------------------
# The generated shell scripts, end to end with a fake deepspeed launcher
# ------------------------------------------------------------------------------------------------
def test_a_terminal_whose_reader_goes_away_leaves_the_step_running_and_its_log_whole(fake_root, tmp_path):
    """``python -m dschat.launch ... | head``: once head exits, the step runs to its end (not killed
    by the launcher's BrokenPipeError), its log gets every line, and the step's exit code is kept."""
    out = tmp_path / "out"
    env = dict(os.environ, FAKE_LINES="20000", FAKE_RC="3", FAKE_MESSAGE="last words")
    proc = subprocess.Popen([sys.executable, "-m", "dschat.launch", "step1", "cpu/tiny", "--launcher", "python",
                             "--output_dir", str(out), "--repo-root", str(fake_root)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"[dschat.launch] ")
    proc.stdout.close()  # as head does after its lines
    stderr = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 3, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr
    assert "step1 exited with status 3" in stderr
    log = (out / "training.log").read_text()
    assert "filler 19999" in log and "last words" in log


@pytest.mark.parametrize("launcher", ["missing", "not-executable"])
def test_a_launcher_that_cannot_run_is_one_line_and_the_folder_is_as_it_was(launcher, fake_root, tmp_path,
                                                                            monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "training.log").write_text("the earlier run's log\n")
    target = tmp_path / "deepspeed"
    if launcher == "not-executable":
        target.write_text("#!/bin/sh\n")
    monkeypatch.setenv(L.LAUNCHER_ENV, str(target))
    assert L._entry(["step1", "cpu/tiny", "--output_dir", str(out), "--repo-root", str(fake_root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot run {target}: "), err
    assert L.LAUNCHER_ENV in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["training.log"]
    assert (out / "training.log").read_text() == "the earlier run's log\n"


def _copy_script(fake_root: Path, step: str, rid: str) -> Path:
    recipe = recipe_loading.get_recipe(step, rid, REPO)
    src = recipe_scripts.script_path(recipe, REPO)
    dst = recipe_scripts.script_path(recipe, fake_root)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    return dst


def _run_script(script: Path, args: list[str], tmp_path: Path, rc: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    launcher = tmp_path / "fake_deepspeed.py"
    launcher.write_text(FAKE_LAUNCHER, encoding="utf-8")
    argv_file = tmp_path / "argv.json"
    env = dict(os.environ, PYTHON=sys.executable, FAKE_ARGV_FILE=str(argv_file), FAKE_RC=str(rc))
    env[L.LAUNCHER_ENV] = f"{sys.executable} {launcher}"
    env.pop("DSCHAT_REPO_ROOT", None)
    proc = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    recorded = json.loads(argv_file.read_text()) if argv_file.exists() else []
    return proc, recorded


def test_step3_script_passes_upstream_positionals(fake_root, tmp_path):
    script = _copy_script(fake_root, "step3", "opt/single_node/1.3b")
    proc, argv = _run_script(script, ["/sft", "/rm", "3", "", "out3", "--actor_lora_dim", "8"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    main = str(fake_root / "training/step3_rlhf_finetuning/main.py")
    recipe = recipe_loading.get_recipe("step3", "opt/single_node/1.3b", REPO)
    expected_flags = recipe.render({"actor_model": "/sft", "critic_model": "/rm", "actor_zero_stage": "3",
                                    "output_dir": "out3"}, ["--actor_lora_dim", "8"])
    assert argv[:1] == ["--master_port"] and argv[2:] == [main, *expected_flags]
    # One node: a free port rather than the recipe's 12346, which a second run would also take.
    assert argv[1] != "12346" and M.port_is_free(int(argv[1]))
    assert "--critic_zero_stage" in argv and argv[argv.index("--critic_zero_stage") + 1] == "2"  # '' -> default
    assert "fake deepspeed launcher" in proc.stdout
    assert (tmp_path / "out3" / "training.log").read_text().count("fake deepspeed launcher") == 1


def test_step1_script_defaults_and_exit_code(fake_root, tmp_path):
    script = _copy_script(fake_root, "step1", "opt/single_gpu/1.3b")
    proc, argv = _run_script(script, [], tmp_path, rc=5)
    assert proc.returncode == 5
    assert argv[:3] == ["--num_gpus", "1", "--master_port"]
    assert argv[argv.index("--zero_stage") + 1] == "0" and argv[-2:] == ["--output_dir", "./output"]
    assert "step1 exited with status 5" in proc.stderr


def test_script_with_required_path_missing_fails_in_one_line(fake_root, tmp_path):
    script = _copy_script(fake_root, "step3", "opt/single_node/30b_lora")
    proc, argv = _run_script(script, [], tmp_path)
    assert proc.returncode == 2 and argv == []
    assert proc.stderr.strip().count("\n") == 0
    assert "needs actor_model (positional $1, ACTOR_MODEL_PATH)" in proc.stderr


@pytest.mark.slow
def test_real_deepspeed_launcher_streams_and_propagates_exit_code(fake_root, tmp_path, monkeypatch):
    monkeypatch.delenv(L.LAUNCHER_ENV, raising=False)
    monkeypatch.setenv("FAKE_RC", "4")
    monkeypatch.setenv("FAKE_MESSAGE", "rank says bye")
    out = tmp_path / "o"
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    plan = L.plan(recipe, {"output_dir": str(out)}, repo_root=fake_root)  # a free port: nothing fixed
    sink = Sink()
    result = L.run(plan, sink=sink)
    assert result.returncode == 4
    text = sink.data.decode()
    assert "rank says bye" in text and "--local_rank=0" in text  # the launcher really spawned the rank
    assert (out / "training.log").read_bytes() == sink.data


# ------------------------------------------------------------------------------------------------
# Master port, hosts, multi-node safety (issues: a busy port; many nodes; multi-node command lines)
# ------------------------------------------------------------------------------------------------
def _port_of(argv: list[str]) -> int:
    return int(argv[argv.index("--master_port") + 1])


@pytest.fixture
def busy_port():
    """A port something listens on, on every interface (as another job's rendezvous store would)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_single_node_launch_takes_a_free_port_unless_one_is_given(fake_root, busy_port, monkeypatch):
    cases = [(recipe_loading.get_recipe(step, rid, fake_root), params) for step, rid, params in (
        ("step1", "cpu/tiny", {}), ("step3", "opt/single_node/1.3b", {"actor_model": "/a", "critic_model": "/c"}))]
    for recipe, params in cases:
        port = _port_of(L.plan(recipe, params, repo_root=fake_root).argv)
        assert M.port_is_free(port) and port not in (29500, 12346, busy_port)
    taken: list[int] = []

    def free_port() -> int:  # a different port on each call, as the OS's may be
        taken.append(40000 + len(taken))
        return taken[-1]

    monkeypatch.setattr(L, "free_port", free_port)
    for recipe, params in cases:  # chosen afresh for each launch
        first = _port_of(L.plan(recipe, params, repo_root=fake_root).argv)
        second = _port_of(L.plan(recipe, params, repo_root=fake_root).argv)
        assert [first, second] == taken[-2:] and first != second
    assert len(taken) == 4
    free = M.free_port()
    assert _port_of(L.plan(cases[0][0], launcher_overrides={"master_port": free}, repo_root=fake_root).argv) == free
    assert len(taken) == 4


def test_a_busy_master_port_is_refused_in_one_line_naming_a_free_one(fake_root, tmp_path, busy_port, capsys):
    code = L._entry(["--repo-root", str(fake_root), "--dry-run", "step1", "cpu/tiny", "--master_port", str(busy_port)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"master port {busy_port} (--master_port) is already in use on this machine" in err
    suggested = int(err.rsplit("--master_port ", 1)[1].split()[0])
    assert M.port_is_free(suggested)
    # Several nodes with this machine first: its port is checked too (the recipe's or 29500 otherwise).
    hostfile = _hostfile(tmp_path, "localhost", "node2.invalid")
    with pytest.raises(UserError, match=f"master port {busy_port} .* on localhost"):
        L.plan(recipe_loading.get_recipe("step1", "cpu/tiny", fake_root), launcher_overrides={"hostfile": hostfile,
               "master_port": busy_port}, repo_root=fake_root)
    # A first host elsewhere cannot be checked from here: the port is passed on as given.
    hostfile = _hostfile(tmp_path, "node1.invalid", "node2.invalid")
    plan = L.plan(recipe_loading.get_recipe("step1", "cpu/tiny", fake_root), launcher_overrides={"hostfile": hostfile,
                  "master_port": busy_port}, repo_root=fake_root)
    assert _port_of(plan.argv) == busy_port


def test_hosts_are_read_as_the_deepspeed_launcher_reads_them(tmp_path):
    hostfile = _hostfile(tmp_path, "a", "b", "c")
    assert M.launch_hosts(hostfile).names == ("a", "b", "c")
    assert M.launch_hosts(hostfile, num_nodes=1).multi_node is False
    assert M.launch_hosts(hostfile, include="b:0,1@c").names == ("b", "c")
    assert M.launch_hosts(hostfile, exclude="a@b:1").names == ("b", "c")
    assert M.launch_hosts(hostfile, exclude="b:0@c:1").names == ("a", "c")  # b's one slot excluded: b is gone
    (tmp_path / "twice").write_text("a slots=1\nb slots=1\na slots=2\n")
    with pytest.raises(UserError, match="lists host a twice"):
        M.launch_hosts(str(tmp_path / "twice"))
    assert M.launch_hosts(None).names == ("localhost",)  # no /job/hostfile: this machine
    with pytest.raises(UserError, match="--num_nodes 2 needs a hostfile"):
        M.launch_hosts(None, num_nodes=2)
    with pytest.raises(UserError, match="--num_nodes 4 but hostfile .* lists 3"):
        M.launch_hosts(hostfile, num_nodes=4)
    with pytest.raises(UserError, match="does not exist"):
        M.launch_hosts(str(tmp_path / "missing"))
    (tmp_path / "bad").write_text("a slots=1\nb\n")
    with pytest.raises(UserError, match="bad line 'b'"):
        M.launch_hosts(str(tmp_path / "bad"))


def test_multi_node_script_takes_launcher_flags_and_passes_the_rest_to_main_py(fake_root, tmp_path):
    script = _copy_script(fake_root, "step1", "opt/multi_node/66b")
    hostfile = _hostfile(tmp_path, "node1.invalid", "node2.invalid")
    proc, argv = _run_script(script, ["out", "", "--hostfile", hostfile, "--master_addr", "10.0.0.7",
                                      "--master_port=29777", "--num_nodes", "2", "--num_gpus", "1",
                                      "--learning_rate", "1e-5"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    main = str(fake_root / "training/step1_supervised_finetuning/main.py")
    recipe = recipe_loading.get_recipe("step1", "opt/multi_node/66b", REPO)
    assert argv == ["--hostfile", hostfile, "--num_nodes", "2", "--num_gpus", "1", "--master_addr", "10.0.0.7",
                    "--master_port", "29777", main, *recipe.render({"output_dir": "out"}, ["--learning_rate", "1e-5"])]


def test_a_scripts_hostfile_after_an_equals_sign_has_its_tilde_expanded(monkeypatch, tmp_path):
    """bash leaves ``--hostfile=~/h`` as it is; ``python -m dschat.launch --hostfile=~/h`` expands it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    found, rest = L._take_launcher_flags(["out", "--hostfile=~/hosts", "--learning_rate", "1e-5"])
    assert L._launcher_values(found) == {"hostfile": str(tmp_path / "hosts")} and rest[0] == "out"


def test_launch_cli_takes_master_addr(fake_root, tmp_path, capsys):
    hostfile = _hostfile(tmp_path, "node1.invalid", "node2.invalid")
    assert L._entry(["--repo-root", str(fake_root), "--dry-run", "step2", "opt/multi_node/350m", "--hostfile",
                     hostfile, "--master_addr", "10.0.0.7", "--master_port", "29777", "--num_nodes", "2"]) == 0
    line = capsys.readouterr().out
    assert f"--hostfile {hostfile} --num_nodes 2 --master_addr 10.0.0.7 --master_port 29777 " in line


@pytest.mark.parametrize("value", ["/data/$(touch /tmp/pwned)", "/data/`id`", "out;id", "a|b", "x%n", "a\nb"])
def test_multi_node_launch_refuses_shell_metacharacters(fake_root, tmp_path, value, capsys):
    hostfile = _hostfile(tmp_path, "node1.invalid", "node2.invalid")
    code = L._entry(["--repo-root", str(fake_root), "--dry-run", "--hostfile", hostfile, "step1",
                     "opt/multi_node/66b", "--output_dir", value])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --output_dir {value!r} holds ")
    # The same value on one node is an argument-list element: no shell sees it.
    assert L._entry(["--repo-root", str(fake_root), "--dry-run", "step1", "opt/single_node/1.3b",
                     "--output_dir", value]) == 0


def test_multi_node_ranks_get_the_recipe_environment_through_a_private_deepspeed_env(fake_root, tmp_path,
                                                                                     monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\n")
    (work / ".deepspeed_env").write_text("OMP_NUM_THREADS=4\n")
    before = {p: p.read_bytes() for p in (home / ".deepspeed_env", work / ".deepspeed_env")}
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's own file wins for the ranks elsewhere
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # never on a command line
    monkeypatch.setenv("FAKE_ARGV_FILE", str(tmp_path / "argv.json"))
    monkeypatch.setenv(L.LAUNCHER_ENV, f"{sys.executable} {tmp_path / 'fake.py'}")
    (tmp_path / "fake.py").write_text(FAKE_LAUNCHER)
    hostfile = _hostfile(tmp_path, "node1.invalid", "node2.invalid")
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)  # env: DS_ACCELERATOR=cpu
    plan = L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": hostfile},
                  repo_root=fake_root)
    assert plan.rank_env["DS_ACCELERATOR"] == "cpu" and "OMP_NUM_THREADS" not in plan.rank_env
    sink = Sink()
    assert L.run(plan, sink=sink, log=False).returncode == 0
    lines = (tmp_path / "argv.json.env").read_text().splitlines()
    assert lines[:2] == ["NCCL_DEBUG=INFO", "OMP_NUM_THREADS=4"]
    assert {"DS_ACCELERATOR=cpu", "HF_HUB_OFFLINE=1"} <= set(lines)
    assert not any("hf_secret" in line for line in lines)
    assert b"the ranks on other hosts get " in sink.data and b"DS_ACCELERATOR" in sink.data
    assert {p: p.read_bytes() for p in before} == before  # the user's files are untouched
    written = Path(sink.data.decode().split(" through ", 1)[1].split()[0])
    assert written.name == ".deepspeed_env" and not written.parent.exists()  # removed after the launch
    # A value the remote shell would run is refused before anything starts.
    monkeypatch.setenv("DSCHAT_CACHE_DIR", "/c/$(id)")
    with pytest.raises(UserError, match="environment variable DSCHAT_CACHE_DIR .* holds"):
        L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": hostfile},
               repo_root=fake_root)
    # One node: the environment is inherited, nothing is written.
    assert L.plan(recipe, {"output_dir": str(tmp_path / "o")}, repo_root=fake_root).rank_env == {}


# A stand-in for the deepspeed launcher that records the names of its environment and the launch's
# .deepspeed_env ($DS_ENV_FILE), as DeepSpeed's multi-node runner would read them for the remote command.
ENV_RECORDER = textwrap.dedent(
    """
    import json, os
    seen = {"names": sorted(os.environ), "values": sorted(os.environ.values()), "env_file": ""}
    if os.environ.get("DS_ENV_FILE"):
        seen["env_file"] = open(os.environ["DS_ENV_FILE"]).read()
    with open(os.environ["FAKE_ENV_FILE"], "w") as fh:
        json.dump(seen, fh)
    """
)


@pytest.fixture
def two_hosts(tmp_path, monkeypatch):
    """A multi-node launch from a private working directory and home, with the recording launcher."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(mode=0o700)
    work.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    (tmp_path / "recorder.py").write_text(ENV_RECORDER)
    monkeypatch.setenv("FAKE_ENV_FILE", str(tmp_path / "seen.json"))
    monkeypatch.setenv(L.LAUNCHER_ENV, f"{sys.executable} {tmp_path / 'recorder.py'}")
    return _hostfile(tmp_path, "node1.invalid", "node2.invalid")


@pytest.mark.parametrize("host", ["-oProxyCommand=touch${IFS}/tmp/pwned", "-p2222", "a,b", "node[1-4]", "h%n",
                                  ".hidden", "node1;id"])
def test_a_hostfile_host_name_that_is_not_one_is_refused_in_one_line(fake_root, tmp_path, host, capsys):
    (tmp_path / "hostfile").write_text(f"node1 slots=1\n{host} slots=1\n")
    with pytest.raises(UserError, match="names host .* which is not a host name"):
        M.read_hostfile(tmp_path / "hostfile")
    code = L._entry(["--repo-root", str(fake_root), "--dry-run", "--hostfile", str(tmp_path / "hostfile"), "step1",
                     "opt/multi_node/66b"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"names host {host!r}" in err, err


def test_host_names_and_addresses_are_accepted():
    for host in ("node1", "gpu-07.cluster.example.com", "10.0.0.7", "fe80::1", "Node_2"):
        M.check_host_name(host, "hostfile h")


def test_deepspeed_export_prefixes_cover_the_runner_and_every_accelerator():
    """The prefixes dschat strips secrets from are every family DeepSpeed's runner forwards by itself:
    its EXPORT_ENVS and each accelerator's export_envs() (read from the installed DeepSpeed's source)."""
    import ast

    import deepspeed
    from deepspeed.launcher import runner

    forwarded = set(runner.EXPORT_ENVS)
    for source in (Path(deepspeed.__file__).parent / "accelerator").glob("*_accelerator.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "export_envs":
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and isinstance(ret.value, ast.List):
                        forwarded |= {elt.value for elt in ret.value.elts}
    assert "MLFLOW" in forwarded and "NCCL" in forwarded
    assert forwarded <= set(M.DEEPSPEED_EXPORT_PREFIXES), forwarded - set(M.DEEPSPEED_EXPORT_PREFIXES)


def test_secret_named_variables_never_reach_the_multi_node_runner(fake_root, tmp_path, monkeypatch, two_hosts):
    secrets = {"MLFLOW_TRACKING_PASSWORD": "pw-1", "MLFLOW_TRACKING_TOKEN": "tok-2", "NCCL_IB_SECRET": "s-3",
               "PYTHON_KEYRING_CREDENTIALS": "c-4", "UCX_API_KEY": "k-5"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.invalid")  # no secret: DeepSpeed forwards it
    (Path.home() / ".deepspeed_env").write_text("HF_TOKEN=hf-6\nNCCL_DEBUG=INFO\n")
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    plan = L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": two_hosts},
                  repo_root=fake_root)
    assert plan.withheld == sorted([*secrets, "HF_TOKEN"])
    sink = Sink()
    assert L.run(plan, sink=sink, log=False).returncode == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert not set(secrets) & set(seen["names"]) and "MLFLOW_TRACKING_URI" in seen["names"]
    assert "NCCL_DEBUG=INFO" in seen["env_file"].splitlines() and "HF_TOKEN" not in seen["env_file"]
    values = [*secrets.values(), "hf-6"]
    assert not any(v in " ".join(seen["values"]) + seen["env_file"] for v in values)
    notice = [line for line in sink.data.decode().splitlines() if "not forwarded" in line]
    assert len(notice) == 1 and all(name in notice[0] for name in plan.withheld), notice
    assert not any(v in sink.data.decode() for v in values)  # names only, never values
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw-1"  # the launching process keeps its own
    # One node: no ssh, nothing on a command line; the ranks inherit the environment as it is.
    single = L.plan(recipe, {"output_dir": str(tmp_path / "o")}, repo_root=fake_root)
    assert single.withheld == [] and single.rank_env == {}


def test_urls_with_credentials_in_forwarded_values_never_reach_the_multi_node_runner(fake_root, tmp_path,
                                                                                   monkeypatch, two_hosts):
    """A password inside a value (not a secret-looking name) went onto the ssh command line and into
    the log: DeepSpeed's own families, dschat's HF_* and the user's .deepspeed_env lines."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:hunter2@mlflow.invalid")
    monkeypatch.setenv("HF_ENDPOINT", "https://bob:s3cret@mirror.invalid")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (Path.home() / ".deepspeed_env").write_text("PIP_INDEX_URL=https://carol:pw9@pypi.invalid/simple\n")
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    plan = L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": two_hosts},
                  repo_root=fake_root)
    assert plan.withheld == ["HF_ENDPOINT", "MLFLOW_TRACKING_URI", "PIP_INDEX_URL"]
    assert "HF_ENDPOINT" not in plan.rank_env and plan.rank_env["HF_HUB_OFFLINE"] == "1"
    sink = Sink()
    assert L.run(plan, sink=sink, log=False).returncode == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    everything = " ".join(seen["values"]) + seen["env_file"] + sink.data.decode()
    assert not any(secret in everything for secret in ("hunter2", "s3cret", "pw9")), everything


@pytest.mark.parametrize("name", ["MLFLOW_EXPERIMENT_NAME", "PYTHONSTARTUP", "NCCL_SOCKET_IFNAME"])
def test_a_variable_deepspeed_forwards_by_itself_with_shell_syntax_is_refused(fake_root, tmp_path, monkeypatch,
                                                                               two_hosts, name):
    """DeepSpeed's runner writes `export NAME="x $(id)"` into the remote command: it would run there.
    NCCL's own patterns (%h, %p) are left to mean what the user means."""
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p")
    L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": two_hosts}, repo_root=fake_root)
    monkeypatch.setenv(name, "x $(id)")
    with pytest.raises(UserError, match=rf"^environment variable {name} holds '\$', which the remote shell of a "
                                        "multi-node launch would run as a command"):
        L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": two_hosts},
               repo_root=fake_root)


@pytest.mark.parametrize("value, secret", [("https://a https://u:p@b", True), ("-Dx=https://u:p@h", True),
                                           ("postgresql://user@db/x", True), ("https://h/x?k=1", True),
                                           ("https://h/p#frag", False), ("http://mlflow.invalid:5000", False),
                                           ("file:///tmp/mlruns", False), ("a@b", False)])
def test_a_secret_value_is_a_url_with_a_user_password_or_query_anywhere_in_it(value, secret):
    assert M.is_secret_value(value) is secret


def test_a_refused_path_is_shown_as_given():
    with pytest.raises(UserError, match=r"^--output_dir '/data/run#3/out' holds '#'"):
        M.check_remote_safe([("--output_dir", "/data/run#3/out")])


def test_a_refused_url_flag_is_shown_without_its_password_or_query(fake_root, tmp_path, capsys):
    hostfile = _hostfile(tmp_path, "node1.invalid", "node2.invalid")
    code = L._entry(["--repo-root", str(fake_root), "--dry-run", "--hostfile", hostfile, "step1",
                     "opt/multi_node/66b", "--output_dir", str(tmp_path / "o"), "--",
                     "--reward_url", "https://alice:hunter2@rm.invalid/score?api_key=SEKRET"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --reward_url 'https://***@rm.invalid/score?***' holds '?'"), err
    assert "hunter2" not in err and "SEKRET" not in err


def test_multi_node_launch_refuses_a_working_directory_others_can_write_to(fake_root, tmp_path, monkeypatch,
                                                                           two_hosts, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may plant a module here, e.g. the --reward_fn one
    (shared / "project").mkdir(mode=0o755)  # the user's own folder, inside it: renamable by anyone
    recipe = recipe_loading.get_recipe("step3", "opt/single_node/1.3b", fake_root)
    params = {"actor_model": "/a", "critic_model": "/c", "output_dir": str(tmp_path / "o")}
    for cwd in (shared, shared / "project"):
        monkeypatch.chdir(cwd)
        with pytest.raises(UserError, match=f"the working directory {cwd} is not safe for a multi-node launch: "
                                            ".*DeepSpeed puts it first on PYTHONPATH on every node"):
            L.plan(recipe, params, launcher_overrides={"hostfile": two_hosts}, repo_root=fake_root)
        assert L.plan(recipe, params, repo_root=fake_root).hosts.multi_node is False  # one node: no PYTHONPATH
    code = L._entry(["--repo-root", str(fake_root), "--dry-run", "--hostfile", two_hosts, "step1",
                     "opt/multi_node/66b"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the working directory" in err
    monkeypatch.chdir(tmp_path / "work")  # the user's own, private
    assert L.plan(recipe, params, launcher_overrides={"hostfile": two_hosts}, repo_root=fake_root).hosts.multi_node


@pytest.mark.parametrize("where", ["home", "cwd", "DS_ENV_FILE"])
def test_multi_node_launch_refuses_a_deepspeed_env_that_is_not_the_users_alone(fake_root, tmp_path, monkeypatch,
                                                                                two_hosts, where):
    folder = {"home": Path.home(), "cwd": Path.cwd(), "DS_ENV_FILE": tmp_path}[where]
    env_file = folder / ("my_env" if where == "DS_ENV_FILE" else ".deepspeed_env")
    env_file.write_text("PYTHONPATH=/somewhere\n")
    if where == "DS_ENV_FILE":
        monkeypatch.setenv("DS_ENV_FILE", str(env_file))
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)

    def attempt():
        return L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": two_hosts},
                      repo_root=fake_root)

    env_file.chmod(0o644)
    assert attempt().hosts.multi_node  # the user's own, writable by nobody else
    env_file.chmod(0o666)
    with pytest.raises(UserError, match=f"{env_file} is not safe to use: its group and others can write to it "
                                        ".*DeepSpeed turns its lines into commands of every rank"):
        attempt()
    env_file.chmod(0o644)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: _other_owner(real_stat(p, *a, **k)) if os.fspath(p) == str(
        env_file) else real_stat(p, *a, **k))
    with pytest.raises(UserError, match=f"{env_file} is not safe to use: it belongs to .*, not to you"):
        attempt()


def _other_owner(info: os.stat_result) -> os.stat_result:
    import stat as stat_module

    fields = list(info)
    fields[stat_module.ST_UID] = 65534
    return os.stat_result(fields)


def test_every_launch_gives_its_ranks_one_rendezvous_id(fake_root, tmp_path, two_hosts):
    recipe = recipe_loading.get_recipe("step1", "cpu/tiny", fake_root)
    one = L.plan(recipe, {"output_dir": str(tmp_path / "o")}, repo_root=fake_root)
    many = L.plan(recipe, {"output_dir": str(tmp_path / "o")}, launcher_overrides={"hostfile": two_hosts},
                  repo_root=fake_root)
    ids = [one.env_set[M.RENDEZVOUS_ID_VAR], many.env_set[M.RENDEZVOUS_ID_VAR]]
    assert ids[0] != ids[1] and all(len(i) == 32 for i in ids)
    assert many.rank_env[M.RENDEZVOUS_ID_VAR] == ids[1]  # the ranks on other hosts get the same one


def test_dschats_own_rank_settings_are_forwarded_though_their_names_hold_a_secret_word():
    """TOKENIZERS_PARALLELISM holds "TOKEN" but is one of dschat's settings: the remote ranks get it;
    a real secret beside it (HF_TOKEN) is still left out."""
    from dschat import multinode as M

    env = M.rank_env({"TOKENIZERS_PARALLELISM": "false", "HF_TOKEN": "s3cret", "OMP_NUM_THREADS": "1"}, {})
    assert env == {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert M.is_secret_name("HF_TOKEN") and not M.is_secret_name("TOKENIZERS_PARALLELISM")


@pytest.mark.parametrize("num_nodes", [None, 2])
def test_a_hostfile_that_is_a_folder_is_named_as_one(tmp_path, num_nodes):
    """It was said not to exist."""
    with pytest.raises(UserError, match=rf"--hostfile {tmp_path} is not a file; write one line per host"):
        M.launch_hosts(str(tmp_path), num_nodes=num_nodes)
    with pytest.raises(UserError, match=rf"--hostfile {tmp_path / 'no'} does not exist; write one line per host"):
        M.launch_hosts(str(tmp_path / "no"), num_nodes=num_nodes)
