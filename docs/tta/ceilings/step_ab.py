"""Case a's training step at 2 ranks with the setting auto chooses there (3 levels, cf 8,
1/1 iterations, batched), the median of 60 steps after 10: run it at two commits in
turn to compare them (same data, same initial weights, so the losses must agree).

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/step_ab.py LABEL
"""
import gc
import statistics
import sys
import time

import torch
from mpi4py import MPI

from layerpar import LayerParallel, MGRITOptions
from layerpar.apps.loop import adam
from layerpar.apps.nets import problem_net

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
torch.manual_seed(0)
net = problem_net("mnist1d", 1024, 32, arch="dense", t_final=1.0)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(128, 40, generator=g), torch.randint(0, 10, (128,), generator=g)
o = MGRITOptions(max_levels=3, cfactor=8, max_iter=1, tol=0.0, rtol=0.0)
m = LayerParallel(net, comm, o, o, batched=True)
opt = adam(m.parameters(), lr=1e-3)
gc.freeze()
ts = []
for _ in range(70):
    comm.Barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    ts.append(time.perf_counter() - t0)
if comm.rank == 0:
    print(sys.argv[1], "median step ms", round(1e3 * statistics.median(ts[10:]), 2), "loss",
          loss.item())
