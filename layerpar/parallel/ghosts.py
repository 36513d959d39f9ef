"""Ghost blocks: read-only copies of a neighbour's layers that coarse steps use.

With injection a coarse step evaluates the block at the start of its interval, and
for a rank's first coarse interval that block may belong to the left neighbour (with
"average" coarsening, any block the interval spans).  Such blocks are copied once
and refreshed from their owners at every forward pass.  The adjoint's coarse steps
start at the rank's own layers, so it needs no foreign state.  Which blocks each
rank keeps, and from whom, is the plan's (`SegmentPlan.ghosts`).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from ..ode.net import Segment
from .move import move

if TYPE_CHECKING:
    from .plan import SegmentPlan

__all__ = ["Ghosts"]

_GHOST_TAG = 31001


class Ghosts:
    """This rank's ghost copies of one segment's foreign blocks, and the traffic that
    refreshes them: `plan`'s ghosts of this rank, and its ghost sends (the same on
    every rank)."""

    def __init__(self, seg: Segment, plan: SegmentPlan, rank: int) -> None:
        self.seg = seg
        self.layers = [k for k, _ in plan.ghosts[rank]]
        self.blocks: dict[int, nn.Module] = {}
        for k in self.layers:  # not submodules: train()/eval() is passed on per pass
            ghost = copy.deepcopy(seg.blocks[k])
            for p in ghost.parameters():
                p.requires_grad_(False)
            self.blocks[k] = ghost
        # (layer, owner, needer) for every rank
        self.sends = plan.ghost_sends()

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
        if not self.sends:
            return
        me = transport.group_rank
        move(transport, [(owner, needer, self.seg.blocks[k] if owner == me else
                          self.blocks.get(k))
                         for k, owner, needer in self.sends],
             tag=_GHOST_TAG, what="a layer's parameters (a ghost block)")
