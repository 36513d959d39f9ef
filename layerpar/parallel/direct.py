"""Direct mode: one rank, forward and adjoint both sequential.

The adjoint solve would then be exactly backpropagation through the recorded final
sweep, which here is the serial network's own graph; so the steps are recorded onto
the input's graph and PyTorch's engine runs the backward.  Parameters are the graph's
leaves as in plain PyTorch: `autograd.grad`, `backward(inputs=)` and hooks behave as
in serial code, and no autograd Function with one input per parameter stands in
between (that cost ~4.5 us per parameter per backward pass).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..mgrit.errors import DivergenceError
from ..mgrit.result import MGRITResult

if TYPE_CHECKING:
    from .model import LayerParallel
    from .runner import SegmentRunner

__all__ = ["direct_backward_started", "direct_sweep"]


def direct_sweep(r: SegmentRunner, as_: list, bs: list) -> list:
    """Direct mode's sequential sweep (or a stretch of it), recorded onto the segment
    input's graph as plain PyTorch would: no per-step records, states kept with
    their graph.  A stretch not starting at 0 continues the previous one."""
    step, blocks, times, special = r.scheme.step, r.blocks, r.times, \
        r.tape.rng_layers
    outs = []
    x = r.u0_graph if as_[0] == 0 else r.direct_out
    with torch.enable_grad():
        for a, b in zip(as_, bs):
            if a in special or r.check_shapes:
                x = r.phi(x, a, b, update_stats=True)
            else:
                x = step(blocks[a], x, times[b] - times[a])
            outs.append(x)
    r.direct_out = x
    return outs


def direct_backward_started(model: LayerParallel, gy: Tensor) -> None:
    """Hook on the direct-mode output: the same check and report as the adjoint solve
    (a sequential solve: one iteration, no residuals, no communication).  The timings
    are zeros, not measurements: PyTorch's engine runs this backward."""
    if model.check_finite and not bool(torch.isfinite(gy).all()):
        raise DivergenceError("the loss gradient is not finite (NaN or inf loss?)")
    model.last_backward = [
        MGRITResult(iterations=1, converged=True, n_levels=1,
                    timings=dict.fromkeys(fwd.timings, 0.0), _history=[])
        for fwd in model.last_forward]
