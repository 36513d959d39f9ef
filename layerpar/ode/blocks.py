"""Standard residual-branch blocks.

Each block computes only the residual *branch* F(u) of a step, never u + F(u):
the scheme (see ``schemes``) adds the state and the step size.  Blocks preserve
the shape of their input, as a residual ODE requires.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import boolean, positive_int

__all__ = ["ACTIVATIONS", "get_activation", "Dense", "Conv", "Conv1d", "PreNorm",
           "Transformer"]


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


class Dense(nn.Module):
    """F(u) = act(W u + b) on vectors of length ``width``.

    The Peaks network's step u ← u + h·tanh(K u + b) is ``Dense(width)`` under
    forward Euler.
    """

    def __init__(self, width: int, activation: str = "tanh", bias: bool = True) -> None:
        super().__init__()
        width = positive_int("width", width)
        self._act = get_activation(activation)
        self.activation = activation
        self.linear = nn.Linear(width, width, bias=boolean("bias", bias))

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
        channels = positive_int("channels", channels)
        kernel_size = positive_int("kernel_size", kernel_size)
        batch_norm = boolean("batch_norm", batch_norm)
        bias = not batch_norm if bias is None else boolean("bias", bias)
        self._act = get_activation(activation)
        self.activation = activation
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding="same", bias=bias)
        self.bn = nn.BatchNorm2d(channels) if batch_norm else None

    def forward(self, u: Tensor) -> Tensor:
        v = self.conv(u)
        if self.bn is not None:
            v = self.bn(v)
        return self._act(v)

    def forward_batched(self, params: dict[str, Tensor], buffers: dict[str, Tensor],
                        u: Tensor) -> Tensor:
        """F for n layers at once: ``params`` stacked along a leading layer dimension,
        ``u`` of shape [n, batch, C, H, W].  Without batch norm and with an odd kernel,
        one vmapped (grouped) convolution whose backward is one vmapped
        ``convolution_backward`` (`_StackedConv`: autograd through vmap would record
        four more reshaping operations per backward call); otherwise vmap over the
        block, as for any block."""
        k = self.conv.kernel_size
        if self.bn is None and k[0] % 2 == 1 and k[1] % 2 == 1 \
                and self.conv.padding_mode == "zeros":
            return self._act(_StackedConv.apply(u, params["conv.weight"],
                                                params.get("conv.bias"),
                                                [k[0] // 2, k[1] // 2]))

        def one(p: dict[str, Tensor], b: dict[str, Tensor], v: Tensor) -> Tensor:
            return torch.func.functional_call(self, (p, b), (v,))

        return torch.func.vmap(one)(params, buffers, u)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class _StackedConv(torch.autograd.Function):
    """conv2d (stride 1, symmetric zero padding) of x[l] with weights w[l] for all l at
    once, forward and backward each one vmapped call (bit-identical to autograd through
    vmap)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Optional[Tensor],  # type: ignore[override]
                padding: list[int]) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.padding, ctx.has_bias = padding, b is not None
        if b is None:
            return torch.func.vmap(lambda x1, w1: F.conv2d(x1, w1, padding=padding))(x, w)
        return torch.func.vmap(lambda x1, w1, b1: F.conv2d(x1, w1, b1, padding=padding))(
            x, w, b)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                ctx.has_bias and ctx.needs_input_grad[2]]
        if not any(mask):
            return None, None, None, None
        pad = ctx.padding

        def one(g1: Tensor, x1: Tensor, w1: Tensor) -> tuple[Tensor, ...]:
            outs = torch.ops.aten.convolution_backward(
                g1, x1, w1, [w1.shape[0]] if ctx.has_bias else None, [1, 1], pad, [1, 1],
                False, [0, 0], 1, mask)
            return tuple(o for o, m in zip(outs, mask) if m)

        got = iter(torch.func.vmap(one)(g, x, w))
        gx, gw, gb = (next(got) if m else None for m in mask)
        return gx, gw, gb, None


class Transformer(nn.Module):
    """A pre-norm transformer block as a residual branch, on states [batch, seq, d_model]:

        a = Attn(LN1(u)),   F(u) = a + MLP(LN2(u + a)),

    so that u + F(u) is the usual pre-norm block u1 = u + Attn(LN1(u)),
    u1 + MLP(LN2(u1)), and u + h·F(u) its ODE step.  Attn is multi-head self-attention
    (``F.scaled_dot_product_attention``, ``heads`` heads, no mask; ``causal=True`` for
    a causal mask); MLP is Linear(d, mlp_ratio·d), ``activation``, Linear back.
    Layer-parallel cycles evaluate n layers at once with `forward_batched` (one call of
    each operation for all n, attention included); ``torch.func.vmap`` over the block
    gives the same result, but runs attention layer by layer on the CPU (no batching
    rule for its fused kernel there).
    """

    def __init__(self, d_model: int, heads: int = 4, mlp_ratio: int = 4,
                 activation: str = "gelu", causal: bool = False) -> None:
        super().__init__()
        d_model = positive_int("d_model", d_model)
        heads = positive_int("heads", heads)
        mlp_ratio = positive_int("mlp_ratio", mlp_ratio)
        if d_model % heads:
            raise ValueError(f"`d_model` ({d_model}) must be a multiple of `heads` ({heads})")
        self._act = get_activation(activation)
        self.activation = activation
        self.heads = heads
        self.causal = boolean("causal", causal)
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)

    def attention(self, u: Tensor) -> Tensor:
        """Attn(LN1(u)) for u of shape [..., seq, d_model]."""
        *lead, s, d = u.shape
        q, k, v = self.qkv(self.norm1(u)).split(d, dim=-1)
        shape = (*lead, s, self.heads, d // self.heads)
        q, k, v = (t.reshape(shape).transpose(-3, -2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(o.transpose(-3, -2).reshape(*lead, s, d))

    def forward(self, u: Tensor) -> Tensor:
        a = self.attention(u)
        return a + self.fc2(self._act(self.fc1(self.norm2(u + a))))

    def forward_batched(self, params: dict[str, Tensor], buffers: dict[str, Tensor],
                        u: Tensor) -> Tensor:
        """F for n layers at once: ``params`` stacked along a leading layer dimension,
        ``u`` of shape [n, batch, seq, d_model]."""
        n, d = u.shape[0], u.shape[-1]

        def norm(v: Tensor, name: str) -> Tensor:
            w, b = params[f"{name}.weight"], params[f"{name}.bias"]
            eps = getattr(self, name).eps
            return torch.addcmul(b.view(n, *[1] * (v.dim() - 2), d),
                                 F.layer_norm(v, (d,), eps=eps),
                                 w.view(n, *[1] * (v.dim() - 2), d))

        def linear(v: Tensor, name: str) -> Tensor:
            w, b = params[f"{name}.weight"], params[f"{name}.bias"]
            flat = v.reshape(n, -1, v.shape[-1])
            return torch.baddbmm(b.unsqueeze(1), flat, w.transpose(1, 2)).view(
                *v.shape[:-1], w.shape[1])

        qkv = linear(norm(u, "norm1"), "qkv")
        q, k, v = qkv.split(d, dim=-1)
        shape = (*u.shape[:-1], self.heads, d // self.heads)
        q, k, v = (t.reshape(shape).transpose(-3, -2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        a = linear(o.transpose(-3, -2).reshape(u.shape), "proj")
        return a + linear(self._act(linear(norm(u + a, "norm2"), "fc1")), "fc2")

    def extra_repr(self) -> str:
        return f"heads={self.heads}, activation={self.activation!r}, causal={self.causal}"
class Conv1d(nn.Module):
    """F(u) = act(BN(conv1d(u))) on signals [batch, channels, length]: a shape-preserving
    1-D convolution (stride 1, "same" padding), e.g. for MNIST-1D.

    ``batch_norm`` adds a ``BatchNorm1d`` after the convolution (as `Conv` does);
    ``bias`` defaults to ``not batch_norm`` (a bias before batch norm is redundant).
    """

    def __init__(self, channels: int, kernel_size: int = 3, activation: str = "relu",
                 bias: bool | None = None, batch_norm: bool = False) -> None:
        super().__init__()
        channels = positive_int("channels", channels)
        kernel_size = positive_int("kernel_size", kernel_size)
        batch_norm = boolean("batch_norm", batch_norm)
        bias = not batch_norm if bias is None else boolean("bias", bias)
        self._act = get_activation(activation)
        self.activation = activation
        self.conv = nn.Conv1d(channels, channels, kernel_size, padding="same", bias=bias)
        self.bn = nn.BatchNorm1d(channels) if batch_norm else None

    def forward(self, u: Tensor) -> Tensor:
        v = self.conv(u)
        if self.bn is not None:
            v = self.bn(v)
        return self._act(v)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class PreNorm(nn.Module):
    """F(u) = W2 act(W1 LayerNorm(u) + b1) + b2 on vectors of length ``width``: the
    pre-norm residual branch (the normalisation inside the branch, the state itself
    never normalised), with a hidden layer of ``hidden`` features (default ``width``).

    Layer norm keeps each layer's input at unit scale however the state grows, so a
    deep stack of these trains where plain ``Dense`` steps of the same depth stall.
    """

    def __init__(self, width: int, hidden: Optional[int] = None,
                 activation: str = "gelu") -> None:
        super().__init__()
        width = positive_int("width", width)
        hidden = width if hidden is None else positive_int("hidden", hidden)
        self._act = get_activation(activation)
        self.activation = activation
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, u: Tensor) -> Tensor:
        return self.fc2(self._act(self.fc1(self.norm(u))))

    def forward_batched(self, params: dict[str, Tensor], buffers: dict[str, Tensor],
                        u: Tensor) -> Tensor:
        """F for n layers at once: ``params`` stacked along a leading layer dimension,
        ``u`` of shape [n, batch, width]; the norm's affine map and each linear map one
        batched operation (layer-parallel cycles)."""
        d = u.shape[-1]
        v = torch.addcmul(params["norm.bias"].unsqueeze(1),
                          F.layer_norm(u, (d,), eps=self.norm.eps),
                          params["norm.weight"].unsqueeze(1))
        v = torch.baddbmm(params["fc1.bias"].unsqueeze(1), v,
                          params["fc1.weight"].transpose(1, 2))
        return torch.baddbmm(params["fc2.bias"].unsqueeze(1), self._act(v),
                             params["fc2.weight"].transpose(1, 2))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
