"""Case a of issue 20 as the ceiling scripts here measure it (imported by them: they run
from this folder): the 1,024-layer dense MNIST-1D net (width 32, T = 1), one thread per
rank, and the setting `--auto` chooses on it (3 levels, cf 8, 1/1 iterations, batched)."""
import torch
from mpi4py import MPI

from layerpar.apps.train import build_net, load_data
from layerpar.mgrit.options import MGRITOptions

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
x_tr, y_tr, _, _ = load_data("mnist1d", 0, torch.float32)
torch.manual_seed(0)
net = build_net("mnist1d", 1024, 32, arch="dense", t_final=1.0)
opts = MGRITOptions(max_levels=3, cfactor=8, max_iter=1, tol=0.0, rtol=0.0)
