import sys, time, torch
from mpi4py import MPI
import layerpar
from layerpar.apps.train import load_data, build_net
from layerpar.parallel.model import LayerParallel
from layerpar.mgrit.options import MGRITOptions
from layerpar.parallel import adjoint as A
comm = MPI.COMM_WORLD
torch.set_num_threads(1)

class PreNormMLP(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.norm = torch.nn.LayerNorm(w); self.fc1 = torch.nn.Linear(w, 2 * w); self.fc2 = torch.nn.Linear(2 * w, w)
    def forward(self, u):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(u))))

def nets():
    xt, yt, _, _ = load_data("mnist1d", 0, torch.float32)
    torch.manual_seed(0)
    yield "dense 1024x32", build_net("mnist1d", 1024, 32, arch="dense", t_final=1.0), xt[:128], yt[:128]
    torch.manual_seed(0)
    yield "conv 256x16", build_net("mnist1d", 256, None, arch="conv", t_final=1.0), xt[:128], yt[:128]
    torch.manual_seed(0)
    yield "prenorm 256x32", layerpar.ODENet(open=torch.nn.Linear(40, 32), steps=lambda k: PreNormMLP(32), n_steps=256, t_final=1.0, close=torch.nn.Linear(32, 10)), xt[:128], yt[:128]
    xp, yp, _, _ = load_data("peaks", 0, torch.float32)
    torch.manual_seed(0)
    yield "peaks 32x8", build_net("peaks", 32, 8), xp[:100], yp[:100]

for name, net, x, y in nets():
    for L, cf in ((3, 8), (2, 4)):
        o = MGRITOptions(max_levels=L, cfactor=cf, max_iter=1, tol=0.0)
        model = LayerParallel(net, comm, o, o)
        t = {0.5: [], 0.0: []}
        for rep in range(12):
            for share in (0.5, 0.0):
                A.RESTEP_SHARE = share
                comm.Barrier(); a = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward()
                d = comm.allreduce(time.perf_counter() - a, op=MPI.MAX)
                if rep >= 2: t[share].append(d)
        model.close()
        if comm.rank == 0:
            m = {k: sorted(v)[len(v)//2] * 1e3 for k, v in t.items()}
            print(f"{name:16s} L{L} cf{cf}: restep {m[0.5]:7.2f} ms  whole-record {m[0.0]:7.2f} ms  ratio {m[0.5]/m[0.0]:.3f}", flush=True)
