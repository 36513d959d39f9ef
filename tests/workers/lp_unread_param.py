"""MPI worker: a block with a trainable parameter its forward never reads, on the
batched (vectorised) path at 2 processes, against the per-step path.

Run: mpiexec -n 2 python -m mpi4py tests/workers/lp_unread_param.py layers|data
layers: one segment over both ranks, every adjoint step of a few rows of a record
    stepped again (`AdjointApp._rows_vjp`: the rows next to the rank boundary);
data: two data replicas of one rank each (`ProcessGrid(data=2)`), whose gradients are
    averaged record by record.
Each rank reports ``RANK r <worst relative difference of the read parameters'
gradients> <names of unread parameters given a gradient, or ->``.
"""
import copy
import sys

import torch
from mpi4py import MPI

import layerpar
from layerpar import MGRITOptions
from layerpar.parallel import adjoint

comm = MPI.COMM_WORLD
adjoint.RESTEP_MIN_ROWS = 1  # a small net's records: restep a few rows anyway


class Unread(torch.nn.Module):
    """A residual branch with a trainable parameter its forward never reads."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(w, w)
        self.unread = torch.nn.Parameter(torch.ones(w))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(u))


def main(mode: str) -> None:
    torch.manual_seed(0)
    net = layerpar.ODENet(open=torch.nn.Linear(3, 5), steps=lambda k: Unread(5),
                          n_steps=24, t_final=1.0, close=torch.nn.Linear(5, 4)).double()
    x = torch.randn(6, 3, dtype=torch.float64)[comm.rank::2] if mode == "data" else \
        torch.randn(6, 3, dtype=torch.float64)
    y = torch.arange(x.shape[0]) % 4
    opts = MGRITOptions(max_levels=3, cfactor=2, max_iter=2, tol=0.0)
    grads = []
    for batched in (True, False):
        if mode == "data":
            grid = layerpar.ProcessGrid(comm, data=2, layers=1)
            m = layerpar.LayerParallel(copy.deepcopy(net), None, opts, opts,
                                       batched=batched, grid=grid)
        else:
            m = layerpar.LayerParallel(copy.deepcopy(net), comm, opts, opts, batched=batched)
        if batched and m._runners[1].vectorised is None:
            raise RuntimeError("the batched path was not taken")
        torch.nn.functional.cross_entropy(m(x), y).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
        m.close()
    worst, given = 0.0, []
    for name, g in grads[0].items():
        if name.endswith(".unread"):
            if g is not None or grads[1][name] is not None:
                given.append(name)
            continue
        want = grads[1][name]
        worst = max(worst, float((g - want).norm() / max(float(want.norm()), 1e-300)))
    sys.stdout.write(f"RANK {comm.rank} {worst:.3e} {','.join(given) or '-'}\n")


if __name__ == "__main__":
    main(sys.argv[1])
