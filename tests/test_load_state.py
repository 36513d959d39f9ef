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


@pytest.mark.parametrize("save", ["torch.save", "pickle", "auto"])
def test_pickling_a_model_is_refused_by_name(save: str) -> None:
    """``torch.save(model)`` (and pickle) says what to save instead, for the model and
    the policy above it, not a Cython message about ``__cinit__``."""
    import io
    import pickle

    import torch

    import layerpar
    from layerpar.ode import blocks

    net = layerpar.ODENet(open=torch.nn.Linear(3, 4), steps=lambda k: blocks.Dense(4),
                          n_steps=8, close=torch.nn.Linear(4, 5))
    model = layerpar.LayerParallel(net, None, "auto" if save == "auto" else
                                   layerpar.MGRITOptions(max_levels=2, cfactor=2))
    with pytest.raises(TypeError, match=r"a LayerParallel cannot be pickled .*Save "
                                        r"`model.gather_state_dict\(\)`"):
        if save == "pickle":
            pickle.dumps(model)
        else:
            torch.save(model, io.BytesIO())
