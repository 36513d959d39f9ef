"""MGRIT settings chosen by measurement: the tuning of ``Auto`` (``options="auto"``).

How inexact MGRIT's gradients are depends on the network, and how fast a setting runs
depends on the machine, so `tune` measures both on the user's own net and batch, on
these ranks (docs/guide/accuracy.md says why each step is as it is):

1. The exact settings: replicated serial (`layerpar.parallel.replicated`; at P > 1
   ranks), with the batch split where the net has no batch norm, and exact
   propagation (``max_levels=1`` both ways; at one rank serial autograd, the net's own
   forward), unless the budget has no room for it (`EXACT_SETUP` plus its passes).
   The fastest is the time to beat.
2. MGRIT candidates: (levels, cfactor) from `STRUCTURES` (the most coarsening first)
   in the order of `order_structures`, batched, first each at the first iteration
   counts of `ITERATIONS`, then more iterations on those outside the bound (`_Tuning.
   ladder`).  A candidate is timed on one pass (`_time_passes`); one no faster than
   the best found is dropped, else its gradient error is measured with
   `check_gradients` against the batch's one exact pass (`exact_reference`), and only
   one within the bound is timed on more passes.  Once one is within the bound,
   `SLOWER_STRUCTURES` structures in a row at least `SLOWER` x the time to beat at
   their first counts end the first round (those left coarsen less); more
   iterations are tried while the pass before times the growth (`ITERATION_GROWTH`,
   or the least ratio timed on another structure) may beat the best found, and the
   first within the bound ends a structure's.  Then, where the model's coarse levels
   use injection, structures outside the bound at 1/1 are tried with "average"
   coarsening, as long as they may beat the best found and the first tried was more
   accurate averaged than with injection; then the best with per-step cycles.
3. The bound: an `AccuracyPolicy` with `min_cosine` / `max_rel_error` as given, or by
   default (`noise_fraction` = `NOISE_FRACTION`) measured: `gradient_noise` estimates
   the batch gradient's relative sampling error from its two halves, and a candidate
   may have that fraction of it (capped at `NOISE_CAP`).
4. With the training steps to come known, no new candidate is measured where the
   tuning would take more than `BUDGET` of their expected time with it (`_Tuning.over`,
   `_Tuning.ahead`).
5. `choose`: the fastest within the bound; where no MGRIT setting is both within it
   and faster than the exact settings, the faster exact one, and why.

A re-tuning after a gradient check found the running setting outside the bound runs
on that check's batch, and takes what the check measured there (`Checked`): the bound,
the batch's exact pass and the running setting's error are not measured again.

`layerpar.parallel.tuner.AutoTuner` keeps the results, runs the choice, checks it
during training and tunes again.

Every rank decides alike: times are the slowest rank's and gradient checks are reduced
over ranks, so the table and the choice are identical on every rank.  The tuning's
time (`TuneResult.seconds`) counts in every time a training loop reports.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

import torch
from torch import Tensor

from ..mgrit.grid import build_levels
from ..mgrit.options import MGRITOptions
from ..ode.net import ODENet
from .accuracy import (
    ExactReference,
    GradientCheck,
    _Restore,
    _sq,
    check_gradients,
    exact_reference,
    random_state,
)
from .adaptive import AccuracyPolicy
from .replicated import ReplicatedSerial, split_supported, supported
from .timing import SLOWER, frozen_heap, gauged_seconds

_log = logging.getLogger("layerpar")

if TYPE_CHECKING:
    from .model import LayerParallel

__all__ = ["ITERATIONS", "NOISE_CAP", "NOISE_FRACTION", "STRUCTURES",
           "Candidate", "Checked", "Measurement", "NO_TARGETS", "TuneResult", "choose",
           "gradient_noise", "order_structures", "tune"]

#: (levels, coarsening factor) tried, in this order: the most coarsening (cfactor to
#: the power levels - 1) first, fewer levels first where that ties.  A structure that
#: coarsens more runs a shorter pass and a larger gradient error, so the first within
#: the bound is usually the fastest that will be, and every later one, slower, is
#: dropped after one timed pass without a check (on the 1,024-layer dense MNIST-1D net
#: at 2 ranks the tuning took 2.60 s against 3.20 s least coarsening first, and 1.91 s
#: with `SLOWER_STRUCTURES` ending the ladder, one run each, all choosing L3 cf8 1/1)
STRUCTURES: tuple[tuple[int, int], ...] = ((3, 8), (4, 4), (2, 8), (3, 4), (2, 4))
#: (forward, adjoint) iteration counts tried on each structure, cheapest first
ITERATIONS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (2, 2), (3, 2))
#: the default, measured bound: a candidate's relative gradient error may be this
#: fraction of the batch gradient's measured sampling error (docs/guide/accuracy.md: why)
NOISE_FRACTION = 0.5
#: ... but never more than this relative error, however noisy the batch: the largest
#: error training is known to tolerate here (MNIST-1D dense, 1,024 layers x 32,
#: 1/1 iterations with errors 0.13-0.17 tracked serial's accuracy within 0.5 points)
NOISE_CAP = 0.2


@dataclass(frozen=True)
class Candidate:
    """One setting: levels (1: exact propagation, or with `replicated` the whole net
    run serially on every rank), cfactor, iterations, batched."""

    levels: int
    cfactor: int = 0
    fwd_iters: int = 1
    bwd_iters: int = 1
    batched: bool = True
    replicated: bool = False
    split: bool = False  # replicated, each rank running its share of the batch's rows
    #: parameter coarsening of the coarse levels (`layerpar.ode.coarsening`); None: the
    #: model's own
    coarsening: Optional[str] = None

    @property
    def exact(self) -> bool:
        return self.levels == 1

    def options(self) -> tuple[MGRITOptions, MGRITOptions]:
        """(forward, adjoint) options: fixed iteration counts (tol = rtol = 0)."""
        if self.exact:
            one = MGRITOptions(max_levels=1)
            return one, one
        common: dict[str, Any] = dict(max_levels=self.levels, cfactor=self.cfactor,
                                      tol=0.0, rtol=0.0)
        return (MGRITOptions(max_iter=self.fwd_iters, **common),
                MGRITOptions(max_iter=self.bwd_iters, **common))

    def name(self, ranks: int = 2) -> str:
        if self.replicated:
            return "serial (replicated, batch split)" if self.split else "serial (replicated)"
        if self.exact:
            return "serial autograd" if ranks == 1 else "exact propagation"
        return (f"L{self.levels} cf{self.cfactor} {self.fwd_iters}/{self.bwd_iters} "
                f"{'batched' if self.batched else 'per-step'}"
                + ("" if self.coarsening is None else
                   " avg" if self.coarsening == "average" else f" {self.coarsening}"))


@dataclass(frozen=True)
class Measurement:
    """A candidate's pass time (forward + backward, see `_time_passes`) and its
    gradient error against exact propagation (None: not measured, as it was slower
    than a candidate already found)."""

    candidate: Candidate
    seconds: float
    rel_error: Optional[float] = None
    cosine: Optional[float] = None
    within: bool = False


@dataclass
class TuneResult:
    """What one tuning measured and chose."""

    table: list[Measurement]
    choice: Measurement
    reason: str
    seconds: float  # the tuning's wall time (slowest rank)
    ranks: int
    batch: int = 0  # the training batch at which it ran (0: the first)
    #: the batch gradient's relative sampling error (`gradient_noise`; None: not
    #: measured) and the bound the candidates were held to
    noise: Optional[float] = None
    bound: Optional[AccuracyPolicy] = None
    bound_note: str = ""
    reused: int = 0  # pass times taken from an earlier tuning (`tune`'s `known`)
    #: the replicated settings timed (built and warm): `AutoTuner.tune` runs the chosen
    #: one and closes the others
    kept: dict[Candidate, Any] = field(default_factory=dict, repr=False, compare=False)
    #: training steps timed online before this result (`AutoTuner.tune` with
    #: ``online``): with `timed_online`, the table's times are those steps' (ms per
    #: training step); else replicated serial ran them and the budget had room for
    #: this tuning, whose times are passes as usual
    online: int = 0
    timed_online: bool = False
    #: (seconds of the timed online step, the training steps then to come): what the
    #: trial's decision to run this tuning on passes went by
    online_step: Optional[tuple[float, int]] = None

    def __str__(self) -> str:
        """The table and the choice, readable (`lines`); the dataclass's own repr is
        several KB of fields."""
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """The candidate table and the choice, as text lines."""
        if self.timed_online:
            out = [f"auto: {len(self.table)} candidates timed on the training's own first "
                   f"{self.online} steps at {self.ranks} rank(s): each ran real training "
                   "steps in turn (exact: they train as serial does), its first one a "
                   "warm-up, not counted; the time is a whole step's (pass, optimizer and "
                   f"data alike for each); {1e3 * self.seconds:.1f} ms of the tuning's "
                   "own work (builds, exchanges) inside those steps"]
        else:
            out = [f"auto: {len(self.table)} candidates measured in {self.seconds:.2f} s "
                   f"at {self.ranks} rank(s) (batch {self.batch})"]
            if self.online:
                why = ""
                if self.online_step is not None:
                    t, steps = self.online_step
                    why = (f" ({1e3 * t:.1f} ms; {100 * BUDGET:g}% of {steps} such steps "
                           f"= {BUDGET * t * steps:.2f} s)")
                out.append(f"auto: replicated serial trained the first {self.online} "
                           f"step(s), one of them timed{why}: by that step the budget had "
                           "room to time exact propagation, so the candidates were timed "
                           "on passes of this batch")
        if self.bound_note:
            out.append(f"auto: bound: {self.bound_note}")
        if self.reused:
            out.append(f"auto: {self.reused} pass time(s) reused from the earlier tuning "
                       "(they depend on the machine and the net's shape, not its weights: "
                       "only the gradient errors were measured again)")
        unit = "ms/step" if self.timed_online else "ms/pass"
        out += [
               f"  {'candidate':34s} {unit:>9s} {'rel.err':>9s} {'cosine':>9s}  ok"]
        for m in self.table:
            err = "-" if m.rel_error is None else f"{m.rel_error:.3g}"
            cos = "-" if m.cosine is None else f"{m.cosine:.5f}"
            # (-: not checked, being slower than a candidate already found)
            mark = "*" if m is self.choice else ("-" if m.rel_error is None else
                                                 "y" if m.within else "n")
            out.append(f"  {m.candidate.name(self.ranks):34s} {1e3 * m.seconds:9.2f} "
                       f"{err:>9s} {cos:>9s}  {mark}")
        out.append(f"auto: chose {self.choice.candidate.name(self.ranks)}: {self.reason}")
        return out


@dataclass(frozen=True)
class Checked:
    """What a gradient check of the running setting measured on the batch a
    re-tuning then runs on, at the same parameter values (`AutoTuner.check`): the
    tuning reuses it instead of measuring it again (on the 1,024-layer dense MNIST-1D
    net at 2 ranks, the noise, the exact pass and the running setting's check took
    about half of a 0.8 s re-tuning whose budget, near the training's end, was 0.5 s,
    and the budget then had no room for another MGRIT setting).

    candidate, check: the running setting, as the check ran it, and its result.
    exact: the batch's exact pass the check compared with (`exact_reference`).
    bound: the bound the check held it to (None: the tuning measures its own), with
    the gradient noise measured on this batch (None: not measured here) and how the
    bound came about (`TuneResult.bound_note`)."""

    candidate: Candidate
    check: GradientCheck
    exact: ExactReference
    bound: Optional[AccuracyPolicy] = None
    noise: Optional[float] = None
    note: str = ""


def given_note(bound: AccuracyPolicy) -> str:
    """How a bound the caller gave reads in a tuning's table (`TuneResult.bound_note`)."""
    return f"given: relative error <= {bound.max_rel_error:g}, cosine >= {bound.min_cosine:g}"


def measured_note(fraction: float, noise: float, bound: AccuracyPolicy) -> str:
    """How a bound measured from the batch gradient's `noise` reads in a tuning's
    table: `fraction` of it, capped at `NOISE_CAP` (`TuneResult.bound_note`)."""
    return (f"the batch gradient's relative sampling error is {noise:.3g} (exact "
            f"gradients of the two half batches); a candidate may have {fraction:g} x "
            f"that = relative error <= {bound.max_rel_error:.3g}"
            + (f" (capped at {NOISE_CAP:g})" if fraction * noise > NOISE_CAP else ""))


def _why_no_mgrit(table: list[Measurement], base: Measurement, what: str,
                  ranks: int) -> str:
    """Why no MGRIT setting was chosen over `base` (the fastest exact setting)."""
    ok = [m for m in table if m.within and not m.candidate.exact]
    if ok:
        fast = min(ok, key=lambda m: m.seconds)
        return (f"no MGRIT setting pays here: the fastest within the bound "
                f"({fast.candidate.name(ranks)}) takes {1e3 * fast.seconds:.1f} ms per "
                f"pass against {1e3 * base.seconds:.1f} ms for {what}")
    if all(m.candidate.exact for m in table):
        return f"no MGRIT setting was measured, so {what}"
    if any(m.rel_error is not None for m in table if not m.candidate.exact):
        return (f"no MGRIT setting tried is within the gradient-error bound, so "
                f"{what} ({1e3 * base.seconds:.1f} ms per pass)")
    return (f"every MGRIT setting tried is slower than {what} "
            f"({1e3 * base.seconds:.1f} ms per pass)")


def choose(table: list[Measurement], ranks: int, unit: str = "pass",
           exact_untimed: Optional[str] = None) -> tuple[Measurement, str]:
    """The fastest measurement within the bound (ties: the earlier one), and why
    (`unit`: what the table's times are of, a pass or a training step;
    `exact_untimed`: why exact propagation is not in the table, where it is not and
    the budget is not why).

    A pure function of the table: the same table gives the same choice everywhere.
    """
    rep = min((m for m in table if m.candidate.replicated), default=None,
              key=lambda m: (m.seconds, table.index(m)))
    exact = next((m for m in table if m.candidate.exact and not m.candidate.replicated), rep)
    if exact is None:
        raise RuntimeError("the table holds no exact setting")
    ok = [m for m in table if m.within]
    best = min(ok, key=lambda m: (m.seconds, table.index(m)))
    what = "serial autograd" if ranks == 1 else "exact propagation"
    if best is rep:
        vs = (f"exact propagation not timed "
              f"({exact_untimed or 'the budget had no room for it'})" if exact is rep else
              f"against {1e3 * exact.seconds:.1f} ms for exact propagation")
        share = (" on its share of the batch's rows (one all-reduce sums the gradients)"
                 if rep.candidate.split else "")
        why = (f"every rank runs the whole net serially{share} (plain autograd, its own "
               f"layers' parameters, the others' refreshed from their owners): "
               f"{1e3 * rep.seconds:.1f} ms per {unit}, {vs}; "
               + _why_no_mgrit(table, rep, "replicated serial", ranks))
        return best, why
    if best is exact:
        why = _why_no_mgrit(table, exact, what, ranks)
        if ranks > 1 and rep is None:
            why += ("; at one rank exact propagation is plain serial autograd, without "
                    "messages: run this net on one rank")
        elif rep is not None:
            why += (f"; replicated serial took {1e3 * rep.seconds:.1f} ms per pass")
        return best, why
    base = exact if rep is None or exact.seconds <= rep.seconds else rep
    base_name = what if base is exact else "replicated serial"
    return best, (f"fastest within the bound: {1e3 * best.seconds:.1f} ms per pass, "
                  f"{base.seconds / best.seconds:.2f}x {base_name} "
                  f"({1e3 * base.seconds:.1f} ms), gradient error {best.rel_error:.3g}, "
                  f"cosine {best.cosine:.5f}")


def _structures(model: LayerParallel) -> list[tuple[int, int]]:
    """`STRUCTURES` that give the segments the levels they ask for (a structure whose
    levels collapse into another's, on the shortest segment, is left out), in the
    order `order_structures` gives at the model's rank count."""
    n = min(sp.n_steps for sp in model.plan.segments)
    seen, out = set(), []
    for levels, cf in STRUCTURES:
        got = len(build_levels(n, MGRITOptions(max_levels=levels, cfactor=cf)))
        if got == levels and (levels, cf) not in seen:
            seen.add((levels, cf))
            out.append((levels, cf))
    return order_structures(out, n, model.size)


def order_structures(structures: list[tuple[int, int]], n_steps: int, ranks: int
                     ) -> list[tuple[int, int]]:
    """`structures` (levels, cfactor) with those whose coarsest grid is longer than
    twice a rank's share of the fine steps moved last (otherwise in their order).

    The coarsest level is solved sequentially across the ranks, so where it has more
    steps than a rank's fine work, it, not the parallel work, sets the pass's time:
    on the 16-core machine (dense 1,024 x 32, docs/tta/cpu-16core), L2 cf4 (a coarse
    grid of 256 steps against 64 fine steps per rank) ran 85.9 ms per pass, against
    26.8 ms for a batch of L3 cf4 (docs/studies/cpu-16core); tried first, it spent
    the tuning's budget before any other structure was timed.  At 2 ranks (512 fine
    steps per rank) no structure of `STRUCTURES` moves."""
    share = n_steps / max(ranks, 1)

    def sequential(lc: tuple[int, int]) -> bool:
        levels, cf = lc
        return n_steps / cf ** (levels - 1) > 2 * share

    return sorted(structures, key=sequential)  # (stable: False first, in their order)


def _average_possible(model: LayerParallel) -> bool:
    """Whether "average" coarsening is a candidate: the model's own is injection, and
    the blocks of each segment have the same parameters (names and shapes, what
    `coarse_block` averages over)."""
    if model.coarsening != "injection":
        return False
    for _, seg in model.whole_net.segments:
        first = [(n, p.shape) for n, p in seg.blocks[0].named_parameters()]
        if not first or any([(n, p.shape) for n, p in blk.named_parameters()] != first
                            for blk in seg.blocks):
            return False
    return True


class _Runnable(Protocol):
    """What `_time_passes` runs: a net called on a batch that has parameters (a
    `LayerParallel`, the net itself, or a `ReplicatedSerial`)."""

    def __call__(self, x: Tensor) -> Tensor: ...

    def parameters(self) -> Iterable[Tensor]: ...


def _params(m: _Runnable) -> list[Tensor]:
    return [p for p in m.parameters() if p.requires_grad]


#: the MGRIT ladder's first round ends after this many structures in a row, each at
#: least `SLOWER` x the time to beat at its fewest iterations: `STRUCTURES` come most
#: coarsening first, and a structure that coarsens less ran a slower pass in every
#: tuning measured (dense and pre-norm MNIST-1D nets, the conv ResNet, a user's block
#: of two convolutions, at 2 ranks).  Two in a row, clearly slower, and only once a
#: setting within the bound was found, so that a disturbed timing does not end it: on
#: the two-convolution net (256 layers, 8 channels) L3 cf8, the first MGRIT candidate,
#: was timed at 129 and 154 ms in two tunings of seven (96-108 ms in the others),
#: against the batch split's 123-124 ms; counting those, the round ended there and the
#: batch split was chosen
SLOWER_STRUCTURES = 2
#: seconds a tuning may take (`tune`'s `limit`): a number, or a function of the
#: fastest seconds per pass found so far (a caller's budget counted in steps of the
#: fastest way of training), or None: no cap
Limit = Union[float, Callable[[float], float], None]

#: a setting with the next iteration counts of `ITERATIONS` takes at least this many
#: times the pass of the one before: one no faster than the best found then is not
#: timed (one more iteration took 1.6-2.0x the pass in every tuning measured: dense,
#: pre-norm and conv MNIST-1D nets at 2 ranks; a lower bound, with room)
ITERATION_GROWTH = 1.25


def _time_passes(model: LayerParallel, m: _Runnable, x: Tensor, y: Any,
                 loss_fn: Callable[[Tensor, Any], Tensor], repeats: int,
                 bound: float = float("inf"), warm: bool = False,
                 untimed_out: Optional[list[float]] = None) -> float:
    """Fewest seconds of a forward and backward pass (`torch.autograd.grad`: no
    `.grad` is written), the slowest rank's, on every rank, timed by
    `timing.gauged_seconds` against `bound` (one untimed pass first, none if `m` is
    `warm`: it ran passes of this batch's shape already; its seconds appended to
    `untimed_out` where given)."""
    params = _params(m)
    xi = x if params else x.detach().clone().requires_grad_()
    inputs = params or [xi]

    def one_pass() -> None:
        with torch.enable_grad():
            loss = loss_fn(m(xi), y)
            torch.autograd.grad(loss, inputs, allow_unused=True)

    return gauged_seconds(one_pass, model.transport, repeats, bound, warm, x.is_cuda,
                          "the auto-tuning's timings", untimed_out=untimed_out)


def _within(check: GradientCheck, policy: AccuracyPolicy) -> bool:
    return check.cosine >= policy.min_cosine and check.param_grad_error <= \
        policy.max_rel_error


def gradient_noise(model: LayerParallel, x: Tensor, y: Any,
                   loss_fn: Callable[[Tensor, Any], Tensor]) -> Optional[float]:
    """The relative sampling error of this batch's gradient, measured (collective).

    The exact gradients g1, g2 of the batch's two halves (exact propagation, this
    model's trainable parameters on all ranks) differ by twice the noise of a half
    batch's mean; the full batch's gradient (g1 + g2) / 2 carries half of that
    difference's noise in norm, so ``|g1 - g2| / |g1 + g2|`` estimates its error
    relative to its own size, whatever the loss's scaling (mean or sum).  None where
    it cannot be measured: fewer than 2 samples, targets that are not a tensor with
    one row per sample, no trainable parameter.  Identical on every rank (norms
    summed in rank order); the random generators, buffers and last solve statistics
    are put back, no `.grad` is written.
    """
    n = x.shape[0] if x.dim() else 0
    params = _params(model)
    ok = n >= 2 and isinstance(y, Tensor) and y.dim() >= 1 and y.shape[0] == n
    if not model.transport.allgather_object(ok and bool(params), "the noise estimate")[0]:
        return None
    h = n // 2
    grads = []
    with _Restore(model) as restore:
        for sl in (slice(0, h), slice(h, 2 * h)):
            restore.rng()
            restore.buffers()
            with torch.enable_grad(), model.exact():
                loss = loss_fn(model(x[sl]), y[sl])
                # None for a parameter the loss does not use (allow_unused)
                got: tuple[Optional[Tensor], ...] = torch.autograd.grad(
                    loss, params, allow_unused=True)
            grads.append([torch.zeros_like(p) if g is None else g for p, g in
                          zip(params, got)])
    d2 = sum(_sq(a.double() - b.double()) for a, b in zip(*grads))
    s2 = sum(_sq(a.double() + b.double()) for a, b in zip(*grads))
    norms = model.transport.allgather_object((d2, s2), "the noise estimate's norms")
    d2, s2 = sum(g[0] for g in norms), sum(g[1] for g in norms)
    if not (s2 > 0 and math.isfinite(d2) and math.isfinite(s2)):
        return None
    return math.sqrt(d2 / s2)


def _build(model: LayerParallel, cand: Candidate, policy: Optional[AccuracyPolicy]
           ) -> LayerParallel:
    """The model with the candidate's settings (collective): same ranks, same
    parameter tensors."""
    fwd, bwd = cand.options()
    extra: dict[str, Any] = {} if cand.coarsening is None else {"coarsening": cand.coarsening}
    twin = model.like(options=fwd, backward_options=bwd, accuracy=policy,
                      batched=cand.batched, **extra)
    twin.train(model.training)
    return twin


def _serial_alone(model: LayerParallel) -> bool:
    """Whether serial autograd here is the net run alone: one rank, and no data
    replicas (whose gradients are averaged inside the layer-parallel pass)."""
    return model.size == 1 and not model.averages_replicas


def plain_serial(model: LayerParallel, chosen: Any) -> Optional[ODENet]:
    """The net the training passes run directly where the choice at one rank is serial
    autograd (`chosen`: exact both ways, no controller), else None.

    Why not `chosen` itself: at one rank its passes (direct mode) are the same serial
    autograd through the same modules, but go through the layer-parallel machinery
    on the way (the engine's sequential solve, the finiteness checks, the pass's
    bookkeeping): about 0.15 ms a pass, 4 % of a digits step, which left ``--auto``
    at 1.10-1.15x serial's time to target there (``layerpar.bench tta --np 1``).  `chosen`
    stays the setting (a CUDA graph captures it: `AutoCapturedStep`); its reported
    solves are one level, one iteration, as a direct pass reports them."""
    from ..mgrit.result import MGRITResult

    if not _serial_alone(model) or not isinstance(chosen, type(model)) \
            or chosen.accuracy is not None or chosen.options.max_levels != 1 \
            or chosen.backward_options.max_levels != 1:
        return None
    net = model.whole_net
    one = [MGRITResult(iterations=1, converged=True, n_levels=1, timings={}, _history=[])
           for _ in net.segments]
    chosen.last_forward, chosen.last_backward = one, list(one)
    return net


def _drop(twin: Optional[LayerParallel]) -> None:
    """Close a candidate (collective)."""
    if twin is not None:
        twin.close()


#: the share of the expected training time (steps x an exact pass) the tuning may take
BUDGET = 0.05
#: the passes a new MGRIT candidate outside the bound runs (its untimed one, one timed,
#: its check's): what the budget expects the next candidate to cost (`_Tuning.ahead`)
PASSES_AHEAD = 3
#: seconds that setting up exact propagation and its first pass take beyond the passes
#: themselves (~0.5 s on an 8-layer net, 2-core CPU, 2 ranks, measured building a
#: separate exact model; exact mode reuses the model, so this is an upper bound); exact
#: propagation is timed only where the budget has room for this and its passes
EXACT_SETUP = 0.5


def tune(model: LayerParallel, x: Tensor, y: Any, loss_fn: Callable[[Tensor, Any], Tensor],
         policy: AccuracyPolicy, repeats: int = 3, batch: int = 0,
         steps: Optional[int] = None,
         known: Optional[dict[Candidate, float]] = None,
         built: Optional[dict[Candidate, ReplicatedSerial]] = None,
         step_seconds: Optional[float] = None, to_beat: Optional[float] = None,
         limit: Limit = None, checked: Optional[Checked] = None,
         serial_floor: Optional[float] = None) -> TuneResult:
    """Measure the candidates on one batch and choose (collective; every rank passes
    the same `x`, `y`).  See the module docstring.  Nothing the training sees
    changes (gradients by `torch.autograd.grad`, the random generator put back).

    steps: the training steps to come, if known: then no new candidate is measured
    once the tuning has taken `BUDGET` of their expected time (steps x the fastest
    exact pass; the slowest rank's clock), so a small or short training is not
    swamped by it.  Exact propagation and replicated serial are always timed.

    known: pass times measured by an earlier tuning of this model on batches of this
    shape (identical on every rank).  A pass's time depends on the machine and the
    net's shape, not on its weights, so a re-tuning reuses them and measures only
    what training changed, the gradient errors.

    built: replicated settings already built on this model (`AutoTuner`'s trial ran
    them): timed instead of new ones; the tuning closes those it does not keep.

    step_seconds: a training step's measured time (the online trial's): the budget
    counts steps of that length (a pass where it is longer), and exact propagation is
    timed whatever the budget says (the trial's step found room for it: counted in
    passes, shorter than steps, this budget would not always agree).

    to_beat: seconds per pass of a way of training outside layer-parallel training
    that a caller choosing between methods has timed already (`choose_method`): an
    MGRIT candidate no faster is not checked (its gradient error is not measured).
    limit: seconds the tuning may take at most (the caller's share left); it stops
    timing new candidates then, as at its own budget.  A function of the fastest
    seconds per pass found so far (`to_beat`, or faster here) is evaluated as the
    tuning goes: a caller whose budget is a share of the training at its fastest
    way sees it shrink when this tuning finds a faster one (`choose_method`: on the
    1,024-layer dense net the tuning went on timing MGRIT settings for 1.7 s after
    finding one twice as fast as solo, against a budget counted at solo's step).

    checked: what a gradient check measured on this batch (`x`, `y`, the same objects)
    at these parameter values: its bound, exact pass and the running setting's error
    are taken, not measured again (`Checked`).

    serial_floor: seconds of the serial net's forward and backward on this batch at
    the ranks' thread count, where a caller timed it (`choose_method`'s solo).  Exact
    propagation runs the layers one after another, so its pass takes at least that;
    where that is at least `timing.SLOWER` x the time to beat (replicated serial's,
    or `to_beat`), exact propagation cannot be chosen and is timed only once a
    gradient check needs the batch's exact pass, its time then pricing the checks
    (on the MNIST-1D conv ResNet, 2 ranks, where the batch split's 123 ms beat every
    setting, its timing took 0.4 s of a 4 s choice for a pass of 200 ms).

    The buffers (batch-norm running statistics and their counts), the random generators
    and the model's last solve statistics are put back afterwards: the candidates'
    passes are measurements, not training (they updated a batch norm's statistics four
    times per candidate, so an evaluation after an auto-tuned training differed from
    serial's)."""
    with _Restore(model), frozen_heap():
        return _tune(model, x, y, loss_fn, policy, repeats, batch, steps, known, built,
                     step_seconds, to_beat, limit, checked, serial_floor)


class _Tuning:
    """One run of `tune`: its state (the table so far, the time to beat, the budget,
    the bound) and its steps, in the order `_tune` takes them: the exact settings
    (`time_exact`), the MGRIT ladder (`ladder`), then the choice (`result`)."""

    def __init__(self, model: LayerParallel, x: Tensor, y: Any,
                 loss_fn: Callable[[Tensor, Any], Tensor], policy: AccuracyPolicy,
                 repeats: int, batch: int, steps: Optional[int],
                 known: Optional[dict[Candidate, float]],
                 built: Optional[dict[Candidate, ReplicatedSerial]],
                 step_seconds: Optional[float], to_beat: Optional[float] = None,
                 limit: Limit = None, checked: Optional[Checked] = None,
                 serial_floor: Optional[float] = None) -> None:
        self.t_start = time.perf_counter()
        #: the serial step at the ranks' thread count, where a caller timed it: what
        #: exact propagation's pass takes at least (`time_exact`)
        self.serial_floor = serial_floor
        #: why exact propagation is not timed yet, where its timing waits for the
        #: first gradient check (`time_exact`), else None
        self.exact_untimed: Optional[str] = None
        #: a time per pass found outside layer-parallel training (a caller choosing
        #: between methods), which an MGRIT candidate must beat to be checked
        self.to_beat = math.inf if to_beat is None else to_beat
        #: seconds the whole tuning may take at most (the caller's share left), or
        #: that as a function of the fastest seconds per pass found so far
        self.cap = limit
        self.model, self.x, self.y, self.loss_fn = model, x, y, loss_fn
        self.policy, self.repeats, self.batch, self.steps = policy, repeats, batch, steps
        self.built = {} if built is None else built
        self.known = {} if known is None else known
        self.step_seconds = step_seconds
        self.reused = 0
        self.kept: dict[Candidate, ReplicatedSerial] = {}  # timed, warm: the chosen one is used
        self.ranks = model.size
        self.rng = random_state(model)  # (put back before each check)
        self.table: list[Measurement] = []
        self.best_t = math.inf  # the time to beat
        self.limit: Optional[float] = None
        self.unit = math.nan  # what the budget counts a training step as (`per_step`)
        self.best: Optional[Candidate] = None
        self.stopped = False
        self.skipped = 0  # MGRIT structures left untimed as slower (`ladder`)
        self.bound: Optional[AccuracyPolicy] = None if policy.noise_fraction is not None \
            else policy
        self.noise: Optional[float] = None
        self.note = "" if self.bound is None else given_note(policy)
        self.exact: list[ExactReference] = []  # the batch's exact pass, run for the first check
        self.checked = checked
        if checked is not None:  # (what a check measured on this batch: `Checked`)
            self.exact.append(checked.exact)
            if checked.bound is not None:
                self.bound, self.noise, self.note = checked.bound, checked.noise, checked.note

    def per_step(self) -> float:
        """What the budget counts a training step as: the time to beat (the fastest
        exact setting's pass), or the trial's measured step where that is longer."""
        return max(self.best_t, self.step_seconds or 0.0)

    def replicated(self, cand: Candidate) -> float:
        """A replicated setting's pass time (refresh included): known, or timed on a
        new instance against the time to beat (a slower one is cut short, as an MGRIT
        candidate is), kept warm for `AutoTuner.tune` to run if it is chosen."""
        if cand in self.known:
            self.reused += 1
            t = self.known[cand]
        else:
            rep = self.built.pop(cand, None)
            warm = rep is not None  # (it trained steps of this shape: no warm-up pass)
            rep = rep or ReplicatedSerial(self.model, split=cand.split)
            rep.training = self.model.training
            try:
                t = _time_passes(self.model, rep, self.x, self.y, self.loss_fn, self.repeats,
                                 min(self.best_t, self.to_beat), warm=warm)
            except BaseException:
                rep.close()
                raise
            self.kept[cand] = rep
        self.table.append(Measurement(cand, t, 0.0, 1.0, True))
        return t

    def over(self, ahead: float = 0.0) -> bool:
        """Whether the budget is spent (or would be, after `ahead` more seconds)."""
        limit = self._capped(self.limit)
        if limit is None:
            return False
        spent = time.perf_counter() - self.t_start + ahead
        return max(self.model.transport.allgather_object(spent, "the auto-tuning's clock")) \
            > limit

    def time_exact(self) -> None:
        """Replicated serial (with the batch split where it can) and exact propagation
        timed: the time to beat, and the budget counted from it."""
        model, x, repeats, known, steps = self.model, self.x, self.repeats, self.known, \
            self.steps
        if supported(model) is None:  # replicated serial
            self.best_t = self.replicated(Candidate(1, replicated=True))
            self.unit = self.per_step()
            self.limit = None if steps is None else BUDGET * self.unit * steps
        split = Candidate(1, replicated=True, split=True)  # rows shared over the ranks
        if split_supported(model, x) is None and x.shape[0] >= self.ranks and (
                split in known or not self.over((repeats + 1) * self.best_t)):
            self.best_t = min(self.best_t, self.replicated(split))
        if self.step_seconds is None and Candidate(1) not in known and self.table and \
                self.over(EXACT_SETUP + (repeats + 1) * self.best_t):
            # a small net: the budget has no room for exact propagation (where a
            # replicated setting was timed: the choice needs one exact setting)
            self.stopped = True
            return
        floor, beat = self.serial_floor, min(self.best_t, self.to_beat)
        if floor is not None and Candidate(1) not in known and self.table and \
                not _serial_alone(model) and floor >= SLOWER * beat:
            # exact propagation runs the layers one after another: no faster than the
            # serial step, clearly slower than the time to beat; it is timed only
            # where a gradient check needs the batch's exact pass (`measure`)
            self.exact_untimed = (f"its pass, the layers one after another, takes at "
                                  f"least the serial step, {1e3 * floor:.1f} ms, against "
                                  f"{1e3 * beat:.1f} ms to beat")
            return
        self.time_exact_propagation()

    def time_exact_propagation(self) -> None:
        """Exact propagation's pass timed (or known): a candidate, and what a gradient
        check's exact pass costs; the budget counted from the fastest exact setting."""
        model, x, repeats, known, steps = self.model, self.x, self.repeats, self.known, \
            self.steps
        self.exact_untimed = None
        if Candidate(1) in known:
            t_exact = known[Candidate(1)]
            self.reused += 1
        elif _serial_alone(model):  # serial autograd: the net itself, as it will run
            t_exact = _time_passes(model, model.whole_net, x, self.y, self.loss_fn, repeats)
        else:
            # against the time to beat (the replicated settings', a caller's): slower,
            # its time serves only as a gradient check's cost, which one pass tells
            with model.exact():  # exact propagation on the model itself
                t_exact = _time_passes(model, model, x, self.y, self.loss_fn, repeats,
                                       min(self.best_t, self.to_beat))
        self.table.insert(0, Measurement(Candidate(1), t_exact, 0.0, 1.0, True))
        self.best_t = min(self.best_t, t_exact)
        if steps is not None:
            self.unit = self.per_step()
            self.limit = BUDGET * self.unit * steps

    def _capped(self, limit: Optional[float]) -> Optional[float]:
        """`limit`, at most the caller's cap now: a cap given as a function of the
        fastest pass is evaluated at the fastest found so far (here or the caller's
        `to_beat`), so a faster setting found here shrinks a budget counted in its
        steps."""
        cap = self.cap
        if callable(cap):
            cap = cap(min(self.best_t, self.to_beat))
        if cap is None:
            return limit
        return cap if limit is None else min(limit, cap)

    def held_to(self) -> AccuracyPolicy:
        """The bound, measured on this batch the first time a candidate needs it."""
        if self.bound is not None:
            return self.bound
        policy = self.policy
        self.rng.restore()
        self.noise = noise = gradient_noise(self.model, self.x, self.y, self.loss_fn)
        if noise is None:
            self.bound = replace(policy, noise_fraction=None)
            why = ("no targets (tuned on a forward pass whose backward never came, "
                   "with a surrogate loss: call tune(x, y, loss_fn) to tune on the "
                   "training's own)"
                   if self.y is NO_TARGETS else
                   "the gradient noise could not be measured on this batch")
            self.note = (f"{why}, so the default: relative error <= "
                         f"{self.bound.max_rel_error:g}, cosine >= {self.bound.min_cosine:g}")
        else:
            if policy.noise_fraction is None:
                raise RuntimeError("a measured bound needs the policy's `noise_fraction` set")
            self.bound = policy.measured(noise, NOISE_CAP)
            self.note = "measured: " + measured_note(policy.noise_fraction, noise,
                                                     self.bound)
        return self.bound

    def measure(self, cand: Candidate) -> Measurement:
        """An MGRIT candidate's pass time and, where it beats the best found, its
        gradient error against the batch's exact pass.

        A new candidate is timed on one pass first (after its untimed one); where
        that beats the best found, its gradient is checked before more passes are
        timed: one outside the bound keeps that pass's time (it only orders the
        ladder's next steps), so only a candidate that may be chosen is timed on
        the fewest of `repeats` passes (on the pre-norm MNIST-1D net, where no
        structure was within the bound, that saved one or two passes of four or
        five per candidate)."""
        model, x, y, loss_fn = self.model, self.x, self.y, self.loss_fn
        beat = min(self.best_t, self.to_beat)
        t = self.known.get(cand)
        if t is not None:
            self.reused += 1
            if t >= beat:
                return Measurement(cand, t)
        if self.checked is not None and cand == self.checked.candidate:
            # the running setting, checked on this batch just now: its error is known
            check = self.checked.check
            t = check.inexact_seconds if t is None else t
            if t >= beat:
                return Measurement(cand, t)
            return Measurement(cand, t, check.param_grad_error, check.cosine,
                               _within(check, self.held_to()))
        twin = _build(model, cand, None)
        try:
            more = 0  # timed passes still to run where the check finds it within
            if t is None:
                untimed: list[float] = []
                t = _time_passes(model, twin, x, y, loss_fn, 1, beat, untimed_out=untimed)
                more = self.repeats - 1
                if beat <= t and more and not (
                        t > SLOWER * beat and untimed and untimed[0] > SLOWER * beat):
                    # perhaps a disturbed pass: as many as usual (as `gauged_seconds`
                    # times them, a pass clearly slower after an untimed one as slow
                    # is not timed again: on the conv ResNet the structures 1.3-1.4x the
                    # batch split's pass were timed a second time, 0.2 s each)
                    t = min(t, _time_passes(model, twin, x, y, loss_fn, more, beat,
                                            warm=True))
                    more = 0
            if t >= beat:
                return Measurement(cand, t)
            limit_ = self.held_to()
            if self.exact_untimed is not None:  # (what the checks will cost)
                self.time_exact_propagation()
            self.rng.restore()
            if not self.exact:
                self.exact.append(exact_reference(model, x, y, loss_fn))
            check = check_gradients(twin, x, y, loss_fn, reference=self.exact[0])
            within = _within(check, limit_)
            if within and more:
                t = min(t, _time_passes(model, twin, x, y, loss_fn, more, beat, warm=True))
            return Measurement(cand, t, check.param_grad_error, check.cosine, within)
        finally:
            _drop(twin)

    def ahead(self, cand: Candidate, per_pass: float) -> float:
        """What measuring `cand` will cost, about: a check's pass where its time is
        known, else `PASSES_AHEAD` passes of `per_pass` seconds (a guess: the time to
        beat, or the time predicted), so that the budget is a cap the tuning stops
        short of, not a line its last candidate crosses."""
        known = self.known.get(cand)
        return known if known is not None else PASSES_AHEAD * per_pass

    def _found(self, m: Measurement) -> None:
        self.best, self.best_t = m.candidate, m.seconds

    def ladder(self) -> None:
        """The MGRIT candidates: every structure at the first iteration counts (the
        first within the bound is the best found; after it, `SLOWER_STRUCTURES` in a
        row at least `SLOWER` x the time to beat end the round); then more iterations on the
        structures outside the bound, fastest first, while their time predicted
        (the counts before times the least ratio timed on another structure this
        round, at least `ITERATION_GROWTH`) may beat the best found (the first within
        the bound ends a structure's ladder); then "average" coarsening on the structures
        outside the bound at the first counts, fastest first, until one is no more
        accurate averaged; then the best with per-step cycles.
        Breadth first: a structure's more iterations cost a new timing, its first
        counts in a re-tuning only a gradient check (their time is known), so a
        re-tuning on a short budget checks every structure's cheapest setting before
        it times a dearer one."""
        missed: list[Measurement] = []  # first iteration counts timed, outside the bound
        structures = _structures(self.model)
        known = self.known
        # a re-tuning: the structures whose pass time is known, fastest first, so that
        # the first within the bound ends the search (every later one is slower, dropped
        # without a check); those the first tuning left untimed (slower) after them
        structures.sort(key=lambda lc: (Candidate(*lc) not in known,
                                        known.get(Candidate(*lc), 0.0)))
        slower = 0  # structures in a row no faster than the time to beat at their first counts
        for levels, cf in structures:
            if self.stopped:
                break
            if slower == SLOWER_STRUCTURES:
                # they come most coarsening first, so those left coarsen less: slower
                self.skipped = len(structures) - structures.index((levels, cf))
                break
            beat = min(self.best_t, self.to_beat)
            if self.over(self.ahead(Candidate(levels, cf, *ITERATIONS[0]), beat)):
                self.stopped = True
                break
            m = self.measure(Candidate(levels, cf, *ITERATIONS[0]))
            self.table.append(m)
            # clearly slower than a setting found within the bound only: the first MGRIT
            # candidate's pass (the most coarsening structure's) was sometimes timed far
            # too slow, and before any is found nothing measured says the others are slower
            slower = slower + 1 if self.best is not None and m.rel_error is None and \
                m.seconds >= SLOWER * beat else 0
            if m.within:
                self._found(m)
            elif m.rel_error is not None:
                missed.append(m)
        # what the next iteration counts cost over the ones before, as timed on some
        # structure in this round: the least of those ratios (at least
        # `ITERATION_GROWTH`) predicts the others', so that a structure whose more
        # iterations another structure's timing says are slower is not timed
        growth: dict[tuple[int, int], float] = {}
        for first in sorted(missed, key=lambda m: m.seconds):
            t = first.seconds
            for fi, bi in ITERATIONS[1:]:
                before = t
                t *= max(ITERATION_GROWTH, growth.get((fi, bi), 0.0))
                if self.stopped or max(fi, bi) > self.policy.max_iters or \
                        t >= min(self.best_t, self.to_beat):
                    break
                cand = replace(first.candidate, fwd_iters=fi, bwd_iters=bi)
                if self.over(self.ahead(cand, t)):
                    self.stopped = True
                    break
                m = self.measure(cand)
                self.table.append(m)
                ratio = m.seconds / before
                growth[fi, bi] = min(growth.get((fi, bi), ratio), ratio)
                if m.rel_error is None:  # slower than what we have: more iterations won't help
                    break
                t = m.seconds
                if m.within:
                    self._found(m)
                    break
        if _average_possible(self.model):
            # structures timed at the first counts but outside the bound, with averaged
            # coarse levels (a few % more per pass; sometimes far more accurate,
            # sometimes far less): after the ladder, so that they never take its budget,
            # and only where they may beat the best found (their time is that of
            # injection's + 10 %).  Whether averaging helps is the net's, at its
            # weights now, not a structure's: where the first structure tried is no
            # more accurate averaged, the others are not tried (in every tuning
            # measured, averaging was better on all structures or worse on all: the
            # dense 1,024-layer net better at initialisation and worse after training,
            # the pre-norm MNIST-1D net better on one batch and worse on another, the
            # conv ResNet worse)
            for m in sorted(missed, key=lambda m: m.seconds):
                if self.stopped or m.seconds * 1.1 >= self.best_t:
                    break
                cand = replace(m.candidate, coarsening="average")
                if self.over(self.ahead(cand, 1.1 * m.seconds)):
                    self.stopped = True
                    break
                got = self.measure(cand)
                self.table.append(got)
                if got.within:
                    self._found(got)
                    break
                if got.rel_error is not None and m.rel_error is not None and \
                        got.rel_error >= m.rel_error:
                    break
        if self.best is not None and not (self.stopped or self.over()):
            # the same with per-step cycles
            self.table.append(self.measure(replace(self.best, batched=False)))

    def result(self, loss_note: str) -> TuneResult:
        """The choice from the table, and what the tuning measured (collective)."""
        self.rng.restore()
        for rep in self.built.values():  # (built, not timed: not kept)
            rep.close()
        choice, reason = choose(self.table, self.ranks, exact_untimed=self.exact_untimed)
        if self.skipped:
            reason += (f" ({self.skipped} structure(s) coarsening less not timed: the "
                       f"{SLOWER_STRUCTURES} before them took at least {SLOWER:g} x "
                       f"{1e3 * min(self.best_t, self.to_beat):.1f} ms at their fewest "
                       "iterations)")
        if self.stopped:
            reason += (f" (tuning stopped after {len(self.table)} candidates: it may take "
                       f"{100 * BUDGET:g}% of the expected training time, {self.steps} "
                       f"steps x {1e3 * self.unit:.1f} ms)")
        spent = time.perf_counter() - self.t_start
        spent = max(self.model.transport.allgather_object(spent, "the auto-tuning's duration"))
        note = self.note
        if self.bound is None:
            note = (f"to be measured ({self.policy.noise_fraction:g} x the batch's gradient "
                    "noise); no MGRIT candidate needed it")
        return TuneResult(self.table, choice, reason, spent, self.ranks, self.batch,
                          self.noise, self.bound, loss_note + note, self.reused,
                          kept=self.kept)


def _tune(model: LayerParallel, x: Tensor, y: Any, loss_fn: Callable[[Tensor, Any], Tensor],
          policy: AccuracyPolicy, repeats: int, batch: int, steps: Optional[int],
          known: Optional[dict[Candidate, float]],
          built: Optional[dict[Candidate, ReplicatedSerial]],
          step_seconds: Optional[float] = None, to_beat: Optional[float] = None,
          limit: Limit = None, checked: Optional[Checked] = None,
          serial_floor: Optional[float] = None) -> TuneResult:
    run = _Tuning(model, x, y, loss_fn, policy, repeats, batch, steps, known, built,
                  step_seconds, to_beat, limit, checked, serial_floor)
    run.time_exact()
    # (no tune() call: the first training pass's backward revealed the loss)
    loss_note = ("the gradients are the training loss's to first order, from its "
                 "gradient at the first training pass's output (tuned at its backward; "
                 "the first gradient check, due at once, holds the choice to the bound "
                 "on the loss itself, and tunes again where it is outside); "
                 if loss_fn is _output_gradient_loss else "")
    run.ladder()
    return run.result(loss_note)


class _NoTargets:
    """The targets of a tuning on a forward pass, which knows none: what the checks
    pass to `_surrogate_loss`, which ignores them (not None, which the checks refuse,
    and not a tensor, so no noise is estimated from them)."""

    def __repr__(self) -> str:
        return "NO_TARGETS"


#: the targets `AutoTuner.forward` tunes with (see `_NoTargets`)
NO_TARGETS = _NoTargets()


def _output_gradient_loss(out: Tensor, grad: Tensor) -> Tensor:
    """The training's loss as its first backward revealed it: ``(out * grad).sum()``,
    `grad` the loss's gradient at the first training pass's output, so that the
    tuning's gradients are the loss's own to first order (exactly, at the exact
    output and the parameters of that pass).  One row per sample, as the loss's, so
    the gradient noise of the batch can be measured from its halves."""
    return (out * grad).sum()


def _surrogate_loss(out: Tensor, y: Any) -> Tensor:
    """A loss for tuning when the caller gave none: the output's projection on a fixed
    random direction (the same on every rank), so gradients have no special shape.
    `y` is ignored (`NO_TARGETS`)."""
    g = torch.Generator().manual_seed(20)
    w = torch.randn(out.shape[1:], generator=g, dtype=torch.float64).to(out)
    return (out * w).sum() / max(1, out.shape[0])
