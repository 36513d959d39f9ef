"""MPI worker: the batched (vectorised) cycle against the per-step cycle.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_batched.py OUT.json
For Dense, Conv and a user-written pre-norm block (LayerNorm, vmapped), in float64 and
float32, with "injection" and "average" coarsening (37 and 21 steps, cfactor 3: the
last coarse interval of a level is truncated), inexact (3 levels, 2/1 iterations,
the setting where a difference in the schedule would show) and converged: outputs,
input gradient and every parameter gradient of LayerParallel(batched=True) against
LayerParallel(batched=False), and the converged batched run against the serial
oracle.  Rank 0 writes the worst relative
differences (over all ranks) per case to OUT.json.
"""
import copy
import json
import sys

import torch
from mpi4py import MPI

import layerpar
from layerpar import MGRITOptions
from layerpar.ode import Segment, blocks
from layerpar.parallel import adjoint
from layerpar.parallel.adjoint import AdjointApp

comm = MPI.COMM_WORLD
SPARSE = [0]  # adjoint steps of a few rows of a record, stepped again (AdjointApp._rows_vjp)
_rows_vjp = AdjointApp._rows_vjp


def _counted(self, rec, rows, cot, final):
    SPARSE[0] += len(rows)
    return _rows_vjp(self, rec, rows, cot, final)


AdjointApp._rows_vjp = _counted
adjoint.RESTEP_MIN_ROWS = 1  # these nets' records are small: restep them anyway, to check it


class PreNormMLP(torch.nn.Module):
    """A user's own residual block: LayerNorm, then an MLP (no batched method)."""

    def __init__(self, w):
        super().__init__()
        self.norm = torch.nn.LayerNorm(w)
        self.fc1 = torch.nn.Linear(w, 2 * w)
        self.fc2 = torch.nn.Linear(2 * w, w)

    def forward(self, u):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(u))))


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


NETS = {
    "dense": (lambda: layerpar.ODENet(open=torch.nn.Linear(3, 6),
                                      steps=lambda k: blocks.Dense(6), n_steps=37,
                                      t_final=3.0, close=torch.nn.Linear(6, 5)), (9, 3)),
    "conv": (lambda: layerpar.ODENet(layers=[
        torch.nn.Conv2d(1, 3, 3, padding=1), Segment(lambda k: blocks.Conv(3), 21, 2.0),
        torch.nn.Flatten(), torch.nn.Linear(3 * 5 * 5, 5)]), (4, 1, 5, 5)),
    "prenorm": (lambda: layerpar.ODENet(open=torch.nn.Linear(3, 6),
                                        steps=lambda k: PreNormMLP(6), n_steps=33,
                                        t_final=3.0, close=torch.nn.Linear(6, 5)), (9, 3)),
}


def run(net, x, y, fwd, bwd, batched, coarsening):
    model = layerpar.LayerParallel(copy.deepcopy(net), comm, fwd, bwd, batched=batched,
                                   coarsening=coarsening)
    xp = x.clone().requires_grad_()
    out = model(xp)
    torch.nn.functional.cross_entropy(out, y).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    used = all(r.bb is not None for r in model._runners.values())
    stats = (model.last_forward[0].iterations, model.last_backward[0].iterations,
             model.last_forward[0].residual_history)
    model.close()
    return out.detach(), xp.grad, grads, used, stats


def main():
    results = {}
    inexact = (MGRITOptions(max_levels=3, cfactor=3, max_iter=2, tol=0.0),
               MGRITOptions(max_levels=3, cfactor=3, max_iter=1, tol=0.0))
    exact = (MGRITOptions(max_levels=3, cfactor=3, max_iter=40, tol=1e-13),
             MGRITOptions(max_levels=3, cfactor=3, max_iter=40, tol=1e-13))
    for dtype, coarsening in ((torch.float64, "injection"), (torch.float32, "injection"),
                              (torch.float64, "average"), (torch.float32, "average")):
        for name, (make, shape) in NETS.items():
            for mode, (fwd, bwd) in (("inexact", inexact), ("exact", exact)):
                if dtype == torch.float32 and mode == "exact":
                    continue
                torch.manual_seed(0)
                net = make().to(dtype)
                x = torch.randn(*shape, dtype=dtype)
                y = torch.randint(0, 5, (shape[0],))
                SPARSE[0] = 0
                b = run(net, x, y, fwd, bwd, True, coarsening)
                sparse = comm.allreduce(SPARSE[0])
                u = run(net, x, y, fwd, bwd, False, coarsening)
                diff = max([rel(b[0], u[0]), rel(b[1], u[1])]
                           + [rel(b[2][n], u[2][n]) for n in b[2]])
                r = {"batched_vs_steps": comm.allreduce(diff, op=MPI.MAX),
                     "batched_used": comm.allreduce(int(b[3]), op=MPI.MIN) == 1,
                     "sparse_rows": sparse, "iters": list(b[4][:2]), "iters_steps": list(u[4][:2]),
                     "history": b[4][2], "history_steps": u[4][2]}
                if mode == "exact":
                    ref = copy.deepcopy(net)
                    xr = x.clone().requires_grad_()
                    ro = ref(xr)
                    torch.nn.functional.cross_entropy(ro, y).backward()
                    refp = dict(ref.named_parameters())
                    err = max([rel(b[0], ro.detach()), rel(b[1], xr.grad)]
                              + [rel(g, refp[n].grad) for n, g in b[2].items()])
                    r["oracle"] = comm.allreduce(err, op=MPI.MAX)
                results[f"{name} {mode} {str(dtype)[6:]} {coarsening}"] = r
    if comm.Get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
