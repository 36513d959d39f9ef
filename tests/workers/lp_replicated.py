"""MPI worker: `options="auto"` steps aside to replicated serial (every rank runs the
whole net with plain autograd) and trains exactly like the serial net.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_replicated.py
The clock is replaced by fixed costs (after running each candidate's passes as
usual): exact propagation 1.0, replicated serial 0.5, MGRIT 2.0, so replicated
serial is chosen; three Adam steps then run through it and through the serial net
from the same weights (float64), the outputs, losses and every rank's parameter
gradients compared each step, and a validation pass in eval mode.  A second model,
with a bound no MGRIT setting meets and MGRIT "faster" (0.1), must still pick
replicated serial (0.8 against exact's 1.0); tuned with no training to come, it
times replicated serial alone (``RANK <r> budget ...``).  Each rank reports
``RANK <r> choice <name> | <reason>`` per model and ``RANK <r> step k out .. grad ..``
with the largest relative differences.
"""

import sys

import torch
from mpi4py import MPI
from peaks_twins import peaks_twins

from layerpar.apps.nets import problem_net
from layerpar.parallel import LayerParallel, autotune
from layerpar.parallel.adaptive import AccuracyPolicy
from layerpar.parallel.replicated import ReplicatedSerial

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
loss_fn = torch.nn.functional.cross_entropy
timed = autotune._time_passes
costs = {"exact": 1.0, "replicated": 0.5, "mgrit": 2.0}


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def fake_clock(model, m, x, y, loss_fn, repeats, bound=float("inf"), **kw):
    timed(model, m, x, y, loss_fn, 1)  # the passes and exchanges, as usual
    if isinstance(m, ReplicatedSerial):
        return costs["replicated"]
    return costs["exact"] if m.options.max_levels == 1 else costs["mgrit"]


autotune._time_passes = fake_clock
autotune.STRUCTURES = ((2, 4),)
net, serial, x, y = peaks_twins()

model = LayerParallel(net, comm, "auto")
got = model.tune(x, y, loss_fn)
say(f"choice {got.choice.candidate.name(comm.Get_size())} | {got.reason}")
# fused: it writes the parameters in place without bumping their version counters
opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
opt_s = torch.optim.Adam(serial.parameters(), lr=1e-2, fused=True)
sp = dict(serial.named_parameters())
for step in range(3):
    xb = x + 0.1 * step
    opt.zero_grad()
    opt_s.zero_grad()
    out = model(xb)
    loss = loss_fn(out, y)
    loss.backward()
    ref = serial(xb)
    loss_fn(ref, y).backward()
    out_err = float((out - ref).detach().abs().max() / ref.detach().abs().max())
    worst = 0.0
    n = 0
    for name, p in model.named_parameters():
        d = (p.grad - sp[name].grad).abs().max() / sp[name].grad.abs().max().clamp_min(1e-300)
        worst = max(worst, float(d))
        n += 1
    worst = comm.allreduce(worst, MPI.MAX)
    n = comm.allreduce(n)
    say(f"step {step} out {out_err:.1e} grad {worst:.1e} params {n} "
        f"loss {float(loss.detach())!r}")
    opt.step()
    opt_s.step()
model.eval()
serial.eval()
with torch.no_grad():
    val = model(x)
    say(f"eval {float((val - serial(x)).abs().max()):.1e}")
model.close()

costs.update(replicated=0.8, mgrit=0.1)
torch.manual_seed(0)
net2 = problem_net("peaks", 16, 8, t_final=20.0).double()
model2 = LayerParallel(net2, comm, "auto", accuracy=AccuracyPolicy(max_rel_error=1e-6))
got = model2.tune(x, y, loss_fn)
say(f"choice {got.choice.candidate.name(comm.Get_size())} | {got.reason}")
# no training to come: replicated serial alone spends the budget, exact is not timed
model2.tuner.timings.clear()  # (not reused from the tuning above: timed again)
got = model2.tune(x, y, loss_fn, steps=0)
say(f"budget {[m.candidate.name(2) for m in got.table]} | {got.reason}")
model2.close()

# the batch split over the ranks: each runs the whole net on its share of the rows, one
# all-reduce sums the gradients; 32 rows, 7 (not divisible by the ranks), 1 (fewer rows
# than ranks: every rank runs it whole), 32 again with the own sums picked one by one;
# input gradients too; then a pass without grad
from layerpar.mgrit import MGRITOptions  # noqa: E402

net3, serial3, _, _ = peaks_twins()
m3 = LayerParallel(net3, comm, MGRITOptions(max_levels=1))
rep3 = ReplicatedSerial(m3, split=True)
opt3 = torch.optim.Adam(rep3.parameters(), lr=1e-2, fused=True)
opt3s = torch.optim.Adam(serial3.parameters(), lr=1e-2, fused=True)
sp3 = dict(serial3.named_parameters())
for step, n in enumerate((32, 7, 1, 32)):
    if step == 3:  # own parameters not side by side in the flat gradient (shared ones)
        rep3._own_span = None
    opt3.zero_grad()
    opt3s.zero_grad()
    xb = (x[:n] + 0.1 * step).clone().requires_grad_()
    xs = xb.detach().clone().requires_grad_()
    out = rep3(xb)
    loss_fn(out, y[:n]).backward()
    ref = serial3(xs)
    loss_fn(ref, y[:n]).backward()
    worst = max(float((out - ref).detach().abs().max() / ref.detach().abs().max()),
                float((xb.grad - xs.grad).abs().max() / xs.grad.abs().max()))
    for name, p in m3.named_parameters():
        d = (p.grad - sp3[name].grad).abs().max() / sp3[name].grad.abs().max().clamp_min(1e-300)
        worst = max(worst, float(d))
    say(f"split {n} {comm.allreduce(worst, MPI.MAX):.1e}")
    opt3.step()
    opt3s.step()
with torch.no_grad():
    say(f"split eval {float((rep3(x) - serial3(x)).abs().max()):.1e}")
rep3.close()
m3.close()
