"""One training step and one training loop for every front door, and their progress bar.

`train_step` is what one batch is, wherever layerpar trains or times training
(``layerpar train`` and the examples through `layerpar.apps.train.train`, the scaling
studies' workers and serial baseline, ``python -m layerpar.bench``, the operation
counts and the GPU benchmark): zero the gradients, forward, loss, backward, the
optimiser's step and the learning-rate schedule's.  It works on any module that maps
inputs to logits: a serial `ODENet`, its `layerpar.apps.nets.sequential_twin`, or a
`LayerParallel`.  It returns a `Step`: the loss, the output, the time of the forward
part and of the rest, and, for a `LayerParallel`, that pass's MGRIT reports, read
(`Step.fwd`, `Step.bwd`) only when asked, since reading residuals may wait for the
device.  `train_steps` runs it over a sequence of batches.

`Progress` is the progress bar of ``layerpar train`` and ``layerpar scale``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, TextIO, Union

import torch
from torch import Tensor, nn

from ..parallel.baselines.method import TrainingMethod
from ..parallel.flatadam import FlatAdam

__all__ = ["Batches", "Progress", "SolveSummary", "Step", "available_cores", "summarize",
           "train_step", "train_steps"]

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class SolveSummary:
    """One pass's MGRIT solves (all segments) in three numbers.

    iterations: the most any segment did.
    residual: root-sum-square of the segments' final residual norms; None where none
        was measured (e.g. one iteration with `skip`).
    comm_idle_seconds: the engines' ``wait`` and ``reduce`` timers, summed over segments
        (communication and idle time of this rank); None where the engine does not
        measure them (engine="xbraid": XBraid's messages are its own).
    """

    iterations: int
    residual: Optional[float]
    comm_idle_seconds: Optional[float]


def summarize(stats: Sequence[Any]) -> SolveSummary:
    """The `SolveSummary` of ``model.last_forward`` or ``model.last_backward``."""
    res = [s.residual_history[-1] for s in stats if s.residual_history]
    return SolveSummary(
        iterations=max((s.iterations for s in stats), default=0),
        residual=math.sqrt(sum(r * r for r in res)) if res else None,
        comm_idle_seconds=None if any("wait" not in s.timings for s in stats) else
        sum(s.timings["wait"] + s.timings["reduce"] for s in stats))


@dataclass
class Step:
    """What one `train_step` did.

    loss: the loss, detached.  output: the model's output (its graph already used).
    target: the labels the loss was computed against.
    seconds: the whole step; forward_seconds: zero_grad, forward and loss;
    backward_seconds: backward, optimiser and schedule steps.
    fwd_stats, bwd_stats: the model's ``last_forward`` / ``last_backward`` after this
    step (a `LayerParallel`), else None; `fwd` / `bwd` summarise them.
    """

    loss: Tensor
    output: Optional[Tensor]
    target: Tensor
    seconds: float
    forward_seconds: float
    backward_seconds: float
    fwd_stats: Optional[list] = None
    bwd_stats: Optional[list] = None
    input: Optional[Tensor] = None  # the batch's input (a gradient check may reuse it)

    @property
    def fwd(self) -> Optional[SolveSummary]:
        """The forward solves' `SolveSummary` (None without MGRIT)."""
        return None if self.fwd_stats is None else summarize(self.fwd_stats)

    @property
    def bwd(self) -> Optional[SolveSummary]:
        """The adjoint solves' `SolveSummary` (None without MGRIT)."""
        return None if self.bwd_stats is None else summarize(self.bwd_stats)


def adam(params: Iterable[Tensor], lr: Any = 1e-3, *, flat: bool = False,
         **kwargs: Any) -> torch.optim.Adam:
    """`torch.optim.Adam`, fused where torch has it for the parameters' device and
    dtype (one kernel per tensor instead of about ten operations: an ODE-net has two
    tensors per layer, so the default Adam's step costs ~45 us per layer on a CPU,
    as much as the layer's forward), else the default.  With `flat`, a
    `layerpar.parallel.flatadam.FlatAdam`: each run of parameters stored as rows of
    one tensor (an ODE-net's segments) stepped as that tensor, one kernel for a
    segment's weights instead of one per layer (its state is per run: for a training
    that saves no optimizer state, or reloads it into a `FlatAdam`).  Same arithmetic
    up to rounding."""
    params = list(params)
    if flat and not kwargs.get("capturable"):
        return FlatAdam(params, lr=lr, **kwargs)
    if not kwargs.get("capturable"):
        try:
            return torch.optim.Adam(params, lr=lr, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.Adam(params, lr=lr, **kwargs)


def train_step(model: Union[nn.Module, TrainingMethod], x: Tensor, y: Tensor,
               optimizer: Optional[Any] = None, *, scheduler: Optional[Any] = None,
               loss_fn: LossFn = nn.functional.cross_entropy) -> Step:
    """One optimisation step of `model` on the batch (x, y).

    With an `optimizer`: its gradients are zeroed (set to None) first and it steps
    after the backward pass, then the `scheduler` (if any).  Without one, only
    forward, loss and backward run (gradients accumulate): what a benchmark times.
    Adds no tensor operation and no host synchronisation of its own beyond detaching
    the loss, so it can be counted (`layerpar.apps.opcount`) and captured in a CUDA graph.
    """
    if isinstance(model, TrainingMethod):
        return _method_step(model, x, y, optimizer, scheduler, loss_fn)
    t0 = time.perf_counter()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    out = model(x)
    loss = loss_fn(out, y)
    t1 = time.perf_counter()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    t2 = time.perf_counter()
    return Step(loss.detach(), out, y, t2 - t0, t1 - t0, t2 - t1,
                getattr(model, "last_forward", None), getattr(model, "last_backward", None),
                x)


def _method_step(method: TrainingMethod, x: Tensor, y: Tensor, optimizer: Optional[Any],
                 scheduler: Optional[Any], loss_fn: LossFn) -> Step:
    """`train_step` through a `TrainingMethod`'s own ``train_step`` (data parallelism, a
    pipeline): it sets the gradients and returns the whole batch's loss; the output
    stays where the method computed it (None here)."""
    t0 = time.perf_counter()
    loss = method.train_step(x, y, loss_fn)
    t1 = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    t2 = time.perf_counter()
    return Step(torch.tensor(loss), None, y, t2 - t0, t1 - t0, t2 - t1, input=x)


def train_steps(model: Union[nn.Module, TrainingMethod], batches: Iterable[tuple[Tensor, Tensor]],
                optimizer: Optional[Any] = None, *, scheduler: Optional[Any] = None,
                loss_fn: LossFn = nn.functional.cross_entropy,
                shard: Optional[Callable[[Tensor], Tensor]] = None,
                before: Optional[Callable[[], None]] = None) -> Iterator[Step]:
    """`train_step` over `batches`, one `Step` per batch as it finishes.

    shard: applied to inputs and labels first (e.g. `ProcessGrid.shard`: a replica's
    share of the global batch).  before: called before each step, untimed (e.g. a
    barrier).  What the caller does with a step before asking for the next one is
    not timed either.
    """
    for x, y in batches:
        if shard is not None:
            x, y = shard(x), shard(y)
        if before is not None:
            before()
        yield train_step(model, x, y, optimizer, scheduler=scheduler, loss_fn=loss_fn)


class Batches:
    """Shuffled mini-batches of in-memory tensors, each gathered by one indexing
    operation per tensor.

    The same batches, in the same order, as ``DataLoader(TensorDataset(*tensors),
    batch_size, shuffle=True, generator=generator)``: a `DataLoader` over the indices
    draws the order (its sampler, its use of `generator`), and each batch is then
    ``t[indices]`` instead of a tuple built per sample and stacked: inside the
    1,024-layer dense net's training steps at 2 ranks on the 2-core CPU, 0.58-0.62
    -> 0.25-0.30 ms per batch of 128 MNIST-1D rows, and where the tensors live on a
    GPU no batch is copied from the host.  ``len`` is the batches per
    epoch; `generator` is the shuffling generator (a caller may save and restore its
    state to peek)."""

    def __init__(self, *tensors: Tensor, batch_size: int, shuffle: bool = True,
                 generator: Optional[torch.Generator] = None) -> None:
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise ValueError("`tensors` must be one or more tensors of the same length")
        self.tensors, self.generator = tensors, generator
        self._index = torch.utils.data.DataLoader(
            range(len(tensors[0])), batch_size=batch_size, shuffle=shuffle,
            generator=generator)

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        for i in self._indices(self.tensors[0].device):
            yield tuple(t[i] for t in self.tensors)

    def _indices(self, device: torch.device, whole: Optional[bool] = None
                 ) -> Iterator[Tensor]:
        """The epoch's batches of indices, on `device`.  Off the CPU (`whole`) the
        epoch's whole order is sent at once: a copy from (pageable) host memory waits
        for the work queued on the stream before it, so one copy per batch made the
        host wait for the GPU at every training step."""
        if not (device.type != "cpu" if whole is None else whole):
            yield from self._index
            return
        order = list(self._index)  # (the sampler draws the epoch's permutation at once)
        if order:
            yield from torch.cat(order).to(device).split([len(i) for i in order])


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; all of them off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Progress:
    """A dependency-free progress bar: ``label [#####.......] done/total note``.

    On a terminal it redraws one line, at most once per `interval` seconds (the last
    update always shows).  Off a terminal it writes one line per update with
    ``lines=True`` (long steps, worth a log), and nothing otherwise.  `clock` adds
    the seconds since the bar was made.  Disabled (`enabled` False) it writes nothing.
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True,
                 stream: Optional[TextIO] = None, lines: bool = False, clock: bool = False,
                 interval: float = 0.1) -> None:
        self.stream = sys.stderr if stream is None else stream  # the current one
        self.tty = self.stream.isatty()
        self.enabled = enabled and (self.tty or lines)
        self.total, self.label, self.clock, self.interval = total, label, clock, interval
        self.t0 = time.monotonic()
        self._last = -math.inf

    def update(self, done: int, note: Union[str, Callable[[], str]]) -> None:
        """Show `done` of `total` with a `note`: a string, or a function that makes
        it, called only when the bar is drawn (a note that reads a GPU tensor then
        waits for the GPU at most once per `interval`, not at every step)."""
        now = time.monotonic()
        if not self.enabled or (done < self.total and now - self._last < self.interval):
            return
        if callable(note):
            note = note()
        self._last = now
        width = 24
        fill = width * done // max(self.total, 1)
        line = f"{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} "
        if self.clock:
            line += f"{now - self.t0:6.0f}s "
        line += note
        self.stream.write("\r" + line + "\x1b[K" if self.tty else line + "\n")
        self.stream.flush()

    def close(self, note: str = "") -> None:
        """End the bar's line on a terminal; with a `note`, replace the bar by it."""
        if not (self.enabled and self.tty):
            return
        self.stream.write(f"\r{self.label} {note}\x1b[K\n" if note else "\n")
        self.stream.flush()
