"""MPI worker: auto times its exact replicated settings on the training's own steps
(``model.tune(..., online=True)``, what ``layerpar train --auto`` asks for).

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_online.py
The tuning's clock is a fake one that the training loop below advances by a fixed
cost per step of the setting that ran it, so the choice and the number of steps the
trial takes do not depend on the machine.  Three trainings of a float64 Peaks net,
each against the serial net trained from the same weights with the same fused Adam
(outputs, losses and every rank's gradients compared at every step):

1. ``cheap split``: the batch split costs 1 ms per step, replicated serial 2 ms;
   after the second step an evaluation pass, and a pass without grad in training
   mode (as for a training accuracy): the interval across them is no step;
2. ``cheap whole``: the opposite costs;
3. ``room``: so many steps to come that the budget has room for the full tuning:
   after the first timed step, the tuning runs on the first batch (its passes on
   fixed costs: replicated serial 0.5, exact propagation 1.0, MGRIT 2.0); ``room
   passes``: the same where a replicated pass (5 ms) is half a step (10 ms), so the
   budget counted in passes would have had no room: exact propagation is timed all
   the same, and the log says so alone (``RANK <r> <case> story ...``);
4. ``short``: two steps only, so the trial never decides (``RANK <r> short ...``).

Each rank reports ``RANK <r> <case> tune <None|result> | steps <k> | online <n> |
timed <bool> | choice <name> | table <names and times> | builds <replicated serial
instances built> | worst <rel. difference>``.
"""

import sys
import types

import torch
from mpi4py import MPI
from peaks_twins import peaks_twins

from layerpar.parallel import LayerParallel, autotune
from layerpar.parallel import tuner as tuning
from layerpar.parallel.replicated import ReplicatedSerial

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
loss_fn = torch.nn.functional.cross_entropy
now = [0.0]
fake = types.SimpleNamespace(perf_counter=lambda: now[0])
real = autotune.time
autotune.STRUCTURES = ((2, 4),)


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


pass_costs = {"replicated": 0.5}


def fake_passes(model, m, x, y, loss_fn, repeats, bound=float("inf"), **kw):
    """The full tuning's timings (case 3): the passes as usual, fixed costs."""
    timed(model, m, x, y, loss_fn, 1)
    if isinstance(m, ReplicatedSerial):
        return pass_costs["replicated"]
    return 1.0 if m.options.max_levels == 1 else 2.0  # MGRIT slower: training stays exact


timed = autotune._time_passes
autotune._time_passes = fake_passes
builds = [0]


class Counted(ReplicatedSerial):
    """Replicated serial, its builds counted (each deep-copies the net)."""

    def __init__(self, *args, **kwargs) -> None:
        builds[0] += 1
        super().__init__(*args, **kwargs)


autotune.ReplicatedSerial = tuning.ReplicatedSerial = Counted


def train(case: str, costs: dict[bool, float], steps_to_come: int, evaluate_at: int) -> None:
    net, serial, x, y = peaks_twins()
    model = LayerParallel(net, comm, "auto")
    builds[0] = 0
    autotune.time = tuning.time = fake  # (the tuning's budget, the online trial)
    got = model.tune(x, y, loss_fn, steps=steps_to_come, online=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    opt_s = torch.optim.Adam(serial.parameters(), lr=1e-2, fused=True)
    sp = dict(serial.named_parameters())
    worst = 0.0
    tuner = model.tuner
    step = 0
    while tuner.trial is not None or step < 2:
        xb = x + 0.05 * step
        opt.zero_grad()
        opt_s.zero_grad()
        out = model(xb)
        chosen = tuner.chosen
        loss = loss_fn(out, y)
        loss.backward()
        ref = serial(xb)
        loss_fn(ref, y).backward()
        worst = max(worst, float(((out - ref).abs().max() / ref.abs().max()).detach()))
        for name, p in model.named_parameters():
            d = (p.grad - sp[name].grad).abs().max() / sp[name].grad.abs().max()
            worst = max(worst, float(d))
        opt.step()
        opt_s.step()
        # the step's cost on the fake clock: that of the setting that ran it
        now[0] += costs[bool(getattr(chosen, "split", False))] if isinstance(
            chosen, ReplicatedSerial) else 1e-4
        step += 1
        if step == evaluate_at:  # evaluation passes: the interval across them is no step
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
            with torch.no_grad():  # (in training mode, as for a training accuracy)
                model(x)
            now[0] += 1.0
        if step > 20:
            break
    autotune.time = tuning.time = real
    worst = comm.allreduce(worst, MPI.MAX)
    res = tuner.results[-1] if tuner.results else None
    table = "none" if res is None else ", ".join(
        f"{m.candidate.name(2)} {m.seconds:g}" for m in res.table)
    say(f"{case} tune {'None' if got is None else 'result'} | steps {step} | online "
        f"{None if res is None else res.online} | timed "
        f"{None if res is None else res.timed_online} | choice "
        f"{None if res is None else res.choice.candidate.name(2)} | table {table} | "
        f"builds {builds[0]} | worst {worst:.1e}")
    if res is not None and rank == 0:
        for line in res.lines():
            sys.stderr.write(line + "\n")
    if res is not None:
        text = "\n".join(res.lines())
        say(f"{case} story room {'had room to time exact' in text} | exact timed "
            f"{any(m.candidate.exact and not m.candidate.replicated for m in res.table)} | "
            f"not timed {'not timed' in text}")
    model.close()


# (steps of 1-2 ms: 1,000 of them leave no room for the full tuning, 10^6 do)
train("cheap split", {True: 1e-3, False: 2e-3}, 1000, evaluate_at=2)
train("cheap whole", {True: 2e-3, False: 1e-3}, 1000, evaluate_at=0)
train("room", {True: 1e-3, False: 1e-3}, 10**6, evaluate_at=0)
# a step (10 ms) twice a replicated pass (5 ms): the step's budget has room for exact
# propagation, the passes' alone would not (the tuning must time it all the same)
pass_costs["replicated"] = 5e-3
train("room passes", {True: 1e-2, False: 1e-2}, 1100, evaluate_at=0)
pass_costs["replicated"] = 0.5

# a training that ends before the steps decided: the log says so, the choice is the
# setting that ran
net, _, x, y = peaks_twins()
model = LayerParallel(net, comm, "auto")
model.tune(x, y, loss_fn, steps=1000, online=True)
for _ in range(2):
    loss_fn(model(x), y).backward()
tuner = model.tuner
say(f"short choice {tuner.choice_name(comm.Get_size())} | results {len(tuner.results)} | "
    f"{tuner.log(comm.Get_size())[-1]}")
model.close()
