"""MPI worker: the adaptive check loop (``if model.accuracy.check_due(batch):
model.check_gradients(x, y, loss_fn)``) under ``options="auto"``, whatever auto chose.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_auto_check_loop.py
The clock is replaced by fixed costs (after running each candidate's passes as usual)
and the bound by an explicit one, so that each setting is chosen in turn: an MGRIT
setting (cheapest, loose bound), exact propagation (serial autograd at one rank:
no MGRIT setting within a bound of 1e-9, replicated serial dearer), replicated
serial (2+ ranks: cheaper than exact).  Each model asks `check_due` before its first
pass (nothing tuned), then trains 8 SGD steps with the loop, tuning on the first pass
(with MGRIT chosen, the checks' least interval is lifted through `model.accuracy`).
Each rank reports ``RANK <r> loop <name> | choice <choice> | checks <batches> |
exact <bool> | log <n>``, and ``RANK <r> engine <error>``: ``engine="xbraid"`` with
``options="auto"`` refused on every rank at construction.
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
costs: dict[str, float] = {}


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def fake_clock(model, m, x, y, loss_fn, repeats, bound=float("inf"), **kw):
    timed(model, m, x, y, loss_fn, 1)  # the passes and exchanges, as usual
    if isinstance(m, ReplicatedSerial):
        return costs["replicated"]
    if not hasattr(m, "options") or m.options.max_levels == 1:
        return costs["exact"]
    return costs["mgrit"]


autotune._time_passes = fake_clock
autotune.STRUCTURES = ((2, 4),)
cases = [("mgrit", 0.1, 5.0, 1.0), ("exact", 5.0, 5.0, 1e-9)]
if size > 1:
    cases.append(("replicated", 5.0, 0.5, 1e-9))
for name, mgrit, replicated, bound in cases:
    costs.update(exact=1.0, mgrit=mgrit, replicated=replicated)
    net, serial, x, y = peaks_twins()
    model = LayerParallel(net, comm, "auto", accuracy=AccuracyPolicy(
        max_rel_error=bound, min_cosine=-1.0 if bound >= 1 else 0.99, check_every=2))
    due0 = model.accuracy.check_due(2)  # before any pass: nothing tuned, nothing due
    checks = []
    for batch in range(1, 9):
        xb = x + 0.05 * batch
        out = model(xb)
        loss_fn(out, y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        if batch == 1 and name == "mgrit":
            # (the checks' share of the fake clock's training would spread them past
            # these 8 batches; written through to the chosen setting's controller)
            model.accuracy.min_every = 0
        if model.accuracy.check_due(batch):
            got = model.check_gradients(xb, y, loss_fn)
            checks.append(f"{batch}:{got.param_grad_error:.2g}")
    say(f"loop {name} | choice {model.tuner.choice_name(size)} | due0 {due0} | checks "
        f"{' '.join(checks) or '-'} | exact {model.accuracy.exact} | log "
        f"{len(model.accuracy.log)}")
    model.close()

net, _, _, _ = peaks_twins()
try:
    LayerParallel(net, comm, "auto", engine="xbraid")
    say("engine accepted")
except ValueError as exc:
    say(f"engine {exc}")
