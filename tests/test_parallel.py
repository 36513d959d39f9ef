"""LayerParallel on one process (comm=None) against the serial ODENet oracle.

Multi-rank checks of the same properties are in test_parallel_mpi.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from tolerances import F32, F64

import layerpar
from layerpar.mgrit import DivergenceError, MGRITOptions
from layerpar.ode import Segment, blocks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def dense_net(n: int = 12, width: int = 4, dropout: float = 0.0) -> layerpar.ODENet:
    def block(k: int) -> torch.nn.Module:
        d = blocks.Dense(width, activation="tanh")
        return torch.nn.Sequential(d, torch.nn.Dropout(dropout)) if dropout else d

    return layerpar.ODENet(open=torch.nn.Linear(3, width), steps=block, n_steps=n, t_final=2.0,
                           close=torch.nn.Linear(width, 5))


def bn_net(n: int = 8) -> layerpar.ODENet:
    return layerpar.ODENet(layers=[
        torch.nn.Conv2d(1, 3, 3, padding=1),
        Segment(lambda k: blocks.Conv(3, activation="relu", batch_norm=True), n, 1.0),
        torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5)])


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


EXACT = MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=50)
ONE = MGRITOptions(max_levels=1)  # one rank, one level: direct mode (PyTorch runs backward)


@pytest.mark.parametrize("n", [12, 1])  # 1 layer: the engine calls step(), not step_seq()
@pytest.mark.parametrize("opts", [MGRITOptions(max_levels=1), EXACT,
                                  MGRITOptions(max_levels=2, cfactor=4, tol=1e-13, max_iter=50,
                                               fmg=True)])
def test_matches_serial_oracle(opts: MGRITOptions, n: int) -> None:
    torch.manual_seed(0)
    net = dense_net(n).double()
    ref = copy.deepcopy(net)
    x = torch.randn(7, 3, dtype=torch.float64)
    y = torch.randint(0, 5, (7,))
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref(xr), y).backward()
    model = layerpar.LayerParallel(net, None, opts, opts)
    out = model(xp)
    torch.nn.functional.cross_entropy(out, y).backward()
    assert rel(out.detach(), ref(x).detach()) <= F64.converged
    assert rel(xp.grad, xr.grad) <= F64.converged
    refg = grads(ref)
    for name, g in grads(model).items():
        assert rel(g, refg[name]) <= F64.converged, name
    assert set(grads(model)) == set(refg)
    if opts.max_levels == 1:  # sequential: bit for bit
        assert torch.equal(out.detach(), ref(x).detach())
        assert model.last_forward[0].iterations == 1
        assert model.last_backward[0].iterations == 1


@pytest.mark.parametrize("opts", [ONE, EXACT])
def test_groups_of_plain_layers_match_serial_oracle(opts: MGRITOptions) -> None:
    """Consecutive plain layers (one graph per group) before, between and after segments."""
    torch.manual_seed(0)
    net = layerpar.ODENet(layers=[
        torch.nn.Conv2d(1, 3, 3, padding=1), torch.nn.Tanh(),
        Segment(lambda k: blocks.Conv(3, activation="tanh"), 6, 1.0),
        torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.ReLU(),
        Segment(lambda k: blocks.Conv(4, activation="tanh"), 5, 1.0),
        torch.nn.AvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(4 * 2 * 2, 5)]).double()
    ref = copy.deepcopy(net)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    model = layerpar.LayerParallel(net, None, opts, opts)
    model(xp).square().sum().backward()
    assert rel(xp.grad, xr.grad) <= F64.converged
    assert len(model.last_backward) == 2
    refg = grads(ref)
    for name, g in grads(model).items():
        assert rel(g, refg[name]) <= F64.converged, name


def test_inexact_is_reported_and_bounded() -> None:
    torch.manual_seed(0)
    net = dense_net(32, 8).double()
    ref = copy.deepcopy(net)
    x = torch.randn(16, 3, dtype=torch.float64)
    fwd = MGRITOptions(max_levels=3, cfactor=4, max_iter=2, tol=0.0)
    bwd = MGRITOptions(max_levels=3, cfactor=4, max_iter=1, tol=0.0)
    model = layerpar.LayerParallel(net, None, fwd, bwd)
    out = model(x)
    out.sum().backward()
    ref(x).sum().backward()
    err = rel(out.detach(), ref(x).detach())
    assert 0 < err < 0.1  # inexact, but close
    stats = model.last_forward[0]
    assert stats.iterations == 2 and not stats.converged
    assert len(stats.residual_history) == 1  # skip: r_1 only
    assert model.last_backward[0].iterations == 1


def test_float32_end_to_end() -> None:
    torch.manual_seed(0)
    net = dense_net()
    ref = copy.deepcopy(net)
    x = torch.randn(5, 3)
    opts = MGRITOptions(max_levels=3, cfactor=2, tol=1e-6, max_iter=30)
    model = layerpar.LayerParallel(net, None, opts, opts)
    out = model(x)
    assert out.dtype == torch.float32
    out.square().sum().backward()
    ref(x).square().sum().backward()
    refg = grads(ref)
    for name, g in grads(model).items():
        assert g.dtype == torch.float32
        assert rel(g, refg[name]) <= F32.converged, name


def test_batch_size_may_change_and_no_grad_forward() -> None:
    torch.manual_seed(0)
    net = dense_net().double()
    model = layerpar.LayerParallel(copy.deepcopy(net), None, EXACT, EXACT)
    for bs in (8, 3, 8):
        x = torch.randn(bs, 3, dtype=torch.float64)
        out = model(x)
        assert out.shape == (bs, 5)
        out.sum().backward()
        with torch.no_grad():
            assert rel(model(x), net(x)) <= F64.converged


def test_state_dict_roundtrip_and_names() -> None:
    torch.manual_seed(3)
    net = dense_net()
    model = layerpar.LayerParallel(copy.deepcopy(net), None)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in net.named_parameters()]
    sd = model.gather_state_dict()
    fresh = dense_net()
    fresh.load_state_dict(sd)
    x = torch.randn(4, 3)
    assert torch.equal(fresh(x), net(x))
    model2 = layerpar.LayerParallel(dense_net, None, state_dict=sd)
    with torch.no_grad():
        assert torch.equal(model2(x), net(x))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, gen_seed: int,
           steps: int) -> list[float]:
    """`steps` Adam steps on batches drawn from a generator seeded with `gen_seed`."""
    gen = torch.Generator().manual_seed(gen_seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 3, generator=gen)
        y = torch.randint(0, 5, (8,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_checkpoint_resume_gives_same_losses() -> None:
    torch.manual_seed(0)
    model = layerpar.LayerParallel(dense_net, None, EXACT, EXACT)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    uninterrupted = _train(model, opt, 5, 3) + _train(model, opt, 105, 2)

    torch.manual_seed(0)
    model = layerpar.LayerParallel(dense_net, None, EXACT, EXACT)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = _train(model, opt, 5, 3)
    ckpt = {"model": model.gather_state_dict(), "opt": copy.deepcopy(opt.state_dict())}
    del model, opt
    model = layerpar.LayerParallel(dense_net, None, EXACT, EXACT, state_dict=ckpt["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["opt"])
    resumed = _train(model, opt, 105, 2)
    assert first + resumed == uninterrupted


@pytest.mark.parametrize("opts", [ONE, EXACT])
def test_dropout_matches_serial_with_same_seed(opts: MGRITOptions) -> None:
    torch.manual_seed(0)
    net = dense_net(10, 6, dropout=0.3).double()
    ref = copy.deepcopy(net)
    x = torch.randn(9, 3, dtype=torch.float64)
    model = layerpar.LayerParallel(net, None, opts, opts)
    torch.manual_seed(42)
    out = model(x)
    torch.manual_seed(42)
    out_ref = ref(x)
    assert rel(out.detach(), out_ref.detach()) <= F64.converged
    out.sum().backward()
    out_ref.sum().backward()
    refg = grads(ref)
    for name, g in grads(model).items():
        assert rel(g, refg[name]) <= F64.converged, name
    torch.manual_seed(43)
    assert rel(model(x).detach(), out_ref.detach()) > 1e-3  # a new batch, new masks


@pytest.mark.parametrize("opts", [ONE, EXACT])
def test_batch_norm_running_stats_updated_once_per_batch(opts: MGRITOptions) -> None:
    torch.manual_seed(0)
    net = bn_net().double()
    ref = copy.deepcopy(net)
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    model = layerpar.LayerParallel(net, None, opts, opts)
    out = model(x)
    out_ref = ref(x)
    assert rel(out.detach(), out_ref.detach()) <= F64.converged
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.allclose(b, rb, rtol=F64.converged, atol=F64.roundoff), name
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert rel(model(x), ref(x)) <= F64.converged


@pytest.mark.parametrize("opts", [ONE, EXACT])
def test_nan_loss_raises(opts: MGRITOptions) -> None:
    torch.manual_seed(0)
    model = layerpar.LayerParallel(dense_net, None, opts, opts)
    out = model(torch.randn(4, 3))
    with pytest.raises(DivergenceError, match="not finite"):
        (out.sum() * float("nan")).backward()
    with pytest.raises(DivergenceError, match="non-finite"):
        model(torch.full((4, 3), float("nan")))


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(TypeError, match="`net`"):
        layerpar.LayerParallel(42, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`options`"):
        layerpar.LayerParallel(dense_net(), None, options={"max_levels": 2})  # type: ignore
    with pytest.raises(ValueError, match="`coarsening`"):
        layerpar.LayerParallel(dense_net(), None, coarsening="median")
    with pytest.raises(TypeError, match="`x`"):
        layerpar.LayerParallel(dense_net(), None)([1.0, 2.0])  # type: ignore[arg-type]
    # the meta device (shapes, no values) failed deep in the first pass, naming nothing
    with pytest.raises(ValueError, match="`net` is on the meta device"):
        layerpar.LayerParallel(dense_net().to("meta"), None)
    model = layerpar.LayerParallel(dense_net(), None)
    with pytest.raises(ValueError, match="`x` is on the meta device"):
        model(torch.empty(2, 3, device="meta"))


def test_batch_norm_model_built_in_eval_mode_then_trained() -> None:
    """Running statistics move once per batch whatever mode the model was built in."""
    torch.manual_seed(0)
    net = bn_net().double().eval()
    ref = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, None, EXACT, EXACT)
    model.train()
    ref.train()
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    model(x).sum().backward()
    ref(x).sum().backward()
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.allclose(b, rb, rtol=F64.converged, atol=F64.roundoff), name


@pytest.mark.parametrize("opts", [ONE, EXACT])
def test_autograd_grad_and_backward_inputs_behave_as_in_serial_code(
        opts: MGRITOptions) -> None:
    """`autograd.grad` returns the oracle's gradients and leaves `.grad` alone;
    `backward(inputs=...)` fills only those; frozen parameters get nothing.  Both in
    direct mode (ONE) and through the adjoint MGRIT Function (EXACT)."""
    torch.manual_seed(0)
    net = dense_net().double()
    ref = copy.deepcopy(net)
    model = layerpar.LayerParallel(net, None, opts, opts)
    assert model._direct is (opts is ONE)
    x = torch.randn(5, 3, dtype=torch.float64)
    names = [n for n, _ in model.named_parameters()]
    refp = dict(ref.named_parameters())
    got = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    want = torch.autograd.grad(ref(x).square().sum(), [refp[n] for n in names])
    for name, g, w in zip(names, got, want):
        assert rel(g, w) <= F64.converged, name
    assert all(p.grad is None for p in model.parameters())
    params = dict(model.named_parameters())
    chosen = {"layers.1.blocks.3.linear.weight", "layers.2.bias"}
    model(x).square().sum().backward(inputs=[params[n] for n in sorted(chosen)])
    for name, g in zip(names, want):
        p = params[name]
        assert (p.grad is not None) == (name in chosen), name
        if p.grad is not None:
            assert rel(p.grad, g) <= F64.converged, name
    # frozen parameters: only the input's gradient is wanted
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(xp).square().sum().backward()
    ref(xr).square().sum().backward()
    assert rel(xp.grad, xr.grad) <= F64.converged
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("opts", [ONE, EXACT])
def test_block_that_changes_the_shape_is_refused(opts: MGRITOptions) -> None:
    """u + h F(u) would broadcast F(u) of shape [B, 1] silently: name the layer."""
    class Narrow(torch.nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1 if k == 3 else 4)

        def forward(self, u: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(u))

    net = layerpar.ODENet(open=torch.nn.Linear(3, 4), steps=Narrow, n_steps=6,
                          close=torch.nn.Linear(4, 5))
    model = layerpar.LayerParallel(net, None, opts, opts)
    for _ in range(2):  # and again: a failed first pass must not mark the shape checked
        with pytest.raises(ValueError,
                           match=r"layer 3 of segment 0 \(Narrow\) changed .* \(2, 1\)"):
            model(torch.randn(2, 3))
    with torch.no_grad(), pytest.raises(ValueError, match="layer 3 of segment 0"):
        model(torch.randn(2, 3))


def test_optimizer_state_helpers_name_what_is_wrong() -> None:
    torch.manual_seed(0)
    model = layerpar.LayerParallel(dense_net(), None, EXACT, EXACT)
    stranger = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"`optimizer` \(param_groups\[0\]\['params'\]\["):
        model.gather_optimizer_state(torch.optim.SGD([*model.parameters(), stranger], lr=0.1))
    with pytest.raises(TypeError, match="`optimizer` must be a torch.optim.Optimizer"):
        model.gather_optimizer_state(object())  # type: ignore[arg-type]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    sgd.step()
    state = model.gather_optimizer_state(sgd)
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="gathered from a SGD optimizer; it cannot be loaded "
                                         "into a Adam"):
        model.load_optimizer_state(adam, state)
    with pytest.raises(ValueError, match="`state` must be what gather_optimizer_state"):
        model.load_optimizer_state(sgd, {"state": {}})
    model.load_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               state)  # the right one still loads


def test_loading_an_optimizer_state_leaves_it_as_gathered() -> None:
    """The loaded optimizer owns copies: training on does not change the gathered state
    (it can be loaded again, e.g. into a model on another grid shape)."""
    torch.manual_seed(0)
    model = layerpar.LayerParallel(dense_net(), None, EXACT, EXACT)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    adam.step()
    state = model.gather_optimizer_state(adam)
    before = {n: {k: v.clone() for k, v in st.items()} for n, st in state["state"].items()}
    again = torch.optim.Adam(model.parameters(), lr=0.01)
    model.load_optimizer_state(again, state)
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        again.step()
    for n, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(v, before[n][k]), (n, k)


def test_forward_after_close_says_so() -> None:
    model = layerpar.LayerParallel(dense_net(), None, EXACT, EXACT)
    model.close()
    with pytest.raises(RuntimeError, match="this LayerParallel was closed"):
        model(torch.randn(2, 3))


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout": 0}, "`timeout` must be a positive finite number"),
    ({"timeout": float("nan")}, "`timeout` must be a positive finite number"),
    ({"timeout": "60"}, "`timeout` must be a number of seconds or None"),
    ({"check_inputs": -1}, "`check_inputs` must be an int >= 0"),
    ({"check_inputs": True}, "`check_inputs` must be an int >= 0"),
    ({"check_finite": 1}, "`check_finite` must be a bool"),
    ({"batched": "yes"}, "`batched` must be True, False or \"auto\""),
])
def test_new_arguments_are_validated(kwargs: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        layerpar.LayerParallel(dense_net(), None, EXACT, EXACT, **kwargs)


def test_solve_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="`timeout` must be a positive finite number"):
        layerpar.solve(lambda u, a, b, lv: u, torch.ones(1), 4, 1.0, timeout=-1.0)
