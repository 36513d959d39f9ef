"""A segment's per-layer parameters as the rows of one tensor per parameter name.

A `Segment` keeps its blocks' parameters "flat" (as sharded data-parallel wrappers
keep theirs): block n's ``linear.weight`` is row n of one [N, out, in] tensor, and so
on for every name the blocks share.  Nothing changes for a user or an optimizer: the
`Parameter` objects, their values, shapes, hooks and `.grad` stay as they were; only
their storage is shared.  A layer-parallel pass then reads the parameters of layers
a, a + d, a + 2d, ... (a vectorised MGRIT step) as a strided view of those rows
(`rows`) instead of stacking copies of them: on the 1,024-layer dense MNIST-1D net at
2 ranks the stacking took about 2 ms of a 75 ms training step.

The layout is made where nobody can yet hold the old storage: when a `Segment` builds
its blocks, and again right after `.to()`, `.double()` and the like have replaced it
(`Segment._apply`).  `rows` only reads it, and answers None where it has gone (a
`.data` a user set): the caller then stacks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch
from torch import Tensor, nn
from torch.utils import swap_tensors

__all__ = ["flatten", "generation", "rows"]

#: how many times `flatten` has moved parameters to new storage in this process: a
#: holder of detached views of parameters (a replicated net's exchange) compares it
#: with the count it built them at, and lays them out again when it moved
_GENERATION = 0


def generation() -> int:
    """The count of `flatten`'s storage moves so far (see `_GENERATION`)."""
    return _GENERATION


def _column(named: Sequence[Mapping[str, Tensor]], name: str) -> Optional[list[Tensor]]:
    """Parameter `name` of every block (`named`: each block's parameters by name), where
    all are plain dense tensors of one shape, dtype and device and no tensor serves two
    blocks; else None."""
    col = [d.get(name) for d in named]
    t0 = col[0]
    if t0 is None or any(t is None for t in col):
        return None
    if isinstance(t0, nn.parameter.UninitializedParameter) or t0.numel() == 0 or \
            t0.layout != torch.strided or len({id(t) for t in col}) < len(col):
        return None
    if any(t is not None and (t._backward_hooks or getattr(
            t, "_post_accumulate_grad_hooks", None)) for t in col):
        return None  # swapping a tensor would drop the hooks a user put on it
    if any(t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device or  # type: ignore[union-attr]
           isinstance(t, nn.parameter.UninitializedParameter) for t in col):
        return None
    return col  # type: ignore[return-value]


def flatten(blocks: Union[Sequence[nn.Module], nn.ModuleList]) -> None:
    """Make each parameter the blocks share the rows of one tensor (values, `Parameter`
    objects and `requires_grad` unchanged; each tensor swapped for a view of its row,
    `torch.utils.swap_tensors`).  Names that cannot be rows of one tensor (shapes,
    dtypes or devices that differ, a tensor in two blocks, lazy or empty tensors, a
    tensor with hooks, a tensor an autograd node holds) are left as they are; so are
    names already flat.  Nothing is swapped inside a `torch.autocast` region: autocast
    keeps its casts of the parameters (and their autograd nodes) until the region
    ends, and a parameter swapped under them would fail the pass's backward ("poisoned
    by swap_tensors"; an auto setting built during a pass under autocast did)."""
    if len(blocks) < 2 or any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return
    named = [dict(b.named_parameters()) for b in blocks]
    with torch.no_grad():
        for name in named[0]:
            col = _column(named, name)
            if col is None or rows(col) is not None:
                continue
            base = torch.stack([t.detach() for t in col])
            _moved()
            for i, t in enumerate(col):
                grad = t.grad
                try:
                    # the Parameter object stays (optimizers and hooks hold it); its
                    # tensor becomes row i of base
                    swap_tensors(t, nn.Parameter(base[i], requires_grad=t.requires_grad))
                    # swapping moves `.grad` too: a gradient accumulated before (a
                    # model built, or a twin of it, between a backward and its step)
                    # stays the parameter's
                    t.grad = grad
                except RuntimeError:
                    # held elsewhere (an autograd node of an earlier pass): left as it
                    # is, and so the name is not flat (`rows` says so; passes stack)
                    break


def _moved() -> None:
    global _GENERATION
    _GENERATION += 1


def rows(col: Sequence[Tensor]) -> Optional[Tensor]:
    """The tensors of `col` as one [len(col), *shape] view (no copy) where they are
    consecutive contiguous rows of one storage in this order, else None."""
    t0 = col[0]
    if t0.numel() == 0 or not all(t.is_contiguous() for t in col):
        return None
    step = t0.numel() * t0.element_size()
    first = t0.data_ptr()
    if [t.data_ptr() for t in col] != list(range(first, first + step * len(col), step)):
        return None
    storage = t0.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage or t.dtype != t0.dtype or
           t.shape != t0.shape for t in col):
        return None
    return t0.detach().as_strided((len(col), *t0.shape), (t0.numel(), *t0.stride()),
                                  t0.storage_offset())
