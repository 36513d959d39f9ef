"""What one forward pass of one segment leaves for its backward pass: the tape.

A tape belongs to the pass, not to the model: the autograd Function's context owns
it (as torchdiffeq keeps its state in the Function's ``ctx`` and XBraid in one tape
object).  So several forward passes before one backward, a ``no_grad`` forward
between a forward and its backward, and the backward of an earlier pass after a
later pass's, all behave as in plain PyTorch.  Dropping a pass's output drops its
tape with its graph.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["BatchRecord", "PassRecord", "PlainRecord", "Tape", "input_leaf"]


def input_leaf(x: Tensor) -> Tensor:
    """`x` detached, as a leaf that requires grad where its dtype can carry a gradient
    (floating or complex); an integer input (token ids into an `nn.Embedding`) stays
    a plain tensor: ``requires_grad_`` refused it, so such nets could not train."""
    x = x.detach()
    return x.requires_grad_() if x.is_floating_point() or x.is_complex() else x


class BatchRecord:
    """One batched step of the final forward sweep, kept for the adjoint."""

    __slots__ = ("x", "params", "y", "pairs", "layers", "grads", "xd", "rows", "final_rows")

    def __init__(self, x: Tensor, params: dict[str, Tensor], y: Tensor,
                 pairs: tuple[tuple[int, int], ...]) -> None:
        self.x, self.params, self.y, self.pairs = x, params, y, pairs
        self.layers = tuple(a for a, _ in pairs)
        self.grads: dict[str, Tensor] = {}  # stacked parameter gradients (final sweep)
        self.xd: Optional[Tensor] = None  # x detached, when coarse steps read its rows
        self.rows: Optional[tuple[Tensor, ...]] = None  # xd's rows, for lone coarse steps
        self.final_rows = 0  # rows whose gradients the final adjoint sweep has added


class Tape:
    """One segment's records of one forward pass on this rank.

    records: per-step path, layer a -> (input, output with its graph, detached
        output); consecutive layers form chains sharing one graph, chain_head[a] being
        the chain's first layer.
    brecords / where: batched path, the records of the final sweep's vectorised steps
        and, per layer, (record, row).
    coarse_graphs: coarse steps linearised at the forward states, built at the first
        adjoint iteration that needs one and reused by the others.
    param_grads: per layer, what the final adjoint sweep produced (per-step path).
    bb / layer_params: the vectorised steps the pass ran with (None: per-step) and the
        parameters that required grad then; its backward uses the same.
    versions: what `BatchedBlocks.param_versions` said when the pass began (its
        records read the parameters as views: the backward checks they are unchanged).
    exact: the pass ran exact propagation (`LayerParallel.exact`); so does its backward.
    seed / rng_layers: the pass's dropout seed and the layers that draw from it (a
        coarse step rebuilt in the backward pass must draw the same masks).
    autocast: the autocast dtype the pass ran under on its device, None where autocast
        was off: the backward's steps run under the same (`autocast_as`), since the
        autograd engine runs a backward outside the caller's autocast.
    """

    __slots__ = ("recording", "seed", "rng_layers", "records", "chain_head", "brecords",
                 "where", "coarse_graphs", "param_grads", "bb",
                 "layer_params", "exact", "versions", "autocast")

    def __init__(self, recording: bool = False, seed: Optional[int] = None,
                 rng_layers: frozenset[int] = frozenset()) -> None:
        self.recording = recording
        self.seed = seed
        self.rng_layers = rng_layers
        self.records: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.chain_head: dict[int, int] = {}
        self.brecords: list[BatchRecord] = []
        self.where: dict[int, tuple[int, int]] = {}
        self.coarse_graphs: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.param_grads: dict[int, tuple] = {}
        self.bb: Optional[Any] = None  # the BatchedBlocks the pass stepped with, if any
        self.layer_params: dict[int, list[Tensor]] = {}  # trainable, as the pass found them
        self.exact = False  # the pass ran exact propagation, not the model's MGRIT
        self.versions: Optional[dict[int, int]] = None  # flat parameters' versions
        self.autocast: Optional[torch.dtype] = None

    def clear(self) -> None:
        """Empty the tape, as a new one is: a consumed tape drops its records and their
        graphs (and no longer records)."""
        Tape.__init__(self)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast runs `device`'s operations in now, None where it is off."""
    return torch.get_autocast_dtype(device.type) \
        if torch.is_autocast_enabled(device.type) else None


def autocast_as(device: torch.device, dtype: Optional[torch.dtype]) -> torch.autocast:
    """Autocast on `device` as `autocast_dtype` found it: on in `dtype`, or off."""
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


class PlainRecord:
    """A plain layer evaluated once with its graph kept for the backward pass.

    Consecutive plain layers on one rank share one graph (`prev`): the backward pass
    then goes through the whole group in one autograd call."""

    def __init__(self, layer: nn.Module, x: Tensor, record: bool,
                 prev: Optional[PlainRecord] = None) -> None:
        # the group's first record, None where it is this one: a record naming itself
        # was a reference cycle, freed only by the cyclic collector, which kept each
        # pass's graph alive and with it the parameters' AccumulateGrad nodes, bound
        # to the CUDA stream of that pass (eager steps on the default stream then
        # broke a later graph capture on the H200: `cudaErrorStreamCaptureImplicit`)
        self._head: Optional[PlainRecord] = None
        self.x: Tensor  # the layer's input (a leaf, or the group's previous output)
        self.y: Tensor  # its output, with its graph where `record`
        if record:
            with torch.enable_grad():
                if prev is not None:
                    self.x, self._head = prev.y, prev.head
                else:
                    self.x = input_leaf(x)
                self.y = layer(self.x)
        else:
            self.x, self.y = x, layer(x)
        self.params = [p for p in layer.parameters() if p.requires_grad]
        # each tensor once (the group's gradient of a weight two of its layers share is
        # the sum of both uses; listed twice, autograd would hand that sum out twice)
        group = prev.group_params if prev is not None else []
        self.group_params: list[Tensor] = group + [
            p for p in self.params if all(p is not q for q in group)]

    @property
    def head(self) -> PlainRecord:
        """The first record of this one's group (consecutive plain layers, one graph)."""
        return self if self._head is None else self._head


class PassRecord:
    """What one forward pass of the whole model leaves for its backward pass: its plain
    layers' records, per segment its tape, and where the states and the output were."""

    def __init__(self) -> None:
        self.plain: dict[int, PlainRecord] = {}
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []  # segment states
        self.out_holder = 0  # rank that computed the output
        self.x_requires_grad = False
        self.x_shape: tuple[int, ...] = ()
        self.x_dtype = torch.float32
        self.direct = False  # recorded onto the caller's graph (see LayerParallel)
        self.exact = False  # exact propagation (see LayerParallel.exact)
        self.tapes: dict[int, Tape] = {}  # per segment layer: what its backward needs
