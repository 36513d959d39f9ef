"""MGRIT settings chosen by measurement: ``LayerParallel(..., options="auto")``.

How inexact MGRIT's gradients are depends on the network (its stiffness), and how
fast a setting runs depends on the machine, so neither can be fixed in advance.
`tune` measures both on the user's own net and batch, on these ranks:

1. **Exact propagation** (``max_levels=1`` both ways; at one rank this is *direct
   mode*, plain serial autograd through the same modules) is timed first: it is
   within any bound, and the time to beat.
2. **MGRIT candidates**, cheapest first: levels and coarsening factor from
   `STRUCTURES`, each at the iteration counts of `ITERATIONS` (forward/adjoint),
   batched cycles.  A candidate is timed (one untimed pass, then `repeats` passes;
   the fastest of them, the least disturbed by other load, on the slowest rank; a
   first pass above `GIVE_UP` times the time to beat ends it there); if it is no
   faster than the best candidate found so far it is dropped (more iterations
   would only cost more), else its gradient error is measured with
   `check_gradients` against exact propagation.
   The first iteration counts within the bound (`AccuracyPolicy`: cosine and
   relative error of the parameter gradient) end that structure's ladder.
3. The best MGRIT candidate is also timed with per-step (unbatched) cycles.
4. Given the number of training steps to come (``layerpar train`` gives it), the
   tuning stops measuring new candidates once it has taken `BUDGET` (5 %) of their
   expected time (steps x an exact pass), so a small net is not swamped by it.
5. The choice is the fastest candidate within the bound.  Where none of MGRIT's is
   both within the bound and faster than exact propagation, auto picks exact
   propagation (serial autograd at one rank) and says why.

Every rank decides alike: times are the slowest rank's (one small exchange per
candidate) and gradient checks are reduced over ranks, so the table, and the
choice taken from it by `choose`, are identical on every rank.  The table and the
choice are kept in `AutoTuner.results` (and logged by ``layerpar train --auto``).
What tuning costs (`TuneResult.seconds`) happens inside the first training step and
counts in every time a training loop reports.

After tuning, the chosen setting runs as a twin of the model (`LayerParallel.like`:
same ranks, same parameter tensors) under the existing adaptive policy
(`layerpar.parallel.adaptive`), which keeps watching the gradient error.  A gradient
check that finds the error outside the bound tunes again on that batch (at most
`max_retunes` times).  An exact choice has nothing to watch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor

from ..mgrit.grid import build_levels
from ..mgrit.options import MGRITOptions
from .accuracy import GradientCheck, check_gradients
from .adaptive import AccuracyPolicy

if TYPE_CHECKING:
    from .model import LayerParallel

__all__ = ["ITERATIONS", "STRUCTURES", "AutoTuner", "Candidate", "Measurement",
           "TuneResult", "choose", "tune"]

#: (levels, coarsening factor) tried, in this order
STRUCTURES: tuple[tuple[int, int], ...] = ((2, 4), (3, 4), (4, 4), (3, 8), (2, 8))
#: (forward, adjoint) iteration counts tried on each structure, cheapest first
ITERATIONS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (2, 2), (3, 2))


@dataclass(frozen=True)
class Candidate:
    """One setting: levels (1: exact propagation), cfactor, iterations, batched."""

    levels: int
    cfactor: int = 0
    fwd_iters: int = 1
    bwd_iters: int = 1
    batched: bool = True

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
        if self.exact:
            return "serial autograd (direct mode)" if ranks == 1 else "exact propagation"
        return (f"L{self.levels} cf{self.cfactor} {self.fwd_iters}/{self.bwd_iters} "
                f"{'batched' if self.batched else 'per-step'}")


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

    def lines(self) -> list[str]:
        """The candidate table and the choice, as text lines."""
        out = [f"auto: {len(self.table)} candidates measured in {self.seconds:.2f} s "
               f"at {self.ranks} rank(s) (batch {self.batch})",
               f"  {'candidate':34s} {'ms/pass':>9s} {'rel.err':>9s} {'cosine':>9s}  ok"]
        for m in self.table:
            err = "-" if m.rel_error is None else f"{m.rel_error:.3g}"
            cos = "-" if m.cosine is None else f"{m.cosine:.5f}"
            mark = "*" if m is self.choice else ("y" if m.within else "n")
            out.append(f"  {m.candidate.name(self.ranks):34s} {1e3 * m.seconds:9.2f} "
                       f"{err:>9s} {cos:>9s}  {mark}")
        out.append(f"auto: chose {self.choice.candidate.name(self.ranks)}: {self.reason}")
        return out


def choose(table: list[Measurement], ranks: int) -> tuple[Measurement, str]:
    """The fastest measurement within the bound (ties: the earlier one), and why.

    A pure function of the table: the same table gives the same choice everywhere.
    """
    exact = next(m for m in table if m.candidate.exact)
    ok = [m for m in table if m.within]
    best = min(ok, key=lambda m: (m.seconds, table.index(m)))
    what = "serial autograd" if ranks == 1 else "exact propagation"
    if best is exact:
        mgrit_ok = [m for m in ok if not m.candidate.exact]
        if mgrit_ok:
            fast = min(mgrit_ok, key=lambda m: m.seconds)
            why = (f"no MGRIT setting pays here: the fastest within the bound "
                   f"({fast.candidate.name(ranks)}) takes {1e3 * fast.seconds:.1f} ms per "
                   f"pass against {1e3 * exact.seconds:.1f} ms for {what}")
        elif all(m.candidate.exact for m in table):
            why = f"no MGRIT setting was measured, so {what}"
        elif any(m.rel_error is not None for m in table if not m.candidate.exact):
            why = (f"no MGRIT setting tried is within the gradient-error bound, so "
                   f"{what} ({1e3 * exact.seconds:.1f} ms per pass)")
        else:
            why = (f"every MGRIT setting tried is slower than {what} "
                   f"({1e3 * exact.seconds:.1f} ms per pass)")
        if ranks > 1:
            why += ("; at one rank exact propagation is plain serial autograd, without "
                    "messages: run this net on one rank")
        return best, why
    return best, (f"fastest within the bound: {1e3 * best.seconds:.1f} ms per pass, "
                  f"{exact.seconds / best.seconds:.2f}x {what} "
                  f"({1e3 * exact.seconds:.1f} ms), gradient error {best.rel_error:.3g}, "
                  f"cosine {best.cosine:.5f}")


def _structures(model: LayerParallel) -> list[tuple[int, int]]:
    """`STRUCTURES` that give the segments the levels they ask for (a structure whose
    levels collapse into another's, on the shortest segment, is left out)."""
    n = min(sp.n_steps for sp in model.plan.segments)
    seen, out = set(), []
    for levels, cf in STRUCTURES:
        got = len(build_levels(n, MGRITOptions(max_levels=levels, cfactor=cf)))
        if got == levels and (levels, cf) not in seen:
            seen.add((levels, cf))
            out.append((levels, cf))
    return out


def _params(m: LayerParallel) -> list[Tensor]:
    return [p for p in m.parameters() if p.requires_grad]


#: a candidate whose first pass takes this many times the time to beat is not timed
#: further (its first pass, one-time costs included, is what the table shows)
GIVE_UP = 3.0


def _time_passes(model: LayerParallel, m: LayerParallel, x: Tensor, y: Any,
                 loss_fn: Callable[[Tensor, Any], Tensor], repeats: int,
                 bound: float = float("inf")) -> float:
    """Fewest seconds of a forward and backward pass (`torch.autograd.grad`: no
    `.grad` is written) after one untimed pass; the slowest rank's, on every rank.
    A first pass above `GIVE_UP` x `bound` ends the timing there."""
    params = _params(m)
    xi = x if params else x.detach().clone().requires_grad_()
    inputs = params or [xi]
    cuda = x.is_cuda
    times = []
    for k in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.enable_grad():
            loss = loss_fn(m(xi), y)
            torch.autograd.grad(loss, inputs, allow_unused=True)
        if cuda:
            torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - t0)
        elif bound < float("inf"):
            first = max(model.transport.allgather_object(time.perf_counter() - t0,
                                                         "the auto-tuning's first pass"))
            if first > GIVE_UP * bound:
                return first
    local = min(times)
    got = model.transport.allgather_object(local, "the auto-tuning's timings")
    return max(got)


def _within(check: GradientCheck, policy: AccuracyPolicy) -> bool:
    return check.cosine >= policy.min_cosine and check.param_grad_error <= \
        policy.max_rel_error


def _build(model: LayerParallel, cand: Candidate, policy: Optional[AccuracyPolicy]
           ) -> LayerParallel:
    """The model with the candidate's settings (collective): same ranks, same
    parameter tensors."""
    fwd, bwd = cand.options()
    twin = model.like(options=fwd, backward_options=bwd, accuracy=policy,
                      batched=cand.batched)
    twin.train(model.training)
    return twin


def _drop(twin: Optional[LayerParallel]) -> None:
    """Close a candidate (collective)."""
    if twin is not None:
        twin.close()


#: the share of the expected training time (steps x an exact pass) the tuning may take
BUDGET = 0.05


def tune(model: LayerParallel, x: Tensor, y: Any, loss_fn: Callable[[Tensor, Any], Tensor],
         policy: AccuracyPolicy, repeats: int = 3, batch: int = 0,
         steps: Optional[int] = None) -> TuneResult:
    """Measure the candidates on one batch and choose (collective; every rank passes
    the same `x`, `y`).  See the module docstring.  Nothing the training sees
    changes (gradients by `torch.autograd.grad`, the random generator put back).

    steps: the training steps to come, if known: then no new candidate is measured
    once the tuning has taken `BUDGET` of their expected time (steps x an exact pass;
    the slowest rank's clock), so a small or short training is not swamped by it."""
    t_start = time.perf_counter()
    ranks = model.size
    rng = torch.get_rng_state()
    table: list[Measurement] = []
    with model.exact():  # exact propagation on the model itself
        t_exact = _time_passes(model, model, x, y, loss_fn, repeats)
    table.append(Measurement(Candidate(1), t_exact, 0.0, 1.0, True))
    best_t = t_exact  # the time to beat
    best: Optional[Candidate] = None
    limit = None if steps is None else BUDGET * t_exact * steps
    stopped = False

    def over() -> bool:
        if limit is None:
            return False
        spent = time.perf_counter() - t_start
        return max(model.transport.allgather_object(spent, "the auto-tuning's clock")) \
            > limit

    def measure(cand: Candidate) -> Measurement:
        twin = _build(model, cand, None)
        try:
            t = _time_passes(model, twin, x, y, loss_fn, repeats, best_t)
            if t >= best_t:
                return Measurement(cand, t)
            torch.set_rng_state(rng)
            check = check_gradients(twin, x, y, loss_fn)
            return Measurement(cand, t, check.param_grad_error, check.cosine,
                               _within(check, policy))
        finally:
            _drop(twin)

    for levels, cf in _structures(model):
        if stopped:
            break
        for fi, bi in ITERATIONS:
            if max(fi, bi) > policy.max_iters:
                break
            if over():
                stopped = True
                break
            m = measure(Candidate(levels, cf, fi, bi))
            table.append(m)
            if m.rel_error is None:  # slower than what we have: more iterations won't help
                break
            if m.within:
                best, best_t = m.candidate, m.seconds
                break
    if best is not None and not (stopped or over()):  # the same with per-step cycles
        table.append(measure(Candidate(best.levels, best.cfactor, best.fwd_iters,
                                       best.bwd_iters, batched=False)))
    torch.set_rng_state(rng)
    choice, reason = choose(table, ranks)
    if stopped:
        reason += (f" (tuning stopped after {len(table)} candidates: it may take "
                   f"{100 * BUDGET:g}% of the expected training time, {steps} steps x "
                   f"{1e3 * t_exact:.1f} ms)")
    spent = time.perf_counter() - t_start
    spent = max(model.transport.allgather_object(spent, "the auto-tuning's duration"))
    return TuneResult(table, choice, reason, spent, ranks, batch)


def _surrogate_loss(out: Tensor, y: Any) -> Tensor:
    """A loss for tuning when the caller gave none: the output's projection on a fixed
    random direction (the same on every rank), so gradients have no special shape."""
    g = torch.Generator().manual_seed(20)
    w = torch.randn(out.shape[1:], generator=g, dtype=torch.float64).to(out)
    return (out * w).sum() / max(1, out.shape[0])


@dataclass
class AutoTuner:
    """The auto settings of one `LayerParallel` (identical on every rank).

    `chosen` runs the passes once `tune` has run: a twin with the chosen settings
    under the adaptive `policy` (None for exact propagation, which needs no watching).
    """

    policy: AccuracyPolicy
    repeats: int = 3
    max_retunes: int = 3
    results: list[TuneResult] = field(default_factory=list)
    chosen: Optional[LayerParallel] = None
    batches: int = 0  # forward passes run through `chosen` (training and evaluation)

    @property
    def tuned(self) -> bool:
        return bool(self.results)

    @property
    def seconds(self) -> float:
        """All tuning's wall time so far (slowest rank)."""
        return sum(r.seconds for r in self.results)

    def tune(self, model: LayerParallel, x: Tensor, y: Any,
             loss_fn: Callable[[Tensor, Any], Tensor],
             steps: Optional[int] = None) -> TuneResult:
        """Measure and choose on this batch (collective); the choice runs from now on.
        `steps`: the training steps to come, if known (they bound the tuning's time)."""
        got = tune(model, x, y, loss_fn, self.policy, self.repeats, self.batches, steps)
        self.results.append(got)
        old, self.chosen = self.chosen, None
        _drop(old)
        cand = got.choice.candidate
        self.chosen = _build(model, cand, None if cand.exact else self.policy)
        model.accuracy = self.chosen.accuracy
        return got

    def forward(self, model: LayerParallel, x: Tensor) -> Tensor:
        """A pass of `model`: tuned first if it never was (with a surrogate loss,
        since a forward pass knows no targets; `layerpar.apps.train` tunes with its loss)."""
        if not self.tuned:
            self.tune(model, x, None, _surrogate_loss)
        assert self.chosen is not None
        self.chosen.training = model.training
        self.batches += 1
        return self.chosen(x)

    def check(self, model: LayerParallel, x: Tensor, y: Any,
              loss_fn: Callable[[Tensor, Any], Tensor]) -> GradientCheck:
        """`check_gradients` of the chosen setting (the adaptive policy observes it);
        outside the bound, tune again on this batch."""
        assert self.chosen is not None
        got = self.chosen.check_gradients(x, y, loss_fn)
        if not _within(got, self.policy) and len(self.results) <= self.max_retunes:
            self.tune(model, x, y, loss_fn)
        return got

    def close(self) -> None:
        _drop(self.chosen)
        self.chosen = None
