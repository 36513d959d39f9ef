"""The propagator Φ: one (possibly coarse) step of an ODE segment, and its VJP.

Φ(u; a, b) advances the state from fine point a to fine point b of a segment with
the segment's scheme: u + (t_b - t_a)·F(u) for forward Euler, F being the block of
layer a (or, for a coarse step with ``"average"`` coarsening, the block with
parameters averaged over layers a..b-1).  The serial oracle (`Segment.step`), the
layer-parallel forward, adjoint and direct callbacks (`layerpar.parallel`) all step
through this one object; the adjoint applies `vjp` to the steps it recorded.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from .coarsening import coarse_block
from .schemes import Scheme

__all__ = ["Propagator", "vjp"]

Blocks = Union[Sequence[nn.Module], nn.ModuleList, Mapping[int, nn.Module]]
Wrap = Callable[[Callable[[Tensor], Tensor], int, int], Callable[[Tensor], Tensor]]


class Propagator:
    """Φ of one segment over the blocks one process evaluates.

    blocks: layer index -> residual branch F_n (a Segment's whole ``blocks``, or one
        rank's own blocks and ghosts); only the layers stepped from need be there.
    times: the fine grid t_0..t_N, a list or `Segment.time` (the same numbers), so step
        sizes agree bit for bit.
    scheme / coarsening: the segment's scheme; ``"injection"`` or ``"average"``.
    """

    def __init__(self, blocks: Blocks, times: Union[Sequence[float], Callable[[int], float]],
                 scheme: Scheme, coarsening: str = "injection") -> None:
        self.blocks = blocks
        self.time: Callable[[int], float] = times if callable(times) else \
            list(times).__getitem__
        self.scheme = scheme
        self.coarsening = coarsening
        # averaged coarse blocks of the current pass (None: not cached, see `new_pass`)
        self._coarse: Optional[dict[tuple[int, int], Callable[[Tensor], Tensor]]] = None

    def new_pass(self) -> None:
        """A layer-parallel pass begins (the parameters may have changed since the
        last): from now until the next call, each averaged coarse block is built once,
        detached (a coarse step's parameters get no gradient: only fine steps'
        do), instead of at every step that uses it.  Without it (the serial oracle)
        every step builds its own, differentiable."""
        self._coarse = {}

    def block(self, a: int, b: int) -> Callable[[Tensor], Tensor]:
        """The layer function of the step a -> b (`coarse_block`)."""
        if b == a + 1 or self.coarsening == "injection":
            return self.blocks[a]
        cache = self._coarse
        got = None if cache is None else cache.get((a, b))
        if got is None:
            with torch.set_grad_enabled(cache is None and torch.is_grad_enabled()):
                got = coarse_block([self.blocks[k] for k in range(a, b)], 0, b - a,
                                   self.coarsening)
            if cache is not None:
                cache[(a, b)] = got
        return got

    def dt(self, a: int, b: int) -> float:
        """t_b - t_a."""
        return self.time(b) - self.time(a)

    def __call__(self, u: Tensor, a: int, b: int, wrap: Optional[Wrap] = None) -> Tensor:
        """Φ(u; a, b).  `wrap(f, a, b)`, if given, returns the function the scheme
        evaluates in place of the block's F (dropout generators, frozen batch-norm
        statistics, checks of the first pass)."""
        f = self.block(a, b)
        if wrap is not None:
            f = wrap(f, a, b)
        return self.scheme.step(f, u, self.time(b) - self.time(a))


def vjp(outputs: Union[Tensor, Sequence[Tensor]], inputs: Sequence[Tensor],
        cotangents: Union[Tensor, Sequence[Tensor]], *,
        retain_graph: bool = False) -> tuple[Optional[Tensor], ...]:
    """Vector-Jacobian products of recorded steps: ∂(outputs)/∂(inputs)ᵀ · cotangents,
    with None for an input the outputs do not depend on.  The adjoint's transposed
    steps (λ_a = (∂Φ/∂u_a)ᵀ λ_b) and its parameter gradients are this."""
    return torch.autograd.grad(outputs, list(inputs), cotangents, retain_graph=retain_graph,
                               allow_unused=True)
