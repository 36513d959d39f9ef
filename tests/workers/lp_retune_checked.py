"""MPI worker: a re-tuning after a confirmed check takes what the check measured.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_retune_checked.py
A small dense ODE-net (float64, `peaks_twins`) is tuned with a fake clock (a fixed cost
per candidate: MGRIT "faster"), then the bound's cap falls below the chosen setting's
error, so two checks find it outside and the second tunes again on its batch, taking
the check's bound, exact pass and error (`autotune.Checked`).  A tuning of the same
batch that measures everything follows.  Each rank reports ``RANK <r> retune <...>``
and ``RANK <r> full <...>`` (every candidate's name, time, error, within), the
``measured`` counts of noise estimates and exact passes inside the re-tuning, and
``choices <re-tuning's> <full's>``.
"""

import sys

import torch
from mpi4py import MPI
from peaks_twins import peaks_twins

from layerpar.parallel import LayerParallel
from layerpar.parallel import autotune as at
from layerpar.parallel import tuner as tn

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
net, _, x, y = peaks_twins(64)
loss_fn = torch.nn.functional.cross_entropy
timed = at._time_passes


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def fake_clock(model, m, x, y, loss_fn, repeats, bound=float("inf"), **kw):
    timed(model, m, x, y, loss_fn, repeats)  # the passes and exchanges, as usual
    if not hasattr(m, "options") or m.options.max_levels == 1:
        return 1.0
    return 0.1 * (m.options.max_iter + m.backward_options.max_iter) + \
        0.01 * m.options.max_levels


at._time_passes = fake_clock
model = LayerParallel(net, comm, "auto")
first = model.tune(x, y, loss_fn)
ran = first.choice
assert not ran.candidate.exact and ran.rel_error is not None, first.lines()
at.NOISE_CAP = tn.NOISE_CAP = ran.rel_error * 0.999
model.tuner.noise = None  # (the next check measures the noise, and finds the cap)
counts = {"gradient_noise": 0, "exact_reference": 0}
for name in counts:
    fn = getattr(at, name)

    def counted(*a, _fn=fn, _name=name, **k):
        counts[_name] += 1
        return _fn(*a, **k)

    setattr(at, name, counted)
model.check_gradients(x, y, loss_fn)
model.check_gradients(x, y, loss_fn)
again = model.tuner.results[-1]
say(f"tunings {len(model.tuner.results)}")
say("measured " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
full = model.tuner.tune(model.model, x, y, loss_fn)


def row(r: at.TuneResult) -> str:
    return "; ".join(f"{m.candidate.name(2)} {m.seconds!r} {m.rel_error!r} {m.within}"
                     for m in r.table)


say(f"retune {row(again)}")
say(f"full {row(full)}")
say(f"choices {again.choice.candidate.name(2)} {full.choice.candidate.name(2)}")
say(f"bound {again.bound == full.bound}")
model.close()
say("DONE")
