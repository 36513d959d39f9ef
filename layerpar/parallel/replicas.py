"""Averaging parameter gradients over the replicas of a process grid (data parallelism).

The adjoint solve hands over gradients as they become final (a record of the final
sweep, a layer, a group of plain layers); each is added to a bucket, and a full
bucket's sum over the data group starts at once (asynchronously), so the reductions
overlap with the rest of the backward pass.  `finish` waits for them all and scales
by 1/R: every replica then holds the gradient of the mean loss over the global batch
(each replica's loss being the mean over its equal share of it).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Optional, Protocol

import torch
from torch import Tensor

from ..mgrit.transport import Pending

__all__ = ["GradAverager"]

BUCKET_BYTES = 4 << 20  # tensors are reduced in buckets of about this size


class Reducer(Protocol):
    """What `GradAverager` sums over: a data group's `Transport`, or a wrapper of one
    that meters it (`layerpar.parallel.sync.Metered`)."""

    @property
    def size(self) -> int: ...

    def allreduce_start(self, t: Tensor, what: str = ...) -> Pending: ...


class GradAverager:
    """Sums gradient tensors in place over `transport` (the data group), in buckets.

    `add` each tensor once per backward pass; `finish` completes the pass.  The
    tensors themselves end up holding the average (a bucket of several tensors is
    reduced as one flat copy, then copied back), so views of them (rows of a stacked
    gradient) see it too.  `last_seconds` and `bytes` say what the last pass's
    reductions cost (time spent starting and waiting for them, and the data reduced),
    `total_seconds` what all passes' did.
    """

    def __init__(self, transport: Reducer, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.transport = transport
        self.replicas = transport.size
        self.bucket_bytes = bucket_bytes
        self._bucket: list[Tensor] = []
        self._size = 0
        self._pending: list[tuple[Pending, Optional[Tensor], list[Tensor]]] = []
        self._seen: set[int] = set()
        self.seconds = 0.0  # of the pass in progress
        self.last_seconds = 0.0
        self.bytes = 0
        self.total_seconds = 0.0

    def add(self, tensors: Iterable[Optional[Tensor]]) -> None:
        """Queue gradients for averaging (None entries and repeats are skipped)."""
        for t in tensors:
            if t is None or id(t) in self._seen:
                continue
            self._seen.add(id(t))
            self._bucket.append(t)
            self._size += t.numel() * t.element_size()
            if self._size >= self.bucket_bytes:
                self._flush()

    def _flush(self) -> None:
        if not self._bucket:
            return
        t0 = time.perf_counter()
        bucket, self._bucket, self._size = self._bucket, [], 0
        same = all(t.dtype == bucket[0].dtype and t.device == bucket[0].device
                   for t in bucket)
        if len(bucket) == 1 or not same:
            for t in bucket:
                self._pending.append((self.transport.allreduce_start(t), None, [t]))
        else:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._pending.append((self.transport.allreduce_start(flat), flat, bucket))
        self.seconds += time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for every reduction of this pass and leave the averages in place."""
        self._flush()
        t0 = time.perf_counter()
        scale = 1.0 / self.replicas
        total = 0
        for pending, flat, tensors in self._pending:
            pending.wait()
            if flat is None:
                tensors[0].mul_(scale)
                total += tensors[0].numel() * tensors[0].element_size()
                continue
            flat.mul_(scale)
            total += flat.numel() * flat.element_size()
            off = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n
        self.seconds += time.perf_counter() - t0
        self.last_seconds, self.seconds = self.seconds, 0.0
        self.total_seconds += self.last_seconds
        self.bytes = total
        self._pending = []
        self._seen = set()
