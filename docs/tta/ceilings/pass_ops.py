"""Case a of issue 20 at 2 ranks: what auto's MGRIT pass evaluates, and what its
arithmetic costs inside the pass against the same operations alone.

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/pass_ops.py

The 1,024-layer dense MNIST-1D net (width 32, T = 1, batch 128) under the setting
`--auto` chooses on it (3 levels, cf 8, 1/1 iterations, batched cycles).

1. Every vectorised step of one forward and backward pass, counted by phase, rows
   (intervals advanced at once) and span (1: a fine step, 8: a coarse one): how many
   layer evaluations a rank makes for its 512 layers.
2. The torch profiler over one more pass (rank 0): per operation and input shape,
   the calls and the mean time per call.
3. The largest shapes' operations again on rank 0 alone, repeated on the same
   tensors (which then sit in the caches), for comparison with 2.
"""
import collections
import time

import torch
from case_a import comm, net, opts, x_tr, y_tr
from torch import nn
from torch.profiler import profile

from layerpar.parallel import LayerParallel, batched

model = LayerParallel(net, comm, opts, opts, batched=True)
x, y = x_tr[:128], y_tr[:128]


def one_pass() -> None:
    global phase
    phase = "forward"
    out = model(x)
    phase = "backward"
    nn.functional.cross_entropy(out, y).backward()


for _ in range(3):
    one_pass()

# 1. the vectorised steps of one pass
steps: collections.Counter = collections.Counter()
phase = ""
original = batched.BatchedBlocks.step


def counted(self, xs, pairs, params=None):  # type: ignore[no-untyped-def]
    steps[(phase, len(pairs), pairs[0][1] - pairs[0][0])] += 1
    return original(self, xs, pairs, params)


batched.BatchedBlocks.step = counted  # type: ignore[method-assign]
one_pass()
batched.BatchedBlocks.step = original  # type: ignore[method-assign]
counts = comm.gather(steps)
if comm.rank == 0:
    for rank, c in enumerate(counts):
        print(f"rank {rank}: vectorised steps (phase, rows, span): calls")
        for key, calls in sorted(c.items()):
            print(f"  {key}: {calls}")
        fine = sum(rows * n for (ph, rows, span), n in c.items() if ph == "forward" and span == 1)
        coarse = sum(rows * n for (ph, rows, span), n in c.items() if ph == "forward" and span > 1)
        print(f"  forward: {fine} fine and {coarse} coarse layer evaluations for 512 layers")

# 2. the operations inside a pass
comm.Barrier()
with profile(record_shapes=True) as prof:
    one_pass()
comm.Barrier()
wanted = ("aten::baddbmm", "aten::bmm", "aten::tanh", "aten::tanh_backward", "aten::addcmul",
          "aten::mul", "aten::addmm", "aten::mm")
if comm.rank == 0:
    print("rank 0, one pass: operation, input shapes, calls, mean us per call")
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in wanted]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    for e in rows[:14]:
        print(f"  {e.key:22s} {str(e.input_shapes)[:60]:60s} {e.count:3d} "
              f"{e.self_cpu_time_total / e.count:7.0f}")

    # 3. the same operations alone, their operands in cache
    def alone(fn) -> float:  # type: ignore[no-untyped-def]
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50):
                fn()
            best = min(best, (time.perf_counter() - t) / 50)
        return 1e6 * best

    u, g = torch.randn(64, 128, 32), torch.randn(64, 128, 32)
    w, b = torch.randn(64, 32, 32), torch.randn(64, 1, 32)
    dt = torch.full((64, 1, 1), 1 / 1024)
    t_ = torch.tanh(u)
    print("rank 0, alone, [64, 128, 32]: us per call")
    for name, fn in (("baddbmm", lambda: torch.baddbmm(b, u, w.transpose(1, 2))),
                     ("bmm (state gradient)", lambda: torch.bmm(g, w)),
                     ("bmm (weight gradient)", lambda: torch.bmm(u.transpose(1, 2), g)),
                     ("tanh", lambda: torch.tanh(u)),
                     ("tanh_backward", lambda: torch.ops.aten.tanh_backward(g, t_)),
                     ("addcmul", lambda: torch.addcmul(u, dt, t_))):
        print(f"  {name:22s} {alone(fn):7.0f}")
