"""Direct mode: one rank, forward and adjoint both sequential.

The adjoint solve would then be exactly backpropagation through the recorded final
sweep, which here is the serial network's own graph; so the steps are recorded onto
the input's graph and PyTorch's engine runs the backward.  Parameters are the graph's
leaves as in plain PyTorch: `autograd.grad`, `backward(inputs=)` and hooks behave as
in serial code, and no autograd Function with one input per parameter stands in
between (that cost ~4.5 us per parameter per backward pass).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..mgrit.errors import DivergenceError
from ..mgrit.result import MGRITResult
from .forward import ForwardApp

#: a `LayerParallel` (the model in direct mode): not imported, as the model imports this module
_Model = Any

__all__ = ["DirectApp", "direct_backward_started"]


class DirectApp(ForwardApp):
    """The forward app of a segment that may run in direct mode: a direct pass
    (`begin_direct`) records its final sweep onto the segment input's own graph, as
    plain PyTorch would (no per-step records, states kept with their graph); any other
    pass runs as `ForwardApp`'s."""

    def begin_direct(self, u0: Tensor) -> None:
        """Make the pass begun a direct one: `u0` (with its graph) is the input."""
        self.u0_graph: Optional[Tensor] = u0
        self.u0 = u0.detach()
        self.out: Optional[Tensor] = None

    def end(self) -> None:
        super().end()
        self.u0_graph = None
        self.out = None

    def step(self, u: Tensor, f: Optional[Tensor], ts: float, te: float, a: int, b: int,
             level: int, final: int) -> Tensor:
        if self.u0_graph is not None and final and f is None and level == 0:
            return self.sweep([a], [b])[0]
        return super().step(u, f, ts, te, a, b, level, final)

    def step_seq(self, u: Tensor, fs: Optional[list], ts: list, te: list, as_: list,
                 bs: list, level: int, final: int) -> list:
        if self.u0_graph is not None and final and fs is None and level == 0:
            return self.sweep(as_, bs)
        return super().step_seq(u, fs, ts, te, as_, bs, level, final)

    def sweep(self, as_: list, bs: list) -> list:
        """The sequential sweep (or a stretch of it) onto the input's graph; a stretch
        not starting at 0 continues the previous one.  Layers that draw random numbers,
        and the checks of a first pass, step through `phi`; the others call the
        propagator directly (serial stepping: blocks may update their own buffers)."""
        r = self.r
        prop, special = r.prop, self.tape.rng_layers
        outs = []
        x = self.u0_graph if as_[0] == 0 else self.out
        with torch.enable_grad():
            for a, b in zip(as_, bs):
                if a in special or self.check_shapes:
                    x = r.phi(x, a, b, self.tape, update_stats=True, check=self.check_shapes,
                              own_buffers=False)
                else:
                    x = prop(x, a, b)
                outs.append(x.detach())
        self.out = x
        # the engine keeps the states it is given until its next solve: with their
        # graph they would keep the parameters' AccumulateGrad nodes alive from pass
        # to pass, bound to the CUDA stream of the pass that made them (one made on
        # the default stream then broke every later graph capture); the graph goes
        # on in `out` (0.35 ms of detaches a pass at 1,024 layers on the CPU)
        return outs


def direct_backward_started(model: _Model, gy: Tensor) -> None:
    """Hook on the direct-mode output: the same check and report as the adjoint solve
    (a sequential solve: one iteration, no residuals, no communication).  The timings
    are zeros, not measurements: PyTorch's engine runs this backward."""
    if model.check_finite and not bool(torch.isfinite(gy).all()):
        raise DivergenceError("the loss gradient is not finite (NaN or inf loss?)")
    model.last_backward = [
        MGRITResult(iterations=1, converged=True, n_levels=1,
                    timings=dict.fromkeys(fwd.timings, 0.0), _history=[])
        for fwd in model.last_forward]
