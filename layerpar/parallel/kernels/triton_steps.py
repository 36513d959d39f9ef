"""Triton kernels of the fused batched step u + h·act(K(u) + b), K a dense map or a
same-padded convolution with one weight set per interval, and their gradients.

Everything here imports `triton`: import this module only through
`layerpar.parallel.kernels`, which does so lazily and only when triton is installed.
Set ``TRITON_INTERPRET=1`` before this module is first imported to run the kernels on
the CPU with Triton's interpreter (the tests do so).

Kernels (all float32, accumulation in float32, ``input_precision="ieee"``: no TF32, so
they agree with torch's float32 path to round-off):

- `_bmm_kernel`: a batched matmul C[l] = A[l] @ B[l] (strided, so transposes cost
  nothing) with a fused epilogue: MODE 0 stores C; MODE 1 is the step
  ``y = x + dt[l]·act(C + b[l])`` (and the pre-activation z when gradients are wanted);
  MODE 2 adds a residual, ``out = r + C`` (the state VJP ``g + gz·W``).
- `_conv_kernel`: implicit-GEMM 2-D convolution, stride 1, "same" padding, one weight set
  per interval (grid axis 0 is interval x image), same epilogues as `_bmm_kernel`.  The
  state VJP is the same kernel on the flipped, transposed weights, expressed through
  negative strides (no copy).
- `_conv_wgrad_kernel`: the weight gradient, an implicit GEMM over batch x pixels.
- `_act_grad_kernel`: gz = g·dt[l]·act'(z), elementwise.

Bias gradients are one ``sum`` of gz over the batch (and pixel) axes.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["ACT_CODES", "ConvStep", "DenseStep", "act_grad", "conv_step", "conv_vjp_state",
           "conv_wgrad", "dense_step", "dense_vjp_state", "dense_wgrad"]

#: activations the kernels implement, by the names of `layerpar.ode.blocks.ACTIVATIONS`
ACT_CODES: dict[str, int] = {"identity": 0, "tanh": 1, "relu": 2, "sigmoid": 3, "gelu": 4,
                             "leaky_relu": 5, "softplus": 6}


@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 1:  # tanh, stable for large |z|
        e = tl.exp(-2.0 * tl.abs(z))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(z >= 0, t, -t)
    elif ACT == 2:
        return tl.maximum(z, 0.0)
    elif ACT == 3:
        return 1.0 / (1.0 + tl.exp(-z))
    elif ACT == 4:  # exact (erf) GELU, as F.gelu
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 5:  # F.leaky_relu, slope 0.01
        return tl.where(z > 0, z, 0.01 * z)
    elif ACT == 6:  # F.softplus, beta 1, threshold 20
        return tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    else:
        return z


@triton.jit
def _dact(z, ACT: tl.constexpr):
    """act'(z)."""
    if ACT == 1:
        e = tl.exp(-2.0 * tl.abs(z))
        t = (1.0 - e) / (1.0 + e)
        return 1.0 - t * t
    elif ACT == 2:
        return tl.where(z > 0, 1.0, 0.0)
    elif ACT == 3:
        s = 1.0 / (1.0 + tl.exp(-z))
        return s * (1.0 - s)
    elif ACT == 4:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        return cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACT == 5:
        return tl.where(z > 0, 1.0, 0.01)
    elif ACT == 6:
        return tl.where(z > 20.0, 1.0, 1.0 / (1.0 + tl.exp(-z)))
    else:
        return tl.full(z.shape, 1.0, tl.float32)


@triton.jit
def _epilogue(acc, offs, mask, lay, rn_bias, res_ptr, out_ptr, bias_ptr, dt_ptr, z_ptr,
              N_BIAS, MODE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
              SAVE_Z: tl.constexpr, BIAS_ROWS: tl.constexpr):
    if MODE == 1:
        if HAS_BIAS:
            bm = rn_bias < N_BIAS
            b = tl.load(bias_ptr + lay * N_BIAS + rn_bias, mask=bm, other=0.0)
            if BIAS_ROWS:  # one bias per output row (conv: rows are channels)
                acc = acc + b[:, None]
            else:
                acc = acc + b[None, :]
        if SAVE_Z:
            tl.store(z_ptr + offs, acc, mask=mask)
        dt = tl.load(dt_ptr + lay)
        x = tl.load(res_ptr + offs, mask=mask, other=0.0)
        out = x + dt * _act(acc, ACT)
    elif MODE == 2:
        out = tl.load(res_ptr + offs, mask=mask, other=0.0) + acc
    else:
        out = acc
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _bmm_kernel(a_ptr, b_ptr, out_ptr, res_ptr, bias_ptr, dt_ptr, z_ptr, M, N, K,
                sa0, sam, sak, sb0, sbk, sbn,
                MODE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                SAVE_Z: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[l] (contiguous [L, M, N]) from A[l] @ B[l]; res, z share out's layout."""
    lay = tl.program_id(0)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.program_id(2) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + lay * sa0 + rm[:, None] * sam + kk[None, :] * sak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + lay * sb0 + kk[:, None] * sbk + rn[None, :] * sbn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    offs = lay * M * N + rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    _epilogue(acc, offs, mask, lay, rn, res_ptr, out_ptr, bias_ptr, dt_ptr, z_ptr, N,
              MODE, ACT, HAS_BIAS, SAVE_Z, False)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, bias_ptr, dt_ptr, z_ptr,
                 NB, C, H, W, w_off, sw0, sw1, sw2, sw3, sw4,
                 KS: tl.constexpr, PAD: tl.constexpr,
                 MODE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SAVE_Z: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr,
                 BK: tl.constexpr):
    """out[l, b] = conv(x[l, b], w[l]) (C -> C channels, H x W pixels, stride 1) with the
    epilogue; x, out, res, z contiguous [L, NB, C, H, W]; w addressed as
    w_off + l·sw0 + co·sw1 + ci·sw2 + kh·sw3 + kw·sw4."""
    lb = tl.program_id(0)
    lay = lb // NB
    HW = H * W
    rco = tl.program_id(1) * BC + tl.arange(0, BC)
    rp = tl.program_id(2) * BP + tl.arange(0, BP)
    py = rp // W
    px = rp % W
    KK = C * KS * KS
    acc = tl.zeros((BC, BP), dtype=tl.float32)
    for k0 in range(0, KK, BK):
        rk = k0 + tl.arange(0, BK)
        ci = rk // (KS * KS)
        r = rk % (KS * KS)
        kh = r // KS
        kw = r % KS
        wt = tl.load(w_ptr + w_off + lay * sw0 + rco[:, None] * sw1 + ci[None, :] * sw2
                     + kh[None, :] * sw3 + kw[None, :] * sw4,
                     mask=(rco[:, None] < C) & (rk[None, :] < KK), other=0.0)
        iy = py[None, :] + kh[:, None] - PAD
        ix = px[None, :] + kw[:, None] - PAD
        xm = (rk[:, None] < KK) & (rp[None, :] < HW) & (iy >= 0) & (iy < H) \
            & (ix >= 0) & (ix < W)
        xt = tl.load(x_ptr + lb * C * HW + ci[:, None] * HW + iy * W + ix, mask=xm,
                     other=0.0)
        acc += tl.dot(wt, xt, input_precision="ieee")
    offs = lb * C * HW + rco[:, None] * HW + rp[None, :]
    mask = (rco[:, None] < C) & (rp[None, :] < HW)
    _epilogue(acc, offs, mask, lay, rco, res_ptr, out_ptr, bias_ptr, dt_ptr, z_ptr, C,
              MODE, ACT, HAS_BIAS, SAVE_Z, True)


@triton.jit
def _conv_wgrad_kernel(gz_ptr, x_ptr, gw_ptr, NB, C, H, W,
                       KS: tl.constexpr, PAD: tl.constexpr, BC: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
    """gw[l, co, (ci, kh, kw)] = sum over images and pixels of gz[l, b, co, p] times
    x[l, b, ci, p + (kh, kw) - PAD]; gw contiguous [L, C, C·KS·KS]."""
    lay = tl.program_id(0)
    HW = H * W
    KK = C * KS * KS
    rco = tl.program_id(1) * BC + tl.arange(0, BC)
    rn = tl.program_id(2) * BN + tl.arange(0, BN)
    ci = rn // (KS * KS)
    r = rn % (KS * KS)
    kh = r // KS
    kw = r % KS
    acc = tl.zeros((BC, BN), dtype=tl.float32)
    base = lay * NB * C * HW
    for k0 in range(0, NB * HW, BK):
        rk = k0 + tl.arange(0, BK)
        b = rk // HW
        p = rk % HW
        py = p // W
        px = p % W
        g = tl.load(gz_ptr + base + b[None, :] * C * HW + rco[:, None] * HW + p[None, :],
                    mask=(rco[:, None] < C) & (rk[None, :] < NB * HW), other=0.0)
        iy = py[:, None] + kh[None, :] - PAD
        ix = px[:, None] + kw[None, :] - PAD
        xm = (rk[:, None] < NB * HW) & (rn[None, :] < KK) & (iy >= 0) & (iy < H) \
            & (ix >= 0) & (ix < W)
        xt = tl.load(x_ptr + base + b[:, None] * C * HW + ci[None, :] * HW + iy * W + ix,
                     mask=xm, other=0.0)
        acc += tl.dot(g, xt, input_precision="ieee")
    tl.store(gw_ptr + lay * C * KK + rco[:, None] * KK + rn[None, :], acc,
             mask=(rco[:, None] < C) & (rn[None, :] < KK))


@triton.jit
def _act_grad_kernel(g_ptr, z_ptr, dt_ptr, out_ptr, per_layer, total, ACT: tl.constexpr,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    z = tl.load(z_ptr + offs, mask=m, other=0.0)
    dt = tl.load(dt_ptr + offs // per_layer, mask=m, other=0.0)
    tl.store(out_ptr + offs, g * dt * _dact(z, ACT), mask=m)


# ------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------
def _blk(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def _check(x: Tensor, *others: Optional[Tensor]) -> None:
    for t in (x, *others):
        if t is not None and t.dtype != torch.float32:
            raise TypeError(f"the Triton step kernels take float32 tensors, got {t.dtype}")


def dense_step(x: Tensor, weight: Tensor, bias: Optional[Tensor], dt: Tensor, act: str,
               save_z: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """(y, z): y[l] = x[l] + dt[l]·act(x[l] W[l]^T + b[l]) for x [L, B, width], weight
    [L, width, width] (nn.Linear layout), bias [L, width] or None, dt [L]; z is the
    pre-activation when `save_z`."""
    _check(x, weight, bias, dt)
    x = x.contiguous()
    L, M, K = x.shape
    N = weight.shape[1]
    out = torch.empty_like(x)
    z = torch.empty_like(x) if save_z else None
    BM, BN, BK = _blk(M), _blk(N), _blk(K, hi=32)
    grid = (L, triton.cdiv(M, BM), triton.cdiv(N, BN))
    _bmm_kernel[grid](x, weight, out, x, x if bias is None else bias.contiguous(), dt,
                      out if z is None else z, M, N, K,
                      x.stride(0), x.stride(1), x.stride(2),
                      weight.stride(0), weight.stride(2), weight.stride(1),
                      MODE=1, ACT=ACT_CODES[act], HAS_BIAS=bias is not None,
                      SAVE_Z=save_z, BM=BM, BN=BN, BK=BK)
    return out, z


def dense_vjp_state(g: Tensor, gz: Tensor, weight: Tensor) -> Tensor:
    """g + gz[l] W[l]: the step's VJP w.r.t. the state, given gz = g·dt·act'(z)."""
    g, gz = g.contiguous(), gz.contiguous()
    L, M, K = gz.shape
    N = weight.shape[2]
    out = torch.empty_like(g)
    BM, BN, BK = _blk(M), _blk(N), _blk(K, hi=32)
    _bmm_kernel[(L, triton.cdiv(M, BM), triton.cdiv(N, BN))](
        gz, weight, out, g, g, g, g, M, N, K,
        gz.stride(0), gz.stride(1), gz.stride(2),
        weight.stride(0), weight.stride(1), weight.stride(2),
        MODE=2, ACT=0, HAS_BIAS=False, SAVE_Z=False, BM=BM, BN=BN, BK=BK)
    return out


def dense_wgrad(gz: Tensor, x: Tensor) -> Tensor:
    """gW[l] = gz[l]^T x[l] ([L, width, width], nn.Linear layout)."""
    gz, x = gz.contiguous(), x.contiguous()
    L, B, M = gz.shape
    N = x.shape[2]
    out = torch.empty((L, M, N), dtype=x.dtype, device=x.device)
    BM, BN, BK = _blk(M), _blk(N), _blk(B, hi=32)
    _bmm_kernel[(L, triton.cdiv(M, BM), triton.cdiv(N, BN))](
        gz, x, out, out, out, out, out, M, N, B,
        gz.stride(0), gz.stride(2), gz.stride(1), x.stride(0), x.stride(1), x.stride(2),
        MODE=0, ACT=0, HAS_BIAS=False, SAVE_Z=False, BM=BM, BN=BN, BK=BK)
    return out


def act_grad(g: Tensor, z: Tensor, dt: Tensor, act: str) -> Tensor:
    """g·dt[l]·act'(z), elementwise ([L, ...] tensors, dt [L])."""
    g = g.contiguous()
    out = torch.empty_like(g)
    total = g.numel()
    per = total // g.shape[0]
    BLOCK = 1024
    _act_grad_kernel[(triton.cdiv(total, BLOCK),)](g, z, dt, out, per, total,
                                                  ACT=ACT_CODES[act], BLOCK=BLOCK)
    return out


def _conv_launch(x: Tensor, w: Tensor, w_off: int, w_strides: tuple, res: Tensor,
                 bias: Optional[Tensor], dt: Tensor, z: Optional[Tensor], mode: int,
                 act: str, ks: int, pad: int) -> Tensor:
    L, NB, C, H, W = x.shape
    out = torch.empty_like(x)
    BC, BP, BK = _blk(C), _blk(H * W, hi=64), _blk(C * ks * ks, hi=32)
    grid = (L * NB, triton.cdiv(C, BC), triton.cdiv(H * W, BP))
    _conv_kernel[grid](x, w, out, res, x if bias is None else bias, dt,
                       out if z is None else z, NB, C, H, W, w_off, *w_strides,
                       KS=ks, PAD=pad, MODE=mode, ACT=ACT_CODES[act],
                       HAS_BIAS=bias is not None, SAVE_Z=z is not None,
                       BC=BC, BP=BP, BK=BK)
    return out


def _pad(ks: int) -> int:
    """Left padding of torch's padding="same" (stride 1, dilation 1)."""
    return (ks - 1) // 2


def conv_step(x: Tensor, weight: Tensor, bias: Optional[Tensor], dt: Tensor, act: str,
              save_z: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """(y, z): y[l] = x[l] + dt[l]·act(conv(x[l], W[l]) + b[l]) for x [L, B, C, H, W],
    weight [L, C, C, k, k] (nn.Conv2d layout, "same" padding), bias [L, C] or None."""
    _check(x, weight, bias, dt)
    x = x.contiguous()
    ks = weight.shape[-1]
    z = torch.empty_like(x) if save_z else None
    s = weight.stride()
    y = _conv_launch(x, weight, 0, (s[0], s[1], s[2], s[3], s[4]), x,
                     None if bias is None else bias.contiguous(), dt, z, 1, act, ks,
                     _pad(ks))
    return y, z


def conv_vjp_state(g: Tensor, gz: Tensor, weight: Tensor) -> Tensor:
    """g + conv^T(gz, W): the state VJP, as a convolution with the flipped, transposed
    weights (negative strides from the last tap: no copy) and the mirrored padding."""
    g, gz = g.contiguous(), gz.contiguous()
    ks = weight.shape[-1]
    s = weight.stride()
    off = (ks - 1) * (s[3] + s[4])
    return _conv_launch(gz, weight, off, (s[0], s[2], s[1], -s[3], -s[4]), g, None,
                        g, None, 2, "identity", ks, ks - 1 - _pad(ks))


def conv_wgrad(gz: Tensor, x: Tensor, ks: int) -> Tensor:
    """dL/dW [L, C, C, k, k] from gz [L, B, C, H, W] and the step's input x."""
    gz, x = gz.contiguous(), x.contiguous()
    L, NB, C, H, W = x.shape
    out = torch.empty((L, C, C * ks * ks), dtype=x.dtype, device=x.device)
    BC, BN, BK = _blk(C), _blk(C * ks * ks), _blk(NB * H * W, hi=32)
    _conv_wgrad_kernel[(L, triton.cdiv(C, BC), triton.cdiv(C * ks * ks, BN))](
        gz, x, out, NB, C, H, W, KS=ks, PAD=_pad(ks), BC=BC, BN=BN, BK=BK)
    return out.view(L, C, C, ks, ks)


# ------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------
class _FusedStep(torch.autograd.Function):
    """y = x + dt·act(op(x, W) + b), batched over intervals, differentiable in x, W, b;
    a subclass names the operation's kernels (its step, state VJP, weight gradient)
    and the dimensions the bias gradient sums over."""

    @staticmethod
    def step(x: Tensor, weight: Tensor, bias: Optional[Tensor], dt: Tensor, act: str,
             save_z: bool) -> tuple[Tensor, Optional[Tensor]]:
        raise NotImplementedError

    @staticmethod
    def vjp_state(g: Tensor, gz: Tensor, weight: Tensor) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def wgrad(gz: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        raise NotImplementedError

    bias_dims: tuple[int, ...] = ()

    @classmethod
    def forward(cls, ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], dt: Tensor,
                act: str) -> Tensor:
        need = any(ctx.needs_input_grad[:3])
        y, z = cls.step(x, weight, bias, dt, act, save_z=need)
        if need:
            ctx.save_for_backward(x, weight, z, dt)
        ctx.act, ctx.has_bias = act, bias is not None
        return y

    @classmethod
    def backward(cls, ctx, g: Tensor):  # type: ignore[override]
        x, weight, z, dt = ctx.saved_tensors
        gz = act_grad(g, z, dt, ctx.act)
        gx = cls.vjp_state(g, gz, weight) if ctx.needs_input_grad[0] else None
        gw = cls.wgrad(gz, x, weight) if ctx.needs_input_grad[1] else None
        gb = gz.sum(cls.bias_dims) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


class DenseStep(_FusedStep):
    """y = x + dt·act(x W^T + b), batched over intervals, differentiable in x, W, b."""

    step = staticmethod(dense_step)
    vjp_state = staticmethod(dense_vjp_state)
    wgrad = staticmethod(lambda gz, x, weight: dense_wgrad(gz, x))
    bias_dims = (1,)


class ConvStep(_FusedStep):
    """y = x + dt·act(conv(x, W) + b), batched over intervals, differentiable in x, W, b."""

    step = staticmethod(conv_step)
    vjp_state = staticmethod(conv_vjp_state)
    wgrad = staticmethod(lambda gz, x, weight: conv_wgrad(gz, x, weight.shape[-1]))
    bias_dims = (1, 3, 4)
