"""XBraid itself as a second engine (`engine="xbraid"`), against the native engine.

- Engine agreement: every case of `xbraid_cases.CASES` (levels 1-4, cfactor 2-8, F and
  FCF, F-cycles, skip on and off, tol / rtol / fixed max_iter, final FC relaxation,
  C-weights) in-process at one rank, and a subset at 2, 3 and 4 ranks with N = 37:
  same iteration counts and residual histories within |dr| <= 1e-8 r + 1e-14.
- Training: LayerParallel Peaks gradients (float64, per-step path) agree to 1e-12 at
  1, 2 and 3 ranks, and so does validation accuracy after a few SGD steps.
- Errors: a callback raising on one rank under XBraid stops every rank with the error,
  and so does a rank failing before its XBraid solve while the others enter theirs;
  what XBraid cannot do is refused by name; without a build, one error says how.

The tests that run XBraid are skipped when the engine was not built (XBRAID_DIR).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mpi_util import WORKERS, describe, rank_lines, run_mpi
from problems import T_FINAL, Case, make_problem
from tolerances import F64
from xbraid_cases import CASES, MPI_CASES

from layerpar import LayerParallel, MGRITOptions, solve
from layerpar.apps.nets import problem_net
from layerpar.mgrit.session import EngineSession
from layerpar.mgrit.transport import SerialTransport
from layerpar.mgrit.xbraid import (
    layer_partition_refusal,
    require_xbraid,
    xbraid_available,
    xbraid_bounds,
)

needs_xbraid = pytest.mark.skipif(
    not xbraid_available(),
    reason="the XBraid engine was not built (XBRAID_DIR=/path/to/xbraid make build)")


def _agree(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 1e-8 * abs(b) + F64.step
                                         for a, b in zip(got, want))


def _solve(case: Case, engine: str):
    prob = make_problem(case.problem, case.n_steps)
    return solve(prob.step, prob.u0(), case.n_steps, T_FINAL[case.problem],
                 MGRITOptions(**case.options), engine=engine)


@needs_xbraid
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_engines_agree_in_process(case: Case) -> None:
    nat, xb = _solve(case, "native"), _solve(case, "xbraid")
    assert (xb.iterations, xb.n_levels, xb.converged) == \
        (nat.iterations, nat.n_levels, nat.converged)
    assert _agree(xb.residual_history, nat.residual_history), \
        (xb.residual_history, nat.residual_history)
    scale = float(nat.final_state.abs().max())
    assert float((xb.final_state - nat.final_state).abs().max()) <= F64.roundoff * scale
    # every fine point comes back (one rank owns them all)
    assert sorted(xb.states) == list(range(case.n_steps + 1))
    if case.options.get("max_levels") == 1:  # sequential stepping: bit for bit
        assert torch.equal(xb.final_state, nat.final_state)
    if not case.options.get("fmg"):  # XBraid's F-cycle visits coarse levels differently
        assert xb.step_counts == nat.step_counts


@needs_xbraid
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_engines_agree_under_mpi_and_errors_stop_every_rank(nprocs: int,
                                                           tmp_path: Path) -> None:
    proc = run_mpi(WORKERS / "xbraid_engines.py", nprocs, tmp_path, timeout=120)
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(nprocs)), describe(proc)
    last = nprocs - 1
    for r in range(nprocs):
        err = next(x for x in lines[r] if x.startswith("error"))
        if r == last:
            assert err == "error RuntimeError: step failed on purpose", describe(proc)
        else:
            assert err == (f"error RemoteError: rank {last} failed: RuntimeError: step "
                           "failed on purpose"), describe(proc)
        assert any(x.startswith("done") for x in lines[r]), describe(proc)
    for r in range(nprocs):
        data = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert data["size"] == nprocs
        for case, rec in zip(MPI_CASES, data["records"]):
            (ni, nh, nf), (xi, xh, xf) = rec["native"], rec["xbraid"]
            assert ni == xi, case.label
            assert _agree(xh, nh), (case.label, xh, nh)
            assert float((xf - nf).abs().max()) <= F64.roundoff * float(nf.abs().max()), case.label


@needs_xbraid
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_layer_parallel_training_agrees(nprocs: int) -> None:
    proc = run_mpi(WORKERS / "xbraid_training.py", nprocs, timeout=120)
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(nprocs)), describe(proc)
    for r in range(nprocs):
        _, grad, _, acc_n, acc_x = lines[r][0].split()
        assert float(grad) <= F64.roundoff, describe(proc)
        assert acc_n == acc_x, describe(proc)
        # rank 0 failed before the segment's solve: every rank stops with its error
        want = "RuntimeError: opening layer failed on purpose"
        assert lines[r][1] == ("early " + want if r == 0 else
                               f"early RemoteError: rank 0 failed: {want}"), describe(proc)


@needs_xbraid
def test_in_process_callback_error_is_raised() -> None:
    def step(u, ts, te, level):
        if level == 1:
            raise ZeroDivisionError("no coarse steps today")
        return u * 0.9

    with pytest.raises(ZeroDivisionError, match="no coarse steps today"):
        solve(step, torch.ones(2, dtype=torch.float64), 16, 1.0,
              MGRITOptions(max_levels=2, tol=1e-12), engine="xbraid")
    # the next solve is unaffected
    res = solve(lambda u, ts, te, lvl: u * 0.9, torch.ones(2, dtype=torch.float64), 16, 1.0,
                MGRITOptions(max_levels=2, tol=1e-12), engine="xbraid")
    assert res.converged


@needs_xbraid
def test_refused_by_name() -> None:
    u0 = torch.ones(2, dtype=torch.float64)

    def step(u, ts, te, level):
        return u * 0.9

    with pytest.raises(ValueError, match="step_batch"):
        solve(step, u0, 8, 1.0, engine="xbraid",
              step_batch=lambda us, ts, te, lvl: [u * 0.9 for u in us])
    with pytest.raises(ValueError, match="`options.tol`.*`options.rtol`"):
        solve(step, u0, 8, 1.0, MGRITOptions(tol=1e-9, rtol=1e-6), engine="xbraid")
    with pytest.raises(ValueError, match="`engine`"):
        solve(step, u0, 8, 1.0, engine="braid")
    with pytest.raises(TypeError, match="`engine`"):
        solve(step, u0, 8, 1.0, engine=None)
    with pytest.raises(ValueError, match="defer residual norms"):
        app = SimpleNamespace(step=step, init=lambda t, i: u0, sum=None, norm_sq=None)
        EngineSession(8, 0.0, 1.0, SerialTransport(), xbraid_bounds(8, 1), app,
                      MGRITOptions(tol=0.0), defer_norms=True, engine="xbraid")

    def net():
        torch.manual_seed(0)
        return problem_net("peaks", 4)

    with pytest.raises(ValueError, match="`batched`"):
        LayerParallel(net(), batched=True, engine="xbraid")
    with pytest.raises(ValueError, match="`accuracy`"):
        LayerParallel(net(), engine="xbraid", accuracy=True)
    from layerpar.parallel.capture import capture_step

    model = LayerParallel(net(), engine="xbraid")
    with pytest.raises(ValueError, match="capture_step needs engine='native'"):
        capture_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     torch.nn.functional.cross_entropy, torch.zeros(2, 2),
                     torch.zeros(2, dtype=torch.long))


def test_partitions() -> None:
    # XBraid's block partition of the N+1 points; the first ranks take one more
    assert xbraid_bounds(10, 3) == [0, 4, 8, 11]
    assert xbraid_bounds(8, 2) == [0, 5, 9]
    # LayerParallel runs XBraid where its forward and adjoint partitions give every
    # rank the same layers: the ranks divide the layers
    assert layer_partition_refusal(32, 2) is None
    assert layer_partition_refusal(36, 3) is None
    assert "divisible" in str(layer_partition_refusal(32, 3))


@needs_xbraid
def test_torch_distributed_group_is_refused() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="mpi4py communicator"):
            solve(lambda u, ts, te, lvl: u, torch.ones(2), 4, 1.0, comm=dist.group.WORLD,
                  engine="xbraid")
    finally:
        dist.destroy_process_group()


def test_without_a_build_one_error_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "layerpar._native._xbraid", None)
    assert not xbraid_available()
    with pytest.raises(ImportError, match="XBRAID_DIR=/path/to/xbraid make build"):
        require_xbraid()
    with pytest.raises(ImportError, match="XBRAID_DIR"):
        solve(lambda u, ts, te, lvl: u, torch.ones(2), 4, 1.0, engine="xbraid")
