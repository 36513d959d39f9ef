"""Standard residual-branch blocks.

Each block computes only the residual *branch* F(u) of a step, never u + F(u):
the scheme (see ``schemes``) adds the state and the step size.  Blocks preserve
the shape of their input, as a residual ODE requires.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "get_activation", "Dense", "Conv", "Conv1d"]


def _identity(x: Tensor) -> Tensor:
    return x


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "gelu": F.gelu,
    "identity": _identity,
    "leaky_relu": F.leaky_relu,
    "softplus": F.softplus,
}


def get_activation(activation: str) -> Callable[[Tensor], Tensor]:
    """Return the activation function registered under ``activation`` in ``ACTIVATIONS``."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(
            f"`activation` must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )
    return ACTIVATIONS[activation]


def _positive_int(value: object, name: str) -> int:
    """Return ``value`` as an int, or raise TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value}")
    return int(value)


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")
    return value


class Dense(nn.Module):
    """F(u) = act(W u + b) on vectors of length ``width``.

    The Peaks network's step u ← u + h·tanh(K u + b) is ``Dense(width)`` under
    forward Euler.
    """

    def __init__(self, width: int, activation: str = "tanh", bias: bool = True) -> None:
        super().__init__()
        width = _positive_int(width, "width")
        self._act = get_activation(activation)
        self.activation = activation
        self.linear = nn.Linear(width, width, bias=_bool(bias, "bias"))

    def forward(self, u: Tensor) -> Tensor:
        return self._act(self.linear(u))

    def forward_batched(self, params: dict[str, Tensor], buffers: dict[str, Tensor],
                        u: Tensor) -> Tensor:
        """F for n layers at once: ``params`` stacked along a leading layer dimension,
        ``u`` of shape [n, batch, width]; one batched GEMM (layer-parallel cycles)."""
        w = params["linear.weight"].transpose(1, 2)
        b = params.get("linear.bias")
        z = torch.bmm(u, w) if b is None else torch.baddbmm(b.unsqueeze(1), u, w)
        return self._act(z)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class Conv(nn.Module):
    """F(u) = act(BN(conv(u))): a shape-preserving 2-D convolution (stride 1, "same" padding).

    ``bias`` defaults to ``not batch_norm`` (a bias before batch norm is redundant).
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int = 3,
        activation: str = "relu",
        batch_norm: bool = False,
        bias: bool | None = None,
    ) -> None:
        super().__init__()
        channels = _positive_int(channels, "channels")
        kernel_size = _positive_int(kernel_size, "kernel_size")
        batch_norm = _bool(batch_norm, "batch_norm")
        bias = not batch_norm if bias is None else _bool(bias, "bias")
        self._act = get_activation(activation)
        self.activation = activation
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding="same", bias=bias)
        self.bn = nn.BatchNorm2d(channels) if batch_norm else None

    def forward(self, u: Tensor) -> Tensor:
        v = self.conv(u)
        if self.bn is not None:
            v = self.bn(v)
        return self._act(v)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class Conv1d(nn.Module):
    """F(u) = act(conv1d(u)) on signals [batch, channels, length]: a shape-preserving
    1-D convolution (stride 1, "same" padding), e.g. for MNIST-1D."""

    def __init__(self, channels: int, kernel_size: int = 3, activation: str = "relu",
                 bias: bool = True) -> None:
        super().__init__()
        channels = _positive_int(channels, "channels")
        kernel_size = _positive_int(kernel_size, "kernel_size")
        self._act = get_activation(activation)
        self.activation = activation
        self.conv = nn.Conv1d(channels, channels, kernel_size, padding="same",
                              bias=_bool(bias, "bias"))

    def forward(self, u: Tensor) -> Tensor:
        return self._act(self.conv(u))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
