"""MPI worker: the edges of shared and tied parameters, each printing one line per rank.

Run: mpiexec -n 2 python -m mpi4py tests/workers/lp_shared_edges.py CASE

- `dedup`: a whole-net state dict keeping one name per tied tensor (as savers that
  drop aliases write it), loaded with strict=False into a built model, and one whose
  tied names hold other values: every rank's copy takes the value the serial net keeps.
- `freeze`: a tied weight frozen on one of the two ranks that hold it: refused by name
  (the other copy would go on training).
- `tied-on-one-rank`: a net tied on rank 0 only: refused at construction.
- `shared-bn`: one batch norm with running statistics in every step: refused.
- `deepcopy`: `copy.deepcopy(model)` says why it cannot be done.
- `tuple-head`: a closing layer returning a tuple: refused by name on every rank.
- `two-forwards-auto`: under ``options="auto"`` (replicated serial on this tiny net),
  two forwards and one backward with a tied weight: serial's gradients (the refresh
  between the passes wrote into the tied tensor a pending backward had saved).
- `autocast-switch`: a bfloat16-autocast pass, then a float16 one, then a plain one, on
  the same input shape: outputs equal serial's in each.
"""
from __future__ import annotations

import copy
import sys

import torch
from mpi4py import MPI

from layerpar import LayerParallel
from layerpar.mgrit import MGRITOptions
from layerpar.ode import ODENet
from layerpar.ode.blocks import Dense

comm = MPI.COMM_WORLD
EXACT = MGRITOptions(max_levels=1)


def say(text: str) -> None:
    """One line per rank, in rank order (lines printed at once may interleave)."""
    for r in range(comm.Get_size()):
        if r == comm.Get_rank():
            print(f"RANK {r} {text}", flush=True)
        comm.Barrier()


def tied(tie: bool = True) -> ODENet:
    torch.manual_seed(0)
    net = ODENet(torch.nn.Linear(4, 4), lambda k: Dense(4), 8, 2.0,
                 torch.nn.Linear(4, 4)).double()
    if tie:
        net.layers[2].weight = net.layers[0].weight
    return net


class TupleHead(torch.nn.Module):
    """A closing layer returning (logits, features), as a serial net may."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4).double()

    def forward(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(u), u


def error_of(fn) -> str:
    try:
        fn()
        return "none"
    except Exception as exc:  # noqa: BLE001 - reported for the test to read
        return f"{type(exc).__name__}: {exc}"


def main(case: str) -> None:
    if case == "dedup":
        serial = tied()
        model = LayerParallel(copy.deepcopy(serial), comm, EXACT)
        new = {k: v + 1.0 for k, v in serial.state_dict().items() if k != "layers.2.weight"}
        serial.load_state_dict(new, strict=False)
        model.load_state_dict(new, strict=False)
        full = model.gather_state_dict()
        err = max(float((full[k] - v).abs().max()) for k, v in serial.state_dict().items())
        other = dict(serial.state_dict())  # tied names with other values: the last wins
        other["layers.0.weight"] = other["layers.0.weight"] * 0 + 1.0
        other["layers.2.weight"] = other["layers.2.weight"] * 0 + 2.0
        serial.load_state_dict(other)
        model.load_state_dict(other)
        full = model.gather_state_dict()
        err2 = max(float((full[k] - v).abs().max()) for k, v in serial.state_dict().items())
        say(f"dedup {err:.3e} values {err2:.3e}")
    elif case == "freeze":
        model = LayerParallel(tied(), comm, EXACT)
        if comm.Get_rank() == 0:
            model.layers[0].weight.requires_grad_(False)
        x = torch.randn(3, 4, dtype=torch.float64)
        say("error " + error_of(lambda: model(x)))
    elif case == "tied-on-one-rank":
        say("error " + error_of(lambda: LayerParallel(tied(comm.Get_rank() == 0), comm,
                                                        EXACT)))
    elif case == "shared-bn":
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        net = ODENet(torch.nn.Linear(4, 4), lambda k: block, 8, 2.0, torch.nn.Linear(4, 4))
        say("error " + error_of(lambda: LayerParallel(net, comm, EXACT)))
    elif case == "deepcopy":
        model = LayerParallel(tied(), comm, EXACT)
        say("error " + error_of(lambda: copy.deepcopy(model)))
    elif case == "tuple-head":
        net = tied(False)
        net.layers[2] = TupleHead()
        model = LayerParallel(net, comm, EXACT)
        say("error " + error_of(lambda: model(torch.randn(3, 4, dtype=torch.float64))))
    elif case == "two-forwards-auto":
        serial = tied()
        model = LayerParallel(copy.deepcopy(serial), comm, "auto")
        mse = torch.nn.functional.mse_loss
        g = torch.Generator().manual_seed(1)
        a, b, ya, yb = (torch.randn(4, 4, generator=g, dtype=torch.float64)
                        for _ in range(4))
        model.tune(a, ya, mse)
        (mse(model(a), ya) + mse(model(b), yb)).backward()
        (mse(serial(a), ya) + mse(serial(b), yb)).backward()
        want = dict(serial.named_parameters(remove_duplicate=False))
        err = max(float((p.grad - want[n].grad).norm() / want[n].grad.norm())
                  for n, p in model.named_parameters(remove_duplicate=False))
        say(f"two forwards {err:.3e}")
    elif case == "autocast-switch":
        torch.manual_seed(0)
        serial = ODENet(torch.nn.Linear(4, 4), lambda k: Dense(4), 8, 2.0,
                        torch.nn.Linear(4, 4))
        model = LayerParallel(copy.deepcopy(serial), comm, EXACT)
        x = torch.randn(3, 4)
        errs = []
        for dtype in (torch.bfloat16, torch.float16, None):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16,
                                enabled=dtype is not None), torch.no_grad():
                got, want = model(x), serial(x)
            errs.append(f"{got.dtype}/{want.dtype}:{float((got - want).abs().max()):.3e}")
        say("autocast " + " ".join(errs))
    model = None  # noqa: F841


if __name__ == "__main__":
    main(sys.argv[1])
