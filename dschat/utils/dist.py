"""Process-group set-up and rank helpers shared by the three step scripts.

Upstream's step scripts only worked under the ``deepspeed`` launcher: run as ``python main.py`` they
either went looking for MPI or called ``torch.distributed.get_rank()`` before any process group
existed (reference §10 item 20). :func:`init_distributed` fills in a one-process rendezvous when
no launcher did, so the same ``main.py`` runs both ways.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed

__all__ = [
    "DistInfo",
    "init_distributed",
    "is_rank_0",
    "print_rank_0",
    "get_all_reduce_mean",
    "collective_device",
    "get_world_size",
    "get_rank",
    "barrier",
    "gather_ints",
    "gather_hosts",
]

# Environment variables set by every launcher we support (deepspeed, torchrun).
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE")
# Set by mpirun / PMI launchers; DeepSpeed's own MPI discovery handles those, so leave them alone.
_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    ``device`` is the accelerator device of this rank (``cuda:<local_rank>`` or ``cpu``).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def _free_port() -> int:
    """An unused TCP port on localhost (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ensure_single_process_env() -> None:
    """Set a one-process rendezvous when no launcher (deepspeed, torchrun, MPI) set one."""
    if any(k in os.environ for k in _LAUNCHER_ENV) or any(k in os.environ for k in _MPI_ENV):
        return
    os.environ["RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def init_distributed(dist_backend: Optional[str] = None) -> DistInfo:
    """Initialise DeepSpeed's process group (idempotent) and return this rank's :class:`DistInfo`.

    Works under the ``deepspeed`` launcher, torchrun, and as a plain ``python main.py`` (one
    process, a free local port). On CUDA the current device is set to ``LOCAL_RANK`` *before* the
    NCCL group is created, as upstream's ``get_accelerator().set_device(args.local_rank)`` did.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _ensure_single_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    # deepspeed.init_distributed is itself a no-op when its backend is already up.
    deepspeed.init_distributed(dist_backend=dist_backend)
    return DistInfo(
        rank=torch.distributed.get_rank(),
        local_rank=local_rank,
        world_size=torch.distributed.get_world_size(),
        device=torch.device(accelerator.device_name(local_rank)),
    )


def get_world_size() -> int:
    """World size of the initialised group, else ``$WORLD_SIZE``, else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def get_rank() -> int:
    """Global rank of the initialised group, else ``$RANK``, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_rank_0() -> bool:
    """True on global rank 0, and in a process with no process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def print_rank_0(msg: object, rank: Optional[int] = None) -> None:
    """Print on rank 0 only (upstream semantics: an explicit ``rank <= 0`` always prints)."""
    if rank is not None and rank <= 0:
        print(msg)
    elif is_rank_0():
        print(msg)


def get_all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over all ranks; the tensor itself without a process group.

    Unlike upstream this reduces a copy, so the caller's tensor is not summed in place, and a host
    tensor may be passed under NCCL (the copy goes through the GPU and the result comes back to the
    caller's device).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    return all_reduce_sum(tensor) / torch.distributed.get_world_size()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks, as a new tensor on the caller's device (a host tensor goes
    through the GPU under NCCL); the tensor itself without a process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    reduced = tensor.detach().to(collective_device(tensor), copy=True)
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.SUM)
    return reduced.to(tensor.device)


def collective_device(tensor: torch.Tensor) -> torch.device:
    """Where ``tensor`` must be for a collective: NCCL reduces only CUDA tensors ("No backend type
    associated with device type cpu"), gloo both."""
    if tensor.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def barrier() -> None:
    """``torch.distributed.barrier()`` when a process group exists; otherwise nothing to wait for."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def gather_ints(values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same count on every rank), indexed by rank (collective).

    A sum of a table that is zero but for each rank's own row: plain tensors, no pickled objects
    (``all_gather_object`` would unpickle what other processes send). Without a process group:
    ``[values]``.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [list(values)]
    table = torch.zeros(torch.distributed.get_world_size(), len(values), dtype=torch.int64)
    table[torch.distributed.get_rank()] = torch.tensor(list(values), dtype=torch.int64)
    return all_reduce_sum(table).tolist()


_HOST_BYTES = 64


def gather_hosts() -> list[str]:
    """Every rank's host name (its first 64 bytes), indexed by rank (collective)."""
    name = socket.gethostname().encode("utf-8", "replace")[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")
    return [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in gather_ints(list(name))]
