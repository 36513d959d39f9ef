"""ODE networks: residual segments and the serial oracle.

A ``Segment`` is N residual steps u ← scheme(u, dt, F_n) on [t_start, t_final];
an ``ODENet`` chains segments with ordinary (possibly shape-changing) layers.
``ODENet.forward`` runs everything layer after layer with plain autograd: it is
the *serial oracle* every layer-parallel result is tested against.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable

from torch import Tensor, nn

from .._checks import finite_in, positive_int
from .coarsening import COARSENINGS
from .flat import flatten
from .propagator import Propagator
from .rng import draw_seed, layer_rng, needs_rng, plain_rng
from .schemes import Scheme, get_scheme

__all__ = ["Segment", "ODENet", "sequential_segment", "guard_serial_forward",
           "serial_forward_guard", "copying_stale"]

#: nets whose layers a model distributes over ranks, each with what says why its serial
#: forward would not compute the trained net now (None: it would): `guard_serial_forward`
_GUARDED: weakref.WeakKeyDictionary[nn.Module, Callable[[], str | None]] = \
    weakref.WeakKeyDictionary()


#: `copying_stale` blocks open: a guarded net may be copied (by layerpar itself)
_COPYING_STALE = 0


def guard_serial_forward(net: nn.Module, why: Callable[[], str | None]) -> None:
    """Make `net`'s `ODENet.forward`, `state_dict`, pickling (``torch.save(net)``) and
    `copy.deepcopy` raise `why()` where it is not None: a model that trains the net's
    layers on several ranks leaves each rank's copies of the others' layers
    untrained, and a serial pass over them (evaluating the net as one would a
    DistributedDataParallel's module), a checkpoint or a copy of them (an
    ``AveragedModel``, a best-so-far copy) would be another net, silently.  A copy
    made while the net was current is not guarded."""
    _GUARDED[net] = why


@contextmanager
def copying_stale() -> Iterator[None]:
    """Within it, a guarded net may be copied (`copy.deepcopy`) though it is stale:
    for layerpar's own copies, which take the trained layers from their owners."""
    global _COPYING_STALE
    _COPYING_STALE += 1
    try:
        yield
    finally:
        _COPYING_STALE -= 1


def serial_forward_guard(net: nn.Module) -> Callable[[], str | None] | None:
    """The guard `guard_serial_forward` set on `net`, if any."""
    return _GUARDED.get(net)


class Segment(nn.Module):
    """N residual steps u <- scheme(u, dt, F_n) on [t_start, t_final].

    ``block(n)`` builds the residual branch F_n (it computes F(u), not u + F(u))
    for n = 0..N-1; the blocks are stored in ``self.blocks``.  The fine time grid
    is t_i = t_start + (i / N)(t_final - t_start), computed exactly as the MGRIT
    engine computes it, so step sizes agree bit for bit.

    The blocks' parameters are stored flat (`flat.py`): each parameter name the blocks
    share is one tensor with a row per block, and every block's `Parameter` is a view
    of its row (made when the blocks are built and after `.to()`); a vectorised
    layer-parallel step reads strided views of those rows instead of copying them.
    """

    def __init__(
        self,
        block: Callable[[int], nn.Module],
        n_steps: int,
        t_final: float = 1.0,
        *,
        t_start: float = 0.0,
        scheme: str | Scheme = "euler",
    ) -> None:
        super().__init__()
        if not callable(block) or isinstance(block, nn.Module):
            raise TypeError(
                f"`block` must be a callable n -> nn.Module (a factory, not a module; "
                f"wrap existing modules with sequential_segment), got {type(block).__name__}"
            )
        self.n_steps = positive_int("n_steps", n_steps)
        self.t_start = finite_in("t_start", t_start)
        self.t_final = finite_in("t_final", t_final)
        if not self.t_final > self.t_start:
            raise ValueError(
                f"`t_final` must be greater than `t_start`, got t_final={self.t_final}, "
                f"t_start={self.t_start}"
            )
        self.scheme = get_scheme(scheme)
        blocks = []
        for n in range(self.n_steps):
            b = block(n)
            if not isinstance(b, nn.Module):
                raise TypeError(
                    f"`block` (`steps` in ODENet) must return an nn.Module, but block({n}) "
                    f"returned {type(b).__name__}"
                )
            blocks.append(b)
        self.blocks = nn.ModuleList(blocks)
        flatten(self.blocks)  # one tensor per parameter name, rows per block (flat.py)

    def _apply(self, fn: Callable, recurse: bool = True) -> Segment:
        """`.to()`, `.double()` ... replace the parameters' storage: lay the new one out
        flat again (`flat.py`) before anything can hold it."""
        super()._apply(fn, recurse)
        flatten(self.blocks)
        return self

    def time(self, i: int) -> float:
        """Time of fine point ``i`` (0..N): t_start + (i / N) * (t_final - t_start)."""
        if not 0 <= i <= self.n_steps:
            raise IndexError(f"fine index must be in [0, {self.n_steps}], got {i}")
        return self.t_start + (i / self.n_steps) * (self.t_final - self.t_start)

    def step(
        self,
        u: Tensor,
        istart: int,
        istop: int,
        *,
        coarsening: str = "injection",
        seed: int | None = None,
        segment_index: int = 0,
    ) -> Tensor:
        """One (possibly coarse) step from fine point ``istart`` to ``istop``.

        dt = time(istop) - time(istart), F = coarse_block(self.blocks, istart,
        istop, coarsening); returns scheme.step(F, u, dt), the segment's
        `propagator`.  If ``seed`` is not None and ``needs_rng(blocks[istart])``,
        every evaluation of F runs inside ``layer_rng(seed, segment_index, istart)``,
        so all evaluations of layer ``istart`` for one batch draw the same dropout
        mask.
        """
        if coarsening not in COARSENINGS:
            raise ValueError(f"`coarsening` must be one of {list(COARSENINGS)}, got "
                             f"{coarsening!r}")
        if not 0 <= istart < istop <= self.n_steps:
            raise ValueError(f"need 0 <= istart < istop <= {self.n_steps}, got "
                             f"istart={istart}, istop={istop}")
        # the seed of the layer's random draws, where its block draws any
        rng_seed = seed if seed is not None and needs_rng(self.blocks[istart]) else None

        def wrap(f: Callable[[Tensor], Tensor], a: int, b: int) -> Callable[[Tensor], Tensor]:
            def branch(v: Tensor) -> Tensor:
                if rng_seed is not None:
                    with layer_rng(rng_seed, segment_index, a):
                        out = f(v)
                else:
                    out = f(v)
                if out.shape != v.shape:
                    raise ValueError(
                        f"layer {a} of the segment changed the state's shape from "
                        f"{tuple(v.shape)} to {tuple(out.shape)}; a residual block must "
                        "keep it")
                return out
            return branch

        return self.propagator(coarsening)(u, istart, istop, wrap)

    def propagator(self, coarsening: str = "injection") -> Propagator:
        """Φ of this segment over all its blocks (`layerpar.ode.propagator`)."""
        return Propagator(self.blocks, self.time, self.scheme, coarsening)

    def forward(self, u: Tensor, *, seed: int | None = None, segment_index: int = 0) -> Tensor:
        """Serial oracle: all N fine steps in order, with plain autograd."""
        for n in range(self.n_steps):
            u = self.step(u, n, n + 1, seed=seed, segment_index=segment_index)
        return u

    def extra_repr(self) -> str:
        return (
            f"n_steps={self.n_steps}, t=[{self.t_start:g}, {self.t_final:g}], "
            f"scheme={self.scheme.name!r}"
        )


def sequential_segment(
    seq: nn.Sequential | Sequence[nn.Module],
    t_final: float | None = None,
    *,
    scheme: str | Scheme = "euler",
) -> Segment:
    """Wrap equal-shape residual-branch modules as a Segment (sharing the same objects).

    Each module must compute only the residual branch F(u), not u + F(u).  The
    default ``t_final = len(seq)`` gives step size h = 1 (up to round-off), so
    forward Euler reproduces a classic ResNet u ← u + F(u).
    """
    modules = list(seq)
    if not modules:
        raise ValueError("`seq` must contain at least one module")
    for k, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"`seq` must hold nn.Modules, but item {k} is {type(m).__name__}")
    t_final = float(len(modules)) if t_final is None else t_final
    return Segment(modules.__getitem__, len(modules), t_final, scheme=scheme)


class ODENet(nn.Module):
    """Opening layer(s) → ODE segment(s) → closing layer(s); ``forward`` is the serial oracle.

    Simple form: ``ODENet(open, steps, n_steps, t_final, close, scheme=...)`` gives
    ``layers = [open, Segment(steps, n_steps, t_final, scheme=scheme), close]``
    (a None ``open``/``close`` is left out).  General form: ``ODENet(layers=[...])``
    with any mix of ``Segment``s and plain modules, at least one Segment; there
    each Segment carries its own ``t_final`` and ``scheme``.  Parameters are named
    ``layers.<k>.…``, e.g. ``layers.1.blocks.5.linear.weight``.

    Dropout: in training mode, if any layer needs randomness (``needs_rng``),
    ``forward`` first draws one seed with ``draw_seed()`` (before any layer
    runs) and passes it to every Segment with ``segment_index`` = the Segment's
    position in ``segments`` (0, 1, …).  Each fine layer's mask then depends only
    on (seed, segment_index, layer), so a layer-parallel run that draws its seed
    the same way (``forward_seed``) reproduces serial dropout exactly given the
    same global torch seed.  Plain layers are called once; one with dropout
    draws its mask from ``layer_rng(seed, PLAIN, k)`` (`plain_rng`), so the global
    generator advances by the one seed alone, as it does on every rank of a
    layer-parallel run.
    """

    def __init__(
        self,
        open: nn.Module | None = None,
        steps: Callable[[int], nn.Module] | None = None,
        n_steps: int | None = None,
        t_final: float = 1.0,
        close: nn.Module | None = None,
        *,
        layers: Sequence[nn.Module] | None = None,
        scheme: str | Scheme = "euler",
    ) -> None:
        super().__init__()
        if layers is not None:
            simple = {"open": open, "steps": steps, "n_steps": n_steps, "close": close}
            given = [f"`{k}`" for k, v in simple.items() if v is not None]
            if t_final != 1.0:
                given.append("`t_final`")
            if not (isinstance(scheme, str) and scheme == "euler"):
                given.append("`scheme`")
            if given:
                raise ValueError(
                    f"give either `layers` or the simple form, not both: {', '.join(given)} "
                    "given with `layers` (set t_final/scheme on each Segment)"
                )
            layers = list(layers)
            for k, m in enumerate(layers):
                if not isinstance(m, nn.Module):
                    raise TypeError(
                        f"`layers` must hold nn.Modules, but item {k} is {type(m).__name__}"
                    )
            if not any(isinstance(m, Segment) for m in layers):
                raise ValueError("`layers` must contain at least one Segment")
        else:
            if steps is None or n_steps is None:
                raise ValueError("give `steps` and `n_steps` (simple form) or `layers`")
            if not callable(steps) or isinstance(steps, nn.Module):
                raise TypeError(
                    f"`steps` must be a callable n -> nn.Module, got {type(steps).__name__}"
                )
            for name, end in (("open", open), ("close", close)):
                if end is not None and not isinstance(end, nn.Module):
                    raise TypeError(f"`{name}` must be an nn.Module or None")
            segment = Segment(steps, n_steps, t_final, scheme=scheme)
            layers = [m for m in (open, segment, close) if m is not None]
        self.layers = nn.ModuleList(layers)

    @property
    def segments(self) -> list[tuple[int, Segment]]:
        """(layer index, Segment) for every Segment in ``layers``, in order."""
        return [(k, m) for k, m in enumerate(self.layers) if isinstance(m, Segment)]

    @property
    def n_steps_total(self) -> int:
        """Number of residual steps over all segments."""
        return sum(seg.n_steps for _, seg in self.segments)

    def forward_seed(self) -> int | None:
        """The dropout seed ``forward`` uses: one ``draw_seed()`` if needed, else None.

        Draws (and so advances the global generator) only in training mode when
        some layer needs randomness; otherwise returns None without drawing.
        """
        if self.training and any(needs_rng(m) for m in self.layers):
            return draw_seed()
        return None

    def forward(self, x: Tensor) -> Tensor:
        """Serial oracle: every layer in order, plain autograd (refused where a model
        trains this net's layers on several ranks and they are stale here:
        `guard_serial_forward`)."""
        self._refuse_stale()
        return self.forward_seeded(x, self.forward_seed())

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        """`nn.Module.state_dict`, refused where a model trains this net's layers on
        several ranks and they are stale here (`guard_serial_forward`): a checkpoint
        saved from it would hold the other ranks' untrained layers."""
        self._refuse_stale()
        return super().state_dict(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """`nn.Module`'s, refused where a model trains this net's layers on several
        ranks and they are stale here (`guard_serial_forward`): ``torch.save(net)``,
        `pickle` and `copy.deepcopy` would hold the other ranks' untrained layers."""
        if not _COPYING_STALE:
            self._refuse_stale()
        return super().__getstate__()

    def _refuse_stale(self) -> None:
        guard = _GUARDED.get(self)
        if guard is not None and (why := guard()) is not None:
            raise RuntimeError(why)

    def forward_seeded(self, x: Tensor, seed: int | None) -> Tensor:
        """`forward` with its dropout seed given: ``forward_seed()``'s, or None where
        the caller knows that no layer draws random numbers (`forward_seed` walks
        every module to find that out: 0.3 ms a pass on 128 pre-norm MLP layers)."""
        segment_index = 0
        for k, layer in enumerate(self.layers):
            if isinstance(layer, Segment):
                x = layer(x, seed=seed, segment_index=segment_index)
                segment_index += 1
            else:
                with plain_rng(seed, k, layer):
                    x = layer(x)
        return x

    def extra_repr(self) -> str:
        segs = ", ".join(
            f"{seg.n_steps}@[{seg.t_start:g}, {seg.t_final:g}]" for _, seg in self.segments
        )
        return f"segments={len(self.segments)} ({segs}), n_steps_total={self.n_steps_total}"
