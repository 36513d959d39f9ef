"""Nested iteration on a `LayerParallel`: refine in depth without gathering the net.

`refine_parallel(model, factor, interpolation)` is `layerpar.ode.refine` for a model
distributed over ranks.  Fine layer j of a segment takes its values from coarse layer
j // factor (and, for ``"linear"``, the next one).  Under the fine partition a rank
owns about `factor` times its coarse layers, so all it needs that it does not hold is
at most a layer or two at either end of its block: those come from the neighbour
that owns them, as point-to-point messages.  Nothing is gathered, so memory and
traffic stay per rank as the net grows.
"""
from __future__ import annotations

import copy
from typing import Any

from ..mgrit.grid import Partition
from ..ode.net import Segment, copying_stale
from ..ode.refine import INTERPOLATIONS, refine
from .move import move

#: a `LayerParallel` (the model refined): not imported, as the model imports this module
_Model = Any

__all__ = ["refine_parallel"]

_REFINE_TAG = 31005


def _needed(n: int, size: int, q: int, factor: int, linear: bool) -> set[int]:
    """Coarse layers rank q needs to build its fine layers."""
    fine = Partition.build(n * factor, size).steps(q)
    need = {j // factor for j in fine}
    if linear:
        need |= {min(j // factor + 1, n - 1) for j in fine}
    return need


def refine_parallel(model: _Model, factor: int = 2, interpolation: str = "constant",
                    **settings: Any) -> Any:
    """A new LayerParallel over the same ranks (or grid) whose segments have `factor`
    times the layers, with parameters interpolated in time as `layerpar.ode.refine`
    does; options and settings are the model's, but for `settings` (`LayerParallel.like`:
    `Auto.refine` gives its ``accuracy``).  Collective; `model` is unchanged."""
    from .._checks import positive_int

    factor = positive_int("factor", factor)
    if not isinstance(interpolation, str) or interpolation not in INTERPOLATIONS:
        raise ValueError(f"`interpolation` must be one of {list(INTERPOLATIONS)}, got "
                         f"{interpolation!r}")
    linear = interpolation == "linear"
    tr, size = model.transport, model.size
    # this rank's copy of the whole net: `whole_net`'s modules are the model's own, so the
    # layers this rank owns (blocks and plain layers) hold the trained values; the
    # others are stale and are either received below or never used
    with copying_stale():
        net = copy.deepcopy(model.whole_net)
    for sp in model.plan.segments:
        seg = net.layers[sp.position]
        if not isinstance(seg, Segment):
            raise TypeError(f"layer {sp.position} of the plan must be a Segment, got "
                            f"{type(seg).__name__}")
        n = seg.n_steps
        part = sp.forward
        # every rank lists the same moves: coarse layer a from the rank computing
        # step a (its output point) to each rank that needs it
        move(tr, [(part.owner(a + 1), q, seg.blocks[a]) for q in range(size)
                  for a in sorted(_needed(n, size, q, factor, linear))],
             tag=_REFINE_TAG, what="a layer's parameters (refinement)")
    fine = refine(net, factor, interpolation)
    return model.like(fine, **settings)
