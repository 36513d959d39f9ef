"""Auto's tuning of case a's net at one rank (1,024 dense layers x 32, batch 128 of
random MNIST-1D-shaped data), with and without `batched.same_structures` (each module's
structure computed once per tuning, not once per candidate model), in turn, three
rounds: the tuning's seconds and its choice.

    python docs/tta/ceilings/tune_builds.py
"""
import contextlib
import time

import torch

import layerpar.parallel.autotune as at
from layerpar import LayerParallel
from layerpar.apps.nets import problem_net

torch.set_num_threads(1)
torch.manual_seed(0)
net = problem_net("mnist1d", 1024, 32, arch="dense", t_final=1.0)
x, y = torch.randn(128, 40), torch.randint(0, 10, (128,))
real = at.same_structures
for _ in range(3):
    for mode in ("cache", "none"):
        at.same_structures = real if mode == "cache" else contextlib.nullcontext
        m = LayerParallel(net, None, "auto")
        t0 = time.perf_counter()
        r = m.tune(x, y, torch.nn.functional.cross_entropy, steps=1000)
        print(mode, round(time.perf_counter() - t0, 3), r.choice.candidate.name(1))
        m.close()
