"""Case a's serial net under torch.compile on this CPU (issue 20's third serial baseline,
asked for on a GPU): the first training step's seconds (compilation included) and the
median of the next 10 steps, one thread, Adam, batch 128 of random MNIST-1D-shaped data.

    python docs/tta/ceilings/compile_serial.py MODE LAYERS

MODE: eager (no compilation), whole (``torch.compile`` of the net, what ``layerpar train
--serial --compile`` does) or blocks (each residual block compiled on its own, regional
compilation).  RLIM in the environment sets Python's recursion limit first (default
1,000: inductor's walk over a 1,024-layer graph needs more).
"""
import os
import sys
import time

import torch

from layerpar.apps.nets import problem_net

sys.setrecursionlimit(int(os.environ.get("RLIM", "1000")))
torch.set_num_threads(1)
mode, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
net = problem_net("mnist1d", layers, 32, arch="dense", t_final=1.0)
x, y = torch.randn(128, 40), torch.randint(0, 10, (128,))
if mode == "whole":
    m = torch.compile(net)
elif mode == "blocks":
    for seg in [layer for layer in net.layers if hasattr(layer, "blocks")]:
        for b in seg.blocks:
            b.compile()
    m = net
else:
    m = net
opt = torch.optim.Adam(net.parameters(), lr=1e-3)


def step() -> None:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()


t0 = time.perf_counter()
step()
print(mode, layers, "first step", round(time.perf_counter() - t0, 2), "s", flush=True)
ts = []
for _ in range(10):
    a = time.perf_counter()
    step()
    ts.append(time.perf_counter() - a)
print(mode, layers, "step ms", round(1e3 * sorted(ts)[len(ts) // 2], 2), flush=True)
