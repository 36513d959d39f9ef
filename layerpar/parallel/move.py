"""Handing tensors and layers between ranks: `move`, the one way the model does it.

Activations travel between the ranks that hold them (a plain layer's owner, a
segment's first and last rank), and layers travel to the ranks that keep copies of
them (ghost blocks, refinement in depth).  Each is a list of (from rank, to rank,
what) given alike on every rank; `move` posts every send and receive of the list
before it waits for any, so one call may send in both directions without a
deadlock, and counts the bytes it sends (`Transport.count_sent`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor, nn

__all__ = ["Like", "gather_rows", "load_state_vector", "move", "state_vector"]


@dataclass(frozen=True)
class Like:
    """What a receiving rank expects of a tensor it does not hold yet."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def state_vector(module: nn.Module) -> Tensor:
    """A module's state (parameters and buffers, in `state_dict` order) as one float64
    vector: what travels when a layer moves."""
    vals = [t.detach().reshape(-1).to(torch.float64) for t in module.state_dict().values()]
    return torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float64)


def load_state_vector(module: nn.Module, vec: Tensor) -> None:
    """Copy a `state_vector` into a module of the same structure, in place."""
    off = 0
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            n = t.numel()
            t.copy_(vec[off:off + n].view(t.shape).to(t.dtype))
            off += n


Item = Union[Tensor, nn.Module, Like, None]


def gather_rows(transport: Any, mine: Tensor, counts: Sequence[int], what: str) -> Tensor:
    """Every rank's rows, concatenated in rank order, on every rank (collective): rank
    q holds ``counts[q]`` rows, this rank's are `mine` (no graph: detach first).  One
    all-gather; equal counts are gathered straight into the whole, unequal ones padded
    to the largest first."""
    size, width = len(counts), max(counts)
    if all(c == width for c in counts):
        got = mine.new_empty((sum(counts), *mine.shape[1:]))
        transport.allgather_start(mine.contiguous(), got.view(size, width, *mine.shape[1:]),
                                  what).wait()
        return got
    padded = mine.new_zeros((width, *mine.shape[1:]))
    padded[:mine.shape[0]] = mine
    got = padded.new_empty((size, *padded.shape))
    transport.allgather_start(padded, got, what).wait()
    return torch.cat([got[q, :c] for q, c in enumerate(counts)])


def move(transport: Any, moves: Sequence[tuple[int, int, Item]], *, tag: int,
         what: str) -> list[Item]:
    """Hand tensors or layers from rank to rank (group ranks of `transport`).

    Every rank passes the same list of ``(src, dst, item)``; a move with src == dst
    does nothing.  `item` is, on src, the tensor to send or a module whose state is
    sent (`state_vector`); on dst, a `Like` of the tensor expected, or the module to
    load the received state into (in place); elsewhere anything (it is returned
    as given).  Returns per move: on dst the received tensor (the module, loaded, for a
    module), on every other rank `item` itself.  `what` names the payload in a
    `TimeoutError`.
    """
    me = transport.group_rank
    out: list[Item] = [item for _, _, item in moves]
    sends, recvs = [], []
    for k, (src, dst, item) in enumerate(moves):
        if src == dst:
            continue
        if me == src:
            t = state_vector(item) if isinstance(item, nn.Module) else item
            if not isinstance(t, Tensor):
                raise TypeError(f"internal: rank {me} sends {what} but holds "
                                f"{type(item).__name__}")
            transport.count_sent(t.numel() * t.element_size())
            sends.append((transport.post_send(t, dst, tag), dst))
        elif me == dst:
            if isinstance(item, nn.Module):
                like = Like((state_vector(item).numel(),), torch.float64,
                            torch.device("cpu"))
            elif isinstance(item, Like):
                like = item
            else:
                raise TypeError(f"internal: rank {me} receives {what} without a Like or "
                                f"a module, got {type(item).__name__}")
            recvs.append((k, src, transport.post_recv(like.shape, like.dtype, like.device,
                                                      src, tag)))
    for k, src, handle in recvs:
        got = transport.complete(handle, what, src)
        item = out[k]
        if isinstance(item, nn.Module):
            load_state_vector(item, got)
        else:
            out[k] = got
    for handle, dst in sends:
        transport.complete(handle, f"{what} to be received", dst)
    return out
