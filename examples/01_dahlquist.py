"""Dahlquist's test equation u' = λu, u(0) = 1, solved in parallel in time with MGRIT.

The first rung of the examples: a scalar ODE, one step function, `layerpar.solve`.
Backward Euler (default) steps u ← u / (1 − λ·dt); forward Euler u ← u·(1 + λ·dt).

Run it:

    python examples/01_dahlquist.py                    # MGRIT on one process
    python examples/01_dahlquist.py --serial           # plain sequential stepping
    mpiexec -n 4 python -m mpi4py examples/01_dahlquist.py       # MGRIT on 4 ranks
    mpiexec -n 4 python -m mpi4py examples/01_dahlquist.py --levels 2 --cfactor 8 --fmg

(`python -m mpi4py` makes an error on one rank abort the job instead of hanging it.)
Rank 0 prints the residual norm of every MGRIT iteration, numbered from 0 as the
iteration count at the end counts them (with `skip`, the default, iteration 0 does no
fine-level work and has no residual; nor has the one sweep of `--levels 1`), then the error against
sequential stepping (what the residual tolerance `--tol`, 1e-10 by default, leaves:
about 1e-12 to 1e-10 here; a smaller `--tol` takes it toward round-off) and
against the exact solution e^{λT} (the time discretisation's error, the same for
both).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from mpi4py import MPI

from layerpar import MGRITOptions, solve
from layerpar.mgrit import grid_time


def make_step(lam: float, scheme: str):
    """The propagator: one Euler step of u' = lam u from t_start to t_stop."""

    def step(u: torch.Tensor, t_start: float, t_stop: float, level: int) -> torch.Tensor:
        dt = t_stop - t_start
        return u / (1.0 - lam * dt) if scheme == "backward" else u * (1.0 + lam * dt)

    return step


def sequential(step, u0: torch.Tensor, n: int, t_final: float) -> list[torch.Tensor]:
    """u_0..u_N stepped one after the other on the same grid as MGRIT's."""
    states = [u0]
    for i in range(n):
        states.append(step(states[-1], grid_time(i, n, 0.0, t_final),
                           grid_time(i + 1, n, 0.0, t_final), 0))
    return states


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1024, help="time steps N (default 1024)")
    p.add_argument("--t-final", type=float, default=4.0, help="final time T (default 4)")
    p.add_argument("--lam", type=float, default=-1.0, help="λ (default -1)")
    p.add_argument("--scheme", choices=["backward", "forward"], default="backward")
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
    step = make_step(args.lam, args.scheme)
    u0 = torch.ones(1, dtype=torch.float64)
    exact = math.exp(args.lam * args.t_final)

    if args.serial:
        t0 = time.perf_counter()
        u_n = sequential(step, u0, args.steps, args.t_final)[-1]
        elapsed = time.perf_counter() - t0
        if rank == 0:
            print(f"sequential {args.scheme} Euler, N={args.steps}: u(T) = {u_n.item():.12e}, "
                  f"|u(T) - e^(λT)| = {abs(u_n.item() - exact):.3e}, {elapsed:.3f} s")
        return

    options = MGRITOptions(max_levels=args.levels, cfactor=args.cfactor, nrelax=args.nrelax,
                           tol=args.tol, max_iter=args.max_iter, fmg=args.fmg)
    comm.Barrier()
    t0 = time.perf_counter()
    result = solve(step, u0, args.steps, args.t_final, options, comm=comm)
    elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    ref = sequential(step, u0, args.steps, args.t_final)
    local = max(abs(s.item() - ref[i].item()) for i, s in result.states.items())
    worst = comm.allreduce(local, op=MPI.MAX)
    work = [comm.allreduce(n) for n in result.step_counts]  # summed over ranks
    if rank == 0:
        print(f"MGRIT on {comm.Get_size()} rank(s): N={args.steps}, {result.n_levels} levels, "
              f"cfactor {args.cfactor}, nrelax {args.nrelax}, {'F' if args.fmg else 'V'}-cycles")
        # every iteration by its index, as result.message counts them
        why = "one level: sequential stepping" if result.n_levels == 1 else \
            "skip: no fine-level work"
        for k, r in enumerate(result.residual_by_iteration):
            print(f"  iteration {k:2d}  " + (f"no residual ({why})" if r is None
                                             else f"residual {r:.3e}"))
        print(result.message)
        print(f"u(T) = {result.final_state.item():.12e}")
        print(f"max |u_i - sequential u_i| over all i: {worst:.3e}")
        print(f"|u(T) - e^(λT)| = {abs(result.final_state.item() - exact):.3e} "
              "(time discretisation)")
        print(f"time {elapsed:.3f} s, steps per level (all ranks) {work}")


if __name__ == "__main__":
    main()
