"""Replicated serial: every rank runs the whole net with plain autograd.

Where no MGRIT setting pays, exact propagation over P > 1 ranks is a pipeline with a
single micro-batch: each rank waits for the others, so it is slower than one rank
running the net alone.  `ReplicatedSerial` steps aside instead: every rank runs the
whole `ODENet` serially, as the serial oracle does, and the result is the serial
net's, on every rank.

- **Parameters.**  A private copy of the net whose layers owned by this rank are
  the model's own modules' tensors (the real `Parameter` objects the user's
  optimizer holds: `copy.deepcopy` with those tensors in its memo), so autograd puts
  their gradients straight into their `.grad` and the optimizer is unchanged.  The
  other ranks' layers are copies with ``requires_grad=False`` (no gradient is
  computed for them: their owners compute their own).
- **Refresh.**  Before each pass every rank checks whether the tensors it owns
  (parameters and buffers) changed since the last pass: their version counters
  first (an optimizer step or `load_state_dict` bumps them), and where those did
  not move, their values against the copy sent last (a fused optimizer, such as
  ``torch.optim.Adam(fused=True)``, writes in place without bumping them).  One
  `allgather_object` carries, from each rank whose tensors changed, one flat buffer
  per dtype, and the copies of the others' layers are overwritten with it.  Nothing
  changed on any rank: the exchange carries only `None`s.
- **Identical on every rank.**  The same input, the same parameter values and the
  same code on every rank give the same output and loss; each rank's gradients are
  those of the serial net for its own layers.

Not offered (`supported`) on one rank (direct mode is plain serial autograd already),
under data parallelism (the gradient averaging belongs to the layer-parallel pass),
and for nets with dropout (each rank would draw its own masks).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..mgrit.options import MGRITOptions

if TYPE_CHECKING:
    from .model import LayerParallel

__all__ = ["ReplicatedSerial", "split_supported", "supported"]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def supported(model: LayerParallel) -> Optional[str]:
    """None if `model` can run replicated, else why not."""
    if model.size == 1:
        return "one rank: direct mode is serial autograd already"
    if model.averages_replicas:
        return "data parallelism averages gradients inside the layer-parallel pass"
    if model.has_dropout:
        return "the net has dropout: each rank would draw its own masks"
    return None


def split_supported(model: LayerParallel) -> Optional[str]:
    """None if `model` can run replicated with the batch split over the ranks, else
    why not (on top of `supported`)."""
    why = supported(model)
    if why is not None:
        return why
    net = model.whole_net
    if any(isinstance(m, _BN) for m in net.modules()):
        return "the net has batch norm: its statistics would be a share of the batch's"
    if len({p.dtype for p in net.parameters() if p.requires_grad}) > 1:
        return "the net's parameters have several dtypes"
    return None


class _SplitBatch(torch.autograd.Function):
    """Every rank runs the whole net on its share of the batch's rows; the outputs are
    gathered, so every rank holds the whole batch's output.  Backward: each rank
    back-propagates its rows through the whole net, one all-reduce sums the parameter
    gradients (and the input's), and each rank keeps its own parameters' sum."""

    @staticmethod
    def forward(ctx: Any, rep: ReplicatedSerial, graph: bool, x: Tensor,
                *own: Tensor) -> Tensor:
        n, size, r = x.shape[0], rep.transport.size, rep.rank
        whole = n < size  # fewer rows than ranks: every rank runs them all, no exchange
        lo, hi = (0, n) if whole else (r * n // size, (r + 1) * n // size)
        with torch.set_grad_enabled(graph):  # (graph: grad mode where the pass was called)
            xl = x[lo:hi].detach().requires_grad_(graph and x.requires_grad)
            out = rep.net(xl)
        ctx.rep, ctx.out, ctx.xl, ctx.rows, ctx.n = rep, out, xl, (lo, hi), n
        ctx.whole = whole
        if whole:
            return out.detach()
        width = -(-n // size)  # rows per rank, padded to the largest share
        mine = out.detach().new_zeros((width, *out.shape[1:]))
        mine[:hi - lo] = out.detach()
        got = mine.new_empty((size, *mine.shape))
        rep.transport.allgather_start(mine, got, "the outputs of the batch's shares").wait()
        return torch.cat([got[q, :(q + 1) * n // size - q * n // size] for q in range(size)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        rep, (lo, hi) = ctx.rep, ctx.rows
        wrt = list(rep._trainable) + ([ctx.xl] if ctx.xl.requires_grad else [])
        with torch.enable_grad():
            got = torch.autograd.grad(ctx.out, wrt, grad[lo:hi], allow_unused=True)
        parts = [torch.zeros_like(t).reshape(-1) if g is None else g.reshape(-1)
                 for t, g in zip(rep._trainable, got)]
        if ctx.xl.requires_grad:
            dx = grad.new_zeros((ctx.n, *ctx.xl.shape[1:]))
            if got[-1] is not None:
                dx[lo:hi] = got[-1]
            parts.append(dx.reshape(-1))
        flat = torch.cat(parts)
        if not ctx.whole:  # (whole: this rank's own gradients are complete already)
            rep.transport.allreduce_start(flat, "the batch's shares' gradients").wait()
        at, sums = 0, []
        for t in rep._trainable:
            sums.append(flat[at:at + t.numel()].view_as(t))
            at += t.numel()
        dx_all = flat[at:].view(ctx.n, *ctx.xl.shape[1:]) if ctx.xl.requires_grad else None
        own = [sums[i] for i in rep._own_at]
        ctx.out = ctx.xl = None
        return (None, None, dx_all, *own)


def _named_tensors(net: nn.Module) -> list[tuple[str, Tensor]]:
    """The net's parameters and buffers, each once, in a fixed order."""
    seen: set[int] = set()
    out = []
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


class ReplicatedSerial:
    """The whole net, run serially on every rank of `model` (collective to build:
    one exchange says who owns what).  See the module docstring."""

    #: what the autotuner and the gradient checks read off a setting
    options = MGRITOptions(max_levels=1)
    backward_options = options
    accuracy = None

    def __init__(self, model: LayerParallel, split: bool = False) -> None:
        why = split_supported(model) if split else supported(model)
        if why is not None:
            raise ValueError(f"replicated serial{' (batch split)' if split else ''} is not "
                             f"available here: {why}")
        self.split = split
        self.model = model
        self.transport = model.transport
        self.rank = model.rank
        net: nn.Module = model.whole_net
        named = _named_tensors(net)
        mine = {id(t) for t in model.parameters()} | {id(b) for b in model.buffers()}
        local = [i for i, (_, t) in enumerate(named) if id(t) in mine]
        owners: list[Optional[int]] = [None] * len(named)
        for r, got in enumerate(self.transport.allgather_object(
                local, "the replicated net's owners")):
            for i in got:
                if owners[i] is None:
                    owners[i] = r
        # a private net: this rank's tensors are the real ones, the others' copies
        memo: dict[int, Any] = {id(named[i][1]): named[i][1] for i in local}
        self.net: nn.Module = copy.deepcopy(net, memo)
        rep = _named_tensors(self.net)
        assert [n for n, _ in rep] == [n for n, _ in named]
        self._owners = owners
        self._sources = [rep[i][1] for i in range(len(rep)) if owners[i] == self.rank]
        for i, (_, t) in enumerate(rep):
            if owners[i] != self.rank and isinstance(t, nn.Parameter):
                # its owner computes its gradient; split, every rank adds its rows' share
                t.requires_grad_(split and named[i][1].requires_grad)
        # split: every trainable tensor (the same list on every rank) and, in the order
        # of this rank's `parameters()`, where its own ones sit in it
        self._trainable = [t for i, (_, t) in enumerate(rep)
                           if isinstance(t, nn.Parameter) and named[i][1].requires_grad]
        where = {id(t): k for k, t in enumerate(self._trainable)}
        self._own = [p for p in model.parameters() if id(p) in where]
        self._own_at = [where[id(p)] for p in self._own]
        # per rank: the copies it refreshes, in that rank's order
        self._copies: dict[int, list[Tensor]] = {
            r: [rep[i][1] for i in range(len(rep)) if owners[i] == r]
            for r in range(model.size) if r != self.rank}
        self._seen: Optional[tuple[int, ...]] = None
        self._sent: Optional[dict[str, Tensor]] = None  # the values sent last
        self.force_sync = False  # the autotuner's timing: exchange on every pass
        self.training = model.training
        self._mode: Optional[bool] = None
        self.last_forward: list[Any] = []
        self.last_backward: list[Any] = []

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable tensors (those the user's optimizer holds)."""
        return list(self.model.parameters())

    @staticmethod
    def _flat(tensors: list[Tensor]) -> dict[str, Tensor]:
        groups: dict[str, list[Tensor]] = {}
        for t in tensors:
            groups.setdefault(str(t.dtype), []).append(t.detach().reshape(-1))
        return {k: torch.cat(v).cpu() for k, v in groups.items()}

    def refresh(self) -> bool:
        """Bring the copies of the other ranks' layers up to date (collective).
        Returns whether any rank sent new values."""
        seen = tuple(t._version for t in self._sources)
        changed = self.force_sync or seen != self._seen
        payload = self._flat(self._sources) if changed or self._sent is None else None
        if not changed:  # in-place writes that bump no version (fused optimizers)
            now = payload if payload is not None else self._flat(self._sources)
            changed = self._sent is None or any(
                not torch.equal(now[k], self._sent[k]) for k in now)
            payload = now if changed else None
        if payload is not None:
            self._sent = payload
        got = self.transport.allgather_object(payload, "the replicated net's refresh")
        self._seen = seen
        any_new = False
        with torch.no_grad():
            for r, flat in enumerate(got):
                if r == self.rank or flat is None:
                    continue
                any_new = True
                at: dict[str, int] = {}
                for t in self._copies[r]:
                    k = str(t.dtype)
                    n = t.numel()
                    start = at.get(k, 0)
                    t.copy_(flat[k][start:start + n].view_as(t))
                    at[k] = start + n
        return any_new

    def __call__(self, x: Tensor) -> Tensor:
        self.refresh()
        if self._mode is not self.training:
            self.net.train(self.training)
            self._mode = self.training
        if self.split:
            return _SplitBatch.apply(self, torch.is_grad_enabled(), x, *self._own)
        return self.net(x)

    def check_gradients(self, x: Tensor, y: Any,
                        loss_fn: Callable[[Tensor, Any], Tensor]) -> Any:
        """The gradient check of exact propagation (this setting is exact: errors 0)."""
        from .accuracy import check_gradients

        with self.model.checking():
            return check_gradients(self.model, x, y, loss_fn)

    def close(self) -> None:
        """Drop the private copy (nothing to release: no communicator of its own)."""
        self._copies.clear()
        self._sources = []
