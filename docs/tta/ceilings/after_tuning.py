"""Case a of issue 20 at 2 ranks: the training step under auto's setting before and
after `--auto`'s tuning has run in the same processes.

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/after_tuning.py [freeze]

With `freeze`, every phase starts with `gc.freeze()`, as `layerpar train` does after
its first step and after each gradient check (the cyclic collector then never scans
what existed before).

One job, in this order, each phase 10 warm-up steps then the median of 60 timed
training steps (zero_grad, forward, loss, backward, fused Adam) on the 1,024-layer
dense MNIST-1D net (width 32, T = 1, batch 128), one thread per rank:

1. a fixed `LayerParallel` with auto's usual choice (3 levels, cf 8, 1/1, batched),
   three times (new models, the net training on): the control, what training alone
   does to the step;
2. `LayerParallel(net, comm, "auto")` tuned as `layerpar train --auto` tunes (online:
   replicated serial trains the first steps, then the full tuning), then its steps;
3. a new fixed `LayerParallel` like 1, built after 2 in the same processes.

Also the optimizer's step alone, split into its parts (rank 0, per step): where
fused Adam's 8 ms go at 1,026 parameter tensors.
"""
import gc
import statistics
import sys
import time

import torch
from case_a import comm, net, opts, x_tr, y_tr
from torch import nn

from layerpar.parallel import LayerParallel
from layerpar.parallel.autotune import auto_policy

FREEZE = "freeze" in sys.argv[1:]


def fixed() -> LayerParallel:
    return LayerParallel(net, comm, opts, opts, batched=True)


def steps(model: nn.Module, label: str, warm: int = 10, timed: int = 60) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def one(i: int) -> None:
        i %= 120
        x, y = x_tr[i * 128:(i + 1) * 128], y_tr[i * 128:(i + 1) * 128]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for i in range(warm):
        one(i)
    if FREEZE:
        gc.freeze()
    comm.Barrier()
    ts = []
    for i in range(timed):
        t = time.perf_counter()
        one(warm + i)
        ts.append(time.perf_counter() - t)
    med = comm.gather(statistics.median(ts) * 1e3)
    if comm.rank == 0:
        print(f"{label}: step median {max(med):.1f} ms (ranks: "
              + ", ".join(f"{m:.1f}" for m in med) + ")", flush=True)
    if label.startswith("1."):  # the optimizer's parts, rank 0
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        state = [opt.state[p] for p in params]
        avg, sq = [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state]
        counts = [s["step"] for s in state]
        parts = {
            "whole opt.step()": lambda: opt.step(),
            "torch._foreach_add_(step counts, 1)": lambda: torch._foreach_add_(counts, 1),
            "torch._fused_adam_ (the arithmetic)": lambda: torch._fused_adam_(
                params, grads, avg, sq, [], counts, lr=1e-4, beta1=0.9, beta2=0.999,
                weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False),
        }
        if comm.rank == 0:
            for name, fn in parts.items():
                fn()
                t = time.perf_counter()
                for _ in range(50):
                    fn()
                print(f"  {name}: {(time.perf_counter() - t) / 50 * 1e3:.2f} ms "
                      f"({len(params)} tensors)", flush=True)
        comm.Barrier()


steps(fixed(), "1. fixed L3 cf8 1/1 batched, before any tuning")
steps(fixed(), "1b. the same again (a new model), no tuning")
steps(fixed(), "1c. the same again (a new model), no tuning")
auto = LayerParallel(net, comm, "auto", accuracy=auto_policy(None))
auto.tune(x_tr[:128], y_tr[:128], nn.functional.cross_entropy, steps=1000, online=True)
steps(auto, "2. --auto, tuned online on its first steps (all inside the 10 warm-up steps)")
if comm.rank == 0:
    print("   auto chose:", auto.tuner.choice_name(2), flush=True)
steps(fixed(), "3. fixed L3 cf8 1/1 batched, built after the tuning")
