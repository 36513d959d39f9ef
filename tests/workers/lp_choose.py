"""Worker: `choose_method` keeps the candidate whose clock is fastest, alike on every
rank, and the method it returns trains as the serial net does.

Usage: lp_choose.py CASE.  Cases:

- ``pick``: for each of "serial", "solo", "layerparallel", "data", "pipeline", a timer makes that
  candidate's clock the fastest (the others' slower, by a different amount on each
  rank); prints ``RANK <r> CASE pick/<forced> CHOSE <name> <class>``, then trains two
  Adam steps with the chosen method and prints ``RANK <r> CASE pick/<forced> OK
  <error>`` against the serial net's two steps (float64, same initial weights).
- ``tabled``: layer-parallel under auto, whose tuning timed replicated serial and the
  batch split: serial, data and layer-parallel each made fastest; prints ``RANK <r>
  CASE tabled/<forced> CHOSE <name> <class> TABLED <names>`` (the candidates whose
  times came from that tuning) and ``... OK <error>`` after two Adam steps.
- ``outside``: `LayerParallel`'s auto tuning given ``to_beat`` (a time per pass no
  MGRIT setting beats: none is checked), ``limit=0`` (none is timed), and a limit
  that is a function of the fastest pass found, none once the tuning's own exact
  settings beat ``to_beat`` (none timed), ample (some timed); prints ``RANK <r> CASE
  outside <arg> mgrit=<timed> checked=<with an error measured>``.
- ``floor``: that tuning given the serial step as a floor for exact propagation's
  pass, with the passes' clocks fixed (replicated serial 1 s, exact propagation 2 s,
  MGRIT 0.5 s): exact propagation is timed only once an MGRIT setting's check needs
  it; prints ``RANK <r> CASE floor <arg> exact=<timed> checked=<MGRIT checked>
  note=<the reason names the floor>``.
- ``disagree``: each rank's timer says another candidate is fastest; the choice is
  printed (it must be the same on every rank).
- ``bn``: a net with batch norm, the pipeline made fastest: the batch split's
  gradient error is measured against serial's (kept within the bound, else it stands
  aside: printed), the pipeline runs one micro-batch, and after two steps the weights
  and running statistics equal serial training's.
- ``bnbound``: that choice against a fixed bound: kept under a loose one, not under a
  tight one.
- ``splitcheck``: the batch split's check under batch norm (each share once, the
  batch once) against its figures run out in full: the split's averaged step, and
  at 2 ranks the two halves' serial gradients.
- ``budget``: one step to come: only the first candidate (solo) is timed; the chosen
  solo holds rank 0 at its thread count until closed.
- ``online``: ``online=True`` with 20 steps to come (the share pays for one step):
  nothing is timed apart, layer-parallel under auto is returned with its trial of
  the exact settings running (at one rank it is serial autograd, tuned at once); twelve
  training steps decide it; prints ``RANK <r> CASE online CHOSE <name> <class> TIMED
  <timed apart> TRIAL <running>``, ``... DECIDED <tuned> ONLINE <on the steps> OK
  <error>`` against serial's training; with 2,000 steps to come, or with batch norm
  (which the trial's batch split does not run), the candidates are timed apart as
  without ``online``.
- ``refusal``: an unknown method name raises the same ValueError on every rank.
"""
import contextlib
import copy
import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

import layerpar
from layerpar.ode import blocks
from layerpar.parallel import choose_method
from layerpar.parallel.baselines import LayerParallelMethod, SerialMethod, SoloMethod

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
from tolerances import F64, SOLVER_TOL  # noqa: E402
from user_blocks import Centred, Drawing, Tracker, user_net  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
B, WIDTH = 8, 4
loss_fn = nn.functional.cross_entropy


def say(text: str) -> None:
    sys.stdout.write(f"RANK {rank} {text}\n")
    sys.stdout.flush()


def dense_net(bn: bool = False) -> layerpar.ODENet:
    torch.manual_seed(0)
    opening = nn.Sequential(nn.Linear(3, WIDTH), nn.BatchNorm1d(WIDTH)) if bn else \
        nn.Linear(3, WIDTH)
    return layerpar.ODENet(open=opening, steps=lambda k: blocks.Dense(WIDTH), n_steps=8,
                           close=nn.Linear(WIDTH, 5)).double()


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + k)
    return (torch.randn(B, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (B,), generator=g))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def trains_as_serial(method, net: layerpar.ODENet, seed=None, dtype=torch.float64,
                     region=contextlib.nullcontext) -> float:
    """Two Adam steps with `method` and with the serial net (each from the global
    generator seeded with `seed`, where given; batches in `dtype`; each step's
    `train_step` inside a `region()`); the largest relative difference between the
    gathered state dicts (parameters and buffers)."""
    serial = SerialMethod(copy.deepcopy(net))
    for m in (method, serial):
        if seed is not None:
            torch.manual_seed(seed)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        m.train()
        for k in range(2):
            x, y = batch(k)
            with region():
                m.train_step(x.to(dtype), y, loss_fn)
            opt.step()
    got, want = method.gather_state_dict(), serial.gather_state_dict()
    if set(got) != set(want):
        return float("inf")
    return max(rel(got[k].double(), want[k].double()) for k in want)


def forced(name: str):
    """A timer: `name`'s candidate takes 1 ms, the others 1 s plus a rank's share."""
    return lambda cand, s: 1e-3 if cand.split()[0] == name else 1.0 + 0.1 * rank


#: the layer-parallel candidate converged (its gradients then equal serial's to the
#: solver's tolerance; auto's own setting is held only to its error bound)
CONVERGED = {"options": layerpar.MGRITOptions(max_levels=2, cfactor=2, tol=SOLVER_TOL,
                                              max_iter=50)}


def case_pick() -> None:
    for name in ("serial", "solo", "layerparallel", "data", "pipeline"):
        net = dense_net()
        x, y = batch(0)
        m = choose_method(net, comm, x, y, loss_fn, steps=1, microbatches=(1, 2),
                          layerparallel=CONVERGED, timer=forced(name))
        say(f"CASE pick/{name} CHOSE {m.choice.chosen.replace(' ', '_')} "
            f"{type(m).__name__}")
        err = trains_as_serial(m, net)
        tol = F64.converged if name == "layerparallel" else F64.roundoff
        say(f"CASE pick/{name} {'OK' if err <= tol else 'FAIL'} {err:.3e}")
        m.close()


def case_tabled() -> None:
    """Layer-parallel under auto: its tuning's times of replicated serial and the
    batch split stand for the serial and data candidates, which are built only when
    chosen, and then train as serial does."""
    for name in ("serial", "data", "layerparallel"):
        net = dense_net()
        x, y = batch(0)
        # a bound only exact settings meet, so that every choice trains as serial
        tight = layerpar.parallel.adaptive.AccuracyPolicy(max_rel_error=1e-12,
                                                         min_cosine=0.0)
        m = choose_method(net, comm, x, y, loss_fn, steps=1, methods=(
            "serial", "data", "layerparallel"), timer=forced(name),
            layerparallel={"accuracy": tight})
        notes = {t.name: t.note for t in m.choice.trials}
        tabled = sorted(n for n, note in notes.items() if "layer-parallel's tuning" in note)
        say(f"CASE tabled/{name} CHOSE {m.choice.chosen} {type(m).__name__} "
            f"TABLED {','.join(tabled) or '-'}")
        err = trains_as_serial(m, net)
        say(f"CASE tabled/{name} {'OK' if err <= F64.roundoff else 'FAIL'} {err:.3e}")
        m.close()


def case_outside() -> None:
    """Layer-parallel's tuning given a time to beat from outside (no MGRIT setting is
    then checked) and a limit of 0 s (only the exact settings are timed)."""
    from layerpar import LayerParallel

    x, y = batch(0)
    # a cap counted in steps of the fastest way found: ample at the caller's 1e9 s,
    # none once the tuning's own exact settings beat that
    shrinking = {"to_beat": 1e9, "limit": lambda fastest: 1e9 if fastest >= 1e9 else 0.0}
    ample = {"to_beat": 1e9, "limit": lambda fastest: 1e9}
    for name, kw in (("to_beat", {"to_beat": 1e-9}), ("limit", {"limit": 0.0}),
                     ("shrinking", shrinking), ("ample", ample)):
        lp = LayerParallel(dense_net(), comm, "auto")
        got = lp.tune(x, y, loss_fn, **kw)
        mgrit = [m for m in got.table if not m.candidate.exact]
        say(f"CASE outside {name} mgrit={len(mgrit)} "
            f"checked={sum(m.rel_error is not None for m in mgrit)}")
        lp.close()


def case_floor() -> None:
    """Exact propagation's timing waits for the first gradient check where the
    caller's serial step says it cannot be chosen."""
    from layerpar import LayerParallel
    from layerpar.parallel import autotune
    from layerpar.parallel.replicated import ReplicatedSerial

    def fixed(model, m, *args, **kwargs) -> float:  # (alike on every rank)
        return 1.0 if isinstance(m, ReplicatedSerial) else 2.0 if m is model else 0.5

    real, autotune._time_passes = autotune._time_passes, fixed
    x, y = batch(0)
    try:
        for name, kw in (("beaten", {"to_beat": 1e-9, "serial_floor": 10.0}),
                         ("checked", {"serial_floor": 10.0}),
                         ("below", {"to_beat": 1e-9, "serial_floor": 1.1e-9})):
            lp = LayerParallel(dense_net(), comm, "auto")
            got = lp.tune(x, y, loss_fn, **kw)
            exact = [m for m in got.table if m.candidate.exact and not m.candidate.replicated]
            mgrit = [m for m in got.table if not m.candidate.exact]
            say(f"CASE floor {name} exact={len(exact)} "
                f"checked={sum(m.rel_error is not None for m in mgrit)} "
                f"note={'layers one after another' in got.reason}")
            lp.close()
    finally:
        autotune._time_passes = real


def case_disagree() -> None:
    mine = ("data", "pipeline")[rank % 2]
    x, y = batch(0)
    m = choose_method(dense_net(), comm, x, y, loss_fn, steps=1, microbatches=(2,),
                      timer=forced(mine))
    say(f"CASE disagree CHOSE {m.choice.chosen.replace(' ', '_')}")
    m.close()


def case_bn() -> None:
    net = dense_net(bn=True)
    x, y = batch(0)
    m = choose_method(net, comm, x, y, loss_fn, steps=1, timer=forced("pipeline"))
    data = [t for t in m.choice.trials if t.name == "data"][0]
    measured = "batch norm over each rank's share: gradient error" in data.note
    kept = data.seconds is not None
    say(f"CASE bn DATA measured={measured} kept={kept} "
        f"aside={data.note.startswith('stands aside:')}")
    say(f"CASE bn CHOSE {m.choice.chosen.replace(' ', '_')}")
    say(f"CASE bn ORDER {','.join(t.name.split()[0] for t in m.choice.trials)}")
    err = trains_as_serial(m, net)
    say(f"CASE bn {'OK' if err <= F64.roundoff else 'FAIL'} {err:.3e}")
    m.close()


def case_bnbound() -> None:
    """The batch split under batch norm is kept or stands aside by its error against
    the bound the layer-parallel candidate's policy fixes."""
    x, y = batch(0)
    for bound in (1e-12, 10.0):
        policy = layerpar.parallel.adaptive.AccuracyPolicy(max_rel_error=bound,
                                                          min_cosine=0.0)
        m = choose_method(dense_net(bn=True), comm, x, y, loss_fn, steps=1,
                          methods=("serial", "data"),
                          layerparallel={"accuracy": policy})
        data = [t for t in m.choice.trials if t.name == "data"][0]
        say(f"CASE bnbound {bound:g} kept={data.seconds is not None}")
        m.close()


def case_splitcheck() -> None:
    """The batch split's check under batch norm (`choose._split_error`: each rank's
    share once, the batch once) against the figures run out in full: its gradient
    error against the split's own averaged step and a serial step on the whole batch,
    and at 2 ranks the sampling error of the two halves' serial gradients."""
    from layerpar.mgrit.transport import make_transport
    from layerpar.parallel.baselines import DataParallelNet
    from layerpar.parallel.choose import _Calibration, _flat_grads, _rel, _split_error

    net = dense_net(bn=True)
    x, y = batch(0)
    cal = _Calibration(make_transport(comm), x, y, loss_fn, 1, lambda n, s: s, None, 0.05)
    data = DataParallelNet(copy.deepcopy(net), comm)
    _, figures = _split_error(cal, data, lambda: copy.deepcopy(net), None)
    err = float(figures.split("gradient error ")[1].split()[0])
    noise = float(figures.split("sampling error ")[1].split()[0].rstrip("),"))
    serial = SerialMethod(copy.deepcopy(net))
    halves = []
    for rows in (slice(0, B // 2), slice(B // 2, B)):
        serial.train_step(x[rows], y[rows], loss_fn)
        halves.append(_flat_grads(serial))
    serial.train_step(x, y, loss_fn)
    exact = _flat_grads(serial)
    data.train_step(x, y, loss_fn)
    full_err = _rel(_flat_grads(data), exact)
    g1, g2 = halves
    full_noise = _rel({k: 2 * g1[k] for k in g1}, {k: g1[k] + g2[k] for k in g1})
    # the same check from the serial gradient solo's timing steps kept on rank 0
    # (`choose_method` times solo first): no serial copy is built, every rank takes
    # rank 0's figure
    solo = SoloMethod(copy.deepcopy(net), comm)
    solo.tune_threads(x, y, loss_fn, 1, keep_grads=True)
    kept = _flat_grads(solo)
    cal.serial_grads = kept if rank == 0 else {}
    solo._zero_grad()

    def no_copy() -> None:
        raise AssertionError("the check built a serial copy")

    _, from_solo = _split_error(cal, data, no_copy, None)  # type: ignore[arg-type]
    solo_err = float(from_solo.split("gradient error ")[1].split()[0])
    solo_ok = abs(solo_err - full_err) <= 5e-3 * full_err and \
        (rank == 0) == any(bool(v.abs().sum()) for v in kept.values())
    # (the figures are printed to 3 significant digits)
    say(f"CASE splitcheck err={abs(err - full_err) <= 5e-3 * full_err} "
        f"noise={abs(noise - full_noise) <= 5e-3 * full_noise if size == 2 else noise > 0} "
        f"solo={solo_ok}")
    solo.close()
    data.close()


def case_budget() -> None:
    """One step to come: after the first candidate choosing has cost more than its
    share of that step, so the others are not timed, alike on every rank."""
    x, y = batch(0)
    m = choose_method(dense_net(), comm, x, y, loss_fn, steps=1, steps_to_come=1)
    skipped = [t.name for t in m.choice.trials if t.note.startswith("not timed:")]
    say(f"CASE budget CHOSE {m.choice.chosen} SKIPPED {','.join(skipped)}")
    # a chosen solo holds rank 0 at its thread count (the optimizer's step too) until
    # it is closed
    held = comm.bcast(torch.get_num_threads() == getattr(m, "threads", None), 0)
    m.close()
    back = comm.bcast(torch.get_num_threads() == 1, 0)
    say(f"CASE budget threads held={held} back={back}")


def case_online() -> None:
    """A training too short to time each candidate apart: layer-parallel's auto
    times its exact settings on the training's own steps."""
    net = dense_net()
    x, y = batch(0)
    m = choose_method(net, comm, x, y, loss_fn, steps_to_come=20, online=True)
    timed = sum(t.seconds is not None for t in m.choice.trials)
    trial = m.model.tuner.trial
    say(f"CASE online CHOSE {m.choice.chosen} {type(m).__name__} TIMED {timed} "
        f"TRIAL {trial is not None}")
    serial = SerialMethod(copy.deepcopy(net))
    for meth in (m, serial):
        opt = torch.optim.Adam(meth.parameters(), lr=1e-2)
        for k in range(12):
            xk, yk = batch(k)
            meth.train_step(xk, yk, loss_fn)
            opt.step()
    got, want = m.gather_state_dict(), serial.gather_state_dict()
    err = max(rel(got[k].double(), want[k].double()) for k in want)
    result = m.model.tuner.results[-1] if m.model.tuner.results else None
    say(f"CASE online DECIDED {result is not None} "
        f"ONLINE {result is not None and result.timed_online} "
        f"{'OK' if err <= F64.roundoff else 'FAIL'} {err:.3e}")
    m.close()
    m = choose_method(net, comm, x, y, loss_fn, steps=1, steps_to_come=2000, online=True)
    say(f"CASE online LONG TIMED {sum(t.seconds is not None for t in m.choice.trials) > 1}")
    m.close()
    # batch norm: layer-parallel's trial cannot split the batch, so however short the
    # training the candidates are timed apart (the batch split among them)
    m = choose_method(dense_net(bn=True), comm, x, y, loss_fn, steps=1, steps_to_come=20,
                      online=True)
    say(f"CASE online BN TIMED {sum(t.seconds is not None for t in m.choice.trials) > 0}")
    m.close()


def case_coupled() -> None:
    """A user's modules that couple rows or keep running statistics, which no type
    tells: with the pipeline made fastest it runs one micro-batch and trains as serial
    does; the batch split is measured against serial's gradient (coupled rows) or
    stands aside (a running statistic), its note naming the module or buffer; made
    fastest, the split is kept only so; a block drawing random numbers itself sets the
    split and the pipeline aside (the pipeline would refuse it at its first step);
    layer-parallel's own tuning does not time its batch split on the coupled net (it
    does on the plain one)."""
    x, y = batch(0)
    for name, block in (("centred", Centred), ("tracker", Tracker), ("drawing", Drawing)):
        for fast in ("pipeline", "data"):
            net = user_net(block)
            m = choose_method(net, comm, x, y, loss_fn, steps=1, timer=forced(fast))
            data = [t for t in m.choice.trials if t.name == "data"][0]
            pipe = [t for t in m.choice.trials if t.name.startswith("pipeline")]
            buffer = "['layers.1.blocks.0.seen'" in data.note
            say(f"CASE coupled/{name}/{fast} CHOSE {m.choice.chosen.replace(' ', '_')} "
                f"DATA kept={data.seconds is not None} "
                f"measured={'rows coupled (layers.1.blocks.0 (Centred)' in data.note} "
                f"buffer={buffer} "
                f"PIPE_NOTE={'one micro-batch: ' in (pipe[0].note if pipe else '')} "
                f"DRAWS={[t.name for t in m.choice.trials if 'draws random' in t.note]}")
            err = trains_as_serial(m, net, seed=3)  # (the drawing block: the same draws)
            say(f"CASE coupled/{name}/{fast} {'EXACT' if err <= F64.roundoff else 'INEXACT'}")
            m.close()
    # a training too short to time each candidate apart: not layer-parallel's trial on
    # the training's steps (replicated serial first), which would refuse the net once
    # its tuning ran a layer-parallel pass
    for name, block in (("drawing", Drawing), ("tracker", Tracker)):
        net = user_net(block)
        m = choose_method(net, comm, x, y, loss_fn, steps=1, steps_to_come=20, online=True)
        err = trains_as_serial(m, net, seed=3)
        say(f"CASE coupled/online/{name} CHOSE {m.choice.chosen.split()[0]} "
            f"{'EXACT' if err <= F64.roundoff else 'INEXACT'}")
        m.close()
    for name, make in (("plain", dense_net), ("centred", lambda: user_net(Centred))):
        lp = LayerParallelMethod(make(), comm, options="auto")
        lp.model.tune(x, y, loss_fn)
        split = any(m.candidate.split for m in lp.model.tuner.results[-1].table)
        say(f"CASE coupled/tuning/{name} SPLIT {split}")
        lp.close()


#: two Adam steps under bfloat16 autocast, a batch split against the whole batch: the
#: gradients' bfloat16 sums over other rows differ by about its epsilon (2^-8), which
#: Adam's normalised first steps carry into the weights (measured 1.0e-2 at 2 ranks)
BF16_STEPS = 4 * torch.finfo(torch.bfloat16).eps


def case_autocast() -> None:
    """Under `torch.autocast` (bfloat16, the CPU) the pipeline refuses before it is
    built, the table saying why, and each other candidate made fastest is kept and
    trains as the serial net does under the same autocast (float32 net)."""
    x, y = batch(0)
    x = x.float()

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    for fast in ("pipeline", "data", "layerparallel", "serial", "solo"):
        net = dense_net().float()
        with bf16():
            m = choose_method(net, comm, x, y, loss_fn, steps=1, timer=forced(fast))
        pipe = [t for t in m.choice.trials if t.name.startswith("pipeline")]
        refused = bool(pipe) and all("does not run under torch.autocast" in t.note
                                     for t in pipe)
        # (each step in a region of its own, as torch's recipe has it)
        err = trains_as_serial(m, net, dtype=torch.float32, region=bf16)
        say(f"CASE autocast/{fast} CHOSE {m.choice.chosen.split()[0]} PIPE_REFUSED {refused} "
            f"{'OK' if err <= BF16_STEPS else 'FAIL'} {err:.2e}")
        m.close()


def case_refusal() -> None:
    x, y = batch(0)
    try:
        choose_method(dense_net(), comm, x, y, loss_fn, methods=["nope"])
    except ValueError as exc:
        say(f"CASE refusal RAISED {'`methods`' in str(exc)}")


{"pick": case_pick, "tabled": case_tabled, "outside": case_outside,
 "disagree": case_disagree, "bn": case_bn, "budget": case_budget,
 "bnbound": case_bnbound, "floor": case_floor, "splitcheck": case_splitcheck,
 "online": case_online, "refusal": case_refusal, "coupled": case_coupled,
 "autocast": case_autocast}[sys.argv[1]]()
say("DONE")
