"""`solve()` at 1, 2, 3 and 4 ranks against the serial solve and sequential stepping.

One mpiexec job per rank count runs every case of `problems.PARALLEL_CASES` (N = 37
and 64, so partitions that do not divide evenly, and coarse levels with ranks that
own no points) with `comm=MPI.COMM_WORLD`; each rank saves its results and checks its
own states against sequential stepping.  Here they are compared with the serial
(`comm=None`) solve of the same case.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from mpi_util import WORKERS, describe, rank_lines, run_mpi
from problems import PARALLEL_CASES, Case, run_case
from tolerances import F64

from layerpar.mgrit import MGRITResult, Partition

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def serial() -> dict[str, MGRITResult]:
    return {c.label: run_case(c)[0] for c in PARALLEL_CASES}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(torch.linalg.vector_norm(b))
    return float(torch.linalg.vector_norm(a - b)) / (nb if nb > 0 else 1.0)


def _check_history(case: Case, got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), case.label
    if case.problem == "tanh-batched":
        # batches group differently per partition: states differ by round-off, which is
        # all that is left of residuals near convergence; compare on the history's scale
        scale = max(want, default=0.0)
        assert all(abs(a - b) <= F64.roundoff * scale for a, b in zip(got, want)), (got, want)
    else:
        # only the norm's reduction order differs
        assert all(abs(a - b) <= F64.roundoff * abs(b) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_parallel_equals_serial(nprocs: int, tmp_path: Path,
                                serial: dict[str, MGRITResult]) -> None:
    proc = run_mpi(WORKERS / "solve_cases.py", nprocs, tmp_path, timeout=180)
    assert proc.returncode == 0, describe(proc)
    assert sorted(rank_lines(proc.stdout)) == list(range(nprocs)), describe(proc)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
                for r in range(nprocs)]
    assert [d["size"] for d in per_rank] == [nprocs] * nprocs
    records = {c.label: [d["records"][k] for d in per_rank]
               for k, c in enumerate(PARALLEL_CASES)}
    for case in PARALLEL_CASES:
        ser = serial[case.label]
        part = Partition.build(case.n_steps, nprocs)
        work = [0] * ser.n_levels
        for rank, rec in enumerate(records[case.label]):
            where = f"{case.label} rank {rank}/{nprocs}"
            assert rec["label"] == case.label
            assert rec["iterations"] == ser.iterations, where
            assert rec["converged"] == ser.converged, where
            assert rec["n_levels"] == ser.n_levels, where
            _check_history(case, rec["history"], ser.residual_history)
            assert _rel(rec["final_state"], ser.final_state) <= F64.roundoff, where
            # each rank holds exactly its own points, close to the serial solve's ...
            assert sorted(rec["states"]) == list(part.points(rank)), where
            for i, s in rec["states"].items():
                assert _rel(s, ser.states[i]) <= F64.roundoff, (where, i)
            # ... and checked them against sequential stepping itself
            if case.options.get("max_levels") == 1:
                assert rec["states_err"] == 0.0 and rec["final_err"] == 0.0, where
            elif ser.converged:
                assert rec["states_err"] <= F64.converged, where
                assert rec["final_err"] <= F64.converged, where
            for lvl, n in enumerate(rec["step_counts"]):
                work[lvl] += n
            if case.problem == "tanh-batched" and ser.n_levels > 1:
                assert sum(rec["batch_counts"]) < sum(rec["step_counts"]), where
            elif case.problem != "tanh-batched":
                # one callback per step, except the coarsest level's sequential stretch
                # (one step_seq call per coarsest solve)
                assert rec["batch_counts"][:-1] == rec["step_counts"][:-1], where
                assert rec["batch_counts"][-1] <= rec["step_counts"][-1], where
        # no step is done twice: the ranks share the serial solve's work exactly
        assert work == ser.step_counts, (case.label, work, ser.step_counts)
    # the batched step gives the single step's results with fewer callbacks
    for case in PARALLEL_CASES:
        if case.problem != "tanh-batched":
            continue
        single = records[Case("tanh", case.n_steps, case.options).label]
        for rank, (b, s) in enumerate(zip(records[case.label], single)):
            assert b["iterations"] == s["iterations"], (case.label, rank)
            assert _rel(b["final_state"], s["final_state"]) <= F64.roundoff, (case.label, rank)
            for i in b["states"]:
                assert _rel(b["states"][i], s["states"][i]) <= F64.roundoff, (case.label, rank, i)


def test_run_mpi_kills_a_hanging_job() -> None:
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 5 s") as info:
        run_mpi(WORKERS / "hang.py", 2, timeout=5)
    assert time.monotonic() - t0 < 30
    lines = rank_lines(str(info.value))
    assert sorted(lines) == [0, 1], str(info.value)
    pids = [int(texts[0].split()[1]) for texts in lines.values()]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a rank survived the timeout"


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
