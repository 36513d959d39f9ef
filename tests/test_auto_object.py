"""`Auto`, the policy above the model: ``LayerParallel(net, comm, "auto")`` and
``accuracy=`` build one; the model under it runs one fixed setting; a training loop
calls it as it calls the model (passes, parameters, modes, conversions, state dicts),
and it wraps a model built already."""
from __future__ import annotations

import copy

import pytest
import torch

import layerpar
from layerpar import LayerParallel, MGRITOptions, ODENet
from layerpar.ode import blocks
from layerpar.parallel import Auto
from layerpar.parallel.adaptive import AccuracyController, AccuracyPolicy
from layerpar.parallel.tuner import AutoAccuracy, AutoTuner

FWD = MGRITOptions(max_levels=2, cfactor=4, max_iter=2, tol=0.0)


def _net() -> ODENet:
    torch.manual_seed(3)
    return ODENet(open=torch.nn.Linear(3, 6),
                  steps=lambda n: blocks.Dense(6, activation="tanh"), n_steps=16,
                  t_final=1.0, close=torch.nn.Linear(6, 4)).double()


def test_the_model_constructor_builds_an_auto_for_auto_and_accuracy() -> None:
    auto = LayerParallel(_net(), None, "auto")
    assert type(auto) is Auto and layerpar.Auto is Auto
    assert isinstance(auto.tuner, AutoTuner) and isinstance(auto.accuracy, AutoAccuracy)
    # the model under it runs one setting: exact propagation until the tuning chose
    assert type(auto.model) is LayerParallel and auto.model.options.max_levels == 1
    assert auto.model.tuner is None and auto.model.accuracy is None
    adaptive = LayerParallel(_net(), None, FWD, accuracy=True)
    assert type(adaptive) is Auto and adaptive.tuner is None
    assert isinstance(adaptive.accuracy, AccuracyController)
    assert adaptive.model.options == FWD
    plain = LayerParallel(_net(), None, FWD, accuracy=False)
    assert type(plain) is LayerParallel and plain.accuracy is None
    for m in (auto, adaptive, plain):
        m.close()


def test_auto_is_called_like_the_model() -> None:
    net = _net()
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (8,))
    auto = Auto(copy.deepcopy(net), None, FWD, policy=AccuracyPolicy())
    lp = auto.model
    assert list(auto.parameters()) == list(lp.parameters())
    assert auto.state_dict().keys() == lp.state_dict().keys()
    assert auto.train() is auto and lp.training
    assert auto.eval() is auto and not lp.training and not auto.training
    auto.train()
    assert auto.to(torch.float64) is auto and auto.double() is auto
    loss = torch.nn.functional.cross_entropy(auto(x), y)
    loss.backward()
    assert all(p.grad is not None for p in auto.parameters())
    assert auto.last_forward and auto.last_forward is lp.last_forward
    assert auto.batch == lp.batch == 1
    got = auto.check_gradients(x, y, torch.nn.functional.cross_entropy)
    assert got.param_grad_error >= 0 and auto.batch == 1
    whole = auto.gather_state_dict()
    assert whole.keys() == net.state_dict().keys()
    auto.close()
    assert lp.closed


def test_auto_wraps_a_model_built_already() -> None:
    lp = LayerParallel(_net(), None, FWD)
    adaptive = Auto(lp, options=None, policy=True)
    assert adaptive.model is lp and adaptive.accuracy.policy == AccuracyPolicy()
    tuned = Auto(lp)
    assert tuned.model is lp and tuned.tuner is not None
    with pytest.raises(TypeError, match="with a LayerParallel, pass only"):
        Auto(lp, None, FWD, policy=True)
    with pytest.raises(TypeError, match="needs options='auto' or an accuracy `policy`"):
        Auto(_net(), None, FWD)
    lp.close()
