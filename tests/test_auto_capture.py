"""Auto's setting captured in a CUDA graph (`AutoCapturedStep`, issue 20).

On one H200, case a trains at 8.6 ms per captured step of a fixed setting against
27-34 ms for auto's eager passes (docs/tta/gpu/), so ``layerpar train --auto`` on
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
    model._auto.tune(model, x, y, CE)
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
    import layerpar.parallel.autotune as at

    model, net, x, y = _tuned(monkeypatch)
    tuner, ctl = model.tuner, model.accuracy
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cap = _FakeCapture()
    step = AutoCapturedStep(model, opt, CE, x, y, capture=cap)
    calls: list[tuple] = []
    interval = at._check_interval
    monkeypatch.setattr(at, "_check_interval",
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
    assert at._check_interval(0.03, 0.1, 0.25) == math.ceil(
        (0.03 + 0.1 * 1.25) / (at.CHECK_SHARE * 0.03))
    assert at._check_interval(0.03, 0.1, 0.25, 0.01) == math.ceil(
        (0.03 + 0.1 * 1.25) / (at.CHECK_SHARE * 0.01))
    for bad in (0.0, math.inf, math.nan):  # no usable step time: the pass's
        assert at._check_interval(0.03, 0.1, 0.25, bad) == at._check_interval(0.03, 0.1,
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
