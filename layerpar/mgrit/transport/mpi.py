"""The transport over an mpi4py communicator (mpiexec, srun).

Tensors travel as bytes from their own memory (a CPU tensor is sent and received
without pack/unpack copies; a CUDA tensor is staged through host memory).  Every
wait polls its request together with the error channel: a receive posted once on a
duplicate of the channel's communicator, which a failing rank's message completes.
"""
from __future__ import annotations

import atexit
import functools
import math
import time
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn, Optional

import numpy as np
import torch

from ..errors import RemoteError
from .base import (
    _UNFINISHED,
    SETTLE,
    Pending,
    Transport,
    check_partition,
    nbytes,
    need_tensor,
    pack,
    part_of,
    unpack,
)

_ERROR_TAG = 32001
_ERROR_BYTES = 4096


def _cancel_request(req: Any) -> None:
    """Cancel and complete a pending receive (no-op if already complete or freed)."""
    try:
        if req and not req.Test():
            req.Cancel()
            req.Wait()
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


def _settles(req: Any) -> bool:
    """Whether `req` finishes within `SETTLE` seconds (a failure having been read)."""
    end = time.monotonic() + SETTLE
    while not req.Test():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


class MPIErrors:
    """An error channel over (a duplicate of) a communicator: one receive from any
    source stays posted; `post` sends a failure's text to every other rank.  Shared by
    all transports of a process grid, so a failure reaches the whole world."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.buf = bytearray(_ERROR_BYTES)
        self.status = MPI.Status()
        self.req = comm.Irecv([self.buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_ERROR_TAG)
        self.broken: Optional[RemoteError] = None
        self.closed = False
        # cancel the error receive before mpi4py finalizes MPI (atexit is LIFO)
        self._atexit = functools.partial(_cancel_request, self.req)
        atexit.register(self._atexit)

    def remote(self) -> RemoteError:
        """The failure the posted receive got (call once it completed)."""
        if self.broken is None:
            n = self.status.Get_count(self._MPI.BYTE)
            msg = bytes(self.buf[:n]).decode("utf-8", "replace")
            self.broken = RemoteError(self.status.Get_source(), msg)
        return self.broken

    def poll(self) -> Optional[RemoteError]:
        if self.broken is not None or self.req.Test(self.status):
            return self.remote()
        return None

    def post(self, text: str) -> None:
        if self.broken is not None:
            return
        data = text.encode("utf-8", "replace")[:_ERROR_BYTES]
        reqs = [self.comm.Isend([data, self._MPI.BYTE], dest=q, tag=_ERROR_TAG)
                for q in range(self.comm.Get_size()) if q != self.rank]
        self._MPI.Request.Waitall(reqs)
        self.broken = RemoteError(self.rank, text)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._atexit)
        _cancel_request(self.req)


class MPITransport(Transport):
    """Transport over an mpi4py communicator (duplicated, so tags never clash with the
    user's messages).  Engine rank q is communicator rank q, or size-1-q in the
    `reversed()` view (adjoint solves).  `errors`: a shared error channel (a process
    grid's); by default the transport opens its own on its duplicate.  Its sub-groups
    are communicators split from the duplicate, freed by `close()`."""

    backend = "mpi"

    def __init__(self, comm: Any, *, errors: Optional[MPIErrors] = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm.Dup()
        self._own_errors = errors is None
        self._errors = MPIErrors(self.comm) if errors is None else errors
        # communicators split() and subgroup() made (shared with reversed(): one list)
        self._groups: list[Any] = []
        super().__init__(self.comm.Get_size(), self.comm.Get_rank())

    @property
    def errors(self) -> MPIErrors:
        return self._errors

    @property
    def error_rank(self) -> int:
        return self._errors.rank

    def world_rank(self, q: int) -> int:
        if self._errors.comm.Get_size() == self.size:
            return q
        got = self._MPI.Group.Translate_ranks(self.comm.Get_group(), [q],
                                              self._errors.comm.Get_group())
        return int(got[0])

    # -- waiting ---------------------------------------------------------------------------
    def _raise_remote(self) -> NoReturn:
        broken = self._state.broken or self._errors.remote()
        self._state.broken = broken
        raise broken

    def _wait_request(self, req: Any, what: str = "a collective operation",
                      peer: int | None = None, keep: Any = None) -> None:
        """Complete `req`, watching the error channel; with a timeout, raise
        TimeoutError naming `what`, the communicator rank `peer` waited for and the
        caller's context when it takes longer.  A posted failure is raised where `req`
        has not finished `SETTLE` seconds after it was read (one the others had
        finished returns).  When the wait is given up, `req` and `keep` (its buffers)
        are kept alive: the operation may still complete."""
        try:
            if self._state.broken is None and self._errors.broken is None:
                reqs = [req, self._errors.req]
                limit = self._state.timeout
                if limit is None and not self._state.patient:
                    idx = self._MPI.Request.Waitany(reqs, self._errors.status)
                else:
                    idx = self._poll(reqs, math.inf if limit is None else limit, what,
                                     peer, 0.0 if self._state.patient else 0.02)
                if idx == 0:
                    return
                self._errors.remote()  # (read: the receive is done)
            if self._state.broken is not None or not _settles(req):
                self._raise_remote()
        except BaseException:
            _UNFINISHED.append((req, keep))
            raise

    def _poll(self, reqs: list, limit: float, what: str, peer: int | None,
              spin: float = 0.02) -> int:
        """Testany until one completes: spinning for the first `spin` seconds (20 ms:
        messages of a cycle arrive within microseconds to milliseconds; 0 for a
        patient wait, `Transport.patiently`), then sleeping 0.1-1 ms between tests, up
        to `limit` seconds."""
        test = self._MPI.Request.Testany
        start = time.monotonic()
        pause = 0.0
        while True:
            idx, done = test(reqs, self._errors.status)
            if done:
                return idx
            waited = time.monotonic() - start
            if waited > limit:
                raise self._timeout_error(what, peer, limit)
            if waited >= spin:
                pause = min(0.001, pause + 0.0001)
                time.sleep(pause)

    def check_errors(self) -> None:
        if self._state.broken is not None or self._errors.poll() is not None:
            self._raise_remote()

    def _post_error(self, text: str) -> None:
        self._errors.post(text)

    # -- point to point -------------------------------------------------------------------------
    def post_send(self, t: torch.Tensor, dest: int, tag: int) -> Any:
        buf = pack(t)
        req = self.comm.Isend([buf, self._MPI.BYTE], dest=dest, tag=tag)
        return (req, (buf, t), None)  # keep the bytes alive until complete

    def post_recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  src: int, tag: int) -> Any:
        raw = torch.empty(nbytes(shape, dtype), dtype=torch.uint8)
        req = self.comm.Irecv([raw.numpy(), self._MPI.BYTE], source=src, tag=tag)
        return (req, raw, (tuple(shape), dtype, device))

    def complete(self, handle: Any, what: str = "a message",
                 peer: Optional[int] = None) -> Optional[torch.Tensor]:
        req, payload, meta = handle
        self._wait_request(req, what, peer, keep=payload)
        if meta is None:
            return None
        if meta == "reduce":  # an allreduce of a staged tensor: copy back
            return None
        return unpack(payload, *meta)

    def cancel_all(self) -> None:
        """Cancel outstanding requests after a failure.  MPI may write into a cancelled
        receive's buffer until the request completes, so a request that has not
        completed keeps its buffers alive (in `_UNFINISHED`) instead of freeing them."""
        for (req, payload, _), *_ in self._reqs.values():
            try:
                req.Cancel()
                if not req.Test():
                    _UNFINISHED.append((req, payload))
            except Exception:  # noqa: BLE001 - best effort; keep the buffers regardless
                _UNFINISHED.append((req, payload))
        self._reqs.clear()

    # -- collectives ------------------------------------------------------------------------------
    def allreduce_sum(self, values: list[float]) -> list[float]:
        send = np.asarray(values, dtype=np.float64)
        recv = np.empty_like(send)
        self._wait_request(self.comm.Iallreduce(send, recv, op=self._MPI.SUM),
                           "the residual norm's reduction", keep=(send, recv))
        return recv.tolist()

    def allreduce_start(self, t: torch.Tensor, what: str = "a gradient reduction") -> Pending:
        """Sum `t` in place over the communicator (a CUDA tensor is staged through the
        host and copied back when waited for)."""
        staged = t.device.type != "cpu" or not t.is_contiguous()
        host = t.detach().to("cpu", copy=True).contiguous() if staged else t.detach()
        buf = host.reshape(-1).numpy()
        req = self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)
        done = (lambda: t.copy_(host)) if staged else None
        return Pending(self, (req, (buf, host, t), "reduce"), what, done)

    def allgather_start(self, t: torch.Tensor, out: torch.Tensor,
                        what: str = "an all-gather") -> Pending:
        send = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        recv = out.reshape(-1).view(torch.uint8).numpy()
        req = self.comm.Iallgather([send, self._MPI.BYTE], [recv, self._MPI.BYTE])
        return Pending(self, (req, (send, recv, t, out), "reduce"), what)

    def bcast_tensor(self, t: Optional[torch.Tensor], root: int, shape: Sequence[int],
                     dtype: torch.dtype, device: torch.device,
                     what: str = "a broadcast tensor") -> torch.Tensor:
        mine = need_tensor(t, what) if self.group_rank == root else None
        # received into a tensor of its own (not a view of a byte buffer: the output
        # of a pass, which autograd would refuse to modify in place on this rank only)
        got = mine if mine is not None else torch.empty(tuple(shape), dtype=dtype)
        buf = pack(got)
        self._wait_request(self.comm.Ibcast([buf, self._MPI.BYTE], root=root), what, root,
                           keep=buf)
        return got if mine is not None or torch.device(device).type == "cpu" else \
            got.to(device)

    def _bcast_bytes(self, data: Optional[bytes], root: int, what: str) -> bytes:
        n = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self._wait_request(self.comm.Ibcast(n, root=root), what, root, keep=n)
        buf = bytearray(data) if data is not None else bytearray(int(n[0]))
        self._wait_request(self.comm.Ibcast([buf, self._MPI.BYTE], root=root), what, root,
                           keep=buf)
        return bytes(buf)

    def _allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([len(data)], np.int64)
        self._wait_request(self.comm.Iallgather(mine, sizes), what, keep=(mine, sizes))
        out = bytearray(int(sizes.sum()))
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        sendbuf = bytearray(data)
        self._wait_request(self.comm.Iallgatherv(
            [sendbuf, self._MPI.BYTE],
            [out, (sizes.tolist(), displs.tolist()), self._MPI.BYTE]), what,
            keep=(sendbuf, out))
        return [bytes(out[d:d + s]) for d, s in zip(displs, sizes)]

    # -- sub-groups ------------------------------------------------------------------------
    def split(self, parts: Sequence[Sequence[int]]) -> Any:
        """``Split`` of the duplicate: colour = the index of this process's part, key =
        its place in it (a part of one process gives a communicator of one)."""
        check_partition(parts, self.size, cover=True)
        color = part_of(parts, self.group_rank)
        if color is None:  # not reached: check_partition saw every rank covered
            raise ValueError(f"`parts` do not hold rank {self.group_rank}")
        made = self.comm.Split(color=color, key=list(parts[color]).index(self.group_rank))
        self._groups.append(made)
        return made

    def subgroup(self, parts: Sequence[Sequence[int]]) -> Any:
        check_partition(parts, self.size, cover=False)
        mine = part_of(parts, self.group_rank, smallest=2)
        made = self.comm.Split(self._MPI.UNDEFINED if mine is None else mine,
                               self.group_rank)
        if made == self._MPI.COMM_NULL:
            return None
        self._groups.append(made)
        return made

    def node_key(self) -> Hashable:
        """The lowest rank of this process's shared-memory group (collective)."""
        shared = self.comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.group_rank)
        key = shared.allreduce(self.group_rank, op=self._MPI.MIN)
        shared.Free()
        return int(key)

    def close(self) -> None:
        """Free the communicators `split`/`subgroup` made, and the duplicated one
        (collective)."""
        if self._state.closed:
            return
        self._state.closed = True
        for made in self._groups:
            made.Free()
        self._groups.clear()
        self.cancel_all()
        if self._own_errors:
            self._errors.close()
        if self._state.broken is None and self._errors.broken is None:
            self.comm.Free()
