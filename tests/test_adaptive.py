"""Adaptive accuracy (`LayerParallel(accuracy=...)`): iteration counts follow the measured
gradient error, a stalled or diverging MGRIT solve switches to exact propagation within
the batch (and training then equals serial training), and MGRIT resumes once it
converges again.  Decisions are identical on every rank (`workers/lp_adaptive.py`)."""
from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi_util import describe, rank_lines, run_mpi
from tolerances import F64

import layerpar
from layerpar.ode import blocks
from layerpar.parallel.adaptive import AccuracyPolicy

WORKERS = Path(__file__).parent / "workers"
FWD = layerpar.MGRITOptions(max_levels=3, cfactor=4, max_iter=2, tol=0.0)
BWD = FWD.replace(max_iter=1)
FWD3 = FWD.replace(max_iter=3)

BAD_POLICY = [
    ("min_cosine", 1.5), ("min_cosine", math.nan), ("min_cosine", "0.9"),
    ("max_rel_error", 0.0), ("max_rel_error", -1.0), ("max_rel_error", math.inf),
    ("check_every", 0), ("check_every", 2.0), ("check_every", True),
    ("max_iters", 0), ("max_iters", None),
    ("stall_factor", 0.0), ("stall_factor", math.nan),
    ("probe_every", 0), ("probe_every", 1.5),
    ("prefer_cheaper", 1), ("prefer_cheaper", "yes"),
    ("cost_window", 0), ("cost_window", 2.5), ("cost_margin", -0.1),
    ("cost_margin", math.inf), ("noise_fraction", 0.0), ("noise_fraction", "half"),
    ("check_backoff", 0), ("check_backoff", 1.5),
]


@pytest.mark.parametrize("name, value", BAD_POLICY)
def test_bad_policy_values_name_the_field(name: str, value: object) -> None:
    # TypeError for a value of the wrong type, ValueError for one out of range
    with pytest.raises((TypeError, ValueError), match=rf"`accuracy\.{name}`"):
        AccuracyPolicy(**{name: value})


def test_every_policy_field_has_bad_values_tested() -> None:
    assert {f.name for f in dataclasses.fields(AccuracyPolicy)} == {n for n, _ in BAD_POLICY}


def test_accuracy_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="`accuracy` must be None, a bool or an "
                                        "AccuracyPolicy, got str"):
        layerpar.LayerParallel(net(), None, FWD, BWD, accuracy="on")
    assert layerpar.LayerParallel(net(), None, FWD, BWD, accuracy=True).accuracy.policy \
        == AccuracyPolicy()
    assert layerpar.LayerParallel(net(), None, FWD, BWD, accuracy=False).accuracy is None


def net(n: int = 32, width: int = 4, t_final: float = 1.0, scale: float = 1.0,
        activation: str = "tanh"):
    torch.manual_seed(0)
    m = layerpar.ODENet(open=torch.nn.Linear(3, width),
                        steps=lambda k: blocks.Dense(width, activation=activation), n_steps=n,
                        t_final=t_final, close=torch.nn.Linear(width, 5)).double()
    with torch.no_grad():
        for _, seg in m.segments:
            for b in seg.blocks:
                b.linear.weight.mul_(scale)
    return m


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(16, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (16,), generator=g))


def sgd_steps(model, steps, first=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for k in range(first, first + steps):
        x, y = data(k)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_stalling_solve_switches_to_exact_in_the_same_batch() -> None:
    """A large step size (T = 60 over 32 layers, weights x3) makes MGRIT crawl (the
    residual shrinks by 0.72 per iteration): the first batch is recomputed exactly,
    and training then equals serial training to round-off.  3 forward iterations: the
    rate needs two measured residuals (skip)."""
    serial = net(t_final=60.0, scale=3.0)
    model = layerpar.LayerParallel(copy.deepcopy(serial), None, FWD3, BWD, accuracy=True)
    got = sgd_steps(model, 4)
    want = sgd_steps(serial, 4)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= F64.roundoff, (got, want)
    sd, ref = model.gather_state_dict(), serial.state_dict()
    assert max(float((sd[k] - ref[k]).norm() / ref[k].norm()) for k in ref) <= F64.roundoff
    log = model.accuracy.log
    assert model.accuracy.exact and len(log) == 1 and log[0].batch == 1, log
    assert "switch to exact" in log[0].action and "forward MGRIT of segment 0 stalled" \
        in log[0].reason
    # the train loop's figures come from the pass that ran (the twin's sequential solve)
    assert model.last_forward[0].iterations == 1 and model.last_forward[0].n_levels == 1


def test_mgrit_resumes_once_it_converges_again() -> None:
    model = layerpar.LayerParallel(net(t_final=60.0, scale=3.0), None,
                                   FWD3, BWD, accuracy=AccuracyPolicy(probe_every=3))
    sgd_steps(model, 1)
    assert model.accuracy.exact
    with torch.no_grad():  # the network becomes benign (as training might make it)
        for p in model.parameters():
            p.mul_(0.01)
    sgd_steps(model, 3, first=1)  # batch 3 probes MGRIT: it converges now
    assert not model.accuracy.exact
    assert "back to MGRIT" in model.accuracy.log[-1].action
    assert model.accuracy.log[-1].batch == 3
    assert model.last_forward[0].n_levels == 3


def test_a_diverging_solve_switches_to_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward MGRIT solve whose residual becomes non-finite (simulated: the engine
    session reports it, as it does for a NaN norm on every rank) is recomputed exactly
    in the same batch; the exact pass's output is the serial one."""
    from layerpar.mgrit import session

    serial = net()
    model = layerpar.LayerParallel(copy.deepcopy(serial), None, FWD, BWD, accuracy=True)
    real = session.EngineSession.drive
    calls = []

    def drive(self, **kw):
        calls.append(self.what)
        if len(calls) == 1:
            raise layerpar.mgrit.DivergenceError(
                f"{self.what} residual became nan in iteration 2: non-finite values")
        return real(self, **kw)

    monkeypatch.setattr(session.EngineSession, "drive", drive)
    x, _ = data(0)
    out = model(x)
    assert model.accuracy.exact and "residual became nan" in model.accuracy.log[0].reason
    with torch.no_grad():
        assert float((out - serial(x)).norm() / serial(x).norm()) <= F64.exact


def test_measured_error_raises_then_lowers_iterations() -> None:
    x, y = data(0)
    loss = torch.nn.functional.cross_entropy
    strict = layerpar.LayerParallel(net(t_final=4.0), None, FWD.replace(max_iter=1),
                                    BWD, accuracy=AccuracyPolicy(min_cosine=0.999999,
                                                                 max_rel_error=1e-4,
                                                                 prefer_cheaper=False))
    first = strict.check_gradients(x, y, loss)
    for _ in range(12):
        if strict.accuracy.exact:
            break
        check = strict.check_gradients(x, y, loss)
        if check.cosine >= 0.999999 and check.param_grad_error <= 1e-4:
            break
    ctl = strict.accuracy
    assert ctl.fwd_iters + ctl.bwd_iters > 2, ctl.log
    assert check.param_grad_error < first.param_grad_error
    assert all("iterations ->" in e.action for e in ctl.log), ctl.log
    loose = layerpar.LayerParallel(net(), None, FWD.replace(max_iter=3), BWD.replace(
        max_iter=2), accuracy=AccuracyPolicy(min_cosine=-1.0, max_rel_error=1e9,
                                             prefer_cheaper=False))
    for _ in range(2):
        loose.check_gradients(x, y, loss)
    assert (loose.accuracy.fwd_iters, loose.accuracy.bwd_iters) == (2, 2), loose.accuracy.log
    assert "room" in loose.accuracy.log[-1].reason


def test_exact_propagation_is_chosen_where_it_is_cheaper(monkeypatch) -> None:
    """A check above the bound where exact propagation timed no slower than MGRIT
    switches to exact (for cost: no residual probes); a later check that finds MGRIT
    within the bound and cheaper brings it back (a window of one timing: each check
    decides; `test_cost_rule_needs_a_window_and_a_margin` covers the window)."""
    from layerpar.parallel import accuracy

    x, y = data(0)
    loss = torch.nn.functional.cross_entropy
    model = layerpar.LayerParallel(net(t_final=4.0), None, FWD, BWD,
                                   accuracy=AccuracyPolicy(cost_window=1))
    real = accuracy.check_gradients
    times = {"inexact": 2.0, "exact": 1.0}

    def timed(*args, **kw):
        got = real(*args, **kw)
        return dataclasses.replace(got, inexact_seconds=times["inexact"],
                                   exact_seconds=times["exact"])

    monkeypatch.setattr(accuracy, "check_gradients", timed)
    model.check_gradients(x, y, loss)
    ctl = model.accuracy
    assert ctl.exact and ctl.exact_for_cost and "cheaper here" in ctl.log[-1].reason
    for _ in range(25):  # no probe brings MGRIT back while it is dearer
        model(x)
    assert ctl.exact
    times.update(inexact=0.5)
    model.check_gradients(x, y, loss)
    assert ctl.exact  # cheaper now, but still outside the bound
    ctl.policy = AccuracyPolicy(min_cosine=-1.0, max_rel_error=1e9)
    model.check_gradients(x, y, loss)
    assert not ctl.exact and "back to MGRIT" in ctl.log[-1].action


def _check(err: float, t_mgrit: float, t_exact: float) -> Any:
    from layerpar.parallel.accuracy import GradientCheck

    return GradientCheck(output_error=0.0, loss_error=0.0, input_grad_error=err,
                         segment_grad_errors=(err,), param_grad_error=err,
                         cosine=1.0 - err * err, fwd_iterations=(2,), bwd_iterations=(1,),
                         fwd_residuals=(None,), bwd_residuals=(None,),
                         inexact_seconds=t_mgrit, exact_seconds=t_exact,
                         n_params_compared=10)


def test_cost_rule_needs_a_window_and_a_margin() -> None:
    """Injected timings: one slow MGRIT timing (or several within the 10% margin)
    never switches to exact propagation; the median of the window does; back to
    MGRIT only once MGRIT's median is more than the margin below exact's."""
    from layerpar.parallel.adaptive import AccuracyController, CostWindow

    ctl = AccuracyController(AccuracyPolicy(max_rel_error=0.01), 2, 1)
    bad = 0.05  # outside the bound: the cost rule may switch to exact
    ctl.observe_check(1, _check(bad, 3.0, 1.0))  # one noisy timing: no verdict yet
    assert not ctl.exact
    for b, t in enumerate((1.05, 1.08, 1.02, 1.06), 2):  # median within the margin
        ctl.observe_check(b, _check(bad, t, 1.0))
    assert not ctl.exact, ctl.log
    for b in range(6, 9):  # MGRIT 1.3x exact over the window
        ctl.observe_check(b, _check(bad, 1.3, 1.0))
    assert ctl.exact and ctl.exact_for_cost, ctl.log
    assert "median of the last 5/5" in ctl.log[-1].reason
    ctl.observe_check(9, _check(0.0, 0.5, 1.0))  # within the bound, one fast timing
    assert ctl.exact  # the window's median still says MGRIT is dearer
    for b in range(10, 13):
        ctl.observe_check(b, _check(0.0, 0.5, 1.0))
    assert not ctl.exact and "back to MGRIT" in ctl.log[-1].action
    w = CostWindow(window=4, margin=0.1)
    for t in (1.0, 1.0, 1.09):
        w.add(t, 1.0)
    assert w.verdict() is None  # within the margin: keep the mode
    w.add(float("nan"), 1.0)  # a failed timing is ignored
    assert len(w.mgrit) == 3 and len(w.exact) == 4


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_decisions_are_the_same_on_every_rank(nprocs: int) -> None:
    proc = run_mpi(WORKERS / "lp_adaptive.py", nprocs, timeout=240)
    lines = rank_lines(proc.stdout)
    assert proc.returncode == 0 and sorted(lines) == list(range(nprocs)), describe(proc)
    reports = {r: ls[-1] for r, ls in lines.items()}
    assert all(r.startswith("OK") for r in reports.values()), describe(proc)
    assert len(set(reports.values())) == 1, reports  # same log, same losses


def test_checks_are_spaced_from_the_last_one() -> None:
    """The next check is due an interval after the last one, also where the interval
    changed in between (auto sets `min_every` from each check's timings: counted at
    the interval's multiples, a check at batch 87 and an interval of 121 brought the
    next at 121, 34 batches on); asked again about the batch it said yes to, it says
    yes again; a batch numbered below the last check's (numbering begun again) counts
    from 0."""
    from layerpar.parallel.adaptive import AccuracyController

    ctl = AccuracyController(AccuracyPolicy(check_every=10), 1, 1)
    ctl.min_every = 87
    first = next(b for b in range(1, 400) if ctl.check_due(b))
    assert first == 87 and ctl.check_due(87)
    ctl.min_every = 121
    assert next(b for b in range(first + 1, 400) if ctl.check_due(b)) == 87 + 121
    assert [b for b in range(1, 130) if ctl.check_due(b)] == [121]


def test_checks_back_off_while_within_the_bound() -> None:
    """With `check_backoff`, each check within the bound doubles the interval between
    checks (up to the cap); one outside the bound resets it; the default is off."""
    from layerpar.parallel.adaptive import AccuracyController

    ctl = AccuracyController(AccuracyPolicy(max_rel_error=0.01, check_backoff=4), 1, 1)
    due = [b for b in range(1, 200) if ctl.check_due(b)][:2]
    assert due == [10, 20]
    for k in range(3):
        ctl.observe_check(10 * k, _check(0.001, 1.0, 1.0))
    assert ctl.backoff == 4 and [b for b in range(1, 100) if ctl.check_due(b)] == [40, 80]
    ctl.observe_check(40, _check(0.05, 1.0, 1.0))
    assert ctl.backoff == 1 and ctl.check_due(50)
    plain = AccuracyController(AccuracyPolicy(max_rel_error=0.01), 1, 1)
    plain.observe_check(10, _check(0.001, 1.0, 1.0))
    assert plain.backoff == 1


def test_checks_back_off_further_far_from_the_bound() -> None:
    """A check within 1/FAR of the bound lets the interval grow FAR_BACKOFF times past
    `check_backoff`; the next check nearer the bound brings it back to the cap, one
    outside the bound to every `check_every`; with `check_backoff` 1 nothing changes."""
    from layerpar.parallel.adaptive import FAR, FAR_BACKOFF, AccuracyController

    far = 0.01 / FAR / 2
    ctl = AccuracyController(AccuracyPolicy(max_rel_error=0.01, check_backoff=4), 1, 1)
    for k in range(6):
        ctl.observe_check(10 * k, _check(far, 1.0, 1.0))
    assert ctl.backoff == 4 * FAR_BACKOFF
    ctl.observe_check(100, _check(0.001, 1.0, 1.0))  # within the bound, not far
    assert ctl.backoff == 4
    ctl.observe_check(140, _check(far, 1.0, 1.0))
    assert ctl.backoff == 8
    ctl.observe_check(200, _check(0.05, 1.0, 1.0))
    assert ctl.backoff == 1
    plain = AccuracyController(AccuracyPolicy(max_rel_error=0.01), 1, 1)
    for k in range(4):
        plain.observe_check(10 * k, _check(far, 1.0, 1.0))
    assert plain.backoff == 1
