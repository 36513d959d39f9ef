"""Modules and parameters assigned anew after a LayerParallel was built
(`workers/lp_replaced.py`) at 1, 2 and 4 ranks: refused by name on every rank (the
model computes with the objects it was built with); values set in place, and modules
built elsewhere in the process, give serial's output.  The net's own forward after a
training pass at 2+ ranks is refused (its copies of the other ranks' layers are
stale once a step follows), with any optimizer, and so are its state dict, pickling
(``torch.save(net)``) and deep copies.  ``model.apply(init)`` initialises as
``serial.apply(init)`` does.  An optimizer state loaded from another rank's
``optimizer.state_dict()``, and LBFGS (dot products over every parameter), are refused
at 2+ ranks."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mpi_util import WORKERS, run_mpi
from tolerances import F64

sys.path.insert(0, str(WORKERS))
import lp_replaced  # noqa: E402

LAST = lp_replaced.N_STEPS - 1
#: what each refused case names
REFUSED = {
    "block parameter": "parameter `layers.1.blocks.0.linear.weight` was replaced by another",
    "block submodule": f"module `layers.1.blocks.{LAST}.linear` was replaced by another",
    "block in the net's list": "module `the ODENet's layers.1.blocks.3` was replaced by "
                               "another",
    "plain layer parameter, after the checks": "parameter `layers.2.weight` was replaced",
    "last rank only": f"parameter `layers.1.blocks.{LAST}.linear.bias` was replaced",
    "parametrization": "parameter `layers.1.blocks.2.linear.weight` was removed",
}


def check(results: dict[str, list[Any]], ranks: int) -> None:
    for name, says in REFUSED.items():
        for r in results[name]:
            assert r.get("error", "").startswith("ValueError: " + says), (name, r)
            assert "after the LayerParallel was built" in r["error"], (name, r)
    if ranks > 1:
        for r in results["last rank only"]:
            assert f"(found on rank {ranks - 1})" in r["error"], r
    if ranks > 1:
        # (auto's candidates are models on the same net: still one guard, one hook)
        for r in (results["net's forward, trained"] + results["net's forward, auto"]
                  + results["net's forward, no step"] + results["net's forward, FlatAdam"]):
            assert r.get("error", "").startswith(
                f"RuntimeError: this ODENet's layers are trained over {ranks} ranks"), r
            assert r["load_hooks"] == 1, r
            for what in ("state_dict", "pickle", "deepcopy"):
                assert r[what] == r["error"][len("RuntimeError: "):], (what, r)
    else:
        for name in ("net's forward, no step", "net's forward, FlatAdam",
                     "net's forward, trained"):
            for r in results[name]:
                assert "error" not in r and r["diff"] <= F64.converged, (name, r)
        # (auto's setting may be inexact MGRIT: the net runs, its output is serial's)
        assert all("error" not in r for r in results["net's forward, auto"])
    for r in results["net's forward, loaded"]:
        assert r["state_dict"] == r["pickle"] == r["deepcopy"] == "ran", r
    for name in ("values in place", "modules built elsewhere", "net's forward, loaded"):
        for r in results[name]:
            assert "error" not in r and r["diff"] <= F64.converged, (name, r)
    for r in results["torch.func.functional_call"]:  # (refused on every rank)
        assert r.get("error", "").startswith(
            "ValueError: parameter `layers.") and "torch.func.functional_call" in \
            r["error"], r
    for r in results["optimizer state gathered"]:  # (each rank's groups keep its rank)
        assert "error" not in r and r["params"] <= F64.converged, r
    if ranks > 1:
        # rank 0's own state runs its step; the others refuse theirs, and rank 0
        # hears of it at its next message
        for r in results["optimizer state of rank 0"]:
            assert f"was loaded from the optimizer of rank 0 of {ranks}" in \
                r.get("error", ""), r
        for r in results["LBFGS"]:
            assert r.get("error", "").startswith(
                "ValueError: torch.optim.LBFGS over a LayerParallel model's "
                "parameters"), r
    else:
        for name in ("optimizer state of rank 0", "LBFGS"):
            for r in results[name]:
                assert "error" not in r and r["params"] <= F64.converged, (name, r)
    for r in results["initialised by model.apply"]:  # (the draws in serial's order)
        assert r["diff"] <= F64.converged and r["params"] == 0.0, r
        assert r["generator as serial's"], r


def test_one_rank() -> None:
    check({k: [v] for k, v in lp_replaced.run_all(None).items()}, 1)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_several_ranks(tmp_path: Path, ranks: int) -> None:
    out = tmp_path / "replaced.json"
    proc = run_mpi(WORKERS / "lp_replaced.py", ranks, str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check(json.loads(out.read_text()), ranks)


def test_buffers_counted_apart() -> None:
    """A buffer set anew (a data grid sets its batch norms' averaged running statistics
    on every pass) moves the count a data-parallel net follows, not the one the
    layout check follows, which then stays free."""
    from torch import nn

    from layerpar.parallel.agree import registrations

    bn = nn.BatchNorm1d(3)
    every, placed = registrations(), registrations(buffers=False)
    bn.running_mean = bn.running_mean.clone()
    assert (registrations(), registrations(buffers=False)) == (every + 1, placed)
    bn.weight = nn.Parameter(bn.weight.detach().clone())
    assert (registrations(), registrations(buffers=False)) == (every + 2, placed + 1)
