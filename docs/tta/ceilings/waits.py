"""Case a of issue 20 at 2 ranks: where a training step waits for the other rank.

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/waits.py

The 1,024-layer dense MNIST-1D net (width 32, T = 1, batch 128) under auto's setting
(3 levels, cf 8, 1/1 iterations, batched), fused Adam, one thread per rank.  After 20
steps, one step's timeline per rank: when the forward, backward and optimizer phases
start, and every wait of the transport (`MPITransport._wait_request`: collective
agreements, boundary states, the output's broadcast) with its duration, in ms from a
common barrier.
"""
import time
import traceback

import torch
from case_a import comm, net, opts, x_tr, y_tr
from torch import nn

from layerpar.mgrit.transport import mpi as transport
from layerpar.parallel import LayerParallel

model = LayerParallel(net, comm, opts, opts, batched=True)
opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
x, y = x_tr[:128], y_tr[:128]
log: list[tuple[float, float, str, str]] = []
original = transport.MPITransport._wait_request


def timed(self, req, what="?", peer=None, keep=None):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    try:
        return original(self, req, what, peer, keep)
    finally:
        where = [f.name for f in traceback.extract_stack(limit=6)][:-1]
        log.append((t, time.perf_counter() - t, what, "/".join(where[-3:])))


transport.MPITransport._wait_request = timed  # type: ignore[method-assign]


def step() -> None:
    opt.zero_grad()
    log.append((time.perf_counter(), 0.0, "-- forward starts", ""))
    loss = nn.functional.cross_entropy(model(x), y)
    log.append((time.perf_counter(), 0.0, "-- backward starts", ""))
    loss.backward()
    log.append((time.perf_counter(), 0.0, "-- optimizer starts", ""))
    opt.step()
    log.append((time.perf_counter(), 0.0, "-- step ends", ""))


for _ in range(20):
    step()
comm.Barrier()
log.clear()
base = time.perf_counter()
step()
logs = comm.gather([(t - base, d, w, s) for t, d, w, s in log])
if comm.rank == 0:
    for rank, entries in enumerate(logs):
        print(f"rank {rank}: ms from the barrier, wait ms, what, where")
        for t, d, w, s in entries:
            print(f"  {t * 1e3:7.2f}  {d * 1e3:5.2f}  {w[:45]:45s} {s}")
        print(f"  waits: {sum(d for _, d, _, _ in entries) * 1e3:.2f} ms in this step")
