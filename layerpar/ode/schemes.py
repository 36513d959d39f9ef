"""Time-stepping schemes for the residual ODE u' = F(u).

A scheme advances the state by one (possibly coarse) step of length ``dt`` with a
given right-hand side ``f``.  ``ForwardEuler`` is the classic ResNet update
u + h·F(u); the higher-order schemes evaluate the same layer function several
times per step.  Schemes are found by name through ``SCHEMES``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["Scheme", "ForwardEuler", "Heun", "RK4", "SCHEMES", "get_scheme"]


class Scheme:
    """Base class and contract for a one-step time-stepping scheme.

    Subclasses set the class attributes ``name`` (the key in ``SCHEMES``) and
    ``order`` (the convergence order), and implement ``step``:

    ``step(f, u, dt) -> Tensor`` returns the state after one step of length
    ``dt`` (a Python float) of u' = f(u).  ``f`` maps a tensor to a tensor of the
    same shape; it may be called any number of times.  ``step`` must not modify
    ``u`` in place (MGRIT keeps and reuses states) and must be differentiable
    with plain autograd (the serial oracle backpropagates through it).
    """

    name: str = ""
    order: int = 0

    def step(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: float) -> Tensor:
        """Return the state after one step of length ``dt`` from ``u``."""
        raise NotImplementedError

    def step_many(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: Tensor) -> Tensor:
        """Many independent steps at once: row k of ``u`` ([n, *state]) advances by
        ``dt[k]`` (``dt`` is [n, 1, ...], broadcastable against ``u``); ``f`` maps
        [n, *state] to [n, *state] row by row.  The same arithmetic as ``step`` with a
        tensor step size (layer-parallel cycles advance all intervals of a level so)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ForwardEuler(Scheme):
    """u + dt·f(u): the ResNet update (order 1)."""

    name = "euler"
    order = 1

    def step(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: float) -> Tensor:
        return torch.add(u, f(u), alpha=dt)

    def step_many(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: Tensor) -> Tensor:
        return torch.addcmul(u, dt, f(u))


class Heun(Scheme):
    """Heun's method (explicit trapezoidal rule, RK2, order 2)."""

    name = "heun"
    order = 2

    def step(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: float) -> Tensor:
        k1 = f(u)
        k2 = f(torch.add(u, k1, alpha=dt))
        return torch.add(u, k1 + k2, alpha=0.5 * dt)

    def step_many(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: Tensor) -> Tensor:
        k1 = f(u)
        k2 = f(torch.addcmul(u, dt, k1))
        return torch.addcmul(u, 0.5 * dt, k1 + k2)


class RK4(Scheme):
    """The classic four-stage Runge–Kutta method (order 4)."""

    name = "rk4"
    order = 4

    def step(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: float) -> Tensor:
        k1 = f(u)
        k2 = f(torch.add(u, k1, alpha=0.5 * dt))
        k3 = f(torch.add(u, k2, alpha=0.5 * dt))
        k4 = f(torch.add(u, k3, alpha=dt))
        return torch.add(u, k1 + 2.0 * (k2 + k3) + k4, alpha=dt / 6.0)

    def step_many(self, f: Callable[[Tensor], Tensor], u: Tensor, dt: Tensor) -> Tensor:
        k1 = f(u)
        k2 = f(torch.addcmul(u, 0.5 * dt, k1))
        k3 = f(torch.addcmul(u, 0.5 * dt, k2))
        k4 = f(torch.addcmul(u, dt, k3))
        return torch.addcmul(u, dt / 6.0, k1 + 2.0 * (k2 + k3) + k4)


SCHEMES: dict[str, type[Scheme]] = {cls.name: cls for cls in (ForwardEuler, Heun, RK4)}


def get_scheme(scheme: str | Scheme) -> Scheme:
    """Return a ``Scheme`` instance for a name in ``SCHEMES`` or pass an instance through."""
    if isinstance(scheme, Scheme):
        return scheme
    if isinstance(scheme, str) and scheme in SCHEMES:
        return SCHEMES[scheme]()
    raise ValueError(
        f"`scheme` must be one of {sorted(SCHEMES)} or a Scheme instance, got {scheme!r}"
    )
