"""MPI worker: `LayerParallel.load_state_dict` refuses a bad state dict alike on
every rank, before anything is loaded.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_load_state.py

Cases, each on a model of a 2-8-2 net (the serial net's whole state dict, changed):
``missing`` (a block of the last rank's layers dropped), ``shape`` (the last rank's
closing weight of another shape), ``unexpected`` (a key of no layer), ``assign``
(``assign=True``: refused by name), ``ok`` (the whole dict loads).  Each rank reports
``RANK <r> <case> <ExceptionType or OK> <same>``: `same` is whether its parameters
kept their tensors, and their values (``ok``: took the dict's).
"""
from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from layerpar import LayerParallel
from layerpar.ode import ODENet
from layerpar.ode.blocks import Dense

torch.set_default_dtype(torch.float64)
comm = MPI.COMM_WORLD
rank = comm.Get_rank()


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def main() -> None:
    torch.manual_seed(0)
    net = ODENet(torch.nn.Linear(2, 4), lambda k: Dense(4), 8, 1.0, torch.nn.Linear(4, 2))
    model = LayerParallel(net, comm)
    torch.manual_seed(1)
    other = ODENet(torch.nn.Linear(2, 4), lambda k: Dense(4), 8, 1.0, torch.nn.Linear(4, 2))
    good = other.state_dict()
    cases = {"missing": {k: v for k, v in good.items() if not k.startswith("layers.1.blocks.7.")},
             "shape": {**good, "layers.2.weight": torch.zeros(3, 4)},
             "unexpected": {**good, "layers.9.weight": torch.zeros(1)},
             "assign": good, "ok": good}
    for case, sd in cases.items():
        before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
        try:
            model.load_state_dict(sd, assign=case == "assign")
            got = "OK"
        except Exception as exc:  # noqa: BLE001 - reported
            got = type(exc).__name__
            say(f"message {case} {str(exc)[:200]!r}")
        now = dict(model.named_parameters())
        same = all(now[n] is p for n, (p, _) in before.items()) and (
            all(torch.equal(p, good[n]) for n, p in now.items()) if case == "ok" else
            all(torch.equal(p, v) for p, v in before.values()))
        say(f"{case} {got} {same}")


if __name__ == "__main__":
    main()
