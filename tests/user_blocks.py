"""Residual blocks a user writes that no type tells apart from row-wise ones (shared by
the probe's unit tests and the `choose_method` worker): each breaks what splitting a
batch assumes in its own way."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

import layerpar

WIDTH = 4


class Centred(nn.Module):
    """tanh(W u + b), centred over the batch's rows: a user's batch normalisation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.lin(u))
        return z - z.mean(0, keepdim=True)


class Tracker(nn.Module):
    """Row by row, but a running mean of its output kept in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("seen", torch.zeros(WIDTH))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.lin(u))
        if self.training:
            with torch.no_grad():
                self.seen.mul_(0.9).add_(0.1 * z.mean(0))
        return z


class Drawing(nn.Module):
    """Draws its dropout mask itself (`F.dropout`, no dropout module)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(torch.tanh(self.lin(u)), 0.3, self.training)


def user_net(block: Callable[[], nn.Module], dtype: torch.dtype = torch.float64
             ) -> layerpar.ODENet:
    """Linear(3, 4), 8 residual layers of `block`, Linear(4, 5), seeded alike."""
    torch.manual_seed(0)
    return layerpar.ODENet(open=nn.Linear(3, WIDTH), steps=lambda k: block(), n_steps=8,
                           close=nn.Linear(WIDTH, 5)).to(dtype)
