"""Case a of issue 20 at 2 ranks: the loader's time per step inside real training steps,
DataLoader(TensorDataset) against layerpar.apps.loop.Batches, taking turns (the
setting auto chooses there: 3 levels, cf 8, 1/1, batched).

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/loader.py [STEPS]
"""
import gc
import statistics
import sys
import time

import torch
from case_a import comm, net, opts, x_tr, y_tr
from torch import nn

from layerpar.apps.loop import Batches, adam
from layerpar.parallel import LayerParallel

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
model = LayerParallel(net, comm, opts, opts, batched=True)
opt = adam(model.parameters(), lr=3e-3)
old = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_tr, y_tr),
                                       batch_size=128, shuffle=True,
                                       generator=torch.Generator().manual_seed(0)))
new = iter(Batches(x_tr, y_tr, batch_size=128, generator=torch.Generator().manual_seed(0)))
gc.freeze()
t = {"DataLoader": [], "Batches": [], "step": []}
for k in range(steps):
    name, it = ("DataLoader", old) if k % 2 == 0 else ("Batches", new)
    t0 = time.perf_counter()
    x, y = next(it)
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    t2 = time.perf_counter()
    if k >= 6:
        t[name].append(1e3 * (t1 - t0))
        t["step"].append(1e3 * (t2 - t1))
med = {k: statistics.median(v) for k, v in t.items()}
g = comm.gather(med)
if comm.rank == 0:
    for r, m in enumerate(g):
        print(f"rank {r} ms: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
