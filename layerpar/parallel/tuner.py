"""The auto settings of one model at run time: `AutoTuner` keeps what the tuning
(`layerpar.parallel.autotune`) measured and runs its choice, checks it, and tunes again.

The choice runs as a twin of the model (`LayerParallel.like`: same ranks, same
parameter tensors) under the adaptive policy, or a `ReplicatedSerial`, or exact
propagation (or, at one rank, the net itself: `plain_serial`).  Online (`AutoTuner.tune`
with ``online=True``) the exact replicated settings may be timed on the training's own
steps (`_Trial`).  Without a `tune` call the first training pass runs exactly and its
backward tunes with the loss's gradient at the output.  A gradient check outside the
bound, confirmed by the next, tunes again (at most `max_retunes` times); checks are
spread to take about `CHECK_SHARE` of the training (`_check_interval`).  Under auto,
``auto.accuracy`` is an `AutoAccuracy`: the running setting's controller, and an answer
for every setting.

Every rank decides alike: the tuning's times are the slowest rank's and its gradient
checks are reduced over ranks.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor
from torch.autograd.variable import Variable

from ..ode.net import ODENet
from .accuracy import GradientCheck, exact_reference
from .adaptive import AccuracyController, AccuracyEvent, AccuracyPolicy
from .autotune import (
    BUDGET,
    EXACT_SETUP,
    NO_TARGETS,
    NOISE_CAP,
    NOISE_FRACTION,
    Candidate,
    Checked,
    Limit,
    Measurement,
    TuneResult,
    _build,
    _drop,
    _log,
    _output_gradient_loss,
    _surrogate_loss,
    _within,
    choose,
    given_note,
    gradient_noise,
    measured_note,
    plain_serial,
    tune,
)
from .batched import same_structures
from .replicated import ReplicatedSerial, split_supported, supported
from .timing import AGREE

if TYPE_CHECKING:
    from .model import LayerParallel

__all__ = ["CHECK_BACKOFF", "CHECK_SHARE", "AutoAccuracy", "AutoTuner", "auto_policy"]


#: auto's checks of the chosen setting: every 20 batches at first (the tuning's check
#: of it was the first of every 10), up to every 80 while they stay within the bound
#: (`AccuracyPolicy.check_backoff`)
CHECK_BACKOFF = 8

#: auto's checks may take about this share of the training's time: a check costs the
#: chosen setting's pass and an exact pass (and, when the noise is measured again,
#: two exact half-batch passes), so where exact propagation is much slower than the
#: chosen setting the checks are spread out further than `CHECK_BACKOFF` alone would
#: (on the 1,024-layer dense MNIST-1D net a check took 0.26-0.37 s against a 63 ms
#: pass, and 26 checks took 13 % of the training; tuning's share, `BUDGET`, is 5 %)
CHECK_SHARE = 0.03

#: a check re-measures the batch's gradient noise (two exact half-batch passes, as
#: much as the check itself) unless the last measurement pinned the bound at
#: `NOISE_CAP` with this margin (``NOISE_FRACTION x noise >= NOISE_MARGIN x
#: NOISE_CAP``: the noise would have to fall below 1/`NOISE_MARGIN` of itself to move
#: the bound) ...
NOISE_MARGIN = 2.0
#: ... and then at every `NOISE_EVERY`-th check only (noise grows as training
#: converges; this catches it where it falls)
NOISE_EVERY = 4


def auto_policy(policy: Optional[AccuracyPolicy]) -> AccuracyPolicy:
    """The policy of ``options="auto"``: the caller's (an explicit bound wins), else
    the measured bound (`NOISE_FRACTION` of the batch's gradient noise)."""
    return AccuracyPolicy(noise_fraction=NOISE_FRACTION, check_backoff=CHECK_BACKOFF) \
        if policy is None else policy


def _check_interval(pass_s: float, exact_s: float, noise_share: float,
                    step_s: Optional[float] = None) -> int:
    """The least number of batches between auto's checks for them to take about
    `CHECK_SHARE` of the training: a check's passes (the chosen setting's, an exact
    one, and, in `noise_share` of the checks, two exact half-batch ones for the
    gradient noise) over `CHECK_SHARE` of a training step: `step_s` where the steps
    were measured apart from the passes (captured replays, several times faster than
    the eager passes a check runs), else a pass.  From the slowest rank's timings:
    the same on every rank."""
    if not (pass_s > 0 and math.isfinite(pass_s) and math.isfinite(exact_s)):
        return 0
    step = pass_s if step_s is None or not (step_s > 0 and math.isfinite(step_s)) \
        else step_s
    cost = pass_s + exact_s * (1 + noise_share)
    return math.ceil(cost / (CHECK_SHARE * step))


@dataclass
class _Trial:
    """Replicated settings timed on the training's own steps (`AutoTuner.tune` with
    ``online=True``).  They are exact, so their steps are real training steps, not
    passes thrown away: each candidate runs a few in turn, its first one a warm-up
    (new shapes' one-time costs), the others timed until two agree within `AGREE`
    (or `repeats` ran).  A step's time runs from one training forward to the next:
    pass, optimizer step and data loading, alike for every candidate, so their
    order is fair; the slowest rank's, so every rank decides alike.  The first
    batch is kept for a full tuning, should the budget turn out to have room for it."""

    x: Tensor
    y: Any
    loss_fn: Callable[[Tensor, Any], Tensor]
    steps: int  # the training steps to come when the trial began
    batch: int  # the training batch at which it began
    cand: Candidate  # the candidate running now
    queue: list[Candidate]  # those still to run
    kept: dict[Candidate, ReplicatedSerial]
    done: list[Measurement] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # `cand`'s timed steps
    count: int = 0  # `cand`'s steps whose time is known (the first: its warm-up)
    last: Optional[float] = None  # when the last training forward began its step
    steps_run: int = 0  # training forwards during the trial
    seconds: float = 0.0  # the trial's own work (builds, exchanges), slowest rank

    def close(self) -> None:
        for rep in self.kept.values():
            rep.close()
        self.kept.clear()


class AutoAccuracy:
    """`LayerParallel.accuracy` under ``options="auto"``: the adaptive controller of
    the setting auto runs now (`controller`), where it has one, and an answer for
    every setting, so that the adaptive check loop (``if
    model.accuracy.check_due(batch): model.check_gradients(x, y, loss_fn)``) works
    whatever auto chose, and before it tuned.  An exact setting (replicated serial,
    exact propagation, serial autograd) has nothing to watch: no check is due, and
    `exact` is True.  `log` holds the decisions of every setting's controller since
    the first tuning.  Other attributes are the controller's, read and written
    through (an AttributeError, saying so, where the setting has none)."""

    __slots__ = ("_tuner",)

    def __init__(self, tuner: AutoTuner) -> None:
        object.__setattr__(self, "_tuner", tuner)

    @property
    def controller(self) -> Optional[AccuracyController]:
        """The running setting's controller (None: an exact setting, or not tuned)."""
        chosen = self._tuner.chosen
        return None if chosen is None else chosen.accuracy

    def check_due(self, batch: int) -> bool:
        """Whether the training loop should check the gradients at `batch` (numbered
        as the training counts its batches, from 1): the controller's answer; never
        for an exact setting or before the tuning."""
        ctl = self.controller
        return ctl is not None and (self._tuner.provisional or ctl.check_due(batch))

    @property
    def exact(self) -> bool:
        """Whether the passes run exactly (an exact setting, or its controller's
        switch to exact propagation)."""
        ctl = self.controller
        return ctl is None or ctl.exact

    @property
    def policy(self) -> AccuracyPolicy:
        """The bound in force."""
        ctl = self.controller
        return self._tuner.bound if ctl is None else ctl.policy

    @property
    def log(self) -> list[AccuracyEvent]:
        ctl = self.controller
        return [*self._tuner.events, *([] if ctl is None else ctl.log)]

    def observe_check(self, batch: int, check: GradientCheck) -> None:
        ctl = self.controller
        if ctl is not None:
            ctl.observe_check(batch, check)

    def summary(self) -> str:
        ctl = self.controller
        if ctl is not None:
            return ctl.summary()
        name = self._tuner.choice_name(2)
        return "not tuned yet" if name is None else f"{name}: exact, nothing to watch"

    def _controller_or_raise(self, name: str) -> AccuracyController:
        ctl = self.controller
        if ctl is None:
            what = ("auto has not tuned yet" if self._tuner.chosen is None else
                    f"auto runs an exact setting ({self.summary()})")
            raise AttributeError(f"model.accuracy.{name}: {what}, so there is no adaptive "
                                 "controller (model.accuracy.controller is None)")
        return ctl

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # (its own slot, unset: a copy being built)
            raise AttributeError(name)
        return getattr(self._controller_or_raise(name), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._controller_or_raise(name), name, value)

    def __repr__(self) -> str:
        return f"AutoAccuracy({self.summary()})"


@dataclass
class AutoTuner:
    """The auto settings of one `LayerParallel` (identical on every rank).

    `chosen` runs the passes once `tune` has run: a twin with the chosen settings
    under the adaptive policy (the bound the tuning held it to), a
    `ReplicatedSerial`, or exact propagation (these two are exact: nothing to watch).
    """

    policy: AccuracyPolicy
    repeats: int = 3
    max_retunes: int = 3
    results: list[TuneResult] = field(default_factory=list)
    chosen: Optional[Any] = None  # LayerParallel or ReplicatedSerial
    batches: int = 0  # forward passes run through `chosen` (training and evaluation)
    remeasured: Optional[AccuracyPolicy] = None  # the bound measured at the last check
    #: the last gradient noise measured (tuning or check) and the checks since then
    noise: Optional[float] = None
    checks_since_noise: int = 0
    #: the passes the training will run in all (from the first `tune` given `steps`):
    #: a re-tuning's budget is taken from the steps still to come
    steps: Optional[int] = None
    #: pass times measured so far, per batch (shape, dtype, device): a re-tuning on
    #: such a batch reuses them
    timings: dict[tuple, dict[Candidate, float]] = field(default_factory=dict)
    #: replicated settings being timed on the training's own steps (``online``)
    trial: Optional[_Trial] = None
    #: the last check found the chosen setting outside the bound; the next confirms it
    unconfirmed: bool = False
    #: a training step's measured seconds where the steps do not run the chosen
    #: setting's passes eagerly (`AutoCapturedStep.observe_step`: CUDA-graph replays);
    #: the checks' interval is set against it instead of the eager pass
    step_seconds: Optional[float] = None
    #: at one rank with serial autograd chosen: the net that training passes run
    #: directly (`plain_serial`), else None
    plain: Optional[ODENet] = None
    #: the decisions of the controllers of settings chosen before the one running now
    events: list[AccuracyEvent] = field(default_factory=list)
    #: the first training pass ran (exact) without a tuning: its backward tunes
    awaiting: bool = False
    #: the choice was made on the loss's gradient at the output (`_first_backward`):
    #: the first check, due at once, holds it to the bound on the loss itself
    provisional: bool = False
    #: the last check: (its batch, the bound it was held to, what auto did)
    last_check: Optional[tuple[int, AccuracyPolicy, str]] = None

    @property
    def tuned(self) -> bool:
        return bool(self.results) or self.trial is not None

    @property
    def seconds(self) -> float:
        """All tuning's wall time so far (slowest rank)."""
        return sum(r.seconds for r in self.results)

    @property
    def bound(self) -> AccuracyPolicy:
        """The bound in force: the policy's when given, else the one measured by the
        last tuning (the default bound where none was measured)."""
        if self.policy.noise_fraction is None:
            return self.policy
        if self.remeasured is not None:
            return self.remeasured
        got = self.results[-1].bound if self.results else None
        return got if got is not None else replace(self.policy, noise_fraction=None)

    def tune(self, model: LayerParallel, x: Tensor, y: Any,
             loss_fn: Callable[[Tensor, Any], Tensor],
             steps: Optional[int] = None, online: bool = False,
             built: Optional[dict[Candidate, ReplicatedSerial]] = None,
             trial: Optional[tuple[int, float, int]] = None, batch: Optional[int] = None,
             step_seconds: Optional[float] = None, to_beat: Optional[float] = None,
             limit: Limit = None, checked: Optional[Checked] = None,
             serial_floor: Optional[float] = None) -> Optional[TuneResult]:
        """Measure and choose on this batch (collective); the choice runs from now on.
        `steps`: the training steps to come, if known (they bound the tuning's time; a
        later call without them counts what is left of the first call's).

        online: the caller trains with the passes that follow (``layerpar train``
        does), so where replicated serial can run, the first tuning times it on the
        training's own steps instead of on passes of its own (`_Trial`): replicated
        serial trains the first steps; once one is timed, if the budget (`BUDGET` of
        the training to come) has room for exact propagation and MGRIT, the full
        tuning runs on this batch then, else the replicated settings (with and
        without the batch split) are timed on the steps and the faster kept: a small
        net's tuning costs nothing but those steps.  Returns None then (the result
        is in `results` once the steps have decided).

        built: replicated settings already built on `model` (the trial's), timed by
        the tuning instead of new ones.  trial: (steps it trained, its timed step's
        seconds, the steps then to come), for the result's log.  batch: the training
        batch whose data `x` is, numbered as the training counts them (default: the
        next).  step_seconds: the trial's timed training step (`tune`'s).  to_beat,
        limit: a time per pass found outside layer-parallel training, and the seconds
        the tuning may take (`tune`'s).  checked: what the check that asked for this
        tuning measured on this batch (`tune`'s).  serial_floor: the serial step a
        caller timed, at least exact propagation's pass (`tune`'s)."""
        # (a tuning asked for: the first backward's, still to come, or its check, no more)
        self.awaiting = self.provisional = False
        if self.trial is not None:  # asked again before the steps decided: tune now
            self.trial.close()
            self.trial = self.chosen = None
        if steps is not None:
            self.steps = self.batches + steps
        elif self.steps is not None:
            steps = max(self.steps - self.batches, 1)
        if online and steps is not None and not self.results and model.training \
                and supported(model) is None:
            self._start_trial(model, x, y, loss_fn, steps)
            return None
        known = self.timings.setdefault((tuple(x.shape), x.dtype, x.device), {})
        with same_structures():  # (a model per candidate, over the same modules)
            got = tune(model, x, y, loss_fn, self.policy, self.repeats,
                       self.batches + 1 if batch is None else batch, steps,
                       known=dict(known), built=built, step_seconds=step_seconds,
                       to_beat=to_beat, limit=limit, checked=checked,
                       serial_floor=serial_floor)
        for m in got.table:
            known.setdefault(m.candidate, m.seconds)
        if trial is not None:  # (the trial's steps came first; its timed step decided)
            got.online, got.online_step = trial[0], trial[1:]
        self._record(model, got)
        self.remeasured = None
        self.unconfirmed = False
        if got.noise is not None:
            self.noise, self.checks_since_noise = got.noise, 0
        old, self.chosen = self.chosen, None
        if (controller := getattr(old, "accuracy", None)) is not None:
            self.events += controller.log
        _drop(old)
        cand = got.choice.candidate
        kept, got.kept = got.kept, {}
        if cand.replicated:
            self.chosen = kept.pop(cand, None) or ReplicatedSerial(model, split=cand.split)
        else:
            self.chosen = _build(model, cand, None if cand.exact else self.bound)
            self.chosen.batch = self.batches  # (numbered as the training's batches)
            ctl = self.chosen.accuracy
            if ctl is not None and ctl.costs is not None:  # the tuning's timings count
                exact = next(m for m in got.table if m.candidate.exact)
                ctl.costs.add(got.choice.seconds, exact.seconds)
            if ctl is not None:
                # the tuning's check of it, within the bound, was its first: back off once
                ctl.backoff = min(2, ctl.policy.check_backoff)
                ctl.checked_at = self.batches
                # a check's exact pass is exact propagation's (where it was timed)
                exact = min(m.seconds for m in got.table if m.candidate.exact)
                exact = next((m.seconds for m in got.table if m.candidate.exact
                              and not m.candidate.replicated), exact)
                ctl.min_every = _check_interval(got.choice.seconds, exact,
                                                self._noise_share())
        for other in kept.values():
            other.close()
        self.plain = plain_serial(model, self.chosen)
        return got

    def _start_trial(self, model: LayerParallel, x: Tensor, y: Any,
                     loss_fn: Callable[[Tensor, Any], Tensor], steps: int) -> None:
        """Begin timing the replicated settings on the training's steps (`_Trial`)."""
        t0 = time.perf_counter()
        first = Candidate(1, replicated=True)
        queue = []
        if split_supported(model, x) is None and x.shape[0] >= model.size:
            queue.append(Candidate(1, replicated=True, split=True))
        rep = ReplicatedSerial(model)
        rep.training = model.training
        _drop(self.chosen)
        self.chosen = rep
        self.trial = _Trial(x, y, loss_fn, steps, self.batches + 1, first, queue,
                            {first: rep})
        self.trial.seconds = time.perf_counter() - t0

    def _trial_step(self, model: LayerParallel) -> None:
        """At a forward during the trial: the previous training step's time, and what
        it decides (collective: every rank runs the same forwards)."""
        tr = self.trial
        if tr is None:
            raise RuntimeError("the tuner times a trial step with no trial running")
        now = time.perf_counter()
        if not (model.training and torch.is_grad_enabled()):
            tr.last = None  # an evaluation pass: the interval across it is no step
            return
        tr.steps_run += 1
        if tr.last is None:
            tr.last = now
            return
        tr.count += 1
        if tr.count < 2:  # the candidate's first step: its warm-up
            tr.last = now
            return
        t = max(model.transport.allgather_object(now - tr.last, "the auto-tuning's steps"))
        tr.times.append(t)
        if not tr.done and len(tr.times) == 1 and \
                BUDGET * t * tr.steps > EXACT_SETUP + (self.repeats + 1) * t:
            # a net whose training has room for the full tuning: run it on the first
            # batch (replicated serial, built for the trial, is timed there, not rebuilt)
            self.trial = self.chosen = None
            # (this forward's step runs the choice: the steps before it trained)
            got = self.tune(model, tr.x, tr.y, tr.loss_fn, built=tr.kept,
                            trial=(tr.steps_run - 1, t, tr.steps), batch=tr.batch,
                            step_seconds=t)
            if got is None:
                raise RuntimeError("the trial's tune() chose no setting")
            return
        ts = tr.times
        if not (len(ts) >= self.repeats or len(ts) == 2 and abs(ts[1] - ts[0]) <=
                AGREE * min(ts) or not tr.queue and not tr.done):
            tr.last = now
            return
        # (one candidate alone needs no comparison: its first timed step is enough)
        tr.done.append(Measurement(tr.cand, min(ts), 0.0, 1.0, True))
        if tr.queue:  # the next candidate trains the coming steps
            tr.cand, tr.times, tr.count = tr.queue.pop(0), [], 0
            rep = ReplicatedSerial(model, split=tr.cand.split)
            rep.training = True
            tr.kept[tr.cand] = rep
            self.chosen = rep
            tr.seconds += time.perf_counter() - now
            tr.last = time.perf_counter()
            return
        choice, reason = choose(tr.done, model.size, "training step")
        self.chosen = tr.kept.pop(choice.candidate)
        tr.close()
        self.trial = None
        reason += (f" (timed on the training's own steps: the budget, {100 * BUDGET:g}% of "
                   f"the expected training time, {tr.steps} steps x "
                   f"{1e3 * choice.seconds:.1f} ms, has no room for exact propagation or "
                   "MGRIT)")
        tr.seconds += time.perf_counter() - now
        spent = max(model.transport.allgather_object(tr.seconds, "the auto-tuning's time"))
        self._record(model, TuneResult(tr.done, choice, reason, spent, model.size, tr.batch,
                                       online=tr.steps_run - 1, timed_online=True))

    def _record(self, model: LayerParallel, got: TuneResult) -> None:
        """Keep a tuning's result, and log its table and choice (logger ``layerpar``,
        INFO, rank 0), so that `options="auto"` in a user's own loop reports its choice
        (``layerpar train`` prints `log`)."""
        self.results.append(got)
        if model.rank == 0 and _log.isEnabledFor(logging.INFO):
            _log.info("%s", got)

    def forward(self, model: LayerParallel, x: Tensor) -> Tensor:
        """A pass of `model`.  Where `tune` was never called, the first training pass
        runs exact propagation and its backward tunes, with the training's own loss
        as that backward reveals it (`_first_backward`); where no backward came before
        the next training pass (or nothing there requires grad), that pass tunes with
        a surrogate loss (`layerpar.apps.train` calls `tune` with its loss).
        A pass before any tuning that trains nothing (no gradient recorded, or the
        model in eval mode: an evaluation of a loaded checkpoint, say), or that has an
        empty batch (nothing to time), runs exact propagation and leaves the tuning to
        the first training pass with samples, whose passes it would time."""
        if self.trial is not None:
            self._trial_step(model)
        train = model.training and torch.is_grad_enabled()
        if not self.tuned:
            if not train or x.numel() == 0:
                with model.exact():
                    return model(x)
            if not self.awaiting:
                # the first training pass: exact; its backward reveals the loss
                self.batches += 1
                with model.exact():
                    out = model(x)
                if out.requires_grad:
                    self.awaiting = True
                    out.register_hook(partial(self._first_backward, model, x.detach(),
                                              self.batches))
                    return out
                self.batches -= 1  # (nothing to differentiate: tuned below, this batch)
            # no backward came (or none can): the loss is unknown
            self.awaiting = False
            self.tune(model, x, NO_TARGETS, _surrogate_loss)
        if self.chosen is None:
            raise RuntimeError("the tuner has chosen no setting")
        self.chosen.training = model.training
        if train:
            self.batches += 1
        twin = self.chosen if self.plain is None and not isinstance(
            self.chosen, ReplicatedSerial) else None
        if twin is not None:  # its batches numbered as the training's (its log, checks)
            twin.batch = self.batches - 1 if train else self.batches
        net = self.plain
        if net is not None:  # one rank, serial autograd: the net itself
            if net.training is not model.training:
                net.train(model.training)
            # the base class's layers in order, as every setting runs them (not a
            # subclass's own forward); a seed only where the net has dropout
            return ODENet.forward_seeded(net, x, net.forward_seed() if model.has_dropout
                                         else None)
        out = self.chosen(x)
        if twin is not None and not train:
            twin.batch = self.batches  # (an evaluation pass is no training batch)
        return out

    def _first_backward(self, model: LayerParallel, x: Tensor, batch: int,
                        grad: Tensor) -> None:
        """At the first training pass's backward (a hook on its output's gradient,
        collective: every rank runs the same backward): tune on that batch once the
        backward is over (its saved tensors, batch-norm statistics among them, must
        not change under it), with the training's own loss as the backward reveals
        it, its gradient at the (exact) output (`_output_gradient_loss`), at the
        parameters that pass ran with (before any optimizer step)."""
        if not self.awaiting:  # (a second backward through the same output)
            return
        self.awaiting = False
        g = grad.detach().clone()

        def tune() -> None:
            self.tune(model, x, g, _output_gradient_loss, batch=batch)
            self.provisional = True

        Variable._execution_engine.queue_callback(tune)

    def count_captured(self) -> None:
        """A pass of the chosen setting that ran in a captured CUDA graph
        (`layerpar.parallel.capture.AutoCapturedStep`), counted as `forward` counts
        one: the re-tuning's budget and the controller's batch numbers go on, and the
        chosen setting is in training mode, as `forward` leaves it for a training pass
        (an evaluation between replays left it in eval mode; a check runs it as it is)."""
        self.batches += 1
        if self.chosen is not None:
            self.chosen.training = True
            if not isinstance(self.chosen, ReplicatedSerial):
                self.chosen.batch = self.batches  # (a LayerParallel twin)

    def check(self, model: LayerParallel, x: Tensor, y: Any,
              loss_fn: Callable[[Tensor, Any], Tensor]) -> GradientCheck:
        """`check_gradients` of the chosen setting (the adaptive policy observes it);
        outside the bound on two checks in a row, tune again on the second's batch
        (after the first, nothing changes and the next check is due after
        `check_every` batches: one batch's error is a noisy estimate).  With the
        measured bound, the batch's gradient noise is measured again first (it grows
        as training converges), and the chosen setting's controller is held to the
        new bound; where the last measurement left the bound pinned at its cap with
        room to spare, only every few checks (`noise_due`: it costs as much as the
        check)."""
        if self.chosen is None:
            raise RuntimeError("the tuner has chosen no setting to check")
        ctl = self.chosen.accuracy
        # a choice made on the loss's gradient at the output (no `tune` call) is checked
        # on the loss itself at once, against the bound it was chosen by, and tuned
        # again at once where it is outside (no second check to confirm)
        provisional, self.provisional = self.provisional and ctl is not None, False
        noise: Optional[float] = None  # measured on this batch
        if self.policy.noise_fraction is not None and ctl is not None and not provisional:
            if self.noise_due():
                noise = gradient_noise(model, x, y, loss_fn)
                self.checks_since_noise = 0
                if noise is not None:
                    self.noise = noise
                    self.remeasured = self.policy.measured(noise, NOISE_CAP)
                    ctl.policy = self.remeasured
            else:
                self.checks_since_noise += 1
        batch, name = self.batches, self.choice_name(model.size)
        if ctl is None:  # replicated serial or exact propagation: exact
            got = self.chosen.check_gradients(x, y, loss_fn)
            self.last_check = (batch, self.bound, f"{name} is exact: nothing to change")
            return got
        # the running setting as the check runs it, and the batch's exact pass run
        # apart, so that a re-tuning on this batch takes both (`Checked`)
        ran = replace(self.results[-1].choice.candidate, fwd_iters=ctl.fwd_iters,
                      bwd_iters=ctl.bwd_iters)
        with self.chosen.model.checking():
            exact = exact_reference(self.chosen.model, x, y, loss_fn)
        got = self.chosen.measure_gradients(x, y, loss_fn, reference=exact)
        bound = self.bound
        if not _within(got, bound) and not self.unconfirmed and not provisional and \
                len(self.results) <= self.max_retunes:
            # one batch's error is a noisy estimate of the setting's (1,024-layer dense
            # net: 0.115 to 0.21 from check to check): nothing changes before the next check, due
            # after `check_every` batches, finds it outside the bound too
            self.unconfirmed = True
            ctl.backoff, ctl.min_every = 1, 0
            self.last_check = (batch, bound, f"auto kept {name}: one check's error is a "
                               "noisy estimate, and the next check (due after "
                               f"{ctl.policy.check_every} batches) confirms it or not")
            return got
        self.unconfirmed = False
        ctl.observe_check(self.chosen.batch, got)
        if got.inexact_seconds > 0:
            ctl.min_every = _check_interval(got.inexact_seconds, got.exact_seconds,
                                            self._noise_share(), self.step_seconds)
        if _within(got, bound):
            self.last_check = (batch, bound, f"{name} within the bound")
        elif len(self.results) <= self.max_retunes:
            # (a provisional choice's bound was measured on the output's gradient: the
            # tuning measures the loss's own)
            self.tune(model, x, y, loss_fn, batch=batch, checked=Checked(
                ran, got, exact, None if provisional else bound, noise,
                "" if provisional else self._bound_note(batch, bound, noise)))
            self.last_check = (batch, bound, f"auto tuned again on this batch and chose "
                               f"{self.choice_name(model.size)}")
        else:
            self.last_check = (batch, bound, f"auto kept {name}, its iteration counts "
                               f"now {ctl.fwd_iters}/{ctl.bwd_iters} (its adaptive "
                               f"controller's answer): it has tuned {len(self.results)} "
                               f"times, its most (max_retunes={self.max_retunes})")
        return got

    def _bound_note(self, batch: int, bound: AccuracyPolicy,
                    noise: Optional[float]) -> str:
        """How the bound in force came about, for a re-tuning that takes it from the
        check at `batch` (`TuneResult.bound_note`); `noise`: measured on that batch."""
        if self.policy.noise_fraction is None:
            return given_note(bound)
        if noise is None:
            return (f"the check's at batch {batch}, relative error <= "
                    f"{bound.max_rel_error:.3g} (the gradient noise was not measured on "
                    "that batch: the bound of the last measurement)")
        return (f"the check's at batch {batch}: "
                + measured_note(self.policy.noise_fraction, noise, bound))

    def _pinned(self) -> bool:
        """Whether the last noise measurement pinned the measured bound at `NOISE_CAP`
        with `NOISE_MARGIN` to spare."""
        frac = self.policy.noise_fraction
        return not (self.noise is None or frac is None
                    or frac * self.noise < NOISE_MARGIN * NOISE_CAP)

    def _noise_share(self) -> float:
        """The share of checks that measure the gradient noise (`noise_due`)."""
        if self.policy.noise_fraction is None:
            return 0.0
        return 1.0 / NOISE_EVERY if self._pinned() else 1.0

    def noise_due(self) -> bool:
        """Whether a check should measure the gradient noise again: always, unless
        the last measurement pinned the bound at `NOISE_CAP` with `NOISE_MARGIN` to
        spare; then every `NOISE_EVERY`-th check (the same on every rank: the noise
        is reduced over the ranks)."""
        return not self._pinned() or self.checks_since_noise + 1 >= NOISE_EVERY

    def log(self, ranks: int) -> list[str]:
        """Every tuning's table and choice as text lines, and a line if the training
        ended while the replicated settings were still being timed on its steps."""
        out = [line for r in self.results for line in r.lines()]
        if self.trial is not None:
            out.append(f"auto: training ended while the replicated settings were timed on "
                       f"its steps ({self.trial.steps_run} steps): it ran "
                       f"{self.trial.cand.name(ranks)}")
        return out

    def choice_name(self, ranks: int) -> Optional[str]:
        """The setting running now, by name (None: never tuned)."""
        if self.results:
            return self.results[-1].choice.candidate.name(ranks)
        return None if self.trial is None else self.trial.cand.name(ranks)

    def apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """What `nn.Module._apply` applied to the model (`.to()`, `.float()`,
        `.cuda()` ...), applied to every setting held: the chosen one and those the
        trial keeps (a twin shares the model's modules, so this reaches its ghost
        blocks; a replicated setting builds its private net again).  No message."""
        held = [self.chosen, *([] if self.trial is None else self.trial.kept.values())]
        done: set[int] = set()
        for s in held:
            if s is None or id(s) in done:
                continue
            done.add(id(s))
            if isinstance(s, ReplicatedSerial):
                s.apply(fn)
            else:
                s._apply(fn)

    def close(self) -> None:
        if self.trial is not None:
            self.trial.close()  # (the running one, `chosen`, among them)
            self.trial = self.chosen = None
        _drop(self.chosen)
        self.chosen = self.plain = None
