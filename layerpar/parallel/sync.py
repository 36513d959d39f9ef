"""How the replicas of a `ProcessGrid` stay in step: strategies of its data dimension.

``ProcessGrid(comm, data=R, layers=L, sync=...)`` picks one; every strategy acts on
the parameters of this process's layer group only (the layer-parallel shard), over
the ranks that hold the same layers in the other replicas.

- ``"allreduce"`` (`AllReduce`, the default): gradients summed over the data group
  every batch (bucketed, overlapped with the adjoint sweep; `GradAverager`).
- ``"daso"`` (`DASO`, after Coquelin et al.'s DASO in Helmholtz HeAT): replicas are
  grouped into nodes.  Every batch, gradients are averaged inside a node; every S
  batches one process per node (the node's first replica) starts a non-blocking
  global average of its *parameters* (sent in bfloat16 by default, as HeAT does, as
  the difference from the previous global average, which every node holds alike:
  rounding then costs 2^-9 of the drift since the last exchange, not of the
  parameters, and late, small steps are not rounded away), the node trains on, and
  S-1 batches later the average is merged and copied to the node's other replicas.
  The merge (``merge=``): ``"progress"`` (the default, delayed averaging) keeps the
  node's own progress since it sent, on top of the average of what was sent:
  ``p = avg + (p - p_sent)``; ``"weighted"`` (DASO's published merge) pulls the
  parameters toward the stale average, local ones weighted double:
  ``(2 p + avg) / 3``.  With S = 1 both give the average (nothing was trained since
  the send).  S cycles (4, 2, 1 by default).  Warm-up
  and cool-down batches use synchronous gradient all-reduce.
- ``"lioncub"`` (`LionCub`, after "Lion Cub: minimizing communication overhead in
  distributed Lion"): no gradient reduction at all.  The `Lion` optimizer's update is
  a sign, -1, 0 or +1; each replica packs its signs into two bits per entry (> 0,
  < 0: `pack_signs`), the bits are all-gathered (1/16 of an fp32 all-reduce's
  payload) and every replica applies the majority vote, sign(#(+1) - #(-1))
  (`majority_bits`: zeros abstain, a tie gives no step).  With the same gradients
  on every replica it is plain Lion.  The momentum stays local and is averaged only
  every `momentum_every` batches.

The training loop stays ordinary: ``sync = grid.sync.attach(model, optimizer)`` after
building them (it registers a hook after each optimizer step); ``sync.state_dict()`` /
``sync.load_state_dict(state)`` save and restore the whole training state of every
replica (parameters, optimizer state, the strategy's cycle position and pending
exchange) and load it on any grid shape (replica d of the new grid takes saved
replica d mod R).

Bytes: the grid's `meter` counts what this process hands to the transport to send
(the payload of each operation; a collective's internal algorithm is the library's
and not seen), by kind: ``"p2p"`` (MGRIT's messages in the layer group), ``"data"``
(collectives of the data group inside a node), ``"internode"`` (collectives whose
group spans nodes).  `SlowLink` delays the completion of every inter-node operation
by latency + bytes / bandwidth (a model of a slow link between nodes: each process as
if with its own link; the operation itself runs at local speed), the bytes being what
a ring algorithm sends per process over P processes: 2 (P-1)/P of the payload for an
all-reduce, (P-1) payloads for an all-gather, the payload from a broadcast's root
(with P = 2, all three are the payload).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

from .._checks import finite_in, nonneg_int, positive_int
from ..mgrit.errors import DivergenceError
from ..mgrit.transport import Pending, Transport, guarded, make_transport
from .lion import Lion
from .replicas import GradAverager

#: a `layerpar.parallel.grid.ProcessGrid`: not imported, as the grid imports this module
_Grid = Any

__all__ = ["DASO", "AllReduce", "LionCub", "SlowLink", "SyncStrategy", "make_sync",
           "SYNCS"]

SYNCS = ("allreduce", "daso", "lioncub")


class SlowLink:
    """A slow link between nodes: an inter-node operation of n payload bytes takes
    ``latency + 8 n / bandwidth`` seconds of the link, and the operations of a process
    use its link one after another (first come, first served): one completes no
    earlier than that long after it started or after the previous one's end.

    bandwidth: bits per second (default 1 Gbit/s); latency: seconds (default 50 us).
    Work overlapped with the operation (DASO's non-blocking exchange) hides the delay,
    as it would on a real link."""

    def __init__(self, bandwidth: float = 1e9, latency: float = 50e-6) -> None:
        finite_in("latency", latency, 0.0)
        if finite_in("bandwidth", bandwidth, 0.0) == 0:
            raise ValueError("`bandwidth` must be > 0 bits per second")
        self.bandwidth, self.latency = float(bandwidth), float(latency)
        self._free_at = 0.0  # when this process's link is free again (perf_counter)

    def seconds(self, nbytes: int) -> float:
        """The link time of `nbytes`."""
        return self.latency + 8.0 * nbytes / self.bandwidth

    def reserve(self, nbytes: int) -> float:
        """Queue `nbytes` on the link now; the time (perf_counter) they are through."""
        self._free_at = max(time.perf_counter(), self._free_at) + self.seconds(nbytes)
        return self._free_at

    def key(self) -> tuple[float, float]:
        return (self.bandwidth, self.latency)

    def __repr__(self) -> str:
        return f"SlowLink({self.bandwidth / 1e9:g} Gbit/s, {self.latency * 1e6:g} us)"


class _Delayed:
    """A `Pending` that completes no earlier than `ready` (time.perf_counter)."""

    def __init__(self, pending: Pending, ready: float) -> None:
        self._pending, self._ready = pending, ready

    def wait(self) -> None:
        self._pending.wait()
        left = self._ready - time.perf_counter()
        if left > 0:
            time.sleep(left)


class Metered:
    """A transport of the data dimension that counts the bytes this process sends (in
    `meter`, under `kind`) and, with a `link`, delays each operation's completion by
    the link's time for its payload.  Other attributes are the transport's."""

    def __init__(self, transport: Transport, meter: dict, kind: str,
                 link: Optional[SlowLink] = None) -> None:
        self.transport, self.meter, self.kind, self.link = transport, meter, kind, link
        self.size, self.group_rank = transport.size, transport.group_rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def _count(self, nbytes: int, wire: Optional[float] = None) -> float:
        """Count `nbytes` of payload; with a link, queue `wire` bytes on it (default:
        the payload) and return when they are through."""
        self.meter[self.kind] = self.meter.get(self.kind, 0) + int(nbytes)
        if self.link is None:
            return time.perf_counter()
        return self.link.reserve(int(nbytes if wire is None else wire))

    def allreduce_start(self, t: Tensor, what: str = "a gradient reduction") -> Any:
        # the link carries a ring all-reduce's traffic: 2 (P-1)/P of the payload
        n, P = t.numel() * t.element_size(), self.size
        ready = self._count(n, 2 * (P - 1) * n / P)
        return _Delayed(self.transport.allreduce_start(t, what), ready)

    def allgather_start(self, t: Tensor, out: Tensor, what: str = "an all-gather") -> Any:
        # a ring all-gather: each process passes on the P-1 other parts
        n = t.numel() * t.element_size()
        ready = self._count(n, (self.size - 1) * n)
        return _Delayed(self.transport.allgather_start(t, out, what), ready)

    def bcast_tensor(self, t: Optional[Tensor], root: int, shape: Sequence[int],
                     dtype: torch.dtype, device: torch.device,
                     what: str = "a broadcast tensor") -> Tensor:
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        ready = self._count(n if self.group_rank == root else 0)
        got = self.transport.bcast_tensor(t, root, shape, dtype, device, what)
        if self.link is not None:
            left = ready - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return got


def _flat(tensors: Sequence[Tensor], dtype: Optional[torch.dtype] = None) -> Tensor:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else \
        torch.zeros(0)
    return flat if dtype is None else flat.to(dtype)


def _all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element of `tensors` is finite: each is read once for its least
    and greatest element (a NaN propagates into both, an infinity is one of them), with
    no copy and one host read in all.  The replicas' checks run on every averaged
    gradient of every batch: a flat copy and an `isfinite` mask took 105 ms per check
    of 17.8 M float32 values on one core of the development machine, this 6 ms."""
    ends = [torch.stack(torch.aminmax(t.detach())) for t in tensors if t.numel()]
    return not ends or bool(torch.isfinite(torch.cat(ends)).all())


def _unflat(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    out, off = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[off:off + n].view_as(t))
        off += n
    return out


class _CheckedAverager(GradAverager):
    """A `GradAverager` that raises `DivergenceError` when an average is not finite
    (a NaN in one replica reaches all of them through the sum: every replica raises)."""

    def finish(self) -> None:
        tensors = [t for _, _, ts in self._pending for t in ts] + list(self._bucket)
        super().finish()
        if not _all_finite(tensors):
            raise DivergenceError("a gradient averaged over the replicas is not finite "
                                  "(NaN or inf in some replica)")


def _check_attached(strategy: SyncStrategy) -> None:
    if strategy.model is None:
        raise RuntimeError(f"sync='{strategy.name}' runs after each optimizer step: call "
                           "grid.sync.attach(model, optimizer) before training (without it "
                           "the replicas would drift apart silently)")


class _AttachCheck:
    """Lion Cub's stand-in for a gradient averager: nothing to average, but a backward
    pass before `attach` raises."""

    total_seconds = last_seconds = 0.0
    bytes = 0

    def __init__(self, strategy: SyncStrategy) -> None:
        self.strategy = strategy

    def add(self, tensors: Any) -> None:
        pass

    def finish(self) -> None:
        _check_attached(self.strategy)


class SyncStrategy:
    """Base class: how the replicas of a grid stay in step (see the module docstring).

    Life cycle: `ProcessGrid` calls `setup(grid)` (collective: groups and transports);
    `LayerParallel` asks `averager()` for what averages its gradients in the backward
    pass; the user calls `attach(model, optimizer)` once (a hook then runs
    `after_step` after every optimizer step)."""

    name = "abstract"

    def __init__(self) -> None:
        self.grid: Optional[_Grid] = None
        self.batch = 0  # optimizer steps taken
        self.model: Any = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._hook: Any = None
        self._made: list[Transport] = []
        self.data: Optional[Metered] = None

    # -- set-up ----------------------------------------------------------------------------
    def key(self) -> dict[str, Any]:
        """What must agree between processes."""
        return {"sync": self.name}

    def setup(self, grid: _Grid) -> None:
        """Build this strategy's transports over `grid` (collective)."""
        self.grid = grid
        if grid.data > 1:
            self.data = self._metered(grid.data_comm, grid.data_node_count() > 1)

    def _metered(self, comm: Any, internode: bool) -> Optional[Metered]:
        if self.grid is None:
            raise RuntimeError(f"the {self.name} strategy is not attached to a grid (call "
                               "setup first)")
        if comm is None:
            return None
        t = make_transport(comm, errors=self.grid.errors, timeout=self.grid.timeout)
        t.timeout = self.grid.timeout
        self._made.append(t)
        return Metered(t, self.grid.meter, "internode" if internode else "data",
                       self.grid.link if internode else None)

    def averager(self) -> Optional[GradAverager]:
        """What averages gradients in the backward pass (None: nothing)."""
        return None if self.data is None else _CheckedAverager(self.data)

    def attach(self, model: Any, optimizer: torch.optim.Optimizer) -> SyncStrategy:
        """Bind the model (this process's part) and its optimizer; from now on the
        strategy runs after every ``optimizer.step()``.  Returns the strategy."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"`optimizer` must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if getattr(model, "grid", None) is not self.grid:
            raise ValueError("`model` must be a LayerParallel built on this grid "
                             "(grid=...)")
        if self._hook is not None:
            self._hook.remove()
        self.model, self.optimizer = model, optimizer
        self._hook = optimizer.register_step_post_hook(lambda *_: self._after_step())
        return self

    def _params(self) -> list[Tensor]:
        return [p for p in self.model.parameters()] if self.model is not None else []

    def _after_step(self) -> None:
        if self.grid is None:
            raise RuntimeError(f"the {self.name} strategy is not attached to a grid (call "
                               "setup first)")
        guarded(self.grid.world, self.after_step)

    def after_step(self) -> None:
        """Run after each optimizer step (the strategy's own exchanges)."""
        self.batch += 1

    # -- checkpoints -------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        """Strategy state other than the replicas' (the same on every process)."""
        return {}

    def _load_extra(self, state: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """The whole training state of every replica (collective over the grid):
        ``{"sync", "batch", "replicas": [{"model", "optimizer"} per replica], ...}``."""
        grid, model = self.grid, self.model
        if model is None or grid is None:
            raise RuntimeError("call attach(model, optimizer) before state_dict()")
        extra = self._extra_state()
        own = {"model": model.gather_state_dict(),
               "optimizer": model.gather_optimizer_state(self.optimizer)}
        got = grid.world.allgather_object(
            (grid.data_rank, own if grid.layer_rank == 0 else None), "sync.state_dict")
        replicas = [o for d, o in sorted((d, o) for d, o in got if o is not None)]
        return {"sync": self.name, "batch": self.batch, "replicas": replicas, **extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s result, saved on any grid shape (local: replica d
        takes saved replica d mod R)."""
        if self.model is None:
            raise RuntimeError("call attach(model, optimizer) before load_state_dict()")
        if not isinstance(state, dict) or state.get("sync") != self.name:
            raise ValueError(f"`state` must be a {self.name} strategy's state_dict(), got "
                             f"{state.get('sync') if isinstance(state, dict) else state!r}")
        if self.grid is None:
            raise RuntimeError(f"the {self.name} strategy is not attached to a grid (call "
                               "setup first)")
        rep = state["replicas"][self.grid.data_rank % len(state["replicas"])]
        sd = rep["model"]
        with torch.no_grad():
            for n, t in list(self.model.named_parameters()) + list(
                    self.model.named_buffers()):
                if n in sd:
                    t.copy_(sd[n])
        self.model.load_optimizer_state(self.optimizer, rep["optimizer"])
        self.batch = int(state["batch"])
        self._load_extra(state)

    def close(self) -> None:
        """Release the strategy's transports (collective)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for t in self._made:
            t.close()
        self._made = []


class AllReduce(SyncStrategy):
    """Gradients summed over the data group every batch (the default)."""

    name = "allreduce"


class _PhaseAverager:
    """DASO's gradient averaging: over the whole data group in synchronous phases,
    inside the node otherwise (chosen per backward pass)."""

    def __init__(self, strategy: DASO, sync: Optional[GradAverager],
                 node: Optional[GradAverager]) -> None:
        self.strategy, self.sync, self.node = strategy, sync, node
        self._now: Optional[GradAverager] = None
        self.total_seconds = 0.0

    def _current(self) -> Optional[GradAverager]:
        if self._now is None:
            self._now = self.sync if self.strategy.synchronous(self.strategy.batch) \
                else self.node
        return self._now

    def add(self, tensors: Any) -> None:
        cur = self._current()
        if cur is not None:
            cur.add(tensors)

    def finish(self) -> None:
        _check_attached(self.strategy)
        cur, self._now = self._current(), None
        if cur is not None:
            cur.finish()
            self.total_seconds = sum(a.total_seconds for a in (self.sync, self.node)
                                     if a is not None)


class DASO(SyncStrategy):
    """Hierarchical, asynchronous parameter averaging (see the module docstring).

    cycle: the S values, used in turn (batches from one global exchange's start to its
    merge, inclusive: S = 1 is a blocking average); warmup / cooldown: batches of
    synchronous gradient all-reduce at the start / before `total_batches` (cool-down
    needs it); merge: how a global average of the parameters sent S - 1 batches ago
    enters the node's parameters p: ``"progress"`` (default) ``p = avg + (p - p_sent)``
    with p_sent the node's parameters as sent (the node keeps what it trained since),
    ``"weighted"`` ``(w p + avg) / (w + 1)`` with ``w = local_weight`` (DASO's merge;
    `local_weight` is used by it only); global_dtype: the dtype parameters are
    exchanged in between nodes (None: their own)."""

    MERGES = ("progress", "weighted")

    name = "daso"

    def __init__(self, cycle: Sequence[int] = (4, 2, 1), warmup: int = 0, cooldown: int = 0,
                 total_batches: Optional[int] = None, local_weight: float = 2.0,
                 global_dtype: Optional[torch.dtype] = torch.bfloat16,
                 merge: str = "progress") -> None:
        super().__init__()
        if isinstance(cycle, int) or not cycle or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in cycle):
            raise ValueError(f"`cycle` must be a non-empty sequence of ints >= 1, got "
                             f"{cycle!r}")
        nonneg_int("warmup", warmup)
        nonneg_int("cooldown", cooldown)
        if total_batches is not None:
            positive_int("total_batches", total_batches)
        if cooldown and total_batches is None:
            raise ValueError("`cooldown` needs `total_batches` (when training ends)")
        if not (isinstance(local_weight, (int, float)) and local_weight >= 0):
            raise ValueError(f"`local_weight` must be a number >= 0, got {local_weight!r}")
        if not isinstance(merge, str) or merge not in self.MERGES:
            raise ValueError(f"`merge` must be one of {self.MERGES}, got {merge!r}")
        if global_dtype is not None and not isinstance(global_dtype, torch.dtype):
            raise TypeError(f"`global_dtype` must be a torch.dtype or None, got "
                            f"{type(global_dtype).__name__}")
        self.cycle = tuple(cycle)
        self.warmup, self.cooldown, self.total_batches = warmup, cooldown, total_batches
        self.local_weight, self.global_dtype = float(local_weight), global_dtype
        self.merge = merge
        self.pos = 0  # index into cycle of the exchange in progress or next
        self.pending: Optional[dict[str, Any]] = None
        self.node: Optional[Metered] = None
        self.glob: Optional[Metered] = None
        self.leader = True
        self.one_node = False
        # the last global average (leaders; the same on all of them): the exchange
        # sends parameters minus it.  None: the first exchange sends the parameters
        # in their own dtype (no reference yet)
        self.ref: Optional[Tensor] = None
        self._bufs: dict[str, Tensor] = {}  # see `_buffer`

    def _buffer(self, name: str, like: Tensor, dtype: torch.dtype, rows: int = 0,
                numel: Optional[int] = None) -> Tensor:
        """A buffer of `like`'s numel (or `numel`; x `rows`) on its device, kept between
        exchanges: one exchange is in flight at a time, and a fresh tensor of the
        parameters' size per exchange costs its page faults (~10 ms per 8.9 M float32
        on the development machine)."""
        n = like.numel() if numel is None else numel
        shape = (rows, n) if rows else (n,)
        b = self._bufs.get(name)
        if b is None or b.shape != shape or b.dtype != dtype or b.device != like.device:
            b = self._bufs[name] = torch.empty(shape, dtype=dtype, device=like.device)
        return b

    def _flat_params(self, name: str) -> Tensor:
        """The parameters, concatenated into the kept buffer `name`."""
        params = [p.detach().reshape(-1) for p in self._params()]
        if not params or any(p.dtype != params[0].dtype for p in params):
            return _flat(params)  # (mixed dtypes: promoted, as a concatenation does)
        out = self._buffer(name, params[0], params[0].dtype,
                           numel=sum(p.numel() for p in params))
        return torch.cat(params, out=out)

    def key(self) -> dict[str, Any]:
        return {"sync": self.name, "cycle": self.cycle, "warmup": self.warmup,
                "cooldown": self.cooldown, "total_batches": self.total_batches,
                "local_weight": self.local_weight, "global_dtype": str(self.global_dtype),
                "merge": self.merge}

    def setup(self, grid: _Grid) -> None:
        super().setup(grid)
        node_comm, glob_comm, self.leader = grid.node_split()
        # one node: the node's gradient average is the global one; nothing to exchange
        self.one_node = grid.data_node_count() == 1
        self.node = self._metered(node_comm, False)
        self.glob = self._metered(glob_comm, True)

    def averager(self) -> Any:
        if self.data is None:
            return None
        node = None if self.node is None else _CheckedAverager(self.node)
        return _PhaseAverager(self, _CheckedAverager(self.data), node)

    def synchronous(self, batch: int) -> bool:
        """Whether `batch` (0-based) is in warm-up or cool-down."""
        if batch < self.warmup:
            return True
        return self.total_batches is not None and batch >= self.total_batches - self.cooldown

    def after_step(self) -> None:
        b = self.batch
        if self.one_node:
            self.batch = b + 1
            return
        if self.data is not None and not self.synchronous(b):
            if self.pending is None:
                self._start(b)
            if self.pending is not None and self.pending["due"] <= b:
                self._finish()
        self.batch = b + 1
        if self.data is not None and self.synchronous(self.batch) and \
                not self.synchronous(b):  # entering cool-down: replicas agree again
            if self.pending is not None:
                self._finish()
            self._start(self.batch - 1, s=1)
            self._finish(advance=False)
            self._average_optimizer_state()

    def _average_optimizer_state(self) -> None:
        """Average the optimizer's floating-point state (Adam's moments, ...) over the
        replicas, entering cool-down: from then on the replicas hold the same
        parameters, the same state and all-reduced gradients, so they stay equal to
        the end.  Averaging the parameters alone left each replica its own Adam
        moments, and identical gradients gave different updates (replicas 2-3e-2
        apart at the end of a run; with SGD they were equal)."""
        if self.optimizer is None or self.data is None:
            raise RuntimeError(f"the {self.name} strategy averages optimizer state without an "
                               "optimizer or a data group (call setup and attach first)")
        states = [t for p in self._params()
                  for t in self.optimizer.state.get(p, {}).values()
                  if isinstance(t, Tensor) and t.is_floating_point() and t.numel()]
        if not states:
            return
        flat = _flat(states, torch.float64)
        self.data.allreduce_start(flat, "DASO's optimizer-state average").wait()
        flat /= self.data.size
        with torch.no_grad():
            for t, a in zip(states, _unflat(flat, states)):
                t.copy_(a)

    def _start(self, b: int, s: Optional[int] = None) -> None:
        s = self.cycle[self.pos] if s is None else s
        pend: dict[str, Any] = {"due": b + s - 1, "S": s, "handle": None, "flat": None,
                                "avg": None, "p_sent": None}
        if self.merge == "progress" and s > 1:
            # the parameters as sent (every replica of the node holds the same: a
            # checkpoint saves them per replica); a copy, kept until the merge
            pend["p_sent"] = self._flat_params("p_sent")
        if self.leader and self.glob is not None:
            # an all-gather of the raw bytes: any dtype on any backend (MPI has no
            # bfloat16 sum); the same payload per process as an all-reduce
            flat = self._flat_params("send") if pend["p_sent"] is None else pend["p_sent"]
            if self.ref is not None:  # the difference, rounded once into the wire dtype
                ref = self.ref
                wire = self.global_dtype or flat.dtype
                diff = self._buffer("diff", flat, wire)
                if wire == ref.dtype and flat.dtype == ref.dtype:
                    flat = torch.sub(flat, ref, out=diff)
                else:  # in the reference's dtype, then rounded: a subtraction with a
                    # bfloat16 output computes as slowly as mixed dtypes do (2x here)
                    flat = diff.copy_(torch.sub(flat.to(ref.dtype), ref,
                                                out=self._buffer("scratch", flat, ref.dtype)))
            pend["flat"] = self._buffer("parts", flat, flat.dtype, rows=self.glob.size)
            pend["handle"] = self.glob.allgather_start(flat, pend["flat"], "DASO's global "
                                                       "parameter exchange")
            pend["sent"] = flat
        self.pending = pend

    def _wait(self) -> None:
        """Complete the pending exchange (its average is kept in the pending record)."""
        pend = self.pending
        if pend is not None and pend["handle"] is not None:
            pend["handle"].wait()
            if self.glob is None:
                raise RuntimeError("DASO waits on a global reduction without a global group "
                                   "(call setup first)")
            parts = pend["flat"]
            acc = torch.float64 if parts.dtype == torch.float64 else torch.float32
            if self.ref is None:  # the first exchange: parameters (a fresh average)
                avg = parts.sum(0, dtype=acc).div_(self.glob.size)
            else:  # differences: their mean goes onto the reference, in place
                mean = self._buffer("mean", parts[0], acc)
                if parts.dtype == acc:
                    torch.sum(parts, 0, out=mean)
                else:  # part by part, each widened first: a sum over bfloat16 with a
                    # float32 result, or an add of mixed dtypes, is 3-4x slower here
                    mean.copy_(parts[0])
                    tmp = self._buffer("scratch", parts[0], acc)
                    for row in parts[1:]:
                        mean.add_(tmp.copy_(row))
                avg = self.ref.add_(mean.div_(self.glob.size))
            pend["avg"] = self.ref = avg
            pend["handle"] = pend["flat"] = pend["sent"] = None

    def _finish(self, advance: bool = True) -> None:
        self._wait()
        pend, self.pending = self.pending, None
        if pend is None:
            raise RuntimeError("DASO finishes a reduction that was never started")
        params = self._params()
        with torch.no_grad():
            if pend["avg"] is not None:
                avg = _unflat(pend["avg"], params)
                w = self.local_weight if pend["S"] > 1 else 0.0
                sent = None if pend["p_sent"] is None else _unflat(pend["p_sent"], params)
                for i, (p, a) in enumerate(zip(params, avg)):
                    if sent is not None:  # progress: avg + (p - p_sent)
                        p.sub_(sent[i]).add_(a.to(p.dtype))
                    elif self.merge == "weighted" and w:
                        p.mul_(w).add_(a.to(p.dtype)).div_(w + 1.0)
                    else:  # S = 1 (the average is fresh), or resumed without p_sent
                        p.copy_(a)
                if not _all_finite(params):
                    raise DivergenceError("DASO's merged parameters are not finite (NaN or "
                                          "inf in some replica)")
            if self.node is not None:  # the node's leader is its group rank 0
                flat = self._flat_params("bcast") if self.node.group_rank == 0 else None
                got = self.node.bcast_tensor(flat, 0, (sum(p.numel() for p in params),),
                                             params[0].dtype if params else torch.float32,
                                             params[0].device if params else
                                             torch.device("cpu"), "DASO's merged "
                                             "parameters from the node's first replica")
                if self.node.group_rank != 0:
                    for p, a in zip(params, _unflat(got, params)):
                        p.copy_(a)
        if advance:
            self.pos = (self.pos + 1) % len(self.cycle)

    def _extra_state(self) -> dict[str, Any]:
        self._wait()
        if self.grid is None or self.model is None:
            raise RuntimeError(f"the {self.name} strategy is not set up and attached (call "
                               "setup and attach first)")
        names = [n for n, _ in self.model.named_parameters()]

        def named(flat: Optional[Tensor]) -> Optional[dict[str, Tensor]]:
            return None if flat is None else {
                n: a.clone() for n, a in zip(names, _unflat(flat, self._params()))}

        pend = self.pending
        avg = named(pend["avg"] if pend is not None else None)
        sent = named(pend["p_sent"] if pend is not None else None)
        parts = self.grid.world.allgather_object(
            (avg, named(self.ref), self.grid.data_rank, sent), "DASO's pending exchange")
        merged: dict[str, Tensor] = {}
        ref: dict[str, Tensor] = {}
        # the parameters as sent, per replica (they differ between nodes)
        by_replica: dict[int, dict[str, Tensor]] = {}
        for part, r, d, s in parts:
            merged.update(part or {})
            ref.update(r or {})
            if s is not None:
                by_replica.setdefault(d, {}).update(s)
        pending = None if pend is None else {
            "due": pend["due"], "S": pend["S"], "avg": merged or None,
            "p_sent": [by_replica[d] for d in sorted(by_replica)] or None}
        return {"pos": self.pos, "pending": pending, "ref": ref or None}

    def _load_extra(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"]) % len(self.cycle)
        ref = state.get("ref")
        self.ref = _flat([ref[n] for n, _ in self.model.named_parameters()]) if (
            ref is not None and self.leader and self.glob is not None) else None
        pend = state.get("pending")
        if pend is None:
            self.pending = None
            return
        avg = None
        if pend["avg"] is not None and self.leader and self.glob is not None:
            avg = _flat([pend["avg"][n] for n, _ in self.model.named_parameters()])
        # the parameters as sent by the saved replica this one takes its parameters
        # from (replica d: saved replica d mod R, as in `load_state_dict`); a state
        # without them (saved under merge="weighted") merges by replacing
        sent, p_sent = pend.get("p_sent"), None
        if sent and self.merge == "progress":
            if self.grid is None:
                raise RuntimeError(f"the {self.name} strategy is not attached to a grid (call "
                                   "setup first)")
            p_sent = _flat([sent[self.grid.data_rank % len(sent)][n]
                            for n, _ in self.model.named_parameters()])
        self.pending = {"due": int(pend["due"]), "S": int(pend["S"]), "handle": None,
                        "flat": None, "avg": avg, "p_sent": p_sent}


def pack_signs(signs: Sequence[Tensor], planes: Optional[Tensor] = None) -> Tensor:
    """Update signs (entries -1, 0, +1) packed into two bit planes: a uint8 tensor
    of 2 x ceil(n / 8) bytes, n the total number of entries; bit i of the first plane
    is set where entry i is > 0, of the second where it is < 0 (neither: 0).  Lion's
    update is ``torch.sign`` of its momentum, whose 0 (an entry with no gradient, such
    as a dead unit's) means no step: one bit cannot carry three values.

    planes: a kept bool buffer of shape (2, n) to write the planes into (None: a new
    one); the bits are packed by numpy, on the host."""
    n = sum(u.numel() for u in signs)
    if planes is None:
        planes = torch.empty((2, n), dtype=torch.bool)
    if tuple(planes.shape) != (2, n) or planes.dtype != torch.bool:
        raise ValueError(f"`planes` must be a bool tensor of shape (2, {n}), got "
                         f"{planes.dtype} {tuple(planes.shape)}")
    for u, plus, minus in zip(signs, _unflat(planes[0], signs), _unflat(planes[1], signs)):
        if u.device.type == "cpu":
            torch.gt(u, 0, out=plus)
            torch.lt(u, 0, out=minus)
        else:
            plus.copy_(u > 0)
            minus.copy_(u < 0)
    return torch.from_numpy(np.packbits(planes.numpy(), axis=1).reshape(-1))


def _bit_count(rows: np.ndarray) -> list[np.ndarray]:
    """Per bit, how many of the P packed rows (uint8, P x bytes) have it set, as
    P.bit_length() bit planes (least significant first), added up bit-sliced: a
    ripple-carry add of each row on the packed bytes."""
    P = rows.shape[0]
    planes = [np.zeros_like(rows[0]) for _ in range(P.bit_length())]
    for w in rows:
        carry = w
        for k in range(len(planes)):  # the count is <= P: the last carry is 0
            planes[k], carry = planes[k] ^ carry, planes[k] & carry
    return planes


def _greater(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Packed bits set where count `a` > count `b` (bit-sliced counts of as many
    planes), compared from the most significant plane down."""
    gt = np.zeros_like(a[0])
    eq = np.full_like(a[0], 0xFF)
    for ak, bk in zip(reversed(a), reversed(b)):
        gt |= eq & ak & ~bk
        eq &= ~(ak ^ bk)
    return gt


def majority_bits(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The majority vote of P replicas' packed signs (`pack_signs` rows, uint8 of
    shape P x 2 x bytes), on the packed bits: ``(pos, neg)``, packed, the vote is +1
    where pos is set, -1 where neg is set, 0 where neither.

    The vote is sign(number of +1 - number of -1): a replica whose entry is 0
    abstains, so identical votes give that vote, all-zero votes give 0, and a tie
    (as many +1 as -1, zeros aside) gives 0 (no step).  Bit-sliced: each count is
    added up in P.bit_length() bit planes and the two are compared plane by plane,
    O(P log P) bitwise operations on the packed bytes (nothing is unpacked or
    widened to integers)."""
    if rows.ndim != 3 or rows.shape[1] != 2:
        raise ValueError(f"`rows` must be P x 2 x bytes (two bit planes per replica), "
                         f"got shape {rows.shape}")
    plus, minus = _bit_count(rows[:, 0]), _bit_count(rows[:, 1])
    return _greater(plus, minus), _greater(minus, plus)


def unpack_vote(pos: np.ndarray, neg: np.ndarray, n: int) -> np.ndarray:
    """`majority_bits`' packed vote as n int8 entries -1, 0, +1."""
    vote = np.unpackbits(pos, count=n).view(np.int8)
    return np.subtract(vote, np.unpackbits(neg, count=n).view(np.int8), out=vote)


class LionCub(SyncStrategy):
    """2-bit Lion updates (-1, 0, +1) merged by majority vote (see the module docstring).

    momentum_every: average the Lion momentum over the replicas every this many
    batches (0: never).  Needs a `Lion` optimizer."""

    name = "lioncub"

    def __init__(self, momentum_every: int = 64) -> None:
        super().__init__()
        nonneg_int("momentum_every", momentum_every)
        self.momentum_every = momentum_every
        self._planes: Optional[Tensor] = None  # where this replica's update is > 0, < 0

    def key(self) -> dict[str, Any]:
        return {"sync": self.name, "momentum_every": self.momentum_every}

    def averager(self) -> Any:
        # the replicas exchange updates, not gradients
        return None if self.data is None else _AttachCheck(self)

    def attach(self, model: Any, optimizer: torch.optim.Optimizer) -> SyncStrategy:
        if not isinstance(optimizer, Lion):
            raise TypeError(f"sync='lioncub' needs a layerpar Lion optimizer, got "
                            f"{type(optimizer).__name__}")
        super().attach(model, optimizer)
        optimizer.update_hook = self._vote if self.data is not None else None
        return self

    def _vote(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        if self.grid is None:
            raise RuntimeError(f"the {self.name} strategy is not attached to a grid (call "
                               "setup first)")
        guarded(self.grid.world, lambda: self._vote_here(pairs))

    def _vote_here(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        if self.data is None:
            raise RuntimeError("LionCub votes without a data-parallel group (call setup first)")
        signs = [u for _, u in pairs]
        # torch.sign(NaN) is 0: a NaN would vanish from the update, so look at the grads
        # (Lion pairs only parameters that have one)
        if not _all_finite(g for p, _ in pairs if (g := p.grad) is not None):
            where = "" if self.grid is None else \
                f" on data replica {self.grid.data_rank} (global rank {self.grid.world_rank})"
            raise DivergenceError(f"a gradient is not finite (NaN or inf){where}")
        n = sum(u.numel() for u in signs)
        if self._planes is None or self._planes.shape[1] != n:  # kept: no page faults
            self._planes = torch.empty((2, n), dtype=torch.bool)
        bits = pack_signs(signs, self._planes)
        out = torch.empty((self.data.size, bits.numel()), dtype=torch.uint8)
        self.data.allgather_start(bits, out, "Lion Cub's sign bits").wait()
        rows = out.numpy().reshape(self.data.size, 2, bits.numel() // 2)
        vote = unpack_vote(*majority_bits(rows), n)
        for u, v in zip(signs, _unflat(torch.from_numpy(vote), signs)):
            u.copy_(v)  # int8 -1/0/+1 into the sign tensor's dtype

    def after_step(self) -> None:
        self.batch += 1
        if self.data is None or not self.momentum_every or self.batch % self.momentum_every:
            return
        if self.optimizer is None:
            raise RuntimeError("LionCub averages momenta without an optimizer (call attach "
                               "first)")
        moms = [self.optimizer.state[p]["exp_avg"] for p in self._params()
                if "exp_avg" in self.optimizer.state.get(p, {})]
        if not moms:
            return
        flat = _flat(moms).contiguous().clone()
        self.data.allreduce_start(flat, "Lion Cub's momentum average").wait()
        flat /= self.data.size
        for m, a in zip(moms, _unflat(flat, moms)):
            m.copy_(a)


def make_sync(sync: Union[str, SyncStrategy]) -> SyncStrategy:
    """A strategy from its name ("allreduce", "daso", "lioncub": default settings) or
    as given (an instance, e.g. ``DASO(cycle=(8, 4, 2), warmup=100)``)."""
    if isinstance(sync, SyncStrategy):
        if sync.grid is not None:
            raise ValueError("`sync`: this strategy object already belongs to a grid")
        return sync
    if sync == "allreduce":
        return AllReduce()
    if sync == "daso":
        return DASO()
    if sync == "lioncub":
        return LionCub()
    raise ValueError(f"`sync` must be one of {SYNCS} or a SyncStrategy, got {sync!r}")
