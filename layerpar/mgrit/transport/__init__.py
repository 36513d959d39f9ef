"""Moving data between ranks: the transport protocol and its backends.

`Transport` (in `base`) documents the contract every backend keeps; the engine,
`solve()` and `LayerParallel` use nothing else.  Backends: `SerialTransport` (one
rank), `MPITransport` (an mpi4py communicator: mpiexec, srun) and `TorchTransport`
(a `torch.distributed` process group: torchrun; gloo for CPU tensors, NCCL for CUDA
tensors without host staging).  `make_transport` picks one from what the user passed
as `comm`.
"""
from __future__ import annotations

from typing import Any, Optional

from .base import (
    _UNFINISHED,
    DEFAULT_TIMEOUT,
    ChannelState,
    ErrorChannel,
    Pending,
    Transport,
    check_timeout,
    describe,
    guarded,
    pack,
    unpack,
)
from .mpi import MPIErrors, MPITransport
from .serial import SerialTransport

__all__ = ["DEFAULT_TIMEOUT", "ChannelState", "ErrorChannel", "MPITransport", "Pending",
           "SerialTransport", "Transport", "check_timeout", "describe", "guarded", "is_comm",
           "is_process_group",
           "make_transport", "pack", "unpack", "_UNFINISHED"]


def is_process_group(comm: Any) -> bool:
    """True for a `torch.distributed` process group."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return dist.is_available() and isinstance(comm, dist.ProcessGroup)


def _is_mpi_comm(comm: Any) -> bool:
    return all(hasattr(comm, a) for a in ("Dup", "Get_rank", "Get_size", "Isend"))


def is_comm(comm: Any) -> bool:
    """True for what `make_transport` accepts besides None."""
    return _is_mpi_comm(comm) or is_process_group(comm)


def _channel_of(kind: type, errors: Optional[ErrorChannel], what: str) -> Any:
    """`errors` where it is None or a channel of the `kind` the backend watches."""
    if errors is not None and not isinstance(errors, kind):
        raise TypeError(f"`errors` must be the error channel of {what} transport (a "
                        f"{kind.__name__}, as its `errors`), got {type(errors).__name__}")
    return errors


def make_transport(comm: Any, *, errors: Optional[ErrorChannel] = None,
                   timeout: Optional[float] = None) -> Transport:
    """The transport for `comm`: None gives `SerialTransport`, an mpi4py communicator
    `MPITransport`, a `torch.distributed` process group (e.g. ``dist.group.WORLD``)
    `TorchTransport`.  `errors` shares an error channel (another transport's `errors`
    of the same backend: a process grid's)."""
    if comm is None:
        return SerialTransport()
    if _is_mpi_comm(comm):
        return MPITransport(comm, errors=_channel_of(MPIErrors, errors, "an mpi4py"))
    if is_process_group(comm):
        from .torchdist import StoreErrors, TorchTransport

        return TorchTransport(comm, errors=_channel_of(StoreErrors, errors,
                                                       "a torch.distributed"),
                              timeout=timeout)
    raise TypeError(f"`comm` must be an mpi4py communicator, a torch.distributed process "
                    f"group or None, got {type(comm).__name__}")
