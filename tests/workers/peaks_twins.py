"""A float64 Peaks ODE-net (16 layers x 8) and a serial copy with the same weights,
with a fixed batch: what the auto-tuning workers train through `LayerParallel` and
through plain autograd side by side (`lp_autotune`, `lp_replicated`, `lp_online`)."""

from __future__ import annotations

import torch

from layerpar.apps.nets import problem_net
from layerpar.ode import ODENet


def peaks_twins(rows: int = 32) -> tuple[ODENet, ODENet, torch.Tensor, torch.Tensor]:
    """(net, serial copy, x, y): the net from torch seed 0, the batch from seed 1."""
    torch.manual_seed(0)
    net = problem_net("peaks", 16, 8).double()
    serial = problem_net("peaks", 16, 8).double()
    serial.load_state_dict(net.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 2, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (rows,), generator=g)
    return net, serial, x, y
