"""Parameters that several layers use train as in the serial net (`layerpar.parallel.
sharing`): one block module for every step (a time-invariant ODE) and the opening and
closing layers' weights tied, on every path, against the serial `ODENet` (float64,
converged): gradients, the whole net's gradient norm, the state and the optimizer
state after three SGD steps, and the ranks' copies of each parameter equal."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpi_util import WORKERS, run_mpi
from tolerances import F64

MGRIT = ["batched", "per-step", "average", "batched-average", "exact"]
SEVERAL = [*MGRIT, "replicated", "split", "auto-replicated", "auto-split"]


def _run(nprocs: int, net: str, paths: list[str]) -> None:
    proc = run_mpi(WORKERS / "lp_sharing.py", nprocs, net, *paths, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"RANK (\d+) (\S+) grad (\S+) state (\S+) copies (\S+)", proc.stdout)
    assert sorted((int(r), p) for r, p, *_ in lines) == \
        sorted((r, p) for r in range(nprocs) for p in paths), proc.stdout
    for rank, path, *errs in lines:
        grad, state, copies = map(float, errs)
        assert grad <= F64.converged and state <= F64.converged, (rank, path, errs)
        assert copies == 0.0, (rank, path, errs)  # the ranks' copies stay identical


@pytest.mark.mpi
@pytest.mark.parametrize("net", ["shared", "tied", "tied-plain"])
def test_one_rank(net: str) -> None:
    """At one rank too: a segment's layers share one block, or a tied weight serves
    two plain layers (apart, or in a row: one graph)."""
    _run(1, net, MGRIT)


@pytest.mark.mpi
def test_shared_block_two_ranks() -> None:
    """The shared block's layers lie on both ranks: each rank's uses summed, then over
    the ranks, on every path (auto's replicated serial and batch split too)."""
    _run(2, "shared", SEVERAL)


@pytest.mark.mpi
def test_tied_open_close_three_ranks() -> None:
    """Opening layer on rank 0, closing layer on rank 2, one weight: rank 1 holds none
    of it and still takes part in the reduction."""
    _run(3, "tied", SEVERAL)


@pytest.mark.mpi
@pytest.mark.parametrize("net", ["shared", "tied"])
def test_grid_replicas_compose(net: str) -> None:
    """2 data replicas x 2 layer ranks: the replicas' averaging and the shared
    parameters' sum over the layer ranks compose."""
    _run(4, net, ["grid-batched", "grid-per-step"])


@pytest.mark.mpi
def test_time_invariant_example_two_ranks() -> None:
    """`examples/03_time_invariant.py`: one block shared by 32 layers over 2 ranks
    trains, the ranks' copies of the block stay equal, and a residual that reads n/a is
    explained."""
    example = Path(__file__).resolve().parents[1] / "examples" / "03_time_invariant.py"
    proc = run_mpi(example, 2, "--epochs", "1", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation accuracy" in proc.stdout, proc.stdout
    assert "differ by at most 0.0e+00" in proc.stdout, proc.stdout
    # the adjoint's one iteration measures no residual: the example says why
    assert "adjoint not converged after 1 iterations (residual n/a)" in proc.stdout
    assert "(residual n/a: with skip" in proc.stdout, proc.stdout
