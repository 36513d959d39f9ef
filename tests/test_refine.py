"""Tests of layerpar.ode.refine: nested iteration's refinement (prolongation) in depth."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import F64
from torch import nn

import layerpar.ode
from layerpar.ode import ODENet, Segment, refine
from layerpar.ode.blocks import Conv, Dense
from layerpar.ode.schemes import RK4, SCHEMES

WIDTH = 4


def two_segment_net(dtype=torch.float64):
    """open → Dense segment (Euler, 3 steps on [0, 1]) → plain → Dense segment (Heun,
    2 steps on [0.5, 2]) → close."""
    torch.manual_seed(0)
    return ODENet(
        layers=[
            nn.Linear(2, WIDTH),
            Segment(lambda n: Dense(WIDTH), 3, 1.0),
            nn.Tanh(),
            Segment(lambda n: Dense(WIDTH, "relu"), 2, 2.0, t_start=0.5, scheme="heun"),
            nn.Linear(WIDTH, 3),
        ]
    ).to(dtype)


def conv_net(batch_norm: bool):
    torch.manual_seed(1)
    net = ODENet(
        nn.Conv2d(1, 2, 3, padding=1),
        lambda n: Conv(2, batch_norm=batch_norm),
        3,
        1.5,
        nn.Flatten(),
    ).to(torch.float64)
    if batch_norm:  # running statistics that differ from layer to layer
        for blk in net.layers[1].blocks:
            blk.bn.running_mean.uniform_(-1.0, 1.0)
            blk.bn.running_var.uniform_(0.5, 2.0)
            blk.bn.num_batches_tracked.fill_(torch.randint(1, 100, ()).item())
    return net


def snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(block.named_parameters())
    out.update(block.named_buffers())
    return out


# --- structure, independence, plain layers ------------------------------------------------


@pytest.mark.parametrize("interpolation", ["constant", "linear"])
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_structure_and_input_untouched(factor, interpolation):
    net = two_segment_net()
    for p in (net.layers[0].weight, net.layers[1].blocks[0].linear.weight):
        p.grad = torch.ones_like(p)
    before = snapshot(net)
    ids = {k: id(v) for k, v in net.state_dict(keep_vars=True).items()}
    fine = refine(net, factor, interpolation)

    assert type(fine) is ODENet and fine is not net
    assert len(fine.layers) == len(net.layers)
    for (kc, c), (kf, f) in zip(net.segments, fine.segments):
        assert kc == kf
        assert f.n_steps == factor * c.n_steps
        assert (f.t_start, f.t_final) == (c.t_start, c.t_final)
        assert type(f.scheme) is type(c.scheme) and f.scheme.name == c.scheme.name
        # the fine grid contains every coarse time, bit for bit
        for k in range(c.n_steps + 1):
            assert f.time(factor * k) == c.time(k)
    for k in (0, 2, 4):  # plain layers: equal values, distinct objects
        assert type(fine.layers[k]) is type(net.layers[k])
        assert fine.layers[k] is not net.layers[k]
        for (n1, a), (n2, b) in zip(
            net.layers[k].state_dict().items(), fine.layers[k].state_dict().items()
        ):
            assert n1 == n2 and torch.equal(a, b)

    # the input is unchanged, and nothing is shared with it
    after = net.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for k in before:
        assert id(after[k]) == ids[k] and torch.equal(after[k], before[k])
    coarse_ptrs = {t.data_ptr() for t in net.state_dict().values()}
    assert not coarse_ptrs & {t.data_ptr() for t in fine.state_dict().values()}
    with torch.no_grad():
        for p in fine.parameters():
            p.add_(1.0)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])
    # no stale gradients, dtype and requires_grad kept
    assert all(p.grad is None for p in fine.parameters())
    assert all(p.dtype == torch.float64 and p.requires_grad for p in fine.parameters())


def test_factor_one_is_an_equal_copy():
    net = two_segment_net()
    fine = refine(net, 1)
    a, b = net.state_dict(), fine.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(5, 2, dtype=torch.float64)
    assert torch.equal(net(x), fine(x))


def test_modes_and_requires_grad_are_kept():
    net = two_segment_net().eval()
    net.layers[1].blocks[1].linear.bias.requires_grad_(False)
    fine = refine(net, 2)
    assert not fine.training and not any(m.training for m in fine.modules())
    frozen = [j for j, b in enumerate(fine.layers[1].blocks) if not b.linear.bias.requires_grad]
    assert frozen == [2, 3]


def test_float32_and_default_interpolation():
    net = two_segment_net(torch.float32)
    fine = refine(net)  # factor 2, constant
    assert all(t.dtype == torch.float32 for t in fine.state_dict().values())
    assert fine.n_steps_total == 2 * net.n_steps_total
    x = torch.randn(3, 2)
    assert fine(x).dtype == torch.float32


# --- the interpolation rules ---------------------------------------------------------------


@pytest.mark.parametrize("factor", [2, 3, 4])
def test_constant_takes_the_containing_coarse_layer(factor):
    net = two_segment_net()
    fine = refine(net, factor, "constant")
    for (_, c), (_, f) in zip(net.segments, fine.segments):
        for j, blk in enumerate(f.blocks):
            k = j // factor
            # t_j lies in [t_k, t_{k+1})
            assert c.time(k) <= f.time(j) < c.time(k + 1)
            ref = tensors(c.blocks[k])
            got = tensors(blk)
            assert got.keys() == ref.keys()
            assert all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.mark.parametrize("factor", [2, 4])
def test_linear_hits_coarse_values_and_averages(factor):
    net = two_segment_net()
    fine = refine(net, factor, "linear")
    for (_, c), (_, f) in zip(net.segments, fine.segments):
        n = c.n_steps
        for k in range(n):  # at coarse times: exactly the coarse layer
            got, ref = tensors(f.blocks[factor * k]), tensors(c.blocks[k])
            assert all(torch.equal(got[p], ref[p]) for p in ref)
        for k in range(n - 1):  # midpoints: exactly the average of the neighbours
            got = tensors(f.blocks[factor * k + factor // 2])
            left, right = tensors(c.blocks[k]), tensors(c.blocks[k + 1])
            for p in left:
                assert torch.equal(got[p], (left[p] + right[p]) / 2)
                assert not torch.equal(got[p], left[p])
        for k in range(n - 1):  # every fine layer in between: linear in time
            left, right = tensors(c.blocks[k]), tensors(c.blocks[k + 1])
            for r in range(factor):
                w = (f.time(factor * k + r) - c.time(k)) / (c.time(k + 1) - c.time(k))
                got = tensors(f.blocks[factor * k + r])
                for p in left:
                    torch.testing.assert_close(
                        got[p], (1 - w) * left[p] + w * right[p], rtol=0, atol=F64.step
                    )
        for r in range(factor):  # beyond the last coarse layer: held, not extrapolated
            got, ref = tensors(f.blocks[factor * (n - 1) + r]), tensors(c.blocks[n - 1])
            assert all(torch.equal(got[p], ref[p]) for p in ref)


@pytest.mark.parametrize("batch_norm", [False, True])
@pytest.mark.parametrize("interpolation", ["constant", "linear"])
def test_conv_blocks(interpolation, batch_norm):
    net = conv_net(batch_norm).eval()  # eval: batch norm uses the interpolated statistics
    before = snapshot(net)
    fine = refine(net, 2, interpolation)
    c, f = net.layers[1], fine.layers[1]
    assert f.n_steps == 6 and all(type(b) is Conv for b in f.blocks)
    names = set(tensors(c.blocks[0]))
    if batch_norm:
        assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= names
    for j, blk in enumerate(f.blocks):
        k, r = divmod(j, 2)
        got, left = tensors(blk), tensors(c.blocks[k])
        assert got.keys() == left.keys()
        for p in left:
            if interpolation == "linear" and r and k + 1 < 3 and left[p].is_floating_point():
                expected = (left[p] + tensors(c.blocks[k + 1])[p]) / 2
            else:  # constant, coarse times, the held last interval, integer buffers
                expected = left[p]
            assert torch.equal(got[p], expected), (j, p)
    if batch_norm:
        assert all((b.bn.running_var > 0).all() for b in f.blocks)
    x = torch.randn(2, 1, 5, 5, dtype=torch.float64)
    y, yf = net(x), fine(x)
    assert yf.shape == y.shape and torch.isfinite(yf).all()
    assert not torch.equal(y, yf)  # a finer discretisation, not the same net
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_linear_rejects_unlike_neighbours():
    blocks = [Dense(WIDTH), Dense(WIDTH, bias=False), Dense(WIDTH)]
    net = ODENet(layers=[Segment(blocks.__getitem__, 3, 1.0)])
    with pytest.raises(ValueError, match='`interpolation="linear"`.*block 1 differs'):
        refine(net, 2, "linear")
    assert refine(net, 2, "constant").layers[0].blocks[3].linear.bias is None


# --- consistency: a finer discretisation of the same ODE ------------------------------------


def smooth_net(n: int, scheme: str = "euler", t_final: float = 1.0) -> ODENet:
    """n Dense layers (width 4, float64) whose parameters sample a smooth θ(t) at t_k."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(WIDTH, WIDTH, generator=g, dtype=torch.float64) for _ in range(3))
    bias0, bias1 = (torch.randn(WIDTH, generator=g, dtype=torch.float64) for _ in range(2))

    def block(k: int) -> Dense:
        t = k * t_final / n
        m = Dense(WIDTH).to(torch.float64)
        with torch.no_grad():
            m.linear.weight.copy_(0.5 * (a + math.cos(3 * t) * b + math.sin(2 * t) * c))
            m.linear.bias.copy_(math.sin(t) * bias0 + bias1)
        return m

    return ODENet(layers=[Segment(block, n, t_final, scheme=scheme)])


def x_smooth() -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


@pytest.mark.parametrize("interpolation", ["constant", "linear"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_refinement_converges_with_the_expected_order(scheme, interpolation):
    """e(h) = |refine(net, m)(x) - refine(net, 128)(x)| for m = 1, 2, 4, 8.

    "constant": each coarse interval is an autonomous ODE and the fine grid hits
    every coarse time, so the scheme's own order p shows (euler 1, heun 2, rk4 4).
    "linear": θ varies inside a coarse interval but a step freezes it at its start
    time, so the order is 1 whatever the scheme.  Each halving of h should divide
    e by about 2^p (the reference's own error pushes the ratio slightly up).
    """
    order = SCHEMES[scheme].order if interpolation == "constant" else 1
    net = smooth_net(4, scheme)
    x = x_smooth()
    with torch.no_grad():
        ref = refine(net, 128, interpolation)(x)
        errors = [(refine(net, m, interpolation)(x) - ref).norm().item() for m in (1, 2, 4, 8)]
    ratios = [e0 / e1 for e0, e1 in zip(errors, errors[1:])]
    assert all(0.8 * 2**order <= r <= 1.25 * 2**order for r in ratios), (errors, ratios)


@pytest.mark.parametrize("interpolation", ["constant", "linear"])
def test_coarse_and_refined_outputs_differ_by_O_h(interpolation):
    """The refined net is a small correction of the coarse one: for coarse nets with
    N = 4, 8, 16, 32 layers sampling one smooth θ(t) (forward Euler, order 1),
    d(H) = |refine(net, 2)(x) - net(x)| halves as the coarse step H halves."""
    x = x_smooth()
    diffs = []
    for n in (4, 8, 16, 32):
        net = smooth_net(n)
        with torch.no_grad():
            diffs.append((refine(net, 2, interpolation)(x) - net(x)).norm().item())
    ratios = [d0 / d1 for d0, d1 in zip(diffs, diffs[1:])]
    assert all(1.6 <= r <= 2.7 for r in ratios), (diffs, ratios)
    assert diffs[-1] < 0.1 * x.norm().item()


def test_custom_scheme_instance_is_kept():
    net = ODENet(layers=[Segment(lambda n: Dense(WIDTH), 2, 1.0, scheme=RK4())])
    fine = refine(net, 2)
    assert isinstance(fine.layers[0].scheme, RK4) and fine.layers[0].scheme.order == 4


# --- argument validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"factor": 0}, ValueError, "`factor` must be a positive int, got 0"),
        ({"factor": -2}, ValueError, "`factor`"),
        ({"factor": 2.0}, TypeError, "`factor` must be a positive int, got float"),
        ({"factor": True}, TypeError, "`factor`"),
        ({"factor": "2"}, TypeError, "`factor`"),
        ({"interpolation": "cubic"}, ValueError, r"`interpolation` must be one of \['constant'"),
        ({"interpolation": None}, ValueError, "`interpolation`"),
        ({"interpolation": "Linear"}, ValueError, "`interpolation`"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    net = two_segment_net()
    with pytest.raises(exc, match=match):
        refine(net, **kwargs)


@pytest.mark.parametrize("bad", [None, nn.Linear(2, 2), Segment(lambda n: Dense(2), 2)])
def test_net_must_be_an_odenet(bad):
    with pytest.raises(TypeError, match="`net` must be an ODENet or a LayerParallel, got"):
        refine(bad)


def test_exported():
    assert layerpar.ode.refine is refine and "refine" in layerpar.ode.__all__


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_layer_parallel_refines_on_its_ranks(nprocs: int) -> None:
    """`refine(LayerParallel)` on 1-3 ranks (each receiving only the coarse layers its
    fine block needs) equals the serial refinement of the gathered net."""
    from pathlib import Path

    from mpi_util import describe, rank_lines, run_mpi

    proc = run_mpi(Path(__file__).parent / "workers" / "lp_refine.py", nprocs, timeout=120)
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(nprocs)), describe(proc)
    assert all(ls[-1].startswith("OK") for ls in lines.values()), describe(proc)
