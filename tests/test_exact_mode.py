"""Exact propagation is a mode of the model itself (`LayerParallel.exact`), on its own
plan and communicator: no second model is built, and a pass run in it (its backward
too, wherever that runs) equals the serial oracle although the model's own options
are inexact."""
from __future__ import annotations

import copy

import pytest
import torch

from layerpar import LayerParallel, MGRITOptions, ODENet
from layerpar.ode import blocks
from layerpar.parallel import model as model_module


def _net() -> ODENet:
    torch.manual_seed(3)
    return ODENet(open=torch.nn.Linear(3, 6),
                  steps=lambda n: blocks.Dense(6, activation="tanh"), n_steps=16,
                  t_final=2.0, close=torch.nn.Linear(6, 4)).double()


@pytest.mark.parametrize("batched", [True, False])
def test_exact_pass_equals_the_serial_oracle(batched: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    net = _net()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (5,))
    ref = copy.deepcopy(net)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    inexact = MGRITOptions(max_levels=3, cfactor=2, max_iter=1)
    model = LayerParallel(copy.deepcopy(net), None, inexact, batched=batched)
    built = []
    init = model_module.LayerParallel.__init__

    def counting(self: LayerParallel, *args: object, **kwargs: object) -> None:
        built.append(1)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(model_module.LayerParallel, "__init__", counting)
    transport = model.transport
    with model.exact():
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    loss.backward()  # outside the context: the pass remembers it was exact
    assert not built and model.transport is transport
    assert [s.n_levels for s in model.last_forward] == [1]
    for name, p in model.named_parameters():
        g = dict(ref.named_parameters())[name].grad
        assert torch.allclose(p.grad, g, rtol=1e-12, atol=1e-14), name
    # the model's own passes are inexact again
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert model.last_forward[0].n_levels == 3
    check = model.check_gradients(x, y, torch.nn.functional.cross_entropy)
    assert not built and check.param_grad_error > 1e-6
    model.close()
