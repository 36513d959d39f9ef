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
from typing import TYPE_CHECKING

import torch

from ..mgrit.grid import Partition
from ..ode.net import Segment
from ..ode.refine import INTERPOLATIONS, refine
from .ghosts import _load_state_vector, _state_vector

if TYPE_CHECKING:
    from .model import LayerParallel

__all__ = ["refine_parallel"]

_REFINE_TAG = 31005


def _needed(n: int, size: int, q: int, factor: int, linear: bool) -> set[int]:
    """Coarse layers rank q needs to build its fine layers."""
    fine = Partition.build(n * factor, size).steps(q)
    need = {j // factor for j in fine}
    if linear:
        need |= {min(j // factor + 1, n - 1) for j in fine}
    return need


def refine_parallel(model: LayerParallel, factor: int = 2,
                    interpolation: str = "constant") -> LayerParallel:
    """A new LayerParallel over the same ranks (or grid) whose segments have `factor`
    times the layers, with parameters interpolated in time as `layerpar.ode.refine`
    does; options and settings are the model's.  Collective; `model` is unchanged."""
    from .._checks import positive_int

    factor = positive_int("factor", factor)
    if not isinstance(interpolation, str) or interpolation not in INTERPOLATIONS:
        raise ValueError(f"`interpolation` must be one of {list(INTERPOLATIONS)}, got "
                         f"{interpolation!r}")
    linear = interpolation == "linear"
    tr, size, me = model.transport, model.size, model.rank
    # this rank's copy of the whole net: `_net`'s modules are the model's own, so the
    # layers this rank owns (blocks and plain layers) hold the trained values; the
    # others are stale and are either received below or never used
    net = copy.deepcopy(model._net)
    for k, runner in model._runners.items():
        seg = net.layers[k]
        assert isinstance(seg, Segment)
        n = seg.n_steps
        part = runner.part
        owned = set(part.steps(me))
        sends, recvs = [], []
        for q in range(size):
            if q == me:
                continue
            for a in sorted(_needed(n, size, q, factor, linear) & owned):
                sends.append(tr.post_send(_state_vector(seg.blocks[a]), q, _REFINE_TAG))
        for a in sorted(_needed(n, size, me, factor, linear) - owned):
            src = part.owner(a + 1)  # the rank computing step a (its output point)
            vec = _state_vector(seg.blocks[a])
            recvs.append((a, src, tr.post_recv(vec.shape, vec.dtype, torch.device("cpu"),
                                               src, _REFINE_TAG)))
        for a, src, h in recvs:
            got = tr.complete(h, f"layer {a}'s parameters (refinement)", src)
            _load_state_vector(seg.blocks[a], got)
        for h in sends:
            tr.complete(h, "a layer's parameters to be received (refinement)")
    fine = refine(net, factor, interpolation)
    opts = (model.options, model.backward_options)
    kw = dict(model._init_kwargs)
    if model.accuracy is not None:
        kw["accuracy"] = model.accuracy.policy
    return type(model)(fine, model._comm_arg, *opts, **kw)
