"""One Segment on one rank: ownership, ghosts, the propagator, and its two solves.

The runner owns the forward and adjoint engine sessions of one segment, the blocks
it evaluates (its own and its ghosts), the batched steps when the segment is
vectorised, and what a forward pass leaves for its backward pass.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from ..mgrit.grid import Partition, build_levels, reversed_bounds
from ..mgrit.options import MGRITOptions
from ..mgrit.result import MGRITResult
from ..mgrit.session import EngineSession
from ..ode.coarsening import coarse_block
from ..ode.net import Segment
from ..ode.rng import needs_rng
from .adjoint import AdjointApp
from .batched import (
    BatchedBlocks,
    Row,
    as_tensor,
    buffer_message,
    buffer_versions,
    inplace_message,
    own_buffers,
    stack_rows,
    unbatchable_reason,
    warn_once,
)
from .bn_dropout import batch_norms, layer_function
from .forward import ForwardApp
from .ghosts import Ghosts, needed_layers
from .tape import BatchRecord, Tape
from .timing import best_seconds

__all__ = ["SegmentRunner"]


_log = logging.getLogger("layerpar")


@dataclass(frozen=True)
class PathChoice:
    """Which cycle a segment runs for one input shape, and what was measured (seconds
    of one fine-level batch of steps with their VJPs, summed over the ranks; None where
    the choice was not measured)."""

    batched: bool
    vectorised_s: Optional[float]
    per_step_s: Optional[float]


class SegmentRunner:
    """One Segment on one rank: ownership, ghosts, and the forward/adjoint engines."""

    def __init__(self, seg: Segment, seg_index: int, transport: Any, fwd: MGRITOptions,
                 bwd: MGRITOptions, coarsening: str, batched: Union[bool, str] = "auto",
                 engine: str = "native") -> None:
        self.seg_index = seg_index
        self.n = n = seg.n_steps
        self.coarsening = coarsening
        size, rank = transport.size, transport.rank
        # the partition, its levels and the ghost needs: computed once, here
        self.part = Partition.build(n, size, fwd)
        self.bounds = list(self.part.bounds)
        self.owned = self.part.steps(rank)
        self.times = [seg.time(i) for i in range(n + 1)]
        self.scheme = seg.scheme
        # blocks this rank evaluates: its own, plus ghosts of its neighbours' layers
        self.ghosts = Ghosts(seg, self.part, rank,
                             lambda q: needed_layers(n, size, q, fwd, bwd, coarsening))
        self.blocks: dict[int, nn.Module] = {k: seg.blocks[k] for k in self.owned}
        self.blocks.update(self.ghosts.blocks)
        # trainable parameters per owned layer; refreshed when requires_grad changes
        self.all_params = [(k, p) for k in self.owned for p in seg.blocks[k].parameters()]
        self.trainable: Optional[tuple[bool, ...]] = None
        self.layer_params: dict[int, list[nn.Parameter]] = {}
        self.refresh_trainable()
        self.bn = {k: batch_norms(blk) for k, blk in self.blocks.items()}
        self.sequential_adjoint = len(build_levels(n, bwd)) == 1
        self.sequential_forward = len(build_levels(n, fwd)) == 1
        # vectorised steps (batched.py): for MGRIT in both directions with injection;
        # sequential solves have nothing to batch
        # `vectorised`: the segment's BatchedBlocks where its blocks allow them; `bb`: the
        # same where this pass uses them (per input: "auto" measures both paths at the
        # first pass for an input shape, see choose_path), else None (per-step path)
        self.vectorised: Optional[BatchedBlocks] = None
        self.bb: Optional[BatchedBlocks] = None
        self.paths: dict[tuple, PathChoice] = {}
        # what every rank has alike (agreed options): whether vectorised cycles are
        # possible at all, and whether the ranks time them against per-step cycles
        # (collectively: a rank whose own blocks cannot be vectorised takes part too)
        possible = bool(batched) and coarsening == "injection" and not \
            self.sequential_forward and not self.sequential_adjoint
        self.measure = possible and batched == "auto"
        if possible:
            why = unbatchable_reason(list(self.blocks.values()))
            if why is None:
                self.vectorised = BatchedBlocks(self.blocks, self.scheme, self.times)
            else:
                warn_once(seg.blocks[self.owned[0]], why)
        self.index_cache: dict[tuple, Tensor] = {}
        # fixed iteration counts: residual norms stay on the device during the solve
        # (the native engine's: XBraid reads every norm)
        defer_f = fwd.tol == 0.0 and fwd.rtol == 0.0 and engine == "native"
        defer_b = bwd.tol == 0.0 and bwd.rtol == 0.0 and engine == "native"
        self.fapp = ForwardApp(self)
        self.bapp = AdjointApp(self)
        self.check_finite = True  # set by LayerParallel
        self.transport = transport
        name = f"of segment {seg_index}"
        self.fsession = EngineSession(n, seg.t_start, seg.t_final, transport, self.bounds,
                                      self.fapp, fwd.replace(final_fc_relax=True),
                                      what=f"forward MGRIT {name}", defer_norms=defer_f,
                                      engine=engine)
        self.rtransport = transport.reversed()
        self.bsession = EngineSession(n, seg.t_start, seg.t_final, self.rtransport,
                                      reversed_bounds(self.bounds), self.bapp,
                                      bwd.replace(final_fc_relax=True),
                                      what=f"backward MGRIT {name}", defer_norms=defer_b,
                                      engine=engine)
        self.fapp.deferred = self.fsession.deferred
        self.bapp.deferred = self.bsession.deferred
        self.fwd_options = fwd.replace(final_fc_relax=True)
        self.bwd_options = bwd.replace(final_fc_relax=True)
        # the pass being run: its forward records, or during a backward the records of
        # the pass being differentiated (the autograd context owns it; see tape.py)
        self.tape = Tape()
        # the sequential adjoint's final sweep: one autograd call per chain (chain_vjp)
        self.chain_cache: dict[int, Tensor] = {}
        self.last_lam: Optional[Tensor] = None
        # direct mode (see LayerParallel): the segment input with its graph, which the
        # recorded sweep continues, and the sweep's latest output
        self.u0_graph: Optional[Tensor] = None
        self.direct_out: Optional[Tensor] = None
        # check every block keeps the state's shape (u + h F(u) would broadcast a
        # wrong one silently); done on the first pass for each input shape
        self.check_shapes = False
        # averages gradients over a process grid's replicas (set by LayerParallel)
        self.averager: Optional[Any] = None

    def set_iterations(self, fwd: int, bwd: int) -> None:
        """Forward / adjoint MGRIT iterations from the next pass on (adaptive accuracy)."""
        if fwd != self.fwd_options.max_iter:
            self.fwd_options = self.fwd_options.replace(max_iter=fwd)
            self.fsession.core.set_options(**self.fwd_options.engine_kwargs())
        if bwd != self.bwd_options.max_iter:
            self.bwd_options = self.bwd_options.replace(max_iter=bwd)
            self.bsession.core.set_options(**self.bwd_options.engine_kwargs())

    # -- the propagator -------------------------------------------------------------------
    def phi(self, u: Tensor, a: int, b: int, *, update_stats: bool) -> Tensor:
        """Step from fine point a to b with the block of layer a (or the average)."""
        if b == a + 1 or self.coarsening == "injection":
            f: Callable[[Tensor], Tensor] = self.blocks[a]
        else:
            f = coarse_block([self.blocks[k] for k in range(a, b)], 0, b - a, self.coarsening)
        dt = self.times[b] - self.times[a]
        f = layer_function(f, a, self.seg_index, self.tape.seed, a in self.tape.rng_layers,
                           self.bn.get(a, []), update_stats)
        if self.check_shapes:  # the first pass for each input shape
            unchecked = f

            # buffers a block updates itself (direct mode is serial stepping: allowed)
            bufs = own_buffers(self.blocks[a]) if self.u0_graph is None else []

            def f(v: Tensor) -> Tensor:
                version, before = v._version, buffer_versions(bufs)
                out = unchecked(v)
                if v._version != version:
                    raise ValueError(inplace_message(self.blocks[a], a, self.seg_index))
                if buffer_versions(bufs) != before:
                    raise ValueError(buffer_message(self.blocks[a], a, self.seg_index, bufs,
                                                    before))
                if out.shape != v.shape:
                    raise ValueError(
                        f"layer {a} of segment {self.seg_index} changed the state's shape "
                        f"from {tuple(v.shape)} to {tuple(out.shape)}; a residual block "
                        "must keep it")
                return out
        try:
            return self.scheme.step(f, u, dt)
        except RuntimeError as exc:  # torch's words for it, when the input is a leaf
            if "in-place operation" in str(exc):
                raise ValueError(inplace_message(self.blocks[a], a, self.seg_index)) \
                    from exc
            raise

    # -- which cycle: vectorised or per-step -------------------------------------------
    def use_path(self, like: Tensor) -> Optional[BatchedBlocks]:
        """The vectorised steps for this input, or None for the per-step path.

        At the first pass for an input shape the vectorised evaluation is checked
        against the blocks' own forward (`BatchedBlocks.probe`); with ``batched="auto"``
        both paths are then timed (`choose_path`), since vectorising is not always
        faster (under vmap a convolution becomes a grouped convolution, which runs
        slower than ordinary ones on a CPU).  Collective then: every rank gets here at
        the same pass (input shapes are agreed) and takes the same decision.
        """
        key = (tuple(like.shape), like.dtype, like.device)
        got = self.paths.get(key)
        if got is None:
            bb = self.vectorised
            if bb is not None:
                why = bb.probe(like)
                if why is not None:
                    warn_once(bb.proto, why)
                    self.vectorised = None
            got = self.choose_path(like) if self.measure else \
                PathChoice(self.vectorised is not None, None, None)
            self.paths[key] = got
        return self.vectorised if got.batched else None

    def choose_path(self, like: Tensor, repeats: int = 3) -> PathChoice:
        """Time one fine-level batch of this rank's steps, each step with its
        vector-Jacobian product (input and parameters, as the final sweeps need),
        vectorised and one by one; the faster path (summed over ranks) wins."""
        bb = self.vectorised
        k = max(1, len(self.owned) // self.fwd_options.cfactor_at(0))
        layers = tuple(self.owned[:k])
        pairs = tuple((a, a + 1) for a in layers)
        g = torch.Generator(device=like.device).manual_seed(4321)
        x = torch.randn((k, *like.shape), generator=g, dtype=like.dtype, device=like.device)

        trainable = set() if bb is None else self.trainable_names(layers, bb)

        def vectorised() -> None:
            with torch.enable_grad():
                stacked, _ = bb.stacked(layers)
                leaves = {n: t.detach().requires_grad_(n in trainable)
                          for n, t in stacked.items()}
                xin = x.detach().requires_grad_()
                y = bb.step(xin, pairs, params=leaves)
                torch.autograd.grad(y, [xin, *(t for t in leaves.values()
                                               if t.requires_grad)], x)
            bb.new_pass()

        def per_step() -> None:
            with torch.enable_grad():
                for r, a in enumerate(layers):
                    xin = x[r].detach().requires_grad_()
                    y = self.phi(xin, a, a + 1, update_stats=False)
                    torch.autograd.grad(y, [xin, *self.layer_params[a]], x[r])

        # a rank whose blocks cannot be vectorised votes for per-step cycles
        mine = (math.inf, 0.0) if bb is None else (best_seconds(vectorised, like.device, repeats),
                                                   best_seconds(per_step, like.device, repeats))
        got = [mine] if self.transport.size == 1 else self.transport.allgather_object(
            mine, "the timing of vectorised and per-step cycles")
        t_vec, t_seq = sum(t for t, _ in got), sum(t for _, t in got)
        choice = PathChoice(t_vec <= t_seq, t_vec, t_seq)
        _log.info("layerpar: segment %d, input %s: %s (vectorised %.3g ms, per-step "
                  "%.3g ms for %d steps with their VJPs, summed over %d rank(s))",
                  self.seg_index, tuple(like.shape),
                  "vectorised cycles" if choice.batched else "per-step cycles",
                  1e3 * t_vec, 1e3 * t_seq, k, len(got))
        return choice

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
        rec = self.tape.coarse_graphs.get((a, b))
        if rec is None:
            with torch.enable_grad():
                if self.bb is None:
                    u_a = self.tape.records[a][0].detach().requires_grad_()
                else:  # a row of a detached record input: a leaf already
                    rid, row = self.tape.where[a]
                    rec_a = self.tape.brecords[rid]
                    if rec_a.rows is None:  # one unbind per record, not a select per row
                        self.forward_state(a)
                        rec_a.rows = rec_a.xd.unbind(0)  # type: ignore[union-attr]
                    u_a = rec_a.rows[row].requires_grad_()
                rec = (u_a, self.phi(u_a, a, b, update_stats=False))
            self.tape.coarse_graphs[(a, b)] = rec
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
            # the stacked copies are this pass's own (made under no_grad, never used by
            # another record: each layer's final step is recorded once): leaves as they are
            leaves = {n: t.requires_grad_(n in trainable) for n, t in stacked.items()}
            y = bb.step(xin, pairs, params=leaves)
        rid = len(self.tape.brecords)
        self.tape.brecords.append(BatchRecord(xin, leaves, y, layers))
        for k, a in enumerate(layers):
            self.tape.where[a] = (rid, k)
        return y.detach()

    def trainable_names(self, layers: tuple[int, ...],
                        bb: Optional[BatchedBlocks] = None) -> set[str]:
        """Parameter names that require grad in at least one of these (owned) layers."""
        bb = self.bb if bb is None else bb
        assert bb is not None
        names = bb.param_names
        out: set[str] = set()
        for a in layers:
            for name, p in zip(names, bb._tensors[a][0]):
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
            rid, row = self.tape.where[a]
            ks, rows = groups.setdefault(rid, ([], []))
            ks.append(k)
            rows.append(row)
        out: Optional[Tensor] = None
        for rid, (ks, rows) in groups.items():
            rec = self.tape.brecords[rid]
            n_rec = rec.y.shape[0]
            whole = len(groups) == 1 and len(rows) == n_rec
            if whole and rows == list(range(n_rec)):
                cot = lam  # the whole record in its own order: no index work
            elif whole and rows == list(range(n_rec - 1, -1, -1)):
                cot = lam.flip(0)  # the whole record in reverse (the adjoint's order)
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
            if final:
                if rec.final_rows >= n_rec and self.averager is not None:
                    raise RuntimeError("internal: a step of the final adjoint sweep ran "
                                       "twice after its gradients were sent for averaging")
                rec.final_rows += len(rows)
                if rec.final_rows == n_rec and self.averager is not None:
                    # each step of the final sweep runs once: this record's gradients
                    # are complete, so their average over the replicas can start now
                    self.averager.add(rec.grads.values())
            if cot is lam:
                return dx
            if whole and rows[0] == n_rec - 1:
                return dx.flip(0)
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
        rec = self.tape.coarse_graphs.get(pairs)  # type: ignore[call-overload]
        if rec is None:
            states = [self.forward_state(a) for a, _ in pairs]
            with torch.enable_grad():
                x = stack_rows(states).detach().requires_grad_()
                rec = (x, self.bb.step(x, pairs))  # type: ignore[union-attr]
            self.tape.coarse_graphs[pairs] = rec  # type: ignore[index]
        (dx,) = torch.autograd.grad(rec[1], rec[0], lam, retain_graph=True)
        return dx

    def forward_state(self, a: int) -> Row:
        """u_a, the input of layer a in the final forward sweep (batched records)."""
        rid, row = self.tape.where[a]
        rec = self.tape.brecords[rid]
        if rec.xd is None:
            rec.xd = rec.x.detach()
        return Row(rec.xd, row)

    def collect_batched_grads(self) -> dict[int, tuple]:
        """Per owned layer, its parameter gradients (rows of one tensor per parameter
        name: no copy per layer), from the records of the final adjoint sweep."""
        bb = self.bb
        assert bb is not None
        recs = [r for r in self.tape.brecords if r.grads]
        if not recs:
            return {}
        layers = [a for r in recs for a in r.layers]
        names = bb.param_names
        rows: dict[str, list[Tensor]] = {}
        if self.averager is not None:
            self.averager.add(g for r in recs for g in r.grads.values())  # not yet added
            for name in names:
                # each record's rows as views, not concatenated: the average over the
                # replicas, done in place on the records' tensors later, reaches them
                rows[name] = [row for r in recs for row in
                              (r.grads[name] if name in r.grads
                               else torch.zeros_like(r.params[name])).unbind(0)]
        for name in names if self.averager is None else ():
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
            head = self.tape.chain_head[a]
            layers = range(head, a + 1)
            params = [p for k in layers for p in self.layer_params[k]]
            records = self.tape.records
            grads = torch.autograd.grad(records[a][1], [records[head][0], *params], lam,
                                        allow_unused=True)
            self.chain_cache = dict.fromkeys(layers, self.lam_zero)
            self.chain_cache[head] = grads[0]
            off = 1
            for k in layers:
                n_p = len(self.layer_params[k])
                self.tape.param_grads[k] = grads[off:off + n_p]
                off += n_p
            res = self.chain_cache.pop(a)
        self.last_lam = res
        return res

    # -- per batch ----------------------------------------------------------------------------
    def forward(self, u0: Optional[Tensor], like: Tensor, seed: Optional[int],
                record: bool, training: bool, direct: bool = False,
                check_shapes: bool = False) -> tuple[Optional[Tensor], MGRITResult, Tape]:
        """MGRIT forward solve; returns (u_N on the last rank else None, stats, the
        pass's tape, which its backward needs: the caller keeps it with the pass).

        direct: one rank, sequential solve: record the steps onto u0's own graph and
        return u_N with its graph (PyTorch's engine then runs the backward)."""
        self.ghosts.set_training(training)
        if record and not direct:
            self.refresh_trainable()
        self.tape = tape = Tape(record, seed, frozenset(
            k for k, blk in self.blocks.items() if seed is not None and needs_rng(blk)))
        self.u0 = u0 if u0 is not None else like
        self.zero = torch.zeros_like(like)
        self.transport.set_template(like)
        self.bb = self.use_path(like)
        if self.bb is not None:
            self.bb.new_pass()
        if direct:
            assert u0 is not None
            self.u0_graph, self.u0 = u0, u0.detach()
        self.check_shapes = check_shapes
        tape.bb = self.bb  # as recorded: the backward steps through the same path
        tape.layer_params = self.layer_params
        try:
            stats = self.fsession.drive(lazy_history=not self.check_finite)
        finally:
            self.u0_graph = None
            self.check_shapes = False
            self.tape = Tape()  # the pass's tape lives with the pass, not here
        last = self.transport.size - 1
        out = as_tensor(self.fsession.state(self.n)) if self.transport.rank == last else None
        if direct:
            out, self.direct_out = self.direct_out, None
        return out, stats, tape

    def backward(self, lam_n: Optional[Tensor], like: Tensor, tape: Tape
                 ) -> tuple[Optional[Tensor], MGRITResult, dict[int, Tensor]]:
        """Adjoint MGRIT solve of the pass that recorded `tape`; returns (lambda_0 on
        rank 0 else None, stats, id(parameter) -> gradient of this rank's layers).
        The tape's records are consumed."""
        self.lam_n = lam_n if lam_n is not None else like
        self.lam_zero = torch.zeros_like(like)
        self.rtransport.set_template(like)
        current = self.bb, self.layer_params
        self.bb, self.layer_params, self.tape = tape.bb, tape.layer_params, tape
        try:
            stats = self.bsession.drive(lazy_history=not self.check_finite)
            out = as_tensor(self.bsession.state(self.n)) if self.transport.rank == 0 \
                else None
            grads: dict[int, Tensor] = {}
            if self.bb is not None:
                for pairs in self.collect_batched_grads().values():
                    for p, gp in pairs:
                        grads[id(p)] = gp
            else:
                if self.averager is not None:
                    self.averager.add(g for k in sorted(tape.param_grads)
                                      for g in tape.param_grads[k])
                for k, pg in tape.param_grads.items():
                    for p, gp in zip(self.layer_params[k], pg):
                        if gp is not None:
                            grads[id(p)] = gp
        finally:
            (self.bb, self.layer_params), self.tape = current, Tape()
            self.chain_cache = {}
            self.last_lam = None
            tape.__init__()  # consumed: drop the records and their graphs
        return out, stats, grads
