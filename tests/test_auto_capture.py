"""Auto's setting captured in a CUDA graph (`AutoCapturedStep`, issue 20).

On one H200, case a trains at 8.6 ms per captured step of a fixed setting against
27-34 ms for auto's eager passes (docs/results/tta/gpu-h200/), so ``layerpar train --auto`` on
CUDA at one rank captures the setting auto chose and captures it again when a
gradient check changes it.  A graph cannot be captured on this CPU: the capture
function is replaced by one that runs the captured step eagerly, which checks all
that is not CUDA's (tests/gpu runs the real capture):

- the captured twin runs exactly the tuner's setting of the moment (the controller's
  iteration counts, or one level once it switched to exact), without controller or
  finiteness check, on the parameter tensors the optimizer updates;
- a check that changes nothing captures nothing; one that moves the iteration counts
  or tunes again captures again;
- a failed capture, and a batch of another shape, train eagerly through the model;
- ``layerpar train`` no longer refuses to capture auto at one rank, still at two.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from test_autotune import _fixed_cost, _stiff_batch

from layerpar.apps.train import _capture_refusal
from layerpar.mgrit.options import MGRITOptions
from layerpar.parallel import AutoCapturedStep, LayerParallel
from layerpar.parallel.adaptive import AccuracyPolicy
from layerpar.parallel.capture import fixed_settings

CE = torch.nn.functional.cross_entropy


class _Eager:
    """What `capture_step` returns, run eagerly: one training step of the twin."""

    def __init__(self, twin: LayerParallel, opt: torch.optim.Optimizer, loss_fn: Any,
                 x: torch.Tensor, y: torch.Tensor) -> None:
        self.twin, self.opt, self.loss_fn, self.x = twin, opt, loss_fn, x

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.twin(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


class _FakeCapture:
    """Records each capture's twin and settings; `fail` makes the next one raise."""

    def __init__(self) -> None:
        self.twins: list[tuple[LayerParallel, MGRITOptions, MGRITOptions]] = []
        self.fail = False

    def __call__(self, twin: LayerParallel, opt: Any, loss_fn: Any, x: torch.Tensor,
                 y: torch.Tensor, warmup: int = 3) -> _Eager:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.twins.append((twin, twin.options, twin.backward_options))
        return _Eager(twin, opt, loss_fn, x, y)


def _tuned(monkeypatch: pytest.MonkeyPatch) -> tuple[LayerParallel, Any, torch.Tensor,
                                                         torch.Tensor]:
    _fixed_cost(monkeypatch)
    net, x, y = _stiff_batch(1.0)
    model = LayerParallel(net, None, "auto", accuracy=AccuracyPolicy(max_rel_error=0.05))
    model.tune(x, y, CE)
    return model, net, x, y


def test_captured_twin_runs_the_setting_of_the_moment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, net, x, y = _tuned(monkeypatch)
    tuner = model.tuner
    ctl = model.accuracy
    assert ctl is not None and not ctl.exact
    reference = copy.deepcopy(net)  # the same weights, trained by a plain eager model
    cap = _FakeCapture()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = AutoCapturedStep(model, opt, CE, x, y, capture=cap)
    assert step.captured and step.captures == 1 and step.why_eager is None
    twin, fwd, bwd = cap.twins[-1]
    chosen = tuner.chosen
    assert fwd.max_iter == ctl.fwd_iters and bwd.max_iter == ctl.bwd_iters
    assert (fwd.max_levels, fwd.cfactor) == (chosen.options.max_levels,
                                             chosen.options.cfactor)
    assert twin.accuracy is None and not twin.check_finite
    # a replay trains the parameters the optimizer holds: as a plain model with the
    # same fixed settings (and the chosen setting's others: batched, coarsening),
    # stepped eagerly, trains a copy of the net
    plain = chosen.like(net=reference, options=fwd, backward_options=bwd, accuracy=None)
    ref_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    batches, passes = tuner.batches, chosen.batch
    chosen.training = False  # as an evaluation between epochs leaves it
    for _ in range(2):
        loss = step(x, y)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = CE(plain(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=0)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # the replays count as the chosen setting's passes (re-tuning budget, batch numbers)
    assert (tuner.batches, chosen.batch) == (batches + 2, passes + 2)
    assert chosen.training  # a replay is a training step: a check runs it so
    # nothing changed: nothing is captured again
    assert not step.refresh(x, y) and step.captures == 1
    # the controller moves the forward iterations: captured again, with them
    ctl.fwd_iters += 1
    assert step.refresh(x, y) and step.captures == 2
    assert cap.twins[-1][1].max_iter == ctl.fwd_iters
    # ... switches to exact propagation: one level
    ctl.exact = True
    assert step.refresh(x, y) and cap.twins[-1][1].max_levels == 1
    assert fixed_settings(model)[1] == MGRITOptions(max_levels=1, tol=0.0)
    ctl.exact = False
    # a re-tuning chooses anew (a new chosen setting): captured again
    model.tuner.tune(model.model, x, y, CE)
    assert model.tuner.chosen is not chosen
    assert step.refresh(x, y) and step.captures == 4
    step.close()
    plain.close()
    model.close()


def test_failed_capture_and_other_shapes_train_eagerly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, net, x, y = _tuned(monkeypatch)
    cap = _FakeCapture()
    cap.fail = True
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = AutoCapturedStep(model, opt, CE, x, y, capture=cap)
    assert not step.captured and step.captures == 0
    assert "RuntimeError" in step.why_eager and "capturing" in step.why_eager
    before = [p.detach().clone() for p in net.parameters()]
    batches = model.tuner.batches
    loss = step(x, y)  # eagerly through the auto model: its forward counts the pass
    assert torch.isfinite(loss) and model.tuner.batches == batches + 1
    assert any(not torch.equal(p, q) for p, q in zip(net.parameters(), before))
    # the capture works again at the next change
    cap.fail = False
    model.accuracy.fwd_iters += 1
    assert step.refresh(x, y) and step.captured and step.why_eager is None
    # a batch of another shape (a short last batch) runs eagerly, not through the graph
    replays = model.tuner.chosen.batch
    step(x[:5], y[:5])
    assert model.tuner.chosen.batch == replays + 1  # the auto model's own forward
    step.close()
    model.close()


def test_a_model_that_was_never_tuned_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    net, x, y = _stiff_batch(1.0)
    model = LayerParallel(net, None, "auto")
    opt = torch.optim.Adam(model.parameters())
    step = AutoCapturedStep(model, opt, CE, x, y, capture=_FakeCapture())
    assert not step.captured and "model.tune" in step.why_eager
    with pytest.raises(TypeError, match="options='auto'"):
        AutoCapturedStep(LayerParallel(net, None), opt, CE, x, y)
    model.close()


def test_train_captures_auto_at_one_rank_only() -> None:
    opts = MGRITOptions(max_iter=1, tol=1e-9)  # auto ignores the options' tolerance
    args = dict(serial=False, policy=AccuracyPolicy(), check_every=0, nested=0,
                data_parallel=1, fwd=opts, bwd=opts)
    assert _capture_refusal("cuda", auto=True, size=1, **args) == ""
    assert "between ranks" in _capture_refusal("cuda", auto=True, size=2, **args)
    assert "adaptive" in _capture_refusal("cuda", auto=False, size=1, **args)
    assert _capture_refusal("cpu", auto=True, size=1, **args) == "not on CUDA"


def test_checks_are_spaced_by_the_replayed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check runs eager passes; with the steps replayed, its interval is set against
    the replayed step's measured time (`observe_step`), several times shorter than
    the eager pass the tuning timed, so the checks stay at `CHECK_SHARE` of the
    training's time instead of several times that."""
    import layerpar.parallel.tuner as tn

    model, net, x, y = _tuned(monkeypatch)
    tuner, ctl = model.tuner, model.accuracy
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cap = _FakeCapture()
    step = AutoCapturedStep(model, opt, CE, x, y, capture=cap)
    calls: list[tuple] = []
    interval = tn._check_interval
    monkeypatch.setattr(tn, "_check_interval",
                        lambda *a: calls.append(a) or interval(*a))
    step.observe_step(None)  # nothing replayed yet: nothing changes
    assert tuner.step_seconds is None
    model.check_gradients(x, y, CE)
    assert len(calls) == 1 and calls[0][3] is None  # against the check's eager pass
    step.observe_step(0.002)  # a replayed step's measured seconds
    assert tuner.step_seconds == 0.002
    model.check_gradients(x, y, CE)
    assert len(calls) == 2 and calls[1][3] == 0.002
    assert ctl.min_every == interval(*calls[1])
    # the interval's formula: a check's eager passes over CHECK_SHARE of a step
    assert tn._check_interval(0.03, 0.1, 0.25) == math.ceil(
        (0.03 + 0.1 * 1.25) / (tn.CHECK_SHARE * 0.03))
    assert tn._check_interval(0.03, 0.1, 0.25, 0.01) == math.ceil(
        (0.03 + 0.1 * 1.25) / (tn.CHECK_SHARE * 0.01))
    for bad in (0.0, math.inf, math.nan):  # no usable step time: the pass's
        assert tn._check_interval(0.03, 0.1, 0.25, bad) == tn._check_interval(0.03, 0.1,
                                                                             0.25)
    # a step that failed to capture (eager) does not report replays
    cap.fail = True
    ctl.fwd_iters += 1
    assert not step.refresh(x, y) and not step.captured
    tuner.step_seconds = None
    step.observe_step(0.001)
    assert tuner.step_seconds is None
    step.close()
    model.close()


def _alive_after(step: Any, params: list[torch.Tensor]) -> int:
    """How many of the parameters' AccumulateGrad nodes made before `step()` still
    exist after it (each node is marked in its metadata, which lives with the node)."""
    import gc

    from torch.autograd.graph import get_gradient_edge

    for p in params:
        get_gradient_edge(p).node.metadata["before"] = True
    enabled = gc.isenabled()
    gc.disable()  # what the cyclic collector alone frees counts as alive (it may not run)
    try:
        step()
        return sum("before" in get_gradient_edge(p).node.metadata for p in params)
    finally:
        if enabled:
            gc.enable()


def _small_net() -> Any:
    import layerpar
    from layerpar.ode import blocks

    torch.manual_seed(0)
    return layerpar.ODENet(open=torch.nn.Linear(8, 16), steps=lambda k: blocks.Dense(16),
                           n_steps=32, t_final=1.0, close=torch.nn.Linear(16, 5))


def test_no_gradient_node_outlives_a_capture_reset() -> None:
    """A parameter's AccumulateGrad node is bound to the CUDA stream it was made on
    and lives while anything holds it.  On the H100 nodes made by eager passes on the
    default stream (auto's tuning, a user's own steps) survived into `capture_step`
    and broke the capture: the engine kept direct mode's states with their graph
    until its next solve, and each model cached the nodes of its parameters.  Now a
    direct pass leaves no node alive, a plain layer's record is no reference cycle
    (each kept its pass's graph until the cyclic collector ran), and one
    `reset_grad_delivery` (what `capture_step` calls before capturing) forgets the
    nodes every model sharing the parameters cached."""
    x, y = torch.randn(32, 8), torch.randint(0, 5, (32,))
    net = _small_net()
    one = MGRITOptions(max_levels=1, tol=0.0, rtol=0.0)
    mg = MGRITOptions(max_levels=2, cfactor=4, max_iter=1, tol=0.0, rtol=0.0)
    direct = LayerParallel(net, None, one, one, check_finite=False)
    a = LayerParallel(net, None, mg, mg, check_finite=False)
    b = direct.like(options=mg, backward_options=mg)  # another model, same parameters
    params = [p for p in net.parameters()]
    seg = [p for p in params if p.dim() == 2 and p.shape == (16, 16)]
    assert len(seg) == 32

    def train(m: LayerParallel) -> None:
        m.zero_grad(set_to_none=True)
        CE(m(x), y).backward()

    for m in (direct, a, b):
        train(m)
    assert _alive_after(lambda: None, seg) == len(seg)  # cached by a and b
    a.reset_grad_delivery()
    # the segment's nodes are gone (the open and close layers' too: nothing holds them)
    assert _alive_after(lambda: None, params) == 0
    assert _alive_after(lambda: train(direct), params) == 0  # a direct pass keeps none
    for m in (a, b):  # and the models train on, remaking their nodes
        train(m)
        assert all(p.grad is not None for p in params)
    for m in (direct, a, b):
        m.close()


_SETTINGS = [("direct", 1, 2, 1, "injection"), ("L2 cf4", 2, 4, 1, "injection"),
             ("L3 cf4 2/1", 3, 4, 2, "injection"), ("L3 cf4 avg", 3, 4, 1, "average"),
             ("L4 cf2 avg 2/1", 4, 2, 2, "average")]


@pytest.mark.parametrize("name,levels,cf,iters,coarsening", _SETTINGS)
def test_a_steady_pass_is_capturable(name: str, levels: int, cf: int, iters: int,
                                     coarsening: str, monkeypatch: pytest.MonkeyPatch
                                     ) -> None:
    """What a CUDA graph cannot capture, seen on the CPU: after the first passes, a
    training step makes no tensor from host data (on a GPU a copy from pageable
    memory: refused in a capture, and a wait for the GPU outside one; the averaged
    coarse steps made their index anew each pass, which left auto's setting eager on
    the H200) and reads no value back.  The capture's own branches are taken
    (`torch.cuda.is_current_stream_capturing` and the adjoint's `_capturing` say
    yes), and the step leaves no reference cycle behind."""
    import gc

    from torch.utils._python_dispatch import TorchDispatchMode

    from layerpar.parallel import adjoint

    class Record(TorchDispatchMode):
        hits: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            op = func.__name__.split(".")[0]
            if op in ("lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "item",
                      "is_nonzero", "nonzero", "equal"):
                self.hits.append(op)
            return func(*args, **(kwargs or {}))

    net = _small_net()
    opts = MGRITOptions(max_levels=levels, cfactor=cf, max_iter=iters, tol=0.0, rtol=0.0)
    model = LayerParallel(net, None, opts, opts.replace(max_iter=1), check_finite=False,
                          coarsening=coarsening)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randint(0, 5, (32,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        CE(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(adjoint, "_capturing", lambda t: True)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with Record() as rec:
            step()
        step()
        cycles = gc.collect()
    finally:
        if enabled:
            gc.enable()
    assert rec.hits == [], (name, rec.hits)
    assert cycles == 0, name
    model.close()


def test_a_closed_models_parameters_are_not_kept_alive() -> None:
    """The gradient-node caches die with their models: one reset reaches every live
    model's, but no process-wide cache keeps a discarded model's parameters (each
    node holds its parameter)."""
    import gc
    import weakref

    x, y = torch.randn(32, 8), torch.randint(0, 5, (32,))
    net = _small_net()
    mg = MGRITOptions(max_levels=2, cfactor=4, max_iter=1, tol=0.0, rtol=0.0)
    model = LayerParallel(net, None, mg, mg, check_finite=False)
    CE(model(x), y).backward()
    watched = weakref.ref(next(iter(net.parameters())))
    model.close()
    del model, net
    gc.collect()
    assert watched() is None
