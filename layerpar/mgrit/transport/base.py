"""The transport protocol: everything layerpar sends between ranks goes through it.

A `Transport` is one group of ranks (a communicator or a process group) seen from
one of them.  The engine, `solve()` and `LayerParallel` use only the methods of
`Transport`; a backend implements a handful of primitives (below, marked
"backend") and inherits the rest, so that rank mapping, message labels, the
agreement of options and the error semantics are the same under every backend.

Contract
--------
- **Ranks.**  `rank`/`size` are *engine* ranks: the position in the time partition.
  A `reversed()` view numbers them backwards (the adjoint solve) over the same
  channel.  `group_rank` is the rank in the group as its backend numbers it; the
  point-to-point and broadcast methods that are not engine callbacks take group
  ranks.
- **Point to point.**  `post_send(t, dest, tag)` / `post_recv(shape, dtype, device,
  src, tag)` start a message and return a handle; `complete(handle, what, peer)`
  finishes it and returns the received tensor (None for a send).  A CPU tensor is
  sent from its own memory; a CUDA tensor goes device to device where the backend
  can (NCCL) and is staged through host memory where it cannot (MPI, gloo).  The
  engine's callbacks `isend`/`irecv`/`wait` are these with engine ranks and the
  receive template of `set_template`.
- **Collectives.**  `allreduce_sum` (residual norms, float64 on the host),
  `allreduce_start` (a tensor summed in place, asynchronously: gradient buckets),
  `bcast_state`/`bcast_tensor`, `bcast_object`, `allgather_object` (small picklable
  objects, labelled: ranks at different steps raise `RankMismatchError` instead of
  pairing the wrong messages).
- **Agreement.**  `agree(key, error, what)` is the first collective of any solve or
  model: a rank whose own validation failed raises its error, the others raise
  `RemoteError` naming it, and differing keys raise `RankMismatchError` on every
  rank, before any other message is sent.
- **Errors.**  Every wait is bounded (`timeout` seconds; `TimeoutError` naming what was
  waited for, from which rank, and `set_context`'s text) and watches an error
  channel: `broadcast_error(exc)` tells every rank of the channel (for a process
  grid: every rank of the world) that this one failed, and a rank waiting anywhere
  then raises `RemoteError` instead of waiting on.  A rank that dies is reported as
  lost where the backend notices (a closed connection), else by the timeout.
- **Sub-groups.**  `split(parts)` and `subgroup(parts)` make groups of the same kind
  (an mpi4py communicator, a `torch.distributed` process group) from a partition of
  the group's ranks, following each backend's rules for creating them collectively;
  `node_key()` says which processes share a node.  A process grid builds its layer,
  data and node groups with these alone, whatever the backend.
- **Lifetime.**  A transport owns a duplicate of the user's group (its messages never
  meet the user's); `close()` releases it, and the groups `split`/`subgroup` made where
  the backend frees groups (collective).
"""
from __future__ import annotations

import contextlib
import copy
import io
import itertools
import math
import pickle
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from ...defaults import DEFAULT_TIMEOUT  # seconds any one wait may take
from ..errors import RankMismatchError, RemoteError

# requests given up on (a failure elsewhere, a timeout, a cancel) that may still be
# active, with their buffers: a backend may write into a receive buffer until the
# request completes, so these must never be freed
_UNFINISHED: list = []

#: seconds an operation may take to finish once a wait has read a posted failure,
#: before the wait raises it: the failing rank may have finished its part (a
#: collective of a method's construction, before it failed in the step after) while
#: this rank, descheduled on a busy host, had not yet seen the rest arrive; raising at
#: once would stop this rank in an earlier call than its peers.  Paid only after a
#: failure, in a wait it leaves unfinished
SETTLE = 1.0

__all__ = ["DEFAULT_TIMEOUT", "ChannelState", "ErrorChannel", "Transport", "check_timeout",
           "describe", "guarded", "pack", "unpack"]


def check_timeout(timeout: Any) -> float | None:
    """`timeout` as seconds (a positive finite number) or None (unbounded)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"`timeout` must be a number of seconds or None, got "
                        f"{type(timeout).__name__}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"`timeout` must be a positive finite number of seconds or None, "
                         f"got {timeout!r}")
    return float(timeout)


def as_tensor_state(state: Any) -> torch.Tensor:
    """A state as a tensor: a tensor, or a handle whose ``tensor()`` gives one."""
    return (state if isinstance(state, torch.Tensor) else state.tensor()).detach()


def pack(state: Any) -> np.ndarray:
    """A uint8 view of the state's bytes (a copy only for non-contiguous or CUDA tensors).
    A state is a tensor, or a handle whose ``tensor()`` gives one (a row of a batch)."""
    t = as_tensor_state(state)
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # "contiguous" whatever its stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


def unpack(buf: np.ndarray | torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor of `shape`/`dtype` whose bytes are `buf` (no copy on the CPU)."""
    raw = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
    if raw.numel() == 0:  # an empty buffer may have stride 0: view(dtype) would fail
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    t = raw.view(dtype).view(tuple(shape))
    return t.to(device) if torch.device(device).type != "cpu" else t


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (what travels on the error channel)."""
    return f"{type(exc).__name__}: {exc}"


def mismatch(labels: list[str]) -> Optional[RankMismatchError]:
    """The error for ranks that are at different steps (None if all labels agree)."""
    if all(lb == labels[0] for lb in labels):
        return None
    where = "; ".join(f"rank {q} is in {lb}" for q, lb in enumerate(labels))
    return RankMismatchError(
        f"the ranks are at different steps: {where}. Every rank must make the same "
        "calls in the same order (did a rank skip backward() or a batch?)")


def need_tensor(t: Optional[torch.Tensor], what: str) -> torch.Tensor:
    """`t`, which the root of a broadcast must give (a clear error where it did not)."""
    if t is None:
        raise ValueError(f"the root of {what} must pass the tensor to broadcast, got None")
    return t


def part_of(parts: Sequence[Sequence[int]], rank: int, smallest: int = 1) -> Optional[int]:
    """The index of the part of `parts` holding `rank` among those of at least `smallest`
    ranks (None: in none)."""
    return next((i for i, g in enumerate(parts) if rank in g and len(g) >= smallest), None)


def check_partition(parts: Sequence[Sequence[int]], size: int, cover: bool) -> None:
    """Raise ValueError unless `parts` are disjoint lists of ranks in [0, size), each in
    increasing order (and, with `cover`, hold every rank): the same on every rank, which
    passes the same `parts`."""
    seen: set[int] = set()
    for g in parts:
        if any(a >= b for a, b in zip(g, list(g)[1:])):
            raise ValueError(f"each part must list its ranks in increasing order, got "
                             f"{list(g)}")
        for q in g:
            if isinstance(q, bool) or not isinstance(q, int) or not 0 <= q < size:
                raise ValueError(f"`parts` must hold ranks in [0, {size}), got {q!r}")
            if q in seen:
                raise ValueError(f"`parts` must be disjoint: rank {q} is in two parts")
            seen.add(q)
    if cover and len(seen) != size:
        missing = sorted(set(range(size)) - seen)
        raise ValueError(f"`parts` must cover the group's {size} ranks; ranks {missing} "
                         "are in none")



class _CompactPickler(pickle.Pickler):
    """A pickler that writes a tensor viewing part of a larger storage as its own
    elements only.  Plain pickling writes a view's whole storage: a segment's per-layer
    parameters are rows of one tensor per name, so a state dict of 256 layers pickled
    as 256 copies of every layer (277 MB for 1 MB of parameters).  Tensors that
    require gradients are left to pickle's own rules."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and not obj.requires_grad and obj.layout == \
                torch.strided and obj.untyped_storage().nbytes() > \
                obj.numel() * obj.element_size():
            return obj.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """`obj` pickled, each tensor view with its own elements only (`_CompactPickler`):
    what `bcast_object` and `allgather_object` send."""
    buf = io.BytesIO()
    _CompactPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()

class ErrorChannel(Protocol):
    """Where a failing rank posts its failure for every rank of a world to see (one
    backend's kind: `MPIErrors`, `StoreErrors`); shared by the transports of a grid."""

    rank: int  #: this process's rank as the channel names it (its world rank)
    broken: Optional[RemoteError]  #: the failure seen on the channel, None while none

    def post(self, text: str) -> None:
        """Tell every other rank that this one failed with `text`."""


@dataclass
class ChannelState:
    """What a transport and its `reversed()` view share (one object, not a copy)."""

    #: the failure this channel has seen (its own, sent to the others, or received)
    broken: Optional[RemoteError] = None
    #: seconds any one wait may take (None: unbounded)
    timeout: Optional[float] = DEFAULT_TIMEOUT
    #: what the caller is doing now, named in a TimeoutError ("batch 3, backward pass")
    context: str = ""
    #: whether `close()` ran
    closed: bool = False
    #: byte counts by kind that `count_sent` adds to (a process grid's meter; None: none)
    meter: Optional[dict[str, int]] = None
    #: waits sleep between tests from the start instead of spinning first
    #: (`Transport.patiently`: a rank that waits out another's whole pass)
    patient: bool = False


class Pending:
    """An asynchronous collective started by `Transport.allreduce_start`."""

    def __init__(self, transport: Transport, handle: Any, what: str,
                 done: Optional[Callable[[], object]] = None) -> None:
        self._transport, self._handle, self._what, self._done = transport, handle, what, done

    def wait(self) -> None:
        """Complete the operation (bounded and error-aware like every wait)."""
        if self._handle is not None:
            self._transport.complete(self._handle, self._what)
            self._handle = None
            if self._done is not None:
                self._done()


class Transport:
    """One group of ranks seen from one of them (see the module docstring for the
    contract).  Subclasses implement the primitives marked "backend"."""

    #: the backend's name ("serial", "mpi", "gloo", "nccl")
    backend = "abstract"

    def __init__(self, size: int, group_rank: int, state: Optional[ChannelState] = None,
                 reverse: bool = False) -> None:
        self.size = size
        self.group_rank = group_rank
        self._reverse = reverse
        self.rank = self._map(group_rank)
        # shared with reversed(): failure, ownership, the wait bound, the caller's
        # context and the byte meter
        self._state = state if state is not None else ChannelState()
        self._reqs: dict[int, tuple[Any, str, int]] = {}
        self._ids = itertools.count()
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float64
        self._device = torch.device("cpu")

    # -- ranks -----------------------------------------------------------------------------
    def _map(self, q: int) -> int:
        """Engine rank <-> group rank (an involution)."""
        return self.size - 1 - q if self._reverse else q

    def reversed(self) -> Transport:
        """The same channel with ranks in reverse order (for the adjoint solve)."""
        view = copy.copy(self)
        view._reverse = not self._reverse
        view.rank = view._map(self.group_rank)
        view._reqs, view._ids = {}, itertools.count()
        return view

    # -- settings --------------------------------------------------------------------------
    @property
    def timeout(self) -> float | None:
        """Seconds any one wait may take (None: unbounded)."""
        return self._state.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._state.timeout = check_timeout(value)

    @contextlib.contextmanager
    def patiently(self) -> Iterator[None]:
        """Inside, this rank's waits sleep between tests from the start (0.1 ms, growing
        to 1 ms) instead of spinning first: for a rank that waits out another rank's
        whole pass (`SoloMethod`), whose spinning would take a core from it.  A wait
        ends up to a millisecond after its message came."""
        keep, self._state.patient = self._state.patient, True
        try:
            yield
        finally:
            self._state.patient = keep

    @property
    def failure(self) -> Optional[RemoteError]:
        """The failure this channel has seen (its own, sent to the others, or one
        received from another rank), None while there is none."""
        return self._state.broken

    @property
    def errors(self) -> Optional[ErrorChannel]:
        """The error channel this transport watches and posts to (None where there is
        no other rank); pass it to `make_transport(errors=...)` to share it."""
        return None

    @property
    def meter(self) -> Optional[dict[str, int]]:
        """The byte counts by kind that this transport's sends add to (None: not
        counted); a process grid sets its own meter on its layer transports."""
        return self._state.meter

    @meter.setter
    def meter(self, value: Optional[dict[str, int]]) -> None:
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"`meter` must be a dict of byte counts or None, got "
                            f"{type(value).__name__}")
        self._state.meter = value

    def set_context(self, text: str) -> None:
        """What the caller is doing now, for the message of a TimeoutError."""
        self._state.context = text

    def set_template(self, like: torch.Tensor) -> None:
        """Shape, dtype and device of the states received from now on."""
        self._shape, self._dtype, self._device = tuple(like.shape), like.dtype, like.device

    @property
    def template(self) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
        """(shape, dtype, device) of the states received, as `set_template` gave them."""
        return self._shape, self._dtype, self._device

    def world_rank(self, q: int) -> int:
        """Group rank `q` as the error channel numbers it (the world rank in a process
        grid); the group rank where the group is the world."""
        return q

    def _who(self, q: int) -> str:
        """"rank q", with its world rank where the group is a grid's layer or data
        group (a timeout named group ranks only, which blamed the wrong process)."""
        w = self.world_rank(q)
        return f"rank {q}" if w == q else f"rank {q} of this group (world rank {w})"

    def _timeout_error(self, what: str, peer: Optional[int], limit: float) -> TimeoutError:
        ctx = self._state.context
        who = self._who(peer) if peer is not None else "the other ranks"
        return TimeoutError(
            f"{self._who(self.group_rank)} waited {limit:g} s for {what} from {who}"
            f"{f' ({ctx})' if ctx else ''} and gave up: a rank may have stopped, skipped "
            "a backward() or be stuck (raise `timeout` if the work is just slow)")

    # -- backend primitives ----------------------------------------------------------------
    def post_send(self, t: torch.Tensor, dest: int, tag: int) -> Any:  # backend
        """Start sending tensor `t` to group rank `dest`; a handle for `complete`."""
        raise NotImplementedError

    def post_recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  src: int, tag: int) -> Any:  # backend
        """Start receiving a tensor from group rank `src`; a handle for `complete`."""
        raise NotImplementedError

    def complete(self, handle: Any, what: str = "a message",
                 peer: Optional[int] = None) -> Optional[torch.Tensor]:  # backend
        """Finish a started operation (bounded, error-aware): the received tensor, or
        None.  `what` and `peer` (a group rank) name it in a TimeoutError."""
        raise NotImplementedError

    def cancel_all(self) -> None:  # backend
        """Give up the engine's outstanding requests after a failure."""
        self._reqs.clear()

    def bcast_tensor(self, t: Optional[torch.Tensor], root: int, shape: Sequence[int],
                     dtype: torch.dtype, device: torch.device,
                     what: str = "a broadcast tensor") -> torch.Tensor:  # backend
        """Broadcast a tensor from group rank `root` (given there; received elsewhere)."""
        raise NotImplementedError

    def allreduce_start(self, t: torch.Tensor, what: str = "a gradient reduction"
                        ) -> Pending:  # backend
        """Start summing `t` over the group, in place; `.wait()` the result."""
        raise NotImplementedError

    def allgather_start(self, t: torch.Tensor, out: torch.Tensor,
                        what: str = "an all-gather") -> Pending:  # backend
        """Start gathering every rank's `t` (a contiguous CPU tensor, the same shape on
        every rank) into `out` (shape ``(size, *t.shape)``, rank order); `.wait()` it."""
        raise NotImplementedError

    def allreduce_sum(self, values: list[float]) -> list[float]:  # backend
        """Sums of small float lists over the group (residual norms), on the host."""
        raise NotImplementedError

    def _allgather_bytes(self, data: bytes, what: str) -> list[bytes]:  # backend
        raise NotImplementedError

    def _bcast_bytes(self, data: Optional[bytes], root: int, what: str) -> bytes:  # backend
        raise NotImplementedError

    def check_errors(self) -> None:  # backend
        """Raise `RemoteError` if another rank has reported a failure (non-blocking)."""

    def _post_error(self, text: str) -> None:  # backend
        raise NotImplementedError

    def close(self) -> None:  # backend
        """Release the duplicated group (collective)."""
        self._state.closed = True

    # -- sub-groups ------------------------------------------------------------------------
    def split(self, parts: Sequence[Sequence[int]]) -> Any:  # backend
        """This process's group among `parts`, disjoint lists of group ranks that cover
        the group, each in increasing order (as mpi4py's ``Split`` and
        torch.distributed's ``new_group`` make them), as a group of this backend's kind
        (collective: every process passes the same `parts`).  A backend may give the
        group itself for a part that is the whole group, and None for a part of one
        process (`make_transport(None)` is then that process's transport)."""
        raise NotImplementedError

    def subgroup(self, parts: Sequence[Sequence[int]]) -> Any:  # backend
        """This process's group among disjoint `parts` of group ranks that need not
        cover the group; parts of one process are not made; None where this process
        is in none of the others (collective: every process passes the same `parts`)."""
        raise NotImplementedError

    def node_key(self) -> Hashable:  # backend
        """A value equal on the processes of one node and different between nodes, as
        the launcher placed them (collective where the backend must ask the others)."""
        raise NotImplementedError

    # -- bytes sent ----------------------------------------------------------------------
    def count_sent(self, nbytes: int, kind: str = "p2p") -> None:
        """Add `nbytes` sent by this process to `meter` under `kind` (nothing where
        there is no meter)."""
        meter = self._state.meter
        if meter is not None:
            meter[kind] = meter.get(kind, 0) + int(nbytes)

    # -- the engine's callbacks (engine ranks, the receive template) ----------------------------
    def isend(self, dest: int, tag: int, state: Any) -> int:
        peer = self._map(dest)
        t = as_tensor_state(state)
        if t.dtype != self._dtype or t.shape != self._shape:
            # the receiver sized its buffer from the template: a state of another
            # dtype or shape would be cut short (MPI) or wait forever (gloo)
            raise RuntimeError(f"internal: a boundary state of {t.dtype} {tuple(t.shape)} "
                               f"where the states are {self._dtype} {self._shape}")
        self.count_sent(t.numel() * t.element_size())
        handle = self.post_send(t, peer, tag)
        rid = next(self._ids)
        self._reqs[rid] = (handle, "a boundary state to be received", peer)
        return rid

    def irecv(self, src: int, tag: int) -> int:
        peer = self._map(src)
        handle = self.post_recv(self._shape, self._dtype, self._device, peer, tag)
        rid = next(self._ids)
        self._reqs[rid] = (handle, "a boundary state", peer)
        return rid

    def wait(self, rid: int) -> Optional[torch.Tensor]:
        handle, what, peer = self._reqs.pop(rid)
        return self.complete(handle, what, peer)

    def bcast_state(self, state: Optional[torch.Tensor], root: int) -> torch.Tensor:
        """Broadcast a state of the template's shape from engine rank `root`.  The root
        keeps its own tensor, autograd graph included (a `solve()` whose `u0` requires
        grad returns a differentiable final state where it was computed); the other
        ranks receive its values."""
        own = None if state is None else \
            state if isinstance(state, torch.Tensor) else state.tensor()
        got = self.bcast_tensor(None if own is None else own.detach(), self._map(root),
                                self._shape, self._dtype, self._device, "a broadcast state")
        return got if own is None else own

    # -- blocking point to point (group ranks) ----------------------------------------------------
    def send_tensor(self, t: torch.Tensor, dest: int, tag: int,
                    what: str = "a tensor to be received") -> None:
        self.count_sent(t.numel() * t.element_size())
        self.complete(self.post_send(t, dest, tag), what, dest)

    def recv_tensor(self, src: int, tag: int, shape: Sequence[int], dtype: torch.dtype,
                    device: torch.device, what: str = "a tensor") -> torch.Tensor:
        got = self.complete(self.post_recv(shape, dtype, device, src, tag), what, src)
        if got is None:
            raise RuntimeError(f"the {self.backend} transport completed the receive of "
                               f"{what} from rank {src} without a tensor")
        return got

    # -- small objects ---------------------------------------------------------------------
    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a small picklable object from group rank `root`."""
        data = dumps(obj) if self.group_rank == root else None
        return pickle.loads(self._bcast_bytes(data, root, "a broadcast object"))

    def allgather_object(self, obj: Any, what: str = "an exchange of small objects") -> list[Any]:
        """Gather a small picklable object from every rank (error-aware).

        Each rank's object travels with a label: `what`, and the caller's context (batch
        and pass).  Collectives are matched by their order alone, so a rank that skipped
        a step (say a backward()) would otherwise pair this exchange with a different
        one and read the wrong data; differing labels raise `RankMismatchError` on every
        rank, saying where each rank is."""
        ctx = self._state.context
        label = what + (f" ({ctx})" if ctx else "")
        got = [pickle.loads(b) for b in self._allgather_bytes(
            dumps((label, obj)), f"{what} (all ranks must call it)")]
        err = mismatch([g[0] for g in got])
        if err is not None:
            raise err
        return [g[1] for g in got]

    def agree(self, key: Any, error: BaseException | None, what: str) -> None:
        """Collective check before any solve message: every rank raises the same way.

        A rank whose local validation failed (`error`) raises it; the others raise
        `RemoteError` naming it.  If all passed but `key` differs between ranks, every
        rank raises `RankMismatchError` saying which ranks disagree about `what`.
        """
        gathered = self.allgather_object((None if error is None else describe(error), key),
                                         f"the agreement on {what}")
        if error is not None:  # this rank's own argument is bad: say so, not "rank q failed"
            raise error
        for q, (err, _) in enumerate(gathered):
            if err is not None:
                raise RemoteError(q, err)
        keys = [k for _, k in gathered]
        if any(k != keys[0] for k in keys):
            bad = [q for q, k in enumerate(keys) if k != keys[0]]
            if all(isinstance(k, dict) for k in keys):
                names = [n for n in keys[0] if any(k.get(n) != keys[0][n] for k in keys)]
                names += [n for k in keys for n in k if n not in keys[0] and n not in names]
                detail = "; ".join(
                    f"`{n}`: " + ", ".join(f"rank {q} has {k.get(n)!r}" for q, k in
                                           enumerate(keys)) for n in names)
                raise RankMismatchError(f"{what} differ between ranks: {detail}")
            raise RankMismatchError(
                f"{what} differ between ranks: rank 0 has {keys[0]!r}, ranks {bad} have "
                f"{[keys[q] for q in bad]!r}")

    # -- the error channel -----------------------------------------------------------------
    def broadcast_error(self, exc: BaseException) -> None:
        """Tell every other rank of the error channel that this one failed with `exc`
        (does not raise)."""
        if isinstance(exc, RemoteError) or self._state.broken is not None:
            return
        self._post_error(describe(exc))
        self._state.broken = RemoteError(self.error_rank, describe(exc))

    def stopped_by(self, exc: BaseException) -> BaseException:
        """What this rank raises after `exc` broke off work whose messages are not this
        transport's (torch's own: a pipeline schedule's, DistributedDataParallel's):
        `exc` itself, posted for the other ranks (`broadcast_error`), or the failure
        another rank posted where `exc` only says that rank's connection closed
        (`TorchTransport`)."""
        self.broadcast_error(exc)
        return exc

    @property
    def error_rank(self) -> int:
        """This rank as the error channel names it (the world rank in a process grid)."""
        return self.group_rank


def guarded(transport: Transport, fn: Callable[[], Any]) -> Any:
    """Run `fn`; if it raises here, tell the other ranks before re-raising."""
    try:
        return fn()
    except RemoteError:
        raise
    except BaseException as exc:
        transport.broadcast_error(exc)
        raise
