"""Parameters that several layers use: one block module for every step (a
time-invariant ODE), or weights tied between layers (the opening and closing layers').

Serial autograd gives such a parameter the sum of its uses' gradients.  Layer-parallel
passes compute gradients layer by layer, and a rank holds only its own layers, so:

- on each rank, every use's gradient is summed (`add`, then `finish` once the data
  replicas' averaging, which runs in place on the pieces, is done);
- where the layers using a parameter lie on several ranks, each of those ranks holds
  its own copy; one all-reduce per backward pass (all such parameters together, laid
  out alike on every rank from the whole net, which every rank holds) sums the ranks'
  parts (`reduce`), so every copy gets serial's gradient and, stepped by identical
  optimizers, stays equal to the others.  Nets without such parameters send nothing.

Which layers use which parameter, and on which ranks, is found once from the whole
net (`SharedParams.build`), identically on every rank.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..mgrit.errors import RankMismatchError

__all__ = ["SharedParams", "shared_key", "shares_parameters"]


def shared_key(layers: Sequence[tuple[str, nn.Module, int]]) -> list[tuple[str, ...]]:
    """Which layers share a parameter or a module with running statistics: the names of
    each group of layers using one (agreed between ranks at construction: a net tied
    on one rank only is refused there).  Raises `ValueError` for a batch norm with
    running statistics that several layers use: the passes evaluate a layer more than
    once per batch (relaxation, coarse levels, the adjoint), so its statistics would
    count other updates than serial's."""
    users: dict[int, list[str]] = {}
    for name, module, _ in layers:
        for p in module.parameters():
            users.setdefault(id(p), []).append(name)
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
                users.setdefault(id(m), []).append(name)
                seen = users[id(m)]
                if len(seen) > 1:
                    raise ValueError(
                        f"{type(m).__name__} with running statistics is used by several "
                        f"layers ({seen[0]}, {seen[1]}, ...): layer-parallel passes "
                        "evaluate a layer more than once per batch, so its running "
                        "statistics would not be serial's. Give each layer its own "
                        "batch norm, or track_running_stats=False")
    return sorted(tuple(v) for v in users.values() if len(v) > 1)


def shares_parameters(blocks: Iterable[nn.Module]) -> bool:
    """Whether one parameter tensor serves two of `blocks`."""
    seen: set[int] = set()
    for blk in blocks:
        mine = {id(p) for p in blk.parameters()}
        if mine & seen:
            return True
        seen |= mine
    return False


class SharedParams:
    """The whole net's parameters used by more than one layer (by identity), and the
    ranks whose layers use them (the same on every rank).

    uses: id -> (parameter, the names of the layers using it, their owner ranks).
    cross: the shared parameters used on more than one rank, with those ranks, in the
        whole net's order.
    """

    def __init__(self, uses: dict[int, tuple[nn.Parameter, list[str], list[int]]]) -> None:
        self.uses = uses
        self.cross: list[tuple[nn.Parameter, frozenset[int]]] = [
            (p, frozenset(ranks)) for p, _, ranks in uses.values() if len(set(ranks)) > 1]
        self._first = {id(p): min(ranks) for p, ranks in self.cross}

    @classmethod
    def build(cls, layers: Sequence[tuple[str, nn.Module, int]]) -> Optional[SharedParams]:
        """From (layer name, module, owner rank) of every layer of the whole net (a
        segment's blocks one by one); None where no parameter serves two layers."""
        found: dict[int, tuple[nn.Parameter, list[str], list[int]]] = {}
        for name, module, owner in layers:
            for p in module.parameters():
                got = found.get(id(p))
                if got is None:
                    found[id(p)] = (p, [name], [owner])
                else:
                    got[1].append(name)
                    got[2].append(owner)
        shared = {i: v for i, v in found.items() if len(v[1]) > 1}
        return cls(shared) if shared else None

    def flags(self, rank: int) -> Optional[tuple[Optional[bool], ...]]:
        """Per cross-rank shared parameter, whether `rank`'s copy requires grad (None
        where `rank` holds none); None without such parameters."""
        if not self.cross:
            return None
        return tuple(p.requires_grad if rank in ranks else None for p, ranks in self.cross)

    def check_flags(self, per_rank: Sequence[Any]) -> None:
        """Refuse a pass in which the ranks holding a shared parameter disagree on
        whether it trains (`flags` of every rank, in rank order): one rank froze its
        copy, the others would go on stepping theirs, and the copies would part."""
        if not self.cross:
            return
        for i, (p, ranks) in enumerate(self.cross):
            got = {q: per_rank[q][i] for q in sorted(ranks)}
            if len(set(got.values())) > 1:
                names = ", ".join(sorted(set(self.uses[id(p)][1])))
                raise RankMismatchError(
                    f"a parameter that layers on several ranks use ({names}) requires "
                    f"grad on some of them and not on others ({got}): freeze or unfreeze "
                    "it on every rank that holds it (each lists it under its own layers' "
                    "names in named_parameters())")

    def counts_here(self, p: Tensor, rank: int) -> bool:
        """Whether `rank` counts `p` in a whole-net sum over the ranks' parameters (a
        norm): every rank its own, a cross-rank shared one only its first rank."""
        first = self._first.get(id(p))
        return first is None or first == rank

    def reduce(self, grads: dict[int, Tensor], transport: Any, rank: int) -> None:
        """Sum, over the ranks that use it, each cross-rank shared parameter's gradient
        in `grads` (id(parameter) -> this rank's sum of its uses; collective over
        `transport`, one all-reduce per dtype).  A rank without a gradient for one
        (frozen, or not its layers) adds zeros."""
        if not self.cross or transport.size == 1:
            return
        by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, frozenset[int]]]] = {}
        for p, ranks in self.cross:
            by_dtype.setdefault(p.dtype, []).append((p, ranks))
        for dtype, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            parts = []
            for p, ranks in group:
                g = grads.get(id(p)) if rank in ranks else None
                parts.append(torch.zeros(p.shape, dtype=dtype, device=p.device) if g is None
                             else g.to(dtype).reshape(p.shape))
            flat = torch.cat([t.reshape(-1) for t in parts])
            transport.allreduce_start(flat, "the shared parameters' gradients").wait()
            at = 0
            for p, ranks in group:
                n = p.numel()
                if rank in ranks and p.requires_grad:
                    grads[id(p)] = flat[at:at + n].view(p.shape)
                at += n


def add(grads: dict[int, Tensor], extra: list[tuple[int, Tensor]],
        pairs: Iterable[tuple[int, Tensor]]) -> None:
    """Put (id(parameter), gradient) `pairs` into `grads`; a parameter already there
    (another layer's use of it) goes to `extra`, summed in by `finish`."""
    for i, g in pairs:
        if i in grads:
            extra.append((i, g))
        else:
            grads[i] = g


def finish(grads: dict[int, Tensor], extra: list[tuple[int, Tensor]]) -> None:
    """Sum the further uses' gradients (`add`) into `grads` (new tensors: the pieces
    may be views of a pass's records)."""
    for i, g in extra:
        grads[i] = grads[i] + g
