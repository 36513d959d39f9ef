"""A `torch.distributed` process group for the ranks of an mpi4py communicator.

torch's `DistributedDataParallel` and `torch.distributed.pipelining` run only over
a torch.distributed process group.  Under torchrun that group exists (env://);
under ``mpiexec`` the ranks know each other only through MPI, so
`process_group_from_mpi` initialises the default group from the communicator:
rank 0 chooses the rendezvous address and a free port and broadcasts them over
MPI, then every rank joins with its MPI rank.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Optional

from ...mgrit.transport import check_timeout

__all__ = ["as_process_group", "own_group", "process_group_from_mpi", "release_group"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def process_group_from_mpi(comm: Any, backend: str = "gloo",
                           timeout: Optional[float] = 600.0) -> Any:
    """The default process group (``torch.distributed.group.WORLD``) over the ranks of
    the mpi4py communicator `comm` (collective over `comm`).

    If torch.distributed is not initialised yet, it is, with `backend` ("gloo" for CPU
    tensors, "nccl" for CUDA): MASTER_ADDR and MASTER_PORT from the environment where
    set, else rank 0's host (127.0.0.1 when every rank runs on it) and a free port
    rank 0 found, broadcast over `comm`.  If it is initialised already, its world must
    be `comm`'s ranks in the same order.  `comm` must span the whole job (the default
    group is the world): for a sub-communicator, make groups with
    ``torch.distributed.new_group`` from a world group yourself.
    """
    import torch.distributed as dist

    if not all(hasattr(comm, a) for a in ("bcast", "allgather", "Get_rank", "Get_size")):
        raise TypeError(f"`comm` must be an mpi4py communicator, got {type(comm).__name__}")
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        ranks = comm.allgather(dist.get_rank())
        if dist.get_world_size() != size or ranks != list(range(size)):
            raise ValueError(
                f"torch.distributed is initialised with world size "
                f"{dist.get_world_size()} and ranks {ranks} over `comm`'s {size} ranks: "
                "`comm` must be its world in the same order")
        return dist.group.WORLD
    hosts = comm.allgather(socket.gethostname())
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn())
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        where = (addr, port)
    else:
        where = None
    addr, port = comm.bcast(where, root=0)
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size, **kwargs)
    return dist.group.WORLD


def as_process_group(comm: Any, backend: str = "gloo") -> Any:
    """`comm` if it is a torch.distributed process group; for an mpi4py communicator
    the world group `process_group_from_mpi` makes; a TypeError otherwise."""
    from ...mgrit.transport import is_comm

    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        dist = None  # type: ignore[assignment]
    if dist is not None and dist.is_available() and isinstance(comm, dist.ProcessGroup):
        return comm
    if is_comm(comm):
        return process_group_from_mpi(comm, backend)
    raise TypeError(f"`comm` must be a torch.distributed process group or an mpi4py "
                    f"communicator, got {type(comm).__name__}")


def own_group(group: Any, timeout: Any = None) -> Any:
    """A new process group of `group`'s ranks for a method's messages, torch's own
    among them (a pipeline schedule's, DistributedDataParallel's), which a failing
    rank severs (`TrainingMethod._apart`), leaving `group` whole.  Made only where
    `group` spans the world (torch names a group made by its members alone after its
    ranks, and a second one of the same ranks would meet the first's rendezvous
    keys): a sub-group is returned as it is, to be shared (collective over the world).

    timeout: over gloo, the method's `timeout` (seconds), which then bounds torch's
    own waits in the new group as it bounds layerpar's: a schedule's receive that
    never comes raises on the ranks waiting instead of holding them for the world
    group's timeout.  Anything but a positive finite number (None: unbounded, or a
    value the method's own checks will refuse, alike on every rank), and any other
    backend (NCCL's timeout ends the process, and its barrier would pick a device),
    leaves torch's default."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != dist.get_world_size():
        return group
    try:
        seconds = check_timeout(timeout)
    except (TypeError, ValueError):  # (refused by the method's agreement, after this)
        seconds = None
    if seconds is None or dist.get_backend(group) != "gloo":
        return dist.new_group(ranks)
    # (gloo fixes a group's timeout when it connects, its rendezvous included: the
    # ranks meet on `group` first, whose own timeout bounds how far apart they come)
    dist.barrier(group=group)
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=seconds))


def release_group(made: Any, given: Any, failed: bool) -> None:
    """Destroy `made` (`own_group`'s) unless it is `given`, the user's, or the method
    `failed` (a severed group may hold an operation that never ends, whose thread
    torch's destructor would wait for: it is left to the process's end, as torch
    leaves a group nobody destroys); nothing raises where torch.distributed is gone."""
    import torch.distributed as dist

    if made is given or failed:
        return
    try:
        dist.destroy_process_group(made)
    except Exception:  # noqa: BLE001 - already gone with the default group
        pass
