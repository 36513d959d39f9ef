"""Pipeline parallelism: the `ODENet`'s layers in stages over the ranks, micro-batches
flowing through them (`torch.distributed.pipelining`).

Stages are cut where `LayerParallel` cuts: each segment's residual layers in
contiguous blocks of near-equal size (`layerpar.mgrit.grid.Partition`), the plain
layers before the first segment with the first block, every other plain layer with
the block before it (so on the last rank, as in `LayerParallel`).  `StagePlan` is
that cut as plain data (print it); the schedule, chosen by name, orders the work:

  "gpipe", "1f1b"      one stage per rank.  One segment: rank q holds LayerParallel's
                       block q.  Several segments: all residual layers are cut into P
                       contiguous blocks (LayerParallel puts one block of every segment
                       on each rank, which a one-stage schedule cannot run).
  "interleaved",       v stages per rank (`stages_per_rank`, default the number of
  "looped-bfs",        segments, or 2 with one segment), placed round robin: stage s on
  "zero-bubble"        rank s mod P.  Each segment is cut into P·v/S blocks; with v = S
                       every rank holds exactly LayerParallel's layers.
  "zbv"                two stages per rank in a V: stage s on rank s, then 2P-1-s.

Each rank builds (or is given) the whole net, keeps its stages' layers, and trains
only those: `parameters()` are its stages' parameters, `gather_state_dict()` merges
every rank's.  The loss lives on the rank of the last stage and is broadcast, so
`train_step` returns it on every rank.  Micro-batches are equal row slices of the
batch, `microbatches` of them; torch scales the gradients by 1/count, so they are the
serial net's for the mean loss over the batch.  A batch whose rows do not divide by
`microbatches` (an epoch's last, smaller one) runs as the most micro-batches that
divide them, under a schedule of the same stage placement where the one asked for
refuses that count (1F1B with fewer micro-batches than stages runs as GPipe).
`tune_microbatches` chooses the count by timing a few steps of each candidate.

torch.distributed.pipelining needs a torch.distributed process group: under
torchrun pass ``torch.distributed.group.WORLD``; under mpiexec pass the mpi4py
communicator and the world group is initialised from it (`process_group_from_mpi`).
Dropout draws masks of each rank's own, new every step (`StepStreams`: not the serial
net's), with every rank's generators kept in step; other random draws in a stage are
refused at the first step.  Batch norm sees micro-batch statistics.  A parameter used by
two stages (tied weights, a shared block) is refused: ranks would train copies of
their own, and torch scales each stage's gradients apart.  With several micro-batches
`loss_fn` must be a mean over the rows (no sum, no class weights, no ignored rows):
every step the last stage's rank compares the whole batch's loss with its
micro-batches' mean and refuses the step where they differ.  A failure on one rank
during a step stops every rank with its message (`TrainingMethod._apart`): the
schedules send on a group of the method's own, which the failing rank severs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from ..._checks import positive_int
from ...mgrit.grid import Partition
from ...mgrit.transport import DEFAULT_TIMEOUT, check_timeout, make_transport
from ...ode.net import ODENet, Segment
from ...ode.rng import GeneratorStates, StepStreams
from .. import optimizers
from ..agree import layer_key
from ..batched import buffer_versions
from ..checkpoint import _name_order, clip_over_ranks
from ..move import Like, move
from .dist import as_process_group, own_group, release_group
from .method import (
    LossFn,
    TrainingMethod,
    as_net,
    check_check_inputs,
    parts_loss_error,
    step_seconds,
)

__all__ = ["SCHEDULES", "PipelineNet", "StagePlan", "step_refusal"]

def step_refusal(y: Any) -> Optional[BaseException]:
    """What a pipeline refuses of a step before any message, whatever the net (None:
    nothing): targets that are not a tensor with a row per sample (or None), and
    `torch.autocast` (on the CPU or CUDA) around the step.  `choose_method` asks it
    before building a pipeline."""
    if not (y is None or isinstance(y, Tensor) and y.dim() > 0):
        return TypeError(f"`y` must be a tensor with a row per sample, or None: torch's "
                         f"schedules cut the targets into micro-batches, got "
                         f"{type(y).__name__}")
    if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return RuntimeError("PipelineNet does not run under torch.autocast: torch's "
                            "stages hand activations between ranks in buffers of the "
                            "net's dtype, which autocast's outputs would not fill. Cast "
                            "the net instead (net.to(torch.bfloat16)), or train with "
                            "DataParallelNet or LayerParallel")
    return None


#: schedule name -> (torch class name, placement: "single", "loop" or "v")
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved": ("ScheduleInterleaved1F1B", "loop"),
    "looped-bfs": ("ScheduleLoopedBFS", "loop"),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
}

#: where a batch's rows do not divide by `microbatches` and torch's schedule refuses
#: every count that does divide them (1F1B asks at least as many as stages), the
#: schedule of the same stage placement that runs it
_FALLBACK = {"1f1b": "gpipe", "interleaved": "looped-bfs", "zero-bubble": "looped-bfs"}

_TAG = 31107

#: how torch's stages begin the RuntimeError they wrap a forward's or backward's in
_WRAPS = ("[Stage ", "Failed to run stage backward")

# a unit of a stage: (index in net.layers, (first step, stop step) of a segment, or None
# for a plain layer)
Unit = tuple[int, Optional[tuple[int, int]]]


@dataclass(frozen=True)
class StagePlan:
    """Which layers each pipeline stage runs and which rank holds it (plain data, the
    same on every rank; ``print(StagePlan.build(net, 4, "interleaved"))``)."""

    stages: tuple[tuple[Unit, ...], ...]
    ranks: tuple[int, ...]
    n_ranks: int

    @classmethod
    def build(cls, net: ODENet, n_ranks: int, schedule: str = "1f1b",
              stages_per_rank: Optional[int] = None) -> StagePlan:
        """The stages of `net` over `n_ranks` ranks for `schedule` (see the module)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"`schedule` must be one of {list(SCHEDULES)}, got {schedule!r}")
        placement = SCHEDULES[schedule][1]
        segs = net.segments
        n_segs = len(segs)
        if placement == "single":
            v = 1
        elif placement == "v":
            v = 2
        else:
            v = n_segs if n_segs > 1 else 2
        if stages_per_rank is not None:
            positive_int("stages_per_rank", stages_per_rank)
            if stages_per_rank != v and placement != "loop":
                raise ValueError(f"`stages_per_rank` must be {v} (or None) with schedule "
                                 f"{schedule!r}, got {stages_per_rank}")
            v = stages_per_rank
        if placement == "single" and n_segs > 1:
            stages = cls._contiguous(net, n_ranks)
        else:
            if v % n_segs:
                raise ValueError(
                    f"`stages_per_rank` ({v}) must be a multiple of the net's {n_segs} "
                    f"segments with schedule {schedule!r} (each segment is cut into "
                    "P * stages_per_rank / segments blocks)")
            stages = cls._per_segment(net, n_ranks * v // n_segs)
        n = len(stages)
        if placement == "v":
            ranks = tuple(s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n))
        else:
            ranks = tuple(s % n_ranks for s in range(n))
        return cls(tuple(tuple(s) for s in stages), ranks, n_ranks)

    @staticmethod
    def _per_segment(net: ODENet, pieces: int) -> list[list[Unit]]:
        stages: list[list[Unit]] = []
        head: list[Unit] = []
        for k, layer in enumerate(net.layers):
            if not isinstance(layer, Segment):
                (stages[-1] if stages else head).append((k, None))
                continue
            if layer.n_steps < pieces:
                raise ValueError(
                    f"segment net.layers[{k}] has {layer.n_steps} layers but is cut into "
                    f"{pieces} pipeline stages: use fewer ranks or `stages_per_rank`")
            part = Partition.build(layer.n_steps, pieces)
            for i in range(pieces):
                steps = part.steps(i)
                stages.append([*head, (k, (steps.start, steps.stop))])
                head = []
        return stages

    @staticmethod
    def _contiguous(net: ODENet, n_stages: int) -> list[list[Unit]]:
        total = net.n_steps_total
        if total < n_stages:
            raise ValueError(f"the net has {total} residual layers but {n_stages} "
                             "pipeline stages: use fewer ranks")
        part = Partition.build(total, n_stages)
        stages: list[list[Unit]] = [[] for _ in range(n_stages)]
        offset, last = 0, 0
        for k, layer in enumerate(net.layers):
            if not isinstance(layer, Segment):
                stages[last].append((k, None))
                continue
            for q in range(n_stages):
                r = part.steps(q)
                lo, hi = max(r.start, offset), min(r.stop, offset + layer.n_steps)
                if lo < hi:
                    stages[q].append((k, (lo - offset, hi - offset)))
                    last = q
            offset += layer.n_steps
        return stages

    def stages_of(self, rank: int) -> list[int]:
        """The stage indices `rank` holds, in order."""
        return [s for s, q in enumerate(self.ranks) if q == rank]

    def __str__(self) -> str:
        rows = [f"StagePlan: {len(self.stages)} stages over {self.n_ranks} ranks"]
        for s, units in enumerate(self.stages):
            parts = [f"layers[{k}]" if st is None else
                     f"layers[{k}] steps {st[0]}-{st[1] - 1}" for k, st in units]
            rows.append(f"  stage {s} on rank {self.ranks[s]}: " + ", ".join(parts))
        return "\n".join(rows)


class _Piece(nn.Module):
    """Some consecutive blocks of a Segment, registered under their indices so that
    parameter names match the serial net's (``blocks.<n>.…``)."""

    def __init__(self, seg: Segment, steps: range) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(n): seg.blocks[n] for n in steps})


class _Stage(nn.Module):
    """One pipeline stage: its units of the net in order.  Parameter names are the
    serial net's (``layers.<k>.…``)."""

    def __init__(self, net: ODENet, units: Sequence[Unit]) -> None:
        super().__init__()
        seg_index = {k: j for j, (k, _) in enumerate(net.segments)}
        self.layers = nn.ModuleDict()
        self._run: list[tuple[nn.Module, Optional[range], int]] = []
        for k, steps in units:
            layer = net.layers[k]
            if steps is None:
                self.layers[str(k)] = layer
                self._run.append((layer, None, -1))
            else:
                if not isinstance(layer, Segment):
                    raise TypeError(f"a split layer must be a Segment, got "
                                    f"{type(layer).__name__}")
                rng = range(*steps)
                self.layers[str(k)] = _Piece(layer, rng)
                self._run.append((layer, rng, seg_index[k]))

    def forward(self, x: Tensor) -> Tensor:
        for layer, steps, j in self._run:
            if steps is None:
                x = layer(x)
            else:
                if not isinstance(layer, Segment):
                    raise TypeError(f"a split layer must be a Segment, got "
                                    f"{type(layer).__name__}")
                for n in steps:
                    x = layer.step(x, n, n + 1, segment_index=j)
        return x


def _refuse_shared_across_stages(net: ODENet, plan: StagePlan) -> None:
    """ValueError where one parameter or buffer serves two stages (a block module
    shared by several layers, tied weights): stages on different ranks would each
    train their own copy with their own share of the gradient, and torch scales each
    stage's gradients by 1/micro-batches, so one tensor of two stages on one rank is
    scaled twice: silently apart from serial either way.  Within a stage it may be
    shared.  From the whole net, which every rank holds: raised alike on every rank."""
    owner: dict[int, tuple[int, str]] = {}  # id -> (stage, first name)
    for s, units in enumerate(plan.stages):
        stage = _Stage(net, units)
        tensors = [*stage.named_parameters(remove_duplicate=False),
                   *stage.named_buffers(remove_duplicate=False)]
        for name, t in tensors:
            first_stage, first = owner.setdefault(id(t), (s, name))
            if first_stage != s:
                where = (f"ranks {plan.ranks[first_stage]} and {plan.ranks[s]}: each rank "
                         "would train its own copy with its own stages' gradient"
                         if plan.ranks[first_stage] != plan.ranks[s] else
                         f"rank {plan.ranks[s]}, whose schedule scales each stage's "
                         "gradients by 1/micro-batches, so this tensor's twice")
                raise ValueError(
                    f"`{name}` is the same tensor as `{first}`, and the pipeline puts "
                    f"them in stages {first_stage} and {s}, on {where} (not serial's). "
                    "Untie them, or train with DataParallelNet or LayerParallel, which "
                    "handle a parameter shared by several layers")


class PipelineNet(TrainingMethod):
    """Train `net` as a pipeline over the ranks of `comm` (`torch.distributed.pipelining`).

    net: an `ODENet`, or a zero-argument factory returning one (called on every rank:
        seed the global generator first, or load one state dict everywhere).  Each rank
        trains only its stages' layers of it: the others stay as they were there, so
        the trained net is `gather_state_dict()` (or `eval_forward`), not ``.net``.
    comm: a torch.distributed process group, or an mpi4py communicator spanning the job
        (the world group is then initialised from it with gloo: `process_group_from_mpi`).
    schedule: "gpipe", "1f1b", "interleaved", "looped-bfs", "zero-bubble" or "zbv"
        (see the module docstring for where each puts the stages).
    microbatches: micro-batches per batch (torch asks at least as many as stages of
        "1f1b" and "zbv"); a batch whose rows it does not divide runs as fewer (see
        the module docstring).  `tune_microbatches` chooses it by measurement.
    stages_per_rank: stages per rank of the looped schedules (default: the number of
        segments, or 2 with one segment); must be a multiple of the number of segments.
    check_inputs: for this many first steps compare the batch's shapes between ranks.
    timeout: seconds any wait of layerpar's own messages may take (loss, outputs,
        agreements); over gloo, where `comm` spans the world, also the timeout of
        the method's own group (`own_group`), which bounds the schedule's sends and
        receives (otherwise they are bounded by `comm`'s).
    """

    name = "pipeline"
    splits_rows = True

    def __init__(self, net: Union[ODENet, Callable[[], ODENet]], comm: Any, *,
                 schedule: str = "1f1b", microbatches: int = 4,
                 stages_per_rank: Optional[int] = None, check_inputs: int = 10,
                 timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        if comm is None:
            raise TypeError("`comm` must be a torch.distributed process group or an mpi4py "
                            "communicator: a pipeline needs torch.distributed")
        self.group = as_process_group(comm)
        # every message (the schedules', layerpar's) on a group of the method's own,
        # which a failing rank severs (`TrainingMethod._apart`): the user's stays whole
        self._own = own_group(self.group, timeout)
        self._groups = (self._own,)
        self.transport = make_transport(self._own)
        err: Optional[BaseException] = None
        key: Any = None
        try:
            net = as_net(net)
            self.plan = StagePlan.build(net, self.transport.size, schedule, stages_per_rank)
            self.microbatches = positive_int("microbatches", microbatches)
            self.check_inputs = check_check_inputs(check_inputs)
            timeout = check_timeout(timeout)
            self.schedule = schedule
            _refuse_shared_across_stages(net, self.plan)
            self._local = {q: _Stage(net, self.plan.stages[q])
                           for q in self.plan.stages_of(self.transport.rank)}
            self.device = next(iter(net.parameters())).device
            one = [(1,)] * len(self.plan.stages)
            # torch's refusals, before any message
            self._build(1, one, one, torch.float64, schedule, self.microbatches)
            key = {"schedule": schedule, "microbatches": microbatches,
                   "stages_per_rank": stages_per_rank, "check_inputs": check_inputs,
                   **{n: v for k, m in enumerate(net.layers) for n, v in
                      layer_key(k, m).items()}}
        except Exception as exc:  # noqa: BLE001 - raised alike on every rank by agree
            err = exc
        self.transport.agree(key, err, "PipelineNet settings (schedule, microbatches, "
                             "stages_per_rank, layers)")
        if not isinstance(net, ODENet):
            raise TypeError(f"`net` must build an ODENet, got {type(net).__name__}")
        self.transport.timeout = timeout
        self.net = net
        self._streams = StepStreams(net, self.rank)
        mine = [t for mod in self._local.values() for t in mod.parameters()]
        optimizers.watch(self, mine)  # (another rank's optimizer state, LBFGS: refused)
        local = set(map(id, mine))
        # the net's parameters this rank does not train: a loss reaching them (a penalty
        # on the whole net's weights) would move stale copies, not their owners' (a hook
        # notes them: nothing to walk per step)
        self._reached: list[str] = []
        self._hooks = [t.register_post_accumulate_grad_hook(
            lambda t, n=n: self._reached.append(n))
            for n, t in net.named_parameters() if id(t) not in local and t.requires_grad]
        # this rank's buffers that forward() must not update with several micro-batches
        # (all but batch norm's statistics, documented as the micro-batches')
        self._updated = [(f"{n}.{b}" if n else b, t) for mod in self._local.values()
                         for n, m in mod.named_modules()
                         if not isinstance(m, nn.modules.batchnorm._NormBase)
                         for b, t in m.named_buffers(recurse=False)]
        # (input shape, dtype, m) -> torch's schedule, its micro-batch count
        self._built: dict[tuple, tuple[Any, int]] = {}
        self._shapes: dict[tuple, list[tuple[int, ...]]] = {}
        self._loss_fn: Optional[LossFn] = None
        self._parts = self.microbatches  # micro-batches of this step's batch
        # this step's micro-batches' (outputs, targets), detached, on the last stage's rank
        self._seen: list[tuple[Tensor, Any]] = []

    # -- shapes and torch's objects --------------------------------------------------------
    def _stage_shapes(self, x: Tensor) -> list[tuple[int, ...]]:
        """Per stage, the shape of its output without the batch dimension, from one row
        run through the whole local net (no gradients, modules in eval mode for it:
        shapes only, so other ranks' stale layers do no harm)."""
        key = (tuple(x.shape[1:]), x.dtype)
        got = self._shapes.get(key)
        if got is None:
            modes = [(m, m.training) for m in self.net.modules()]
            # (a forward that counts its calls in a buffer must not count this one)
            kept = [(b, b.clone()) for b in self.net.buffers()]
            self.net.eval()
            try:
                with torch.no_grad():
                    u, got = x[:1], []
                    for units in self.plan.stages:
                        u = _Stage(self.net, units)(u)
                        got.append(tuple(u.shape[1:]))
            finally:
                for m, mode in modes:
                    m.training = mode
                with torch.no_grad():
                    for b, value in kept:
                        b.copy_(value)
            self._shapes[key] = got
        return got

    def _torch_schedule(self, x: Tensor) -> tuple[Any, int]:
        """torch's schedule for batches of `x`'s shape and dtype, and its micro-batch
        count: `microbatches` where the rows divide by it; else (an epoch's last,
        smaller batch) the most micro-batches that divide them, under the schedule
        asked for where torch takes that count, else under the one of the same
        placement that does (`_FALLBACK`).  Cached; the choice depends only on the
        rows, `microbatches`, the schedule and the ranks, so it is the same on every
        rank (a ValueError only where the rows divide by `microbatches` and torch
        refuses that count, which construction already tried)."""
        m = self.microbatches
        key = (tuple(x.shape), x.dtype, m)
        got = self._built.get(key)
        if got is not None:
            return got
        outs = self._stage_shapes(x)
        ins = [tuple(x.shape[1:]), *outs[:-1]]
        rows = x.shape[0]
        tries = [(self.schedule, m)] if rows % m == 0 else [
            (name, d) for d in range(min(m, rows), 0, -1) if rows % d == 0
            for name in dict.fromkeys((self.schedule, _FALLBACK.get(self.schedule,
                                                                     self.schedule)))]
        for k, (name, d) in enumerate(tries, 1):
            try:
                got = self._built[key] = \
                    self._build(rows // d, ins, outs, x.dtype, name, d), d
                return got
            except ValueError:  # torch refuses this count for this schedule
                if k == len(tries):
                    raise
        raise AssertionError("unreachable: the last try returns or raises")

    def _build(self, rows: int, ins: Sequence[tuple[int, ...]],
               outs: Sequence[tuple[int, ...]], dtype: torch.dtype, schedule: str,
               microbatches: int) -> Any:
        """torch's stages of this rank and `schedule`'s object, for `microbatches`
        micro-batches of `rows` rows; per stage the input and output shapes without
        the batch dimension.  No message: torch's own refusals (too few micro-batches
        for the schedule) come out as ValueError, alike on every rank."""
        import torch.distributed.pipelining as pp

        n = len(self.plan.stages)
        stages = [pp.PipelineStage(
            mod, s, n, self.device,
            # (torch allocates gradient buffers only for tensors that require grad: a
            # later stage's input and every output carry one back)
            input_args=torch.empty((rows, *ins[s]), dtype=dtype, device=self.device,
                                   requires_grad=s > 0),
            output_args=torch.empty((rows, *outs[s]), dtype=dtype, device=self.device,
                                    requires_grad=True),
            group=self._own) for s, mod in self._local.items()]
        cls = getattr(pp, SCHEDULES[schedule][0])
        single = SCHEDULES[schedule][1] == "single"
        return cls(stages[0] if single else stages, microbatches, loss_fn=self._loss)

    def _loss(self, out: Tensor, target: Any) -> Tensor:
        if self._loss_fn is None:
            raise RuntimeError("PipelineNet has no loss function to apply")
        if self._parts > 1:  # (compared with the whole batch's loss after the step)
            self._seen.append((out.detach(), target))
        return self._loss_fn(out, target)

    def _holds(self, stage: int) -> bool:
        return self.plan.ranks[stage] == self.rank

    # -- the interface ---------------------------------------------------------------------
    def _batch_error(self, x: Tensor, y: Any) -> Optional[BaseException]:
        err = super()._batch_error(x, y)
        return err if err is not None else step_refusal(y)

    def train_step(self, x: Tensor, y: Any, loss_fn: LossFn) -> float:
        self._check_batch(x, y)
        self._zero_grad()
        self._loss_fn = loss_fn
        losses: list[Tensor] = []
        last = len(self.plan.stages) - 1
        drawn = self._streams.active()
        before = None if drawn else GeneratorStates()
        said: list[Optional[str]] = []
        try:
            # (a failure in here, until every rank has its end of the step, stops every
            # rank: `_apart`)
            with self._apart():
                sched, self._parts = self._torch_schedule(x)
                versions = buffer_versions(self._updated)
                # (dropout: masks of this rank's own stages)
                with self._streams.step(), self._said_as():
                    sched.step(x, target=y, losses=losses, return_outputs=False)
                bad = self._parts_error(loss_fn, losses, versions)
                value = sum(float(t.detach()) for t in losses) / len(losses) \
                    if self._holds(last) else 0.0
                moved = 0.0 if before is None else float(before.moved())
                value, moved, flagged = self.transport.allreduce_sum(
                    [value, moved, float(bad is not None)])
                if flagged:  # (the last stage's rank's message, on every rank)
                    said = self.transport.allgather_object(bad, "the loss's test")
        finally:
            self._loss_fn, self._seen = None, []
        if said:  # (refused alike on every rank: not to be stepped)
            raise ValueError(next(m for m in said if m is not None))
        if moved:
            raise RuntimeError(
                f"the net drew random numbers on {int(moved)} rank(s) outside the dropout "
                "modules layerpar finds (torch.nn's Dropout kinds, in training mode): a "
                "pipeline runs each stage on one rank, whose global generator then moved "
                "alone, and the ranks' random streams (a shuffling DataLoader's) fell out "
                "of step. Draw them in torch.nn dropout modules, or train with "
                "DataParallelNet or LayerParallel")
        return value

    @contextlib.contextmanager
    def _said_as(self) -> Iterator[None]:
        """torch's errors in a schedule's step said as what they mean: a failure in a
        stage's forward or backward comes out as raised there (torch wraps it in a
        RuntimeError of its arguments' shapes); under a zero-bubble schedule, which runs
        the weights' gradients in a backward pass of their own, a loss that reaches the
        last stage's parameters other than through its output (a penalty on the
        weights) comes out as that."""
        try:
            yield
        except RuntimeError as exc:
            err: BaseException = exc
            while isinstance(err, RuntimeError) and err.__cause__ is not None and \
                    str(err).lstrip().startswith(_WRAPS):
                err = err.__cause__
            if SCHEDULES[self.schedule][0].endswith("ZeroBubble") and \
                    "backward through the graph a second time" in str(err):
                raise ValueError(
                    f"`loss_fn` reached the parameters of this rank's stages other than "
                    f"through the net's output (a penalty on the weights?): schedule "
                    f"{self.schedule!r} computes the weights' gradients in a backward "
                    "pass apart from the inputs', which such a loss cannot run. Add the "
                    "penalty to the gradients after train_step, or use another "
                    "schedule") from err
            if err is exc:
                raise
            raise err from None

    def _parts_error(self, loss_fn: LossFn, losses: list[Tensor], versions: list[int]
                     ) -> Optional[str]:
        """Why this step is not serial's (None: it is): the loss reached parameters of
        other ranks' stages; and cut into several micro-batches, a buffer a stage of
        this rank updated in forward() (once per micro-batch, where serial updates it
        once), or on the last stage's rank a loss that is not a mean over the rows
        (`parts_loss_error`)."""
        reached, self._reached = self._reached, []
        if reached:
            mine = {id(t) for t in self.parameters()}
            for t in self.net.parameters():  # (the stale copies' gradients)
                if id(t) not in mine:
                    t.grad = None
            return (f"`loss_fn` reached parameters of stages on other ranks ({reached[:3]}"
                    f"{' ...' if len(reached) > 3 else ''}): the loss runs on the last "
                    "stage's rank, whose copies of them are stale and not trained there, "
                    "so a penalty on the whole net's weights would miss their owners. Add "
                    "the penalty to the gradients after train_step (each rank over its "
                    "parameters()), or train with DataParallelNet or LayerParallel")
        if self._parts == 1:
            return None
        changed = [n for (n, t), v in zip(self._updated, versions) if t._version != v]
        if changed:
            return (f"the net updated its buffer(s) {changed} in forward(): a pipeline of "
                    f"{self._parts} micro-batches runs each stage {self._parts} times a "
                    "step where serial runs it once, so such a buffer (a counter, spectral "
                    "norm's vectors, running statistics of a module other than batch norm) "
                    "would not end as serial's. Train with microbatches=1 or LayerParallel")
        try:
            return parts_loss_error(loss_fn, self._seen, losses) if self._seen else None
        except Exception as exc:  # noqa: BLE001 - said on every rank by train_step
            return (f"`loss_fn` on the whole batch's output (compared every step with its "
                    f"micro-batches' mean) raised {type(exc).__name__}: {exc}")

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def close(self) -> None:
        """Remove the hooks on other ranks' stages' parameters and release the method's
        group (collective)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if not getattr(self, "_closed", False):
            release_group(self._own, self.group,
                          self.transport.failure is not None)
        super().close()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """The whole net's gradient norm, the ranks' stages' parts combined in rank
        order (no parameter serves two ranks: refused), every gradient scaled by
        ``max_norm / total`` where it exceeds it (collective)."""
        params = self.parameters()
        return clip_over_ranks(params, params, None if self.size == 1 else (
            lambda local: self.transport.allgather_object(local, "clip_grad_norm_")),
            max_norm, norm_type, error_if_nonfinite)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for mod in self._local.values():
            for n, p in mod.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def eval_forward(self, x: Tensor) -> Tensor:
        """The whole batch through the stages one after the other (no micro-batches),
        the output broadcast from the last stage's rank (collective)."""
        self._usable()
        err = TrainingMethod._batch_error(self, x, None)
        if err is not None:
            raise err
        rows = x.shape[0]
        u: Optional[Tensor] = x
        # (dropout in training mode: masks of the stages' ranks' own, every rank's
        # generators in step, as in train_step; a failure stops every rank)
        with torch.no_grad(), self._apart(), self._streams.step():
            outs = self._stage_shapes(x)
            for s in range(len(self.plan.stages)):
                src = self.plan.ranks[s - 1] if s else self.plan.ranks[0]
                if src != self.plan.ranks[s]:
                    like = Like((rows, *outs[s - 1]), x.dtype, self.device)
                    u = move(self.transport, [(src, self.plan.ranks[s],
                                               u if self.rank == src else like)],
                             tag=_TAG, what="a pipeline activation")[0]  # type: ignore[assignment]
                if self._holds(s):
                    u = self._local[s](u)
            root = self.plan.ranks[-1]
            return self.transport.bcast_tensor(u if self.rank == root else None, root,
                                               (rows, *outs[-1]), x.dtype, self.device,
                                               "the pipeline's output")

    def gather_state_dict(self) -> dict[str, Tensor]:
        local: dict[str, Tensor] = {}
        for mod in self._local.values():
            local.update({k: v.detach().cpu() for k, v in mod.state_dict().items()})
        merged: dict[str, Tensor] = {}
        for part in self.transport.allgather_object(local, "gather_state_dict"):
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: _name_order(kv[0])))

    def tune_microbatches(self, x: Tensor, y: Any, loss_fn: LossFn,
                          candidates: Sequence[int] = (1, 2, 4, 8), repeats: int = 3,
                          bound: float = float("inf")) -> dict[int, float]:
        """Choose `microbatches` by measurement (collective): each candidate that
        divides the batch and that the schedule accepts is timed (`step_seconds`: a
        warm-up `train_step`, then at most `repeats` timed ones, the slowest rank's
        fewest seconds) against the fastest so far (or `bound`, a time to beat from
        elsewhere, where lower): one clearly slower is not timed further.  The fastest
        candidate is kept (the same on every rank).  Returns candidate -> seconds per
        step (refused candidates left out).  Gradients are left unset (`.grad` None):
        no parameter changes."""
        positive_int("repeats", repeats)
        times: dict[int, float] = {}
        keep = self.microbatches
        try:
            for m in candidates:
                m = positive_int("candidates", m)
                if x.shape[0] % m:
                    continue
                self.microbatches = m
                try:
                    self._torch_schedule(x)
                except ValueError:  # torch refuses it (too few micro-batches), alike
                    continue
                times[m] = step_seconds(self, x, y, loss_fn, repeats,
                                        min([bound, *times.values()]))
        finally:
            self.microbatches = keep
            self._zero_grad()
        if not times:
            raise ValueError(f"none of `candidates` {list(candidates)} divides the batch of "
                             f"{x.shape[0]} rows and suits schedule {self.schedule!r}")
        self.microbatches = min(times, key=lambda m: (times[m], m))
        return times
