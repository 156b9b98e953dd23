"""Process-group set-up and rank helpers shared by the three step scripts.

:func:`init_distributed` fills in a one-process rendezvous when no launcher did, so the same
``main.py`` runs under a launcher and as ``python main.py`` (docs/upstream.md#step-1-sft).

The rendezvous:

* One process (plain ``python main.py``, or a launcher with one rank) meets itself through a store
  in its own memory: no port is opened for it (torch's default store listens on every interface), a
  busy port cannot stop it, and no file is left behind.
* Several ranks meet at ``MASTER_ADDR:MASTER_PORT`` as the launcher set them, waiting at most
  ``--dist_timeout`` minutes. A rank whose peers never come stops with one line naming the address,
  the port and what to do, instead of waiting for torch's timeout with a C++ traceback.
* Rank 0 opens the rendezvous store itself and marks it as this launch's at once (a key named by
  ``DSCHAT_RENDEZVOUS_ID``, which ``dschat.launch`` gives every rank of one launch; else by the world
  size). The other ranks wait for that mark at most ``DSCHAT_RANK0_WAIT`` seconds (default 45, never
  longer than ``--dist_timeout``): when rank 0 could not start (its master port was taken on the first
  host, so something else answers there, or nothing does), they stop with one line each within a
  minute instead of waiting out ``--dist_timeout``. Torch's own rendezvous then reuses that store
  (``multi_tenant``). Collectives after start-up wait the longest of DeepSpeed's default
  (``DEEPSPEED_TIMEOUT``, 10 minutes), ``--dist_timeout`` and step 3's user-code stretch: one rank may
  legitimately work alone for minutes (the data cache, a large save, a slow reward function). Every
  process group waits that long, DeepSpeed's own (ZeRO's) and the tensor-parallel ones included
  (:func:`use_collective_timeout`).
"""
from __future__ import annotations

import atexit
import datetime
import gc
import math
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed
from torch.distributed import distributed_c10d

from dschat.errors import EXIT_USAGE, UserError
from dschat.multinode import DEFAULT_DIST_TIMEOUT_MINUTES, RENDEZVOUS_ID_VAR
from dschat.runtime.shm_buffers import (claim_shm_allreduce_buffer, load_shm_all_reduce,
                                        shm_all_reduce_expected, unlink_shm_allreduce_buffer)

__all__ = [
    "DistInfo",
    "init_distributed",
    "destroy_gloo_group",
    "is_rank_0",
    "print_rank_0",
    "get_all_reduce_mean",
    "all_reduce_sum",
    "use_collective_timeout",
    "claim_shm_allreduce_buffer",
    "unlink_shm_allreduce_buffer",
    "collective_device",
    "get_world_size",
    "get_rank",
    "barrier",
    "gather_ints",
    "gather_hosts",
    "TensorParallelGroup",
    "tensor_parallel_group",
    "DEFAULT_DIST_TIMEOUT_MINUTES",
]

# Environment variables set by every launcher we support (deepspeed, torchrun).
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE")
# Set by mpirun / PMI launchers; DeepSpeed's own MPI discovery handles those, so leave them alone.
_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# How long a rank other than 0 waits for rank 0's store to be this launch's (seconds; capped by
# --dist_timeout). Rank 0 reaches the rendezvous as early as its peers, give or take start-up noise.
RANK0_WAIT_VAR = "DSCHAT_RANK0_WAIT"
DEFAULT_RANK0_WAIT_SECONDS = 45.0
MAX_DIST_TIMEOUT_MINUTES = 525_600  # a year: torch holds the timeout in a C int of seconds (68 years)
_READY_KEY = "dschat/rank0-ready/"
_RANK0_STORES: list[object] = []  # rank 0's own store until torch's rendezvous shares its server


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    ``device`` is the accelerator device of this rank (``cuda:<local_rank>`` or ``cpu``).
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def _ensure_single_process_env() -> None:
    """Set a one-process rank environment when no launcher (deepspeed, torchrun, MPI) set one.

    No ``MASTER_ADDR``/``MASTER_PORT``: a one-process run meets itself through a store in its memory.
    """
    if any(k in os.environ for k in _LAUNCHER_ENV) or any(k in os.environ for k in _MPI_ENV):
        return
    os.environ["RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"


def _loopback_interface() -> Optional[str]:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in ("lo", "lo0") if name in names), None)


def _duration(timeout: datetime.timedelta) -> str:
    seconds = timeout.total_seconds()
    return f"{seconds:g} s" if seconds < 120 else f"{seconds / 60:g} min"


def _rank0_wait(rendezvous: datetime.timedelta) -> tuple[datetime.timedelta, str]:
    """How long a rank other than 0 waits for rank 0's store, and what sets it (for messages)."""
    raw = os.environ.get(RANK0_WAIT_VAR, "")
    try:
        seconds = float(raw) if raw else DEFAULT_RANK0_WAIT_SECONDS
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise UserError(f"{RANK0_WAIT_VAR}={raw!r} is not a number of seconds > 0; unset it (default "
                        f"{DEFAULT_RANK0_WAIT_SECONDS:g}) or set, e.g., {RANK0_WAIT_VAR}=120")
    wait = datetime.timedelta(seconds=seconds)
    if wait >= rendezvous:
        return rendezvous, "--dist_timeout"
    return wait, f"{RANK0_WAIT_VAR}, the wait for rank 0 to start"


def _ready_key() -> str:
    """The key rank 0 sets in its store at once: this launch's, not another job's on the same port."""
    return _READY_KEY + (os.environ.get(RENDEZVOUS_ID_VAR) or f"world-{os.environ.get('WORLD_SIZE', '')}")


def _use_libuv() -> bool:
    return os.environ.get("USE_LIBUV", "1") == "1"  # as torch's env:// rendezvous decides


def _wait_for_master(addr: str, port: int, rank: int, timeout: datetime.timedelta, bound: str) -> None:
    """Wait until rank 0's store accepts connections, or raise the one-line error.

    Torch's own client would wait as long, but print C++ retry logs and a traceback on the way.
    ``bound`` names what set ``timeout`` in the message.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"rank {rank} on {socket.gethostname()} waited {_duration(timeout)} ({bound}) for rank 0 at "
                    f"{addr}:{port} and nobody answered: rank 0 did not start or failed (see the first host's "
                    f"output), or {addr} is not an address of the first host that this host can reach; pass "
                    "--master_addr / --master_port to the launcher, or a longer --dist_timeout"
                ) from None
            time.sleep(0.5)


def _open_rank0_store(addr: str, port: int, rendezvous: datetime.timedelta) -> None:
    """Rank 0: listen on ``port`` and mark the store as this launch's before torch's rendezvous,
    which reuses the server (``multi_tenant``). A taken port raises torch's ``DistNetworkError``."""
    store = torch.distributed.TCPStore(addr, port, None, True, rendezvous, wait_for_workers=False,
                                       multi_tenant=True, use_libuv=_use_libuv())
    store.set(_ready_key(), "1")
    _RANK0_STORES.append(store)


def _wait_for_rank0(addr: str, port: int, rank: int, wait: datetime.timedelta, bound: str) -> None:
    """A rank other than 0: return once the store at ``addr:port`` is this launch's rank 0's, or raise
    the one-line error within ``wait`` (a program that answers but is no store: the watchdog)."""
    start = time.monotonic()
    _wait_for_master(addr, port, rank, wait, bound)
    left = datetime.timedelta(seconds=max(1.0, wait.total_seconds() - (time.monotonic() - start)))
    client = torch.distributed.TCPStore(addr, port, None, False, left, wait_for_workers=False,
                                        use_libuv=_use_libuv())
    try:
        client.wait([_ready_key()], left)
    except torch.distributed.DistError:
        raise UserError(
            f"rank {rank} on {socket.gethostname()}: the rendezvous store at {addr}:{port} is not this job's (its rank "
            f"0 did not mark it within {_duration(wait)}, {bound}): another job holds that port on the first host, so "
            "this job's rank 0 could not start (see the first host's output); pass a free --master_port to the launcher"
        ) from None


def _rendezvous_error(err: Exception, rank: int, world_size: int, addr: str, port: str,
                      timeout: datetime.timedelta) -> UserError:
    text = " ".join(str(err).split())
    host = socket.gethostname()
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return UserError(f"rank 0 on {host} cannot listen on port {port} (address already in use): another job "
                         "holds it; pass a free --master_port to the launcher")
    if rank == 0 and "waiting for clients" in text:
        return UserError(f"rank 0 on {host} waited {_duration(timeout)} (--dist_timeout) at {addr}:{port} for the "
                         f"{world_size - 1} other rank(s) and not all came ({text}): a host failed to start its "
                         "ranks (see its output) or cannot reach this address; pass the launcher --master_addr "
                         "with an address the other hosts reach (and --master_port if that port is filtered), or "
                         "a longer --dist_timeout")
    return UserError(f"rank {rank} on {host}: the rendezvous at {addr}:{port} failed within {_duration(timeout)} "
                     f"(--dist_timeout): {text}; check that every host started and reaches {addr}:{port} "
                     "(launcher options --master_addr / --master_port)")


def _watchdog(rendezvous: datetime.timedelta, message: str, grace: float | None = None) -> threading.Timer:
    """Stop the process with ``message`` (one line, exit code 2) when the rendezvous outlives its
    timeout by a grace period (``grace`` seconds; default: the timeout, between 5 and 30 s).

    Torch bounds each wait by the timeout, except one: a client connected to a port where some other
    program listens waits for the store's greeting forever (seen: until that program exited). Nothing
    can be unwound from inside that C++ call, so the process ends here.
    """
    grace = max(5.0, min(30.0, rendezvous.total_seconds())) if grace is None else grace

    def fire() -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_USAGE)

    timer = threading.Timer(rendezvous.total_seconds() + grace, fire)
    timer.daemon = True
    timer.start()
    return timer


def _collective_timeout(rendezvous: datetime.timedelta, least: datetime.timedelta | None = None) -> datetime.timedelta:
    # lazy (here and in init_distributed): deepspeed costs 0.3 s CPU at import after torch (python -X
    # importtime); chat.py imports this module through dschat.models.tokenizer and never starts DeepSpeed.
    from deepspeed.constants import default_pg_timeout  # DEEPSPEED_TIMEOUT minutes, default 10

    return max(rendezvous, default_pg_timeout, least or rendezvous)


_COLLECTIVE_TIMEOUT: list[datetime.timedelta] = []  # what use_collective_timeout last gave the groups


def use_collective_timeout(timeout: datetime.timedelta) -> None:
    """Make every process group's collectives wait ``timeout``: the groups that exist now (the
    default one, and any a caller or DeepSpeed made already), and the groups made later.

    Torch gives a group made without a ``timeout`` its backend's default (NCCL 10 minutes, gloo 30),
    not the default group's; DeepSpeed makes its groups that way (``deepspeed.utils.groups``: the
    clone of the world group that ZeRO's all-gathers and reduce-scatters use, hpZ's and the expert
    groups), at its engine's set-up. So torch's default for such groups
    (``distributed_c10d.default_pg_timeout``, and ``default_pg_nccl_timeout``, which torch's
    ``new_group`` reads at each call) becomes ``timeout`` too, for the rest of the process; dschat's
    own groups pass it (:func:`tensor_parallel_group`). Called by :func:`init_distributed`.
    """
    for group in list(distributed_c10d._world.pg_map):
        if not distributed_c10d._rank_not_in_group(group):
            distributed_c10d._set_pg_timeout(timeout, group)
    distributed_c10d.default_pg_timeout = timeout
    if isinstance(distributed_c10d.default_pg_nccl_timeout, datetime.timedelta):  # None without NCCL
        distributed_c10d.default_pg_nccl_timeout = timeout
    _COLLECTIVE_TIMEOUT[:] = [timeout]


def init_distributed(dist_backend: Optional[str] = None, timeout_minutes: float = DEFAULT_DIST_TIMEOUT_MINUTES,
                     collective_minutes: float = 0.0) -> DistInfo:
    """Initialise DeepSpeed's process group (idempotent) and return this rank's :class:`DistInfo`.

    Works under the ``deepspeed`` launcher, torchrun, and as a plain ``python main.py`` (one
    process, a store in its own memory). On CUDA the current device is set to ``LOCAL_RANK`` *before*
    the NCCL group is created, as upstream's ``get_accelerator().set_device(args.local_rank)`` did.
    ``timeout_minutes`` (``--dist_timeout``) bounds the wait for the other ranks at start-up (a
    :class:`UserError` line when they do not come); collectives, in every process group, wait the
    longest of it, DeepSpeed's ``DEEPSPEED_TIMEOUT`` and ``collective_minutes``
    (:func:`use_collective_timeout`). On a CPU, the ranks pass a barrier before each removes its
    shared-memory all-reduce buffer's name (:mod:`dschat.runtime.shm_buffers`). See the module
    docstring.
    """
    import deepspeed  # lazy: see _collective_timeout
    from deepspeed.accelerator import get_accelerator

    if not (math.isfinite(timeout_minutes) and 0 < timeout_minutes <= MAX_DIST_TIMEOUT_MINUTES):
        raise UserError(f"--dist_timeout must be > 0 and at most {MAX_DIST_TIMEOUT_MINUTES} minutes (a year), got "
                        f"{timeout_minutes:g}")
    rendezvous, least = datetime.timedelta(minutes=timeout_minutes), datetime.timedelta(minutes=collective_minutes)
    _ensure_single_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    created = not torch.distributed.is_initialized()
    # The CPU all-reduce buffer's name, made before DeepSpeed's. Not under an MPI launch: DeepSpeed's
    # discovery sets RANK and rewrites MASTER_ADDR / MASTER_PORT, which the name holds, only inside it.
    claimed = (created and accelerator.device_name() == "cpu" and "RANK" in os.environ
               and shm_all_reduce_expected() and claim_shm_allreduce_buffer(int(os.environ["RANK"])))
    collective = _collective_timeout(rendezvous, least)
    met = False  # whether the ranks passed a barrier after DeepSpeed's set-up (_init_ranks has one)
    try:
        if not created:
            deepspeed.init_distributed(dist_backend=dist_backend)  # registers DeepSpeed's handle on the group
        elif "RANK" not in os.environ:  # an MPI launcher: DeepSpeed's discovery fills in the rest
            deepspeed.init_distributed(dist_backend=dist_backend, timeout=collective)
        elif int(os.environ["WORLD_SIZE"]) == 1:
            loopback = _loopback_interface()
            if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
                # gloo opens a listener for peers even alone; one process has none, so loopback only.
                os.environ["GLOO_SOCKET_IFNAME"] = loopback
            # One process meets itself through a store in its own memory: no port, no file (a file
            # store's folder outlived every process that ended without running its exit handlers).
            torch.distributed.init_process_group(dist_backend or accelerator.communication_backend_name(),
                                                 store=torch.distributed.HashStore(), rank=0, world_size=1,
                                                 timeout=collective)
            deepspeed.init_distributed(dist_backend=dist_backend, auto_mpi_discovery=False, timeout=collective)
        else:
            _init_ranks(deepspeed, accelerator, dist_backend, rendezvous, collective)
            met = True
    except BaseException:
        if claimed:
            unlink_shm_allreduce_buffer(int(os.environ["RANK"]))
        raise
    use_collective_timeout(collective)
    if accelerator.device_name() == "cpu":  # every branch, MPI and an existing group included
        if not met and torch.distributed.get_world_size() > 1:
            # DeepSpeed's set-up returns once this rank has mapped its peers' buffers, not once they
            # have mapped this one's: a peer still opening this name would wait for it forever.
            torch.distributed.barrier()
        unlink_shm_allreduce_buffer(torch.distributed.get_rank())
    if created and torch.distributed.get_backend() == "gloo":
        atexit.register(destroy_gloo_group)
    return DistInfo(
        rank=torch.distributed.get_rank(),
        local_rank=local_rank,
        world_size=torch.distributed.get_world_size(),
        device=torch.device(accelerator.device_name(local_rank)),
    )


def destroy_gloo_group() -> None:
    """Destroy the gloo process group :func:`init_distributed` created; registered to run at exit.

    Torch asks for the group to be destroyed before the program exits. Left to the interpreter's
    teardown, gloo's worker threads can still hold work objects whose tensors reach back into Python,
    and the rank aborts with "terminate called without an active exception" (exit code 250) after its
    work is done: seen in 2-rank CPU tests, after a clean finish and after a one-line error (exit 2).
    NCCL groups are not destroyed here: destroying one while a peer hangs
    in a collective could block the exit.
    """
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        gc.collect()  # work objects left in reference cycles go before the group does
        torch.distributed.destroy_process_group()


def _init_ranks(deepspeed: object, accelerator: object, dist_backend: Optional[str],
                rendezvous: datetime.timedelta, collective: datetime.timedelta) -> None:
    """Several ranks: meet at ``MASTER_ADDR:MASTER_PORT`` within ``rendezvous`` and pass a barrier,
    then give the store the collectives' longer timeout ``collective`` (:func:`_collective_timeout`;
    the groups get it from :func:`use_collective_timeout`)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
    host = socket.gethostname()
    wait, bound = _rank0_wait(rendezvous)

    def message(limit: datetime.timedelta, what: str) -> str:
        return (f"rank {rank} on {host}: no rendezvous at {addr}:{port} within {_duration(limit)} ({what}): the program "
                "answering there is not this job's rank 0 (another job holds the port?) or a peer hangs; pass a free "
                "--master_port to the launcher, and stop this job's ranks left on other hosts")

    watchdog = None
    try:
        if port.isdigit():
            if rank == 0:
                _open_rank0_store(addr, int(port), rendezvous)
            else:
                watchdog = _watchdog(wait, message(wait, bound), grace=5.0)
                _wait_for_rank0(addr, int(port), rank, wait, bound)
                watchdog.cancel()
        load_shm_all_reduce(deepspeed, accelerator)
        watchdog = _watchdog(rendezvous, message(rendezvous, "--dist_timeout"))
        deepspeed.init_distributed(dist_backend=dist_backend, timeout=rendezvous)  # type: ignore[attr-defined]
        torch.distributed.barrier()  # NCCL connects here; every rank has joined after it
    except torch.distributed.DistError as err:
        raise _rendezvous_error(err, rank, world_size, addr, port, rendezvous) from None
    finally:
        if watchdog is not None:
            watchdog.cancel()
        _RANK0_STORES.clear()  # torch's store holds the server now; after a failure nothing may listen
    if collective != rendezvous:  # the groups' own timeouts: init_distributed's use_collective_timeout
        distributed_c10d._get_default_store().set_timeout(collective)


def get_world_size() -> int:
    """World size of the initialised group, else ``$WORLD_SIZE``, else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def get_rank() -> int:
    """Global rank of the initialised group, else ``$RANK``, else an MPI launcher's rank beside its size
    (``_MPI_ENV``; such a launch sets no ``RANK`` before start-up), else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    for rank, size in zip(("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"), _MPI_ENV):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank])
    return 0


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

    Reduces a copy (docs/upstream.md#small-fixes), so the caller's tensor is left as it is, and a host
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


def gather_json(value: object) -> list[object]:
    """Every rank's ``value``, indexed by rank (collective: two all-gathers on every rank).

    ``value`` is what :func:`json.dumps` writes (dicts with string keys, lists, strings, numbers, bools,
    None; NaN and infinities kept); it comes back as :func:`json.loads` reads it (tuples as lists), on
    this rank too. Sent as UTF-8 JSON bytes in a uint8 tensor, padded to the longest rank's length
    (gathered first): data only, no pickled objects (``all_gather_object`` would unpickle what other
    processes send). Without a process group: ``[value]`` through the same round trip.
    """
    data = json.dumps(value, allow_nan=True).encode("utf-8")
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [json.loads(data)]
    lengths = [row[0] for row in gather_ints([len(data)])]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(collective_device(mine))
    parts = [torch.empty_like(mine) for _ in lengths]
    torch.distributed.all_gather(parts, mine)
    return [json.loads(part[:n].cpu().numpy().tobytes()) for part, n in zip(parts, lengths)]


# ------------------------------------------------------------------------------------------------
# Inference tensor parallelism (--inference_tp_size)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's group of ``size`` contiguous ranks for tensor-parallel generation: ``index`` is the
    rank's place in it, ``ranks`` the global ranks, ``group`` torch's process group. The three
    collectives the decode model needs are methods, so a test can stand in a simulated group."""

    size: int
    index: int
    ranks: tuple[int, ...]
    group: object

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place (the row-parallel projections' partial sums)."""
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=self.group)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` (the same shape on each), in group order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        torch.distributed.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def broadcast_(self, tensor: torch.Tensor, src_index: int = 0) -> None:
        """Overwrite ``tensor`` with member ``src_index``'s, in place."""
        torch.distributed.broadcast(tensor, src=self.ranks[src_index], group=self.group)


def tensor_parallel_group(size: int) -> TensorParallelGroup:
    """Split the world into groups of ``size`` contiguous ranks and return this rank's (collective:
    every rank must call it, once, with the same ``size``).

    Contiguous ranks share a node under the DeepSpeed launcher and torchrun (ranks are numbered node
    by node), so a group's all-reduces stay on the node's links; the host names are compared to make
    sure, and a group that spans hosts is refused with one line.
    """
    world, rank = get_world_size(), get_rank()
    if size < 1 or world % size:
        raise UserError(f"--inference_tp_size {size} does not divide the world size {world}: launch a multiple of "
                        f"{size} ranks or use an --inference_tp_size that divides {world}")
    hosts = gather_hosts()
    groups = [tuple(range(start, start + size)) for start in range(0, world, size)]
    for ranks in groups:
        if len({hosts[r] for r in ranks}) > 1:
            raise UserError(f"--inference_tp_size {size}: ranks {ranks[0]}-{ranks[-1]} span hosts "
                            f"{sorted({hosts[r] for r in ranks})}; a tensor-parallel group must sit within one node "
                            f"(its all-reduces run every layer): give each node a multiple of {size} ranks")
    mine = None
    for ranks in groups:
        # every rank creates every group, in the same order; its collectives wait as the others do
        group = torch.distributed.new_group(list(ranks), timeout=next(iter(_COLLECTIVE_TIMEOUT), None))
        if rank in ranks:
            mine = TensorParallelGroup(size, ranks.index(rank), ranks, group)
    assert mine is not None
    return mine
