"""Ghost blocks: read-only copies of a neighbour's layers that coarse steps use.

With injection a coarse step evaluates the block at the start of its interval, and
for a rank's first coarse interval that block may belong to the left neighbour (with
"average" coarsening, any block the interval spans).  Such blocks are copied once
and refreshed from their owners at every forward pass.  The adjoint's coarse steps
start at the rank's own layers, so it needs no foreign state.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

from torch import nn

from ..mgrit.grid import Partition, reversed_bounds
from ..mgrit.options import MGRITOptions
from ..ode.net import Segment
from .move import move

__all__ = ["Ghosts", "needed_layers"]

_GHOST_TAG = 31001


def needed_layers(n: int, size: int, rank: int, fwd: MGRITOptions, bwd: MGRITOptions,
                  coarsening: str) -> set[int]:
    """Layers whose blocks this rank's coarse steps use (owned or not), from the forward
    partition and the adjoint's reversed one."""
    need: set[int] = set()
    part = Partition.build(n, size, fwd)
    for lv in part.levels[1:]:
        for j in part.level_range(lv.index, rank):
            if j >= 1:
                a, b = (j - 1) * lv.stride, j * lv.stride
                need.update([a] if coarsening == "injection" else range(a, b))
    rpart = Partition.build(n, size, bwd)
    rpart = Partition(n, size, tuple(reversed_bounds(list(part.bounds))), rpart.levels)
    for lv in rpart.levels[1:]:
        for m in rpart.level_range(lv.index, size - 1 - rank):
            if m >= 1:
                a, b = n - m * lv.stride, n - (m - 1) * lv.stride
                need.update([a] if coarsening == "injection" else range(a, b))
    return need


class Ghosts:
    """This rank's ghost copies of one segment's foreign blocks, and the traffic that
    refreshes them (the same plan on every rank)."""

    def __init__(self, seg: Segment, part: Partition, rank: int,
                 need: Callable[[int], set[int]]) -> None:
        self.seg = seg
        owned = part.steps(rank)
        self.layers = sorted(need(rank) - set(owned))
        self.blocks: dict[int, nn.Module] = {}
        for k in self.layers:  # not submodules: train()/eval() is passed on per pass
            ghost = copy.deepcopy(seg.blocks[k])
            for p in ghost.parameters():
                p.requires_grad_(False)
            self.blocks[k] = ghost
        # (layer, owner, needer) for every rank
        self.plan = [(k, part.owner(k + 1), q) for q in range(part.n_ranks)
                     for k in sorted(need(q)) if k not in part.steps(q)]

    def plan_owner(self, k: int) -> int:
        """The rank owning layer k (from the plan)."""
        return next(owner for layer, owner, _ in self.plan if layer == k)

    def set_training(self, training: bool) -> None:
        for blk in self.blocks.values():
            if blk.training != training:
                blk.train(training)

    def apply(self, fn: Callable) -> None:
        """`.to()`, `.double()`, ... of the model, passed on to the copies."""
        for blk in self.blocks.values():
            blk._apply(fn)

    def sync(self, transport: Any) -> None:
        """Send owned blocks' current parameters to the ranks that keep ghosts of them."""
        if not self.plan:
            return
        me = transport.group_rank
        move(transport, [(owner, needer, self.seg.blocks[k] if owner == me else
                          self.blocks.get(k))
                         for k, owner, needer in self.plan],
             tag=_GHOST_TAG, what="a layer's parameters (a ghost block)")
