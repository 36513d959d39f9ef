"""MPI worker: bad input to `solve()`, one case after the other in one job.

Usage: mpiexec -n P python -m mpi4py tests/workers/solve_errors.py [CASE ...]
(no CASE: all of them, in the order of CASES).

For each case every rank catches whatever the case raises at top level and prints
one line ``RANK <r> <case> <ExceptionType>: <message>`` (``RANK <r> <case> OK ...``
when nothing was raised), then goes on with the next case: a failed solve must leave
the communicator usable.  The last case, ``recovers``, is a good solve checked
against sequential stepping.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from problems import Dahlquist, TanhResNet, rel_err  # noqa: E402
from tolerances import F64  # noqa: E402

from layerpar.mgrit import MGRITOptions, solve  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
N = 16
OPTS = MGRITOptions(max_levels=3, cfactor=2, tol=1e-12, max_iter=20)
DAHL = Dahlquist("backward")


def run(step=DAHL.step, u0=None, n_steps=N, t_final=1.0, options=OPTS, **kw):
    u0 = DAHL.u0() if u0 is None else u0
    return solve(step, u0, n_steps, t_final, options, comm=comm, **kw)


def case_invalid_option():
    run(options=MGRITOptions(cfactor=1))


def case_n_steps_zero():
    run(n_steps=0)


def case_fewer_steps_than_ranks():
    run(n_steps=size - 1)


def case_bad_t_final_on_one_rank():
    run(t_final=-1.0 if rank == 1 else 1.0)


def case_wrong_shape():
    run(step=lambda u, ts, te, lvl: torch.cat([u, u]))


def case_wrong_dtype():
    run(step=lambda u, ts, te, lvl: DAHL.step(u, ts, te, lvl).float())


def case_wrong_shape_late():
    # a good step except on the last interval of the fine grid, on the last rank only
    def step(u, ts, te, lvl):
        out = DAHL.step(u, ts, te, lvl)
        return out.reshape(1, 1) if (lvl == 0 and te == 1.0) else out
    run(step=step)


def case_nan_mid_solve():
    # the fine step into t = 0.75 (a C-point) is taken twice in iteration 1 (C-sweep,
    # residual): it turns NaN from its third call on, so r_1 is finite and r_2 is NaN
    calls = [0]

    def step(u, ts, te, lvl):
        out = DAHL.step(u, ts, te, lvl)
        if lvl == 0 and te == 0.75:
            calls[0] += 1
            if calls[0] >= 3:
                return out * float("nan")
        return out
    run(step=step)


def case_step_raises_on_one_rank():
    def step(u, ts, te, lvl):
        if rank == 1 and lvl == 1:
            raise RuntimeError("injected failure on rank 1")
        return DAHL.step(u, ts, te, lvl)
    run(step=step)


def case_init_raises_on_rank0():
    def init(t):
        if rank == 0:
            raise KeyError("no initial guess on rank 0")
        return torch.zeros(1, dtype=torch.float64)
    run(init=init)


def case_options_differ():
    run(options=OPTS if rank == 0 else OPTS.replace(max_iter=7))


def case_u0_shape_differs():
    run(u0=torch.ones(1 + (rank == size - 1), dtype=torch.float64))


def case_u0_dtype_differs():
    run(u0=torch.ones(1, dtype=torch.float32 if rank == 1 else torch.float64))


def case_recovers():
    net = TanhResNet(N, 1.0, batched=True)
    res = run(step=net.step, u0=net.u0(), step_batch=net.step_batch)
    ref = net.sequential(net.u0(), N, 1.0)
    worst = max(rel_err(s, ref[i]) for i, s in res.states.items())
    final = rel_err(res.final_state, ref[-1])
    if not (res.converged and worst < F64.converged and final < F64.converged):
        raise RuntimeError(f"bad result after the failures: converged={res.converged}, "
                           f"state error {worst:.2e}, final error {final:.2e}")
    return f"iterations={res.iterations}"


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    for name in names:
        try:
            info = CASES[name]()
            line = f"OK {info or ''}"
        except BaseException as exc:  # report everything, on every rank
            line = f"{type(exc).__name__}: {exc}"
        line = line.replace("\n", " ")
        # one write per line: with PYTHONUNBUFFERED, print() writes text and newline
        # separately and mpiexec may interleave other ranks' output between them
        sys.stdout.write(f"RANK {rank} {name} {line}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
