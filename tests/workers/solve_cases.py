"""MPI worker: solve every case of `problems.PARALLEL_CASES` on COMM_WORLD.

Usage: mpiexec -n P python -m mpi4py tests/workers/solve_cases.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.pt: per case its result (iterations, residual
history, counters, final state), its own states, and its own check of those states
against sequential stepping.  The test compares all of it with the serial solve.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from problems import PARALLEL_CASES, max_rel_err, rel_err, run_case  # noqa: E402


def main() -> None:
    out_dir = Path(sys.argv[1])
    comm = MPI.COMM_WORLD
    records = []
    for case in PARALLEL_CASES:
        result, ref = run_case(case, comm)
        records.append(dict(
            label=case.label,
            iterations=result.iterations,
            converged=result.converged,
            history=list(result.residual_history),
            n_levels=result.n_levels,
            step_counts=list(result.step_counts),
            batch_counts=list(result.batch_counts),
            final_state=result.final_state.clone(),
            states={i: s.clone() for i, s in result.states.items()},
            states_err=max_rel_err(result.states, ref),
            final_err=rel_err(result.final_state, ref[-1]),
        ))
    torch.save(dict(size=comm.size, rank=comm.rank, records=records),
               out_dir / f"rank{comm.rank}.pt")
    sys.stdout.write(f"RANK {comm.rank} done {len(records)} cases\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
