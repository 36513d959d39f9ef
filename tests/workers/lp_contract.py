"""MPI worker: ranks that differ in what they differentiate.  Every rank prints
`RANK <r> OK` when its outputs and gradients equal the serial oracle's (float64,
<= 1e-10 relative), else `RANK <r> <ExceptionType>: <message>`.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_contract.py CASE
"""
import copy
import sys

import torch
from mpi4py import MPI

import layerpar
from layerpar.ode import blocks

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
OPTS = layerpar.MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=40)


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def net():
    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(3, 4), steps=lambda k: blocks.Dense(4),
                           n_steps=12, t_final=1.0, close=torch.nn.Linear(4, 5)).double()


def check(model, ref, x_here, x_ref):
    torch.manual_seed(1)
    y = torch.randint(0, 5, (6,))
    torch.nn.functional.cross_entropy(model(x_here), y).backward()
    torch.nn.functional.cross_entropy(ref(x_ref), y).backward()
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        want = refp[n].grad
        if (p.grad is None) != (want is None):
            raise AssertionError(f"{n}: grad {p.grad is not None}, oracle {want is not None}")
        if want is not None and rel(p.grad, want) > 1e-10:
            raise AssertionError(f"{n}: relative error {rel(p.grad, want)}")


def case_frozen_rank():
    """Fine-tune the head only: every parameter but the classifier's is frozen, so the
    ranks without the classifier have nothing of their own to differentiate."""
    base = net()
    for n, p in base.named_parameters():
        p.requires_grad_(n.startswith("layers.2."))
    ref = copy.deepcopy(base)
    model = layerpar.LayerParallel(base, comm, OPTS, OPTS)
    x = torch.randn(6, 3, dtype=torch.float64)
    check(model, ref, x, x)


def case_x_requires_grad_differs():
    base = net()
    ref = copy.deepcopy(base)
    model = layerpar.LayerParallel(base, comm, OPTS, OPTS)
    x = torch.randn(6, 3, dtype=torch.float64)
    xp = x.clone().requires_grad_(rank == 1)  # not the broadcast root
    xr = x.clone().requires_grad_()
    check(model, ref, xp, xr)
    if rank == 1 and rel(xp.grad, xr.grad) > 1e-10:
        raise AssertionError(f"x.grad relative error {rel(xp.grad, xr.grad)}")
    if rank != 1 and xp.grad is not None:
        raise AssertionError("x.grad set on a rank whose x does not require grad")


def main():
    case = sys.argv[1]
    try:
        globals()["case_" + case]()
        print(f"RANK {rank} OK", flush=True)
    except Exception as exc:  # noqa: BLE001 - report what each rank saw
        msg = str(exc).replace("\n", " ")
        print(f"RANK {rank} {type(exc).__name__}: {msg}", flush=True)


if __name__ == "__main__":
    main()
