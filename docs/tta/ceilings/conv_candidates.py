"""Case b of issue 20 at 2 ranks: every MGRIT structure at 1/1 iterations, batched
and per-step cycles: pass time (as `--auto` times it) and relative gradient error
against exact propagation, on the first training batch.

    mpiexec -n 2 python -m mpi4py docs/tta/ceilings/conv_candidates.py
"""
import torch
from mpi4py import MPI
from torch import nn

from layerpar.apps.train import build_net, load_data
from layerpar.parallel import LayerParallel
from layerpar.parallel.accuracy import check_gradients, exact_reference
from layerpar.parallel.autotune import STRUCTURES, Candidate, _build, _drop, _time_passes

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
x_tr, y_tr, _, _ = load_data("mnist1d", 0, torch.float32)
torch.manual_seed(0)
net = build_net("mnist1d", 256, 16, arch="conv", t_final=1.0)
model = LayerParallel(net, comm, "auto")
x, y = x_tr[:128], y_tr[:128]
loss = nn.functional.cross_entropy
ref = exact_reference(model, x, y, loss)
for levels, cf in list(STRUCTURES) + [(2, 16), (3, 16)]:
    for batched in (True, False):
        cand = Candidate(levels, cf, 1, 1, batched=batched)
        twin = _build(model, cand, None)
        t = _time_passes(model, twin, x, y, loss, 3)
        err = check_gradients(twin, x, y, loss, reference=ref).param_grad_error
        _drop(twin)
        if comm.rank == 0:
            print(f"L{levels} cf{cf} 1/1 {'batched ' if batched else 'per-step'} "
                  f"{1e3 * t:7.1f} ms per pass, gradient error {err:.3f}", flush=True)
