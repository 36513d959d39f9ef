"""The placement plan: which rank owns which layers on each level, the ghosts, and
who sends what to whom, as plain data that prints as a table.

Built from the net's structure, the number of ranks and the MGRIT options alone (no
communicator), so a configuration can be read and checked before any job runs:
``print(layerpar.parallel.Plan.build(net, 4, options))``, or ``print(model.plan)``.
It is the same on every rank.  A `LayerParallel` builds it once, at construction, and
it is the one description of the placement that the model, its segment runners and
their ghosts read: each segment's partitions, and each rank's ghost blocks, are
computed here and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Union

from torch import nn

from ..mgrit.grid import Partition, build_levels, reversed_bounds
from ..mgrit.options import MGRITOptions
from ..ode.net import ODENet, Segment

__all__ = ["Plan", "SegmentPlan", "needed_layers"]


def _span(r: range) -> str:
    if not len(r):
        return "-"
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


@dataclass(frozen=True)
class SegmentPlan:
    """One ODE segment over the ranks.

    forward: the partition of fine points and the forward solve's levels.
    adjoint: the adjoint solve's partition of the reverse-time grid and its levels:
        reverse point m holds lambda_{N-m}, and its engine rank q is forward rank
        P-1-q, so each rank differentiates its own layers (`reversed_bounds`).
    ghosts: per rank, (layer, owner) of the neighbours' blocks it keeps copies of
        for its coarse steps, refreshed from their owners at every forward pass.
    """

    index: int
    position: int  # in net.layers
    t_start: float
    t_final: float
    forward: Partition
    adjoint: Partition
    ghosts: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def n_steps(self) -> int:
        return self.forward.n_steps

    @property
    def adjoint_levels(self) -> tuple:
        """The adjoint solve's levels."""
        return self.adjoint.levels

    def ghost_sends(self) -> list[tuple[int, int, int]]:
        """(layer, owner, needer) of every ghost block, the needers in rank order: the
        messages that refresh the ghosts at every forward pass, the same list on every
        rank."""
        return [(k, o, q) for q in range(self.forward.n_ranks) for k, o in self.ghosts[q]]

    def layers(self, rank: int) -> range:
        """The layers (steps u_n -> u_{n+1}) `rank` owns and differentiates."""
        return self.forward.steps(rank)

    def boundary_sends(self, level: int) -> list[tuple[int, int, int]]:
        """(from rank, to rank, level point) of the forward states that cross ranks at
        each relaxation sweep of `level`: a rank's last point, to the next rank that
        owns points on that level.  The adjoint sends the mirror image."""
        part = self.forward
        owned = [part.level_range(level, q) for q in range(part.n_ranks)]
        out = []
        for q in range(part.n_ranks):
            if not len(owned[q]):
                continue
            nxt = next((r for r in range(q + 1, part.n_ranks) if len(owned[r])), None)
            if nxt is not None:
                out.append((q, nxt, owned[q].stop - 1))
        return out

    def __str__(self) -> str:
        part = self.forward
        levels = part.levels
        cfs = ", ".join(str(lv.cfactor) for lv in levels[:-1]) or "-"
        lines = [f"segment {self.index} (net.layers[{self.position}]): {self.n_steps} "
                 f"residual layers on [{self.t_start:g}, {self.t_final:g}], forward "
                 f"{len(levels)} level(s) (cf {cfs}), adjoint {len(self.adjoint_levels)} "
                 "level(s)"]
        head = ["rank", "layers"] + [f"level {lv.index} pts" for lv in levels] + ["ghosts"]
        rows = []
        for q in range(part.n_ranks):
            ghosts = ", ".join(f"{k} (from {o})" for k, o in self.ghosts[q]) or "-"
            rows.append([str(q), _span(self.layers(q))]
                        + [_span(part.level_range(lv.index, q)) for lv in levels]
                        + [ghosts])
        widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
        for r in [head] + rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        for lv in levels:
            sends = self.boundary_sends(lv.index)
            if sends:
                text = ", ".join(f"{a}->{b} (u at point {j})" for a, b, j in sends)
                lines.append(f"  level {lv.index} forward sends: {text}")
        if part.n_ranks > 1:
            lines.append("  adjoint: the same sends mirrored (right to left), in reverse "
                         "time")
        return "\n".join(lines)


@dataclass(frozen=True)
class Plan:
    """The whole network over `ranks` ranks: plain layers with their owner, and each
    segment's `SegmentPlan`.

    items: per layer of the net, in order, (position, name, owner rank) for a plain
        layer (the ones before the first segment on rank 0, the others on the last
        rank) or the segment's `SegmentPlan`.
    """

    ranks: int
    items: tuple[Union[tuple[int, str, int], SegmentPlan], ...]

    @classmethod
    def build(cls, net: ODENet, ranks: int, options: Optional[MGRITOptions] = None,
              backward_options: Optional[MGRITOptions] = None,
              coarsening: str = "injection") -> Plan:
        """The plan `LayerParallel(net, <ranks>, options, backward_options,
        coarsening=...)` runs."""
        fwd = MGRITOptions(max_levels=1) if options is None else options
        bwd = fwd if backward_options is None else backward_options
        first = min(k for k, _ in net.segments)
        items: list[Union[tuple[int, str, int], SegmentPlan]] = []
        s = 0
        for k, layer in enumerate(net.layers):
            if isinstance(layer, Segment):
                n = layer.n_steps
                part = Partition.build(n, ranks, fwd)
                adj = Partition(n, ranks, tuple(reversed_bounds(list(part.bounds))),
                                tuple(build_levels(n, bwd)))
                ghosts = []
                for q in range(ranks):
                    need = needed_layers(part, adj, q, coarsening)
                    ghosts.append(tuple((g, part.owner(g + 1)) for g in sorted(need)
                                        if g not in part.steps(q)))
                items.append(SegmentPlan(s, k, layer.t_start, layer.t_final, part, adj,
                                         tuple(ghosts)))
                s += 1
            else:
                items.append((k, _name(layer), 0 if k < first else ranks - 1))
        return cls(ranks, tuple(items))

    @property
    def segments(self) -> list[SegmentPlan]:
        return [i for i in self.items if isinstance(i, SegmentPlan)]

    @cached_property
    def kinds(self) -> tuple[tuple[str, int], ...]:
        """Per layer of the net: ("segment", segment index) or ("plain", owner rank)
        (what a pass walks through; computed once)."""
        return tuple(("segment", i.index) if isinstance(i, SegmentPlan) else
                     ("plain", i[2]) for i in self.items)

    def placements(self) -> list[tuple[int, Optional[int], int]]:
        """(layer position, block index or None, owner rank) of every plain layer and
        every segment block of the net, in the net's order."""
        out: list[tuple[int, Optional[int], int]] = []
        for item in self.items:
            if isinstance(item, SegmentPlan):
                out.extend((item.position, n, q) for q in range(self.ranks)
                           for n in item.layers(q))
            else:
                out.append((item[0], None, item[2]))
        return out

    def __str__(self) -> str:
        lines = [f"LayerParallel plan over {self.ranks} rank(s)"]
        for item in self.items:
            if isinstance(item, SegmentPlan):
                lines.append(str(item))
            else:
                k, name, owner = item
                lines.append(f"net.layers[{k}] {name}: plain layer, on rank {owner}")
        lines.append(f"output: broadcast from rank {self.ranks - 1} to every rank")
        return "\n".join(lines)


def needed_layers(forward: Partition, adjoint: Partition, rank: int,
                  coarsening: str) -> set[int]:
    """Layers whose blocks `rank`'s coarse steps use, owned or not.

    With injection a coarse step evaluates the block at the start of its interval;
    with "average" coarsening, every block the interval spans.  The forward coarse
    step into level point j covers fine steps (j-1)*stride .. j*stride-1; the
    adjoint's into reverse point m covers forward steps N-m*stride .. N-(m-1)*stride-1,
    on engine rank P-1-rank of the reverse-time partition.
    """
    need: set[int] = set()
    n, size = forward.n_steps, forward.n_ranks
    for lv in forward.levels[1:]:
        for j in forward.level_range(lv.index, rank):
            if j >= 1:
                a, b = (j - 1) * lv.stride, j * lv.stride
                need.update([a] if coarsening == "injection" else range(a, b))
    for lv in adjoint.levels[1:]:
        for m in adjoint.level_range(lv.index, size - 1 - rank):
            if m >= 1:
                a, b = n - m * lv.stride, n - (m - 1) * lv.stride
                need.update([a] if coarsening == "injection" else range(a, b))
    return need


def _name(layer: nn.Module) -> str:
    text = repr(layer)
    return text if "\n" not in text and len(text) <= 60 else type(layer).__name__
