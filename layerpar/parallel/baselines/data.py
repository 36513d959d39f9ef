"""Data parallelism: the whole `ODENet` on every rank, the batch split over the ranks.

Each rank runs the net on its share of the batch's rows (as even as can be); the
shares' outputs are gathered, so every rank applies the loss to the whole batch's
output, as serial training does, and back-propagates it through its own rows (times
P); the gradients are then averaged over the ranks, so every rank holds serial's
gradient, for any loss (a mean, a sum, class weights, ignored rows), and identical
optimizers keep identical parameters.  The gather is one all-gather of the outputs a
step (a classifier's: a few kilobytes).  Two engines average the gradients:

- ``"ddp"``: torch's `DistributedDataParallel` over a torch.distributed process group
  (gloo on CPU, NCCL on CUDA): bucketed all-reduces started by autograd hooks as the
  backward pass produces gradients.
- ``"allreduce"``: layerpar's own transport (an mpi4py communicator or a process
  group) and its bucketed averager (`parallel.replicas.GradAverager`): each gradient
  is queued as soon as autograd has accumulated it, in one fixed order on every rank
  (the reverse of the parameters' order, waiting for those before it), so the
  reductions overlap with the rest of the backward pass.

Rank 0's parameters and buffers are broadcast when the method is built, so every
rank starts from the same net whatever each built.  The engine follows the trainable
parameters from step to step (replaced by ``load_state_dict(..., assign=True)``, frozen
or unfrozen).  Dropout draws masks of each rank's own share, new every step
(`StepStreams`: not the serial net's masks), the generators kept in step.  Batch norm
normalises each share by its own statistics; rank 0's running statistics are given to
every rank after each step, so every rank evaluates and saves the same net.  A module
of the user's that normalises by a batch statistic, or keeps a running one in a
buffer, does the same here, as under DistributedDataParallel (`choose_method` finds
one, `replicated.probe_rows`, and measures or sets the split aside).  A failure
on one rank during a step stops every rank with its message (`TrainingMethod._apart`;
over a process group the method sends on a group of its own, which it severs).
"""
from __future__ import annotations

import gc
import operator
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors

from ...mgrit.transport import DEFAULT_TIMEOUT, check_timeout, is_process_group, make_transport
from ...ode.net import ODENet
from ...ode.rng import StepStreams
from ..agree import layer_key, registrations
from ..move import gather_rows
from ..replicas import GradAverager
from .dist import own_group, release_group
from .method import LossFn, TrainingMethod, as_net, check_check_inputs

__all__ = ["DataParallelNet"]

ENGINES = ("auto", "ddp", "allreduce")
_TRAINED = operator.attrgetter("requires_grad")


class DataParallelNet(TrainingMethod):
    """Train `net` data-parallel over the ranks of `comm`.

    net: an `ODENet`, or a zero-argument factory returning one (rank 0's values are
        broadcast to the others).
    comm: an mpi4py communicator, a torch.distributed process group, or None (one rank).
    engine: "ddp" (torch's DistributedDataParallel; needs a process group), "allreduce"
        (layerpar's transport and bucketed averager; any communicator), or "auto"
        (default): "ddp" for a process group, "allreduce" otherwise.
    check_inputs: for this many first steps compare the batch's shapes between ranks.
    timeout: seconds any wait of the "allreduce" engine may take (None: unbounded);
        over a gloo process group spanning the world, also the timeout of the
        method's own group (`own_group`), which bounds DistributedDataParallel's
        all-reduce.

    `train_step` takes the whole batch on every rank (at least a row per rank) and runs
    this rank's share, the loss applied to the whole output (`whole_loss`);
    `forward(x_share)` runs a share the user chose, as `DistributedDataParallel` does
    (then call ``backward`` and `average_gradients` yourself with the "allreduce"
    engine).
    """

    name = "data"
    splits_rows = True

    def __init__(self, net: Union[ODENet, Callable[[], ODENet]], comm: Any = None, *,
                 engine: str = "auto", check_inputs: int = 10,
                 timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        # over a process group: every message (DistributedDataParallel's, layerpar's)
        # on a group of the method's own, which a failing rank severs
        # (`TrainingMethod._apart`): the user's group stays whole
        self._comm = comm
        self._groups = (own_group(comm, timeout),) if is_process_group(comm) else ()
        self.transport = make_transport(self._groups[0] if self._groups else comm)
        err: Optional[BaseException] = None
        key: Any = None
        try:
            net = as_net(net)
            if engine not in ENGINES:
                raise ValueError(f"`engine` must be one of {list(ENGINES)}, got {engine!r}")
            pg = self.transport.backend in ("gloo", "nccl")
            if engine == "auto":
                engine = "ddp" if pg else "allreduce"
            if engine == "ddp" and not pg:
                raise TypeError(
                    "`engine='ddp'` needs `comm` to be a torch.distributed process group "
                    "(under mpiexec: layerpar.parallel.baselines.process_group_from_mpi"
                    "(comm)); use engine='allreduce' with an mpi4py communicator")
            self.check_inputs = check_check_inputs(check_inputs)
            timeout = check_timeout(timeout)
            key = {"engine": engine, "check_inputs": check_inputs,
                   **{n: v for k, m in enumerate(net.layers) for n, v in
                      layer_key(k, m).items()}}
        except Exception as exc:  # noqa: BLE001 - raised alike on every rank by agree
            err = exc
        self.transport.agree(key, err, "DataParallelNet settings (engine, layers)")
        if not isinstance(net, ODENet):
            raise TypeError(f"`net` must build an ODENet, got {type(net).__name__}")
        self.transport.timeout = timeout
        self.net = net
        self.engine = engine
        self._averager: Optional[GradAverager] = None
        self._ddp: Optional[nn.Module] = None
        self._hooks: list[Any] = []
        self._in_step = False  # the hooks act inside train_step only: the net may be
        # trained otherwise as well
        self._streams = StepStreams(net, self.rank)
        if engine == "allreduce":
            self._broadcast_state()
            self._averager = GradAverager(self.transport)
        self._attach()

    def _trainable(self) -> tuple[tuple[int, bool], ...]:
        """What the engine was attached to: each parameter's identity and whether it
        is trained (`load_state_dict(..., assign=True)` replaces the tensors, and a user
        may freeze or unfreeze layers between steps).  A walk of the net (2.8 ms for
        the 1,024-layer dense net): `_follow_parameters` runs it only where a parameter
        was registered anywhere since, and reads the flags of the list it made."""
        self._params = list(self.net.parameters())
        groups: dict[torch.dtype, list[Tensor]] = {}  # (floating buffers by dtype)
        for b in self.net.buffers():
            if b is not None and (b.is_floating_point() or b.is_complex()):
                groups.setdefault(b.dtype, []).append(b)
        self._buffers = [(dtype, bufs, [b.numel() for b in bufs])
                         for dtype, bufs in groups.items()]
        self._registered = registrations()
        return tuple((id(p), p.requires_grad) for p in self._params)

    def _attach(self) -> None:
        """Average the gradients of the net's trainable parameters as they are now
        (collective): torch's DistributedDataParallel wrapped around the net again
        ("ddp", which broadcasts rank 0's parameters and buffers), or a gradient hook
        on each in a fixed order ("allreduce")."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._attached = self._trainable()
        self._flags = [t for _, t in self._attached]
        if self.engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            if self._ddp is not None:  # its reducer's hooks go with it, before the new one's
                self._ddp = None
                gc.collect()
            dev = next(self.net.parameters()).device
            self._ddp = DistributedDataParallel(
                self.net, device_ids=None if dev.type == "cpu" else [dev],
                process_group=self._groups[0])
            return
        self._order = list(reversed(self.parameters()))
        self._ready: set[int] = set()
        self._queued = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for p in self._order]

    def _follow_parameters(self) -> None:
        """Attach the engine again where the net's trainable parameters changed since
        the last step (replaced or frozen or unfrozen), so that every one of them is
        averaged: otherwise the ranks would step apart, silently.  Agreed first (the
        same change on every rank, or every rank raises)."""
        if registrations() == self._registered and \
                list(map(_TRAINED, self._params)) == self._flags:
            return  # (0.13 ms for the 1,024-layer dense net)
        if self._trainable() == self._attached:
            self._flags = [t for _, t in self._attached]
            return
        key = [(n, tuple(p.shape)) for n, p in self.named_parameters()]
        self.transport.agree(key, None, "the trainable parameters (changed since the last "
                             "step: every rank must replace, freeze or unfreeze alike)")
        if self.engine == "allreduce":  # (new tensors: rank 0's, as when built; DDP's
            self._broadcast_state()     # construction broadcasts them itself)
        self._attach()

    # -- the "allreduce" engine ------------------------------------------------------------
    def _broadcast_state(self) -> None:
        if self.size == 1:
            return
        with torch.no_grad():
            for t in [*self.net.parameters(), *self.net.buffers()]:
                got = self.transport.bcast_tensor(
                    t.detach() if self.rank == 0 else None, 0, tuple(t.shape), t.dtype,
                    t.device, "rank 0's initial parameters")
                if self.rank != 0:
                    t.copy_(got)

    def _grad_ready(self, p: Tensor) -> None:
        """Queue gradients for averaging in the fixed order, as far as they are ready."""
        if not self._in_step or self._averager is None or self.size == 1:
            return
        self._ready.add(id(p))
        while self._queued < len(self._order) and id(self._order[self._queued]) in self._ready:
            self._averager.add([self._order[self._queued].grad])
            self._queued += 1

    def _share_buffers(self) -> None:
        """Rank 0's floating-point buffers (batch norm's running statistics, which each
        rank updated from its own share) on every rank, one broadcast per dtype: as
        `DistributedDataParallel` broadcasts them, but after the step, so that every
        rank evaluates and saves the same net.  Integer buffers (batch norm's batch
        counters) count steps alike on every rank and are left alone.  (The conv
        ResNet's 262 statistics: about 0.3 ms a step.)"""
        if self.size == 1 or not self._buffers:
            return
        with torch.no_grad():
            for dtype, bufs, sizes in self._buffers:
                flat = _flatten_dense_tensors(bufs) if self.rank == 0 else None
                got = self.transport.bcast_tensor(
                    flat, 0, (sum(sizes),), dtype, bufs[0].device,
                    "rank 0's buffers (batch-norm statistics)")
                if self.rank != 0:
                    parts = got.split(sizes)
                    torch._foreach_copy_(bufs, [p if p.shape == b.shape else p.view(b.shape)
                                                for p, b in zip(parts, bufs)])

    def average_gradients(self) -> None:
        """Finish averaging this pass's gradients over the ranks ("allreduce" engine;
        `train_step` calls it; DistributedDataParallel does it inside backward)."""
        if self._averager is None or self.size == 1:
            return
        # parameters autograd did not reach (none on any rank of one net) are skipped
        self._averager.add(p.grad for p in self._order[self._queued:])
        self._averager.finish()
        self._ready.clear()
        self._queued = 0

    # -- the interface ---------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """The net on this rank's own rows (through DistributedDataParallel with "ddp")."""
        return (self._ddp if self._ddp is not None else self.net)(x)

    __call__ = forward

    def _batch_error(self, x: Tensor, y: Any) -> Optional[BaseException]:
        err = super()._batch_error(x, y)
        if err is None and x.shape[0] < self.size:
            err = ValueError(f"the batch has {x.shape[0]} rows, fewer than the {self.size} "
                             "ranks: `x` must give every rank a row")
        return err

    def _share(self, rows: int, rank: Optional[int] = None) -> tuple[int, int]:
        """(first, stop) of this rank's (or `rank`'s) rows of a batch of `rows`: as
        even as can be, the first ``rows % size`` ranks one row more."""
        rank = self.rank if rank is None else rank
        q, r = divmod(rows, self.size)
        first = rank * q + min(rank, r)
        return first, first + q + (rank < r)

    def shard(self, t: Any) -> Any:
        """This rank's share of the rows of `t` (`_share`; anything not a batch as it
        is)."""
        if not isinstance(t, Tensor) or t.dim() == 0:
            return t
        first, stop = self._share(t.shape[0])
        return t[first:stop]

    def whole_loss(self, x: Tensor, y: Any, loss_fn: LossFn, *, engine: bool = True
                   ) -> Tensor:
        """The loss of the whole batch's output, on every rank, its graph through this
        rank's rows only (collective): each rank runs its share of `x`'s rows (through
        the engine, else the bare net), the shares' outputs are gathered (one
        all-gather), and `loss_fn` is applied to the whole output and the whole `y`,
        as serial training applies it.  The gradient reaching this rank's output is
        scaled by P, so the ranks' average of the gradients is serial's for any loss: a
        mean, a sum, a weighted mean (class weights, ignored rows), one of the batch's
        statistics, a penalty on the parameters (which each rank's backward counts
        once, unscaled)."""
        out = (self.forward if engine else self.net)(self.shard(x))
        if self.size == 1:
            return loss_fn(out, y)
        if out.requires_grad:  # (P x its rows' part: the ranks' average is their sum)
            out.register_hook(lambda g: g * self.size)
        rows = x.shape[0]
        first, stop = self._share(rows)
        counts = [b - a for a, b in (self._share(rows, q) for q in range(self.size))]
        whole = gather_rows(self.transport, out.detach(), counts,
                            "the outputs of the batch's shares")
        return loss_fn(torch.cat([whole[:first], out, whole[stop:]]), y)

    def train_step(self, x: Tensor, y: Any, loss_fn: LossFn) -> float:
        self._check_batch(x, y)
        with self._apart(alike=True):  # (a rank ahead may fail meanwhile)
            self._follow_parameters()
        self._zero_grad()
        self._in_step = True
        try:
            # (dropout: masks of this rank's own; a failure here stops every rank)
            with self._apart(), self._streams.step():
                loss = self.whole_loss(x, y, loss_fn)
                loss.backward()
                self.average_gradients()
        finally:
            self._in_step = False
        self._share_buffers()
        return self._loss_value(loss)  # (the same on every rank: the same whole output)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.net.named_parameters() if p.requires_grad)

    def eval_forward(self, x: Tensor) -> Tensor:
        """The whole batch on every rank (every rank holds the whole, identical net: no
        message)."""
        with torch.no_grad():
            return self.net(x)

    def gather_state_dict(self) -> dict[str, Tensor]:
        """This rank's copy of the net's state, the same on every rank (parameters
        stepped alike; buffers such as batch-norm statistics rank 0's after each
        `train_step`)."""
        return {k: v.detach().cpu() for k, v in self.net.state_dict().items()}

    def close(self) -> None:
        """Remove the gradient hooks (and the DistributedDataParallel wrapper, whose
        hooks go with it) and release the duplicated communicator (collective)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._ddp = None
        if self._groups and not getattr(self, "_closed", False):
            release_group(self._groups[0], self._comm,
                          self.transport.failure is not None)
        super().close()
