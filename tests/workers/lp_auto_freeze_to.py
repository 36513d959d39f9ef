"""MPI worker: under ``options="auto"``, freezing and unfreezing blocks mid-training,
and ``model.to(dtype)``, train like the serial net.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_auto_freeze_to.py
The clock is replaced by fixed costs (after running each candidate's passes as
usual) so that the replicated batch split is chosen at 2+ ranks (serial autograd at
one).  Plain SGD steps run through the model and through the serial net from the same
weights (float64), side by side:

- steps 1-2: one block of rank 0 frozen from the start (frozen on its owner only,
  through ``model.named_parameters()``, as a user's loop reaches its own layers);
- steps 3-4: that block unfrozen, one block of the last rank frozen;
- steps 5-6: every parameter of the last rank frozen (its backward still joins);
- then ``model.to(torch.float32)`` (and the serial net's), steps 7-8 in float32.

Each rank reports ``RANK <r> choice <name>`` and per step ``RANK <r> step k <dtype>
out <rel> grad <rel> none <ok>`` (the largest relative differences of the outputs and
of every parameter's gradient over all ranks; ``none`` says that the parameters whose
serial gradient is None have none either).  A second model, with an MGRIT setting
chosen (its ghost blocks are its own), reports ``RANK <r> mgrit <dtype> <rel>`` after
``.to(torch.float32)``: its output's difference from the serial net's, inexact, and
the same difference in float64 before.  At 2+ ranks a third, with replicated serial
chosen (no batch split) and every parameter of the last rank frozen, reports
``RANK <r> whole choice <name>`` and its ``step 9``.
"""

import sys

import torch
from mpi4py import MPI
from peaks_twins import peaks_twins

from layerpar.parallel import LayerParallel, autotune
from layerpar.parallel.adaptive import AccuracyPolicy
from layerpar.parallel.replicated import ReplicatedSerial

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
loss_fn = torch.nn.functional.cross_entropy
timed = autotune._time_passes
costs = {"split": 0.1, "replicated": 0.5, "exact": 1.0, "mgrit": 2.0}


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def fake_clock(model, m, x, y, loss_fn, repeats, bound=float("inf"), **kw):
    timed(model, m, x, y, loss_fn, 1)  # the passes and exchanges, as usual
    if isinstance(m, ReplicatedSerial):
        return costs["split" if m.split else "replicated"]
    if not hasattr(m, "options") or m.options.max_levels == 1:
        return costs["exact"]
    return costs["mgrit"]


autotune._time_passes = fake_clock
autotune.STRUCTURES = ((2, 4),)
net, serial, x, y = peaks_twins()
model = LayerParallel(net, comm, "auto")
own = [n for n, _ in model.named_parameters()]
owners = comm.allgather(own)
sp = dict(serial.named_parameters())


def block_of(r: int) -> str:
    """The name prefix of a residual block that rank `r` owns."""
    name = next(n for n in owners[r] if ".blocks." in n)
    return name.rsplit(".", 1)[0] + "."


def freeze(prefix: str, flag: bool) -> None:
    """Set requires_grad of the parameters under `prefix`: on their owner (the model's
    own parameters) and in the serial net."""
    for n, p in model.named_parameters():
        if n.startswith(prefix):
            p.requires_grad_(flag)
    for n, p in sp.items():
        if n.startswith(prefix):
            p.requires_grad_(flag)


first, last = block_of(0), block_of(size - 1)
freeze(first, False)  # before the tuning builds anything
got = model.tune(x, y, loss_fn)
say(f"choice {got.choice.candidate.name(size)}")


def step(k: int, xb: torch.Tensor, lr: float = 0.05) -> None:
    for p in [*model.parameters(), *serial.parameters()]:
        p.grad = None
    out = model(xb)
    loss_fn(out, y).backward()
    ref = serial(xb)
    loss_fn(ref, y).backward()
    out_err = float((out - ref).detach().abs().max() / ref.detach().abs().max())
    worst, none_ok = 0.0, True
    for n, p in model.named_parameters():
        want = sp[n].grad
        if want is None:
            none_ok = none_ok and p.grad is None
            continue
        if p.grad is None:
            worst = float("inf")
            continue
        d = (p.grad - want).abs().max() / want.abs().max().clamp_min(1e-30)
        worst = max(worst, float(d))
    worst = comm.allreduce(worst, MPI.MAX)
    none_ok = comm.allreduce(none_ok, MPI.LAND)
    say(f"step {k} {str(out.dtype).split('.')[1]} out {out_err:.1e} grad {worst:.1e} "
        f"none {none_ok}")
    with torch.no_grad():
        for p in [*model.parameters(), *serial.parameters()]:
            if p.grad is not None:
                p -= lr * p.grad


for k in (1, 2):
    step(k, x + 0.1 * k)
freeze(first, True)
freeze(last, False)
for k in (3, 4):
    step(k, x + 0.1 * k)
freeze(last, True)
if size > 1:  # (at one rank that is the whole net: nothing would train)
    for n in owners[size - 1]:  # every parameter of the last rank
        freeze(n, False)
    for k in (5, 6):
        step(k, x + 0.1 * k)
    for n in owners[size - 1]:
        freeze(n, True)
model.to(torch.float32)
serial.to(torch.float32)
for k in (7, 8):
    step(k, (x + 0.1 * k).float())
model.close()

# an MGRIT setting chosen: `.to()` reaches its twin's ghost blocks
costs.update(mgrit=0.01)
net2, serial2, _, _ = peaks_twins()
model2 = LayerParallel(net2, comm, "auto", accuracy=AccuracyPolicy(max_rel_error=1.0,
                                                                   min_cosine=-1.0))
got = model2.tune(x, y, loss_fn)
with torch.no_grad():
    before = float((model2(x) - serial2(x)).abs().max() / serial2(x).abs().max())
model2.to(torch.float32)
serial2.to(torch.float32)
out = model2(x.float())
loss_fn(out, y).backward()
ref = serial2(x.float())
say(f"mgrit {got.choice.candidate.name(size)} {str(out.dtype).split('.')[1]} "
    f"{float((out - ref).detach().abs().max() / ref.detach().abs().max()):.3e} "
    f"float64 {before:.3e}")
model2.close()

# replicated serial without the batch split, every parameter of the last rank frozen:
# that rank's output still carries a graph, so the same loop runs backward() there
if size > 1:
    costs.update(split=5.0, replicated=0.5, mgrit=2.0)
    net3, serial3, _, _ = peaks_twins()
    model = LayerParallel(net3, comm, "auto")
    serial, sp = serial3, dict(serial3.named_parameters())
    got = model.tune(x, y, loss_fn)
    for n in owners[size - 1]:
        freeze(n, False)
    say(f"whole choice {got.choice.candidate.name(size)}")
    step(9, x)
    model.close()
