"""How far an inexact layer-parallel gradient is from the exact one, measured.

Training runs the forward and adjoint MGRIT solves inexactly on purpose (one or two
iterations), so the gradient the optimizer sees is not the network's gradient.
`check_gradients` says by how much, for one batch: it runs the batch with the model's
own options and again with exact propagation (`LayerParallel.exact`: sequential
stepping both ways, as with ``MGRITOptions(max_levels=1)``, exact to round-off) on the
same model, plan, ranks and parameter tensors, and compares the outputs, the input
gradients and the parameter gradients.

Nothing the training sees changes: gradients come from `torch.autograd.grad` (no
`.grad` is written), the training mode is the model's, the global random generator
is put back (both solves draw the same dropout masks: those the next training pass
would draw), batch-norm running statistics are put back, and so are
`model.last_forward` / `model.last_backward`.

Several checks of one batch at the same parameter values (auto-tuning compares each
candidate setting with exact propagation on its first batch) share one exact pass:
`exact_reference` runs it once, and ``check_gradients(..., reference=...)`` reuses it.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor

from ..ode.net import Segment
from ..ode.rng import GeneratorStates
from .tape import input_leaf

if TYPE_CHECKING:
    from ..mgrit.result import MGRITResult

#: a `LayerParallel` (the model measured): not imported, as the model imports this module
_Model = Any

__all__ = ["ExactReference", "GradientCheck", "check_gradients", "exact_reference"]


@dataclass(frozen=True)
class GradientCheck:
    """One batch's inexact solve against the exact one (identical on every rank).

    Errors are relative, ‖inexact − exact‖ / ‖exact‖ in float64 (0 where both are
    zero).  The input gradient is always computed (on a detached copy of the input,
    whether or not it requires grad), except for an integer input (token ids), which
    has none: its error reads 0 and its cosine 1.  Parameter gradients are over this model's
    trainable parameters on all ranks; `segment_grad_errors` has one entry per ODE
    segment (its residual blocks only), `param_grad_error` and `cosine` cover all
    trainable parameters, plain layers included.  Iterations and final residual
    norms are those of the inexact solve, per segment (a residual is None where none
    was measured, e.g. one iteration with `skip`, or a sequential solve).

    `n_params_compared` counts the parameter values compared (all ranks).  Where it is
    0 (every parameter frozen) the parameter errors and cosine are NaN, not a perfect
    score, and `compared` says "input": `error` and `cos`, what a bound is checked
    against, are then the input gradient's.
    """

    output_error: float
    loss_error: float
    input_grad_error: float
    segment_grad_errors: tuple[float, ...]
    param_grad_error: float
    cosine: float
    fwd_iterations: tuple[int, ...]
    bwd_iterations: tuple[int, ...]
    fwd_residuals: tuple[Optional[float], ...]
    bwd_residuals: tuple[Optional[float], ...]
    #: seconds of the inexact and of the exact forward + backward pass (the slowest
    #: rank's, so the same on every rank): which of the two is cheaper here
    inexact_seconds: float = field(default=0.0, compare=False)
    exact_seconds: float = field(default=0.0, compare=False)
    n_params_compared: int = 0
    input_cosine: float = 1.0

    @property
    def compared(self) -> str:
        """"parameters" (the gradient the optimizer uses), or "input" where no
        parameter requires grad."""
        return "parameters" if self.n_params_compared > 0 else "input"

    @property
    def error(self) -> float:
        """Relative error of the compared gradient (see `compared`)."""
        return self.param_grad_error if self.n_params_compared > 0 else \
            self.input_grad_error

    @property
    def cos(self) -> float:
        """Cosine between the inexact and the exact compared gradient."""
        return self.cosine if self.n_params_compared > 0 else self.input_cosine

    def __str__(self) -> str:
        def res(values: Sequence[Optional[float]]) -> str:
            return ",".join("n/a" if v is None else f"{v:.1e}" for v in values)

        segs = ",".join(f"{e:.1e}" for e in self.segment_grad_errors)
        params = (f"param grad rel. error {self.param_grad_error:.2e} (cos "
                  f"{self.cosine:.6f}; per segment {segs}; {self.n_params_compared} values)"
                  if self.n_params_compared else
                  "no trainable parameter: parameter gradients not compared")
        return (f"gradient check: {params} | input grad "
                f"{self.input_grad_error:.2e} (cos {self.input_cosine:.6f}) | output "
                f"{self.output_error:.2e} | loss "
                f"{self.loss_error:.2e} | fwd iters "
                f"{','.join(map(str, self.fwd_iterations))} (res {res(self.fwd_residuals)})"
                f" | bwd iters {','.join(map(str, self.bwd_iterations))} "
                f"(res {res(self.bwd_residuals)})")


def _grads(model: _Model, x: Tensor, y: Any, loss_fn: Callable[[Tensor, Any], Tensor],
           params: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(output, loss, input gradient, parameter gradients) of one batch, by
    `torch.autograd.grad` (no `.grad` is touched); unused parameters get zeros."""
    xc = input_leaf(x.clone())
    with torch.enable_grad():
        out = model(xc)
        loss = loss_fn(out, y)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"`loss_fn` must return a scalar tensor, got "
                            f"{type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
                               else ""))
        wrt = [xc] if xc.requires_grad else []  # (no gradient for integer inputs)
        # None for what the loss does not depend on (allow_unused)
        got: tuple[Optional[Tensor], ...] = torch.autograd.grad(
            loss.reshape(()), [*wrt, *params], allow_unused=True)
        got = got if wrt else (None, *got)
    gx = got[0] if got[0] is not None else torch.zeros_like(xc)
    gp = [torch.zeros_like(p) if g is None else g for p, g in zip(params, got[1:])]
    return out.detach(), loss.detach(), gx, gp


@dataclass(frozen=True)
class ExactReference:
    """One batch's exact pass, as `check_gradients` compares with it: the output, the
    loss, the input gradient, this rank's parameter gradients and the pass's seconds
    (this rank's clock).  Valid for the same `x`, `y`, loss and parameter values only;
    `check_gradients` checks that it is given the same `x` and `y` objects and the
    same parameter tensors, the caller that no parameter was written in between."""

    x: Tensor
    y: Any
    params: tuple[int, ...]  # ids of the parameters the gradients belong to
    out: Tensor
    loss: Tensor
    input_grad: Tensor
    param_grads: tuple[Tensor, ...]
    seconds: float


def _check_params(model: _Model) -> tuple[list[Tensor], dict[int, Optional[int]]]:
    """This rank's trainable parameters (its own layers) and the segment each belongs
    to (None: a plain layer)."""
    params: list[Tensor] = []
    group: dict[int, Optional[int]] = {}
    for k, (kind, info) in enumerate(model.layer_kinds):
        for p in model.layers[k].parameters():
            if p.requires_grad and id(p) not in group:
                params.append(p)
                group[id(p)] = info if kind == "segment" else None
    return params, group


def random_state(model: _Model) -> GeneratorStates:
    """The states of the generators a measuring pass of `model` may move, taken now: the
    global ones and those the net's plain layers hold (a segment's block holding one is
    refused at its first pass, `runner._checked`; scanning only the plain layers keeps
    this to their few modules: every module of a 1,024-layer net took about 9 ms)."""
    net = getattr(model, "whole_net", None)
    return GeneratorStates([] if net is None else
                           [m for m in net.layers if not isinstance(m, Segment)])


class _Restore:
    """Puts back what a measuring pass may change: the random generators (CPU and,
    where initialised, CUDA, and those the net's modules hold: `GeneratorStates`), the
    buffers (batch-norm statistics) and the model's
    last solve statistics.  `rng()` puts the generators back alone (so that two
    passes draw the same dropout masks); leaving the `with` puts back everything."""

    def __init__(self, model: _Model) -> None:
        self.model = model
        self._rng = random_state(model)
        self._buffers = list(model.buffers())
        self._saved = [b.detach().clone() for b in self._buffers]
        self._stats = (model.last_forward, model.last_backward)

    def rng(self) -> None:
        self._rng.restore()

    def buffers(self) -> None:
        with torch.no_grad():
            for b, s in zip(self._buffers, self._saved):
                b.copy_(s)

    def __enter__(self) -> _Restore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.rng()
        self.buffers()
        self.model.last_forward, self.model.last_backward = self._stats


def _exact(model: _Model, x: Tensor, y: Any, loss_fn: Callable[[Tensor, Any], Tensor],
           params: list[Tensor]) -> ExactReference:
    t0 = time.perf_counter()
    with model.exact():
        out, loss, gx, gp = _grads(model, x, y, loss_fn, params)
    return ExactReference(x, y, tuple(id(p) for p in params), out, loss, gx, tuple(gp),
                          time.perf_counter() - t0)


def exact_reference(model: _Model, x: Tensor, y: Any,
                    loss_fn: Callable[[Tensor, Any], Tensor]) -> ExactReference:
    """The exact pass `check_gradients` compares with, run once (collective) for
    several checks of this batch at these parameter values (models sharing the
    parameter tensors: `LayerParallel.like`).  Nothing the training sees changes."""
    _check_arguments(model, x, y, loss_fn)
    params, _ = _check_params(model)
    with _Restore(model):
        return _exact(model, x, y, loss_fn, params)


def _sq(t: Tensor) -> float:
    return float(torch.sum(t.detach().to(torch.float64) ** 2))


def _rel(d2: float, e2: float) -> float:
    """sqrt(d2) / sqrt(e2); 0 where both are zero, inf where only e2 is."""
    if e2 > 0.0:
        return math.sqrt(d2 / e2)
    return 0.0 if d2 == 0.0 else math.inf


def _cosine(dot: float, a2: float, b2: float) -> float:
    """dot / (|a| |b|), clipped to [-1, 1]; 1 where both are zero, 0 where one is."""
    if a2 > 0.0 and b2 > 0.0:
        return max(-1.0, min(1.0, dot / math.sqrt(a2 * b2)))
    return 1.0 if a2 == b2 else 0.0


def _final(stats: list[MGRITResult]) -> tuple[tuple[int, ...], tuple[Optional[float], ...]]:
    iters = tuple(int(s.iterations) for s in stats)
    res = tuple(float(s.residual_history[-1]) if s.residual_history else None for s in stats)
    return iters, res


def _check_arguments(model: _Model, x: Any, y: Any, loss_fn: Any) -> None:
    if model.closed:
        raise RuntimeError("this LayerParallel was closed; check_gradients needs a model "
                           "that can still run")
    if not isinstance(x, Tensor):
        raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool:
        raise TypeError("`x` must be a numeric tensor (floating point: its gradient is "
                        "compared too; integer: token ids), got dtype torch.bool")
    if x.numel() == 0:
        raise ValueError(f"`x` must not be empty, got shape {tuple(x.shape)}")
    if y is None:
        raise TypeError("`y` must be the targets passed to `loss_fn`, got None")
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable as loss_fn(output, y), got "
                        f"{type(loss_fn).__name__}")


def check_gradients(model: _Model, x: Tensor, y: Any,
                    loss_fn: Callable[[Tensor, Any], Tensor], *,
                    reference: Optional[ExactReference] = None) -> GradientCheck:
    """Compare one batch's inexact gradient with the exact one (collective).

    Every rank calls it with the same `x` and `y`.  The batch runs once with the
    model's options and once exactly (`LayerParallel.exact`: sequential solves on the
    same plan and ranks); see the module docstring for what is left unchanged.  Returns a
    `GradientCheck`, identical on every rank.

    reference: the exact pass of this batch, from `exact_reference` (several checks
    of one batch at the same parameter values run it once); None runs it here.
    """
    _check_arguments(model, x, y, loss_fn)
    params, group = _check_params(model)
    n_segments = sum(1 for kind, _ in model.layer_kinds if kind == "segment")
    if reference is not None and not (reference.x is x and reference.y is y and
                                      reference.params == tuple(id(p) for p in params)):
        raise ValueError("`reference` was measured on another batch or other parameters "
                         "(it must come from exact_reference on this x, y and a model "
                         "sharing these parameter tensors)")
    with _Restore(model) as restore:
        t0 = time.perf_counter()
        out_i, loss_i, gx_i, gp_i = _grads(model, x, y, loss_fn, params)
        t_inexact = time.perf_counter() - t0
        fwd_it, fwd_res = _final(model.last_forward)
        bwd_it, bwd_res = _final(model.last_backward)
        if reference is None:
            restore.rng()  # the same dropout masks in both solves
            restore.buffers()  # and the same batch-norm statistics
            reference = _exact(model, x, y, loss_fn, params)
    out_e, loss_e, gx_e, gp_e = (reference.out, reference.loss, reference.input_grad,
                                 reference.param_grads)
    t_exact = reference.seconds

    # this rank's sums; the output, loss and input gradient are the same on every rank.
    # Per segment (None: plain layers), the gradients flattened into one float64 vector
    # each: a few reductions, not several per parameter (1,024 layers: ~6,000 small
    # operations and host reads per check otherwise)
    seg_d2, seg_e2 = [0.0] * n_segments, [0.0] * n_segments
    d2 = e2 = i2 = dot = 0.0
    members: dict[Optional[int], tuple[list[Tensor], list[Tensor]]] = {}
    for p, gi, ge in zip(params, gp_i, gp_e):
        gis, ges = members.setdefault(group.get(id(p)), ([], []))
        gis.append(gi.detach().reshape(-1))
        ges.append(ge.detach().reshape(-1))
    for s, (gis, ges) in members.items():
        gi64 = torch.cat(gis).to(torch.float64)
        ge64 = torch.cat(ges).to(torch.float64)
        sums = torch.stack([torch.dot(gi64 - ge64, gi64 - ge64), torch.dot(ge64, ge64),
                            torch.dot(gi64, gi64), torch.dot(gi64, ge64)]).tolist()
        d2, e2, i2, dot = d2 + sums[0], e2 + sums[1], i2 + sums[2], dot + sums[3]
        if s is not None:
            seg_d2[s] += sums[0]
            seg_e2[s] += sums[1]
    gx_i64, gx_e64 = gx_i.detach().to(torch.float64), gx_e.detach().to(torch.float64)
    x_cos = _cosine(float(torch.sum(gx_i64 * gx_e64)), _sq(gx_i64), _sq(gx_e64))
    local = (seg_d2, seg_e2, d2, e2, i2, dot,
             _sq(out_i.to(torch.float64) - out_e.to(torch.float64)), _sq(out_e),
             abs(float(loss_i) - float(loss_e)), abs(float(loss_e)),
             _sq(gx_i.to(torch.float64) - gx_e.to(torch.float64)), _sq(gx_e),
             t_inexact, t_exact, sum(p.numel() for p in params))
    model.transport.set_context(f"batch {model.batch}, gradient check")
    got = model.transport.allgather_object(local, "check_gradients' error norms")
    # summed in rank order, so every rank computes the same numbers
    seg_d2 = [sum(g[0][s] for g in got) for s in range(n_segments)]
    seg_e2 = [sum(g[1][s] for g in got) for s in range(n_segments)]
    d2, e2, i2, dot = (sum(g[k] for g in got) for k in (2, 3, 4, 5))
    o_d2, o_e2, l_d, l_e, x_d2, x_e2 = got[0][6:12]
    t_inexact, t_exact = (max(g[k] for g in got) for k in (12, 13))
    n_params = sum(g[14] for g in got)
    nan = math.nan
    return GradientCheck(
        output_error=_rel(o_d2, o_e2),
        loss_error=_rel(l_d * l_d, l_e * l_e),
        input_grad_error=_rel(x_d2, x_e2),
        segment_grad_errors=tuple(_rel(a, b) if n_params else nan
                                  for a, b in zip(seg_d2, seg_e2)),
        param_grad_error=_rel(d2, e2) if n_params else nan,
        cosine=_cosine(dot, i2, e2) if n_params else nan,
        n_params_compared=n_params, input_cosine=x_cos,
        fwd_iterations=fwd_it, bwd_iterations=bwd_it,
        fwd_residuals=fwd_res, bwd_residuals=bwd_res,
        inexact_seconds=t_inexact, exact_seconds=t_exact)
