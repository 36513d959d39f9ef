"""Fused batched steps (Triton) for `Dense` and `Conv` blocks under forward Euler.

Why here, beside ``parallel/batched.py``, and not in ``_native/``: these kernels
replace one thing only, `BatchedBlocks.step` (all intervals of a level advanced at
once), and they are written against the layouts ``batched.py`` stacks (parameters with
a leading layer axis, states ``[n, *state]``, step sizes ``[n, 1, ...]``).  ``_native/``
is the C engine, which never touches tensor data (states are opaque to it); Triton
kernels are Python-compiled and torch-launched, so they live with the torch code that
calls them.

What they do: for intervals l = 0..n-1 at once, ``u_l + h_l·act(K_l u_l + b_l)`` with
K_l a dense map (`Dense`) or a same-padded k×k convolution (`Conv`, no batch norm), one
weight set per interval, the intervals a grid axis, in one kernel; and its VJP with
respect to the state, the weights and the bias (`triton_steps`).  The torch path runs a
vectorised convolution as a grouped convolution (groups = intervals), which cuDNN runs
far below the rate of ordinary convolutions.

When they are used: on CUDA, float32, forward Euler, for a block that is exactly a
`Dense` or a `Conv` without batch norm, with an activation in `triton_steps.ACT_CODES`,
and, per input shape, only where a first-use measurement (forward and backward, CUDA
events) shows the fused step faster than the torch path.  Never on the CPU (the tests
run them there with ``TRITON_INTERPRET=1`` through `FusedStep(..., force=True)`).
One switch turns them off: ``LAYERPAR_TRITON=0`` in the environment.  `triton` is
optional: without it (or without CUDA) `fused_step_for` returns None and nothing here
imports it.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..timing import best_seconds

__all__ = ["FusedStep", "enabled", "fused_step_for", "triton_available"]

ENV = "LAYERPAR_TRITON"


def enabled() -> bool:
    """False when ``LAYERPAR_TRITON`` is set to 0/false/off/no (the one switch)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def triton_available() -> bool:
    """Whether `triton` can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _kind(block: nn.Module) -> Optional[tuple[str, str, str, str]]:
    """(kind, weight name, bias name, activation) of a block the kernels implement."""
    from ...ode.blocks import Conv, Dense

    if type(block) is Dense:
        return ("dense", "linear.weight", "linear.bias", block.activation)
    if type(block) is Conv and block.bn is None:
        c = block.conv
        if c.stride == (1, 1) and c.dilation == (1, 1) and c.groups == 1 \
                and c.padding == "same" and c.kernel_size[0] == c.kernel_size[1] \
                and c.padding_mode == "zeros":
            return ("conv", "conv.weight", "conv.bias", block.activation)
    return None


def _applies(x: Tensor) -> bool:
    """Whether the kernels can step this state: float32 on CUDA, under 2**31
    elements (they index in 32 bits)."""
    return x.is_cuda and x.dtype == torch.float32 and x.numel() < 2 ** 31


#: which path is faster, per (kind, activation, state shape, device, gradients wanted,
#: weight and bias shapes): the process's measurements, shared by every `FusedStep`:
#: the answer depends on nothing else, and the auto-tuning builds a model per candidate
#: whose segments would otherwise time each shape again
_CHOICES: dict[tuple, bool] = {}


class FusedStep:
    """The fused step of one segment's blocks: ``__call__(x, params, dt, fallback)``
    returns the fused ``x + dt·F(x)``, or ``fallback()`` (the torch path) where the
    kernels do not apply or measured slower for this shape.

    force: use the kernels whatever the device and measurement (tests, interpreter)."""

    def __init__(self, kind: str, weight: str, bias: str, act: str, force: bool = False):
        from . import triton_steps as ts

        self.kind, self.weight, self.bias, self.act = kind, weight, bias, act
        self.fn = ts.DenseStep.apply if kind == "dense" else ts.ConvStep.apply
        self.force = force
        self.choice = _CHOICES  # shape key -> fused is faster (shared: see _CHOICES)

    def fused(self, x: Tensor, params: dict[str, Tensor], dt: Tensor) -> Tensor:
        """The fused step, unconditionally."""
        return self.fn(x, params[self.weight], params.get(self.bias),
                       dt.reshape(-1).contiguous(), self.act)

    def __call__(self, x: Tensor, params: dict[str, Tensor], dt: Tensor,
                 fallback: Callable[[], Tensor]) -> Tensor:
        if self.force:
            return self.fused(x, params, dt)
        if not _applies(x):
            return fallback()
        grad = torch.is_grad_enabled() and (x.requires_grad or any(
            p.requires_grad for p in params.values()))
        key = (self.kind, self.act, tuple(x.shape), x.device.index, grad,
               tuple((n, tuple(t.shape), t.requires_grad) for n, t in params.items()
                     if n in (self.weight, self.bias)))
        use = self.choice.get(key)
        if use is None:
            if torch.cuda.is_current_stream_capturing():
                return fallback()  # no measuring inside a graph capture
            use = self.choice[key] = self._measure(x, params, dt, fallback, grad)
        return self.fused(x, params, dt) if use else fallback()

    def _measure(self, x: Tensor, params: dict[str, Tensor], dt: Tensor,
                 fallback: Callable[[], Tensor], grad: bool) -> bool:
        """Time both paths on this shape (forward, and backward when gradients are
        wanted), the fastest of a few runs after a warm-up; True if fused is faster.  A
        failure of the kernels (compilation, resources) means: use torch."""
        def run(f: Callable[[], Tensor]) -> Callable[[], Any]:
            def go() -> Any:
                y = f()
                if grad:
                    leaves = [t for t in (x, *params.values()) if t.requires_grad]
                    torch.autograd.grad(y, leaves, torch.ones_like(y))
            return go

        try:
            t_fused = best_seconds(run(lambda: self.fused(x, params, dt)), x.device, 5)
        except Exception:  # noqa: BLE001 - any kernel failure: keep the torch path
            return False
        return t_fused < best_seconds(run(fallback), x.device, 5)


def fused_step_for(block: nn.Module, scheme: Any, force: bool = False
                   ) -> Optional[FusedStep]:
    """A `FusedStep` for a segment whose blocks have the structure of `block`, or None
    (switched off, no triton, no CUDA, another scheme than forward Euler, a block the
    kernels do not implement).  `force` skips the CUDA and measurement conditions."""
    from ...ode.schemes import ForwardEuler

    if not enabled() or type(scheme) is not ForwardEuler:
        return None
    kind = _kind(block)
    if kind is None:
        return None
    from importlib import import_module

    if not (force or torch.cuda.is_available()) or not triton_available():
        return None
    if kind[3] not in import_module(".triton_steps", __name__).ACT_CODES:
        return None
    return FusedStep(*kind, force=force)
