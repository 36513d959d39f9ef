"""`LayerParallel`: an `ODENet` distributed over the ranks of a communicator.

Each Segment's N steps are split into contiguous blocks of layers, one block per
rank (`block_bounds`).  Forward propagation through a segment is an MGRIT solve;
backpropagation is the adjoint equation solved by MGRIT in reverse time, and
each rank computes the parameter gradients of its own layers only.  Plain layers
(anything that is not a residual step) run once per batch on one rank: those
before the first segment on rank 0, all others on the last rank, which holds the
segment outputs.  The output is broadcast, so the loss is available on every rank.

Coarse steps use the block at the start of their interval (injection) or the
parameter average over the interval.  The first coarse interval of a rank may
start at a layer its left neighbour owns: such blocks are kept as read-only
"ghost" copies and refreshed from their owners at every forward pass.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from .._native._core import NAN_ERROR, Core
from ..mgrit.errors import DivergenceError, RankMismatchError, RemoteError
from ..mgrit.grid import block_bounds, build_levels, reversed_bounds
from ..mgrit.options import MGRITOptions
from ..mgrit.solve import vec_norm_sq, vec_sum
from ..mgrit.transport import MPITransport, SerialTransport, pack, unpack
from ..ode.coarsening import COARSENINGS, coarse_block
from ..ode.net import ODENet, Segment
from ..ode.rng import DROPOUT_TYPES as _DROPOUT
from ..ode.rng import draw_seed, layer_rng, needs_rng
from .batched import (
    BatchedBlocks,
    Row,
    as_tensor,
    batched_norm_sq,
    batched_sum,
    stack_rows,
    unbatchable_reason,
    unstack_rows,
    warn_once,
)
from .grads import GradDelivery

_GHOST_TAG = 31001
_LINK_TAG = 31002

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@contextlib.contextmanager
def _frozen_running_stats(modules: list[nn.Module]) -> Iterator[None]:
    """Batch norm in training mode without updating running statistics (MGRIT
    evaluates a layer several times per batch; the statistics move once, in the
    final sweep)."""
    saved = []
    for m in modules:
        if not m.training:  # eval mode uses running statistics and never updates them
            continue
        saved.append((m, m.momentum, None if m.num_batches_tracked is None
                      else m.num_batches_tracked.clone()))
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, mom, nbt in saved:
            m.momentum = mom
            if nbt is not None:
                m.num_batches_tracked.copy_(nbt)


class _Remote(nn.Module):
    """Placeholder for a layer that lives on another rank (holds no parameters)."""

    def __init__(self, owner: int) -> None:
        super().__init__()
        self.owner = owner

    def extra_repr(self) -> str:
        return f"on rank {self.owner}"


class _SegmentShard(nn.Module):
    """This rank's blocks of a Segment, registered under their global indices so that
    parameter names match the serial net (``layers.<k>.blocks.<n>.…``)."""

    def __init__(self, seg: Segment, owned: range) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(n): seg.blocks[n] for n in owned})

    def extra_repr(self) -> str:
        keys = list(self.blocks.keys())
        return f"layers {keys[0]}..{keys[-1]}" if keys else "no layers"


def _state_vector(module: nn.Module) -> Tensor:
    vals = [t.detach().reshape(-1).to(torch.float64) for t in module.state_dict().values()]
    return torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float64)


def _load_state_vector(module: nn.Module, vec: Tensor) -> None:
    off = 0
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            n = t.numel()
            t.copy_(vec[off:off + n].view(t.shape).to(t.dtype))
            off += n


def _needed_layers(n: int, size: int, rank: int, fwd: MGRITOptions, bwd: MGRITOptions,
                   coarsening: str) -> set[int]:
    """Layers whose blocks this rank's coarse steps use (owned or not)."""
    bounds = block_bounds(n, size)
    need: set[int] = set()
    for lv in build_levels(n, fwd)[1:]:
        lo = -(-bounds[rank] // lv.stride)
        hi = min((bounds[rank + 1] - 1) // lv.stride, lv.n_intervals)
        for j in range(max(lo, 1), hi + 1):
            a, b = (j - 1) * lv.stride, j * lv.stride
            need.update([a] if coarsening == "injection" else range(a, b))
    rb = reversed_bounds(bounds)
    rrank = size - 1 - rank
    for lv in build_levels(n, bwd)[1:]:
        lo = -(-rb[rrank] // lv.stride)
        hi = min((rb[rrank + 1] - 1) // lv.stride, lv.n_intervals)
        for m in range(max(lo, 1), hi + 1):
            a, b = n - m * lv.stride, n - (m - 1) * lv.stride
            need.update([a] if coarsening == "injection" else range(a, b))
    return need


class _ForwardApp:
    """Engine callbacks of a segment's forward solve on this rank."""

    def __init__(self, runner: _SegmentRunner, defer: bool) -> None:
        self.r = runner
        # local residual norms of this solve (device scalars) when norms are deferred
        self.deferred: Optional[list[Tensor]] = [] if defer else None

    def step_batch(self, us: list, fs: Optional[list], ts: list, te: list, as_: list,
                   bs: list, level: int, final: int) -> list:
        """Independent steps at once: one vectorised step over the stacked states when
        the segment is batched (see batched.py), else one by one."""
        r = self.r
        if r.bb is None:
            return [self.step(u, None if fs is None else fs[k], ts[k], te[k], as_[k], bs[k],
                              level, final) for k, u in enumerate(us)]
        pairs = tuple(zip(as_, bs))
        x = stack_rows(us)
        if final and r.recording:
            y = r.record_batch(x, pairs)
        else:
            y = r.bb.step(x, pairs)
        if fs is not None:
            y = y + stack_rows([r.zero if g is None else g for g in fs])
        return unstack_rows(y)

    def step(self, u: Tensor, f: Optional[Tensor], ts: float, te: float, a: int, b: int,
             level: int, final: int) -> Tensor:
        r = self.r
        if r.u0_graph is not None and final and f is None and level == 0:
            return r.direct_sweep([a], [b])[0]
        if r.bb is not None:
            if final and r.recording:  # recorded as a batch of one
                return self.step_batch([u], None if f is None else [f], [ts], [te], [a], [b],
                                       level, final)[0]
            u, f = as_tensor(u), None if f is None else as_tensor(f)
        if final and r.recording:
            prev = r.records.get(a - 1)
            with torch.enable_grad():
                if prev is not None and u is prev[2]:
                    u_in = prev[1]  # continue the previous step's graph (a chain)
                    r.chain_head[a] = r.chain_head[a - 1]
                else:
                    u_in = u.detach().requires_grad_()
                    r.chain_head[a] = a
                out = r.phi(u_in, a, b, update_stats=True)
            det = out.detach()
            r.records[a] = (u_in, out, det)
            return det if f is None else torch.add(det, f)
        elif final:
            out = r.phi(u, a, b, update_stats=True)
        else:
            out = r.phi(u, a, b, update_stats=False)
        return out if f is None else torch.add(out, f)

    def step_seq(self, u: Tensor, fs: Optional[list], ts: list, te: list, as_: list,
                 bs: list, level: int, final: int) -> list:
        """A rank's stretch of a sequential solve in one call; when it is the final
        (recorded) sweep, the stretch is recorded as one graph, like plain PyTorch."""
        r = self.r
        if r.u0_graph is not None and final and fs is None and level == 0:
            return r.direct_sweep(as_, bs)
        outs = []
        if not (final and r.recording and fs is None and level == 0):
            for k in range(len(ts)):
                u = self.step(u, None if fs is None else fs[k], ts[k], te[k], as_[k], bs[k],
                              level, final)
                outs.append(u)
            return outs
        prev = r.records.get(as_[0] - 1)
        with torch.enable_grad():
            if prev is not None and u is prev[2]:
                x, head = prev[1], r.chain_head[as_[0] - 1]
            else:
                x, head = u.detach().requires_grad_(), as_[0]
            for a, b in zip(as_, bs):
                x_in = x
                x = r.phi(x_in, a, b, update_stats=True)
                det = x.detach()
                r.records[a] = (x_in, x, det)
                r.chain_head[a] = head
                outs.append(det)
        return outs

    def init(self, t: float, i: int) -> Tensor:
        return self.r.u0 if i == 0 else self.r.zero

    @staticmethod
    def sum(alpha: float, x: Any, beta: float, y: Any) -> Tensor:
        return vec_sum(alpha, as_tensor(x), beta, as_tensor(y))

    def sum_batch(self, alpha: float, xs: list, beta: float, ys: list) -> list:
        if self.r.bb is None:  # the per-step reference path: point by point, as before
            return [vec_sum(alpha, x, beta, y) for x, y in zip(xs, ys)]
        return batched_sum(alpha, xs, beta, ys)  # elementwise: bit-identical to vec_sum

    def norm_sq(self, states: list) -> float:
        if self.deferred is not None:  # fixed iterations: keep it on the device
            self.deferred.append(torch.linalg.vector_norm(stack_rows(states),
                                                          dtype=torch.float64))
            return 0.0
        return batched_norm_sq(states) if self.r.bb is not None else vec_norm_sq(states)


class _AdjointApp:
    """Engine callbacks of a segment's adjoint solve (reverse time).

    Reverse point m holds lambda_{N-m}.  The reverse step from m_a to m_b applies the
    transposed Jacobian of the forward step from N-m_b to N-m_a (one layer on the fine
    grid, a coarse step on coarse levels), linearised at the forward state u_{N-m_b}.
    """

    def __init__(self, runner: _SegmentRunner, defer: bool) -> None:
        self.r = runner
        self.deferred: Optional[list[Tensor]] = [] if defer else None

    def step(self, lam: Tensor, f: Optional[Tensor], ts: float, te: float, ma: int, mb: int,
             level: int, final: int) -> Tensor:
        r = self.r
        n = r.n
        a, b = n - mb, n - ma
        if r.bb is not None:
            return self.step_batch([lam], None if f is None else [f], [ts], [te], [ma], [mb],
                                   level, final)[0]
        if level == 0:
            u_in, out, _ = r.records[a]
            if final and r.sequential_adjoint:
                res = r.chain_vjp(a, lam)
            elif final:
                params = r.layer_params[a]
                grads = torch.autograd.grad(out, [u_in, *params], lam, allow_unused=True)
                r.param_grads[a] = grads[1:]
                res = grads[0]
            else:
                (res,) = torch.autograd.grad(out, u_in, lam, retain_graph=True)
        else:
            rec = r.coarse_graph(a, b)
            (res,) = torch.autograd.grad(rec[1], rec[0], lam, retain_graph=True)
        return res if f is None else torch.add(res, f)

    def step_batch(self, lams: list, fs: Optional[list], ts: list, te: list, mas: list,
                   mbs: list, level: int, final: int) -> list:
        """Independent adjoint steps in one autograd call (many outputs, many inputs).

        Layers of one forward chain are not independent in the recorded graph (a
        gradient requested at an earlier layer's input would also collect the later
        layer's contribution), so such batches, and the sequential final sweep, go
        one by one."""
        r = self.r
        n = r.n
        pairs = [(n - mb, n - ma) for ma, mb in zip(mas, mbs)]
        if r.bb is not None:
            lam = stack_rows(lams)
            res = r.adjoint_fine(lam, pairs, final) if level == 0 else \
                r.adjoint_coarse(lam, tuple(pairs))
            if fs is not None:
                res = res + stack_rows([r.lam_zero if g is None else g for g in fs])
            return unstack_rows(res)
        one_by_one = final and r.sequential_adjoint
        if level == 0 and not one_by_one:
            heads = {r.chain_head[a] for a, _ in pairs}
            one_by_one = len(heads) < len(pairs)
        if one_by_one:
            return [self.step(lam, None if fs is None else fs[k], ts[k], te[k], mas[k], mbs[k],
                              level, final) for k, lam in enumerate(lams)]
        recs = [r.records[a][:2] if level == 0 else r.coarse_graph(a, b) for a, b in pairs]
        with_params = bool(final) and level == 0
        params = [p for a, _ in pairs for p in r.layer_params[a]] if with_params else []
        grads = torch.autograd.grad([o for _, o in recs], [u for u, _ in recs] + params, lams,
                                    retain_graph=not with_params, allow_unused=True)
        outs = list(grads[:len(recs)])
        if with_params:
            off = len(recs)
            for a, _ in pairs:
                k = len(r.layer_params[a])
                r.param_grads[a] = grads[off:off + k]
                off += k
        if fs is not None:
            outs = [o if g is None else torch.add(o, g) for o, g in zip(outs, fs)]
        return outs

    def step_seq(self, lam: Tensor, fs: Optional[list], ts: list, te: list, mas: list,
                 mbs: list, level: int, final: int) -> list:
        """A rank's stretch of a sequential adjoint solve in one call."""
        outs = []
        for k in range(len(ts)):
            lam = self.step(lam, None if fs is None else fs[k], ts[k], te[k], mas[k], mbs[k],
                            level, final)
            outs.append(lam)
        return outs

    def init(self, t: float, i: int) -> Tensor:
        return self.r.lam_n if i == 0 else self.r.lam_zero

    @staticmethod
    def sum(alpha: float, x: Any, beta: float, y: Any) -> Tensor:
        return vec_sum(alpha, as_tensor(x), beta, as_tensor(y))

    def sum_batch(self, alpha: float, xs: list, beta: float, ys: list) -> list:
        if self.r.bb is None:  # the per-step reference path: point by point, as before
            return [vec_sum(alpha, x, beta, y) for x, y in zip(xs, ys)]
        return batched_sum(alpha, xs, beta, ys)  # elementwise: bit-identical to vec_sum

    def norm_sq(self, states: list) -> float:
        if self.deferred is not None:  # fixed iterations: keep it on the device
            self.deferred.append(torch.linalg.vector_norm(stack_rows(states),
                                                          dtype=torch.float64))
            return 0.0
        return batched_norm_sq(states) if self.r.bb is not None else vec_norm_sq(states)


class _BatchRecord:
    """One batched step of the final forward sweep, kept for the adjoint."""

    __slots__ = ("x", "params", "y", "layers", "grads", "xd")

    def __init__(self, x: Tensor, params: dict[str, Tensor], y: Tensor,
                 layers: tuple[int, ...]) -> None:
        self.x, self.params, self.y, self.layers = x, params, y, layers
        self.grads: dict[str, Tensor] = {}  # stacked parameter gradients (final sweep)
        self.xd: Optional[Tensor] = None  # x detached, when coarse steps read its rows


class _SegmentRunner:
    """One Segment on one rank: ownership, ghosts, and the forward/adjoint engines."""

    def __init__(self, seg: Segment, seg_index: int, transport: Any, fwd: MGRITOptions,
                 bwd: MGRITOptions, coarsening: str, batched: bool = True) -> None:
        self.seg = seg
        self.seg_index = seg_index
        self.n = n = seg.n_steps
        self.coarsening = coarsening
        size, rank = transport.size, transport.rank
        self.bounds = block_bounds(n, size)
        self.owned = range(max(self.bounds[rank], 1) - 1, self.bounds[rank + 1] - 1)
        self.times = [seg.time(i) for i in range(n + 1)]
        self.scheme = seg.scheme
        # blocks this rank evaluates: its own, plus ghosts of its neighbours' layers
        need = _needed_layers(n, size, rank, fwd, bwd, coarsening) - set(self.owned)
        self.blocks: dict[int, nn.Module] = {k: seg.blocks[k] for k in self.owned}
        self.ghosts = sorted(need)  # not submodules: train()/eval() is passed on per pass
        for k in self.ghosts:
            ghost = copy.deepcopy(seg.blocks[k])
            for p in ghost.parameters():
                p.requires_grad_(False)
            self.blocks[k] = ghost
        # ghost traffic: (layer, owner, needer) for every rank, computed identically
        owner_of = [q for q in range(size) for _ in range(self.bounds[q + 1] - self.bounds[q])]
        self.ghost_plan = []
        for q in range(size):
            lo_q = max(self.bounds[q], 1) - 1
            hi_q = self.bounds[q + 1] - 1
            for k in sorted(_needed_layers(n, size, q, fwd, bwd, coarsening)):
                if not lo_q <= k < hi_q:
                    self.ghost_plan.append((k, owner_of[k + 1], q))
        # trainable parameters per owned layer; refreshed when requires_grad changes
        self.all_params = [(k, p) for k in self.owned for p in seg.blocks[k].parameters()]
        self.trainable: Optional[tuple[bool, ...]] = None
        self.layer_params: dict[int, list[nn.Parameter]] = {}
        self.refresh_trainable()
        self.bn = {k: [m for m in blk.modules() if isinstance(m, _BN_TYPES)
                       and m.track_running_stats]
                   for k, blk in self.blocks.items()}
        self.sequential_adjoint = len(build_levels(n, bwd)) == 1
        self.sequential_forward = len(build_levels(n, fwd)) == 1
        # vectorised steps (batched.py): for MGRIT in both directions with injection;
        # sequential solves have nothing to batch
        self.bb: Optional[BatchedBlocks] = None
        if batched and coarsening == "injection" and not self.sequential_forward \
                and not self.sequential_adjoint:
            why = unbatchable_reason(list(self.blocks.values()))
            if why is None:
                self.bb = BatchedBlocks(self.blocks, self.scheme, self.times)
            else:
                warn_once(seg.blocks[self.owned[0]], why)
        # batched final forward sweep: records of (input leaf, parameter leaves, output,
        # layers); where[a] = (record, row) of layer a
        self.brecords: list[_BatchRecord] = []
        self.where: dict[int, tuple[int, int]] = {}
        self.index_cache: dict[tuple, Tensor] = {}
        # fixed iteration counts: residual norms stay on the device during the solve
        defer_f = fwd.tol == 0.0 and fwd.rtol == 0.0
        defer_b = bwd.tol == 0.0 and bwd.rtol == 0.0
        self.fapp = _ForwardApp(self, defer_f)
        self.bapp = _AdjointApp(self, defer_b)
        self.check_finite = True  # set by LayerParallel
        self.transport = transport
        self.fcore = Core(n, seg.t_start, seg.t_final, rank, size, self.bounds, self.fapp,
                          transport)
        fo = fwd.replace(final_fc_relax=True)
        self.fcore.set_options(**fo.engine_kwargs())
        self.fcore.set_defer_norms(defer_f)
        self.rtransport = transport.reversed()
        self.bcore = Core(n, seg.t_start, seg.t_final, self.rtransport.rank, size,
                          reversed_bounds(self.bounds), self.bapp, self.rtransport)
        self.bcore.set_options(**bwd.replace(final_fc_relax=True).engine_kwargs())
        self.bcore.set_defer_norms(defer_b)
        # per-batch state
        self.seed: Optional[int] = None
        self.rng_layers: set[int] = set()
        self.recording = False
        # final forward sweep: layer -> (input, output with graph, detached output);
        # consecutive layers form chains sharing one graph, chain_head[k] = first layer
        self.records: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.chain_head: dict[int, int] = {}
        self.chain_cache: dict[int, Tensor] = {}
        self.last_lam: Optional[Tensor] = None
        # direct mode (see LayerParallel): the segment input with its graph, which the
        # recorded sweep continues, and the sweep's latest output
        self.u0_graph: Optional[Tensor] = None
        self.direct_out: Optional[Tensor] = None
        # check every block keeps the state's shape (u + h F(u) would broadcast a
        # wrong one silently); done on the first pass for each input shape
        self.check_shapes = False
        self.coarse_graphs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.param_grads: dict[int, tuple] = {}
        self.batched_grads: dict[int, list[tuple[Tensor, Tensor]]] = {}

    # -- the propagator -------------------------------------------------------------------
    def phi(self, u: Tensor, a: int, b: int, *, update_stats: bool) -> Tensor:
        """Step from fine point a to b with the block of layer a (or the average)."""
        if b == a + 1 or self.coarsening == "injection":
            f: Callable[[Tensor], Tensor] = self.blocks[a]
        else:
            f = coarse_block([self.blocks[k] for k in range(a, b)], 0, b - a, self.coarsening)
        dt = self.times[b] - self.times[a]
        bn = self.bn.get(a)
        if a in self.rng_layers or (bn and not update_stats):
            inner = f

            def f(v: Tensor) -> Tensor:
                with contextlib.ExitStack() as stack:
                    if a in self.rng_layers:
                        stack.enter_context(layer_rng(self.seed, self.seg_index, a))
                    if bn and not update_stats:
                        stack.enter_context(_frozen_running_stats(bn))
                    return inner(v)
        if self.check_shapes:
            unchecked = f

            def f(v: Tensor) -> Tensor:
                out = unchecked(v)
                if out.shape != v.shape:
                    raise ValueError(
                        f"layer {a} of segment {self.seg_index} changed the state's shape "
                        f"from {tuple(v.shape)} to {tuple(out.shape)}; a residual block "
                        "must keep it")
                return out
        return self.scheme.step(f, u, dt)

    def direct_sweep(self, as_: list, bs: list) -> list:
        """Direct mode's sequential sweep (or a stretch of it), recorded onto the segment
        input's graph as plain PyTorch would: no per-step records, states kept with
        their graph.  A stretch not starting at 0 continues the previous one."""
        step, blocks, times, special = self.scheme.step, self.blocks, self.times, \
            self.rng_layers
        outs = []
        x = self.u0_graph if as_[0] == 0 else self.direct_out
        with torch.enable_grad():
            for a, b in zip(as_, bs):
                if a in special or self.check_shapes:
                    x = self.phi(x, a, b, update_stats=True)
                else:
                    x = step(blocks[a], x, times[b] - times[a])
                outs.append(x)
        self.direct_out = x
        return outs

    def refresh_trainable(self) -> None:
        """Re-read which owned parameters require grad (the user may freeze some)."""
        flags = tuple(p.requires_grad for _, p in self.all_params)
        if flags != self.trainable:
            self.trainable = flags
            self.layer_params = {k: [] for k in self.owned}
            for (k, p), f in zip(self.all_params, flags):
                if f:
                    self.layer_params[k].append(p)

    def coarse_graph(self, a: int, b: int) -> tuple[Tensor, Tensor]:
        """(u_a as a leaf, forward coarse step a -> b with its graph), built once per
        backward pass and reused by every adjoint iteration."""
        rec = self.coarse_graphs.get((a, b))
        if rec is None:
            with torch.enable_grad():
                u_a = self.records[a][0].detach().requires_grad_()
                rec = (u_a, self.phi(u_a, a, b, update_stats=False))
            self.coarse_graphs[(a, b)] = rec
        return rec

    # -- batched records and adjoint steps (bb is not None) ------------------------------
    def record_batch(self, x: Tensor, pairs: tuple[tuple[int, int], ...]) -> Tensor:
        """A final forward step of several layers, recorded with its graph: the input
        and the stacked parameters are leaves, so the adjoint gets the stacked parameter
        gradients in one autograd call.  Returns the detached output."""
        bb = self.bb
        assert bb is not None
        layers = tuple(a for a, _ in pairs)
        with torch.enable_grad():
            xin = x.detach().requires_grad_()
            stacked, _ = bb.stacked(layers)
            trainable = self.trainable_names(layers)
            leaves = {n: t.detach().requires_grad_(n in trainable) for n, t in stacked.items()}
            y = bb.step(xin, pairs, params=leaves)
        rid = len(self.brecords)
        self.brecords.append(_BatchRecord(xin, leaves, y, layers))
        for k, a in enumerate(layers):
            self.where[a] = (rid, k)
        return y.detach()

    def trainable_names(self, layers: tuple[int, ...]) -> set[str]:
        """Parameter names that require grad in at least one of these (owned) layers."""
        names = self.bb.param_names  # type: ignore[union-attr]
        out: set[str] = set()
        for a in layers:
            for name, p in zip(names, self.bb._tensors[a][0]):  # type: ignore[union-attr]
                if p.requires_grad:
                    out.add(name)
        return out

    def _index(self, rows: tuple[int, ...], device: torch.device) -> Tensor:
        key = (rows, device)
        got = self.index_cache.get(key)
        if got is None:
            got = self.index_cache[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return got

    def adjoint_fine(self, lam: Tensor, pairs: list, final: int) -> Tensor:
        """Transposed Jacobians of fine steps (layers a of `pairs`) applied to the rows
        of `lam`, through the recorded batches; at the final sweep also the parameter
        gradients (accumulated per record).  One autograd call per record touched."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for k, (a, _) in enumerate(pairs):
            rid, row = self.where[a]
            ks, rows = groups.setdefault(rid, ([], []))
            ks.append(k)
            rows.append(row)
        out: Optional[Tensor] = None
        for rid, (ks, rows) in groups.items():
            rec = self.brecords[rid]
            n_rec = rec.y.shape[0]
            if len(groups) == 1 and rows == list(range(n_rec)):
                cot = lam  # the whole record in its own order: no index work
            else:
                cot = lam.new_zeros(rec.y.shape)
                cot.index_copy_(0, self._index(tuple(rows), lam.device),
                                lam.index_select(0, self._index(tuple(ks), lam.device)))
            wrt = [rec.x]
            names = [n for n, t in rec.params.items() if t.requires_grad] if final else []
            wrt += [rec.params[n] for n in names]
            got = torch.autograd.grad(rec.y, wrt, cot, retain_graph=True)
            dx = got[0]
            for name, g in zip(names, got[1:]):
                prev = rec.grads.get(name)
                rec.grads[name] = g if prev is None else prev + g
            if cot is lam:
                return dx
            if out is None:
                out = torch.empty_like(lam)
            out.index_copy_(0, self._index(tuple(ks), lam.device),
                            dx.index_select(0, self._index(tuple(rows), lam.device)))
        assert out is not None
        return out

    def adjoint_coarse(self, lam: Tensor, pairs: tuple[tuple[int, int], ...]) -> Tensor:
        """Transposed Jacobians of coarse steps a -> b, linearised at the forward states
        u_a of the final sweep; the batched coarse graph is built once per backward pass
        and reused by every adjoint iteration."""
        rec = self.coarse_graphs.get(pairs)  # type: ignore[call-overload]
        if rec is None:
            states = [self.forward_state(a) for a, _ in pairs]
            with torch.enable_grad():
                x = stack_rows(states).detach().requires_grad_()
                rec = (x, self.bb.step(x, pairs))  # type: ignore[union-attr]
            self.coarse_graphs[pairs] = rec  # type: ignore[index]
        (dx,) = torch.autograd.grad(rec[1], rec[0], lam, retain_graph=True)
        return dx

    def forward_state(self, a: int) -> Row:
        """u_a, the input of layer a in the final forward sweep (batched records)."""
        rid, row = self.where[a]
        rec = self.brecords[rid]
        if rec.xd is None:
            rec.xd = rec.x.detach()
        return Row(rec.xd, row)

    def collect_batched_grads(self) -> dict[int, tuple]:
        """Per owned layer, its parameter gradients (rows of one tensor per parameter
        name: no copy per layer), from the records of the final adjoint sweep."""
        bb = self.bb
        assert bb is not None
        recs = [r for r in self.brecords if r.grads]
        if not recs:
            return {}
        layers = [a for r in recs for a in r.layers]
        names = bb.param_names
        rows: dict[str, list[Tensor]] = {}
        for name in names:
            parts = [r.grads.get(name) for r in recs]
            if any(g is None for g in parts):
                parts = [torch.zeros_like(r.params[name]) if g is None else g
                         for r, g in zip(recs, parts)]
            rows[name] = list((torch.cat(parts) if len(parts) > 1 else parts[0]).unbind(0))
        out: dict[int, list[tuple[Tensor, Tensor]]] = {}
        for k, a in enumerate(layers):
            out[a] = [(p, rows[name][k]) for name, p in zip(names, bb._tensors[a][0])
                      if p.requires_grad]
        return out

    def chain_vjp(self, a: int, lam: Tensor) -> Tensor:
        """Final adjoint step of layer a when the adjoint is solved sequentially.

        The engine then visits this rank's layers from the last to the first, each
        step's input being the previous step's output.  The first visit of a chain
        (its last layer) back-propagates the whole chain in one autograd call, as
        plain PyTorch would; the other visits return the cached results.  Only the
        chain head's input gradient is requested: in a sequential solve the engine
        reads no other point (the head's value is what travels to the next chain or
        rank), so the points inside a chain hold a shared zero placeholder.
        """
        if a in self.chain_cache and lam is self.last_lam:
            res = self.chain_cache.pop(a)
        else:
            head = self.chain_head[a]
            layers = range(head, a + 1)
            params = [p for k in layers for p in self.layer_params[k]]
            grads = torch.autograd.grad(self.records[a][1], [self.records[head][0], *params],
                                        lam, allow_unused=True)
            self.chain_cache = dict.fromkeys(layers, self.lam_zero)
            self.chain_cache[head] = grads[0]
            off = 1
            for k in layers:
                n_p = len(self.layer_params[k])
                self.param_grads[k] = grads[off:off + n_p]
                off += n_p
            res = self.chain_cache.pop(a)
        self.last_lam = res
        return res

    # -- per batch ----------------------------------------------------------------------------
    def sync_ghosts(self) -> None:
        """Send owned blocks' current parameters to ranks that keep ghosts of them."""
        if not self.ghost_plan:
            return
        tr = self.transport
        me = tr.comm.Get_rank()
        reqs, recvs = [], []
        for k, owner, needer in self.ghost_plan:
            if owner == me:
                buf = _state_vector(self.seg.blocks[k]).numpy()
                reqs.append((tr.comm.Isend(buf, dest=needer, tag=_GHOST_TAG), buf))
            elif needer == me:
                buf = np.empty(_state_vector(self.blocks[k]).numel(), dtype=np.float64)
                recvs.append((k, tr.comm.Irecv(buf, source=owner, tag=_GHOST_TAG), buf))
        for k, req, buf in recvs:
            tr._wait_request(req)
            _load_state_vector(self.blocks[k], torch.from_numpy(buf))
        for req, _ in reqs:
            tr._wait_request(req)

    def forward(self, u0: Optional[Tensor], like: Tensor, seed: Optional[int],
                record: bool, training: bool, direct: bool = False,
                check_shapes: bool = False) -> tuple[Optional[Tensor], dict]:
        """MGRIT forward solve; returns (u_N on the last rank else None, stats).

        direct: one rank, sequential solve: record the steps onto u0's own graph and
        return u_N with its graph (PyTorch's engine then runs the backward)."""
        for k in self.ghosts:
            if self.blocks[k].training != training:
                self.blocks[k].train(training)
        if record and not direct:
            self.refresh_trainable()
        self.seed = seed
        self.rng_layers = {k for k, blk in self.blocks.items() if seed is not None
                           and needs_rng(blk)}
        self.recording = record
        self.records = {}
        self.chain_head = {}
        self.brecords = []
        self.where = {}
        self.coarse_graphs = {}
        self.param_grads = {}
        self.u0 = u0 if u0 is not None else like
        self.zero = torch.zeros_like(like)
        self.transport.set_template(like)
        if self.bb is not None:
            self.bb.new_pass()
            if check_shapes:  # first pass for this input shape: is vmap right here?
                why = self.bb.probe(like)
                if why is not None:
                    warn_once(self.bb.proto, why)
                    self.bb = None
        if direct:
            assert u0 is not None
            self.u0_graph, self.u0 = u0, u0.detach()
        self.check_shapes = check_shapes
        try:
            code = self.fcore.drive()
        finally:
            self.u0_graph = None
            self.check_shapes = False
        self._check(code, self.fcore, "forward")
        last = self.transport.size - 1
        out = as_tensor(self.fcore.get_state(self.n)) if self.transport.rank == last else None
        if direct:
            out, self.direct_out = self.direct_out, None
        return out, self._stats(self.fcore, self.fapp, "forward")

    def backward(self, lam_n: Optional[Tensor], like: Tensor) -> tuple[Optional[Tensor], dict]:
        """Adjoint MGRIT solve; returns (lambda_0 on rank 0 else None, stats)."""
        self.lam_n = lam_n if lam_n is not None else like
        self.lam_zero = torch.zeros_like(like)
        self.rtransport.set_template(like)
        code = self.bcore.drive()
        self._check(code, self.bcore, "backward")
        out = as_tensor(self.bcore.get_state(self.n)) if self.transport.rank == 0 else None
        if self.bb is not None:
            self.batched_grads = self.collect_batched_grads()
        self.brecords = []
        self.where = {}
        self.records = {}
        self.chain_head = {}
        self.chain_cache = {}
        self.last_lam = None
        self.coarse_graphs = {}
        return out, self._stats(self.bcore, self.bapp, "backward")

    def _check(self, code: int, core: Core, what: str) -> None:
        if code == NAN_ERROR:
            raise DivergenceError(
                f"{what} MGRIT residual became {core.residual_history[-1]} in iteration "
                f"{core.iterations} of segment {self.seg_index}: non-finite values")

    def _stats(self, core: Core, app: Any, what: str) -> dict:
        stats = _Stats({"iterations": core.iterations, "converged": core.converged,
                        "n_levels": core.n_levels, "timings": core.timings})
        if app.deferred is None:
            stats["residual_history"] = core.residual_history
            return stats
        norms, app.deferred = app.deferred, []
        if not norms:
            stats["residual_history"] = []
            return stats

        def history() -> list[float]:
            local = (torch.stack(norms) ** 2).tolist()  # the one read-back of the solve
            hist = [v ** 0.5 for v in self.transport.allreduce_sum(local)]
            if not all(np.isfinite(hist)):
                raise DivergenceError(
                    f"{what} MGRIT residual became {hist[-1]} in iteration {len(hist)} of "
                    f"segment {self.seg_index}: non-finite values (history {hist})")
            return hist

        if self.check_finite or self.transport.size > 1:  # a collective: on every rank now
            stats["residual_history"] = history()
        else:  # one rank, no checks wanted: read back only when someone asks
            stats.lazy = history
        return stats


class _Stats(dict):
    """Per-solve report; "residual_history" may be read back from the device lazily
    (one rank, `check_finite=False`), at the first access of that key."""

    lazy: Optional[Callable[[], list[float]]] = None

    def __missing__(self, key: str) -> Any:
        if key == "residual_history" and self.lazy is not None:
            value, self.lazy = self.lazy(), None
            self[key] = value
            return value
        raise KeyError(key)


class _PlainRecord:
    """A plain layer evaluated once with its graph kept for the backward pass.

    Consecutive plain layers on one rank share one graph (`prev`): the backward pass
    then goes through the whole group in one autograd call."""

    def __init__(self, layer: nn.Module, x: Tensor, record: bool,
                 prev: Optional[_PlainRecord] = None) -> None:
        self.head: _PlainRecord = self
        if record:
            with torch.enable_grad():
                if prev is not None:
                    self.x, self.head = prev.y, prev.head
                else:
                    self.x = x.detach().requires_grad_()
                self.y = layer(self.x)
        else:
            self.x, self.y = x, layer(x)
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.group_params = (prev.group_params if prev is not None else []) + self.params


class _Context:
    """What one forward pass leaves for its backward pass."""

    def __init__(self) -> None:
        self.plain: dict[int, _PlainRecord] = {}
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []  # segment states
        self.out_holder = 0  # rank that computed the output
        self.x_requires_grad = False
        self.x_shape: tuple[int, ...] = ()
        self.x_dtype = torch.float32
        self.direct = False  # recorded onto the caller's graph (see LayerParallel)


class LayerParallel(nn.Module):
    """Run an `ODENet` layer-parallel over the ranks of `comm` with MGRIT.

    net: an `ODENet`, or a zero-argument factory returning one (called on every rank,
        so seed the global generator first to get the same network everywhere).
    comm: an mpi4py communicator (never COMM_WORLD implicitly), or None for one rank.
    options / backward_options: `MGRITOptions` of the forward and adjoint solves
        (`final_fc_relax` is always on: the final sweep records states and gradients).
    coarsening: parameter coarsening on coarse levels, "injection" or "average".
    state_dict: optional whole-network state dict to load before distributing.
    batched: advance all independent intervals of a level in one vectorised step
        (default; see `layerpar.parallel.batched`).  False steps layer by layer, as a
        reference.  Blocks that cannot be vectorised fall back with one warning.
    check_finite: check every output and loss gradient for NaN/inf (one flag read back
        from the device per pass; a non-finite one raises `DivergenceError`).  With
        False and fixed iteration counts (tol = rtol = 0) a training step on one GPU
        has no host-device synchronisation at all; residual histories are then read
        back when `last_forward[i]["residual_history"]` is first looked at.

    Same forward signature as the serial net: pass the input on every rank; the output
    (and so the loss) is returned on every rank.  `named_parameters()` yields only this
    rank's parameters, under the names they have in the serial net.  After each pass
    `last_forward` / `last_backward` report MGRIT iterations and residuals per segment.

    On one rank with sequential forward and adjoint solves (`max_levels=1` for both,
    the default) the model runs in *direct mode*: the forward sweep is recorded onto
    the input's own graph and PyTorch's engine runs the backward, which is then
    exactly the adjoint solve and costs what plain PyTorch costs.  Otherwise the
    forward and adjoint MGRIT solves run inside one autograd Function whose inputs are
    this rank's trainable parameters.  Both keep serial semantics for `backward()`,
    `torch.autograd.grad`, `backward(inputs=...)` and frozen parameters.
    """

    def __init__(self, net: Union[ODENet, Callable[[], ODENet]], comm: Any = None,
                 options: Optional[MGRITOptions] = None,
                 backward_options: Optional[MGRITOptions] = None, *,
                 coarsening: str = "injection",
                 state_dict: Optional[dict[str, Tensor]] = None,
                 batched: bool = True, check_finite: bool = True) -> None:
        super().__init__()
        self.transport: Union[SerialTransport, MPITransport] = (
            MPITransport(comm) if comm is not None else _SerialLP())
        options = MGRITOptions(max_levels=1) if options is None else options
        backward_options = options if backward_options is None else backward_options
        err: Optional[BaseException] = None
        key: Any = None
        try:
            if not isinstance(net, ODENet):
                if not callable(net):
                    raise TypeError(f"`net` must be an ODENet or a factory returning one, got "
                                    f"{type(net).__name__}")
                net = net()
                if not isinstance(net, ODENet):
                    raise TypeError(f"the `net` factory returned {type(net).__name__}, "
                                    "not an ODENet")
            for name, o in (("options", options), ("backward_options", backward_options)):
                if not isinstance(o, MGRITOptions):
                    raise TypeError(f"`{name}` must be an MGRITOptions, got {type(o).__name__}")
            for name, flag in (("batched", batched), ("check_finite", check_finite)):
                if not isinstance(flag, bool):
                    raise TypeError(f"`{name}` must be a bool, got {type(flag).__name__}")
            if coarsening not in COARSENINGS:
                raise ValueError(f"`coarsening` must be one of {COARSENINGS}, got "
                                 f"{coarsening!r}")
            if state_dict is not None:
                net.load_state_dict(state_dict)
            for _, seg in net.segments:
                if seg.n_steps < self.transport.size:
                    raise ValueError(
                        f"a segment has {seg.n_steps} layers but the communicator has "
                        f"{self.transport.size} ranks: each rank needs at least one layer")
            key = {**{f"options.{k}": v for k, v in options.key().items()},
                   **{f"backward_options.{k}": v for k, v in backward_options.key().items()},
                   "coarsening": coarsening, "batched": batched, "check_finite": check_finite,
                   "layers": [(type(m).__name__, getattr(m, "n_steps", None))
                              for m in net.layers]}
        except Exception as exc:  # noqa: BLE001 - re-raised identically on every rank
            err = exc
        self.transport.agree(key, err, "LayerParallel settings (options, coarsening, layers)")
        assert isinstance(net, ODENet)
        self.options = options
        self.backward_options = backward_options
        self.coarsening = coarsening
        size, rank = self.transport.size, self.transport.rank
        self._layers_meta: list[tuple[str, Any]] = []
        shards: list[nn.Module] = []
        self._runners: dict[int, _SegmentRunner] = {}
        first_seg = min(k for k, _ in net.segments)
        seg_index = 0
        for k, layer in enumerate(net.layers):
            if isinstance(layer, Segment):
                runner = _SegmentRunner(layer, seg_index, self.transport, options,
                                        backward_options, coarsening, batched)
                self._runners[k] = runner
                shards.append(_SegmentShard(layer, runner.owned))
                self._layers_meta.append(("segment", seg_index))
                seg_index += 1
            else:
                owner = 0 if k < first_seg else size - 1
                shards.append(layer if owner == rank else _Remote(owner))
                self._layers_meta.append(("plain", owner))
        self.layers = nn.ModuleList(shards)
        self._param_list: Optional[list[nn.Parameter]] = None
        self._deliver = GradDelivery()
        self.check_finite = check_finite
        for r in self._runners.values():
            r.check_finite = check_finite
        self._shape_cache: dict[tuple, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        # one rank, sequential forward and adjoint: see _forward_direct
        self._direct = size == 1 and all(r.sequential_forward and r.sequential_adjoint
                                         for r in self._runners.values())
        self._net_repr = repr(net)
        self._has_dropout = \
            any(isinstance(m, _DROPOUT) for m in net.modules())
        self.last_forward: list[dict] = []
        self.last_backward: list[dict] = []

    # -- helpers ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

    def _send(self, t: Tensor, dest: int) -> None:
        tr = self.transport
        tr._wait_request(tr.comm.Isend([pack(t), tr._MPI.BYTE], dest=dest, tag=_LINK_TAG))

    def _recv(self, src: int, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
        tr = self.transport
        raw = torch.empty(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),
                          dtype=torch.uint8)
        tr._wait_request(tr.comm.Irecv([raw.numpy(), tr._MPI.BYTE], source=src, tag=_LINK_TAG))
        return unpack(raw, shape, dtype, device)

    def _meta(self, t: Optional[Tensor], root: int) -> tuple[tuple[int, ...], torch.dtype]:
        if self.size == 1:
            assert t is not None
            return tuple(t.shape), t.dtype
        return self.transport.bcast_object(None if t is None else (tuple(t.shape), t.dtype),
                                           root=root)

    def _bcast(self, t: Optional[Tensor], root: int, shape: tuple, dtype: torch.dtype,
               device: torch.device) -> Tensor:
        if self.size == 1:
            assert t is not None
            return t
        tr = self.transport
        if tr.rank == root:
            assert t is not None
            buf = pack(t)
        else:
            buf = torch.empty(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),
                              dtype=torch.uint8).numpy()
        tr._wait_request(tr.comm.Ibcast([buf, tr._MPI.BYTE], root=root))
        return t if tr.rank == root else unpack(buf, shape, dtype, device)  # type: ignore

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run `fn`; an exception raised on this rank alone is sent to the others.
        Errors every rank raises by itself (same data, same check) are not sent: the
        notice could overtake the other ranks' own, clearer error."""
        try:
            return fn()
        except (RemoteError, RankMismatchError, DivergenceError):
            raise
        except BaseException as exc:
            self.transport.broadcast_error(exc)
            raise

    # -- passes ----------------------------------------------------------------------------------
    def _forward_impl(self, ctx: _Context, x: Tensor, record: bool) -> Tensor:
        size, rank = self.size, self.rank
        last = size - 1
        # one collective: same input shape/dtype/mode on every rank, and rank 0's seed
        seed = draw_seed() if (self.training and self._has_dropout and rank == 0) else None
        key = (tuple(x.shape), str(x.dtype), self.training, record)
        if size > 1:
            got = self.transport.allgather_object((key, seed))
            keys = [g[0] for g in got]
            if any(k != keys[0] for k in keys):
                raise RankMismatchError(f"the input differs between ranks (shape, dtype, "
                                        f"training, grad mode): {keys}")
            seed = got[0][1]
        h: Optional[Tensor] = x if rank == 0 else None
        holder = 0  # rank holding the current activation
        self.last_forward = []
        # activation shapes depend only on the input's (checked equal on every rank):
        # broadcast them the first time, then reuse
        cached = self._shape_cache.get(key)
        metas: list[tuple[tuple[int, ...], torch.dtype]] = []

        def meta(t: Optional[Tensor], root: int) -> tuple[tuple[int, ...], torch.dtype]:
            got = cached[len(metas)] if cached is not None else self._meta(t, root)
            metas.append(got)
            return got

        for k, (kind, info) in enumerate(self._layers_meta):
            if kind == "plain":
                owner = info
                if owner != holder:
                    shape, dtype = meta(h, holder)
                    if rank == holder:
                        self._send(h, owner)  # type: ignore[arg-type]
                    elif rank == owner:
                        h = self._recv(holder, shape, dtype, x.device)
                    holder = owner
                if rank == owner:
                    if ctx.direct:  # onto the caller's graph
                        with torch.enable_grad():
                            h = self.layers[k](h)
                        continue
                    prev = ctx.plain.get(k - 1) if record else None
                    rec = _PlainRecord(self.layers[k], h, record,  # type: ignore[arg-type]
                                       prev)
                    ctx.plain[k] = rec
                    h = rec.y.detach()
            else:
                runner = self._runners[k]
                if holder != 0:
                    shape, dtype = meta(h, holder)
                    if rank == holder:
                        self._send(h, 0)  # type: ignore[arg-type]
                    elif rank == 0:
                        h = self._recv(holder, shape, dtype, x.device)
                    holder = 0
                shape, dtype = meta(h, 0)
                ctx.shapes.append((shape, dtype))
                like = torch.empty(shape, dtype=dtype, device=x.device)
                if size > 1:
                    runner.sync_ghosts()
                h, stats = runner.forward(h if rank == 0 else None, like, seed, record,
                                          self.training, ctx.direct,
                                          check_shapes=cached is None)
                self.last_forward.append(stats)
                holder = last
        shape, dtype = meta(h, holder)
        if cached is None:
            self._shape_cache[key] = metas
        ctx.out_holder = holder
        y = self._bcast(h, holder, shape, dtype, x.device)
        if self.check_finite and not bool(torch.isfinite(y).all()):
            raise DivergenceError("the layer-parallel forward pass produced non-finite "
                                  "outputs (NaN or inf)")
        return y

    def _backward_impl(self, ctx: _Context, gy: Tensor) -> tuple[Optional[Tensor], dict]:
        if self.check_finite and not bool(torch.isfinite(gy).all()):
            raise DivergenceError("the loss gradient is not finite (NaN or inf loss?)")
        size, rank = self.size, self.rank
        grads: dict[int, Tensor] = {}  # id(parameter) -> gradient (Tensor.__hash__ is slow)
        g: Optional[Tensor] = gy if rank == ctx.out_holder else None
        holder = ctx.out_holder
        seg_shapes = list(ctx.shapes)
        g_meta = (tuple(gy.shape), gy.dtype)  # shape of g wherever it travels
        self.last_backward = []
        for k in reversed(range(len(self._layers_meta))):
            kind, info = self._layers_meta[k]
            if kind == "plain":
                owner = info
                if owner != holder:
                    shape, dtype = g_meta
                    if rank == holder:
                        self._send(g, owner)  # type: ignore[arg-type]
                    elif rank == owner:
                        g = self._recv(holder, shape, dtype, gy.device)
                    holder = owner
                if rank == owner:
                    rec = ctx.plain[k]
                    nxt = ctx.plain.get(k + 1)
                    if nxt is None or nxt.head is not rec.head:
                        # the last layer of a group: back-propagate the whole group
                        head = rec.head
                        outs = torch.autograd.grad(rec.y, [head.x, *rec.group_params], g,
                                                   allow_unused=True)
                        g = outs[0]
                        for p, gp in zip(rec.group_params, outs[1:]):
                            if gp is not None:
                                grads[id(p)] = gp
            else:
                runner = self._runners[k]
                shape, dtype = seg_shapes.pop()
                like = torch.empty(shape, dtype=dtype, device=gy.device)
                if holder != size - 1:
                    if rank == holder:
                        self._send(g, size - 1)  # type: ignore[arg-type]
                    elif rank == size - 1:
                        g = self._recv(holder, shape, dtype, gy.device)
                    holder = size - 1
                g, stats = runner.backward(g if rank == size - 1 else None, like)
                self.last_backward.append(stats)
                for n, pg in runner.param_grads.items():
                    for p, gp in zip(runner.layer_params[n], pg):
                        if gp is not None:
                            grads[id(p)] = gp
                for pairs in runner.batched_grads.values():
                    for p, gp in pairs:
                        grads[id(p)] = gp
                runner.param_grads = {}
                runner.batched_grads = {}
                holder = 0
                g_meta = (shape, dtype)
        self.last_backward.reverse()
        gx = None
        if ctx.x_requires_grad:
            gx = self._bcast(g, holder, ctx.x_shape, ctx.x_dtype, gy.device)
        return gx, grads

    def forward(self, x: Tensor) -> Tensor:
        """Layer-parallel forward pass; pass the same `x` on every rank."""
        if not isinstance(x, Tensor):
            raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
        if self._param_list is None:  # walking the module tree costs ~5 us per layer
            self._param_list = list(self.parameters())
        record = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self._param_list))
        if not record:
            ctx = _Context()
            return self._guard(lambda: self._forward_impl(ctx, x, False))
        if self._direct:
            return self._forward_direct(x)
        params = [p for p in self._param_list if p.requires_grad]
        return _LayerParallelFunction.apply(self, x, *params)

    def _forward_direct(self, x: Tensor) -> Tensor:
        """Direct mode: one rank, forward and adjoint both sequential.

        The adjoint solve would then be exactly backpropagation through the recorded
        final sweep, which here is the serial network's own graph; so the steps are
        recorded onto `x`'s graph and PyTorch's engine runs the backward.  Parameters
        are the graph's leaves as in plain PyTorch: `autograd.grad`, `backward(inputs=)`
        and hooks behave as in serial code, and no autograd Function with one input per
        parameter stands in between (that cost ~4.5 us per parameter per backward pass).
        """
        ctx = _Context()
        ctx.direct = True
        with torch.no_grad():  # only the recording itself builds a graph
            y = self._guard(lambda: self._forward_impl(ctx, x, True))
        if y.requires_grad:
            y.register_hook(self._direct_backward_started)
        return y

    def _direct_backward_started(self, gy: Tensor) -> None:
        """Hook on the direct-mode output: the same check and report as the adjoint
        solve (a sequential solve: one iteration, no residuals, no communication).
        The timings are zeros, not measurements: PyTorch's engine runs this backward."""
        if self.check_finite and not bool(torch.isfinite(gy).all()):
            raise DivergenceError("the loss gradient is not finite (NaN or inf loss?)")
        self.last_backward = [
            {"iterations": 1, "converged": True, "residual_history": [], "n_levels": 1,
             "timings": dict.fromkeys(fwd["timings"], 0.0), "direct": True}
            for fwd in self.last_forward]

    # -- portability ------------------------------------------------------------------------------
    def gather_state_dict(self) -> dict[str, Tensor]:
        """The whole network's state dict (loads into the serial `ODENet`), on every rank."""
        local = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        if self.size == 1:
            return local
        merged: dict[str, Tensor] = {}
        for part in self._guard(lambda: self.transport.allgather_object(local)):
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: _name_order(kv[0])))

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state of the whole network, keyed by parameter name, on every
        rank (collective).  `load_optimizer_state` restores it on any number of ranks."""
        names = {id(p): n for n, p in self.named_parameters()}
        sd = optimizer.state_dict()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        state = {names[id(order[i])]: {k: (v.detach().cpu() if isinstance(v, Tensor) else v)
                                       for k, v in st.items()}
                 for i, st in sd["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        group_of = {names[id(p)]: gi for gi, g in enumerate(optimizer.param_groups)
                    for p in g["params"]}
        parts = [(state, groups, group_of)] if self.size == 1 else self._guard(
            lambda: self.transport.allgather_object((state, groups, group_of)))
        merged: dict[str, Any] = {"state": {}, "param_groups": parts[0][1], "group_of": {}}
        for st, _, go in parts:
            merged["state"].update(st)
            merged["group_of"].update(go)
        return merged

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """Load a state from `gather_optimizer_state` into this rank's optimizer."""
        names = {id(p): n for n, p in self.named_parameters()}
        order = [p for g in optimizer.param_groups for p in g["params"]]
        local = optimizer.state_dict()
        if len(local["param_groups"]) != len(state["param_groups"]):
            raise ValueError("`state` has a different number of parameter groups than "
                             "`optimizer`")
        new_state = {}
        for i, p in enumerate(order):
            st = state["state"].get(names[id(p)])
            if st is not None:
                new_state[i] = {k: (v.to(p.device) if isinstance(v, Tensor) and v.dim() > 0
                                    else v) for k, v in st.items()}
        groups = []
        for g_local, g_saved in zip(local["param_groups"], state["param_groups"]):
            groups.append({**g_saved, "params": g_local["params"]})
        optimizer.load_state_dict({"state": new_state, "param_groups": groups})

    def _apply(self, fn: Callable, recurse: bool = True) -> LayerParallel:
        """`.to()`, `.double()`, `.cuda()` ... also reach the ghost blocks, which are not
        submodules (they hold no trainable parameters of this rank)."""
        super()._apply(fn, recurse)
        for runner in self._runners.values():
            for k in runner.ghosts:
                runner.blocks[k]._apply(fn)
        return self

    def close(self) -> None:
        """Release the duplicated communicator (collective: call on every rank).

        Each LayerParallel holds one duplicate of `comm` so its messages never meet the
        user's; a program that builds many models should close the ones it drops
        (MPI has a limited number of communicators).  The model cannot run afterwards.
        """
        self.transport.close()

    def extra_repr(self) -> str:
        return (f"rank {self.rank} of {self.size}, coarsening={self.coarsening!r}, "
                f"options={self.options}, backward_options={self.backward_options}")


def _name_order(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in name.split("."))


class _SerialLP(SerialTransport):
    """Serial transport with the extras LayerParallel uses."""

    comm = None

    def reversed(self) -> _SerialLP:
        return self

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]


class _LayerParallelFunction(torch.autograd.Function):
    """Forward MGRIT / adjoint MGRIT as one autograd node over this rank's parameters."""

    @staticmethod
    def forward(ctx: Any, model: LayerParallel, x: Tensor, *params: Tensor) -> Tensor:
        c = _Context()
        c.x_requires_grad = x.requires_grad
        c.x_shape, c.x_dtype = tuple(x.shape), x.dtype
        y = model._guard(lambda: model._forward_impl(c, x.detach(), True))
        ctx.model, ctx.c, ctx.params = model, c, params
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple:
        model: LayerParallel = ctx.model
        gx, grads = model._guard(lambda: model._backward_impl(ctx.c, gy.contiguous()))
        ctx.c = None
        return (None, gx, *model._deliver(ctx.params, grads))
