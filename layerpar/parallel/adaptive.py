"""Adaptive accuracy: MGRIT iteration counts managed against a bound on gradient error.

`LayerParallel(..., accuracy=AccuracyPolicy())` (or ``accuracy=True``) builds an `Auto`
(`layerpar.parallel.auto`), the policy above the model, which hands the model's forward
and adjoint iteration counts to an `AccuracyController` (`forward_adaptive`):

- **Measured gradient error.**  Each `check_gradients` result (the training loop runs
  one every `check_every` batches; `layerpar train --adaptive` does) is compared with
  the bound: cosine < `min_cosine` or relative error > `max_rel_error` raises the
  iteration count of the solve that is worse off (the forward one when the output's
  own error exceeds half the bound, else the adjoint one); a check with ample room
  (both a quarter of the bound) lowers the larger count by one, never below 1.
- **Stalls and divergence.**  After every inexact forward pass the residual history is
  read: a forward solve whose residual does not shrink (reduction factor per
  iteration >= `stall_factor`) or becomes non-finite switches the model to *exact
  propagation*, and the batch is recomputed exactly (a rate needs two measured
  residuals, see `AccuracyPolicy.stall_factor`): a sequential solve on the same
  ranks and plan (`LayerParallel.exact`, on the same model), with the same parameter
  tensors, so the optimizer and its state carry on unchanged.  The same happens when
  the iteration counts would exceed `max_iters`.
- **Cost.**  A gradient check also times the inexact and the exact pass (the slowest
  rank's); the controller keeps the last `cost_window` timings of each and compares
  their medians, with a margin (`cost_margin`, hysteresis), so one disturbed timing on
  a shared machine decides nothing (`CostWindow`).  Where MGRIT at the current counts
  is, over that window, more than the margin slower than exact propagation and the
  bound needs (or already took) more iterations, the model switches to exact
  propagation: it is then both cheaper and exact.
- **Back to MGRIT.**  While exact, every `probe_every` batches one inexact forward
  pass (no graph) is tried; once its residual shrinks again, MGRIT resumes with the
  iteration counts it had.  A gradient check that finds MGRIT within the bound and,
  over the window, more than the margin cheaper than exact propagation also brings
  it back.

Every decision is taken from values that are identical on every rank (reduced
residual norms, the reduced gradient check), so all ranks decide alike without a
message.  Each change is logged (`controller.log`: batch, what, why).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from .._checks import boolean, finite_in, positive_float, positive_int
from ..defaults import MAX_REL_ERROR, MIN_COSINE
from ..mgrit.errors import DivergenceError
from ..mgrit.options import MGRITOptions

if TYPE_CHECKING:
    from ..mgrit.result import MGRITResult
    from .accuracy import GradientCheck
    from .model import LayerParallel

__all__ = ["AccuracyController", "AccuracyEvent", "AccuracyPolicy", "CostWindow",
           "as_policy"]

#: a check whose error is within 1/`FAR` of the bound (both cosine and relative error)
#: lets the interval between checks grow `FAR_BACKOFF` times past `check_backoff` (when
#: that is above 1): far from its bound an error does not reach it within a few
#: intervals (e.g. the 1,024-layer dense MNIST-1D net at initialisation, 1/1 iterations
#: with "average" coarsening: 0.003 against a bound of 0.2), and each check costs an exact pass
FAR = 16
FAR_BACKOFF = 4


@dataclass(frozen=True)
class AccuracyPolicy:
    """The bound and the knobs of adaptive accuracy (see the module docstring).

    min_cosine: smallest acceptable cosine between inexact and exact gradients.
    max_rel_error: largest acceptable relative error of the full parameter gradient.
    check_every: batches between gradient checks (run by the training loop).
    max_iters: largest forward/adjoint iteration count before switching to exact.
    stall_factor: a forward residual that shrinks by less than this per iteration on
        average ((r_k / r_1)^(1/(k-1)) >= stall_factor) means MGRIT stalls.  Measured
        here (4 forward iterations, one batch, at initialisation): Peaks 0.2, a small
        dense net on [0, 1] 0.03, the same net on [0, 60] with weights x3 0.72.  A
        rate needs two measured residuals: with `skip` (the default) 3 or more
        forward iterations, without it 2 or more; otherwise only non-finite
        residuals and the gradient checks can switch to exact propagation.
    probe_every: batches between tries of MGRIT while propagating exactly (after a
        stall; after a switch for cost, the gradient checks decide).
    prefer_cheaper: switch to exact propagation where the gradient checks find it
        cheaper than MGRIT at the iteration counts the bound needs.
    cost_window: the gradient checks' timings kept for the cost rule (the median of
        the last `cost_window` of MGRIT's and of exact propagation's is compared).
    cost_margin: one of the two must be slower than the other by more than this share
        (medians over the window) for the cost rule to switch: hysteresis, so that
        timings within noise of each other never flip the mode back and forth.
    noise_fraction: with ``options="auto"`` and no explicit bound: the bound is
        measured, not given: a candidate's relative gradient error may be at most
        this fraction of the minibatch gradient noise measured on the batch
        (`layerpar.parallel.autotune.gradient_noise`); `min_cosine` and
        `max_rel_error` are then derived from it (see `AccuracyPolicy.measured`).
        None (default): the bound is `min_cosine` / `max_rel_error` as given.
    check_backoff: each gradient check within the bound doubles the interval between
        checks, up to this many times `check_every` (a check outside the bound
        resets it): a check costs an MGRIT and an exact pass, which every 10 batches
        is a large share of a fast training.  1 (default): every `check_every`.
        Above 1, a check within 1/`FAR` of the bound lets it grow `FAR_BACKOFF` times
        further.
    """

    min_cosine: float = MIN_COSINE
    max_rel_error: float = MAX_REL_ERROR
    check_every: int = 10
    max_iters: int = 8
    stall_factor: float = 0.5
    probe_every: int = 20
    prefer_cheaper: bool = True
    cost_window: int = 5
    cost_margin: float = 0.1
    noise_fraction: Optional[float] = None
    check_backoff: int = 1

    def __post_init__(self) -> None:
        boolean("accuracy.prefer_cheaper", self.prefer_cheaper)
        finite_in("accuracy.min_cosine", self.min_cosine, -1.0, 1.0)
        positive_float("accuracy.max_rel_error", self.max_rel_error)
        positive_int("accuracy.check_every", self.check_every)
        positive_int("accuracy.max_iters", self.max_iters)
        positive_float("accuracy.stall_factor", self.stall_factor)
        positive_int("accuracy.probe_every", self.probe_every)
        positive_int("accuracy.cost_window", self.cost_window)
        positive_int("accuracy.check_backoff", self.check_backoff)
        finite_in("accuracy.cost_margin", self.cost_margin, 0.0)
        if self.noise_fraction is not None:
            positive_float("accuracy.noise_fraction", self.noise_fraction)

    def measured(self, noise: float, cap: float) -> AccuracyPolicy:
        """This policy with the bound measured: relative gradient error at most
        `noise_fraction` x `noise` (the batch gradient's relative sampling error), at
        most `cap`; the cosine bound is the one that relative error implies
        (an error e leaves a cosine of at least sqrt(1 - e^2)), so it adds nothing."""
        if self.noise_fraction is None:
            raise RuntimeError("a measured bound needs `noise_fraction` set")
        err = min(cap, self.noise_fraction * noise)
        err = max(err, 1e-12)
        return replace(self, max_rel_error=err,
                       min_cosine=math.sqrt(max(0.0, 1.0 - err * err)) if err < 1 else 0.0,
                       noise_fraction=None)

    def key(self) -> dict[str, Any]:
        """The fields, for the agreement between ranks."""
        return {f"accuracy.{k}": v for k, v in asdict(self).items()}


def as_policy(accuracy: Any) -> Optional[AccuracyPolicy]:
    """`accuracy` as a policy: None/False (off), True (the default bound) or a policy."""
    if accuracy is None or accuracy is False:
        return None
    if accuracy is True:
        return AccuracyPolicy()
    if isinstance(accuracy, AccuracyPolicy):
        return accuracy
    raise TypeError(f"`accuracy` must be None, a bool or an AccuracyPolicy, got "
                    f"{type(accuracy).__name__}")


@dataclass(frozen=True)
class AccuracyEvent:
    """One decision: at which batch, what changed, and why."""

    batch: int
    action: str
    reason: str

    def __str__(self) -> str:
        return f"batch {self.batch}: {self.action} ({self.reason})"


def _rate(history: list[float]) -> Optional[float]:
    """Mean residual reduction factor per iteration (None with fewer than 2 values);
    inf when a value is not finite."""
    if len(history) < 2:
        return None
    if not all(math.isfinite(v) for v in history):
        return math.inf
    if history[0] <= 0:
        return 0.0
    return (max(history[-1], 0.0) / history[0]) ** (1.0 / (len(history) - 1))


class CostWindow:
    """The last few timed passes of MGRIT and of exact propagation, and the rule that
    compares them: medians over the window and a margin, so no single timing (a
    shared machine disturbs many) flips a decision.

    `verdict()` is "exact" when MGRIT's median exceeds exact propagation's by more
    than `margin` (both with at least `min(3, window)` timings), "mgrit" when exact
    propagation's exceeds MGRIT's by more than `margin`, else None (no evidence
    either way: keep the current mode).
    """

    def __init__(self, window: int = 5, margin: float = 0.1) -> None:
        self.margin = margin
        self.need = min(3, window)
        self.mgrit: deque[float] = deque(maxlen=window)
        self.exact: deque[float] = deque(maxlen=window)

    def add(self, mgrit_seconds: float, exact_seconds: float) -> None:
        for q, v in ((self.mgrit, mgrit_seconds), (self.exact, exact_seconds)):
            if math.isfinite(v) and v > 0:
                q.append(v)

    def medians(self) -> tuple[float, float]:
        """(MGRIT's, exact's) median seconds per pass (NaN where none was timed)."""
        def median(q: deque[float]) -> float:
            return statistics.median(q) if q else math.nan

        return median(self.mgrit), median(self.exact)

    def verdict(self) -> Optional[str]:
        if len(self.mgrit) < self.need or len(self.exact) < self.need:
            return None
        m, e = self.medians()
        if m > (1.0 + self.margin) * e:
            return "exact"
        if e > (1.0 + self.margin) * m:
            return "mgrit"
        return None

    def describe(self) -> str:
        m, e = self.medians()
        return (f"median of the last {len(self.mgrit)}/{len(self.exact)} timed passes: "
                f"MGRIT {1000 * m:.1f} ms vs exact {1000 * e:.1f} ms per pass, margin "
                f"{100 * self.margin:g}%")


@dataclass
class AccuracyController:
    """The state of adaptive accuracy on one model (identical on every rank)."""

    policy: AccuracyPolicy
    fwd_iters: int
    bwd_iters: int
    exact: bool = False
    exact_for_cost: bool = False  # exact because it was cheaper (not for a stall)
    log: list[AccuracyEvent] = field(default_factory=list)
    last_check: Optional[GradientCheck] = None
    _room: int = 0  # consecutive checks with ample room
    costs: Optional[CostWindow] = None  # the cost rule's timings (made from the policy)
    backoff: int = 1  # the interval between checks, in units of check_every
    #: the least interval between checks under MGRIT, in batches (0: none): set by
    #: auto from what a check costs against a pass (`tuner.CHECK_SHARE`)
    min_every: int = 0
    #: the batch `check_due` last said yes to (where the last check ran; 0 before
    #: any): the next is due an interval after it
    checked_at: int = 0

    def __post_init__(self) -> None:
        if self.costs is None:
            self.costs = CostWindow(self.policy.cost_window, self.policy.cost_margin)

    def _event(self, batch: int, action: str, reason: str) -> None:
        self.log.append(AccuracyEvent(batch, action, reason))

    def check_due(self, batch: int) -> bool:
        """Whether the training loop should measure the gradient error at `batch`
        (asked once a batch, the check run where it says yes): `check_every` batches
        after the last check (times `backoff`, see `AccuracyPolicy.check_backoff`, and
        at least `min_every`) under MGRIT, 5 times that while exact (a check then only
        asks whether MGRIT has become usable and cheaper).  Counted from the last
        check, not at the interval's multiples: those came sooner than the interval
        where it had just changed (auto sets `min_every` from each check's timings).
        A `batch` below the last check's (numbering begun again, say each epoch)
        counts from 0."""
        every = self.policy.check_every * (5 if self.exact else self.backoff)
        if not self.exact:
            every = max(every, self.min_every)
        if batch == self.checked_at and batch > 0:
            return True  # (asked again about the batch it said yes to)
        since = batch - self.checked_at if batch >= self.checked_at else batch
        if since < every:
            return False
        self.checked_at = batch
        return True

    def stalled(self, stats: list[MGRITResult]) -> Optional[str]:
        """Why the forward solves of a pass stalled or diverged (None if they did not)."""
        for k, s in enumerate(stats):
            rate = _rate(list(s.residual_history))
            if rate is not None and rate >= self.policy.stall_factor:
                what = "diverged" if rate > 1.0 else "stalled"
                return (f"forward MGRIT of segment {k} {what}: residual reduction "
                        f"{rate:.3g} per iteration >= {self.policy.stall_factor:g}")
        return None

    def to_exact(self, batch: int, reason: str, for_cost: bool = False) -> None:
        if not self.exact:
            self.exact, self.exact_for_cost = True, for_cost
            self._event(batch, "switch to exact propagation", reason)

    def to_mgrit(self, batch: int, reason: str) -> None:
        if self.exact:
            self.exact = False
            self._event(batch, f"back to MGRIT ({self.fwd_iters}/{self.bwd_iters} "
                               "iterations)", reason)

    def observe_check(self, batch: int, check: GradientCheck) -> None:
        """Adjust the iteration counts from a measured gradient error."""
        self.last_check = check
        p = self.policy
        cos, err = check.cos, check.error
        bad = not (cos >= p.min_cosine and err <= p.max_rel_error)
        if self.costs is None:
            raise RuntimeError("the accuracy controller has no cost window (not started)")
        self.costs.add(check.inexact_seconds, check.exact_seconds)
        verdict = self.costs.verdict()  # medians over a window, with a margin
        cost = self.costs.describe()
        if self.exact:  # the check measured MGRIT as it would run now
            # after a switch for cost, only the window brings MGRIT back; after a stall,
            # with no verdict yet, this check's own timings say
            cheaper = verdict == "mgrit" or (not self.exact_for_cost and verdict is None
                                             and check.inexact_seconds < check.exact_seconds)
            if not bad and cheaper and not any(math.isnan(r) for r in (cos, err)):
                self.to_mgrit(batch, f"a gradient check within the bound: cosine "
                                     f"{cos:.4f}, relative error {err:.3g}; {cost}")
            return
        if p.prefer_cheaper and verdict == "exact" and (
                bad or self.fwd_iters + self.bwd_iters > 2):
            # more iterations would only cost more: exact propagation is cheaper and exact
            self.to_exact(batch, f"exact propagation is cheaper here: {cost}",
                          for_cost=True)
            return
        if bad:
            self._room = 0
            self.backoff = 1
            why = (f"cosine {cos:.4f} (bound {p.min_cosine:g}), relative error {err:.3g} "
                   f"(bound {p.max_rel_error:g})")
            fwd_first = check.output_error > p.max_rel_error / 2
            if fwd_first and self.fwd_iters < p.max_iters:
                self.fwd_iters += 1
                self._event(batch, f"forward iterations -> {self.fwd_iters}", why)
            elif self.bwd_iters < p.max_iters:
                self.bwd_iters += 1
                self._event(batch, f"adjoint iterations -> {self.bwd_iters}", why)
            elif self.fwd_iters < p.max_iters:
                self.fwd_iters += 1
                self._event(batch, f"forward iterations -> {self.fwd_iters}", why)
            else:
                self.to_exact(batch, f"{why} at {p.max_iters} iterations")
            return
        ample = 1.0 - cos <= (1.0 - p.min_cosine) / 4 and err <= p.max_rel_error / 4
        self._room = self._room + 1 if ample else 0
        far = 1.0 - cos <= (1.0 - p.min_cosine) / FAR and err <= p.max_rel_error / FAR
        cap = p.check_backoff * (FAR_BACKOFF if far and p.check_backoff > 1 else 1)
        self.backoff = min(2 * self.backoff, cap)
        if self._room >= 2 and max(self.fwd_iters, self.bwd_iters) > 1:
            self._room = 0
            why = f"room: cosine {cos:.4f}, relative error {err:.3g} in two checks"
            if self.fwd_iters >= self.bwd_iters:
                self.fwd_iters -= 1
                self._event(batch, f"forward iterations -> {self.fwd_iters}", why)
            else:
                self.bwd_iters -= 1
                self._event(batch, f"adjoint iterations -> {self.bwd_iters}", why)

    def options(self, fwd: MGRITOptions, bwd: MGRITOptions) -> tuple[MGRITOptions,
                                                                     MGRITOptions]:
        """The model's options with the current iteration counts."""
        return fwd.replace(max_iter=self.fwd_iters), bwd.replace(max_iter=self.bwd_iters)

    def summary(self) -> str:
        mode = "exact" if self.exact else f"MGRIT {self.fwd_iters}/{self.bwd_iters}"
        check = "" if self.last_check is None else \
            f", last check cos {self.last_check.cos:.4f} err " \
            f"{self.last_check.error:.3g}"
        return f"{mode}{check}, {len(self.log)} change(s)"


def apply_iterations(model: LayerParallel, ctl: AccuracyController) -> None:
    """Give the model's segment solves the controller's iteration counts."""
    fwd, bwd = ctl.options(model.options, model.backward_options)
    model.set_iterations(fwd.max_iter, bwd.max_iter)


def forward_adaptive(model: LayerParallel, ctl: AccuracyController, x: Tensor) -> Tensor:
    """A forward pass of `model` under adaptive accuracy: MGRIT with the controller's
    iteration counts, or exact propagation (`LayerParallel.exact`); a pass that stalls
    or diverges is recomputed exactly, in the same batch."""
    batch = model.batch + 1
    if ctl.exact and not ctl.exact_for_cost and batch % ctl.policy.probe_every == 0:
        # after a stall: is MGRIT usable again?
        apply_iterations(model, ctl)
        try:
            with torch.no_grad():
                model(x)
            why = ctl.stalled(model.last_forward)
        except DivergenceError as exc:
            why = str(exc)
        if why is None:
            ctl.to_mgrit(batch, "a probe's forward residual shrinks again")
        else:
            model.batch -= 1  # the probe was not a batch of its own
    if ctl.exact:
        return _forward_exact(model, x)
    apply_iterations(model, ctl)
    try:
        y = model(x)
    except DivergenceError as exc:
        ctl.to_exact(model.batch, str(exc).split(":")[0])
        return _forward_exact(model, x, again=True)
    why = ctl.stalled(model.last_forward)
    if why is not None:
        ctl.to_exact(model.batch, why)
        del y
        return _forward_exact(model, x, again=True)
    return y


def _forward_exact(model: LayerParallel, x: Tensor, again: bool = False) -> Tensor:
    """This batch with exact propagation; `again`: the batch's MGRIT pass was
    dropped, so the batch is not counted twice."""
    if again:
        model.batch -= 1
    with model.exact():
        return model(x)
