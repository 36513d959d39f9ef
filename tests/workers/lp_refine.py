"""MPI worker: `LayerParallel.refine` (nested iteration) on P ranks equals the serial
`layerpar.ode.refine` of the same trained net (float64, exact solves: <= 1e-12), for
piecewise-constant and linear interpolation, with a 7-layer segment (uneven blocks).
Prints ``RANK r OK <errors>`` or ``RANK r <Error>: ...``.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_refine.py
"""
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import layerpar
from layerpar.ode import blocks, refine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64  # noqa: E402

comm = MPI.COMM_WORLD
EXACT = layerpar.MGRITOptions(max_levels=1)


def net():
    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(3, 4),
                           steps=lambda k: blocks.Dense(4, activation="tanh"), n_steps=7,
                           t_final=2.0, close=torch.nn.Linear(4, 5)).double()


try:
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(2))
    model = layerpar.LayerParallel(net(), comm, EXACT)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(3):  # train a little: every rank's layers move
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    trained = net()
    trained.load_state_dict(model.gather_state_dict())
    errs = []
    for how in ("constant", "linear"):
        for factor in (2, 3):
            fine = refine(model, factor, how)
            assert isinstance(fine, layerpar.LayerParallel) and fine.size == comm.size
            want = refine(trained, factor, how)
            got = fine.gather_state_dict()
            ref = want.state_dict()
            assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
            errs.append(max(float((got[k] - ref[k]).norm()) for k in ref))
            out = fine(x).detach()
            errs.append(float((out - want(x).detach()).norm() / out.norm()))
            fine.close()
    if not max(errs) <= F64.roundoff:
        raise AssertionError(f"refined model differs from the serial refinement: {errs}")
    sys.stdout.write(f"RANK {comm.rank} OK {max(errs):.1e}\n")
except Exception as exc:  # noqa: BLE001
    sys.stdout.write(f"RANK {comm.rank} {type(exc).__name__}: {exc}\n")
sys.stdout.flush()
