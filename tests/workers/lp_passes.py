"""MPI worker: passes that behave like PyTorch's (several forwards before a backward).

Run: mpiexec -n P python -m mpi4py tests/workers/lp_passes.py OUT.json
Every case is run on the serial ODENet oracle and on LayerParallel (batched and
per-step cycles, converged MGRIT, float64); each rank compares its own parameter
gradients and the input gradients; rank 0 writes the worst relative error per case.
Also importable: `run_cases(comm)` runs the same on one process.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import sys
import warnings

import torch

import layerpar
from layerpar.mgrit import MGRITOptions
from layerpar.ode import blocks

CONVERGED = MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=50)
ce = torch.nn.functional.cross_entropy


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def net16() -> layerpar.ODENet:
    torch.manual_seed(3)
    return layerpar.ODENet(open=torch.nn.Linear(3, 4),
                           steps=lambda k: blocks.Dense(4, activation="tanh"),
                           n_steps=16, t_final=2.0, close=torch.nn.Linear(4, 5)).double()


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (n,), generator=g))


def _two_forwards(m: torch.nn.Module, xs: list) -> None:
    (xa, ya), (xb, yb) = xs
    (ce(m(xa), ya) + 0.5 * ce(m(xb), yb)).backward()


def _no_grad_between(m: torch.nn.Module, xs: list) -> None:
    (xa, ya), (xb, _) = xs
    loss = ce(m(xa), ya)
    with torch.no_grad():
        m(xb)  # an evaluation batch between the forward and its backward
    loss.backward()


def _later_backward_first(m: torch.nn.Module, xs: list) -> None:
    (xa, ya), (xb, yb) = xs
    la = ce(m(xa), ya)
    lb = ce(m(xb), yb)
    lb.backward()
    la.backward()


def _micro_batches(m: torch.nn.Module, xs: list) -> None:
    (x, y), _ = xs
    for xi, yi in zip(x.chunk(4), y.chunk(4)):
        (ce(m(xi), yi) / 4).backward()


def _full_batch(m: torch.nn.Module, xs: list) -> None:
    (x, y), _ = xs
    ce(m(x), y).backward()


def _output_in_place(m: torch.nn.Module, xs: list) -> None:
    (x, y), _ = xs
    out = m(x)
    out.mul_(2.0)  # (autograd refuses this on a view a Function returns)
    ce(out, y).backward()


CASES = {"two forwards, one backward": (_two_forwards, _two_forwards),
         "no_grad forward between": (_no_grad_between, _no_grad_between),
         "later backward first": (_later_backward_first, _later_backward_first),
         # k micro-batches accumulated == one batch of k times the size (exact mode)
         "4 micro-batches == one batch": (_micro_batches, _full_batch),
         "output changed in place": (_output_in_place, _output_in_place)}


def run_cases(comm) -> dict[str, float]:
    """Worst relative gradient error per case and cycle kind (this rank's layers)."""
    out: dict[str, float] = {}
    for name, (par_case, ser_case) in CASES.items():
        for batched in (True, False):
            net = net16()
            ref = copy.deepcopy(net)
            (xa, ya), (xb, yb) = _data(8, 0), _data(6, 1)
            xr = [(xa.clone().requires_grad_(), ya), (xb.clone().requires_grad_(), yb)]
            xp = [(xa.clone().requires_grad_(), ya), (xb.clone().requires_grad_(), yb)]
            ser_case(ref, xr)
            model = layerpar.LayerParallel(net, comm, CONVERGED, CONVERGED, batched=batched)
            par_case(model, xp)
            refp = dict(ref.named_parameters())
            worst = max(rel(p.grad, refp[n].grad) for n, p in model.named_parameters())
            if par_case is ser_case:  # the same inputs: their gradients too
                worst = max(worst, rel(xp[0][0].grad, xr[0][0].grad))
            out[f"{name}, batched={batched}"] = worst
            model.close()
    return out


class _Scaled(torch.nn.Module):
    """A user's block with a learnable scalar and a parameter its forward never uses
    (serial autograd leaves that one's gradient None)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.alpha = torch.nn.Parameter(torch.tensor(0.7))
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.alpha * torch.tanh(self.linear(u))


def unused_parameters(comm) -> float:
    """Blocks holding a parameter they do not use (`_Scaled`), each cycle path
    (vectorised, per-step, timed): the worst relative error of this rank's other
    gradients against serial's, inf where an unused parameter got a gradient (serial
    leaves it None)."""
    worst = 0.0
    for batched in (True, False, "auto"):
        torch.manual_seed(5)
        ref = layerpar.ODENet(open=torch.nn.Linear(3, 4), steps=lambda k: _Scaled(),
                              n_steps=16, close=torch.nn.Linear(4, 5)).double()
        model = layerpar.LayerParallel(copy.deepcopy(ref), comm, CONVERGED, batched=batched)
        x, y = _data(8, 2)
        for m in (ref, model):
            ce(m(x), y).backward()
        refp = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if n.endswith(".unused"):
                worst = worst if p.grad is None else math.inf
            else:
                worst = max(worst, rel(p.grad, refp[n].grad))
        model.close()
    return worst


def segment_last_in_place(comm) -> float:
    """The worst relative gradient error against serial's of a net whose last layer is a
    segment (the output its last state, on the last rank, which the others receive),
    its output changed in place before the loss: as serial autograd allows."""
    torch.manual_seed(6)
    ref = layerpar.ODENet(layers=[
        torch.nn.Linear(3, 5),
        layerpar.ode.Segment(lambda k: blocks.Dense(5, activation="tanh"), 16, 1.0)]).double()
    model = layerpar.LayerParallel(copy.deepcopy(ref), comm, CONVERGED, CONVERGED)
    xs = [_data(8, 4), _data(6, 5)]
    for m in (ref, model):
        _output_in_place(m, xs)
    refp = dict(ref.named_parameters())
    worst = max(rel(p.grad, refp[n].grad) for n, p in model.named_parameters())
    model.close()
    return worst


def tensors_alive() -> int:
    gc.collect()
    with warnings.catch_warnings():  # is_tensor on deprecated torch objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


def dropped_outputs_growth(comm) -> int:
    """Live tensors after 100 forwards whose outputs are dropped, minus after 10."""
    model = layerpar.LayerParallel(net16(), comm, CONVERGED, CONVERGED)
    x, _ = _data(8, 0)
    counts = []
    for k in range(100):
        model(x)
        if k in (9, 99):
            counts.append(tensors_alive())
    model.close()
    return counts[1] - counts[0]


def auto_choice(comm) -> tuple:
    """batched="auto" on a two-convolution block: (chosen path, measured seconds), and
    the gradient error against the per-step path."""
    def conv_net() -> layerpar.ODENet:
        torch.manual_seed(5)
        return layerpar.ODENet(layers=[
            torch.nn.Conv2d(1, 3, 3, padding=1),
            layerpar.ode.Segment(lambda k: torch.nn.Sequential(
                torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.ReLU(),
                torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.Tanh()), 12, 1.0),
            torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 5)]).double()

    x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 5, (4,))
    opts = MGRITOptions(max_levels=2, cfactor=2, max_iter=2)
    grads = []
    for batched in ("auto", False):
        model = layerpar.LayerParallel(conv_net(), comm, opts, batched=batched)
        ce(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        if batched == "auto":
            (choice,) = model.cycle_paths[0].values()
        model.close()
    err = max(rel(g, grads[1][n]) for n, g in grads[0].items())
    return (choice.batched, choice.vectorised_s, choice.per_step_s), err


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    errs = run_cases(comm)
    errs["tensor growth"] = float(dropped_outputs_growth(comm))
    errs["unused parameters"] = unused_parameters(comm)
    errs["segment last, output changed in place"] = segment_last_in_place(comm)
    choice, errs["auto vs per-step"] = auto_choice(comm)
    got = comm.gather((errs, choice), root=0)
    if comm.rank == 0:
        worst = {k: max(e[k] for e, _ in got) for k in got[0][0]}
        worst["auto choices agree"] = all(c == got[0][1] for _, c in got)
        with open(sys.argv[1], "w") as f:
            json.dump(worst, f)


if __name__ == "__main__":
    main()
