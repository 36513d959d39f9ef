"""`LayerParallel.load_state_dict`: a whole-network state dict with a missing key, a
wrong shape or a key of no layer raises on every rank (each checks the whole dict
against the whole net it holds, without messages), before anything is loaded; and
``assign=True`` is refused by name (the new tensors would not be the ones layerpar
steps and trains), leaving the model as it was."""
from __future__ import annotations

import re

import pytest
from mpi_util import WORKERS, run_mpi

WANT = {"missing": "RuntimeError", "shape": "RuntimeError", "unexpected": "RuntimeError",
        "assign": "ValueError", "ok": "OK"}


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_bad_state_dict_raises_on_every_rank(nprocs: int) -> None:
    proc = run_mpi(WORKERS / "lp_load_state.py", nprocs, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {(int(r), case): (what, same) for r, case, what, same in
           re.findall(r"RANK (\d+) (\w+) (\w+) (True|False)$", proc.stdout, re.M)}
    assert got == {(r, case): (what, "True") for r in range(nprocs)
                   for case, what in WANT.items()}, proc.stdout
    assert "`assign=True`" in proc.stdout  # the refusal names the argument
    assert '"layers.1.blocks.7.linear.weight"' in proc.stdout  # ... and the missing key
