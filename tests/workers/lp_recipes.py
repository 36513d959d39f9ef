"""MPI worker: the MNIST-1D ResNets of ``layerpar train`` (`mnist1d_resnet`: three
segments with batch norm and strided convolutions between them; `mnist1d_prenorm`:
pre-norm dense blocks) under LayerParallel against the serial oracle.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_recipes.py
Each tiny float64 net runs one training-mode forward and backward under each setting:
"exact" (one level: sequential sweeps) and "converged" (two-level MGRIT, coarsening
factor 2, to `SOLVER_TOL`, vectorised cycles where the blocks allow them).  Each rank
reports ``RANK <r> <arch> <setting> out <err> x <err> params <err> batched <flags>``:
the relative errors of the output, the input gradient and its own parameters'
gradients (the largest), and per segment whether its cycles ran vectorised (1) or
layer by layer (0), and the most forward iterations any segment took.
"""
import copy
import sys
import warnings
from pathlib import Path

import torch
from mpi4py import MPI

import layerpar
from layerpar.apps.nets import mnist1d_prenorm, mnist1d_resnet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import SOLVER_TOL  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
warnings.filterwarnings("ignore", "layerpar: residual block")  # (not vectorised: BN)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


NETS = {"resnet": lambda: mnist1d_resnet(12, 2, 1.0),
        "prenorm": lambda: mnist1d_prenorm(8, 6, 4.0)}
SETTINGS = {"exact": layerpar.MGRITOptions(max_levels=1),
            "converged": layerpar.MGRITOptions(max_levels=2, cfactor=2, tol=SOLVER_TOL,
                                               max_iter=60)}
gen = torch.Generator().manual_seed(3)
x = torch.randn(6, 40, generator=gen, dtype=torch.float64)
y = torch.randint(0, 10, (6,), generator=gen)
for arch, make in NETS.items():
    for setting, opts in SETTINGS.items():
        torch.manual_seed(1)
        net = make().double()
        ref = copy.deepcopy(net)
        xr = x.clone().requires_grad_()
        out_r = ref(xr)
        torch.nn.functional.cross_entropy(out_r, y).backward()
        model = layerpar.LayerParallel(net, comm, opts, opts, batched=True)
        xp = x.clone().requires_grad_()
        out = model(xp)
        torch.nn.functional.cross_entropy(out, y).backward()
        refp = dict(ref.named_parameters())
        params = max(rel(p.grad, refp[n].grad) for n, p in model.named_parameters())
        flags = "".join(str(int(c.batched)) for paths in model.cycle_paths
                        for c in paths.values()) or "-"
        sys.stdout.write(f"RANK {rank} {arch} {setting} out {rel(out.detach(), out_r.detach()):.3e}"
                         f" x {rel(xp.grad, xr.grad):.3e} params {params:.3e} "
                         f"batched {flags} iters "
                         f"{max(s.iterations for s in model.last_forward)}\n")
        sys.stdout.flush()
        model.close()
