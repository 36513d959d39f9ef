"""The time grid, its level hierarchy and its partition over ranks, as plain data.

Mirrors what the C engine computes (tests check that they agree), so a user can
print and check a configuration without MPI.
"""
from __future__ import annotations

from dataclasses import dataclass

from .options import MGRITOptions


def grid_time(i: int, n_steps: int, t_start: float, t_final: float) -> float:
    """t_i = t_start + (i/N)(t_final - t_start), in the engine's order of operations."""
    return t_start + (i / n_steps) * (t_final - t_start)


@dataclass(frozen=True)
class Level:
    """One level: points 0..n_intervals, level point j is fine point j*stride."""

    index: int
    n_intervals: int
    stride: int
    cfactor: int  # to the next level; 0 on the coarsest


def build_levels(n_steps: int, options: MGRITOptions) -> list[Level]:
    """Levels are added while the coarse grid keeps >= min_coarse intervals and
    fewer than max_levels exist."""
    levels: list[Level] = []
    n, stride, lvl = n_steps, 1, 0
    while True:
        cf = options.cfactor_at(lvl)
        if lvl + 1 < options.max_levels and n // cf >= options.min_coarse:
            levels.append(Level(lvl, n, stride, cf))
            n, stride, lvl = n // cf, stride * cf, lvl + 1
        else:
            levels.append(Level(lvl, n, stride, 0))
            return levels


def block_bounds(n_steps: int, n_ranks: int) -> list[int]:
    """Partition of fine points 0..N: rank q owns bounds[q]..bounds[q+1]-1.

    The N steps (points 1..N) are split into n_ranks near-equal contiguous blocks and
    rank 0 also owns point 0 (the initial condition), so every rank does the same
    number of steps (+-1) — better balance than splitting the N+1 points.
    """
    if n_ranks > n_steps:
        raise ValueError(f"more ranks ({n_ranks}) than steps ({n_steps}): every rank "
                         "needs at least one step")
    return [0] + [1 + (q * n_steps) // n_ranks for q in range(1, n_ranks)] + [n_steps + 1]


def reversed_bounds(bounds: list[int]) -> list[int]:
    """Partition of the adjoint (reverse-time) grid matching a forward partition.

    Reverse point m holds lambda_{N-m}; the reverse step into m uses forward step
    N-m+1, so engine rank q of the reverse grid is forward rank P-1-q and owns the
    reverse points whose steps use its own layers.
    """
    p = len(bounds) - 1
    n = bounds[-1] - 1
    return [0] + [n + 2 - bounds[p - q] for q in range(1, p)] + [n + 1]


@dataclass(frozen=True)
class Partition:
    """Fine points 0..n_steps over n_ranks ranks, with the level hierarchy."""

    n_steps: int
    n_ranks: int
    bounds: tuple[int, ...]
    levels: tuple[Level, ...]

    @classmethod
    def build(cls, n_steps: int, n_ranks: int, options: MGRITOptions | None = None
              ) -> Partition:
        options = options or MGRITOptions()
        return cls(n_steps, n_ranks, tuple(block_bounds(n_steps, n_ranks)),
                   tuple(build_levels(n_steps, options)))

    def points(self, rank: int) -> range:
        """Fine points owned by `rank`."""
        return range(self.bounds[rank], self.bounds[rank + 1])

    def steps(self, rank: int) -> range:
        """Indices n of the steps (layers) u_n -> u_{n+1} that `rank` computes."""
        pts = self.points(rank)
        return range(max(pts.start, 1) - 1, pts.stop - 1)

    def owner(self, i: int) -> int:
        """Rank owning fine point i."""
        for q in range(self.n_ranks):
            if self.bounds[q] <= i < self.bounds[q + 1]:
                return q
        raise IndexError(f"point {i} outside 0..{self.n_steps}")

    def level_range(self, level: int, rank: int) -> range:
        """Level indices of `level` owned by `rank` (possibly empty)."""
        lv = self.levels[level]
        lo = -(-self.bounds[rank] // lv.stride)
        hi = min((self.bounds[rank + 1] - 1) // lv.stride, lv.n_intervals)
        return range(lo, hi + 1)

    def __str__(self) -> str:
        head = f"Partition: {self.n_steps} steps, {self.n_ranks} ranks, {len(self.levels)} levels"
        rows = [head, "level  intervals  cf  " + "  ".join(f"rank{q:<3d}" for q in
                                                          range(self.n_ranks))]
        for lv in self.levels:
            cells = []
            for q in range(self.n_ranks):
                r = self.level_range(lv.index, q)
                cells.append(f"{r.start}-{r.stop - 1}" if len(r) else "-")
            rows.append(f"{lv.index:5d}  {lv.n_intervals:9d}  {lv.cfactor:2d}  "
                        + "  ".join(f"{c:<7s}" for c in cells))
        return "\n".join(rows)
