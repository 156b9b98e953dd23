"""How ranks meet (dschat.runtime.dist.init_distributed): a one-process run opens no port on any
network interface; a rank whose peers never come stops within --dist_timeout with one line naming
the master address and port; a busy master port is one line too. Every step script has the flag."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from helpers import REPO
from helpers.steps import cli_env, load_script

TIMEOUT_MINUTES = 0.05  # 3 s
# DeepSpeed imported and its CPU shared-memory all-reduce op built or loaded, as init_distributed
# does: a first build (a C++ compile) is slow, and no timed case below may include it.
WARM_UP = r"""
import deepspeed
from deepspeed.accelerator import get_accelerator
from dschat.runtime.shm_buffers import load_shm_all_reduce
load_shm_all_reduce(deepspeed, get_accelerator())
"""
# Runs in a fresh process: each case tries to start a 2-rank group alone, then a 1-process run
# starts and reports the addresses its sockets listen on (from /proc/net/tcp*).
PROBE = WARM_UP + r"""
import json, os, socket, sys, time
from dschat.errors import cli_main
from dschat.runtime import dist

def attempt(case, rank, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    print(f"--- {case}", file=sys.stderr, flush=True)
    start = time.monotonic()
    code = cli_main(lambda argv: dist.init_distributed(timeout_minutes=%(minutes)r), [])
    print(f"=== {case} {code} {time.monotonic() - start:.1f}", file=sys.stderr, flush=True)

def unused_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]

attempt("rank1-alone", 1, unused_port())   # rank 0 never comes
attempt("rank0-alone", 0, unused_port())   # rank 1 never comes
holder = socket.socket(); holder.bind(("", 0)); holder.listen()
attempt("port-busy", 0, holder.getsockname()[1])
holder.close()

for key in ("MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(key)
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
info = dist.init_distributed()
dist.barrier()
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes and fields[3] == "0A":  # state LISTEN
            listening.append(fields[1].split(":")[0])
print(json.dumps({"world_size": info.world_size, "listening": listening}), flush=True)

# Last: a program that accepts connections but is no rendezvous store holds the port. Torch's client
# would wait for its greeting until that program exits; dschat's watchdog ends the process.
import torch.distributed
torch.distributed.destroy_process_group()
mute = socket.socket(); mute.bind(("127.0.0.1", 0)); mute.listen()
attempt("port-held-by-another-program", 1, mute.getsockname()[1])
"""
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net/tcp* write them


def _cases(stderr: str) -> dict[str, tuple[int, float, list[str]]]:
    out: dict[str, tuple[int, float, list[str]]] = {}
    lines: list[str] = []
    for line in stderr.splitlines():
        if line.startswith("--- "):
            lines = []
        elif line.startswith("=== "):
            _, case, code, seconds = line.split()
            out[case] = (int(code), float(seconds), lines)
        else:
            lines.append(line)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from Linux's /proc/net/tcp")
def test_ranks_without_peers_stop_in_one_line_and_one_process_opens_no_port():
    env = cli_env()
    env.pop("GLOO_SOCKET_IFNAME", None)
    warm = subprocess.run([sys.executable, "-c", WARM_UP], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert warm.returncode == 0, warm.stderr[-3000:]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PROBE % {"minutes": TIMEOUT_MINUTES}], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]  # the watchdog's exit code, the last case
    cases = _cases(proc.stderr)
    # The wait must end near --dist_timeout (3 s), not at torch's 30 minutes; the margin is for torch's
    # store rounding its wait up to whole seconds and for a busy machine (CI shares its cores).
    limit = TIMEOUT_MINUTES * 60 + 20
    for case, expected in (
        ("rank1-alone", "rank 1 on {host} waited 3 s (--dist_timeout) for rank 0 at 127.0.0.1:"),
        ("rank0-alone", "rank 0 on {host} waited 3 s (--dist_timeout) at 127.0.0.1:"),
        ("port-busy", "rank 0 on {host} cannot listen on port"),
    ):
        code, seconds, lines = cases[case]
        errors = [line for line in lines if not line.startswith("[20")]  # DeepSpeed's own log lines
        assert code == 2 and seconds < limit, (case, code, seconds, lines)
        assert len(errors) == 1 and errors[0].startswith("error: " + expected.format(host=os.uname().nodename)), (case, lines)
        assert "--master_port" in errors[0]
    last = proc.stderr.split("--- port-held-by-another-program\n", 1)[1]
    errors = [line for line in last.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "no rendezvous at 127.0.0.1:" in errors[0] and "--master_port" in errors[0]
    assert "Traceback" not in last
    assert took < 150  # imports + 3 cases of ~3 s + the watchdog's 3 s + 5 s grace, on a busy machine
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["world_size"] == 1
    # torch's default store would listen on every interface (00000000) at MASTER_PORT.
    assert set(result["listening"]) <= LOOPBACK, result


@pytest.mark.slow
def test_a_one_process_run_that_ends_without_its_exit_handlers_leaves_no_file(tmp_path):
    """The one-process store lives in memory: a run killed (or ended by ``os._exit``) leaves nothing in
    the temporary folder (a file store's folder there outlived every such run)."""
    warm = subprocess.run([sys.executable, "-c", WARM_UP], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=1200)
    assert warm.returncode == 0, warm.stderr[-3000:]
    code = ("import os, torch\nfrom dschat.runtime.dist import init_distributed\ninit_distributed()\n"
            "t = torch.ones(1)\ntorch.distributed.all_reduce(t)\nprint('met', int(t.item()), flush=True)\n"
            "os._exit(0)\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(TMPDIR=str(scratch)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "met 1" in proc.stdout, proc.stderr[-3000:]
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_every_step_takes_dist_timeout_and_setup_run_passes_it(monkeypatch):
    from dschat.runtime import dist
    from dschat.training import run_setup

    seen: list[float] = []

    def fake_init(dist_backend=None, timeout_minutes=dist.DEFAULT_DIST_TIMEOUT_MINUTES, collective_minutes=0.0):
        seen.append(timeout_minutes)
        return dist.DistInfo(0, 0, 1, run_setup.torch.device("cpu"))

    monkeypatch.setattr(run_setup, "init_distributed", fake_init)  # setup_run's names (imported at its top)
    monkeypatch.setattr(run_setup, "barrier", lambda: None)
    for step in ("step1", "step2", "dpo"):
        args = load_script(step).parse_args(["--model_name_or_path", "tiny-llama", "--dist_timeout", "0.5"])
        assert args.dist_timeout == 0.5
    step3 = _load_step3()
    args = step3.parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c"])
    assert args.dist_timeout == dist.DEFAULT_DIST_TIMEOUT_MINUTES == 5.0
    run_setup.setup_run(Namespace(dtype="fp32", seed=1, dist_timeout=0.5))
    run_setup.setup_run(Namespace(dtype="fp32", seed=1))  # an upstream-style Namespace: the default
    assert seen == [0.5, 5.0]


def _load_step3():
    import importlib.util

    path = REPO / "training" / "step3_rlhf_finetuning" / "main.py"
    spec = importlib.util.spec_from_file_location("dschat_script_step3_rendezvous", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module



def test_the_shared_memory_all_reduce_buffer_name_is_removed(monkeypatch, tmp_path):
    """DeepSpeed names each CPU rank's all-reduce buffer by user, master address, port and rank and
    never removes it; dschat removes its own rank's name after start-up, and nobody else's."""
    from dschat.runtime import dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "31234")
    mine = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_31234_1"
    other_rank = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_31234_0"
    other_job = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29500_1"
    for path in (mine, other_rank, other_job):
        path.write_bytes(b"x")
    assert dist.unlink_shm_allreduce_buffer(1, shm_dir=tmp_path)
    assert not mine.exists() and other_rank.exists() and other_job.exists()
    assert not dist.unlink_shm_allreduce_buffer(1, shm_dir=tmp_path)  # gone already: nothing to do


def test_a_buffer_name_is_claimed_once_and_only_the_users_own_leftover_is_kept(monkeypatch, tmp_path):
    from dschat.errors import UserError
    from dschat.runtime import dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "31235")
    name = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_31235_0"
    assert dist.claim_shm_allreduce_buffer(0, shm_dir=tmp_path)
    assert name.stat().st_size == 0 and name.stat().st_mode & 0o077 == 0
    assert not dist.claim_shm_allreduce_buffer(0, shm_dir=tmp_path)  # the user's own leftover: DeepSpeed reuses it
    name.chmod(0o666)  # as another account would leave it, for all to write
    with pytest.raises(UserError, match=r"all-reduce buffer for rank 0 of this job, is not safe .* its group and "
                                        r"others can write to it .*; pass the launcher another --master_port"):
        dist.claim_shm_allreduce_buffer(0, shm_dir=tmp_path)
    name.unlink()
    name.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="it is a symbolic link"):
        dist.claim_shm_allreduce_buffer(0, shm_dir=tmp_path)
    assert not (tmp_path / "elsewhere").exists()
    assert not dist.claim_shm_allreduce_buffer(0, shm_dir=tmp_path / "no-shm")  # no /dev/shm: DeepSpeed makes none


# One rank as the deepspeed launcher starts it (LOCAL_SIZE = WORLD_SIZE: DeepSpeed's CPU all-reduce
# maps /dev/shm buffers), with a buffer name planted first, writable by all.
PLANTED_SHM = r"""
import os, sys
from pathlib import Path
name = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{os.environ['MASTER_PORT']}_0"
name.touch(); name.chmod(0o666)
try:
    if sys.argv[1] == "deepspeed":
        import tempfile, deepspeed
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, rank=0, world_size=1,
                                   init_method=f"file://{tempfile.mkdtemp()}/store")
    else:
        from dschat.errors import UserError
        from dschat.runtime import dist
        try:
            dist.init_distributed()
        except UserError as err:
            print("error:", err)
    print("planted file size:", name.stat().st_size, flush=True)
finally:
    name.unlink()
"""


@pytest.mark.slow
def test_deepspeed_maps_a_planted_all_reduce_buffer_and_dschat_refuses_it():
    """DeepSpeed opens a /dev/shm name another account made first and writes its all-reduce workspace
    into it (the threat); dschat's start-up refuses that name in one line before DeepSpeed runs."""
    from helpers.steps import free_port

    env = cli_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
    runs = {who: subprocess.run([sys.executable, "-c", PLANTED_SHM, who], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=600) for who in ("deepspeed", "dschat")}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-3000:]
    size = int(runs["deepspeed"].stdout.split("planted file size: ")[1].split()[0])
    assert size > 1_000_000, runs["deepspeed"].stdout  # DeepSpeed's workspace, in a file others can read and write
    assert "all-reduce buffer for rank 0 of this job, is not safe to use on a shared machine" in runs["dschat"].stdout
    assert "planted file size: 0" in runs["dschat"].stdout, runs["dschat"].stdout


# A hook registered before init_distributed runs after dschat's own exit hook (atexit is last in,
# first out): by then the gloo group must be gone.
AT_EXIT = r"""
import atexit, os, torch.distributed
from dschat.runtime import dist
atexit.register(lambda: print("group alive at exit:", torch.distributed.is_initialized(), flush=True))
for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(key, None)
info = dist.init_distributed()
dist.barrier()
print("backend:", torch.distributed.get_backend(), flush=True)
"""


@pytest.mark.slow
def test_the_gloo_group_is_destroyed_before_the_program_exits():
    """Torch asks for the group to be destroyed before exit; a 2-rank CPU job left it to the
    interpreter's teardown and once died there ("terminate called without an active exception")."""
    proc = subprocess.run([sys.executable, "-c", AT_EXIT], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend: gloo" in proc.stdout and "group alive at exit: False" in proc.stdout, proc.stdout


# One rank of a 2-rank job at MASTER_PORT (argv: rank); prints "=== <exit code> <seconds>" at the end.
RANK = r"""
import os, sys, time
from dschat.errors import cli_main
from dschat.runtime import dist

os.environ.update(RANK=sys.argv[1], WORLD_SIZE="2", LOCAL_RANK=sys.argv[1], MASTER_ADDR="127.0.0.1")
start = time.monotonic()
minutes = float(os.environ.get("TEST_DIST_TIMEOUT", dist.DEFAULT_DIST_TIMEOUT_MINUTES))
code = cli_main(lambda argv: (dist.init_distributed(timeout_minutes=minutes), dist.barrier()), [])
print(f"=== {code} {time.monotonic() - start:.1f}", file=sys.stderr, flush=True)
sys.exit(code)
"""


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _start_rank(rank: int, port: int, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK, str(rank)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=cli_env(MASTER_PORT=str(port), **env))


def _seconds(stderr: str) -> float:
    return float(stderr.split("=== ", 1)[1].split()[1])


@pytest.mark.slow
def test_when_rank_0_cannot_take_a_busy_port_the_other_rank_stops_within_a_minute():
    """Another job's rendezvous store holds the master port on the first host: rank 0 stops at once
    with one line; rank 1 reaches that store (it answers like this job's would) and, with the default
    --dist_timeout of 5 minutes, stops with one line when the wait for rank 0 ends (DSCHAT_RANK0_WAIT,
    short here; its default is under a minute: test_the_wait_for_rank_0_is_under_a_minute_...)."""
    from torch.distributed import TCPStore

    from helpers.steps import free_port

    port = free_port()
    other_job = TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=600), wait_for_workers=False)
    other_job.set("dschat/rank0-ready/world-2", "1")  # another dschat job of 2 ranks, launched by dschat.launch
    env = {"DSCHAT_RENDEZVOUS_ID": "this-launch", "DSCHAT_RANK0_WAIT": "6"}
    ranks = [_start_rank(0, port, **env), _start_rank(1, port, **env)]
    outputs = [p.communicate(timeout=300)[1] for p in ranks]
    del other_job
    assert [p.returncode for p in ranks] == [2, 2], outputs
    host = os.uname().nodename
    assert _errors(outputs[0]) == [_errors(outputs[0])[0]] and _errors(outputs[0])[0].startswith(
        f"error: rank 0 on {host} cannot listen on port {port} (address already in use)")
    errors = _errors(outputs[1])
    assert len(errors) == 1 and errors[0].startswith(
        f"error: rank 1 on {host}: the rendezvous store at 127.0.0.1:{port} is not this job's (its rank 0 did not "
        "mark it within 6 s, DSCHAT_RANK0_WAIT, the wait for rank 0 to start)"), outputs[1]
    assert "--master_port" in errors[0] and "Traceback" not in outputs[1]
    assert 5 < _seconds(outputs[1]) < 21, outputs[1]  # the wait (6 s), not --dist_timeout (5 minutes)


@pytest.mark.slow
@pytest.mark.parametrize("holder", ["nothing", "another-program"])
def test_a_rank_whose_rank_0_never_starts_stops_after_the_rank_0_wait_not_dist_timeout(holder):
    """Rank 0 never starts; the port is free (nothing answers) or another program that is no store
    listens there (torch's client would wait for its greeting until that program exits)."""
    import socket

    from helpers.steps import free_port

    mute = None
    if holder == "another-program":
        mute = socket.socket()
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        port = mute.getsockname()[1]
    else:
        port = free_port()
    rank = _start_rank(1, port, DSCHAT_RANK0_WAIT="4")  # --dist_timeout stays 5 minutes
    try:
        _, stderr = rank.communicate(timeout=300)
    finally:
        rank.kill()
        if mute is not None:
            mute.close()
    assert rank.returncode == 2, stderr
    errors = _errors(stderr)
    host = os.uname().nodename
    if holder == "nothing":
        assert len(errors) == 1 and errors[0].startswith(
            f"error: rank 1 on {host} waited 4 s (DSCHAT_RANK0_WAIT, the wait for rank 0 to start) for rank 0 at "
            f"127.0.0.1:{port} and nobody answered"), stderr
        assert _seconds(stderr) < 15
    else:  # ended by the watchdog, 5 s after the wait
        assert errors == [f"error: rank 1 on {host}: no rendezvous at 127.0.0.1:{port} within 4 s (DSCHAT_RANK0_WAIT, "
                          "the wait for rank 0 to start): the program answering there is not this job's rank 0 "
                          "(another job holds the port?) or a peer hangs; pass a free --master_port to the launcher, "
                          "and stop this job's ranks left on other hosts"], stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_two_ranks_of_one_launch_still_meet_and_a_rank_of_another_launch_is_refused():
    from helpers.steps import free_port

    port = free_port()
    ranks = [_start_rank(r, port, DSCHAT_RENDEZVOUS_ID="launch-a") for r in (0, 1)]
    outputs = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    # Rank 0 of launch A waits for its peer (until its own --dist_timeout: never killed, it may be
    # building DeepSpeed's op); a rank 1 of launch B reaches A's store and is told it is not its own.
    port = free_port()
    a0 = _start_rank(0, port, DSCHAT_RENDEZVOUS_ID="launch-a", TEST_DIST_TIMEOUT="0.5")
    time.sleep(1)
    b1 = _start_rank(1, port, DSCHAT_RENDEZVOUS_ID="launch-b", DSCHAT_RANK0_WAIT="10")
    _, stderr = b1.communicate(timeout=300)
    a0_err = a0.communicate(timeout=300)[1]
    assert b1.returncode == 2 and "is not this job's" in _errors(stderr)[0], stderr
    assert a0.returncode == 2 and "waited 30 s (--dist_timeout) at 127.0.0.1:" in _errors(a0_err)[0], a0_err


def test_the_wait_for_rank_0_is_under_a_minute_and_never_longer_than_dist_timeout(monkeypatch):
    from dschat.errors import UserError
    from dschat.runtime import dist

    monkeypatch.delenv(dist.RANK0_WAIT_VAR, raising=False)
    wait, bound = dist._rank0_wait(datetime.timedelta(minutes=5))
    assert wait.total_seconds() + 5 < 60 and bound.startswith(dist.RANK0_WAIT_VAR)  # + the watchdog's grace
    assert dist._rank0_wait(datetime.timedelta(seconds=3)) == (datetime.timedelta(seconds=3), "--dist_timeout")
    monkeypatch.setenv(dist.RANK0_WAIT_VAR, "120")
    assert dist._rank0_wait(datetime.timedelta(minutes=5))[0] == datetime.timedelta(seconds=120)
    for bad in ("soon", "0", "-3", "inf", "nan"):
        monkeypatch.setenv(dist.RANK0_WAIT_VAR, bad)
        with pytest.raises(UserError, match=f"{dist.RANK0_WAIT_VAR}='{bad}' is not a number of seconds > 0"):
            dist._rank0_wait(datetime.timedelta(minutes=5))
