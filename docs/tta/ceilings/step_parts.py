"""Case a of issue 20 at 2 ranks: where a training step's time goes.

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/step_parts.py [STEPS]

The 1,024-layer dense MNIST-1D net (width 32, T = 1, batch 128) under the setting
`--auto` chooses on it (3 levels, cf 8, 1/1 iterations, batched cycles), trained with
`layerpar.apps.loop.adam` as `layerpar train` does.  Per step (medians after 5 steps):
the batch, `zero_grad`, forward, loss, backward, the optimizer's step, and the pass
as the tuner times it (forward and `torch.autograd.grad`).  Then, on one process, the
fused Adam step over 1,024 tensors shaped like one rank's (512 layers of 32 x 32 and
32) against the same step over one flat tensor of the same size.
"""
import gc
import statistics
import sys
import time

import torch
from mpi4py import MPI
from torch import nn

from layerpar.apps.loop import adam
from layerpar.apps.train import build_net, load_data
from layerpar.mgrit.options import MGRITOptions
from layerpar.parallel import LayerParallel

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
x_tr, y_tr, _, _ = load_data("mnist1d", 0, torch.float32)
torch.manual_seed(0)
net = build_net("mnist1d", 1024, 32, arch="dense", t_final=1.0)
opts = MGRITOptions(max_levels=3, cfactor=8, max_iter=1, tol=0.0, rtol=0.0)
model = LayerParallel(net, comm, opts, opts, batched=True)
opt = adam(model.parameters(), lr=3e-3)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_tr, y_tr),
                                     batch_size=128, shuffle=True,
                                     generator=torch.Generator().manual_seed(0))
batches = iter(loader)
gc.freeze()
params = [p for p in model.parameters() if p.requires_grad]
parts: dict[str, list[float]] = {k: [] for k in
                                 ("batch", "zero_grad", "forward", "loss", "backward",
                                  "optimizer", "step", "tuner_pass")}
for k in range(steps):
    t0 = time.perf_counter()
    x, y = next(batches)
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    out = model(x)
    t3 = time.perf_counter()
    loss = nn.functional.cross_entropy(out, y)
    t4 = time.perf_counter()
    loss.backward()
    t5 = time.perf_counter()
    opt.step()
    t6 = time.perf_counter()
    torch.autograd.grad(nn.functional.cross_entropy(model(x), y), params)
    t7 = time.perf_counter()
    if k >= 5:
        for key, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5,
                                  t6 - t1, t7 - t6)):
            parts[key].append(1e3 * v)
med = {k: statistics.median(v) for k, v in parts.items()}
gathered = comm.gather(med)
if comm.rank == 0:
    for rank, m in enumerate(gathered):
        print(f"rank {rank} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))

    def adam_ms(tensors: list[torch.Tensor]) -> float:
        ps = [torch.nn.Parameter(t) for t in tensors]
        for p in ps:
            p.grad = torch.randn_like(p)
        o = adam(ps, lr=1e-3)
        for _ in range(5):
            o.step()
        t = time.perf_counter()
        for _ in range(50):
            o.step()
        return 1e3 * (time.perf_counter() - t) / 50

    each = [t for _ in range(512) for t in (torch.randn(32, 32), torch.randn(32))]
    print(f"fused Adam step, 1,024 tensors (one rank's): {adam_ms(each):.2f} ms; "
          f"one flat tensor of the same size: "
          f"{adam_ms([torch.randn(512 * (32 * 32 + 32))]):.2f} ms")
