"""Case a's training step at one rank (1,024 dense layers x 32, batch 128 of random
MNIST-1D-shaped data, fused Adam): top-level operations per step (flips, cats, stacks,
copies among them; `layerpar.apps.opcount.count_ops`) and the median of 15 steps.
Run it at two commits in turn to compare them.

    python docs/tta/ceilings/ops_one_rank.py LEVELS CFACTOR FWD_ITERS
"""
import sys
import time

import torch

from layerpar import LayerParallel, MGRITOptions
from layerpar.apps.loop import adam
from layerpar.apps.nets import problem_net
from layerpar.apps.opcount import count_ops

torch.set_num_threads(1)
torch.manual_seed(0)
levels, cf, it = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
net = problem_net("mnist1d", 1024, 32, arch="dense", t_final=1.0)
x, y = torch.randn(128, 40), torch.randint(0, 10, (128,))
fwd = MGRITOptions(max_levels=levels, cfactor=cf, max_iter=it, tol=0.0, rtol=0.0)
bwd = MGRITOptions(max_levels=levels, cfactor=cf, max_iter=1, tol=0.0, rtol=0.0)
m = LayerParallel(net, None, fwd, bwd, batched=True, check_finite=False)
opt = adam(m.parameters(), lr=1e-3)


def step() -> None:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()


n, names = count_ops(step)
print(f"L{levels} cf{cf} {it}/1 ops", n, *(f"{k} {names.get('aten::' + k, 0)}"
                                          for k in ("flip", "cat", "stack", "copy_")))
ts = []
for _ in range(15):
    t0 = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t0)
print("  step ms", round(sorted(ts)[7] * 1e3, 2))
