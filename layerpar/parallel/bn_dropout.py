"""Batch norm and dropout inside layer-parallel solves.

MGRIT evaluates a layer several times per batch.  Batch-norm running statistics must
still move once per batch (in the final sweep), so every other evaluation runs with
them frozen; dropout must draw the same mask at every evaluation of a layer, so each
layer draws from its own generator seeded by (batch seed, segment, layer)
(`layerpar.ode.rng.layer_rng`).  `layer_function` wraps a block accordingly.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Callable, Optional

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from ..ode.rng import layer_rng

__all__ = ["BN_TYPES", "batch_norms", "frozen_running_stats", "layer_function"]

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def batch_norms(block: nn.Module) -> list[_NormBase]:
    """The batch-norm modules of a block that keep running statistics."""
    return [m for m in block.modules() if isinstance(m, BN_TYPES) and m.track_running_stats]


@contextlib.contextmanager
def frozen_running_stats(modules: Sequence[_NormBase]) -> Iterator[None]:
    """Batch norm in training mode without updating running statistics (MGRIT
    evaluates a layer several times per batch; the statistics move once, in the
    final sweep)."""
    saved: list[tuple[_NormBase, Optional[float], Optional[Tensor]]] = []
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
            if nbt is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(nbt)


def layer_function(f: Callable[[Tensor], Tensor], layer: int, seg_index: int,
                   seed: Optional[int], rng: bool, bn: Sequence[_NormBase],
                   update_stats: bool) -> Callable[[Tensor], Tensor]:
    """`f` evaluated inside the layer's own dropout generator (`rng`: seeded from the
    pass's `seed`, which a pass that draws random numbers always has) and with its
    batch norms' running statistics frozen (`bn`, unless `update_stats`)."""
    if not rng and not (bn and not update_stats):
        return f
    if rng and seed is None:
        raise RuntimeError(f"internal: layer {layer} of segment {seg_index} draws random "
                           "numbers, but its pass has no dropout seed")

    def wrapped(v: Tensor) -> Tensor:
        with contextlib.ExitStack() as stack:
            if rng and seed is not None:
                stack.enter_context(layer_rng(seed, seg_index, layer))
            if bn and not update_stats:
                stack.enter_context(frozen_running_stats(bn))
            return f(v)

    return wrapped
