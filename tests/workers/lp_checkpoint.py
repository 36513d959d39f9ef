"""MPI worker: train 3 steps at P ranks, checkpoint (model + optimizer, name-keyed),
resume on a *fresh* LayerParallel and train 2 more; compare with 5 uninterrupted
steps.  Rank 0 prints `RANK 0 LOSSES <json>` for both runs (and under
"load_state_dict" whether `model.load_state_dict(whole network's dict)` on a built
model gave every rank its part).

Run: mpiexec -n P python -m mpi4py tests/workers/lp_checkpoint.py [save|resume PATH]
With `save PATH` the checkpoint after 3 steps is written to PATH; with `resume PATH`
it is read from PATH (written at another number of ranks) and 2 steps follow.
"""
import json
import sys

import torch
from mpi4py import MPI

import layerpar
from layerpar.ode import blocks

comm = MPI.COMM_WORLD
OPTS = layerpar.MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=50)


def factory():
    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(3, 4), steps=lambda k: blocks.Dense(4),
                           n_steps=12, t_final=2.0, close=torch.nn.Linear(4, 5)).double()


def batches():
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 3, generator=gen, dtype=torch.float64),
             torch.randint(0, 5, (8,), generator=gen)) for _ in range(5)]


def train(model, opt, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


data = batches()
mode = sys.argv[1] if len(sys.argv) > 2 else "both"
path = sys.argv[2] if len(sys.argv) > 2 else None
out = {}
if mode in ("both", "save"):
    model = layerpar.LayerParallel(factory, comm, OPTS, OPTS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out["full"] = train(model, opt, data)
    model = layerpar.LayerParallel(factory, comm, OPTS, OPTS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out["first"] = train(model, opt, data[:3])
    ckpt = {"model": model.gather_state_dict(), "opt": model.gather_optimizer_state(opt)}
    if path is not None and comm.rank == 0:
        torch.save(ckpt, path)
    del model, opt
if mode == "resume":
    ckpt = torch.load(path, weights_only=False)
if mode in ("both", "resume"):
    # the PyTorch way too: a model built first, then the whole network's state dict
    # loaded into it on every rank (each takes its part; others' keys are not unexpected)
    later = layerpar.LayerParallel(factory, comm, OPTS, OPTS)
    later.load_state_dict(ckpt["model"])
    back = later.gather_state_dict()
    same = sorted(back) == sorted(ckpt["model"]) and all(
        torch.equal(back[k], v) for k, v in ckpt["model"].items())
    out["load_state_dict"] = bool(min(comm.allgather(same)))
    later.close()
    model = layerpar.LayerParallel(factory, comm, OPTS, OPTS, state_dict=ckpt["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.load_optimizer_state(opt, ckpt["opt"])
    out["second"] = train(model, opt, data[3:])
if comm.rank == 0:
    print("RANK 0 LOSSES " + json.dumps(out), flush=True)
