"""Errors raised by the MGRIT layer.  All derive from `MGRITError`."""
from __future__ import annotations


class MGRITError(RuntimeError):
    """Base class of layerpar's MGRIT errors."""


class RemoteError(MGRITError):
    """Another rank failed; raised on every rank that learns of it instead of hanging.

    `rank` is the failing rank (in the communicator passed by the user) and the message
    carries that rank's exception type and text.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.remote_message = message


class RankMismatchError(MGRITError, ValueError):
    """Options, shapes or dtypes differ between ranks (would otherwise hang or be wrong)."""


class EngineError(MGRITError):
    """The C engine reported an error that no Python callback raised (out of memory,
    an inconsistent grid): a defect of the engine or of its build, not of the input."""


class ConvergenceError(MGRITError):
    """MGRIT did not reach its tolerance in `max_iter` iterations (only with `strict`)."""


class DivergenceError(MGRITError, ArithmeticError):
    """The residual norm became NaN or infinite: the solve produced non-finite values."""


class RankLostError(RemoteError):
    """A rank's process is gone (killed, crashed), as the torch.distributed transport
    finds out: its connection closed while another rank waited for it, a census of the
    rendezvous store found it missing, or the store itself became unreachable (rank
    0's process or the launcher is gone).  `rank` is its rank in the world, or -1
    where the backend cannot say which one (the message then reads "rank ?").  The
    mpi4py transport does not raise it: there mpiexec ends the job when a process
    dies, or else the waiting rank's `timeout` expires (`TimeoutError`)."""

    PREFIX = "LOST "  # marks a lost rank on an error channel

    def __init__(self, rank: int | None, detail: str) -> None:
        MGRITError.__init__(self, f"rank {'?' if rank is None or rank < 0 else rank} was "
                            f"lost: {detail}")
        self.rank = -1 if rank is None else rank
        self.remote_message = detail
        self.detail = detail
