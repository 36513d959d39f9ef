"""MPI worker: fixed iteration counts (tol = rtol = 0: the residual norms deferred, read
back once after the solve) where some ranks hold no residual point.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_deferred_norms.py
A 16-layer Peaks net (float64) at L2 cf8, 2 iterations both ways: its coarse points are
layers 0 and 8, so at 4 ranks (4 layers each) ranks 1 and 3 hold none, and measure no
norm of their own.  Each rank runs one forward and backward with the norms deferred
and one with them reduced in every iteration (tol = 1e-300: never met), batched and
per-step, and reports ``RANK <r> <json>``: the largest differences of the outputs and
gradients between the two, their residual histories, and the deferred ones again.
"""

import json
import sys

import torch
from mpi4py import MPI
from peaks_twins import peaks_twins

from layerpar.mgrit import MGRITOptions
from layerpar.parallel import LayerParallel

comm = MPI.COMM_WORLD
net, _, x, y = peaks_twins(32)
report = {}
for batched in (True, False):
    got = {}
    for how, tol in (("deferred", 0.0), ("reduced", 1e-300)):
        opts = MGRITOptions(max_levels=2, cfactor=8, max_iter=2, tol=tol, rtol=0.0)
        model = LayerParallel(net, comm, opts, batched=batched)
        out = model(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = None
        got[how] = (out.detach(), grads,
                    [list(s.residual_history) for s in model.last_forward],
                    [list(s.residual_history) for s in model.last_backward])
        model.close()
    d, r = got["deferred"], got["reduced"]
    report["batched" if batched else "per-step"] = {
        "out": float((d[0] - r[0]).abs().max()),
        "grad": max(float((d[1][n] - r[1][n]).abs().max()) for n in d[1]),
        "fwd": [d[2], r[2]], "bwd": [d[3], r[3]]}
sys.stdout.write(f"RANK {comm.rank} {json.dumps(report)}\n")
sys.stdout.flush()
