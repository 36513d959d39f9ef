"""`LayerParallel.check_gradients`: the reported errors against an independent
computation with the serial oracle, at 1 rank (in this process) and at 2 and 3 ranks
(mpiexec, the same worker code), and the ``accuracy`` study's command line.

The cases live in ``workers/lp_accuracy.py`` (`CASES`); each case's result holds what
`check_gradients` reported ("check") and what the serial `ODENet` and a second,
ordinarily trained `LayerParallel` give ("want").  The worker itself asserts that the
check left `.grad`, the random generator, buffers and the training mode alone, that a
second call gives the same result, that `close()` closes the cached twin, and (at P
ranks) that every rank got the same result.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi_util import describe, run_mpi
from tolerances import F64
from torch.nn import functional as F

import layerpar

WORKERS = Path(__file__).parent / "workers"

_spec = importlib.util.spec_from_file_location("lp_accuracy", WORKERS / "lp_accuracy.py")
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

FIELDS = ("output_error", "loss_error", "input_grad_error", "segment_grad_errors",
          "param_grad_error", "cosine", "fwd_iterations", "bwd_iterations",
          "fwd_residuals", "bwd_residuals")
EXACT_CASES = ("dense exact L1", "dense converged L3", "dropout+bn converged")
INEXACT_CASES = tuple(n for n in worker.CASES if n not in EXACT_CASES)


def _close(a: Any, b: Any, rel: float, floor: float) -> bool:
    """a == b elementwise, to `rel` relative with an absolute `floor` (lists, None)."""
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(u, v, rel, floor) for u, v in zip(a, b))
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rel * abs(b) + floor


@pytest.fixture(scope="module")
def one_rank() -> dict[str, Any]:
    return worker.run_cases(None)


def _matches_independent(results: dict[str, Any]) -> None:
    for name in worker.CASES:
        got, want = results[name]["check"], results[name]["want"]
        for f in FIELDS:
            # 1e-8 relative; errors at round-off (exact cases) are compared absolutely
            assert _close(got[f], want[f], 1e-8, F64.roundoff), (name, f, got[f], want[f])


def test_one_rank_matches_the_serial_oracle(one_rank: dict[str, Any]) -> None:
    _matches_independent(one_rank)


def test_exact_and_converged_solves_report_round_off(one_rank: dict[str, Any]) -> None:
    for name in EXACT_CASES:
        c = one_rank[name]["check"]
        errors = [c["output_error"], c["loss_error"], c["input_grad_error"],
                  c["param_grad_error"], *c["segment_grad_errors"]]
        assert max(errors) <= F64.converged, (name, c)
        assert c["cosine"] >= 1 - F64.converged, (name, c)
    assert one_rank["dense converged L3"]["check"]["fwd_iterations"][0] > 1


def test_inexact_solves_report_a_clear_error(one_rank: dict[str, Any]) -> None:
    for name in INEXACT_CASES:
        c = one_rank[name]["check"]
        assert c["param_grad_error"] > 1e-3 and c["output_error"] > 1e-4, (name, c)
        assert min(c["segment_grad_errors"]) > 1e-4 and c["cosine"] < 1 - 1e-6, (name, c)
    c = one_rank["dense inexact L3 cf4 1/1"]["check"]
    assert c["fwd_iterations"] == [1] and c["bwd_iterations"] == [1]
    assert c["fwd_residuals"] == [None]  # one iteration with skip: nothing measured
    c = one_rank["dense inexact L3 cf4 2/1"]["check"]
    assert c["fwd_iterations"] == [2] and c["fwd_residuals"][0] > 0
    assert len(one_rank["conv 2seg inexact L3 cf2 1/1"]["check"]["segment_grad_errors"]) == 2


def test_frozen_parameters_are_not_reported_as_a_perfect_gradient() -> None:
    """Every parameter frozen: no parameter gradient is compared, and the report says
    so (NaN, not error 0 / cosine 1); the input gradient's error is what `error` and
    `cos` (what the adaptive bound checks) then give."""
    torch.manual_seed(0)
    net = worker.dense_net(16).double()
    model = layerpar.LayerParallel(net, None, worker.INEXACT)
    for p in model.parameters():
        p.requires_grad_(False)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 0])
    c = model.check_gradients(x, y, F.cross_entropy)
    assert c.n_params_compared == 0 and c.compared == "input"
    assert math.isnan(c.param_grad_error) and math.isnan(c.cosine)
    assert c.input_grad_error > 1e-3  # the inexact input gradient is off
    assert c.error == c.input_grad_error and c.cos == c.input_cosine < 1 - 1e-6
    assert "no trainable parameter: parameter gradients not compared" in str(c)
    for p in model.parameters():
        p.requires_grad_(True)
    c = model.check_gradients(x, y, F.cross_entropy)
    assert c.compared == "parameters" and c.error == c.param_grad_error
    assert c.n_params_compared == sum(p.numel() for p in model.parameters())
    model.close()


def test_bad_arguments_name_the_argument(one_rank: dict[str, Any]) -> None:
    msgs = one_rank["bad arguments"]
    assert len(msgs) == 7 and msgs[-1].startswith("RuntimeError")
    torch.manual_seed(0)
    model = layerpar.LayerParallel(worker.dense_net(4).double(), None, worker.INEXACT)
    x, y = torch.randn(3, 3, dtype=torch.float64), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="`x` must be a torch.Tensor"):
        model.check_gradients([[1.0]], y, F.cross_entropy)
    with pytest.raises(TypeError, match="`x` must be a numeric tensor"):
        model.check_gradients(x > 0, y, F.cross_entropy)
    with pytest.raises(TypeError, match="`loss_fn` must be callable"):
        model.check_gradients(x, y, None)
    with pytest.raises(TypeError, match="`loss_fn` must return a scalar tensor"):
        model.check_gradients(x, y, lambda out, t: out)
    model.close()


def test_str_is_one_readable_line(one_rank: dict[str, Any]) -> None:
    text = one_rank["dense inexact L3 cf4 2/1"]["str"]
    assert text.startswith("gradient check: param grad rel. error ") and "\n" not in text
    assert "cos 0." in text and "fwd iters 2 (res " in text and "bwd iters 1 (res n/a)" in text


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_ranks_report_what_one_rank_reports(nprocs: int, tmp_path: Path,
                                            one_rank: dict[str, Any]) -> None:
    out = tmp_path / "accuracy.json"
    proc = run_mpi(WORKERS / "lp_accuracy.py", nprocs, out, timeout=300)
    assert proc.returncode == 0, describe(proc)[-4000:]
    results = json.loads(out.read_text())
    _matches_independent(results)
    for name in worker.CASES:
        got, one = results[name]["check"], one_rank[name]["check"]
        for f in FIELDS:
            assert _close(got[f], one[f], F64.converged, F64.converged), (name, f, got[f], one[f])
    assert results["bad arguments"] == one_rank["bad arguments"]


def test_accuracy_study_smoke(tmp_path: Path) -> None:
    from layerpar.apps.studies import cli

    out = tmp_path / "acc"
    argv = ["accuracy", "--models", "peaks", "--states", "init", "--fwd-iters", "1,2",
            "--bwd-iters", "1", "--levels", "2", "--cfactor", "4", "--batch", "20",
            "--out", str(out)]
    assert cli.main(argv) == 0
    rows = list(csv.DictReader((out / "accuracy.csv").open()))
    assert len(rows) == 2 and {r["fwd_iters"] for r in rows} == {"1", "2"}
    assert all(0 < float(r["param_grad_error"]) < math.inf for r in rows)
    assert (out / "accuracy.png").stat().st_size > 0
    readme = (out / "README.md").read_text()
    assert "python -m layerpar.studies accuracy" in readme and "| peaks" in readme
    assert cli.main(argv) == 0  # its own files are replaced
    (out / "README.md").write_text("my notes\n")  # a file it did not write is refused
    assert cli.main(argv) == 2
    assert (out / "README.md").read_text() == "my notes\n"
    assert cli.main(["accuracy", "--levels", "0", "--out", str(out)]) == 2
