"""MPI worker: replicated serial chosen by auto after its tuning built MGRIT settings
on a net whose parameters were apart (a `copy.deepcopy` of an `ODENet`): building an
MGRIT setting lays the segment's parameters out flat (new storage), and the
replicated net's exchange must then send the new storage, not the old (before, every
rank's copies of the others' layers kept their first values: a silent wrong result).

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_replicated_layout.py
Prints ``RANK <r> choice <name>`` and ``RANK <r> step <k> loss <rel> state <rel>``
(three Adam steps against the serial net, float64), then ``RANK <r> DONE``.
"""
import copy
import sys

import torch
from mpi4py import MPI
from torch import nn

import layerpar
from layerpar.ode import blocks
from layerpar.parallel import LayerParallel
from layerpar.parallel.adaptive import AccuracyPolicy

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
loss_fn = nn.functional.cross_entropy


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + k)
    return (torch.randn(8, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (8,), generator=g))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


torch.manual_seed(0)
net = layerpar.ODENet(open=nn.Linear(3, 4), steps=lambda k: blocks.Dense(4), n_steps=16,
                      close=nn.Linear(4, 5)).double()
serial = copy.deepcopy(net)
# a bound only exact settings meet: every MGRIT setting is built and timed, then
# replicated serial is chosen
tight = AccuracyPolicy(max_rel_error=1e-12, min_cosine=0.0)
model = LayerParallel(copy.deepcopy(net), comm, "auto", accuracy=tight)
x0, y0 = batch(0)
model.tune(x0, y0, loss_fn)
say(f"choice {model.tuner.choice_name(size)}")
opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, serial)]
for k in range(3):
    x, y = batch(k)
    losses = []
    for m, opt in zip((model, serial), opts):
        opt.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    got, want = model.gather_state_dict(), serial.state_dict()
    say(f"step {k} loss {rel(losses[0], losses[1]):.3e} state "
        f"{max(rel(got[n], want[n]) for n in want):.3e}")
say("DONE")
