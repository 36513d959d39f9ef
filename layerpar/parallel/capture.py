"""A LayerParallel training step captured in one CUDA graph and replayed.

With fixed iteration counts (tol = rtol = 0) and `check_finite=False`, a forward and
an adjoint MGRIT solve on one GPU are a static sequence of kernels: the schedule is
the engine's, the residual norms stay on the device, and nothing is read back.  Such
a step (forward, loss, backward, optimizer step) can be captured once and replayed,
so the host's per-operation launch and dispatch cost disappears:

    step = layerpar.parallel.capture_step(model, optimizer, loss_fn, x, y)
    for x, y in batches:            # same shapes as the example batch
        loss = step(x, y)           # copies x, y in, replays, returns the loss tensor

Capture needs what CUDA graphs need: one CUDA device, fixed shapes, no host
synchronisation; each of these is checked first and refused with a clear error.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from .._checks import positive_int
from .model import LayerParallel

__all__ = ["CapturedStep", "capture_step"]


class CapturedStep:
    """A captured training step: call it with a batch shaped like the example."""

    def __init__(self, graph: Any, x: Tensor, y: Tensor, loss: Tensor) -> None:
        self.graph, self.x, self.y, self.loss = graph, x, y, loss

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        for name, new, static in (("x", x, self.x), ("y", y, self.y)):
            if new.shape != static.shape or new.dtype != static.dtype:
                raise ValueError(
                    f"`{name}` has shape {tuple(new.shape)} and dtype {new.dtype}, but the "
                    f"step was captured for {tuple(static.shape)}, {static.dtype}: a CUDA "
                    "graph replays fixed shapes (capture another step for this shape)")
            static.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.loss


def capture_step(model: LayerParallel, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor,
                 warmup: int = 3) -> CapturedStep:
    """Capture zero_grad, forward, `loss_fn(model(x), y)`, backward and
    `optimizer.step()` in one CUDA graph (after `warmup` eager steps on a side stream,
    which also train).  Returns the replayable step; `.grad` of every parameter then
    lives in the graph's memory and is rewritten by each replay."""
    if not isinstance(model, LayerParallel):
        raise TypeError(f"`model` must be a LayerParallel, got {type(model).__name__}")
    if getattr(model, "engine", "native") != "native":
        raise ValueError("capture_step needs engine='native': XBraid (engine='xbraid') reads "
                         "every residual norm and steps from C callbacks, which a CUDA graph "
                         "cannot capture")
    if not torch.cuda.is_available():
        raise RuntimeError("capture_step needs CUDA: no CUDA device is available")
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, Tensor) or not t.is_cuda:
            raise ValueError(f"`{name}` must be a CUDA tensor to capture a step (a CUDA "
                             "graph cannot read host memory); move it with .cuda()")
    if any(not p.is_cuda for p in model.parameters()):
        raise ValueError("`model` has parameters off the GPU; call model.cuda() first")
    if model.size != 1:
        raise ValueError("capture_step runs on one rank: messages between ranks go "
                         f"through the host (this model has {model.size} ranks)")
    for name, o in (("options", model.options), ("backward_options", model.backward_options)):
        if o.tol != 0.0 or o.rtol != 0.0:
            raise ValueError(
                f"`{name}` has tol={o.tol}, rtol={o.rtol}: a tolerance decides the number "
                "of iterations on the host after reading the residual back, which a CUDA "
                "graph cannot do; use tol=0, rtol=0 and a fixed max_iter")
    if model.check_finite:
        raise ValueError("`model.check_finite` is True: checking every output for NaN "
                         "reads a flag back from the GPU; build the model with "
                         "check_finite=False to capture it")
    positive_int("warmup", warmup)
    sx, sy = x.detach().clone(), y.detach().clone()

    def step() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(sx), sy)
        loss.backward()
        optimizer.step()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first passes: shape checks, vmap probe, caches
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    optimizer.zero_grad(set_to_none=True)
    model.reset_grad_delivery()  # AccumulateGrad nodes of the capture's own stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    return CapturedStep(graph, sx, sy, loss)
