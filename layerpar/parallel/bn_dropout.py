"""Batch norm and dropout inside layer-parallel solves.

MGRIT evaluates a layer several times per batch.  Batch-norm running statistics must
still move once per batch (in the final sweep), so every other evaluation runs with
them frozen; dropout must draw the same mask at every evaluation of a layer, so each
layer draws from its own generator seeded by (batch seed, segment, layer)
(`layerpar.ode.rng.layer_rng`).  `layer_function` wraps a block accordingly.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Callable, Optional

from torch import Tensor, nn

from ..ode.rng import layer_rng

__all__ = ["BN_TYPES", "batch_norms", "frozen_running_stats", "layer_function"]

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def batch_norms(block: nn.Module) -> list[nn.Module]:
    """The batch-norm modules of a block that keep running statistics."""
    return [m for m in block.modules() if isinstance(m, BN_TYPES) and m.track_running_stats]


@contextlib.contextmanager
def frozen_running_stats(modules: list[nn.Module]) -> Iterator[None]:
    """Batch norm in training mode without updating running statistics (MGRIT
    evaluates a layer several times per batch; the statistics move once, in the
    final sweep)."""
    saved = []
    for m in modules:
        if not m.training:  # eval mode uses running statistics and never updates them
            continue
        saved.append((m, m.momentum, None if m.num_batches_tracked is None
                      else m.num_batches_tracked.clone()))
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, mom, nbt in saved:
            m.momentum = mom
            if nbt is not None:
                m.num_batches_tracked.copy_(nbt)


def layer_function(f: Callable[[Tensor], Tensor], layer: int, seg_index: int,
                   seed: Optional[int], rng: bool, bn: list[nn.Module],
                   update_stats: bool) -> Callable[[Tensor], Tensor]:
    """`f` evaluated inside the layer's own dropout generator (`rng`) and with its
    batch norms' running statistics frozen (`bn`, unless `update_stats`)."""
    if not rng and not (bn and not update_stats):
        return f

    def wrapped(v: Tensor) -> Tensor:
        with contextlib.ExitStack() as stack:
            if rng:
                stack.enter_context(layer_rng(seed, seg_index, layer))
            if bn and not update_stats:
                stack.enter_context(frozen_running_stats(bn))
            return f(v)

    return wrapped
