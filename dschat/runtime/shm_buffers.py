"""DeepSpeed's CPU shared-memory all-reduce buffers in ``/dev/shm``: their names claimed before
DeepSpeed makes them, and removed once every rank has mapped every one.

When every rank of a CPU job is on one machine (the launcher's ``LOCAL_SIZE`` equals the world
size), DeepSpeed's process-group set-up maps one buffer per rank, named
``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``. The names are predictable
and anyone may create files in ``/dev/shm``, so :func:`claim_shm_allreduce_buffer` makes this rank's
name first, a file only this user can open; DeepSpeed never removes them, so
:func:`unlink_shm_allreduce_buffer` does, after start-up. :func:`load_shm_all_reduce` builds
DeepSpeed's op before the rendezvous. :mod:`dschat.runtime.dist` calls all three.
"""
from __future__ import annotations

import os
from pathlib import Path

from dschat.errors import UserError
from dschat.runtime.trust import owned_privately, untrusted_reason

__all__ = ["SHM_DIR", "shm_all_reduce_expected", "claim_shm_allreduce_buffer", "unlink_shm_allreduce_buffer",
           "load_shm_all_reduce"]

SHM_DIR = Path("/dev/shm")


def _shm_buffer_name(rank: int) -> str:
    """DeepSpeed's name for ``rank``'s CPU all-reduce buffer in ``/dev/shm`` (``shm.cpp``)."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def shm_all_reduce_expected() -> bool:
    """DeepSpeed's rule (``shm_interface.cpp``): the shared-memory all-reduce runs when the launcher's
    ``LOCAL_SIZE`` equals the world size (every rank on this machine; plain ``python`` sets neither)."""
    local = os.environ.get("LOCAL_SIZE", "")
    return local.isdigit() and local == os.environ.get("WORLD_SIZE")


def claim_shm_allreduce_buffer(rank: int, shm_dir: Path = SHM_DIR) -> bool:
    """Create this rank's buffer name of DeepSpeed's CPU shared-memory all-reduce before DeepSpeed
    does, a file only this user can open; returns whether this call made it.

    DeepSpeed opens its own name with ``O_CREAT`` (no ``O_EXCL``) and the other ranks' names as soon
    as they exist, never asking who made them. The names are predictable (user id, master address and
    port, rank) and anyone may create files in ``/dev/shm``, so a file another account made first
    would carry every all-reduce of the job, for that account to read and rewrite (the gradients
    included). Called before the rendezvous, so every rank's name is its own before any rank maps one
    (DeepSpeed maps them after it). An existing name is kept only when it is this user's own file
    and nobody else can write to it (a killed run's leftover on the same port, which DeepSpeed then
    reuses); anything else is a :class:`UserError`. Where no name can be made and none exists (no
    ``/dev/shm``), nothing is done: DeepSpeed cannot make one either. A rank killed before the
    rendezvous ends (the launcher's SIGTERM, the rendezvous watchdog) can leave its empty name behind,
    the user's own, reused on that port.
    """
    path = shm_dir / _shm_buffer_name(rank)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600))
        return True
    except FileExistsError:
        pass
    except OSError:
        if not os.path.lexists(path):
            return False
    if owned_privately(path):
        return False
    reason = "it is a symbolic link" if path.is_symlink() else untrusted_reason(path)
    raise UserError(f"{path}, DeepSpeed's shared-memory all-reduce buffer for rank {rank} of this job, is not "
                    f"safe to use on a shared machine: {reason}; pass the launcher another --master_port")


def unlink_shm_allreduce_buffer(rank: int, shm_dir: Path = SHM_DIR) -> bool:
    """Remove the name of this rank's buffer of DeepSpeed's CPU shared-memory all-reduce.

    When every rank of a CPU job is on one machine (the launcher's ``LOCAL_SIZE`` equals the world
    size), DeepSpeed creates ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
    in ``/dev/shm`` (69 MB a rank) and never removes it, so each run on another port leaves its
    buffers behind, in memory, until the machine fills. Call this once every
    rank has opened every buffer: after a barrier that follows DeepSpeed's set-up (which returns once
    this rank has mapped its peers' buffers, not once they have mapped this one's); the mappings live on until the processes exit, only the names go. Returns whether one was removed.
    """
    try:
        (shm_dir / _shm_buffer_name(rank)).unlink()
    except FileNotFoundError:  # no shared-memory all-reduce here (ranks on several hosts, or a GPU)
        return False
    return True


def load_shm_all_reduce(deepspeed: object, accelerator: object) -> None:
    """Build or load DeepSpeed's CPU shared-memory all-reduce op now, which its process-group set-up
    would do inside the rendezvous: a first build takes minutes, and a watchdog ending the process
    mid-build would leave torch's build lock behind, on which every later DeepSpeed start waits."""
    builder = accelerator.create_op_builder("ShareMemCommBuilder")  # type: ignore[attr-defined]
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):  # type: ignore[attr-defined]
        builder.load()
