"""MPI worker: a propagator that turns non-finite in the last interval, at 1..3 levels.

Usage: mpiexec -n P python -m mpi4py tests/workers/solve_nonfinite.py

For each (value, max_levels) every rank prints one line
``RANK <r> <value>-<levels> <ExceptionType>: <message>`` (``OK converged=...`` when
nothing was raised).  Only the last fine interval (owned by the last rank) goes bad,
so with one level no residual is ever computed: the final state must be checked.
"""

from __future__ import annotations

import math
import sys

import torch
from mpi4py import MPI

from layerpar.mgrit import MGRITOptions, solve

comm = MPI.COMM_WORLD
N = 16


def make_step(value: float):
    def step(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
        out = u / (1.0 + (te - ts))
        return out * value if te == 1.0 else out
    return step


def main() -> None:
    for value in (math.nan, math.inf):
        for levels in (1, 2, 3):
            try:
                res = solve(make_step(value), torch.ones(2, dtype=torch.float64), N, 1.0,
                            MGRITOptions(max_levels=levels, cfactor=2), comm=comm)
                line = f"OK converged={res.converged} final={res.final_state.tolist()}"
            except BaseException as exc:  # report everything, on every rank
                line = f"{type(exc).__name__}: {exc}"
            line = line.replace("\n", " ")
            sys.stdout.write(f"RANK {comm.rank} {value}-{levels} {line}\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
