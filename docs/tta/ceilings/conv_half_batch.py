"""Case b of issue 20: what a serial training step of the conv net costs at the full
batch and at half of it (what each rank computes under the batch split).

    python docs/tta/ceilings/conv_half_batch.py BATCH THREADS

MNIST-1D conv ODE-net, 256 layers x 16 channels, T = 1, fused Adam; median of 20
steps after 5.  Run two at once (`&`) to see whether two 1-thread processes slow
each other down on the two cores.
"""
import gc
import statistics
import sys
import time

import torch

from layerpar.apps.loop import adam, train_step
from layerpar.apps.train import build_net, load_data

batch, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
x_tr, y_tr, _, _ = load_data("mnist1d", 0, torch.float32)
torch.manual_seed(0)
net = build_net("mnist1d", 256, 16, arch="conv", t_final=1.0)
opt = adam(net.parameters(), lr=1e-3)
gc.freeze()
times = []
for k in range(25):
    x, y = x_tr[k * batch:(k + 1) * batch], y_tr[k * batch:(k + 1) * batch]
    t = time.perf_counter()
    train_step(net, x, y, opt)
    times.append(time.perf_counter() - t)
print(f"batch {batch}, {threads} thread(s): {1e3 * statistics.median(times[5:]):.1f} ms "
      "per step", flush=True)
