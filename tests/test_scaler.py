"""Loss scaling across ranks (`workers/lp_scaler.py`) at 1, 2 and 4 ranks: with
`layerpar.parallel.GradScaler` an overflow in the last rank's layers skips every rank's
step, and the scales and parameters equal a serial net's under torch's scaler; torch's
own scaler on each rank parts the ranks' scales; a float16-autocast pass at several ranks
warns once, unless the agreeing scaler was built for the model."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi_util import WORKERS, run_mpi
from tolerances import F64

import layerpar

sys.path.insert(0, str(WORKERS))
import lp_scaler  # noqa: E402


def check(results: dict[str, list[Any]], ranks: int) -> None:
    for r in results["agreeing"]:
        assert r["scales"] == r["serial_scales"], r
        assert r["skipped"], r
        assert r["diff"] <= F64.converged, r
    if ranks > 1:
        # torch's scaler skips the step on the overflowing (last) rank alone, and the
        # ranks' scales part: the loss gradient's check in the first batches finds it
        for r in results["torch's"]:
            assert r["error"].startswith("RankMismatchError: the loss gradient differs "
                                         "between ranks"), r
        for said in results["warning"]:
            assert len(said) == 1 and "layerpar.parallel.GradScaler(model)" in said[0], said
    else:
        assert all(not said for said in results["warning"]), results["warning"]
    assert all(not said for said in results["no warning"]), results["no warning"]


def test_one_rank() -> None:
    check({k: [v] for k, v in lp_scaler.run_all(None).items()}, 1)


def test_built_over_what_holds_the_ranks() -> None:
    """Over the auto policy and a training method the flag lands on the LayerParallel
    they run (whose passes look for it); anything without a transport is refused."""
    from layerpar.parallel.baselines import LayerParallelMethod
    from layerpar.parallel.scaler import GradScaler, scaler_agrees

    auto = layerpar.LayerParallel(lp_scaler._net(), None, "auto")
    method = LayerParallelMethod(lp_scaler._net(), None, options="auto")
    for holder in (auto, method):
        assert not scaler_agrees(holder)
        GradScaler(holder, "cpu")
        assert scaler_agrees(holder)
        holder.close()
    with pytest.raises(TypeError, match="`model` must be a LayerParallel"):
        GradScaler(torch.nn.Linear(2, 2), "cpu")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_several_ranks(tmp_path: Path, ranks: int) -> None:
    out = tmp_path / "scaler.json"
    proc = run_mpi(WORKERS / "lp_scaler.py", ranks, str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check(json.loads(out.read_text()), ranks)
