"""The transport over a `torch.distributed` process group (torchrun; gloo or NCCL).

- **Where tensors go.**  With NCCL, CUDA tensors are sent, received, broadcast and
  reduced on the device (no host staging; waits are stream-ordered, so a training
  step has no host-device synchronisation).  With gloo, CPU tensors are sent from
  their own memory and CUDA tensors are staged through the host.  Small objects
  (agreements, shapes) and the host-side norm reductions always use a gloo group.
- **Bounded, error-aware waits.**  gloo's point-to-point requests cannot be polled
  (their ``is_completed()`` stays False until ``wait()`` is called, and a timed
  ``wait`` closes the connection), so each is waited for by a helper thread of a
  small pool while the caller waits on an event: slices of at most 10 ms, between
  which it looks at the error channel and the timeout.  Collectives are polled
  directly.
- **The error channel** is a key in the job's rendezvous store (the TCPStore that
  torchrun or ``init_process_group`` created): a failing rank writes its message
  there; a waiting rank looks at it at least every 10 ms (one store round trip) and
  raises `RemoteError` (where its operation does not finish within `SETTLE` of the
  read: one that the others had finished returns its result).  It works
  under gloo and NCCL alike and reaches every rank of a process grid.
- **A rank that dies** (SIGKILL): gloo closes its connections, so a rank waiting for
  it gets an error at once, raises `RankLostError` naming it (when it waited for that
  rank) and posts it for the others.  With NCCL a wait on a dead peer is not seen by
  the host; the process group's own timeout (set to the transport's, see
  `TorchTransport`) aborts the job.  Under torchrun the agent also stops the job when
  any worker dies.
"""
from __future__ import annotations

import datetime
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..errors import RankLostError, RemoteError
from .base import (
    _UNFINISHED,
    SETTLE,
    Pending,
    Transport,
    check_partition,
    need_tensor,
    part_of,
)

_LOST = ("Connection closed", "Connection reset", "Broken pipe", "connection refused",
         "Socket closed", "NCCL communicator was aborted")


def _is_lost(exc: BaseException) -> bool:
    text = str(exc)
    return any(s.lower() in text.lower() for s in _LOST)


class StoreErrors:
    """An error channel in a `torch.distributed` store, shared by the transports of a
    process grid: `post` writes the failure under `prefix`, `poll` reads it.

    A lost process is found by a census: the rank that notices a closed connection
    without knowing whose (a collective) posts a query, every rank that reads it
    answers by writing an "alive" key, and after `CENSUS_SECONDS` the ranks that did
    not answer are named in the verdict every rank then raises."""

    QUERY = "LOST ?"
    CENSUS_SECONDS = 3.0

    def __init__(self, store: Any, prefix: str, rank: int) -> None:
        self.store, self.key, self.rank = store, f"layerpar/{prefix}/error", rank
        self.broken: Optional[RemoteError] = None
        self._next = 0.0

    def _unreachable(self, exc: BaseException) -> RemoteError:
        self.broken = RankLostError(None, "the rendezvous store is unreachable (rank 0's "
                                    f"process or the launcher is gone: {exc})")
        return self.broken

    def poll(self, force: bool = True) -> Optional[RemoteError]:
        """The posted failure, if any (a store round trip; with `force` False at most
        every 5 ms)."""
        if self.broken is not None:
            return self.broken
        now = time.monotonic()
        if not force and now < self._next:
            return None
        self._next = now + 0.005
        try:
            if not self.store.check([self.key]):
                return None
            src, _, text = self.store.get(self.key).decode("utf-8", "replace").partition("\n")
            if text == self.QUERY:  # a census: answer it, then wait for its verdict
                self.store.set(f"{self.key}/alive/{self.rank}", "1")
                verdict = f"{self.key}/verdict"
                self.store.wait([verdict], datetime.timedelta(
                    seconds=self.CENSUS_SECONDS + 10))
                src, _, text = self.store.get(verdict).decode(
                    "utf-8", "replace").partition("\n")
        except Exception as exc:  # noqa: BLE001 - the store's host is gone
            return self._unreachable(exc)
        if text.startswith(RankLostError.PREFIX):
            self.broken = RankLostError(int(src), text[len(RankLostError.PREFIX):])
        else:
            self.broken = RemoteError(int(src), text)
        return self.broken

    def census(self) -> Optional[list[int]]:
        """Post a census query and return the world ranks that did not answer within
        `CENSUS_SECONDS` (a waiting rank looks every 10 ms); None when another
        rank posted a failure or a census first (`poll` then reads it)."""
        try:
            if self.store.compare_set(self.key, "", f"{self.rank}\n{self.QUERY}").decode(
                    "utf-8", "replace") != f"{self.rank}\n{self.QUERY}":
                return None
            self.store.set(f"{self.key}/alive/{self.rank}", "1")
            keys = [f"{self.key}/alive/{q}" for q in range(dist.get_world_size())]
            deadline = time.monotonic() + self.CENSUS_SECONDS
            while True:
                missing = [q for q, k in enumerate(keys) if not self.store.check([k])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store itself is gone
            return []

    def post(self, text: str, rank: Optional[int] = None) -> None:
        """Tell every rank: `rank` (default: this one) failed with `text`; after a
        census, the verdict."""
        if self.broken is not None:
            return
        src = self.rank if rank is None else rank
        try:
            got = self.store.compare_set(self.key, "", f"{src}\n{text}").decode(
                "utf-8", "replace")
            if got.endswith(self.QUERY):  # our census (or another's): its verdict
                self.store.compare_set(f"{self.key}/verdict", "", f"{src}\n{text}")
        except Exception:  # noqa: BLE001 - best effort: the waits still time out
            pass
        self.broken = RemoteError(src, text)


#: the tag of `sever`'s receives, which nothing sends
_SEVER_TAG = 0x5EE


def sever(group: Any) -> None:
    """Close this rank's connections to the other ranks of `group`, so that a rank
    blocked in a wait of torch's own on it (a pipeline schedule's receive,
    DistributedDataParallel's all-reduce) raises at once ("Connection closed by
    peer", which `TorchTransport.stopped_by` turns into the failure this rank posted)
    instead of waiting out the group's timeout.  gloo closes the connection of a
    receive whose timed wait expires: one receive from each other rank on a tag
    nothing sends, waited for a millisecond.  A NCCL group is aborted.  The group is
    unusable afterwards; nothing raises here."""
    try:
        if "nccl" in str(dist.get_backend(group)).lower():
            group.abort()
            return
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        buf = torch.empty(1)
        for q in ranks:
            if q != me:
                try:
                    work = dist.irecv(buf, q, group=group, tag=_SEVER_TAG)
                    if work is not None:
                        work.wait(datetime.timedelta(milliseconds=1))
                except Exception:  # noqa: BLE001 - the expected expiry, which severs
                    pass
    except Exception:  # noqa: BLE001 - best effort: the peers' waits still time out
        pass


def _sleep(seconds: float) -> bool:
    """Sleep; False: the wait is not over (a `block` for `TorchTransport._wait`)."""
    time.sleep(seconds)
    return False


class _Waiters:
    """Daemon threads that block in gloo ``Work.wait()`` for the caller (see the module
    docstring); one per outstanding request, reused.  Daemon threads never delay exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, work: Any) -> list:
        """Start waiting for `work`; returns a box [event, error] filled when done."""
        box = [threading.Event(), None]
        with self._lock:
            if self._idle == 0:
                threading.Thread(target=self._run, daemon=True,
                                 name="layerpar-gloo-wait").start()
            else:
                self._idle -= 1
        self._jobs.put((work, box))
        return box

    def _run(self) -> None:
        while True:
            work, box = self._jobs.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                box[1] = exc
            box[0].set()
            with self._lock:
                self._idle += 1


_WAITERS = _Waiters()


def default_store() -> Any:
    """The store `init_process_group` rendezvoused through (the error channel's home)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


class TorchTransport(Transport):
    """Transport over a `torch.distributed` process group.

    The group is used as it is, not duplicated: a duplicate would have to be created
    by every process of the world (or named consistently by its members), which a
    layer group of a grid cannot promise.  Collectives of one program run in program
    order on every rank, so sharing the group with the user's own collectives is safe;
    layerpar's point-to-point tags are >= 31000 (a user's own send/recv on the same
    group must use other tags).  A NCCL-only group gets a gloo group for small
    messages, which every process of the world must create at the same time (build
    models on all processes together, as a `ProcessGrid` does).  `errors`: a shared
    error channel (a process grid's); by default the transport opens its own in the
    default store.  `timeout` bounds that extra gloo group's operations.
    """

    def __init__(self, group: Any, *, errors: Optional[StoreErrors] = None,
                 timeout: Optional[float] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("`comm` is a torch.distributed process group but "
                               "torch.distributed is not initialized")
        ranks = dist.get_process_group_ranks(group)
        name = str(dist.get_backend(group)).lower()
        self._nccl = "nccl" in name
        self.backend = "nccl" if self._nccl else "gloo"
        self.group = group
        # small objects, host-side reductions, staged tensors: gloo
        self.cpu_group = group
        self._made: list = []
        if self._nccl and "gloo" not in name and "cpu" not in name:
            kw: dict[str, Any] = {}
            if timeout is not None:
                kw["timeout"] = datetime.timedelta(seconds=timeout)
            self.cpu_group = dist.new_group(ranks=ranks, backend="gloo", **kw)
            self._made.append(self.cpu_group)
        self._global = ranks
        super().__init__(len(ranks), dist.get_rank(group))
        if errors is None:
            # from the OS, not torch's generator: drawn on one rank, it would put that
            # rank's generator out of step with the others'
            tag = torch.tensor([secrets.randbits(62) if self.group_rank == 0 else 0],
                               dtype=torch.int64)
            dist.broadcast(tag, src=ranks[0], group=self.cpu_group)
            errors = StoreErrors(default_store(), f"{int(tag)}", dist.get_rank())
        self._errors = errors

    @property
    def errors(self) -> StoreErrors:
        return self._errors

    @property
    def error_rank(self) -> int:
        return self._errors.rank

    def world_rank(self, q: int) -> int:
        return int(self._global[q])

    # -- waiting ---------------------------------------------------------------------------
    def _wait(self, done: Callable[[], bool], block: Callable[[float], bool], what: str,
              peer: Optional[int]) -> None:
        """Until `done()`: spin for 2 ms (not at all in a patient wait,
        `Transport.patiently`), then `block(slice)` for slices growing to 10 ms,
        watching the error channel and the timeout in between.  A posted failure is
        raised where the operation has not finished `SETTLE` seconds after it was
        read (one the others had finished returns its result)."""
        if self._state.broken is not None:
            raise self._state.broken
        limit = self._state.timeout
        spin = 0.0 if self._state.patient else 0.002
        start = time.monotonic()
        pause = 0.0
        settle: Optional[float] = None  # when a failure read stops the wait
        while not done():
            now = time.monotonic()
            waited = now - start
            if waited >= spin:
                broken = self._errors.poll(force=False)
                if broken is not None:
                    if settle is None:
                        settle = now + SETTLE
                    elif now > settle:
                        self._state.broken = broken
                        raise broken
                if limit is not None and waited > limit:
                    raise self._timeout_error(what, peer, limit)
                pause = min(0.01, pause + 0.0005)
                if block(pause):
                    break

    def _finish_work(self, work: Any, what: str, peer: Optional[int]) -> None:
        """Complete a collective's work (gloo collectives can be polled)."""
        try:
            self._wait(work.is_completed, _sleep, what, peer)
            work.wait()
        except BaseException as exc:
            _UNFINISHED.append(work)
            raise self._lost(exc, peer) from exc

    def _lost(self, exc: BaseException, peer: Optional[int]) -> BaseException:
        """A backend error that means a peer's process is gone becomes RankLostError
        (posted for the other ranks); anything else is returned as it is."""
        if isinstance(exc, (RemoteError, TimeoutError)) or not _is_lost(exc):
            return exc
        posted = self._errors.poll(force=True)
        if posted is not None:  # (a failing rank posts, then may sever: `sever`)
            self._state.broken = posted
            return posted
        who = self._global[peer] if peer is not None else None
        how = "its connection closed while this rank waited for it"
        if who is None:
            missing = self._errors.census()
            if missing is None:  # another rank was first: its verdict
                got = self._errors.poll(force=True)
                if got is not None:
                    self._state.broken = got
                    return got
                missing = []
            if len(missing) == 1:
                who, how = missing[0], "a connection closed and it did not answer"
            elif missing:
                how = f"ranks {missing} did not answer after a connection closed"
        err = RankLostError(who, f"{how} ({str(exc).splitlines()[0][:160]})")
        self._errors.post(RankLostError.PREFIX + err.detail, -1 if who is None else who)
        self._state.broken = err
        return err

    def _start(self, fn: Callable, peer: Optional[int], *args: Any, **kw: Any) -> Any:
        """Start a backend operation; a lost peer's error becomes RankLostError."""
        try:
            return fn(*args, **kw)
        except BaseException as exc:
            raise self._lost(exc, peer) from exc

    def check_errors(self) -> None:
        broken = self._state.broken or self._errors.poll()
        if broken is not None:
            self._state.broken = broken
            raise broken

    def _post_error(self, text: str) -> None:
        self._errors.post(text)

    def stopped_by(self, exc: BaseException) -> BaseException:
        """As `Transport.stopped_by`; a failure another rank posted first is every
        rank's (this one's `exc` most likely followed from it: a closed connection,
        which `sever` makes)."""
        if self._state.broken is None:
            first = self._errors.poll(force=True)
            if first is not None:
                self._state.broken = first
                return first
            if _is_lost(exc):  # (and nothing posted: a process is gone)
                return self._lost(exc, None)
        return super().stopped_by(exc)

    # -- point to point --------------------------------------------------------------------
    def _on_device(self, device: torch.device) -> bool:
        return self._nccl and device.type == "cuda"

    def post_send(self, t: torch.Tensor, dest: int, tag: int) -> Any:
        t = t.detach()
        if self._on_device(t.device):
            x = t.contiguous()
            work = self._start(dist.isend, dest, x, self._global[dest], group=self.group,
                               tag=tag)
            return ("nccl", work, x, None)
        x = t.to("cpu").contiguous()
        work = self._start(dist.isend, dest, x, self._global[dest], group=self.cpu_group,
                           tag=tag)
        return ("gloo", work, x, None, _WAITERS.submit(work))

    def post_recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  src: int, tag: int) -> Any:
        if self._on_device(device):
            x = torch.empty(tuple(shape), dtype=dtype, device=device)
            work = self._start(dist.irecv, src, x, self._global[src], group=self.group,
                               tag=tag)
            return ("nccl", work, x, device)
        x = torch.empty(tuple(shape), dtype=dtype)
        work = self._start(dist.irecv, src, x, self._global[src], group=self.cpu_group,
                           tag=tag)
        return ("gloo", work, x, device, _WAITERS.submit(work))

    def complete(self, handle: Any, what: str = "a message",
                 peer: Optional[int] = None) -> Optional[torch.Tensor]:
        kind, work, x, device = handle[:4]
        if kind == "nccl":
            work.wait()  # stream-ordered: no host wait
        elif kind == "gloo":
            box = handle[4]
            try:
                self._wait(box[0].is_set, box[0].wait, what, peer)
            except BaseException:
                _UNFINISHED.append(handle)
                raise
            if box[1] is not None:
                raise self._lost(box[1], peer) from box[1]
        else:  # a collective
            self._finish_work(work, what, peer)
            if handle[4] is not None:
                handle[4]()
            return None
        if device is None:
            return None
        return x if x.device == device else x.to(device)

    def cancel_all(self) -> None:
        for handle, *_ in self._reqs.values():
            _UNFINISHED.append(handle)  # gloo cannot cancel: keep the buffers alive
        self._reqs.clear()

    # -- collectives -----------------------------------------------------------------------
    def _host(self, fn: Callable, what: str, peer: Optional[int], *args: Any) -> None:
        """A collective on the host (gloo) group, started and completed."""
        work = self._start(fn, peer, *args, group=self.cpu_group, async_op=True)
        self._finish_work(work, what, peer)

    def allreduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self._host(dist.all_reduce, "the residual norm's reduction", None, t)
        return t.tolist()

    def allreduce_start(self, t: torch.Tensor, what: str = "a gradient reduction") -> Pending:
        if self._on_device(t.device) and t.is_contiguous():
            work = self._start(dist.all_reduce, None, t, group=self.group, async_op=True)
            return Pending(self, ("nccl", work, t, None), what)
        staged = t.device.type != "cpu" or not t.is_contiguous()
        host = t.detach().to("cpu", copy=True).contiguous() if staged else t.detach()
        work = self._start(dist.all_reduce, None, host, group=self.cpu_group, async_op=True)
        done = (lambda: t.copy_(host)) if staged else None
        return Pending(self, ("coll", work, host, None, done), what)

    def allgather_start(self, t: torch.Tensor, out: torch.Tensor,
                        what: str = "an all-gather") -> Pending:
        if self._on_device(t.device) and self._on_device(out.device):
            work = self._start(dist.all_gather_into_tensor, None, out.reshape(-1),
                               t.contiguous().reshape(-1), group=self.group, async_op=True)
            return Pending(self, ("nccl", work, out, None), what)
        host = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        parts = [torch.empty_like(host) for _ in range(self.size)]
        work = self._start(dist.all_gather, None, parts, host, group=self.cpu_group,
                           async_op=True)

        def done() -> None:  # bytes, whatever the dtype (gloo lacks some)
            flat = torch.cat(parts)
            if out.device.type == "cpu" and out.is_contiguous():
                out.reshape(-1).view(torch.uint8).copy_(flat)
            else:
                out.copy_(flat.view(out.dtype).view(out.shape))
        return Pending(self, ("coll", work, (host, parts), None, done), what)

    def bcast_tensor(self, t: Optional[torch.Tensor], root: int, shape: Sequence[int],
                     dtype: torch.dtype, device: torch.device,
                     what: str = "a broadcast tensor") -> torch.Tensor:
        mine = need_tensor(t, what) if self.group_rank == root else None
        if self._on_device(torch.device(device)):
            x = mine.contiguous() if mine is not None else torch.empty(
                tuple(shape), dtype=dtype, device=device)
            self._start(dist.broadcast, root, x, self._global[root], group=self.group,
                        async_op=True).wait()
            return mine if mine is not None else x
        x = mine.detach().to("cpu").contiguous() if mine is not None else torch.empty(
            tuple(shape), dtype=dtype)
        self._host(dist.broadcast, what, root, x, self._global[root])
        if mine is not None:
            return mine
        return x if torch.device(device).type == "cpu" else x.to(device)

    def _bcast_bytes(self, data: Optional[bytes], root: int, what: str) -> bytes:
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._host(dist.broadcast, what, root, n, self._global[root])
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
               else torch.empty(int(n), dtype=torch.uint8))
        if int(n):
            self._host(dist.broadcast, what, root, buf, self._global[root])
        return bytes(buf.numpy())

    def _allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._host(dist.all_gather, what, None, sizes, n)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._host(dist.all_gather, what, None, outs, mine)
        return [bytes(o[:int(s)].numpy()) for o, s in zip(outs, sizes)]

    # -- sub-groups ------------------------------------------------------------------------
    def _new_group_kw(self) -> dict[str, Any]:
        """``new_group`` arguments of a sub-group: this group's kind (NCCL or gloo) and
        the transport's timeout."""
        kw: dict[str, Any] = {"backend": "nccl" if self._nccl else "gloo"}
        if self.timeout is not None:
            kw["timeout"] = datetime.timedelta(seconds=self.timeout)
        return kw

    def split(self, parts: Sequence[Sequence[int]]) -> Any:
        """The group itself for one part, None for parts of one process; otherwise a
        new group.  Within the whole world, every process creates every group in the
        same order (torch names groups by creation order); within a subgroup of it,
        only a group's members create it (torch then names it by its ranks and the
        number of groups each member made before, which its members share as long as
        they made the same groups before)."""
        check_partition(parts, self.size, cover=True)
        if len(parts) == 1:
            return self.group
        if all(len(g) == 1 for g in parts):
            return None
        mine = part_of(parts, self.group_rank)
        local = self.size != dist.get_world_size()
        kw = {**self._new_group_kw(), "use_local_synchronization": local}
        got = None
        for i, g in enumerate(parts):
            if len(g) > 1 and (not local or i == mine):
                made = dist.new_group([self._global[q] for q in g], **kw)
                if i == mine:
                    got = made
        return got

    def subgroup(self, parts: Sequence[Sequence[int]]) -> Any:
        """Every process creates every group of two or more, in order."""
        check_partition(parts, self.size, cover=False)
        mine = part_of(parts, self.group_rank, smallest=2)
        kw = self._new_group_kw()
        got = None
        for i, g in enumerate(parts):
            if len(g) > 1:
                made = dist.new_group([self._global[q] for q in g], **kw)
                if i == mine:
                    got = made
        return got

    def node_key(self) -> Hashable:
        """The node index from torchrun's LOCAL_WORLD_SIZE (consecutive ranks per
        node), else the host name."""
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return dist.get_rank() // int(local) if local else socket.gethostname()

    def close(self) -> None:
        """Forget outstanding requests; release a gloo group made for a NCCL group
        (the groups `split`/`subgroup` made live as long as torch.distributed)."""
        if self._state.closed:
            return
        self._state.closed = True
        self.cancel_all()
        if self._state.broken is None and self._errors.broken is None:
            for g in self._made:
                try:
                    dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001 - already gone with the default group
                    pass
