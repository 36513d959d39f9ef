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

An auto-tuned model (``options="auto"``) changes its settings between batches (a
check outside the bound tunes again; the adaptive controller moves the iteration
counts), so its setting of the moment is captured instead, `AutoCapturedStep`, and
captured again after a check that changed it.  On one H200, the MNIST-1D dense net
(1,024 x 32) trained at 8.6 ms per captured step of L3 cf8 1/1, against 38.3 ms per
eager step of the setting auto chose there (L4 cf4; docs/tta/gpu/).
"""
from __future__ import annotations

import gc
import traceback
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .._checks import positive_int
from ..mgrit.options import MGRITOptions
from .auto import Auto
from .model import LayerParallel

__all__ = ["AutoCapturedStep", "CapturedStep", "capture_step"]


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
    # the parameters' AccumulateGrad nodes are bound to the stream they were made on:
    # the capture must make its own, so none may outlive the passes before it (one
    # made on the default stream breaks the capture: cudaErrorStreamCaptureImplicit).
    # Every model's cache of them is dropped (`GradDelivery.reset`), and whatever only
    # the cyclic collector would free (a caller's reference cycle holding a graph) is
    # freed now; layerpar's own passes leave no cycle (tests/test_auto_capture.py)
    model.reset_grad_delivery()
    gc.collect()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    return CapturedStep(graph, sx, sy, loss)


def fixed_settings(model: Auto) -> tuple[Any, MGRITOptions, MGRITOptions]:
    """What an auto-tuned `model` runs now, as fixed settings: (the tuner's chosen
    setting, forward options, adjoint options), with the adaptive controller's
    iteration counts, or exact propagation (one level) where it switched to exact.
    Raises ValueError where the choice is no `LayerParallel` of its own (replicated
    serial, which needs more than one rank) or `model` was never tuned."""
    tuner = model.tuner
    if tuner is None or tuner.chosen is None:
        raise ValueError("`model` has no tuned auto settings: build it with "
                         "options='auto' and call model.tune(x, y, loss_fn) first")
    chosen = tuner.chosen
    if not isinstance(chosen, (LayerParallel, Auto)):
        raise ValueError(f"auto chose {type(chosen).__name__}, which runs on several ranks "
                         "and cannot be captured")
    ctl = chosen.accuracy  # (an Auto's: the chosen setting's adaptive controller)
    if ctl is None:
        fwd, bwd = chosen.options, chosen.backward_options
    elif ctl.exact:
        fwd = bwd = MGRITOptions(max_levels=1)
    else:
        fwd, bwd = ctl.options(chosen.options, chosen.backward_options)
    # one level iterates nothing, so its tolerance decides nothing (a capture takes none)
    fwd, bwd = (o.replace(tol=0.0, rtol=0.0) if o.max_levels == 1 else o for o in (fwd, bwd))
    return chosen, fwd, bwd


def _why(exc: BaseException) -> str:
    """A failed capture in words: the error, where in layerpar it was raised, and the
    error that came first during the capture (CUDA reports a broken capture when it
    ends, as "operation failed due to a previous error during capture": the first
    error, in `__context__`, is the one that says what broke it)."""
    def one(e: BaseException) -> str:
        where = [f for f in traceback.extract_tb(e.__traceback__)
                 if "layerpar" in f.filename]
        at = f" (at {where[-1].filename.rsplit('layerpar', 1)[-1].lstrip('/')}:" \
             f"{where[-1].lineno}, {where[-1].name})" if where else ""
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{at}"
    first = exc.__context__ or exc.__cause__
    return one(exc) + (f"; first: {one(first)}" if first is not None else "")


class AutoCapturedStep:
    """The training step of an auto-tuned `LayerParallel` on one GPU, captured.

    Its setting of the moment (`fixed_settings`) is built as a plain twin (same
    parameter tensors, no controller, no finiteness check) and its step captured with
    `capture_step`.  Call `refresh` after each gradient check (``model.check_gradients``,
    which runs eagerly and may tune again or move the iteration counts): it captures
    again when the setting changed, and returns whether it did.  A capture that fails
    leaves the step eager (`why_eager` says why), so training goes on.

    capture: the function that captures (`capture_step`; tests give another)."""

    def __init__(self, model: Auto, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Tensor, Any], Tensor], x: Tensor, y: Tensor,
                 warmup: int = 3, capture: Callable[..., Any] = capture_step) -> None:
        if not isinstance(model, Auto) or model.tuner is None:
            raise TypeError("`model` must be a LayerParallel built with options='auto'")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.warmup, self._capture = warmup, capture
        self.captures = 0  # captures made (the first and every re-capture)
        self.why_eager: Optional[str] = None
        self._key: Optional[tuple] = None
        self._twin: Optional[LayerParallel] = None
        self._step: Any = None
        self.x = x  # the shape a replay takes (a short last batch runs eagerly)
        self.refresh(x, y)

    def _settings(self) -> tuple[Any, MGRITOptions, MGRITOptions, tuple]:
        chosen, fwd, bwd = fixed_settings(self.model)
        return chosen, fwd, bwd, (id(chosen), fwd, bwd)

    def refresh(self, x: Tensor, y: Tensor) -> bool:
        """Capture the setting of the moment again if it changed since the last
        capture (its warm-up steps train on `x`, `y`); whether it captured."""
        try:
            chosen, fwd, bwd, key = self._settings()
        except ValueError as exc:
            self._release()
            self.why_eager = str(exc)
            return False
        if key == self._key:
            return False
        self._release()
        self._key = key
        twin = chosen.like(options=fwd, backward_options=bwd, accuracy=None,
                           check_finite=False)
        twin.train(True)
        try:
            self._step = self._capture(twin, self.optimizer, self.loss_fn, x, y,
                                       warmup=self.warmup)
        except (RuntimeError, ValueError) as exc:
            twin.close()
            self.why_eager = _why(exc)
            return False
        self._twin, self.why_eager = twin, None
        self.captures += 1
        return True

    def _release(self) -> None:
        self._step = None
        if self._twin is not None:
            self._twin.close()
            self._twin = None

    def observe_step(self, seconds: Optional[float]) -> None:
        """The measured seconds of a replayed step (the training loop times them
        without waiting for the GPU: `layerpar.parallel.timing.SpanTimer`), given to
        the tuner before a gradient check: checks run eagerly, and their interval is
        set for them to take `tuner.CHECK_SHARE` of the training's time, which is
        this step's, several times shorter than the eager pass the tuning timed (on
        the H200, the 1,024-layer dense net's L3 cf8 1/1: a 27.4 ms eager pass, an 8.6 ms captured
        step).  None (nothing replayed yet) changes nothing."""
        tuner = self.model.tuner
        if seconds is not None and self.captured and tuner is not None:
            tuner.step_seconds = seconds

    @property
    def captured(self) -> bool:
        """Whether steps replay a graph now (else they run eagerly)."""
        return self._step is not None

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """One training step on (`x`, `y`): a replay where a graph of this shape is
        captured, else eagerly through the auto model.  Returns the loss tensor."""
        tuner = self.model.tuner
        if tuner is None:
            raise RuntimeError("a captured step needs an auto-tuned model (its tuner is None)")
        if self._step is not None and x.shape == self.x.shape:
            loss = self._step(x, y)
            tuner.count_captured()
            return loss
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def close(self) -> None:
        self._release()
