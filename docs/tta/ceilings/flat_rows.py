"""Case a of issue 20 at 2 ranks: the training step with the blocks' parameters kept
flat and the gradient rows reused, against the same step as it ran before.

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/flat_rows.py [steps]

The 1,024-layer dense MNIST-1D net (width 32, T = 1, batch 128) under auto's setting
(3 levels, cf 8, 1/1 iterations, batched), fused Adam, one thread per rank.  Two
`LayerParallel` models of copies of the net take turns step by step in one job:

- "now": the default (a vectorised step reads its layers' parameters as a strided
  view of the segment's flat rows, `layerpar.ode.flat`; after `zero_grad()` a pass
  writes its gradients into the last pass's rows);
- "before": its parameters given storage of their own after it is built (each step
  stacks copies of them) and its adjoint making new gradient rows every pass.

Per model: the median and the mean of the timed steps (zero_grad, forward, loss,
backward, optimizer step), the slowest rank's, and the time the parts that changed
took (`BatchedBlocks.stacked`, `AdjointApp.batched_grads`, per step, rank 0).
"""
import collections
import copy
import statistics
import sys
import time

import torch
from case_a import comm, net, opts, x_tr, y_tr
from torch import nn

from layerpar.parallel import LayerParallel, adjoint, batched

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
spent: collections.Counter = collections.Counter()
current = [""]


def timed(cls: type, name: str) -> None:
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[(current[0], name)] += time.perf_counter() - t

    setattr(cls, name, wrapper)


timed(batched.BatchedBlocks, "stacked")
timed(adjoint.AdjointApp, "batched_grads")

now = LayerParallel(copy.deepcopy(net), comm, opts, opts, batched=True)
before = LayerParallel(copy.deepcopy(net), comm, opts, opts, batched=True)
with torch.no_grad():
    for p in before.parameters():
        p.data = p.data.clone()
for runner in before._runners.values():
    runner.bapp.reuse_rows = False
models = {"now": now, "before": before}
optims = {k: torch.optim.Adam(m.parameters(), lr=1e-4, fused=True) for k, m in models.items()}
times: dict[str, list[float]] = {k: [] for k in models}

for i in range(10 + STEPS):
    j = i % 120
    x, y = x_tr[j * 128:(j + 1) * 128], y_tr[j * 128:(j + 1) * 128]
    for key in (("now", "before") if i % 2 else ("before", "now")):
        model, opt = models[key], optims[key]
        current[0] = key
        comm.Barrier()
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 10:
            times[key].append(time.perf_counter() - t)
        elif i == 9:
            spent.clear()

got = comm.gather(times)
if comm.rank == 0:
    print(f"case a, 2 ranks, {STEPS} timed steps per model, taking turns")
    for key in models:
        worst = [max(r[key][k] for r in got) for k in range(STEPS)]
        parts = ", ".join(f"{name} {1e3 * spent[(key, name)] / STEPS:.2f}"
                          for name in ("stacked", "batched_grads"))
        print(f"  {key:6s}: step median {1e3 * statistics.median(worst):6.1f} ms, "
              f"mean {1e3 * statistics.mean(worst):6.1f} ms (rank 0: {parts} ms per step)")
    ratio = statistics.median(max(r["now"][k] for r in got) for k in range(STEPS)) / \
        statistics.median(max(r["before"][k] for r in got) for k in range(STEPS))
    print(f"  now / before (medians): {ratio:.3f}")
