"""MPI worker: both engines on the cases of `test_xbraid.MPI_CASES`, and a callback
that raises on one rank under XBraid.

Usage: mpiexec -n P python -m mpi4py tests/workers/xbraid_engines.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.pt with, per case and engine, the iterations, the
residual history and the final state, and prints ``RANK <r> error <Type>: <message>``
for the failing solve (the last rank's step raises at the fourth call on level 1),
then ``RANK <r> done``: every rank must get past the failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from problems import T_FINAL, Dahlquist, make_problem  # noqa: E402
from xbraid_cases import MPI_CASES  # noqa: E402

from layerpar.mgrit import MGRITOptions, solve  # noqa: E402


def main() -> None:
    out_dir = Path(sys.argv[1])
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    records = []
    for case in MPI_CASES:
        prob = make_problem(case.problem, case.n_steps)
        rec = {}
        for engine in ("native", "xbraid"):
            res = solve(prob.step, prob.u0(), case.n_steps, T_FINAL[case.problem],
                        MGRITOptions(**case.options), comm=comm, engine=engine)
            rec[engine] = (res.iterations, list(res.residual_history),
                           res.final_state.clone())
        records.append(rec)
    torch.save(dict(size=size, records=records), out_dir / f"rank{rank}.pt")

    dahl = Dahlquist("backward")
    calls = [0]

    def failing(u, ts, te, level):
        if rank == size - 1 and level == 1:
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("step failed on purpose")
        return dahl.step(u, ts, te, level)

    try:
        solve(failing, dahl.u0(), 24, 1.0, MGRITOptions(max_levels=3, cfactor=2, tol=1e-14,
                                                        max_iter=30),
              comm=comm, engine="xbraid")
        sys.stdout.write(f"RANK {rank} error none\n")
    except Exception as exc:  # noqa: BLE001 - reported per rank
        sys.stdout.write(f"RANK {rank} error {type(exc).__name__}: {exc}\n")
    # the communicator still works: a good solve afterwards
    res = solve(dahl.step, dahl.u0(), 24, 1.0, MGRITOptions(max_levels=2, tol=1e-12),
                comm=comm, engine="xbraid")
    sys.stdout.write(f"RANK {rank} done {res.iterations}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
