"""Refinement in depth: the prolongation operator of nested iteration.

Nested iteration (multilevel initialisation; Cyr, Günther & Schroder, "Multilevel
initialization for layer-parallel deep neural network training", 2019) trains a
shallow ODE-net first, refines it to a deeper net that discretises the *same* ODE
on a finer time grid, and continues training the deep one.  Coarse training is
cheap, and the refined net starts close to a trained one: its output differs from
the coarse net's by O(h) for a scheme of order >= 1, because both are
discretisations of one continuous-in-time network.  ``refine`` is that refinement.
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from .._checks import positive_int
from .net import ODENet, Segment

__all__ = ["INTERPOLATIONS", "RefinesItself", "refine"]

#: The names ``refine`` accepts for ``interpolation``.
INTERPOLATIONS = ("constant", "linear")


@runtime_checkable
class RefinesItself(Protocol):
    """A distributed net that refines itself (`LayerParallel.refine`: each rank
    receives only the coarse layers it needs, no gather): `refine` hands such a net
    the work through this method, so `ode` never imports the parallel side."""

    def refine(self, factor: int, interpolation: str) -> nn.Module: ...


def _tensors(block: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer (persistent or not) of ``block``, by name."""
    out: dict[str, Tensor] = dict(block.named_parameters())
    out.update(block.named_buffers())
    return out


def _check_alike(blocks: nn.ModuleList, k: int) -> None:
    """Linear interpolation mixes blocks k and k+1: they must hold the same tensors."""
    a, b = _tensors(blocks[k]), _tensors(blocks[k + 1])
    if a.keys() != b.keys() or any(
        a[n].shape != b[n].shape or a[n].dtype != b[n].dtype for n in a
    ):
        raise ValueError(
            f'`interpolation="linear"` needs blocks with identical parameter and buffer '
            f"names, shapes and dtypes, but block {k + 1} differs from block {k}"
        )


def _fine_blocks(blocks: nn.ModuleList, factor: int, linear: bool) -> list[nn.Module]:
    """The ``factor * len(blocks)`` blocks of a refined segment (fresh deep copies).

    Fine layer j sits at t_start + j·h with h = H / factor, i.e. at coarse position
    j / factor = k + w (k = j // factor, w = (j % factor) / factor), computed in
    integers so no layer lands in the wrong interval by round-off.  Constant: the
    coarse layer k (the one whose interval [t_k, t_{k+1}) contains t_j).  Linear:
    (1 - w)·θ_k + w·θ_{k+1}, which equals θ_k exactly at w = 0 and (θ_k + θ_{k+1})/2
    exactly at w = 1/2; in the last coarse interval (no θ_N exists) θ_{N-1} is held.
    """
    n = len(blocks)
    if linear:
        for k in range(n - 1):
            _check_alike(blocks, k)
    fine = []
    for j in range(n * factor):
        k, r = divmod(j, factor)
        block = copy.deepcopy(blocks[k])  # a Parameter's deep copy has no .grad
        if linear and r and k + 1 < n:
            w = r / factor
            left, right = _tensors(blocks[k]), _tensors(blocks[k + 1])
            with torch.no_grad():
                for name, t in _tensors(block).items():
                    # Integer buffers (batch norm's num_batches_tracked) cannot be
                    # interpolated: they stay those of layer k, as under "constant".
                    if t.is_floating_point() or t.is_complex():
                        t.copy_((1.0 - w) * left[name] + w * right[name])
        fine.append(block)
    return fine


def refine(net: ODENet, factor: int = 2, interpolation: str = "constant") -> ODENet:
    """Return a new ``ODENet`` with ``factor`` times as many layers in every Segment.

    Every Segment keeps its [t_start, t_final] and scheme and gets ``factor · N``
    steps, so its step size shrinks by ``factor``: the result is a finer
    discretisation of the same ODE, the prolongation step of nested iteration
    (train a coarse net, refine it, continue training the fine one; Cyr et al.
    2019).  Coarse layer k sits at t_k = t_start + k·H.  The parameters *and*
    buffers (e.g. batch-norm running statistics) of fine layer j, at
    t_j = t_start + j·H/factor, are interpolated in time:

    - ``"constant"``: those of the coarse layer whose interval [t_k, t_{k+1})
      contains t_j, i.e. k = j // factor (the fine net runs the same piecewise-
      constant-in-time ODE as the coarse one).
    - ``"linear"``: linear in time between coarse layers; beyond the last coarse
      layer's time t_{N-1} they are held at layer N-1's values, not extrapolated.
      Holding keeps every value inside the range the coarse net was trained with
      (convex combinations: a batch-norm variance stays positive, a bounded weight
      stays bounded) and agrees with the coarse net, whose layer N-1 also acts on
      all of [t_{N-1}, t_final]; extrapolation from two layers would amplify their
      noise.  Needs neighbouring blocks with the same tensor names, shapes, dtypes.
      Integer buffers (batch norm's ``num_batches_tracked``) are taken as under
      ``"constant"``.

    A `LayerParallel` is refined on its own ranks (`LayerParallel.refine`: each rank
    receives only the coarse layers it needs from its neighbours) and a new
    LayerParallel with the same options is returned (collective).

    Fine blocks are deep copies of coarse ones (same class, configuration, dtype,
    device, ``requires_grad`` and training mode) with the interpolated values;
    plain (non-Segment) layers are deep copies with identical values.  Nothing is
    shared with ``net``, which is never modified, and the new net holds no
    gradients (``.grad`` is None).  ``factor=1`` returns an equal copy.  The
    result is a plain ``ODENet`` of plain ``Segment``s even if ``net`` uses
    subclasses.

    Order: with ``"constant"`` each coarse interval is an autonomous ODE and the
    fine grid hits every coarse time, so the refined net converges with the
    scheme's full order.  With ``"linear"`` the parameters vary inside a coarse
    interval but each step freezes them at its start time, which limits
    convergence to first order for any scheme.
    """
    if not isinstance(net, ODENet) and isinstance(net, nn.Module) and isinstance(
            net, RefinesItself):
        return net.refine(factor, interpolation)  # on its own ranks; collective
    if not isinstance(net, ODENet):
        raise TypeError(f"`net` must be an ODENet or a LayerParallel, got "
                        f"{type(net).__name__}")
    factor = positive_int("factor", factor)
    if not isinstance(interpolation, str) or interpolation not in INTERPOLATIONS:
        raise ValueError(
            f"`interpolation` must be one of {list(INTERPOLATIONS)}, got {interpolation!r}"
        )
    linear = interpolation == "linear"
    memo: dict[int, object] = {}  # plain layers that share modules keep sharing them
    layers: list[nn.Module] = []
    for layer in net.layers:
        if isinstance(layer, Segment):
            fine = _fine_blocks(layer.blocks, factor, linear)
            seg = Segment(
                fine.__getitem__,
                factor * layer.n_steps,
                layer.t_final,
                t_start=layer.t_start,
                scheme=copy.deepcopy(layer.scheme),
            )
            seg.training, seg.blocks.training = layer.training, layer.blocks.training
            layers.append(seg)
        else:
            layers.append(copy.deepcopy(layer, memo))
    out = ODENet(layers=layers)
    out.training, out.layers.training = net.training, net.layers.training
    return out
