"""The 1-D heat equation u_t = u_xx solved in parallel in time with MGRIT.

The second rung of the examples: a vector state (nx grid values on (0, 1), u = 0 at both
ends), backward Euler in time, u ← (I − dt·A)⁻¹ u with A the second-difference matrix.
Coarse levels take the same step with their longer dt.

Run it:

    python examples/02_heat.py                         # MGRIT on one process
    python examples/02_heat.py --serial                # plain sequential stepping
    mpiexec -n 4 python -m mpi4py examples/02_heat.py           # MGRIT on 4 ranks
    mpiexec -n 4 python -m mpi4py examples/02_heat.py --nrelax 0 --levels 2 --cfactor 16

(`python -m mpi4py` makes an error on one rank abort the job instead of hanging it.)
Rank 0 prints the residual norm of every MGRIT iteration, numbered from 0 as the
iteration count at the end counts them (with `skip`, the default, iteration 0 does no
fine-level work and has no residual; nor has the one sweep of `--levels 1`), then the error against
sequential stepping (what the residual tolerance `--tol`, 1e-10 by default, leaves:
about 1e-12 to 1e-10 here; a smaller `--tol` takes it toward round-off) and
against the exact solution e^{-π²t} sin(πx) + ½ e^{-9π²t} sin(3πx) (the
discretisation's error).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from mpi4py import MPI

from layerpar import MGRITOptions, solve
from layerpar.mgrit import grid_time


class Heat:
    """Backward Euler for u_t = u_xx with `nx` interior points; (I - dt A)^-1 cached per dt."""

    def __init__(self, nx: int) -> None:
        dx = 1.0 / (nx + 1)
        self.nx = nx
        self.x = torch.linspace(dx, 1.0 - dx, nx, dtype=torch.float64)
        a = (torch.diag(torch.full((nx,), -2.0, dtype=torch.float64))
             + torch.diag(torch.ones(nx - 1, dtype=torch.float64), 1)
             + torch.diag(torch.ones(nx - 1, dtype=torch.float64), -1))
        self.a = a / dx**2
        self._inverse: dict[float, torch.Tensor] = {}

    def step(self, u: torch.Tensor, t_start: float, t_stop: float, level: int) -> torch.Tensor:
        dt = t_stop - t_start
        m = self._inverse.get(dt)
        if m is None:  # one matrix per step size: the same interval always gives the same bits
            m = torch.linalg.inv(torch.eye(self.nx, dtype=torch.float64) - dt * self.a)
            self._inverse[dt] = m
        return torch.mv(m, u)

    def exact(self, t: float) -> torch.Tensor:
        x = self.x
        return (math.exp(-math.pi**2 * t) * torch.sin(math.pi * x)
                + 0.5 * math.exp(-9 * math.pi**2 * t) * torch.sin(3 * math.pi * x))


def sequential(step, u0: torch.Tensor, n: int, t_final: float) -> list[torch.Tensor]:
    """u_0..u_N stepped one after the other on the same grid as MGRIT's."""
    states = [u0]
    for i in range(n):
        states.append(step(states[-1], grid_time(i, n, 0.0, t_final),
                           grid_time(i + 1, n, 0.0, t_final), 0))
    return states


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1024, help="time steps N (default 1024)")
    p.add_argument("--t-final", type=float, default=0.5, help="final time T (default 0.5)")
    p.add_argument("--nx", type=int, default=31, help="interior grid points (default 31)")
    p.add_argument("--levels", type=int, default=30, help="max MGRIT levels (1: sequential)")
    p.add_argument("--cfactor", type=int, default=2, help="coarsening factor (default 2)")
    p.add_argument("--nrelax", type=int, default=1, help="0: F-, 1: FCF-relaxation, ...")
    p.add_argument("--tol", type=float, default=1e-10, help="absolute residual tolerance")
    p.add_argument("--max-iter", type=int, default=50, help="iterations at most")
    p.add_argument("--fmg", action="store_true", help="F-cycles instead of V-cycles")
    p.add_argument("--serial", action="store_true",
                   help="plain sequential stepping instead of MGRIT, for comparison")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    heat = Heat(args.nx)
    u0 = heat.exact(0.0)
    exact = heat.exact(args.t_final)

    if args.serial:
        t0 = time.perf_counter()
        u_n = sequential(heat.step, u0, args.steps, args.t_final)[-1]
        elapsed = time.perf_counter() - t0
        if rank == 0:
            print(f"sequential backward Euler, N={args.steps}, nx={args.nx}: "
                  f"|u(T) - exact| / |exact| = {rel(u_n, exact):.3e}, {elapsed:.3f} s")
        return

    options = MGRITOptions(max_levels=args.levels, cfactor=args.cfactor, nrelax=args.nrelax,
                           tol=args.tol, max_iter=args.max_iter, fmg=args.fmg)
    comm.Barrier()
    t0 = time.perf_counter()
    result = solve(heat.step, u0, args.steps, args.t_final, options, comm=comm)
    elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    ref = sequential(heat.step, u0, args.steps, args.t_final)
    local = max(rel(s, ref[i]) for i, s in result.states.items() if i > 0)
    worst = comm.allreduce(local, op=MPI.MAX)
    work = [comm.allreduce(n) for n in result.step_counts]  # summed over ranks
    if rank == 0:
        print(f"MGRIT on {comm.Get_size()} rank(s): N={args.steps}, nx={args.nx}, "
              f"{result.n_levels} levels, cfactor {args.cfactor}, nrelax {args.nrelax}, "
              f"{'F' if args.fmg else 'V'}-cycles")
        # every iteration by its index, as result.message counts them
        why = "one level: sequential stepping" if result.n_levels == 1 else \
            "skip: no fine-level work"
        for k, r in enumerate(result.residual_by_iteration):
            print(f"  iteration {k:2d}  " + (f"no residual ({why})" if r is None
                                             else f"residual {r:.3e}"))
        print(result.message)
        print(f"max |u_i - sequential u_i| / |sequential u_i| over all i: {worst:.3e}")
        print(f"|u(T) - exact| / |exact| = {rel(result.final_state, exact):.3e} "
              "(discretisation)")
        print(f"time {elapsed:.3f} s, steps per level (all ranks) {work}")


if __name__ == "__main__":
    main()
