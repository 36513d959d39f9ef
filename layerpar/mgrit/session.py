"""One engine session: what `solve()` and `LayerParallel` share around the C engine.

A session owns one `Core` over a fixed grid and partition: it sets the validated
options once, drives the solve, turns the engine's codes into the `MGRITError` tree,
and returns a typed `MGRITResult` (`result.py`).  With fixed iteration counts
(tol = rtol = 0) it can defer the residual norms: the app appends each iteration's
local norm (a device scalar) to `session.deferred` and the history is read back once
after the solve (or, when asked, only when `residual_history` is first read), so the
cycle itself needs no host-device synchronisation.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from .._native._core import NAN_ERROR, Core
from .errors import DivergenceError
from .options import MGRITOptions
from .result import MGRITResult

__all__ = ["EngineSession"]


class EngineSession:
    """One engine instance over the fine grid of `n_steps` steps on [t_start, t_final],
    partitioned by `bounds` over `transport`'s ranks, with `app`'s callbacks.

    what: how errors name this solve (e.g. "forward MGRIT ... of segment 0").
    defer_norms: keep residual norms on the device (needs tol = rtol = 0); the app's
        `norm_sq` then appends to `deferred` and returns 0.0.
    engine: "native" (layerpar's C engine) or "xbraid" (XBraid itself, when built; see
        `layerpar.mgrit.xbraid`: its partition is `xbraid_bounds`).
    """

    def __init__(self, n_steps: int, t_start: float, t_final: float, transport: Any,
                 bounds: Sequence[int], app: Any, options: MGRITOptions, *,
                 what: str = "MGRIT", defer_norms: bool = False,
                 engine: str = "native") -> None:
        self.engine = engine
        self.core: Any
        if engine == "xbraid":
            from .xbraid import XBraidEngine

            self.core = XBraidEngine(n_steps, t_start, t_final, transport, bounds, app)
        else:
            self.core = Core(n_steps, float(t_start), float(t_final), transport.rank,
                             transport.size, list(bounds), app, transport)
        self.core.set_options(**options.engine_kwargs())
        self.core.set_defer_norms(defer_norms)
        self.transport = transport
        self.what = what
        self.deferred: Optional[list[torch.Tensor]] = [] if defer_norms else None

    def drive(self, *, lazy_history: bool = False) -> MGRITResult:
        """Run the solve; a non-finite residual raises `DivergenceError` (on every rank:
        they all see the same reduced norm).  lazy_history: with deferred norms on one
        rank, read the history back only when it is first looked at."""
        if self.deferred is not None:
            self.deferred.clear()
        core = self.core
        code = core.drive()
        if code == NAN_ERROR:
            hist = core.residual_history
            raise DivergenceError(
                f"{self.what} residual became {hist[-1]} in iteration {core.iterations}: "
                f"non-finite values (history {hist})")
        stats = MGRITResult(iterations=core.iterations, converged=core.converged,
                           n_levels=core.n_levels, timings=core.timings,
                           step_counts=core.step_counts(), batch_counts=core.batch_counts())
        # the iterations that measured a residual: the same on every rank (a rank that
        # holds no residual point has no norm of its own, yet joins the reduction)
        measured = len(core.residual_history)
        if self.deferred is None:
            stats._history = core.residual_history
        elif not measured:
            stats._history = []
        else:
            norms = list(self.deferred)
            if norms and len(norms) != measured:
                raise RuntimeError(f"{self.what}: {len(norms)} deferred residual norms "
                                   f"for {measured} measured iterations")
            read = self._reader(norms, measured)
            if lazy_history and self.transport.size == 1:
                stats._lazy = read
            else:  # a collective: every rank reads now
                stats._history = read()
        return stats

    def _reader(self, norms: list[torch.Tensor], measured: int
                ) -> Callable[[], list[float]]:
        """The history's reader: this rank's squared norms (`measured` zeros where it
        holds no residual point) summed over the ranks."""
        transport, what = self.transport, self.what

        def read() -> list[float]:
            # the one read-back of the solve
            local = (torch.stack(norms) ** 2).tolist() if norms else [0.0] * measured
            hist = [math.sqrt(v) if v >= 0 else math.nan
                    for v in transport.allreduce_sum(local)]
            if not all(math.isfinite(v) for v in hist):
                bad = next(k for k, v in enumerate(hist) if not math.isfinite(v))
                raise DivergenceError(
                    f"{what} residual became {hist[bad]} (entry {bad + 1} of the history): "
                    f"non-finite values (history {hist})")
            return hist

        return read

    def close(self) -> None:
        """Release what the engine holds beyond memory (XBraid's communicator)."""
        close = getattr(self.core, "close", None)
        if close is not None:
            close()

    def state(self, i: int) -> Any:
        """The engine's state at fine point i (owned by this rank) after the solve."""
        return self.core.get_state(i)
