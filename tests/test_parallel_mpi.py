"""LayerParallel at 1, 2, 3 and 4 ranks against the serial oracle, and its bad-input
cases, each in an mpiexec job under a timeout that kills the process group."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mpi_util import run_mpi
from tolerances import F32, F64

WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_exact_mode_matches_serial_oracle(nprocs: int, tmp_path: Path) -> None:
    out = tmp_path / "lp.json"
    proc = run_mpi(WORKERS / "lp_exact.py", nprocs, str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 17
    inexact = results["inexact vs 1 rank"]
    # inexact (2/1 iterations) is far from the oracle but identical at every rank count
    assert inexact["fwd_iters"] == [2] and inexact["bwd_iters"] == [1]
    assert inexact["oracle_err"] > 1e-3
    for name, r in results.items():
        tol = (F32 if "f32" in name else F64).converged
        assert r["worst"] <= tol, (name, r)
        assert r["names_ok"] and r["gather_ok"], name
        if " L1 " in name:  # sequential: exact, one iteration
            assert r["worst"] == 0.0 and r["fwd_iters"] == [1] and r["bwd_iters"] == [1]
    # the iteration counts do not depend on the number of ranks (pinned at 1 rank)
    assert results["dense n13 L3 cf2"]["fwd_iters"] == [5]
    assert results["dense n13 L3 cf2"]["bwd_iters"] == [5]
    assert results["conv 2seg"]["fwd_iters"] == [4, 3]


# a report is `RANK <r> <Type>[: message]`; mpiexec may glue two reports together
# ("RANK 2 OKRANK 0 OK"), so the type ends at a colon, a space, the end or the next report
LINE = re.compile(r"RANK (\d+) ([A-Za-z]+?)(?=:| |$|RANK )", re.MULTILINE)

CASES = {
    "layers_lt_ranks": ("ValueError", "RemoteError", "each rank needs at least one layer"),
    "options_differ": ("RankMismatchError", "RankMismatchError", "differ between ranks"),
    "accuracy_differs": ("RankMismatchError", "RankMismatchError",
                         "`accuracy.min_cosine`: rank 0 has 0.99, rank 1 has 0.9"),
    "accuracy_bad_on_one_rank": ("TypeError", "RemoteError",
                                 "`accuracy` must be None, a bool or an AccuracyPolicy"),
    "factory_fails_on_one_rank": ("RuntimeError", "RemoteError", "factory exploded"),
    "shape_mismatch_between_segments": ("RuntimeError", "RemoteError", "shapes cannot be"),
    "input_differs": ("RankMismatchError", "RankMismatchError", "input differs"),
    "nan_loss": ("DivergenceError", "DivergenceError", "not finite"),
    "nan_loss_one_rank": ("DivergenceError", "DivergenceError", "not finite on rank(s) [1]"),
    "retain_graph_twice": ("RuntimeError", "RuntimeError", "second backward through the same"),
    "create_graph": ("RuntimeError", "RuntimeError", "create_graph=True"),
    # rank 1 goes on to batch 2 while the others wait in batch 1's backward: every rank
    # is told where each one is (MPI would otherwise pair the two exchanges silently)
    "rank_skips_backward": ("RankMismatchError", "RankMismatchError",
                            "rank 1 is in the forward pass's agreement on the input (batch 2"),
    # rank 1 sleeps past the others' timeout: they give up, naming the batch and pass
    "rank_sleeps_in_loss": ("TimeoutError", "RemoteError", "waited 3 s for the loss-gradient "
                            "check (all ranks must call it) from the other ranks (batch 1, "
                            "backward pass)"),
    "input_values_differ": ("RankMismatchError", "RankMismatchError",
                            "the input `x` differs between ranks: rank(s) [1, 2]"),
    "loss_differs": ("RankMismatchError", "RankMismatchError",
                     "the loss gradient differs between ranks: rank(s) [1, 2]"),
    "activation_differs": ("RankMismatchError", "RankMismatchError",
                           "`layers.1.structure`"),
    "width_differs": ("RankMismatchError", "RankMismatchError",
                      "`layers.0`: rank 0 has 'weight [4, 3] float32, bias [4] float32', "
                      "rank 1 has 'weight [5, 3] float32, bias [5] float32'"),
    "n_steps_differs": ("RankMismatchError", "RankMismatchError",
                        "`layers.1.n_steps`: rank 0 has 8, rank 1 has 12, rank 2 has 8"),
    "optimizer_over_other_tensors_on_one_rank": ("ValueError", "RemoteError",
                                                 "not a parameter of this rank's part"),
    "step_fails_on_one_rank": ("RuntimeError", "RemoteError", "layer 5 failed"),
    "reuse_after_failure": ("RuntimeError", "RuntimeError",
                            "this LayerParallel cannot run again: an earlier pass failed "
                            "(rank 0 failed: RuntimeError: mat1 and mat2 must have the "
                            "same dtype"),
    "block_changes_shape": ("ValueError", "RemoteError",
                            "layer 6 of segment 0 (Narrow) changed"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_on_every_rank(case: str) -> None:
    nprocs = 3
    proc = run_mpi(WORKERS / "lp_errors.py", nprocs, case, timeout=90)
    text = proc.stdout
    seen = {int(m.group(1)): m.group(2) for m in LINE.finditer(text)}
    assert sorted(seen) == list(range(nprocs)), text
    local, remote, msg = CASES[case]
    assert set(seen.values()) <= {local, remote}, text
    assert local in seen.values(), text
    assert text.count(msg) >= nprocs, text


@pytest.mark.parametrize("case", ["frozen_rank", "x_requires_grad_differs"])
def test_ranks_that_differ_in_what_they_differentiate(case: str) -> None:
    """A rank whose own parameters are all frozen (fine-tuning the head), and an input
    that requires grad on one rank only: both train as serial code does, no hang."""
    proc = run_mpi(WORKERS / "lp_errors.py", 3, case, timeout=120)
    seen = {int(m.group(1)): m.group(2) for m in LINE.finditer(proc.stdout)}
    assert sorted(seen) == [0, 1, 2] and set(seen.values()) == {"OK"}, \
        proc.stdout + proc.stderr[-2000:]


def test_input_check_can_be_turned_off() -> None:
    proc = run_mpi(WORKERS / "lp_errors.py", 3, "input_values_differ_after_checks", timeout=90)
    seen = {int(m.group(1)): m.group(2) for m in LINE.finditer(proc.stdout)}
    assert set(seen.values()) == {"OK"}, proc.stdout


def _losses(proc: object) -> dict:
    text = proc.stdout  # type: ignore[attr-defined]
    line = [ln for ln in text.splitlines() if ln.startswith("RANK 0 LOSSES ")]
    assert line, text + proc.stderr  # type: ignore[attr-defined]
    return json.loads(line[0][len("RANK 0 LOSSES "):])


def test_checkpoint_resume_on_another_number_of_ranks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    saved = _losses(run_mpi(WORKERS / "lp_checkpoint.py", 3, "save", ckpt, timeout=120))
    resumed = _losses(run_mpi(WORKERS / "lp_checkpoint.py", 2, "resume", ckpt, timeout=120))
    # exact mode: the interrupted run continues with the uninterrupted run's losses
    assert resumed["load_state_dict"] is True  # 3 ranks' checkpoint, 2 ranks' model
    got = saved["first"] + resumed["second"]
    assert all(abs(a - b) <= F64.roundoff * abs(b)
               for a, b in zip(got, saved["full"])), (got, saved)
    assert len(got) == 5
    # and 5 Adam steps from the same seed give the same losses on 1 rank as on 3
    one = _losses(run_mpi(WORKERS / "lp_checkpoint.py", 1, timeout=120))
    assert all(abs(a - b) <= F64.roundoff * abs(b) for a, b in zip(one["full"], saved["full"]))


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_fixed_iterations_where_a_rank_holds_no_residual_point(nprocs: int) -> None:
    """With fixed iteration counts the residual norms are read back once after the
    solve, reduced over the ranks; a rank that holds no coarse point (4 ranks of a
    16-layer net at cf8) has no norm of its own and must join that reduction all the
    same (it did not, and the job hung).  Outputs and gradients equal those with the
    norms reduced in every iteration, and so do the histories, on every rank."""
    proc = run_mpi(WORKERS / "lp_deferred_norms.py", nprocs, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = {int(m.group(1)): json.loads(m.group(2)) for m in
               re.finditer(r"RANK (\d+) (\{.*\})$", proc.stdout, re.MULTILINE)}
    assert sorted(reports) == list(range(nprocs)), proc.stdout
    for rank, report in reports.items():
        for path, got in report.items():
            assert got["out"] == 0.0 and got["grad"] == 0.0, (rank, path, got)
            for deferred, reduced in (got["fwd"], got["bwd"]):
                assert [len(h) for h in deferred] == [1] and \
                    [len(h) for h in reduced] == [1], (rank, path, got)
                assert deferred[0] == pytest.approx(reduced[0], rel=F64.converged), got
            assert got["fwd"] == reports[0][path]["fwd"], (rank, path)
