"""MPI worker: `LayerParallel(options="auto")` decides alike on every rank.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_autotune.py
A small dense ODE-net (float64) is tuned on one batch with the real clock, then twice
with a fake clock (a fixed cost per candidate, after running its passes as usual), so
that MGRIT candidates are "faster" and their gradient errors are measured and decide.
Each rank reports
``RANK <r> table <...>`` (every candidate's name, time, error and cosine, exactly as
the rank holds them) and ``RANK <r> choice <...>`` per tuning, then ``RANK <r> errors
<...>`` (the two tunings' gradient errors for the candidates both measured: the
measurement is deterministic), and the loss of one training step through the chosen
setting with the gradient norm of this rank's parameters against the serial net's.
"""

import sys

import torch
from mpi4py import MPI
from peaks_twins import peaks_twins

from layerpar.parallel import LayerParallel, autotune
from layerpar.parallel.autotune import choose

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
net, serial, x, y = peaks_twins(64)
model = LayerParallel(net, comm, "auto")
loss_fn = torch.nn.functional.cross_entropy


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


real = model.tune(x, y, loss_fn)
timed = autotune._time_passes


def fake_clock(model, m, x, y, loss_fn, repeats, bound=float("inf"), **kw):
    timed(model, m, x, y, loss_fn, repeats)  # the passes and exchanges, as usual
    fwd, bwd = m.options, m.backward_options
    if fwd.max_levels == 1:
        return 1.0
    return 0.1 * (fwd.max_iter + bwd.max_iter) + 0.01 * fwd.max_levels + (
        0.0 if m._init_kwargs["batched"] else 0.05)


autotune._time_passes = fake_clock
results = []
for _ in range(2):
    model.tuner.timings.clear()  # measured again, not reused: the clock is the fake one
    results.append(model.tune(x, y, loss_fn))
autotune._time_passes = timed
for r in [real, *results]:
    say("table " + "; ".join(f"{m.candidate.name(2)} {m.seconds!r} {m.rel_error!r} "
                             f"{m.cosine!r} {m.within}" for m in r.table))
    say(f"choice {r.choice.candidate.name(2)} | {r.reason}")
    again, _ = choose(r.table, r.ranks)  # a pure function of the table
    say(f"rechoose {again is r.choice}")
first = {m.candidate: m.rel_error for m in results[0].table if m.rel_error is not None}
both = [(c, e, m.rel_error) for m in results[1].table
        for c, e in first.items() if m.candidate == c and m.rel_error is not None]
say(f"errors {len(both)} " + " ".join(f"{e1!r}=={e2!r}" for _, e1, e2 in both))
same = all(e1 == e2 for _, e1, e2 in both)
say(f"errors_equal {same}")
say(f"fake_tables_equal {results[0].table == results[1].table}")
# one training step through the chosen setting: its gradient within the bound of exact
out = model(x)
loss = loss_fn(out, y)
loss.backward()
ref = loss_fn(serial(x), y)
ref.backward()
sp = dict(serial.named_parameters())
num = den = 0.0
for name, p in model.named_parameters():
    num += float(((p.grad - sp[name].grad) ** 2).sum())
    den += float((sp[name].grad ** 2).sum())
num, den = comm.allreduce(num), comm.allreduce(den)
chosen = results[-1].choice.rel_error
say(f"step loss {float(loss.detach())!r} serial {float(ref)!r} grad_rel {(num / den) ** 0.5:.6e} "
    f"chosen_err {chosen!r}")
model.close()

# no tune(): an evaluation runs exact propagation untuned, then the first training
# pass's backward tunes with the loss's gradient at the output (MGRIT candidates
# checked: the fake clock again)
net2, serial2, _, _ = peaks_twins(64)
model2 = LayerParallel(net2, comm, "auto")
model2.eval()
with torch.no_grad():
    out = model2(x)
say(f"surrogate eval_exact {bool(torch.equal(out, serial2.eval()(x)))} "
    f"tuned {model2.tuner.tuned}")
model2.train()
autotune._time_passes = fake_clock
loss = loss_fn(model2(x), y)
loss.backward()
autotune._time_passes = timed
r = model2.tuner.results[-1]
checked = sum(m.rel_error is not None for m in r.table if not m.candidate.exact)
say(f"surrogate checked {checked} choice {r.choice.candidate.name(2)} "
    + "; ".join(f"{m.candidate.name(2)} {m.rel_error!r}" for m in r.table))
model2.close()
