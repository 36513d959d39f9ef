"""`FlatAdam` against ``torch.optim.Adam(fused=True)``: the same update of every parameter.

An ODE-net's segments keep their blocks' parameters as rows of one tensor; `FlatAdam`
steps each run of rows as that tensor.  Each test trains two copies of a net, one
under each optimizer, and compares every parameter after every step: serial autograd
(gradients stacked) and a `LayerParallel` pass (gradients read in place), a frozen
layer, a parameter a user re-points (``.data``), options, hooks and bad arguments.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from tolerances import F64

import layerpar
from layerpar.mgrit import MGRITOptions
from layerpar.ode import blocks
from layerpar.ode.flat import flatten
from layerpar.parallel.flatadam import ROW_LIMIT, FlatAdam


def dense_net(n: int = 8, width: int = 4) -> layerpar.ODENet:
    return layerpar.ODENet(open=torch.nn.Linear(3, width),
                           steps=lambda k: blocks.Dense(width, activation="tanh"),
                           n_steps=n, t_final=1.0, close=torch.nn.Linear(width, 5))


def twins(dtype: torch.dtype = torch.float64) -> tuple[layerpar.ODENet, layerpar.ODENet]:
    """Two equal nets, both with their segments laid out flat (a deep copy is not)."""
    torch.manual_seed(0)
    net = dense_net().to(dtype)
    other = copy.deepcopy(net)
    for n in (net, other):
        for _, seg in n.segments:
            flatten(seg.blocks)
    return net, other


def batch(dtype: torch.dtype = torch.float64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 3, generator=g, dtype=dtype), torch.randint(0, 5, (6,), generator=g)


def pair(net: torch.nn.Module, ref: torch.nn.Module, **options: Any
         ) -> tuple[FlatAdam, torch.optim.Adam]:
    """A `FlatAdam` over `net` and the Adam it must equal over `ref`."""
    return FlatAdam(net.parameters(), lr=1e-2, **options), \
        torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True, **options)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = batch(next(model.parameters()).dtype, seed)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def assert_same(a: torch.nn.Module, b: torch.nn.Module, rtol: float = F64.ops) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=0, msg=name)


def test_runs_are_the_segments_rows() -> None:
    net, _ = twins()
    opt = FlatAdam(net.parameters())
    # weights and biases of the 8 blocks: two runs; the open and close layers alone
    assert sorted(len(col) for _, col, _ in opt._runs) == [8, 8]
    assert len(opt.param_groups[0]["params"]) == 2 + 4
    wide = dense_net(width=65)  # 65 x 65 weights: larger rows than a copy pays for
    assert 65 * 65 > ROW_LIMIT >= 65
    assert [len(col) for _, col, _ in FlatAdam(wide.parameters())._runs] == [8]  # biases


@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.1, "amsgrad": True},
                                     {"maximize": True, "betas": (0.8, 0.9)}])
def test_serial_training_equals_adam(options: dict[str, Any]) -> None:
    net, ref = twins()
    opt, want = pair(net, ref, **options)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    sched_ref = torch.optim.lr_scheduler.CosineAnnealingLR(want, T_max=5)
    for k in range(5):
        step(net, opt, k)
        step(ref, want, k)
        sched.step()
        sched_ref.step()
        assert_same(net, ref)


def test_layer_parallel_gradients_are_gathered_not_stacked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    net, ref = twins()
    opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=50)  # (not direct mode)
    model = layerpar.LayerParallel(net, None, opts, opts)
    opt, want = FlatAdam(model.parameters(), lr=1e-2), \
        torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    x, y = batch()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with monkeypatch.context() as m:  # each run's gradients: rows of the pass's stack
        m.setattr(torch, "stack", lambda *a, **k: pytest.fail("stacked"))
        opt._grads()
    for view, col, _ in opt._runs:
        torch.testing.assert_close(view.grad, torch.stack([p.grad for p in col]), rtol=0,
                                   atol=0)
    opt.zero_grad()
    for k in range(4):
        step(model, opt, k)
        step(ref, want, k)
    assert_same(model.whole_net, ref, F64.converged)  # (MGRIT converged, not serial)


def test_a_frozen_layer_is_skipped_as_adam_skips_it() -> None:
    net, ref = twins()
    opt, want = pair(net, ref)
    step(net, opt, 0)
    step(ref, want, 0)
    for n in (net, ref):  # from now on the third block's weight gets no gradient
        n.segments[0][1].blocks[2].linear.weight.requires_grad_(False)
    for k in range(1, 4):
        step(net, opt, k)
        step(ref, want, k)
        assert_same(net, ref)
    for n in (net, ref):  # and trains again
        n.segments[0][1].blocks[2].linear.weight.requires_grad_(True)
    for k in range(4, 6):
        step(net, opt, k)
        step(ref, want, k)
        assert_same(net, ref)


def test_a_parameter_moved_by_the_user_keeps_its_state() -> None:
    net, ref = twins()
    opt, want = pair(net, ref)
    for k in range(2):
        step(net, opt, k)
        step(ref, want, k)
    for n in (net, ref):  # a tensor of its own now: no longer a row
        w = n.segments[0][1].blocks[3].linear.weight
        w.data = w.data.clone()
    for k in range(2, 5):
        step(net, opt, k)
        step(ref, want, k)
        assert_same(net, ref)
    assert sorted(len(col) for _, col, _ in opt._runs) == [3, 4, 8]  # (the biases: 8)


def test_state_dict_round_trip_and_hooks_run_once() -> None:
    net, ref = twins()
    opt = FlatAdam(net.parameters(), lr=1e-2)
    calls: list[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # (wraps Adam's own step)
    step(net, opt, 0)
    assert calls == [1]
    again = FlatAdam(ref.parameters(), lr=1e-2)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # (a saved one)
    ref.load_state_dict(net.state_dict())
    step(net, opt, 1)
    step(ref, again, 1)
    assert_same(net, ref)


def test_zero_grad_keeps_or_drops_as_asked() -> None:
    net, _ = twins()
    opt = FlatAdam(net.parameters())
    x, y = batch()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_bad_arguments_name_themselves() -> None:
    net, _ = twins()
    with pytest.raises(TypeError, match="params"):
        FlatAdam([{"params": list(net.parameters())}])
    with pytest.raises(ValueError, match="params"):
        FlatAdam([])
    with pytest.raises(TypeError, match="fused"):
        FlatAdam(net.parameters(), fused=False)


def test_gathering_its_state_by_parameter_is_refused_by_name() -> None:
    net, _ = twins()
    model = layerpar.LayerParallel(net, None, MGRITOptions(max_levels=1),
                                   MGRITOptions(max_levels=1))
    with pytest.raises(TypeError, match="FlatAdam"):
        model.gather_optimizer_state(FlatAdam(model.parameters()))


def test_a_layer_parallel_backwards_rows_are_gathered_once_then_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward writes each pass's gradients into the last pass's rows where nothing
    else holds them; the step then reuses the gather it worked out (and holds the rows
    only weakly, so that the reuse goes on).  A `.grad` the user keeps makes new rows:
    the gather is worked out again.  Every step equals Adam's."""
    from layerpar.parallel import adjoint
    from layerpar.parallel import flatadam as fa

    net, ref = twins()
    opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=50)
    model = layerpar.LayerParallel(net, None, opts, opts)
    opt, want = FlatAdam(model.parameters(), lr=1e-2), \
        torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    worked, reused = [], []
    of, rows_reused = fa._Gather.of, adjoint.AdjointApp._rows_reused
    monkeypatch.setattr(fa._Gather, "of", staticmethod(lambda g: worked.append(1) or of(g)))

    def counted(*a: Any) -> Any:
        got = rows_reused(*a)
        reused.append(got is not None)
        return got

    monkeypatch.setattr(adjoint.AdjointApp, "_rows_reused", counted)
    kept = None
    for k in range(6):
        n_worked = len(worked)
        step(model, opt, k)
        step(ref, want, k)
        assert_same(model.whole_net, ref, F64.converged)
        if k in (1, 2, 5):  # the rows of the pass before, written again: nothing worked out
            assert reused[-2:] == [True, True] and len(worked) == n_worked, (k, reused)
        if k == 3:  # a row held (below) at the pass before: new rows, worked out again
            assert reused[-2:] != [True, True] and len(worked) > n_worked
        kept = opt._runs[0][1][0].grad if k == 2 else None  # a row of a segment
    assert kept is None
