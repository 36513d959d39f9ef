"""The transport of a single rank: nothing to send, reductions are identities."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional

import torch

from .base import ChannelState, Pending, Transport, check_partition, need_tensor


class SerialTransport(Transport):
    """One rank: collectives return their input; there is no one to send to; its
    sub-groups are None (a group of one process is served by a serial transport)."""

    backend = "serial"
    comm = None

    def __init__(self) -> None:
        super().__init__(1, 0, ChannelState(timeout=None))  # nothing to wait for

    def post_send(self, t: torch.Tensor, dest: int, tag: int) -> Any:  # pragma: no cover
        raise RuntimeError("a serial transport cannot send")

    def post_recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  src: int, tag: int) -> Any:  # pragma: no cover
        raise RuntimeError("a serial transport cannot receive")

    def complete(self, handle: Any, what: str = "a message",
                 peer: Optional[int] = None) -> Optional[torch.Tensor]:  # pragma: no cover
        raise RuntimeError("a serial transport has no requests")

    def bcast_tensor(self, t: Optional[torch.Tensor], root: int, shape: Sequence[int],
                     dtype: torch.dtype, device: torch.device,
                     what: str = "a broadcast tensor") -> torch.Tensor:
        return need_tensor(t, what)

    def allreduce_start(self, t: torch.Tensor, what: str = "") -> Pending:
        return Pending(self, None, what)

    def allgather_start(self, t: torch.Tensor, out: torch.Tensor,
                        what: str = "") -> Pending:
        out[0].copy_(t)
        return Pending(self, None, what)

    def allreduce_sum(self, values: list[float]) -> list[float]:
        return values

    def _allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        return [data]

    def _bcast_bytes(self, data: Optional[bytes], root: int, what: str) -> bytes:
        if data is None:
            raise ValueError(f"the root of {what} must pass its bytes, got None")
        return data

    def agree(self, key: Any, error: BaseException | None, what: str) -> None:
        if error is not None:
            raise error

    def allgather_object(self, obj: Any, what: str = "") -> list[Any]:
        return [obj]

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def broadcast_error(self, exc: BaseException) -> None:
        pass

    def _post_error(self, text: str) -> None:
        pass

    def reversed(self) -> SerialTransport:
        return self

    def split(self, parts: Sequence[Sequence[int]]) -> Any:
        check_partition(parts, 1, cover=True)
        return None

    def subgroup(self, parts: Sequence[Sequence[int]]) -> Any:
        check_partition(parts, 1, cover=False)
        return None

    def node_key(self) -> Hashable:
        return 0
