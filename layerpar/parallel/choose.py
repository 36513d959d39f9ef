"""Choosing the parallelism: every way of training the net at this rank count, timed
on the user's own batch, and the fastest kept.

A user with P ranks and a deep ResNet can run the whole net on every rank (replicated
serial: nothing split, as fast as one rank), or on rank 0 alone at the torch thread
count that runs its step fastest (`SoloMethod`: the best serial, the others waiting;
its steps timed by rank 0's clock), split the batch (`DataParallelNet`),
split the layers in time (`LayerParallel`, MGRIT, with its own setting chosen by
`Auto`), or split the layers into a pipeline (`PipelineNet`, each schedule at the
micro-batch count that runs fastest).  `choose_method` builds each candidate from a
copy of the same net, runs one warm-up `train_step` and at most `steps` timed ones on the
given batch, and keeps the candidate whose slowest rank's step is shortest (each timed
by the rule the auto-tuning times its passes with, `timing.gauged_seconds`, against
the fastest so far: a clearly slower one is not timed further, and the times compare
with the tuning's).
Solo (the serial run a user would make) comes first, then layer-parallel: its own
tuning times replicated serial and the batch split beside exact propagation and
MGRIT on passes of the batch, and those times stand for the serial and data
candidates, which are then built only if chosen (with batch norm, which the tuning's
split does not run, the batch split is timed before it, its check against the
serial gradient solo's steps computed).
The times are gathered from every rank before anything is decided, so every rank
keeps the same candidate; the others are closed (a chosen solo holds rank 0 at its
thread count until it is closed, `SoloMethod.hold_threads`, so the optimizer's step runs
at it too).  The table, the choice and the reason are in the returned method's
`choice` (`Choice.lines`).

A pipeline is not built where solo's step at the ranks' thread count says it cannot
be the fastest (`_pipeline_floor`: its stages share the serial step's work).

Choosing costs time the training could have used: given the steps to come, it stops
timing candidates once it has cost `calibration_share` of them (cheapest to time
first), and says which it left out.

Only candidates whose gradients are the serial net's take part (``exact=True``, the
default), or whose error on this batch is within the bound `Auto` holds MGRIT to: a
batch split gives batch norm the statistics of each rank's share, so with batch norm
the split's gradient is compared with serial's on the batch and kept only within
that bound (half the batch gradient's own sampling error, at most 0.2, or the bound
the layer-parallel candidate's policy fixes); the pipeline runs one micro-batch.  A
module of the user's that couples rows is treated as batch norm is, and one that
keeps a running statistic of its own in a buffer makes the split stand aside (each
rank's would follow its share), the pipeline run one micro-batch; one that draws
random numbers itself (no dropout module) sets the split aside, and the pipeline,
which refuses it, whatever ``exact``: all found by running the net on a few of the
batch's rows (`replicated.probe_rows`), where its modules are not all of types known
to keep rows apart.  Under `torch.autocast` the pipeline (which refuses it) stands
aside before it is built.
Dropout would draw each rank's masks from its own generator, so with dropout all but
`LayerParallel` (which reproduces serial dropout) stand aside.  The table says why a
candidate stood aside, and the error a batch split was kept with.  ``exact=False``
admits them all, as a user of DistributedDataParallel accepts them.

The timing steps leave no trace: the parameters are not stepped, `.grad` is cleared,
and the chosen method's buffers (batch norm's running statistics) are restored to
their values before the timing.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from ..mgrit.errors import RemoteError
from ..mgrit.transport import make_transport
from ..ode.net import ODENet, Segment
from ..ode.rng import DROPOUT_TYPES, GeneratorStates
from .baselines import (
    DataParallelNet,
    LayerParallelMethod,
    PipelineNet,
    SerialMethod,
    SoloMethod,
    TrainingMethod,
)
from .baselines.method import LossFn, as_net, step_seconds, thread_counts
from .baselines.pipeline import step_refusal
from .replicated import BATCH_NORM_WHY, RowProbe, agreed_rows, split_refusal
from .timing import frozen_heap

__all__ = ["METHOD_NAMES", "Choice", "Trial", "choose_method"]

#: the methods `choose_method` may time, in the order it times them but for solo,
#: which it times first (a few steps: the serial run a user would make, before the
#: open-ended tuning): layer-parallel, whose own tuning (`Auto`) times replicated
#: serial and the batch split too, which then cost nothing more (where it cannot time
#: the split, batch norm, data goes before it, and the tuning must beat it within the
#: share left); the pipeline sweeps while the budget lasts.  On equal times the
#: earlier name wins:
#: layer-parallel running replicated serial (or the batch split) is built and warm
#: already, and its replicated pass skips the serial net's per-pass search for dropout
METHOD_NAMES = ("layerparallel", "serial", "data", "solo", "pipeline")
#: the pipeline schedules timed by default (one stage per rank: the ones that run on
#: any net; the looped and zero-bubble ones are given by name)
DEFAULT_SCHEDULES = ("gpipe", "1f1b")

#: seconds a pipeline costs to set up per micro-batch count it is timed at, beyond its
#: steps (its stages and schedule built, shapes inferred across the ranks): on Peaks at
#: 2 ranks (2-core CPU) a sweep over 1, 2 and 4 micro-batches took 0.75 s of choosing,
#: of which its 12 steps, at the 9-16 ms its table gives, make about 0.15 s; the budget
#: had counted the steps alone (0.02 s at replicated serial's step) and let it run on a
#: 1.3-second training
PIPELINE_SETUP = 0.2

#: (candidate's name, its measured seconds per step) -> the seconds the decision uses;
#: the identity unless a test makes one candidate's clock the fastest
Timer = Callable[[str, float], float]


@dataclass(frozen=True)
class Trial:
    """One candidate: its name, its seconds per step (the slowest rank's fewest; None:
    it stood aside or was refused) and a note (its setting, or why not)."""

    name: str
    seconds: Optional[float]
    note: str = ""
    #: the candidate whose computation this one runs (layer-parallel whose own tuning
    #: chose replicated serial, or the batch split), else None
    same_as: Optional[str] = None


@dataclass(frozen=True)
class Choice:
    """What `choose_method` measured and kept, identical on every rank."""

    ranks: int
    steps: int
    trials: tuple[Trial, ...]
    chosen: str
    calibration_seconds: float
    """Wall seconds the whole choice took on this rank (building and timing every
    candidate): training time spent before the first training step."""
    why: str = ""
    """Why the chosen candidate was kept, where no timing compared it (else empty)."""

    @property
    def reason(self) -> str:
        """Why the chosen candidate won, in one phrase."""
        if self.why:
            return self.why
        best = next(t for t in self.trials if t.name == self.chosen)
        # the others, without the ones that run the same computation as the chosen
        others = sorted((t for t in self.trials if t.seconds is not None and t is not best
                         and best.name != t.same_as and t.name != best.same_as),
                        key=lambda t: t.seconds)  # type: ignore[arg-type, return-value]
        if not others:
            return "the only candidate that runs here"
        nxt = others[0]
        return (f"fastest per step ({best.seconds / nxt.seconds:.2f}x the next, "  # type: ignore[operator]
                f"{nxt.name})")

    def lines(self) -> list[str]:
        """The table and the choice as text lines (what ``layerpar train --auto``
        prints)."""
        timed = (f"seconds per step (slowest rank, fewest of at most {self.steps}; "
                 if any(t.seconds is not None for t in self.trials) else
                 "none timed on steps of its own (")
        out = [f"auto (parallelism): {len(self.trials)} candidates at {self.ranks} rank(s), "
               f"{timed}choosing took {self.calibration_seconds:.1f} s):"]
        for t in self.trials:
            got = "—" if t.seconds is None else f"{1000 * t.seconds:9.1f} ms"
            mark = " <- chosen" if t.name == self.chosen else ""
            out.append(f"  {t.name:34s} {got:>12s}{mark}" + (f"   ({t.note})" if t.note else ""))
        out.append(f"auto (parallelism): trains with {self.chosen}: {self.reason}")
        return out


def _stands_aside(net: ODENet, method: str, exact: bool, rows: RowProbe
                  ) -> tuple[Optional[str], bool]:
    """(why `method` stands aside for `net`, or None; whether it must run one
    micro-batch): the batch split and the pipeline's micro-batches change what a
    module that couples rows (batch norm, or one of the user's: `rows`) computes, a
    running statistic a module keeps (`rows.buffers`) would follow each rank's share
    under the split, a module drawing random numbers itself (`rows.random`) would
    draw them apart on each rank (the pipeline refuses it, whether exact or not),
    and every method but layer-parallel draws dropout masks from
    each rank's own generator."""
    if rows.random is not None and (method == "pipeline" or method == "data" and exact):
        # (the pipeline refuses it at its first step; the split would not be serial's)
        return rows.random + (" (exact=False admits it)" if method == "data" else ""), False
    if not exact or method in ("layerparallel", "solo"):
        return None, False
    mods = list(net.modules())
    if any(isinstance(m, DROPOUT_TYPES) and float(getattr(m, "p", 0.0)) > 0 for m in mods):
        return ("dropout: each rank would draw its own masks, not the serial net's "
                "(exact=False admits it)"), False
    if method == "data" and rows.buffers is not None:
        return f"{rows.buffers} (exact=False admits it)", False
    return None, method == "pipeline" and (rows.coupled is not None
                                           or rows.buffers is not None)


def _flat_grads(method: TrainingMethod) -> dict[str, Tensor]:
    """The gradients `method` holds, by parameter name (a missing one as zeros)."""
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad).detach().double().ravel()
            for n, p in method.named_parameters()}


def _rel(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """|a - b| / |b| over the parameters both name."""
    keys = sorted(set(a) & set(b))
    num = sum(float((a[k] - b[k]).square().sum()) for k in keys)
    den = sum(float(b[k].square().sum()) for k in keys)
    return math.sqrt(num / den) if den > 0 else math.inf


def _split_error(cal: _Calibration, data: DataParallelNet, fresh: Callable[[], ODENet],
                 bound: Optional[float]) -> tuple[bool, str]:
    """Whether the batch split's gradient on this batch (batch norm, or a module of
    the user's that couples rows, `_Calibration.rows`, over each rank's share) is
    within the bound of the serial net's, and the figures: the bound is
    `bound` where given, else ``NOISE_FRACTION`` of the batch gradient's sampling
    error capped at ``NOISE_CAP``.

    Each rank runs its share through the split's net once (its gradient, before the
    average: P x its rows' part of the whole batch's, for a mean loss that share's own
    gradient weighted by its rows); the serial net's gradient of the
    whole batch is the one solo's timing steps left on rank 0 (`_Calibration.
    serial_grads`: rank 0 compares, and every rank takes its figure), else each rank
    runs the batch through a serial copy once.  The shares' spread is the sampling
    error: at 2 ranks ``|g1 - g2| / |g1 + g2|`` of the two halves, as `Auto` measures it
    (`autotune.gradient_noise`); at P ranks the same estimate from P shares,
    ``sqrt(sum |g_i - g|^2 / (P (P - 1))) / |g|``, g their mean (the split's
    gradient).  Every rank computes the same numbers."""
    from .autotune import NOISE_CAP, NOISE_FRACTION

    x, y, loss_fn, transport = cal.x, cal.y, cal.loss_fn, data.transport
    data._check_batch(x, y)  # (fewer rows than ranks: refused alike)
    exact = cal.serial_grads  # solo's, on rank 0, where its timing kept them
    if exact is None:
        serial = SerialMethod(fresh())
        serial.train_step(x, y, loss_fn)
        exact = _flat_grads(serial)
        serial._zero_grad()
    data._zero_grad()
    # this rank's rows' part of the whole batch's loss, times P, through the bare net
    data.whole_loss(x, y, loss_fn, engine=False).backward()
    own = _flat_grads(data)
    data._zero_grad()
    names = sorted(own)
    flat = torch.cat([own[k] for k in names]) if names else torch.zeros(0, dtype=torch.float64)
    ranks = transport.size
    own_sq = float(flat.square().sum())
    if ranks > 1:
        transport.allreduce_start(flat, "the batch split's gradient").wait()
    mean = flat / ranks  # the split's gradient: the shares' average
    sizes = [int(own[k].numel()) for k in names]
    from_solo = cal.serial_grads is not None and ranks > 1  # (rank 0's figure)
    err = _rel(dict(zip(names, mean.split(sizes))), exact) \
        if not from_solo or transport.rank == 0 else math.nan
    if from_solo:
        err = float(transport.bcast_object(err, 0))
    if bound is None and ranks > 1:
        mean_sq = float(mean.square().sum())
        spread = max(0.0, sum(transport.allgather_object(own_sq, "the shares' gradients"))
                     - ranks * mean_sq)
        noise = math.sqrt(spread / (ranks * (ranks - 1)) / mean_sq) if mean_sq > 0 \
            else math.inf
        bound = min(NOISE_CAP, NOISE_FRACTION * noise)
        how = (f"{NOISE_FRACTION:g} x the batch gradient's sampling error {noise:.3g}"
               + (f", capped at {NOISE_CAP:g}" if NOISE_FRACTION * noise > NOISE_CAP
                  else ""))
    elif bound is None:  # one rank: the share is the batch
        bound, how = NOISE_CAP, "one rank: the split is the serial net"
    else:
        how = "the bound given"
    what = "batch norm" if split_refusal(data.net) == BATCH_NORM_WHY else \
        f"rows coupled ({cal.rows.coupled})"
    return err <= bound, (f"{what} over each rank's share: gradient error {err:.3g} "
                          f"against serial's on this batch, bound {bound:.3g} ({how})")


class _Calibration:
    """The candidates' timings as they come, agreed between the ranks, and the share
    of the training they may cost."""

    def __init__(self, transport: Any, x: Tensor, y: Any, loss_fn: LossFn, steps: int,
                 timer: Timer, steps_to_come: Optional[int], share: float) -> None:
        self.transport, self.x, self.y, self.loss_fn = transport, x, y, loss_fn
        self.steps, self.timer = steps, timer
        self.steps_to_come, self.share = steps_to_come, share
        self.t0 = time.perf_counter()
        self.exact = True
        self.trials: list[Trial] = []
        #: each timed candidate: its method, or (timed inside layer-parallel's tuning)
        #: the factory that builds it if it is chosen; its agreed seconds
        self.held: dict[str, tuple[Union[TrainingMethod, Callable[[], TrainingMethod]],
                                   float]] = {}
        #: seconds per pass that layer-parallel's tuning measured for the methods it
        #: runs itself ("serial": replicated serial, "data": the batch split)
        self.tabled: dict[str, float] = {}
        #: solo's seconds per step by torch thread count (where it was timed)
        self.solo: dict[int, float] = {}
        #: whether the batch split's check will need the serial net's gradient of the
        #: batch (`_split_error`), which solo's timing steps then keep
        self.wants_serial_grads = False
        #: that gradient, by parameter name, from solo's timing steps: rank 0's (an
        #: empty dict elsewhere); None where they did not keep it (alike on every rank)
        self.serial_grads: Optional[dict[str, Tensor]] = None
        #: whether the net's modules couple the batch's rows or keep running statistics
        #: (`probe_rows`, rank 0's verdict on every rank)
        self.rows = RowProbe(None, None)

    def agreed(self, value: float) -> float:
        """The largest of the ranks' `value` (every rank gets the same number)."""
        return float(max(self.transport.allgather_object(value, "choose_method's timings")))

    def fastest(self) -> float:
        """The fastest candidate's seconds per step so far (inf: none timed yet)."""
        return min((s for _, s in self.held.values()), default=math.inf)

    def elapsed(self) -> float:
        """Seconds since choosing began, on this rank's clock."""
        return time.perf_counter() - self.t0

    def spent(self, steps: int = 0, serial_long: bool = False, setup: float = 0.0
              ) -> Optional[str]:
        """Why no further candidate is timed (None: the budget allows one): the
        calibration has cost its share of the training that follows, at the fastest
        candidate's step time, or would with `steps` more steps (what the next
        candidate costs at the least: its warm-up and timed steps) of that length, or
        (`serial_long`: a pipeline, whose stages run one after the other) of
        replicated serial's where it was timed, and `setup` seconds to build it."""
        if self.steps_to_come is None or not self.held:
            return None
        best = self.fastest()
        step = max(best, self.held["serial"][1]) if serial_long and "serial" in self.held \
            else best
        spent = self.agreed(self.elapsed())
        budget = self.share * self.steps_to_come * best
        if spent + steps * step + setup < budget:
            return None
        ahead = f" and timing it would take {steps} more steps" if steps else ""
        if setup:
            ahead += f" and about {setup:.2f} s to set up"
        return (f"not timed: choosing had taken {spent:.2f} s{ahead}; its share "
                f"({100 * self.share:g} %) of the {self.steps_to_come} steps to come, at "
                f"the fastest step so far, is {budget:.2f} s")

    def measure(self, name: str, method: Union[TrainingMethod, Callable[[], TrainingMethod]],
                note: str, seconds: Optional[float] = None,
                same_as: Optional[str] = None) -> None:
        """Keep the candidate `name` with its time: `seconds` where it was measured
        already (the same on every rank, or the slowest rank's), else its step on the
        batch (`method` must then be built), timed against the fastest so far
        (`step_seconds`: one clearly slower is not timed further)."""
        if seconds is not None:
            own = seconds
        elif isinstance(method, TrainingMethod):
            own = step_seconds(method, self.x, self.y, self.loss_fn, self.steps,
                               self.fastest())
        else:
            raise TypeError(f"{name}: a candidate timed here must be built")
        s = self.agreed(self.timer(name, own))
        self.trials.append(Trial(name, s, note, same_as))
        self.held[name] = (method, s)


def _serial_step(cal: _Calibration) -> Optional[float]:
    """The serial step's seconds at the torch thread count every rank runs, where solo
    timed it there (None otherwise: solo not timed, or the ranks' counts differ).  The
    same on every rank: solo's times and the thread counts are agreed."""
    if not cal.solo:  # (alike on every rank: nothing to exchange)
        return None
    counts = cal.transport.allgather_object(torch.get_num_threads(), "the thread counts") \
        if cal.transport.size > 1 else [torch.get_num_threads()]
    if any(k != counts[0] for k in counts):
        return None
    return cal.solo.get(counts[0])


def _pipeline_floor(cal: _Calibration, one_micro: bool) -> Optional[str]:
    """Why no pipeline can be the fastest (None: one may): its stages run the serial
    net's layers, one per rank, so a step costs at least the serial step's work at
    the ranks' thread count spread over the ranks (its micro-batches add work per
    layer, never remove it), and with one micro-batch the stages run one after
    another: the whole serial step.  Solo timed that step at this thread count; where
    that floor is no faster than the fastest candidate, the pipeline is not built
    (on the MNIST-1D conv ResNet with batch norm, its one-micro-batch pipeline took
    1.1 s of a 5.2 s choice to time, at 200 ms a step against solo's 158 and the
    batch split's 122).  The same on every rank."""
    ranks = cal.transport.size
    serial = _serial_step(cal) if ranks > 1 else None
    if serial is None:
        return None
    floor = serial if one_micro else serial / ranks
    best = cal.fastest()
    if floor < best:
        return None
    how = (f"the serial step, {1000 * serial:.1f} ms (one micro-batch, for batch norm: "
           "its stages run one after another)" if one_micro else
           f"the serial step's {1000 * serial:.1f} ms over {ranks} ranks, "
           f"{1000 * floor:.1f} ms")
    return (f"not timed: its stages run at {torch.get_num_threads()} thread(s) a rank, "
            f"where solo timed the serial step, so its step takes at least {how}: no "
            f"faster than the fastest so far ({1000 * best:.1f} ms)")


def _time_pipelines(cal: _Calibration, fresh: Callable[[], ODENet], comm: Any,
                    schedules: Sequence[str], counts: tuple[int, ...], one_micro: bool
                    ) -> None:
    """Each pipeline schedule at its fastest micro-batch count (`PipelineNet.
    tune_microbatches`), while the budget lasts and while one may be the fastest
    (`_pipeline_floor`)."""
    floor = _pipeline_floor(cal, one_micro)
    for sched in schedules:
        why = floor or cal.spent(len(counts) * (1 + cal.steps), serial_long=True,
                                 setup=len(counts) * PIPELINE_SETUP)
        if why is not None:
            cal.trials.append(Trial(f"pipeline {sched}", None, why))
            continue
        # built at the largest count (torch refuses 1F1B with fewer micro-batches than
        # stages); the count is then measured
        pipe = PipelineNet(fresh(), comm, schedule=sched, microbatches=max(counts))
        try:
            per = pipe.tune_microbatches(cal.x, cal.y, cal.loss_fn, counts,
                                         repeats=cal.steps, bound=cal.fastest())
        except ValueError as exc:  # no count suits (raised alike)
            cal.trials.append(Trial(f"pipeline {sched}", None, str(exc)))
            pipe.close()
            continue
        tried = ", ".join(f"m={m}: {1000 * s:.1f} ms" for m, s in per.items())
        note = f"micro-batches by measurement ({tried})" + (
            f"; one micro-batch: {cal.rows.coupled or cal.rows.buffers}" if one_micro else "")
        cal.measure(f"pipeline {sched} m={pipe.microbatches}", pipe, note,
                    per[pipe.microbatches])


def _time_one(cal: _Calibration, what: str, fresh: Callable[[], ODENet], comm: Any,
              layerparallel: Optional[dict[str, Any]]) -> None:
    """Build and time the candidate `what` ("serial", "solo", "data" or
    "layerparallel"); serial and the batch split that layer-parallel's tuning timed
    are kept with its times, and built only if chosen."""
    if what in cal.tabled:
        ran = "serial (replicated)" if what == "serial" else \
            "serial (replicated, batch split)"
        build: Callable[[], TrainingMethod] = \
            (lambda: SerialMethod(fresh(), comm)) if what == "serial" else \
            (lambda: DataParallelNet(fresh(), comm, engine=_data_engine(cal)))
        cal.measure(what, build, f"timed by layer-parallel's tuning, as its \"{ran}\" "
                    "(ms per pass)", cal.tabled[what])
    elif what == "serial":
        cal.measure("serial", SerialMethod(fresh(), comm),
                    "every rank runs the whole net (replicated serial)")
    elif what == "solo":
        solo = SoloMethod(fresh(), comm)
        per = solo.tune_threads(cal.x, cal.y, cal.loss_fn, cal.steps, cal.fastest(),
                                keep_grads=cal.wants_serial_grads)
        if cal.wants_serial_grads:  # (its steps are the serial net's on this batch)
            cal.serial_grads = _flat_grads(solo) if solo.rank == 0 else {}
            solo._zero_grad()
        cal.solo = dict(per)
        tried = ", ".join(f"{k}: {1000 * s:.1f} ms" for k, s in sorted(per.items()))
        cal.measure("solo", solo, f"rank 0 alone with {solo.threads} torch thread(s), the "
                    f"others waiting (serial at the thread count measured fastest: {tried})",
                    per[solo.threads])
    elif what == "data":
        engine = _data_engine(cal)
        data = DataParallelNet(fresh(), comm, engine=engine)
        note = f"batch split, gradients averaged ({engine})"
        if cal.exact and cal.rows.coupled is not None:
            ok, figures = _split_error(cal, data, fresh, _given_bound(layerparallel))
            if not ok:
                cal.trials.append(Trial("data", None, f"stands aside: {figures}"))
                data.close()
                return
            note += f"; {figures}"
        cal.measure("data", data, note)
    else:
        _time_layerparallel(cal, fresh, comm, layerparallel)


def _data_engine(cal: _Calibration) -> str:
    """The batch split's gradient exchange: DistributedDataParallel over a
    torch.distributed group, else one all-reduce."""
    return "ddp" if cal.transport.backend in ("gloo", "nccl") else "allreduce"


def _time_layerparallel(cal: _Calibration, fresh: Callable[[], ODENet], comm: Any,
                        layerparallel: Optional[dict[str, Any]]) -> None:
    """The layer-parallel candidate: under ``options="auto"`` its own tuning on this
    batch (bounded by the steps to come) chooses its setting, and the setting's pass
    time there is its time; the tuning's times of replicated serial and the batch
    split stand for the serial and data candidates (`_Calibration.tabled`), and
    solo's serial step is the least exact propagation's pass takes (`autotune.tune`'s
    `serial_floor`).  A fixed setting is timed on steps."""
    kw = {"options": "auto", **(layerparallel or {})}
    lp = LayerParallelMethod(fresh(), comm, **kw)
    if kw["options"] != "auto":
        cal.measure("layerparallel", lp, f"setting given: {kw['options']}")
        return
    best = min((s for _, s in cal.held.values()), default=None)
    limit: Optional[Callable[[float], float]] = None
    if best is not None and cal.steps_to_come is not None:
        # the share of the steps to come at the fastest step found, the tuning's
        # included: its own faster find shrinks what it may spend
        steps, spent = cal.share * cal.steps_to_come, cal.agreed(cal.elapsed())

        def limit(fastest: float) -> float:
            return max(0.0, steps * fastest - spent)

    lp.model.tune(cal.x, cal.y, cal.loss_fn, steps=cal.steps_to_come, to_beat=best,
                  limit=limit, serial_floor=_serial_step(cal))
    got = lp.model.tuner.results[-1]
    for m in got.table:
        if m.candidate.replicated:
            cal.tabled["data" if m.candidate.split else "serial"] = m.seconds
    cand = got.choice.candidate
    cal.measure("layerparallel", lp, f"auto's setting: {cand.name(cal.transport.size)} "
                "(ms per pass, timed by its tuning)", got.choice.seconds,
                ("data" if cand.split else "serial") if cand.replicated else None)


def _timed_steps(steps: int, steps_to_come: Optional[int], share: float,
                 timings: int) -> int:
    """Timed steps per candidate: `steps`, fewer where the training to come is short,
    so that the `timings` (`_timings`), each a warm-up and the timed steps, together
    cost about the calibration's share of it.  The same on every rank: it depends on
    the arguments alone."""
    if steps_to_come is None:
        return steps
    return max(1, min(steps, int(share * steps_to_come / max(timings, 1)) - 1))


def _timings(methods: Sequence[str], schedules: Sequence[str],
             microbatches: Sequence[int], solo_counts: int) -> int:
    """The step timings choosing runs at most: one per candidate, a pipeline's one per
    schedule and micro-batch count, solo's one per thread count."""
    return sum(len(schedules) * len(microbatches) if m == "pipeline" else
               solo_counts if m == "solo" else 1 for m in methods)


def _online(base: ODENet, comm: Any, x: Tensor, y: Any, loss_fn: LossFn,
            layerparallel: Optional[dict[str, Any]], steps_to_come: int, share: float,
            order: Sequence[str], timings: int, t0: float) -> TrainingMethod:
    """Layer-parallel under auto, tuning on the training's own steps: its exact
    settings, replicated serial and the batch split, train the first steps in turn,
    timed, and the faster trains on (`AutoTuner.tune` with
    ``online=True``; where its first timed step finds the budget has room, its full
    tuning runs then).  For a training too short to pay for a step of each candidate
    timed apart (`choose_method`'s ``online``)."""
    lp = LayerParallelMethod(copy.deepcopy(base), comm,
                             **{"options": "auto", **(layerparallel or {})})
    lp.model.tune(x, y, loss_fn, steps=steps_to_come, online=True)
    paid = share * steps_to_come
    aside = (f"not timed: the share ({100 * share:g} %) of the {steps_to_come} steps to "
             f"come pays for {paid:.3g} step(s), fewer than a warm-up and a timed step "
             f"for each of the {timings} timings choosing would run")
    trials = [Trial("layerparallel", None, "auto's exact settings (replicated serial and "
                    "the batch split) timed on the training's own steps")]
    trials += [Trial(m, None, aside) for m in order if m != "layerparallel"]
    why = ("the training is too short to time the candidates apart: layer-parallel's "
           "auto times its exact settings on the training's own steps, which cost "
           "nothing beyond them")
    lp.choice = Choice(lp.size, 0, tuple(trials), "layerparallel",  # type: ignore[attr-defined]
                       time.perf_counter() - t0, why)
    return lp


def _given_bound(layerparallel: Optional[dict[str, Any]]) -> Optional[float]:
    """The relative gradient error the layer-parallel candidate's accuracy policy
    fixes (None: auto measures its bound)."""
    policy = (layerparallel or {}).get("accuracy")
    if policy is None or isinstance(policy, bool):
        return None
    if getattr(policy, "noise_fraction", None) is not None:
        return None
    return float(policy.max_rel_error)


def choose_method(net: Union[ODENet, Callable[[], ODENet]], comm: Any, x: Tensor, y: Any,
                  loss_fn: LossFn, *, methods: Sequence[str] = METHOD_NAMES,
                  steps: int = 3, exact: bool = True,
                  layerparallel: Optional[dict[str, Any]] = None,
                  schedules: Sequence[str] = DEFAULT_SCHEDULES,
                  microbatches: Sequence[int] = (1, 2, 4, 8),
                  steps_to_come: Optional[int] = None, calibration_share: float = 0.05,
                  timer: Optional[Timer] = None, online: bool = False) -> TrainingMethod:
    """The fastest way of training `net` on the ranks of `comm`, measured on the batch
    (`x`, `y`) with `loss_fn` (collective: call it on every rank with the same
    arguments and batch).  Returns the chosen `TrainingMethod`, holding a copy of
    `net` in `net`'s state, with ``.choice`` (a `Choice`) set; build the optimizer over
    its ``parameters()``.

    methods: which of "serial" (every rank the whole net), "data", "layerparallel",
        "solo" (rank 0 with every core), "pipeline" to time, timed in that order
        (solo before layer-parallel and data; with batch norm, data before
        layer-parallel).
    layerparallel: `LayerParallel`'s keyword arguments for its candidate (default
        ``options="auto"``: its own setting chosen by `Auto`, tuned on this batch, held
        to its bound on the gradient error).
    schedules, microbatches: the pipeline schedules timed, each at its fastest count
        among `microbatches` (`PipelineNet.tune_microbatches`).
    exact: only candidates whose gradients are the serial net's (see the module).
    steps_to_come: the training steps that will follow, if known.  Choosing then
        costs at most about `calibration_share` of them (at the fastest candidate's
        step): each candidate is timed on fewer steps where they are few
        (`_timed_steps`), and once choosing has cost its share the candidates left are
        not timed (the table says so); the layer-parallel candidate's own tuning is
        bounded by them too (`Auto.tune`).
    timer: maps a candidate's name and measured seconds to the seconds the decision
        uses (default: the measurement).
    online: the returned method trains from the next step on (``layerpar train``).
        Where `calibration_share` of the steps to come pays for fewer steps than a
        warm-up and a timed step of each candidate, and layer-parallel's replicated
        settings can split the batch (no batch norm), nothing is timed apart: the
        layer-parallel candidate under auto is returned, its exact settings
        (replicated serial and the batch split) timed on the training's own steps,
        the faster kept (on digits, 240 steps of 4 ms, choosing had cost 0.1 s of a
        half-second training); solo and the pipeline are then not timed.
    """
    transport = make_transport(comm)
    err: Optional[BaseException] = None
    try:
        base = as_net(net)
        bad = [m for m in methods if m not in METHOD_NAMES]
        if bad or not methods:
            raise ValueError(f"`methods` must name some of {list(METHOD_NAMES)}, got "
                             f"{list(methods)}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be an int >= 1, got {steps!r}")
        if not 0 < calibration_share <= 1:
            raise ValueError(f"`calibration_share` must be in (0, 1], got "
                             f"{calibration_share!r}")
    except Exception as exc:  # noqa: BLE001 - raised alike on every rank by agree
        err = exc
    transport.agree({"methods": list(methods), "steps": steps, "exact": exact,
                     "schedules": list(schedules), "microbatches": list(microbatches),
                     "steps_to_come": steps_to_come, "share": calibration_share,
                     "online": online},
                    err, "choose_method's arguments (methods, steps, exact, schedules, "
                    "microbatches, steps_to_come, calibration_share, online)")
    # the thread counts solo tries are rank 0's (`SoloMethod.tune_threads`)
    solo_counts = len(transport.bcast_object(thread_counts(), 0)) if "solo" in methods \
        and transport.size > 1 else len(thread_counts())
    t0 = time.perf_counter()
    # (what a split batch changes: batch norm by its type, the user's modules measured)
    rows = agreed_rows(base, x, transport)
    order = _order(methods, base, rows)
    timings = _timings(order, schedules, microbatches, solo_counts)
    if online and steps_to_come is not None and "layerparallel" in order and \
            (layerparallel or {}).get("options", "auto") == "auto" and \
            calibration_share * steps_to_come < 2 * timings and \
            split_refusal(base) is None and rows == RowProbe(None, None) and x.dim() > 0 \
            and x.shape[0] >= transport.size:
        # (only where its trial times the batch split too: with batch norm replicated
        # serial alone would stand for every method, and on the conv ResNet, 250
        # steps, it trained at 183 ms a batch against the batch split's 127; nor where
        # a module keeps a statistic or draws random numbers of its own, which
        # layer-parallel refuses once its tuning runs a layer-parallel pass: the
        # others are timed apart then)
        transport.close()
        with frozen_heap():
            return _online(base, comm, x, y, loss_fn, layerparallel, steps_to_come,
                           calibration_share, order, timings, t0)
    cal = _Calibration(transport, x, y, loss_fn,
                       _timed_steps(steps, steps_to_come, calibration_share, timings),
                       timer or (lambda name, s: s), steps_to_come, calibration_share)
    cal.t0, cal.exact, cal.rows = t0, exact, rows
    # (the buffers the timing steps move are put back from it in the chosen method)
    pristine = {k: v.detach().clone() for k, v in base.state_dict().items()}

    def fresh() -> ODENet:  # (nothing trains `base` itself: a copy is in its state)
        return copy.deepcopy(base)

    cal.wants_serial_grads = exact and "data" in order and "solo" in order \
        and rows.coupled is not None and _stands_aside(base, "data", exact, rows)[0] is None
    # the timing steps draw from the generators on some ranks only (solo's on rank 0, a
    # pipeline's on its dropout's stage): put back, every rank's streams stay in step,
    # and as serial training would have them (a shuffling DataLoader's next order)
    streams = GeneratorStates([m for m in base.layers if not isinstance(m, Segment)])
    try:
        with frozen_heap():  # (the copies of the net set off full collections)
            method = _time_candidates(cal, base, order, fresh, comm, exact, solo_counts,
                                      schedules, microbatches, layerparallel, pristine)
    finally:
        streams.restore()
    transport.close()
    return method


def _time_candidates(cal: _Calibration, base: ODENet, order: list[str],
                     fresh: Callable[[], ODENet], comm: Any, exact: bool, solo_counts: int,
                     schedules: Sequence[str], microbatches: Sequence[int],
                     layerparallel: Optional[dict[str, Any]],
                     pristine: dict[str, Tensor]) -> TrainingMethod:
    """`choose_method`'s timings, candidate by candidate in `order`, and the fastest
    kept (`_keep_fastest`)."""
    for what in order:
        why, one_micro = _stands_aside(base, what, exact, cal.rows)
        refused = step_refusal(cal.y) if what == "pipeline" and why is None else None
        why = why if refused is None else f"refused: {refused}"
        why = why or (None if what == "pipeline" or what in cal.tabled else
                      cal.spent((solo_counts if what == "solo" else 1) * (1 + cal.steps)))
        if why is not None:
            cal.trials.append(Trial(what, None, why))
            continue
        try:
            if what == "pipeline":
                _time_pipelines(cal, fresh, comm, schedules,
                                (1,) if one_micro else tuple(microbatches), one_micro)
            else:
                _time_one(cal, what, fresh, comm, layerparallel)
        except REFUSALS as exc:
            # refusals raised alike on every rank by the methods' own agreements
            cal.trials.append(Trial(what, None, f"refused: {exc}"))
        except RemoteError as exc:
            # a refusal one rank's pass found (a layer it owns), the others told of it
            kind, _, text = exc.remote_message.partition(": ")
            if kind not in {t.__name__ for t in REFUSALS}:
                raise
            cal.trials.append(Trial(what, None, f"refused: {text}"))
    return _keep_fastest(cal, pristine)


#: what a candidate raises to refuse the net or its settings (`_time_candidates`)
REFUSALS = (ValueError, TypeError, NotImplementedError)


def _order(methods: Sequence[str], base: ODENet, rows: RowProbe) -> list[str]:
    """The order the candidates of `methods` are timed in (`METHOD_NAMES`' order,
    but for solo and, with batch norm or another module that couples rows (`rows`),
    the batch split; see the module)."""
    order = sorted(methods, key=METHOD_NAMES.index)
    if "layerparallel" in order and "data" in order and (
            split_refusal(base) is not None or rows.coupled is not None):
        # layer-parallel's tuning will not time the batch split (batch norm): time it
        # first, so that its time is one the tuning must beat and its budget counts
        order.remove("data")
        order.insert(order.index("layerparallel"), "data")
    if "solo" in order and ("layerparallel" in order or "data" in order):
        # the serial run a user would make (rank 0 with every core) costs a few steps:
        # timed first, before layer-parallel's tuning, which may spend the whole share
        # (the pre-norm MNIST-1D net's did, and solo, 10 % faster per step there than
        # the replicated serial chosen, was never timed), and before the batch split,
        # whose check under batch norm takes the serial gradient its steps computed
        order.remove("solo")
        order.insert(min(order.index(m) for m in ("layerparallel", "data") if m in order),
                     "solo")
    return order


def _keep_fastest(cal: _Calibration, pristine: dict[str, Tensor]) -> TrainingMethod:
    """The fastest candidate timed (on equal times the earlier name), built where it
    was timed inside layer-parallel's tuning, its buffers put back to `pristine`, with
    its `Choice`; the others closed (alike on every rank: the times are agreed)."""
    held = cal.held
    if not held:
        raise ValueError("no candidate of `methods` runs this net here: " + "; ".join(
            f"{t.name}: {t.note}" for t in cal.trials))
    chosen = min(held, key=lambda n: (held[n][1], METHOD_NAMES.index(n.split()[0]), n))
    for name, (built, _) in held.items():
        if name != chosen and isinstance(built, TrainingMethod):
            built.close()
    got = held[chosen][0]
    method = got if isinstance(got, TrainingMethod) else got()
    if isinstance(method, SoloMethod):
        method.hold_threads()  # (the optimizer's step too, until it is closed)
    _restore_buffers(method, pristine)
    method.choice = Choice(cal.transport.size, cal.steps,  # type: ignore[attr-defined]
                           tuple(cal.trials), chosen, time.perf_counter() - cal.t0)
    return method


def _restore_buffers(method: TrainingMethod, pristine: dict[str, Tensor]) -> None:
    """Put back the buffers (batch norm's running statistics, its batch counters) the
    timing steps moved, in the tensors the chosen method computes with."""
    net = method.model.whole_net if isinstance(method, LayerParallelMethod) else \
        getattr(method, "net", None)
    if not isinstance(net, nn.Module):
        return
    with torch.no_grad():
        for name, buf in net.named_buffers():
            saved = pristine.get(name)
            if saved is not None and saved.shape == buf.shape:
                buf.copy_(saved)
