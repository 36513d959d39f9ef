"""`Conv.forward_batched`: n layers in one vmapped convolution whose backward is one
vmapped convolution_backward; outputs and all gradients equal the blocks' own forward
(float64), with and without bias, for odd and even kernels and with batch norm."""
from __future__ import annotations

import pytest
import torch
from tolerances import F64

from layerpar.ode import blocks
from layerpar.ode.schemes import ForwardEuler
from layerpar.parallel.batched import BatchedBlocks


@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")
@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"kernel_size": 5},
                                 {"kernel_size": 2}, {"activation": "tanh"}])
def test_forward_batched_equals_per_layer(kw: dict) -> None:
    torch.manual_seed(0)
    bl = {k: blocks.Conv(3, **kw).double() for k in range(3)}
    bb = BatchedBlocks(bl, ForwardEuler(), [0.0, 0.2, 0.5, 0.6])
    x = torch.randn(3, 2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    p, b = bb.stacked((0, 1, 2))
    p = {n: t.clone().requires_grad_() for n, t in p.items()}
    y = bb.fn(p, b, x)
    xs = x.detach().clone().requires_grad_()
    want = torch.stack([bl[k](xs[k]) for k in range(3)])
    assert torch.allclose(y, want, rtol=F64.exact, atol=F64.exact)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *p.values()], g)
    ref = torch.autograd.grad(want, [xs, *[q for k in range(3) for q in bl[k].parameters()]],
                              g)
    assert torch.allclose(got[0], ref[0], rtol=F64.roundoff, atol=F64.roundoff)
    per_layer = ref[1:]
    names = list(p)
    for i, name in enumerate(names):
        stacked = torch.stack([per_layer[k * len(names) + i] for k in range(3)])
        assert torch.allclose(got[1 + i], stacked, rtol=F64.roundoff, atol=F64.roundoff), name
    # only the state's gradient (the adjoint's relaxation): the others are not computed
    (gx,) = torch.autograd.grad(bb.fn({n: t.detach() for n, t in p.items()}, b, x), [x], g)
    assert torch.allclose(gx, ref[0], rtol=F64.roundoff, atol=F64.roundoff)


def test_batch_norm_without_running_stats_is_vmapped() -> None:
    torch.manual_seed(1)
    bl = {k: blocks.Conv(3, batch_norm=True) for k in range(2)}
    for b in bl.values():
        b.bn.track_running_stats = False
        b.bn.running_mean = b.bn.running_var = None
    bb = BatchedBlocks(bl, ForwardEuler(), [0.0, 0.5, 1.0])
    assert bb.probe(torch.zeros(4, 3, 5, 5)) is None
