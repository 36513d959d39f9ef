"""MPI worker: adaptive accuracy at several ranks.  A stalling net switches to exact
propagation in batch 1 and trains as serial training does; a probe brings MGRIT back
once the net is benign.  Prints ``RANK r OK <log> <losses>`` (identical on every rank
when the decisions are) or ``RANK r <Error>: ...``.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_adaptive.py
"""
import copy
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import layerpar
from layerpar.ode import blocks
from layerpar.parallel.adaptive import AccuracyPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64  # noqa: E402

comm = MPI.COMM_WORLD
FWD = layerpar.MGRITOptions(max_levels=3, cfactor=4, max_iter=3, tol=0.0)


def net():
    torch.manual_seed(0)
    m = layerpar.ODENet(open=torch.nn.Linear(3, 4),
                        steps=lambda k: blocks.Dense(4, activation="tanh"), n_steps=32,
                        t_final=60.0, close=torch.nn.Linear(4, 5)).double()
    with torch.no_grad():
        for _, seg in m.segments:
            for b in seg.blocks:
                b.linear.weight.mul_(3.0)
    return m


def steps(model, first, count):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for k in range(first, first + count):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(16, 3, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


try:
    serial = net()
    model = layerpar.LayerParallel(copy.deepcopy(serial), comm, FWD, FWD.replace(max_iter=1),
                                   accuracy=AccuracyPolicy(probe_every=4))
    got, want = steps(model, 0, 3), steps(serial, 0, 3)
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    if not err <= F64.roundoff:
        raise AssertionError(f"exact propagation differs from serial: {err}")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.01)
    steps(model, 3, 2)  # batch 4 probes MGRIT
    if model.accuracy.exact:
        raise AssertionError(f"MGRIT did not resume: {model.accuracy.log}")
    log = "; ".join(str(e) for e in model.accuracy.log)
    sys.stdout.write(f"RANK {comm.rank} OK {log} | {[f'{v:.12f}' for v in got]}\n")
except Exception as exc:  # noqa: BLE001
    sys.stdout.write(f"RANK {comm.rank} {type(exc).__name__}: {exc}\n")
sys.stdout.flush()
