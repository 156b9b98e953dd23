"""Every process group waits the collective timeout (dschat.runtime.dist.use_collective_timeout):
the default group, DeepSpeed's clone of the world group that ZeRO's collectives use (made before or
after init_distributed returns) and dschat's tensor-parallel groups; and on a CPU the ranks pass a
barrier before each removes its shared-memory all-reduce buffer's name."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO
from helpers.steps import cli_env, free_port

# argv: case ("after": dschat starts the group; "before": the caller did and DeepSpeed cloned it
# first), rank, world size. Prints each group's timeout in minutes as JSON.
GROUPS = r"""
import json, os, sys, tempfile
import torch, torch.distributed
from deepspeed.utils import groups
from dschat.runtime import dist

case, rank, world = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1")
if case == "before":
    import deepspeed
    torch.distributed.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0,
                                         world_size=1)
    deepspeed.init_distributed()
    clone = groups._clone_world_group()
dist.init_distributed(timeout_minutes=45.0, collective_minutes=60.0)
if case == "after":
    clone = groups._clone_world_group()  # what a ZeRO engine's data-parallel group is (no mpu)
tp = dist.tensor_parallel_group(int(world))

def minutes(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60

print(json.dumps({"default": minutes(torch.distributed.distributed_c10d._get_default_group()),
                  "deepspeed_dp": minutes(clone), "tensor_parallel": minutes(tp.group)}), flush=True)
dist.barrier()
"""


def _timeouts(case: str, world: int) -> list[dict[str, float]]:
    env = cli_env(MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", GROUPS, case, str(rank), str(world)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * world, [err[-3000:] for _, err in outs]
    return [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out, _ in outs]


@pytest.mark.slow
def test_deepspeeds_data_parallel_group_waits_the_collective_timeout_made_after_start_up():
    """Two gloo ranks: a ZeRO all-gather in DeepSpeed's group waited gloo's default 30 minutes, not
    the 60 that a long reward function needs, while the default group waited 60."""
    for timeouts in _timeouts("after", 2):
        assert timeouts == {"default": 60.0, "deepspeed_dp": 60.0, "tensor_parallel": 60.0}


@pytest.mark.slow
def test_a_group_deepspeed_made_before_start_up_gets_the_collective_timeout_too():
    assert _timeouts("before", 1) == [{"default": 60.0, "deepspeed_dp": 60.0, "tensor_parallel": 60.0}]


@pytest.mark.parametrize("branch", ["existing group", "mpi"])
def test_ranks_pass_a_barrier_before_removing_their_all_reduce_buffer_name(monkeypatch, branch):
    """DeepSpeed's set-up returns once this rank has mapped its peers' buffers; a peer still opening
    this rank's name would spin forever if it were removed before the peer got there."""
    import deepspeed
    import torch.distributed

    from dschat.runtime import dist

    calls: list[str] = []
    if branch == "mpi":  # an MPI launcher: no RANK before DeepSpeed's discovery
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    else:  # a group the caller made (set here so that the test leaves the environment as it was)
        for key, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: branch == "existing group")
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kwargs: calls.append("deepspeed"))
    monkeypatch.setattr(dist, "use_collective_timeout", lambda timeout: None, raising=False)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 1)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")  # no exit hook registered
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "unlink_shm_allreduce_buffer", lambda rank: calls.append(f"unlink {rank}"))
    info = dist.init_distributed()
    assert (info.rank, info.world_size) == (1, 2)
    assert calls == ["deepspeed", "barrier", "unlink 1"]
