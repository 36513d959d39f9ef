"""Parameter coarsening: which layer function a coarse MGRIT step uses.

A coarse step from fine point ``istart`` to ``istop`` spans the fine layers
istart..istop-1 but evaluates a single layer function.  ``"injection"`` uses the
fine layer at the start of the interval (the reference library's choice);
``"average"`` evaluates that layer with its parameters replaced by the mean of
the spanned layers' parameters, which often makes coarse levels more accurate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["COARSENINGS", "coarse_block"]

COARSENINGS = ("injection", "average")


def coarse_block(
    blocks: Sequence[nn.Module], istart: int, istop: int, mode: str
) -> Callable[[Tensor], Tensor]:
    """Return the layer function F of a coarse step from fine index ``istart`` to ``istop``.

    ``"injection"`` returns ``blocks[istart]``.  ``"average"`` returns
    ``blocks[istart]`` evaluated with parameters averaged over
    ``blocks[istart:istop]`` (buffers, e.g. batch-norm statistics, stay those of
    ``blocks[istart]``); the averages are built once here and stay differentiable
    with respect to every averaged block's parameters.  For a fine step
    (``istop == istart + 1``) both modes return ``blocks[istart]`` itself.
    """
    if mode not in COARSENINGS:
        raise ValueError(f"`coarsening` must be one of {list(COARSENINGS)}, got {mode!r}")
    if not 0 <= istart < istop <= len(blocks):
        raise ValueError(
            f"need 0 <= istart < istop <= {len(blocks)}, got istart={istart}, istop={istop}"
        )
    block = blocks[istart]
    if mode == "injection" or istop == istart + 1:
        return block
    spans = [dict(blocks[k].named_parameters()) for k in range(istart, istop)]
    first = spans[0]
    for k, params in enumerate(spans[1:], start=istart + 1):
        if params.keys() != first.keys() or any(
            params[n].shape != first[n].shape for n in first
        ):
            raise ValueError(
                f'`coarsening="average"` needs blocks with identical parameter names and '
                f"shapes, but block {k} differs from block {istart}"
            )
    averaged = {n: torch.stack([p[n] for p in spans]).mean(dim=0) for n in first}

    def averaged_block(u: Tensor) -> Tensor:
        return functional_call(block, averaged, (u,))

    return averaged_block
