"""Moving boundary states between ranks: a serial transport and one over mpi4py.

The engine addresses ranks by their position in the time partition; the MPI
transport maps those to communicator ranks (reversed for the adjoint solve).

Every blocking point (a message wait, a reduction, a broadcast) also watches an
error channel: a rank whose callback raised sends its message to all others,
which then raise `RemoteError` instead of waiting forever.

States are torch tensors.  A CPU tensor is sent from its own memory as bytes and
received straight into a new tensor (no pack/unpack copies); a CUDA tensor is
staged through host memory.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch

from .errors import RankMismatchError, RemoteError

_ERROR_TAG = 32001
_ERROR_BYTES = 4096
DEFAULT_TIMEOUT = 600.0  # seconds any one wait may take (LayerParallel, solve)
# requests given up on (a failure elsewhere, a timeout, a cancel) that may still be
# active, with their buffers: MPI may write into a receive buffer until the request
# completes, so these must never be freed (see _wait_request and cancel_all)
_UNFINISHED: list = []


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


def pack(state: Any) -> np.ndarray:
    """A uint8 view of the state's bytes (a copy only for non-contiguous or CUDA tensors).
    A state is a tensor, or a handle whose ``tensor()`` gives one (a row of a batch)."""
    t = (state if isinstance(state, torch.Tensor) else state.tensor()).detach()
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


def _cancel_request(req: Any) -> None:
    """Cancel and complete a pending receive (no-op if already complete or freed)."""
    try:
        if req and not req.Test():
            req.Cancel()
            req.Wait()
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class SerialTransport:
    """Transport for one rank: nothing to send, reductions are identities."""

    rank = 0
    size = 1

    def isend(self, dest: int, tag: int, state: Any) -> int:  # pragma: no cover
        raise RuntimeError("serial transport cannot send")

    def irecv(self, src: int, tag: int) -> int:  # pragma: no cover
        raise RuntimeError("serial transport cannot receive")

    def wait(self, req: int) -> Any:  # pragma: no cover
        raise RuntimeError("serial transport has no requests")

    def allreduce_sum(self, values: list[float]) -> list[float]:
        return values

    def set_template(self, like: torch.Tensor) -> None:
        pass

    def agree(self, key: Any, error: BaseException | None, what: str) -> None:
        if error is not None:
            raise error

    def bcast_state(self, state: torch.Tensor | None, root: int) -> torch.Tensor:
        assert state is not None
        return state

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def broadcast_error(self, exc: BaseException) -> None:
        pass

    timeout: float | None = None  # nothing to wait for

    def set_context(self, text: str) -> None:
        pass

    def reversed(self) -> SerialTransport:
        return self

    def close(self) -> None:
        pass


class MPITransport:
    """Transport over an mpi4py communicator (duplicated, so tags never clash with the
    user's messages).  Engine rank q is communicator rank q, or size-1-q when
    `reverse` is set (adjoint solves)."""

    def __init__(self, comm: Any, *, _shared: MPITransport | None = None,
                 reverse: bool = False) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        if _shared is None:
            self.comm = comm.Dup()
            self._err_buf = bytearray(_ERROR_BYTES)
            self._err_status = MPI.Status()
            self._err_req = self.comm.Irecv([self._err_buf, MPI.BYTE], source=MPI.ANY_SOURCE,
                                            tag=_ERROR_TAG)
            # shared with reversed(): failure, ownership, the wait bound and what the
            # model is doing (named in a TimeoutError, e.g. "batch 3, backward pass")
            self._state = {"broken": None, "owner": True, "timeout": DEFAULT_TIMEOUT,
                           "context": ""}
            # cancel the error receive before mpi4py finalizes MPI (atexit is LIFO)
            self._atexit = functools.partial(_cancel_request, self._err_req)
            atexit.register(self._atexit)
        else:
            self.comm = _shared.comm
            self._err_buf = _shared._err_buf
            self._err_status = _shared._err_status
            self._err_req = _shared._err_req
            self._state = _shared._state
        self.size = self.comm.Get_size()
        self._reverse = reverse
        self.rank = self._map(self.comm.Get_rank())
        self._reqs: dict[int, tuple[Any, Any]] = {}
        self._ids = itertools.count()
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float64
        self._device = torch.device("cpu")
        self._nbytes = 0

    def reversed(self) -> MPITransport:
        """The same channel with ranks in reverse order (for the adjoint solve)."""
        return MPITransport(None, _shared=self, reverse=not self._reverse)

    def _map(self, q: int) -> int:
        return self.size - 1 - q if self._reverse else q

    # -- receive template ------------------------------------------------------------
    def set_template(self, like: torch.Tensor) -> None:
        """Shape, dtype and device of the states received from now on."""
        self._shape = tuple(like.shape)
        self._dtype = like.dtype
        self._device = like.device
        self._nbytes = like.numel() * like.element_size()

    # -- error channel ------------------------------------------------------------------
    def _raise_remote(self) -> None:
        broken = self._state["broken"]
        if broken is None:
            src = self._err_status.Get_source()
            n = self._err_status.Get_count(self._MPI.BYTE)
            msg = bytes(self._err_buf[:n]).decode("utf-8", "replace")
            broken = RemoteError(src, msg)
            self._state["broken"] = broken
        raise broken

    @property
    def timeout(self) -> float | None:
        return self._state["timeout"]

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._state["timeout"] = check_timeout(value)

    def set_context(self, text: str) -> None:
        """What the caller is doing now, for the message of a TimeoutError."""
        self._state["context"] = text

    def _wait_request(self, req: Any, what: str = "a collective operation",
                      peer: int | None = None, keep: Any = None) -> None:
        """Complete `req`, watching the error channel; with a timeout, raise
        TimeoutError naming `what`, the communicator rank `peer` waited for and the
        caller's context when it takes longer.  When the wait is given up, `req` and
        `keep` (its buffers) are kept alive: the operation may still complete."""
        try:
            if self._state["broken"] is not None:
                self._raise_remote()
            reqs = [req, self._err_req]
            limit = self._state["timeout"]
            if limit is None:
                idx = self._MPI.Request.Waitany(reqs, self._err_status)
            else:
                idx = self._poll(reqs, limit, what, peer)
            if idx == 1:
                self._raise_remote()
        except BaseException:
            _UNFINISHED.append((req, keep))
            raise

    def _poll(self, reqs: list, limit: float, what: str, peer: int | None) -> int:
        """Testany until one completes: spinning for the first 20 ms (messages of a
        cycle arrive within microseconds to milliseconds), then sleeping 0.1-1 ms
        between tests, up to `limit` seconds."""
        test = self._MPI.Request.Testany
        start = time.monotonic()
        pause = 0.0
        while True:
            idx, done = test(reqs, self._err_status)
            if done:
                return idx
            waited = time.monotonic() - start
            if waited > limit:
                ctx = self._state["context"]
                who = f"rank {peer}" if peer is not None else "the other ranks"
                raise TimeoutError(
                    f"rank {self.comm.Get_rank()} waited {limit:g} s for {what} from {who}"
                    f"{f' ({ctx})' if ctx else ''} and gave up: a rank may have stopped, "
                    "skipped a backward() or be stuck (raise `timeout` if the work is "
                    "just slow)")
            if waited > 0.02:
                pause = min(0.001, pause + 0.0001)
                time.sleep(pause)

    def check_errors(self) -> None:
        """Raise `RemoteError` if another rank has reported a failure (non-blocking)."""
        if self._state["broken"] is not None or self._err_req.Test(self._err_status):
            self._raise_remote()

    def broadcast_error(self, exc: BaseException) -> None:
        """Tell every other rank that this one failed with `exc` (does not raise)."""
        if isinstance(exc, RemoteError) or self._state["broken"] is not None:
            return
        me = self.comm.Get_rank()
        data = _describe(exc).encode("utf-8", "replace")[:_ERROR_BYTES]
        reqs = [self.comm.Isend([data, self._MPI.BYTE], dest=q, tag=_ERROR_TAG)
                for q in range(self.size) if q != me]
        self._MPI.Request.Waitall(reqs)
        self._state["broken"] = RemoteError(me, _describe(exc))

    # -- point to point -------------------------------------------------------------------
    def isend(self, dest: int, tag: int, state: torch.Tensor) -> int:
        buf = pack(state)
        req = self.comm.Isend([buf, self._MPI.BYTE], dest=self._map(dest), tag=tag)
        rid = next(self._ids)
        # keep the bytes alive until complete
        self._reqs[rid] = (req, (buf, state), "a boundary state to be received",
                           self._map(dest))
        return rid

    def irecv(self, src: int, tag: int) -> int:
        raw = torch.empty(self._nbytes, dtype=torch.uint8)
        req = self.comm.Irecv([raw.numpy(), self._MPI.BYTE], source=self._map(src), tag=tag)
        rid = next(self._ids)
        self._reqs[rid] = (req, raw, "a boundary state", self._map(src))
        return rid

    def wait(self, rid: int) -> torch.Tensor | None:
        req, payload, what, peer = self._reqs.pop(rid)
        self._wait_request(req, what, peer, keep=payload)
        if isinstance(payload, tuple):
            return None
        return unpack(payload, self._shape, self._dtype, self._device)

    def cancel_all(self) -> None:
        """Cancel outstanding requests after a failure.  MPI may write into a cancelled
        receive's buffer until the request completes, so a request that has not
        completed keeps its buffers alive (in `_UNFINISHED`) instead of freeing them."""
        for req, payload, *_ in self._reqs.values():
            try:
                req.Cancel()
                if not req.Test():
                    _UNFINISHED.append((req, payload))
            except Exception:  # noqa: BLE001 - best effort; keep the buffers regardless
                _UNFINISHED.append((req, payload))
        self._reqs.clear()

    # -- collectives ------------------------------------------------------------------------
    def allreduce_sum(self, values: list[float]) -> list[float]:
        send = np.asarray(values, dtype=np.float64)
        recv = np.empty_like(send)
        self._wait_request(self.comm.Iallreduce(send, recv, op=self._MPI.SUM),
                           "the residual norm's reduction", keep=(send, recv))
        return recv.tolist()

    def bcast_state(self, state: torch.Tensor | None, root: int) -> torch.Tensor:
        """Broadcast a state of the template's shape from engine rank `root`."""
        if self.rank == root:
            assert state is not None
            buf = pack(state)
        else:
            buf = torch.empty(self._nbytes, dtype=torch.uint8).numpy()
        self._wait_request(self.comm.Ibcast([buf, self._MPI.BYTE], root=self._map(root)),
                           "a broadcast state", self._map(root), keep=buf)
        if self.rank == root:
            return state  # type: ignore[return-value]
        return unpack(buf, self._shape, self._dtype, self._device)

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a small picklable object from communicator rank `root`."""
        import pickle

        data = pickle.dumps(obj) if self.comm.Get_rank() == root else None
        n = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self._wait_request(self.comm.Ibcast(n, root=root), "a broadcast object", root, keep=n)
        buf = bytearray(data) if data is not None else bytearray(int(n[0]))
        self._wait_request(self.comm.Ibcast([buf, self._MPI.BYTE], root=root),
                           "a broadcast object", root, keep=buf)
        return pickle.loads(bytes(buf))

    def allgather_object(self, obj: Any, what: str = "an exchange of small objects") -> list[Any]:
        """Gather a small picklable object from every rank (error-aware).

        Each rank's object travels with a label: `what`, and the caller's context (batch
        and pass).  MPI matches collectives by their order alone, so a rank that skipped
        a step (say a backward()) would otherwise pair this exchange with a different
        one and read the wrong data; differing labels raise `RankMismatchError` on every
        rank, saying where each rank is."""
        import pickle

        label = f"{what}" + (f" ({self._state['context']})" if self._state["context"] else "")
        waiting = f"{what} (all ranks must call it)"
        data = pickle.dumps((label, obj))
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([len(data)], np.int64)
        self._wait_request(self.comm.Iallgather(mine, sizes), waiting, keep=(mine, sizes))
        out = bytearray(int(sizes.sum()))
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        sendbuf = bytearray(data)
        self._wait_request(self.comm.Iallgatherv(
            [sendbuf, self._MPI.BYTE],
            [out, (sizes.tolist(), displs.tolist()), self._MPI.BYTE]), waiting,
            keep=(sendbuf, out))
        got = [pickle.loads(bytes(out[d:d + s])) for d, s in zip(displs, sizes)]
        labels = [g[0] for g in got]
        if any(lb != labels[0] for lb in labels):
            where = "; ".join(f"rank {q} is in {lb}" for q, lb in enumerate(labels))
            raise RankMismatchError(
                f"the ranks are at different steps: {where}. Every rank must make the same "
                "calls in the same order (did a rank skip backward() or a batch?)")
        return [g[1] for g in got]

    def agree(self, key: Any, error: BaseException | None, what: str) -> None:
        """Collective check before any solve message: every rank raises the same way.

        A rank whose local validation failed (`error`) raises it; the others raise
        `RemoteError` naming it.  If all passed but `key` differs between ranks, every
        rank raises `RankMismatchError` saying which ranks disagree about `what`.
        """
        gathered = self.allgather_object((None if error is None else _describe(error), key),
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
                detail = "; ".join(
                    f"`{n}`: " + ", ".join(f"rank {q} has {k.get(n)!r}" for q, k in
                                           enumerate(keys)) for n in names)
                raise RankMismatchError(f"{what} differ between ranks: {detail}")
            raise RankMismatchError(
                f"{what} differ between ranks: rank 0 has {keys[0]!r}, ranks {bad} have "
                f"{[keys[q] for q in bad]!r}")

    def close(self) -> None:
        """Release the duplicated communicator (collective)."""
        if not self._state.get("owner") or self._state.get("closed"):
            return
        self._state["closed"] = True
        atexit.unregister(self._atexit)
        self.cancel_all()
        try:
            if not self._err_req.Test():
                self._err_req.Cancel()
                self._err_req.Wait()
        except Exception:
            pass
        if self._state["broken"] is None:
            self.comm.Free()


def make_transport(comm: Any) -> SerialTransport | MPITransport:
    """`SerialTransport` for comm=None or a one-rank communicator, else `MPITransport`."""
    if comm is None:
        return SerialTransport()
    return MPITransport(comm)


def guarded(transport: SerialTransport | MPITransport, fn: Callable[[], Any]) -> Any:
    """Run `fn`; if it raises here, tell the other ranks before re-raising."""
    try:
        return fn()
    except RemoteError:
        raise
    except BaseException as exc:
        transport.broadcast_error(exc)
        raise
