"""MPI worker: parameters that several layers use (one block module for every step,
a time-invariant ODE; the opening and closing layers' weights tied) train as in the
serial net, on every path.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_sharing.py NET PATH [PATH ...]

NET is ``shared`` (one `Dense` block for all 8 steps of the segment), ``tied`` (8
distinct blocks; the closing layer's weight is the opening layer's) or ``tied-plain``
(two plain layers in a row, one weight).  Each PATH (``batched``, ``per-step``:
converged MGRIT with vectorised and per-step cycles; ``average``, ``batched-average``:
the same with averaged coarse parameters; ``exact``:
sequential solves; ``grid-batched`` / ``grid-per-step``: converged MGRIT on a grid of
2 data replicas, at an even number of ranks; ``replicated`` / ``split``: auto's
replicated serial, whole or batch split, at 2+ ranks, built directly or chosen by
``options="auto"`` as ``auto-replicated`` / ``auto-split``) trains a LayerParallel copy of
the net and a serial copy three SGD steps (momentum) from the same weights (float64).
Each rank reports ``RANK <r> <PATH> grad <err> state <err> copies <err>``: the
largest relative difference of its parameters' gradients (and of the whole net's
gradient norm, `clip_grad_norm_`) from serial's over the steps; of the gathered state
dict, and of the gathered optimizer state loaded at one rank, from the serial net's
after them; and between the ranks' own copies of each parameter (all ranks').
"""
from __future__ import annotations

import copy
import sys

import torch
from mpi4py import MPI

from layerpar import LayerParallel, ProcessGrid
from layerpar.mgrit import MGRITOptions
from layerpar.ode import ODENet, Segment
from layerpar.ode.blocks import Dense
from layerpar.parallel import autotune
from layerpar.parallel.replicated import ReplicatedSerial

torch.set_default_dtype(torch.float64)
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
CONVERGED = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=50)
timed = autotune._time_passes


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def make_net(kind: str) -> ODENet:
    torch.manual_seed(0)
    if kind == "shared":
        shared = Dense(4)
        return ODENet(torch.nn.Linear(3, 4), lambda k: shared, 8, 2.0,
                      torch.nn.Linear(4, 2))
    if kind == "tied-plain":  # two plain layers in a row (one graph) share a weight
        first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        second.weight = first.weight
        return ODENet(layers=[first, torch.nn.Tanh(), second,
                              Segment(lambda k: Dense(4), 8, 2.0), torch.nn.Linear(4, 4)])
    net = ODENet(torch.nn.Linear(4, 4), lambda k: Dense(4), 8, 2.0, torch.nn.Linear(4, 4))
    net.layers[2].weight = net.layers[0].weight
    return net


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def run(kind: str, path: str) -> tuple[float, float, float]:
    net = make_net(kind)
    serial = copy.deepcopy(net)
    settings: dict = {"exact": {}, "batched": {"options": CONVERGED, "batched": True},
                      "per-step": {"options": CONVERGED, "batched": False},
                      "average": {"options": CONVERGED, "batched": False,
                                  "coarsening": "average"},
                      "batched-average": {"options": CONVERGED, "batched": True,
                                          "coarsening": "average"},
                      "grid-batched": {"options": CONVERGED, "batched": True},
                      "grid-per-step": {"options": CONVERGED, "batched": False},
                      "replicated": {}, "split": {}, "auto-replicated": {"options": "auto"},
                      "auto-split": {"options": "auto"}}[path]
    rows = slice(None)
    if path.startswith("grid"):
        # data x layers: each replica its half of the batch, gradients averaged
        grid = ProcessGrid(comm, data=2)
        half = 6 // grid.data
        rows = slice(grid.data_rank * half, (grid.data_rank + 1) * half)
        model = LayerParallel(net, grid=grid, **settings)
    else:
        model = LayerParallel(net, comm, **settings)
    step_fn = model
    if path in ("replicated", "split"):
        step_fn = ReplicatedSerial(model, split=path == "split")
    if path.startswith("auto"):
        # the clock replaced by costs that make auto choose the path named
        autotune.STRUCTURES = ((2, 2),)
        split = path == "auto-split"

        def fake_clock(model: LayerParallel, m: object, *args: object, **kw: object) -> float:
            timed(model, m, *args[:3], 1)  # the passes and exchanges, as usual
            if isinstance(m, ReplicatedSerial):
                return 0.5 if m.split == split else 0.8
            return 1.0

        autotune._time_passes = fake_clock
        x0 = torch.randn(6, net.layers[0].in_features)
        model.tune(x0, torch.zeros(6, net.layers[-1].out_features),
                   torch.nn.functional.mse_loss)
        autotune._time_passes = timed
        chosen = model.tuner.chosen
        assert isinstance(chosen, ReplicatedSerial) and chosen.split == split, chosen
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    sp = dict(serial.named_parameters(remove_duplicate=False))
    g = torch.Generator().manual_seed(1)
    d_in = net.layers[0].in_features
    d_out = net.layers[-1].out_features
    grad_err = 0.0
    for _ in range(3):
        x = torch.randn(6, d_in, generator=g)
        y = torch.randn(6, d_out, generator=g)
        opt.zero_grad()
        opt_s.zero_grad()
        torch.nn.functional.mse_loss(step_fn(x[rows]), y[rows]).backward()
        torch.nn.functional.mse_loss(serial(x), y).backward()
        for name, p in model.named_parameters(remove_duplicate=False):
            grad_err = max(grad_err, rel(p.grad, sp[name].grad))
        # the whole net's gradient norm (each shared parameter once, as serial counts)
        norm = model.clip_grad_norm_(1e9)
        want = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9)
        grad_err = max(grad_err, rel(norm, want))
        opt.step()
        opt_s.step()
    state = model.gather_state_dict()
    want = serial.state_dict()
    state_err = max(rel(state[k], want[k]) for k in want)
    # every rank's copy of every parameter it holds, against the others'
    mine = {k: v.detach().clone() for k, v in model.state_dict().items()}
    copies = 0.0
    for other in comm.allgather(mine):
        for k, v in other.items():
            if k in mine:
                copies = max(copies, rel(mine[k], v))
    # the optimizer state, gathered here and loaded at one rank (comm=None): every
    # parameter's momentum is serial's
    saved = model.gather_optimizer_state(opt)
    one = LayerParallel(copy.deepcopy(serial), None)
    opt1 = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
    one.load_optimizer_state(opt1, saved)
    for name, p in one.named_parameters():
        state_err = max(state_err, rel(opt1.state[p]["momentum_buffer"],
                                       opt_s.state[sp[name]]["momentum_buffer"]))
    model.close()
    return (comm.allreduce(grad_err, MPI.MAX), state_err, comm.allreduce(copies, MPI.MAX))


def main() -> None:
    kind, paths = sys.argv[1], sys.argv[2:]
    for path in paths:
        grad_err, state_err, copies = run(kind, path)
        say(f"{path} grad {grad_err:.3e} state {state_err:.3e} copies {copies:.3e}")


if __name__ == "__main__":
    main()
