"""`MGRITResult`: what one MGRIT solve reached, for `solve()` and for every pass.

One type for both: `solve()` returns it with the final state and this rank's states;
`LayerParallel` keeps one per segment and pass in ``model.last_forward`` and
``model.last_backward`` (there the pass's output is the model's return value, so
`final_state` is None and `states` is empty).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

__all__ = ["MGRITResult"]


@dataclass(kw_only=True, repr=False)
class MGRITResult:
    """What one MGRIT solve reached; identical on every rank except `states`.

    `converged` says whether a tolerance was met; not converging is reported here,
    not raised (unless the options are `strict`).  `residual_history` holds r_1, r_2,
    ... with `skip` on (r_0 does not exist then), r_0, r_1, ... otherwise.  It may be
    read back from the device lazily (deferred norms, one rank): then the first access
    reads it and raises `DivergenceError` if it is not finite.

    iterations, n_levels: the cycles done and the levels of the grid hierarchy.
    timings: seconds per phase of the engine (``wait`` and ``reduce`` are this rank's
        communication and idle time; XBraid does not measure them).
    step_counts, batch_counts: per level, the steps this rank computed and the calls
        (a batched call advances several steps) that computed them.
    final_state: u at the final time, broadcast to every rank (`solve()`; None for a
        pass of `LayerParallel`).
    states: this rank's fine-grid states by point index (`solve()`; empty for a pass).
    """

    iterations: int
    converged: bool
    n_levels: int
    timings: dict[str, float] = field(default_factory=dict)
    step_counts: list[int] = field(default_factory=list)
    batch_counts: list[int] = field(default_factory=list)
    final_state: Optional[torch.Tensor] = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    _history: Optional[list[float]] = field(default=None, repr=False)
    _lazy: Optional[Callable[[], list[float]]] = field(default=None, repr=False,
                                                       compare=False)

    @property
    def residual_history(self) -> list[float]:
        if self._history is None:
            self._history = self._lazy() if self._lazy is not None else []
            self._lazy = None
        return self._history

    def __repr__(self) -> str:
        hist = ("<not read back yet>" if self._history is None and self._lazy is not None
                else self.residual_history)
        state = None if self.final_state is None else \
            f"<tensor {tuple(self.final_state.shape)} {self.final_state.dtype}>"
        return (f"MGRITResult(iterations={self.iterations}, converged={self.converged}, "
                f"n_levels={self.n_levels}, residual_history={hist}, "
                f"final_state={state}, states={len(self.states)} on this rank, "
                f"step_counts={self.step_counts}, batch_counts={self.batch_counts}, "
                f"timings={self.timings})")

    @property
    def residual_by_iteration(self) -> list[Optional[float]]:
        """The residual of each iteration, 0 to ``iterations - 1`` (as `message` counts
        them): None where the iteration computed none (iteration 0 with `skip`, which
        does no fine-level work; the single sweep of one level)."""
        hist = self.residual_history
        n = min(self.iterations, len(hist))
        return [None] * (self.iterations - n) + hist[len(hist) - n:]

    @property
    def success(self) -> bool:
        """Whether a tolerance was met (scipy's name for `converged`)."""
        return self.converged

    @property
    def message(self) -> str:
        """One line: converged or not, after how many iterations, the last residual."""
        hist = self.residual_history
        last = f"{hist[-1]:.3e}" if hist else "n/a"
        if self.converged:
            return f"converged in {self.iterations} iterations (residual {last})"
        return f"not converged after {self.iterations} iterations (residual {last})"
