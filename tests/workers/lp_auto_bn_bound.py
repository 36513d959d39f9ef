"""MPI worker: without a `tune` call, the bound auto prints holds for the loss being
trained, on a net with batch norm in its blocks.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_auto_bn_bound.py
A float64 ODE-net of 16 conv -> batch-norm -> tanh blocks; the clock is replaced by
fixed costs (after running each candidate's passes as usual) so that MGRIT settings
are "faster" than exact ones and their gradient errors decide.  The adaptive check
loop of a user's own training: a forward and backward (no `tune` call), an SGD step,
``if model.accuracy.check_due(batch): model.check_gradients(x, y, loss_fn)``.  After
the first batch each rank reports ``RANK <r> first <error> <bound>`` (the first
tuning's choice, measured on the training loss of its batch at its parameters) and,
after the check, ``RANK <r> real <error> <cosine> bound <max error> <min cosine>
choice <name> batch <b> tunings <n>``: the last tuning's choice, measured with
`check_gradients` on the training loss of its batch, against the bound it printed.
"""

import sys

import torch
from mpi4py import MPI
from torch import nn

import layerpar
from layerpar.parallel import LayerParallel, autotune
from layerpar.parallel.accuracy import check_gradients
from layerpar.parallel.replicated import ReplicatedSerial

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
timed = autotune._time_passes


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def fake_clock(model, m, x, y, loss_fn, repeats, bound=float("inf"), **kw):
    timed(model, m, x, y, loss_fn, 1)  # the passes and exchanges, as usual
    if isinstance(m, ReplicatedSerial):
        return 1.5
    if not hasattr(m, "options") or m.options.max_levels == 1:
        return 1.0
    return 0.1 * (m.options.max_iter + m.backward_options.max_iter)


autotune._time_passes = fake_clock
autotune.STRUCTURES = ((2, 4), (2, 8))


class ConvBN(nn.Module):
    """conv -> batch norm -> tanh: F(u) of one residual layer."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(c, c, 3, padding=1), nn.BatchNorm1d(c)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.conv(u)))


torch.manual_seed(0)
net = layerpar.ODENet(open=nn.Conv1d(1, 4, 3, padding=1), steps=lambda n: ConvBN(4),
                      n_steps=16, t_final=1.0,
                      close=nn.Sequential(nn.Flatten(), nn.Linear(4 * 12, 3))).double()
model = LayerParallel(net, comm, "auto")
loss_fn = nn.functional.cross_entropy
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(32, 1, 12, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (32,), generator=g)) for _ in range(2)]
for batch, (x, y) in enumerate(batches, 1):
    loss_fn(model(x), y).backward()
    if batch == 1:
        r = model.tuner.results[-1]
        c = check_gradients(model.tuner.chosen, x, y, loss_fn)
        say(f"first {c.param_grad_error:.4g} {r.bound.max_rel_error:.4g}")
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
    if model.accuracy.check_due(batch):
        model.check_gradients(x, y, loss_fn)
    if batch == 1:
        r = model.tuner.results[-1]
        xb, yb = batches[r.batch - 1]
        c = check_gradients(model.tuner.chosen, xb, yb, loss_fn)
        say(f"real {c.param_grad_error:.6g} {c.cosine:.6g} bound {r.bound.max_rel_error:.6g} "
            f"{r.bound.min_cosine:.6g} choice {r.choice.candidate.name(size)} batch "
            f"{r.batch} tunings {len(model.tuner.results)}")
model.close()
