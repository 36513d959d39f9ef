"""The fused Triton steps compiled for a CUDA device (skipped without one or without
triton): forward and all gradients against the torch path in float32, and the per-shape
choice made by measurement (`make bench-gpu` runs these)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerpar.ode import blocks
from layerpar.ode.schemes import ForwardEuler
from layerpar.parallel import kernels, timing

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available()
                                     and kernels.triton_available()),
                                reason="no CUDA device or no triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_fused_equals_torch_on_cuda(kind: str) -> None:
    from layerpar.parallel.kernels import triton_steps as ts

    torch.manual_seed(0)
    dev = "cuda"
    if kind == "dense":
        shapes = [(7, 33, 65), (7, 65, 65), (7, 65)]
        fn = ts.DenseStep.apply

        def ref(x, w, b, dt):
            return x + dt.view(-1, 1, 1) * torch.tanh(
                torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2)))
    else:
        shapes = [(5, 3, 17, 9, 13), (5, 17, 17, 3, 3), (5, 17)]
        fn = ts.ConvStep.apply

        def ref(x, w, b, dt):
            return torch.stack([x[k] + dt[k] * torch.tanh(F.conv2d(x[k], w[k], b[k],
                                                                   padding="same"))
                                for k in range(x.shape[0])])
    dt = torch.rand(shapes[0][0], device=dev)
    ins = [torch.randn(s, device=dev) * 0.3 for s in shapes]
    a = [t.clone().requires_grad_() for t in ins]
    b = [t.clone().requires_grad_() for t in ins]
    ya, yb = fn(*a, dt, "tanh"), ref(*b, dt)
    assert rel(ya, yb) <= 1e-5
    g = torch.randn_like(yb)
    for ga, gb in zip(torch.autograd.grad(ya, a, g), torch.autograd.grad(yb, b, g)):
        assert rel(ga, gb) <= 1e-5


def test_choice_is_measured_once_per_shape() -> None:
    fs = kernels.fused_step_for(blocks.Conv(16), ForwardEuler())
    assert fs is not None
    x = torch.randn(8, 4, 16, 16, 16, device="cuda")
    p = {"conv.weight": torch.randn(8, 16, 16, 3, 3, device="cuda") * 0.1,
         "conv.bias": torch.zeros(8, 16, device="cuda")}
    dt = torch.full((8, 1, 1, 1, 1), 0.1, device="cuda")

    def torch_path():
        z = torch.stack([F.conv2d(x[k], p["conv.weight"][k], p["conv.bias"][k], padding=1)
                         for k in range(8)])
        return x + dt * torch.relu(z)

    before, timed = len(fs.choice), timing.first_uses()
    y = fs(x, p, dt, torch_path)
    assert len(fs.choice) == before + 1 and rel(y, torch_path()) <= 1e-5
    assert timing.first_uses() == timed + 2  # fused and torch, once each
    again = kernels.fused_step_for(blocks.Conv(16), ForwardEuler())  # another segment
    assert again is not None and rel(again(x, p, dt, torch_path), y) <= 1e-5
    assert timing.first_uses() == timed + 2 and len(again.choice) == before + 1
