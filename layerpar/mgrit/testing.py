"""Self-checks for the callbacks a `solve()` relies on.

Run them on a user's states and propagator before a long job: each returns None when
the callback behaves as the engine assumes and raises `CallbackCheckError` (a
`ValueError`) saying what failed otherwise.  They never use ``assert``, so they also
work under ``python -O``.

- `check_vector_ops(u, v)`: the engine's sum (`vec_sum`: alpha*x + beta*y as a new
  tensor) and norm (`vec_norm_sq`), and that states survive a solve unchanged (the
  engine's clone shares immutable states instead of copying them).
- `check_pack_roundtrip(u)`: `transport.pack` then `unpack` gives the same bits,
  shape and dtype, also for float32/float64/bfloat16 copies and non-contiguous views.
- `check_step(step, u, t0, t1, level)`: the propagator returns a tensor like `u`,
  leaves `u` alone and is deterministic.
- `check_step_batch(step_batch, step, us, t0s, t1s, level)`: the batched propagator
  agrees with the single one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .options import MGRITOptions
from .solve import BatchStepFn, StepFn, solve, vec_norm_sq, vec_sum
from .transport import pack, unpack

__all__ = ["CallbackCheckError", "check_pack_roundtrip", "check_step", "check_step_batch",
           "check_vector_ops"]


class CallbackCheckError(ValueError):
    """A callback self-check failed; the message says which property and by how much."""


def _fail(what: str) -> None:
    raise CallbackCheckError(what)


def _tol(dtype: torch.dtype) -> float:
    """Relative tolerance for values recomputed in another order, per dtype."""
    if dtype in (torch.float64, torch.complex128):
        return 1e-12
    if dtype in (torch.float32, torch.complex64):
        return 1e-5
    return 2e-2  # half, bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` (so NaNs compare equal to themselves)."""
    c = t.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
    if c.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return c.view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(_bits(a), _bits(b)))


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> tuple[bool, float]:
    """(|a - b| <= rtol * max(|b|, 1) elementwise in float64, the largest |a - b|)."""
    a64, b64 = a.detach().double(), b.detach().double()
    if a64.numel() == 0:
        return True, 0.0
    diff = (a64 - b64).abs()
    scale = b64.abs().clamp(min=1.0)
    return bool((diff <= rtol * scale).all()), float(diff.max())


def _check_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_vector_ops(u: torch.Tensor, v: torch.Tensor) -> None:
    """Check the engine's vector operations on two states shaped like the solve's.

    `vec_sum(alpha, x, beta, y)` must equal alpha*x + beta*y (for the coefficients the
    engine uses), return a new tensor and leave its inputs unchanged; `vec_norm_sq`
    must be >= 0, equal the sum of squares, scale quadratically and add over a list.
    Finally a short two-level solve starting from `u` with initial guess `v` must
    leave both unchanged: the engine shares states instead of cloning them.
    """
    u = _check_tensor("u", u)
    v = _check_tensor("v", v)
    if u.shape != v.shape or u.dtype != v.dtype or u.device != v.device:
        _fail(f"`u` and `v` must have the same shape, dtype and device: {tuple(u.shape)} "
              f"{u.dtype} {u.device} vs {tuple(v.shape)} {v.dtype} {v.device}")
    if not u.is_floating_point():
        _fail(f"states must be floating point, got {u.dtype}")
    rtol = _tol(u.dtype)
    u_bits, v_bits = _bits(u).clone(), _bits(v).clone()

    def unchanged(when: str) -> None:
        if not torch.equal(_bits(u), u_bits) or not torch.equal(_bits(v), v_bits):
            _fail(f"{when} modified its input states in place")

    for alpha, beta in ((1.0, 1.0), (1.0, -1.0), (-1.0, 1.0), (0.7, 0.3), (2.5, -0.5)):
        out = vec_sum(alpha, u, beta, v)
        unchanged(f"vec_sum({alpha}, u, {beta}, v)")
        if not isinstance(out, torch.Tensor) or out.shape != u.shape or out.dtype != u.dtype:
            _fail(f"vec_sum({alpha}, u, {beta}, v) returned {type(out).__name__} "
                  f"{getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}; expected a "
                  f"tensor of shape {tuple(u.shape)}, {u.dtype}")
        if out is u or out is v or (out.numel() and out.data_ptr() in (u.data_ptr(),
                                                                        v.data_ptr())):
            _fail(f"vec_sum({alpha}, u, {beta}, v) returned one of its inputs' storage; "
                  "it must return a new tensor")
        ref = alpha * u.double() + beta * v.double()
        ok, err = _close(out, ref, rtol)
        if not ok:
            _fail(f"vec_sum({alpha}, u, {beta}, v) differs from alpha*u + beta*v by {err:.3e} "
                  f"(tolerance {rtol:g} relative)")

    nu = vec_norm_sq([u])
    unchanged("vec_norm_sq([u])")
    if not isinstance(nu, float):
        _fail(f"vec_norm_sq must return a float, got {type(nu).__name__}")
    ref_u = float((u.detach().double() ** 2).sum())
    if not nu >= 0.0:
        _fail(f"vec_norm_sq([u]) = {nu} is not >= 0")
    if abs(nu - ref_u) > rtol * max(ref_u, 1e-300):
        _fail(f"vec_norm_sq([u]) = {nu!r} differs from the sum of squares {ref_u!r}")
    n2 = vec_norm_sq([u * 2])
    if abs(n2 - 4 * nu) > rtol * max(4 * nu, 1e-300):
        _fail(f"vec_norm_sq([2u]) = {n2!r} is not 4 * vec_norm_sq([u]) = {4 * nu!r}")
    nv = vec_norm_sq([v])
    nuv = vec_norm_sq([u, v])
    if abs(nuv - (nu + nv)) > rtol * max(nu + nv, 1e-300):
        _fail(f"vec_norm_sq([u, v]) = {nuv!r} is not vec_norm_sq([u]) + vec_norm_sq([v]) "
              f"= {nu + nv!r}")
    unchanged("vec_norm_sq")

    # clone: the engine shares states; a solve must leave u0 and the guesses intact
    def halve(x: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
        return x * 0.5

    res = solve(halve, u, 8, 1.0, MGRITOptions(max_levels=2, cfactor=2, max_iter=2),
                init=lambda t: v)
    unchanged("a solve starting from `u` with initial guess `v`")
    if not _same_bits(res.states[0], u):
        _fail("the solve's state 0 is not the initial condition `u`")


def check_pack_roundtrip(u: torch.Tensor) -> None:
    """Check that `pack` then `unpack` reproduces states bit for bit.

    Tried on `u` itself, on float32/float64/bfloat16 copies of it and on a
    non-contiguous view of the same values; the dtype and shape must come back and
    `pack` must leave its input unchanged.
    """
    u = _check_tensor("u", u)
    variants: list[tuple[str, torch.Tensor]] = [("u", u)]
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        if u.is_floating_point() and dt != u.dtype:
            variants.append((f"u as {dt}", u.to(dt)))
    if u.dim() >= 1 and u.numel() > 0:
        # the same values, laid out with a stride
        wide = torch.stack([u, torch.zeros_like(u)], dim=-1)
        variants.append(("a non-contiguous view of u", wide[..., 0]))
    if u.dim() >= 2:
        variants.append(("u transposed", u.transpose(0, 1)))
    for label, x in variants:
        before = _bits(x).clone()
        buf = pack(x)
        if not torch.equal(_bits(x), before):
            _fail(f"pack modified {label}")
        back = unpack(buf.copy(), x.shape, x.dtype, x.device)
        if back.dtype != x.dtype:
            _fail(f"pack/unpack of {label} changed the dtype from {x.dtype} to {back.dtype}")
        if back.shape != x.shape:
            _fail(f"pack/unpack of {label} changed the shape from {tuple(x.shape)} to "
                  f"{tuple(back.shape)}")
        if back.device != x.device:
            _fail(f"pack/unpack of {label} moved it from {x.device} to {back.device}")
        if not torch.equal(_bits(back), before):
            _fail(f"pack/unpack of {label} did not reproduce its bits")


def check_step(step: StepFn, u: torch.Tensor, t0: float, t1: float, level: int = 0) -> None:
    """Check a propagator on one interval [t0, t1] of `level`.

    It must return a tensor with the shape, dtype and device of `u`, leave `u`
    unchanged, and give the same bits when called twice.
    """
    u = _check_tensor("u", u)
    if not callable(step):
        raise TypeError(f"`step` must be callable, got {type(step).__name__}")
    before = _bits(u).clone()
    outs = []
    for call in (1, 2):
        out = step(u, t0, t1, level)
        if not isinstance(out, torch.Tensor):
            _fail(f"step(u, {t0}, {t1}, {level}) returned {type(out).__name__}, "
                  "not a torch.Tensor")
        if out.shape != u.shape or out.dtype != u.dtype or out.device != u.device:
            _fail(f"step(u, {t0}, {t1}, {level}) returned shape {tuple(out.shape)}, "
                  f"{out.dtype} on {out.device}; expected {tuple(u.shape)}, {u.dtype} on "
                  f"{u.device} (like u)")
        if not torch.equal(_bits(u), before):
            _fail(f"step(u, {t0}, {t1}, {level}) modified u in place (call {call}); the "
                  "engine shares states, so a step must return a new tensor")
        outs.append(_bits(out).clone())
    if not torch.equal(outs[0], outs[1]):
        _fail(f"step(u, {t0}, {t1}, {level}) is not deterministic: two calls gave "
              "different results")


def check_step_batch(step_batch: BatchStepFn, step: StepFn, us: Sequence[torch.Tensor],
                     t0s: Sequence[float], t1s: Sequence[float], level: int = 0,
                     rtol: Optional[float] = None) -> None:
    """Check that a batched propagator agrees with the single one.

    `step_batch(us, t0s, t1s, level)` must return one tensor per input, each like its
    input and within `rtol` (default: per dtype) of `step(us[k], t0s[k], t1s[k],
    level)`, and leave its inputs unchanged.
    """
    if not callable(step_batch) or not callable(step):
        raise TypeError("`step_batch` and `step` must be callable")
    us = [_check_tensor(f"us[{k}]", x) for k, x in enumerate(us)]
    if not (len(us) == len(t0s) == len(t1s)) or not us:
        _fail(f"need as many states as start and stop times (at least one), got {len(us)}, "
              f"{len(t0s)}, {len(t1s)}")
    before = [_bits(x).clone() for x in us]
    outs = list(step_batch(list(us), list(t0s), list(t1s), level))
    if len(outs) != len(us):
        _fail(f"step_batch returned {len(outs)} states for {len(us)} inputs")
    if any(not torch.equal(_bits(x), b) for x, b in zip(us, before)):
        _fail("step_batch modified its input states in place")
    for k, (x, out) in enumerate(zip(us, outs)):
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
            _fail(f"step_batch output {k} is {type(out).__name__} "
                  f"{getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}; expected shape "
                  f"{tuple(x.shape)}, {x.dtype}")
        ref = step(x, t0s[k], t1s[k], level)
        tol = _tol(x.dtype) if rtol is None else rtol
        ok, err = _close(out, ref, tol)
        if not ok:
            _fail(f"step_batch output {k} (interval [{t0s[k]}, {t1s[k]}], level {level}) "
                  f"differs from step by {err:.3e} (tolerance {tol:g} relative)")
