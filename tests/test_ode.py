"""Tests of layerpar.ode: schemes, blocks, coarsening, per-layer RNG and the serial oracle."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import F64
from torch import nn
from torch.func import functional_call

from layerpar.ode import ODENet, Segment, layer_rng, sequential_segment
from layerpar.ode.blocks import Conv, Dense
from layerpar.ode.coarsening import coarse_block
from layerpar.ode.rng import draw_seed, needs_rng
from layerpar.ode.schemes import SCHEMES, get_scheme


def dense_segment(width=3, n=4, t_final=1.0, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return Segment(lambda n: Dense(width), n, t_final, **kw).to(dtype)


# --- schemes and gradients -------------------------------------------------------------


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_gradcheck_segment_forward(scheme):
    seg = dense_segment(scheme=scheme)
    names = [n for n, _ in seg.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in seg.named_parameters()]
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def f(x, *params):
        return functional_call(seg, dict(zip(names, params)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params))


def test_scheme_orders_on_linear_ode():
    # u' = a*u with an identity-activation block: error ratio at halved h shows the order.
    a = -0.7
    for name, cls in SCHEMES.items():
        errs = []
        for n in (8, 16):
            block = lambda k: Dense(1, activation="identity", bias=False)  # noqa: E731
            seg = Segment(block, n, scheme=name).double()
            for b in seg.blocks:
                b.linear.weight.data.fill_(a)
            u = seg(torch.ones(1, 1, dtype=torch.float64))
            errs.append(abs(u.item() - math.exp(a)))
        rate = math.log2(errs[0] / errs[1])
        assert abs(rate - cls.order) < 0.2, (name, rate)


def test_scheme_does_not_modify_input():
    u = torch.randn(4, 3, dtype=torch.float64)
    u0 = u.clone()
    for name in SCHEMES:
        get_scheme(name).step(torch.tanh, u, 0.3)
        assert torch.equal(u, u0)


# --- times and steps ---------------------------------------------------------------------


def test_time_formula_bit_exact():
    seg = Segment(lambda n: Dense(2), 7, 0.7, t_start=0.1)
    for i in range(8):
        assert seg.time(i) == 0.1 + (i / 7) * (0.7 - 0.1)
    assert seg.time(0) == 0.1 and seg.time(7) == 0.7
    with pytest.raises(IndexError):
        seg.time(8)


def test_fine_step_bit_exact():
    seg = dense_segment(n=5, t_final=2.3)
    u = torch.randn(4, 3, dtype=torch.float64)
    lin = seg.blocks[2].linear
    expected = torch.add(u, torch.tanh(lin(u)), alpha=seg.time(3) - seg.time(2))
    assert torch.equal(seg.step(u, 2, 3), expected)
    for coarsening in ("injection", "average"):
        assert coarse_block(seg.blocks, 2, 3, coarsening) is seg.blocks[2]


def test_forward_is_sequential_stepping():
    seg = dense_segment(n=6)
    u = torch.randn(4, 3, dtype=torch.float64)
    v = u
    for n in range(6):
        v = v + (seg.time(n + 1) - seg.time(n)) * torch.tanh(seg.blocks[n].linear(v))
    torch.testing.assert_close(seg(u), v, rtol=F64.ops, atol=F64.ops)


def test_coarse_step_injection():
    seg = dense_segment(n=8, t_final=3.0)
    u = torch.randn(4, 3, dtype=torch.float64)
    dt = seg.time(6) - seg.time(2)
    expected = torch.add(u, seg.blocks[2](u), alpha=dt)
    assert torch.equal(seg.step(u, 2, 6), expected)
    assert not torch.equal(seg.step(u, 2, 6), torch.add(u, seg.blocks[3](u), alpha=dt))


def test_coarse_step_average_matches_hand_built_block():
    seg = dense_segment(n=8, t_final=3.0)
    u = torch.randn(4, 3, dtype=torch.float64)
    avg = nn.Linear(3, 3).double()
    with torch.no_grad():
        avg.weight.copy_(sum(seg.blocks[k].linear.weight for k in range(2, 6)) / 4)
        avg.bias.copy_(sum(seg.blocks[k].linear.bias for k in range(2, 6)) / 4)
    expected = u + (seg.time(6) - seg.time(2)) * torch.tanh(avg(u))
    before = [p.detach().clone() for p in seg.blocks[2].parameters()]
    got = seg.step(u, 2, 6, coarsening="average")
    torch.testing.assert_close(got, expected, rtol=F64.step, atol=F64.step)
    # the block's own parameters are untouched by the averaged evaluation
    assert all(torch.equal(a, b) for a, b in zip(before, seg.blocks[2].parameters()))


def test_coarse_average_gradients_reach_every_averaged_block():
    seg = dense_segment(n=8)
    seg.step(torch.randn(4, 3, dtype=torch.float64), 2, 6, coarsening="average").sum().backward()
    for k, b in enumerate(seg.blocks):
        if 2 <= k < 6:
            assert b.linear.weight.grad is not None and b.linear.weight.grad.abs().sum() > 0
            # each of the four blocks gets a quarter of the averaged gradient
            torch.testing.assert_close(b.linear.weight.grad, seg.blocks[2].linear.weight.grad)
        else:
            assert b.linear.weight.grad is None


def test_coarse_average_needs_matching_parameters():
    blocks = nn.ModuleList([Dense(3), Dense(3), Dense(3, bias=False)])
    with pytest.raises(ValueError, match="block 2"):
        coarse_block(blocks, 0, 3, "average")
    coarse_block(blocks, 0, 3, "injection")  # injection does not care


# --- ODENet ---------------------------------------------------------------------------


def test_odenet_simple_and_layers_forms_agree():
    torch.manual_seed(1)
    net = ODENet(nn.Linear(2, 8), lambda n: Dense(8), 32, 5.0, nn.Linear(8, 5))
    names = dict(net.named_parameters())
    assert "layers.1.blocks.5.linear.weight" in names
    assert {"layers.0.weight", "layers.2.bias"} <= names.keys()
    assert net.n_steps_total == 32 and [k for k, _ in net.segments] == [1]
    same = ODENet(layers=list(net.layers))
    x = torch.randn(10, 2)
    assert torch.equal(net(x), same(x))
    assert "n_steps_total=32" in repr(net)
    no_open = ODENet(steps=lambda n: Dense(2), n_steps=3)
    assert "layers.0.blocks.2.linear.weight" in dict(no_open.named_parameters())


def test_multi_segment_net_forward_backward():
    torch.manual_seed(2)
    net = ODENet(
        layers=[
            nn.Conv2d(1, 4, 3, padding=1),
            Segment(lambda n: Conv(4), 3, 1.0),
            nn.Conv2d(4, 8, 3, stride=2, padding=1),
            Segment(lambda n: Conv(8, batch_norm=True), 2, 0.5, scheme="heun"),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        ]
    )
    assert [k for k, _ in net.segments] == [1, 3] and net.n_steps_total == 5
    out = net(torch.randn(5, 1, 8, 8))
    assert out.shape == (5, 10)
    out.sum().backward()
    for name, p in net.named_parameters():
        assert p.grad is not None, name


def test_sequential_segment_reproduces_resnet():
    torch.manual_seed(3)
    mods = nn.Sequential(*[Dense(4, activation="relu") for _ in range(3)]).double()
    seg = sequential_segment(mods)
    assert all(a is b for a, b in zip(seg.blocks, mods))
    x = torch.randn(2, 4, dtype=torch.float64)
    v = x
    for m in mods:
        v = v + m(v)
    torch.testing.assert_close(seg(x), v, rtol=F64.ops, atol=F64.ops)


# --- dropout and RNG ------------------------------------------------------------------


def dropout_segment(n=4):
    return Segment(lambda k: nn.Sequential(Dense(6), nn.Dropout(0.5)), n).double()


def test_needs_rng():
    seg = dropout_segment()
    assert needs_rng(seg.blocks[0])
    seg.eval()
    assert not needs_rng(seg.blocks[0])
    assert not needs_rng(Dense(3).train())


def test_layer_rng_is_deterministic_and_restores_state():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with layer_rng(7, 0, 3):
        a = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), state)
    with layer_rng(7, 0, 3):
        b = torch.rand(5)
    with layer_rng(7, 0, 4):
        c = torch.rand(5)
    with pytest.raises(RuntimeError), layer_rng(7, 0, 3):
        raise RuntimeError
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dropout_mask_per_layer_and_seed():
    seg = dropout_segment().train()
    u = torch.randn(8, 6, dtype=torch.float64)
    one = seg.step(u, 1, 2, seed=11)
    torch.rand(100)  # moving the global stream must not matter
    assert torch.equal(one, seg.step(u, 1, 2, seed=11))
    assert not torch.equal(one, seg.step(u, 1, 2, seed=12))
    assert not torch.equal(one, seg.step(u, 1, 2, seed=11, segment_index=1))
    # a coarse step from layer 1 uses layer 1's mask
    coarse = seg.step(u, 1, 3, seed=11)
    assert torch.equal(one != u, coarse != u)  # u + dt * dropout(...): zeros where masked
    # different layers draw different masks
    ones = torch.ones(8, 6, dtype=torch.float64)
    with torch.no_grad():
        for b in seg.blocks:
            b[0].linear.weight.zero_()
            b[0].linear.bias.fill_(1.0)
    f1 = seg.step(ones, 1, 2, seed=11) - ones
    f2 = seg.step(ones, 2, 3, seed=11) - ones
    assert not torch.equal(f1 != 0, f2 != 0)


def test_odenet_dropout_reproducible_and_matches_manual_stepping():
    torch.manual_seed(0)
    seg = dropout_segment(n=5)
    net = ODENet(layers=[nn.Linear(2, 6).double(), seg]).train()
    x = torch.randn(8, 2, dtype=torch.float64)
    torch.manual_seed(42)
    a = net(x)
    torch.manual_seed(42)
    b = net(x)
    torch.manual_seed(43)
    c = net(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(42)
    seed = draw_seed()
    u = net.layers[0](x)
    for n in range(5):
        u = seg.step(u, n, n + 1, seed=seed, segment_index=0)
    assert torch.equal(u, a)
    # eval mode: no dropout and no draw from the global generator
    net.eval()
    state = torch.get_rng_state()
    net(x)
    assert torch.equal(torch.get_rng_state(), state)


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, exc, arg",
    [
        (lambda: Dense(3, activation="swish"), ValueError, "`activation`"),
        (lambda: Dense(0), ValueError, "`width`"),
        (lambda: Dense(2.5), TypeError, "`width`"),
        (lambda: Conv(4, kernel_size=0), ValueError, "`kernel_size`"),
        (lambda: Conv(4, batch_norm=1), TypeError, "`batch_norm`"),
        (lambda: get_scheme("rk45"), ValueError, "`scheme`"),
        (lambda: Segment(lambda n: Dense(2), 0), ValueError, "`n_steps`"),
        (lambda: Segment(lambda n: Dense(2), 3, 0.0), ValueError, "`t_final`"),
        (lambda: Segment(lambda n: Dense(2), 3, float("inf")), ValueError, "`t_final`"),
        (lambda: Segment(Dense(2), 3), TypeError, "`block`"),
        (lambda: Segment(lambda n: 3, 3), TypeError, "`block`"),
        (lambda: ODENet(steps=3, n_steps=2), TypeError, "`steps`"),
        (lambda: ODENet(nn.Linear(2, 2), layers=[dropout_segment()]), ValueError, "`open`"),
        (lambda: ODENet(layers=[nn.Linear(2, 2)]), ValueError, "`layers`"),
        (lambda: ODENet(), ValueError, "`steps`"),
    ],
)
def test_bad_arguments_name_the_argument(make, exc, arg):
    with pytest.raises(exc, match=arg):
        make()


def test_unknown_coarsening():
    seg = dense_segment()
    with pytest.raises(ValueError, match="`coarsening`.*injection"):
        seg.step(torch.zeros(1, 3, dtype=torch.float64), 0, 2, coarsening="max")


def test_shape_changing_block_is_reported():
    seg = Segment(lambda n: nn.Linear(3, 3) if n == 0 else nn.Linear(3, 4), 2)
    with pytest.raises(ValueError, match="layer 1"):
        seg(torch.zeros(2, 3))


def test_ode_never_imports_mpi_or_engine():
    import subprocess
    import sys

    code = (
        "import sys, layerpar.ode, layerpar.ode.coarsening;"
        "bad = [m for m in sys.modules if m.startswith(('mpi4py', 'layerpar.mgrit',"
        " 'layerpar._native'))]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
