"""Case a of issue 20 at 2 ranks: a training step's parts before and after `--auto`'s
tuning in the same processes, under the C library's malloc or another one.

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/allocator.py
    mpiexec -n 2 -env LD_PRELOAD /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
        python -m mpi4py docs/tta/ceilings/allocator.py

Each phase: a new optimizer (fused Adam), 10 warm-up steps, then the medians of 60
steps' parts (zero_grad, forward with the loss, backward, optimizer step) per rank.
Phases: two fixed models with auto's usual setting (3 levels, cf 8, 1/1, batched),
`--auto` tuned as `layerpar train --auto` tunes (online), then two more fixed models
built after the tuning.  Outputs: `allocator.txt`.
"""
import gc
import statistics
import time

import torch
from case_a import comm, net, opts, x_tr, y_tr
from torch import nn

from layerpar.parallel import LayerParallel
from layerpar.parallel.autotune import auto_policy


def steps(label: str, model: nn.Module = None, warm: int = 10, timed: int = 60) -> None:
    model = model or LayerParallel(net, comm, opts, opts, batched=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    parts: dict[str, list[float]] = {k: [] for k in ("zero", "fwd", "bwd", "opt")}

    def one(i: int, rec: bool) -> None:
        i %= 120
        x, y = x_tr[i * 128:(i + 1) * 128], y_tr[i * 128:(i + 1) * 128]
        t0 = time.perf_counter()
        opt.zero_grad()
        t1 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if rec:
            for k, a, b in (("zero", t0, t1), ("fwd", t1, t2), ("bwd", t2, t3),
                            ("opt", t3, t4)):
                parts[k].append(b - a)

    for i in range(warm):
        one(i, False)
    gc.freeze()
    comm.Barrier()
    for i in range(timed):
        one(warm + i, True)
    med = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    got = comm.gather(med)
    if comm.rank == 0:
        print(label, " | ".join(" ".join(f"{k} {v:5.2f}" for k, v in g.items())
                                for g in got), flush=True)


steps("control  ")
steps("control  ")
auto = LayerParallel(net, comm, "auto", accuracy=auto_policy(None))
auto.tune(x_tr[:128], y_tr[:128], nn.functional.cross_entropy, steps=1000, online=True)
steps("auto     ", auto)
steps("after    ")
steps("after    ")
