"""The transport of a single rank: nothing to send, reductions are identities."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .base import Pending, Transport


class SerialTransport(Transport):
    """One rank: collectives return their input; there is no one to send to."""

    backend = "serial"
    comm = None
    timeout: float | None = None  # type: ignore[assignment]  # nothing to wait for

    def __init__(self) -> None:
        super().__init__(1, 0)

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
        assert t is not None
        return t

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
        assert data is not None
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
