"""ms per training step (zero_grad, forward, loss, backward, fused Adam) of replicated
serial at P ranks, one thread each: the batch split ("split") and the plain one
("plain"), against the rank's share of the rows run through the same private net with
no exchange ("local", the floor the split pass approaches).  Median over interleaved
rounds of 40 steps.

Usage: mpiexec -n 2 python -m mpi4py docs/results/replicated/split_passes.py digits,peaks,prenorm [rounds]
Cases: digits (bundled conv net, 8 layers x 8 channels, batch 50), peaks (32 layers,
width 8, batch 100), prenorm (a user block we do not ship: LayerNorm -> Linear -> GELU
-> Linear, width 64, 16 layers, batch 64, random data).
"""
import sys
import time

import torch
from mpi4py import MPI
from torch import nn

from layerpar import ODENet
from layerpar.apps.loop import adam
from layerpar.apps.train import build_net, load_data
from layerpar.mgrit.options import MGRITOptions
from layerpar.parallel.model import LayerParallel
from layerpar.parallel.replicated import ReplicatedSerial

comm = MPI.COMM_WORLD
r, P = comm.rank, comm.size
torch.set_num_threads(1)


class PreNorm(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(w), nn.Linear(w, w), nn.Linear(w, w)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.a(self.norm(u))))


def case(name: str):
    torch.manual_seed(0)
    if name == "digits":
        xt, yt, _, _ = load_data("digits", 0, torch.float32)
        return build_net("digits", 8, 8), xt[:50], yt[:50]
    if name == "peaks":
        xt, yt, _, _ = load_data("peaks", 0, torch.float32)
        return build_net("peaks", 32, 8), xt[:100], yt[:100]
    net = ODENet(open=nn.Linear(32, 64), steps=lambda n: PreNorm(64), n_steps=16,
                 t_final=1.0, close=nn.Linear(64, 10))
    return net, torch.randn(64, 32), torch.randint(0, 10, (64,))


def run(name: str, rounds: int, n: int = 40) -> None:
    net, x, y = case(name)
    m = LayerParallel(net, comm, MGRITOptions(max_levels=1))
    reps = {"split": ReplicatedSerial(m, split=True), "plain": ReplicatedSerial(m)}
    opt = adam(m.parameters(), 1e-3)
    lo, hi = r * len(x) // P, (r + 1) * len(x) // P
    lossf = nn.functional.cross_entropy

    def mk(f, xx, yy):
        def step():
            opt.zero_grad(set_to_none=True)
            lossf(f(xx), yy).backward()
            opt.step()
        return step
    fs = {"split": mk(reps["split"], x, y), "plain": mk(reps["plain"], x, y),
          "local": mk(reps["split"].net, x[lo:hi], y[lo:hi])}
    times: dict[str, list[float]] = {k: [] for k in fs}
    for f in fs.values():
        for _ in range(20):
            f()
    for _ in range(rounds):
        for k, f in fs.items():
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(n):
                f()
            comm.Barrier()
            times[k].append((time.perf_counter() - t) / n * 1e3)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    if r == 0:
        print(f"{name:7s} " + "  ".join(f"{k} {v:.3f}" for k, v in med.items())
              + f"  split-local {med['split'] - med['local']:+.3f}", flush=True)


for name in sys.argv[1].split(","):
    run(name, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
