"""XBraid as a second MGRIT engine: the glue between `EngineSession` and `_xbraid`.

`engine="xbraid"` runs the same forward and adjoint apps as the native engine through
XBraid's callbacks (our own Cython wrapper of `braid.h`, `layerpar._native._xbraid`,
built only when XBRAID_DIR names an XBraid tree).  What differs from the native
engine, and is refused by name rather than done differently:

- XBraid distributes the N+1 fine points itself, in blocks with the first ranks
  taking one more (`xbraid_bounds`); a caller's partition must be that one.
- XBraid halts on an absolute or a relative tolerance, not on both.
- XBraid steps one state per call and reads every residual norm: no batched steps,
  no deferred norms, no CUDA-graph capture.
- XBraid needs a real MPI communicator: mpi4py (or none, one rank), not a
  torch.distributed group.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Optional

from .errors import RemoteError
from .transport.base import describe, nbytes, pack, unpack

__all__ = ["ENGINES", "XBraidEngine", "check_engine", "check_options",
           "layer_partition_refusal", "require_xbraid", "xbraid_available", "xbraid_bounds",
           "xbraid_refusal"]

ENGINES = ("native", "xbraid")

BUILD_HINT = ("build it from an XBraid source tree: `XBRAID_DIR=/path/to/xbraid make build` "
              "(or `XBRAID_DIR=/path/to/xbraid pip install --no-build-isolation .`); "
              "XBRAID_DIR is the folder holding XBraid's braid/ and makefile.inc")


def check_engine(engine: Any) -> str:
    """`engine` as one of ENGINES (TypeError / ValueError naming it otherwise)."""
    if not isinstance(engine, str):
        raise TypeError(f"`engine` must be a str, one of {ENGINES}, got "
                        f"{type(engine).__name__}")
    if engine not in ENGINES:
        raise ValueError(f"`engine` must be one of {ENGINES}, got {engine!r}")
    return engine


def xbraid_available() -> bool:
    """Whether the XBraid engine was built (XBRAID_DIR at build time)."""
    try:
        importlib.import_module("layerpar._native._xbraid")
    except ImportError:
        return False
    return True


def require_xbraid() -> None:
    """Raise ImportError saying how to build the XBraid engine, if it was not built."""
    if not xbraid_available():
        raise ImportError("engine='xbraid' needs layerpar's XBraid engine, which was not "
                          "built: " + BUILD_HINT)


def xbraid_refusal(transport: Any) -> str | None:
    """Why `engine="xbraid"` cannot run over `transport` (None if it can)."""
    if transport.backend not in ("serial", "mpi"):
        return (f"engine='xbraid' needs an mpi4py communicator (XBraid talks MPI itself), "
                f"not a torch.distributed group ({transport.backend}); pass an mpi4py "
                "communicator or use engine='native'")
    return None


def xbraid_bounds(n_steps: int, n_ranks: int) -> list[int]:
    """XBraid's partition of fine points 0..N: blocks of the N+1 points, the first
    (N+1) mod P ranks taking one point more (rank q owns bounds[q]..bounds[q+1]-1)."""
    quo, rem = divmod(n_steps + 1, n_ranks)
    return [q * quo + min(q, rem) for q in range(n_ranks + 1)]


def layer_partition_refusal(n_steps: int, n_ranks: int) -> str | None:
    """Why LayerParallel cannot run a segment of `n_steps` layers with engine="xbraid"
    on `n_ranks` ranks (None if it can).

    A rank's forward and adjoint solves must use the same layers; with XBraid's fixed
    block partitions (forward, and adjoint on the reversed ranks) that holds when
    they equal the native ones, which is when the ranks divide the layers."""
    from .grid import block_bounds, reversed_bounds

    fwd = block_bounds(n_steps, n_ranks)
    if fwd == xbraid_bounds(n_steps, n_ranks) and \
            reversed_bounds(fwd) == xbraid_bounds(n_steps, n_ranks):
        return None
    return (f"engine='xbraid' partitions the points itself, and a segment of {n_steps} "
            f"layers on {n_ranks} ranks would give a rank different layers in the forward "
            f"and the adjoint solve: use a number of layers divisible by the ranks, or "
            f"engine='native'")


def check_options(options: Any, name: str) -> None:
    """ValueError naming `name` for options XBraid cannot run as the native engine does."""
    if options.tol > 0.0 and options.rtol > 0.0:
        raise ValueError(f"engine='xbraid' halts on an absolute or a relative tolerance, not "
                         f"both: set `{name}.tol` ({options.tol}) or `{name}.rtol` "
                         f"({options.rtol}) to 0")


class XBraidEngine:
    """`Core`'s interface over XBraid, for `EngineSession`.

    `bounds` must be XBraid's own partition.  The engine runs on a communicator split
    from the transport's so that its rank order is the time order (a reversed
    transport view, the adjoint's, gives a reversed communicator) and its messages
    never meet the transport's.  After each drive the ranks exchange whether a
    callback failed on one of them: that rank re-raises its exception and the others
    raise `RemoteError` naming it.  Before each drive the ranks meet in a bounded,
    error-aware exchange, so a rank that failed before its solve is reported too.  A
    rank whose process dies inside braid_Drive cannot be noticed: XBraid's waits have
    no time limit.
    """

    def __init__(self, n_steps: int, t_start: float, t_final: float, transport: Any,
                 bounds: Sequence[int], app: Any) -> None:
        require_xbraid()
        why = xbraid_refusal(transport)
        if why is not None:
            raise ValueError(why)
        expect = xbraid_bounds(n_steps, transport.size)
        if list(bounds) != expect:
            raise ValueError(f"engine='xbraid' distributes the {n_steps + 1} points itself "
                             f"({expect}), not as {list(bounds)}")
        from mpi4py import MPI

        from .._native._xbraid import XBraidCore

        self.transport = transport
        self._comm: Optional[MPI.Intracomm]
        if transport.backend == "serial":
            self._comm, self._own = MPI.COMM_SELF, False
        else:
            self._comm, self._own = transport.comm.Split(0, transport.rank), True
        self.core = XBraidCore(n_steps, float(t_start), float(t_final), self._comm, app, pack,
                               self._unpack)

    def _unpack(self, raw: Any) -> Any:
        return unpack(raw, *self.transport.template)

    def set_options(self, **kwargs: Any) -> None:
        self.core.set_options(**kwargs)

    def set_defer_norms(self, on: bool) -> None:
        self.core.set_defer_norms(on)

    def drive(self) -> int:
        """Run XBraid; re-raise a callback's exception here, or `RemoteError` for one
        raised on another rank.  Returns 0 or NAN_ERROR, as `Core.drive`."""
        t = self.transport
        shape, dtype, _ = t.template
        self.core.set_nbytes(nbytes(shape, dtype))
        if t.size > 1:
            # XBraid's own waits watch no error channel and have no time limit: enter
            # braid_Drive only when every rank has come this far (this exchange is
            # bounded and error-aware, so a rank that failed before it is reported)
            t.allgather_object(None, "the start of an XBraid solve")
        code = self.core.drive()
        err = self.core.error
        if t.size > 1:
            texts = t.allgather_object(None if err is None else describe(err),
                                       "the XBraid engine's error check")
        else:
            texts = [None]
        if err is not None:
            raise err
        for q, text in enumerate(texts):
            if text is not None:
                raise RemoteError(q, text)
        return code

    def __getattr__(self, name: str) -> Any:  # n_levels, iterations, residual_history, ...
        if name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit MPI may be gone
            pass

    def close(self) -> None:
        """Release the engine's communicator."""
        comm = getattr(self, "_comm", None)
        if self._own and comm is not None:
            from mpi4py import MPI

            if not MPI.Is_finalized():
                comm.Free()
        self._comm = None
