"""Engine callbacks of a segment's adjoint solve on this rank (the adjoint app).

The adjoint runs in reverse time: reverse point m holds lambda_{N-m}.  Fine steps
apply transposed Jacobians (`layerpar.ode.propagator.vjp`) through the forward's
recorded final sweep (per batch, or per layer/chain), coarse steps through coarse
graphs of the one propagator linearised at the forward states; the final sweep also
yields the parameter gradients.  The app holds the state of the pass it
differentiates (`begin` ... `end`), nothing between passes.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import chain, compress
from operator import attrgetter, itemgetter
from typing import Any, Optional

import torch
from torch import Tensor

from ..ode.propagator import vjp
from .batched import (
    BatchedBlocks,
    Row,
    StateOps,
    as_tensor,
    as_tensors,
    stack_rows,
    unstack_rows,
)
from .sharing import add
from .tape import Tape

#: a `layerpar.parallel.runner.SegmentRunner`: not imported, as the runner imports this module
_Runner = Any

__all__ = ["AdjointApp"]


#: an adjoint sweep touching at most this share of a record's rows steps those rows again
#: (`AdjointApp._rows_vjp`) instead of back-propagating through the whole record
RESTEP_SHARE = 0.5
#: ... of a record of at least this many rows: a smaller one costs its operations' launch,
#: not their arithmetic, and restepping issues more operations (measured: Peaks 32 x 8 at
#: 2 ranks, records of 2-4 rows, 5-20 % slower; 1,024 x 32, records of 64 rows, 8 % faster)
RESTEP_MIN_ROWS = 8

_REQUIRES_GRAD = attrgetter("requires_grad")
_SECOND = itemgetter(1)


def _capturing(t: Tensor) -> bool:
    """A CUDA graph is being captured (`capture.py`): its gradients are its own static
    buffers, so the rows of eager passes are neither kept nor reused then."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _reversed_rows(states: list) -> Optional[Tensor]:
    """The tensor whose rows, last to first, are exactly `states` (`Row` handles), or
    None."""
    n = len(states)
    first = states[0]
    if type(first) is Row and first.k == n - 1 and first.base.shape[0] == n and all(
            type(h) is Row and h.base is first.base and h.k == n - 1 - i
            for i, h in enumerate(states)):
        return first.base
    return None


def _state_grad(g: Optional[Tensor]) -> Tensor:
    """A step's gradient with respect to its input state, as `vjp` gives it: a step's
    output is its input plus an update, so autograd always finds one."""
    if g is None:
        raise RuntimeError("internal: an adjoint step gave no gradient for its input state")
    return g


def _first_uses(params: list[Tensor], grads: tuple[Optional[Tensor], ...],
                seen: set[int]) -> tuple[Optional[Tensor], ...]:
    """`grads` of `params` with None for a parameter already in `seen` (the ids of
    parameters whose gradient was kept); `seen` gains the others."""
    out = []
    for p, g in zip(params, grads):
        if id(p) in seen:
            g = None
        elif g is not None:
            seen.add(id(p))
        out.append(g)
    return tuple(out)


class _Rows:
    """A pass's gradients of one parameter name, kept by `AdjointApp._keep_rows`:
    `base` [layers, ...] (a row per layer, in `layers` order), the layers' tensors and
    their trainable flags then, and the (id(parameter), row) pairs handed over."""

    __slots__ = ("base", "layers", "params", "flags", "pairs")

    def __init__(self, base: Tensor, layers: tuple[int, ...], params: list[Tensor],
                 flags: list[bool], pairs: list[tuple[int, Tensor]]) -> None:
        self.base, self.layers, self.params = base, layers, params
        self.flags, self.pairs = flags, pairs


class AdjointApp(StateOps):
    """Engine callbacks of a segment's adjoint solve (reverse time).

    Reverse point m holds lambda_{N-m}.  The reverse step from m_a to m_b applies the
    transposed Jacobian of the forward step from N-m_b to N-m_a (one layer on the fine
    grid, a coarse step on coarse levels), linearised at the forward state u_{N-m_b}.
    """

    def __init__(self, runner: _Runner, sequential: bool) -> None:
        self.r = runner
        self.sequential = sequential  # the adjoint solve has one level (chain_vjp)
        self.deferred: Optional[list[Tensor]] = None  # see ForwardApp
        # averages gradients over a process grid's replicas (set by LayerParallel)
        self.averager: Optional[Any] = None
        self.index_cache: dict[tuple, Tensor] = {}
        self.move_cache: dict[tuple, tuple] = {}  # see `_plan`
        self.row_cache: dict[int, _Rows] = {}  # see `_rows_reused`
        # (off: every pass makes new rows, as before; benchmarks; and where a parameter
        # serves several layers, whose rows are summed, not kept)
        self.reuse_rows = not runner.shares
        # the pass being differentiated (`begin` ... `end`)
        self.tape: Tape
        self.bb: Optional[BatchedBlocks]
        self.layer_params: dict[int, list[Tensor]]
        self.lam_n: Optional[Tensor]
        self.lam_zero: Optional[Tensor]
        # the sequential adjoint's final sweep: one autograd call per chain (chain_vjp)
        self.chain_cache: dict[int, Tensor]
        self.last_lam: Optional[Tensor]
        self.end()

    # -- the pass ------------------------------------------------------------------------
    def begin(self, tape: Tape, lam_n: Tensor, like: Tensor) -> None:
        """Start differentiating the pass that recorded `tape` (its vectorised steps and
        the parameters that required grad then come with it)."""
        self.tape, self.bb, self.layer_params = tape, tape.bb, tape.layer_params
        self.lam_n, self.lam_zero = lam_n, torch.zeros_like(like)

    def end(self) -> None:
        self.tape = Tape()
        self.bb = None
        self.layer_params = {}
        self.lam_n = None
        self.lam_zero = None
        self.chain_cache = {}
        self.last_lam = None

    # -- the engine's callbacks -------------------------------------------------------------
    def step(self, lam: Tensor, f: Optional[Tensor], ts: float, te: float, ma: int, mb: int,
             level: int, final: int) -> Tensor:
        r = self.r
        n = r.n
        a, b = n - mb, n - ma
        if self.bb is not None:
            if level == 0:  # through the batched records of the final forward sweep
                return self.step_batch([lam], None if f is None else [f], [ts], [te], [ma],
                                       [mb], level, final)[0]
            # a lone coarse step (the sequential coarsest solve): the block itself costs
            # fewer operations than a one-row vectorised step
            lam, f = as_tensor(lam), None if f is None else as_tensor(f)
        if level == 0:
            u_in, out, _ = self.tape.records[a]
            if final and self.sequential:
                res = self.chain_vjp(a, lam)
            elif final:
                grads = vjp(out, [u_in, *self.layer_params[a]], lam)
                self.tape.param_grads[a] = grads[1:]
                res = _state_grad(grads[0])
            else:
                res = _state_grad(vjp(out, [u_in], lam, retain_graph=True)[0])
        else:
            rec = self.coarse_graph(a, b)
            res = _state_grad(vjp(rec[1], [rec[0]], lam, retain_graph=True)[0])
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
        if self.bb is not None:
            res, rev = self.fine_batch(lams, pairs, final) if level == 0 else \
                self.coarse_batch(lams, pairs)
            if fs is not None:
                res = res + stack_rows([self.lam_zero if g is None else g
                                        for g in (fs[::-1] if rev else fs)])
            if rev:  # row k of the result is step len - 1 - k's: handed over as such
                last = res.shape[0] - 1
                return [Row(res, last - k) for k in range(last + 1)]
            return unstack_rows(res)
        one_by_one = final and self.sequential
        if level == 0 and not one_by_one:
            heads = {self.tape.chain_head[a] for a, _ in pairs}
            one_by_one = len(heads) < len(pairs)
        if one_by_one:
            return [self.step(lam, None if fs is None else fs[k], ts[k], te[k], mas[k], mbs[k],
                              level, final) for k, lam in enumerate(lams)]
        recs = [self.tape.records[a][:2] if level == 0 else self.coarse_graph(a, b)
                for a, b in pairs]
        with_params = bool(final) and level == 0
        params = [p for a, _ in pairs for p in self.layer_params[a]] if with_params else []
        grads = vjp([o for _, o in recs], [u for u, _ in recs] + params, lams,
                    retain_graph=not with_params)
        outs = [_state_grad(g) for g in grads[:len(recs)]]
        if with_params:
            off = len(recs)
            # a parameter several of these layers share: autograd gave each of its
            # places the sum over all of them; kept at its first place only
            seen: Optional[set[int]] = set() if self.r.shares else None
            for a, _ in pairs:
                k = len(self.layer_params[a])
                got = grads[off:off + k]
                if seen is not None:
                    got = _first_uses(self.layer_params[a], got, seen)
                self.tape.param_grads[a] = got
                off += k
        if fs is not None:
            outs = [o if g is None else torch.add(o, g) for o, g in zip(outs, fs)]
        return outs

    def step_seq(self, lam: Tensor, fs: Optional[list], ts: list, te: list, mas: list,
                 mbs: list, level: int, final: int) -> list:
        """A rank's stretch of a sequential adjoint solve in one call."""
        if self.bb is not None:
            if self.lam_zero is None:
                raise RuntimeError("internal: an adjoint step outside a pass (`begin`)")
            fs = as_tensors(fs, self.lam_zero)
        outs = []
        for k in range(len(ts)):
            lam = self.step(lam, None if fs is None else fs[k], ts[k], te[k], mas[k], mbs[k],
                            level, final)
            outs.append(lam)
        return outs

    def init(self, t: float, i: int) -> Tensor:
        got = self.lam_n if i == 0 else self.lam_zero
        if got is None:
            raise RuntimeError("internal: the adjoint solve's initial states outside a "
                               "pass (`begin`)")
        return got

    # -- per-step records -----------------------------------------------------------------
    def coarse_graph(self, a: int, b: int) -> tuple[Tensor, Tensor]:
        """(u_a as a leaf, forward coarse step a -> b with its graph), built once per
        backward pass and reused by every adjoint iteration."""
        tape = self.tape
        rec = tape.coarse_graphs.get((a, b))
        if rec is None:
            with torch.enable_grad():
                if self.bb is None:
                    u_a = tape.records[a][0].detach().requires_grad_()
                else:  # a row of a detached record input: a leaf already
                    rid, row = tape.where[a]
                    rec_a = tape.brecords[rid]
                    if rec_a.rows is None:  # one unbind per record, not a select per row
                        rec_a.rows = self.forward_state(a).base.unbind(0)
                    u_a = rec_a.rows[row].requires_grad_()
                rec = (u_a, self.r.phi(u_a, a, b, tape, update_stats=False))
            tape.coarse_graphs[(a, b)] = rec
        return rec

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
            tape = self.tape
            head = tape.chain_head[a]
            layers = range(head, a + 1)
            params = [p for k in layers for p in self.layer_params[k]]
            zero = self.lam_zero
            if zero is None:
                raise RuntimeError("internal: an adjoint step outside a pass (`begin`)")
            grads = vjp(tape.records[a][1], [tape.records[head][0], *params], lam)
            self.chain_cache = dict.fromkeys(layers, zero)
            self.chain_cache[head] = _state_grad(grads[0])
            off = 1
            for k in layers:
                n_p = len(self.layer_params[k])
                tape.param_grads[k] = grads[off:off + n_p]
                off += n_p
            res = self.chain_cache.pop(a)
        self.last_lam = res
        return res

    # -- batched records (bb is not None) ---------------------------------------------------
    def _index(self, rows: tuple[int, ...], device: torch.device) -> Tensor:
        key = (rows, device)
        got = self.index_cache.get(key)
        if got is None:
            got = self.index_cache[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return got

    def fine_batch(self, lams: list, pairs: list, final: int) -> tuple[Tensor, bool]:
        """`adjoint_fine` of the engine's states `lams` (steps `pairs`): (the result,
        whether its rows are in the reverse order of `pairs`).

        The adjoint visits a record's rows last to first, so its states arrive in the
        reverse of the record's order; flipping each batched step's input to the
        record's order and its result back would copy the whole batch twice (16 copies
        a training step of the 1,024-layer dense net at one rank).  Instead a result in
        the record's order is handed on as reversed `Row`s, and states that are exactly
        one tensor's rows last to first are taken as that tensor, in the record's
        order: along a sweep, nothing is flipped."""
        base = _reversed_rows(lams)
        if base is not None:
            dx, flipped = self.adjoint_fine(base, pairs[::-1], final)
            return dx, not flipped
        return self.adjoint_fine(stack_rows(lams), pairs, final)

    def coarse_batch(self, lams: list, pairs: list) -> tuple[Tensor, bool]:
        """`adjoint_coarse` of the engine's states `lams` (coarse steps `pairs`): (the
        result, whether its rows are in the reverse order of `pairs`).  As on the fine
        level (`fine_batch`), a sweep's steps arrive last layer first: the coarse graph
        is built in the forward order (its forward states are then a strided view of
        the fine record, where the adjoint's order flipped them, once per coarse step
        and pass), and the states are taken in that order: a result handed on as
        reversed `Row`s, so only a sweep's first step flips its input."""
        base = _reversed_rows(lams)
        if base is not None:
            return self.adjoint_coarse(base, tuple(pairs[::-1])), True
        if len(pairs) > 1 and pairs[0][0] > pairs[-1][0]:  # last layer first
            return self.adjoint_coarse(stack_rows(lams).flip(0), tuple(pairs[::-1])), True
        return self.adjoint_coarse(stack_rows(lams), tuple(pairs)), False

    def adjoint_fine(self, lam: Tensor, pairs: list, final: int) -> tuple[Tensor, bool]:
        """Transposed Jacobians of fine steps (layers a of `pairs`) applied to the rows
        of `lam`, through the recorded batches; at the final sweep also the parameter
        gradients (accumulated per record).  One autograd call per record touched.
        Returns (the result, whether its rows are in the reverse order of `lam`'s: a
        whole record visited last to first is returned in the record's order, not
        flipped back)."""
        tape = self.tape
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for k, (a, _) in enumerate(pairs):
            rid, row = tape.where[a]
            ks, rows = groups.setdefault(rid, ([], []))
            ks.append(k)
            rows.append(row)
        out: Optional[Tensor] = None
        for rid, (ks, rows) in groups.items():
            rec = tape.brecords[rid]
            n_rec = rec.y.shape[0]
            whole = len(groups) == 1 and len(rows) == n_rec
            if n_rec >= RESTEP_MIN_ROWS and len(rows) <= RESTEP_SHARE * n_rec:  # _rows_vjp
                if out is None:
                    out = torch.empty_like(lam)
                ks_at = self._index(tuple(ks), lam.device)
                out.index_copy_(0, ks_at, self._rows_vjp(rec, rows, lam.index_select(
                    0, ks_at), final))
                continue
            if whole and rows == list(range(n_rec)):
                cot = lam  # the whole record in its own order: no index work
            elif whole and rows == list(range(n_rec - 1, -1, -1)):
                cot = lam.flip(0)  # the whole record in reverse (the adjoint's order)
            else:
                cot = self._gather(lam, ks, rows, rec.y.shape)
            wrt = [rec.x]
            names = [n for n, t in rec.params.items() if t.requires_grad] if final else []
            wrt += [rec.params[n] for n in names]
            got = vjp(rec.y, wrt, cot, retain_graph=True)
            dx = _state_grad(got[0])
            for name, g in zip(names, got[1:]):
                if g is None:  # a parameter the blocks never read: none, as in serial
                    continue
                prev = rec.grads.get(name)
                g = g if prev is None else prev + g
                if self.averager is not None:
                    # row-major, the parameters' layout: under data parallelism the
                    # rows themselves become `.grad`s (not a concatenated copy), and
                    # torch's fused CPU Adam reads a non-contiguous gradient wrongly
                    # (test_grid: one replica against two, with fused Adam)
                    g = g.contiguous()
                rec.grads[name] = g
            if final:
                self._final_rows(rec, len(rows))
            if cot is lam:
                return dx, False
            if whole and rows[0] == n_rec - 1:
                return dx, True
            if out is None:
                out = torch.empty_like(lam)
            self._scatter(out, ks, dx, rows)
        if out is None:
            raise RuntimeError("the adjoint pass produced no output")
        return out, False

    def _plan(self, to: list[int], frm: list[int], device: torch.device
              ) -> tuple[Optional[tuple[int, int]], Tensor, Tensor]:
        """How to move rows frm[i] of one tensor to rows to[i] of another: (the span
        (lo, hi) where `to` holds each of lo..hi-1 once, else None; with a span, the
        `frm` rows in `to` order, else the `to` rows; the `frm` rows), cached (the
        same moves recur every pass)."""
        key = (tuple(to), tuple(frm), device)
        got = self.move_cache.get(key)
        if got is None:
            lo, hi = min(to), max(to) + 1
            if hi - lo == len(to) == len(set(to)):
                order = sorted(range(len(to)), key=to.__getitem__)
                got = ((lo, hi), self._index(tuple(frm[i] for i in order), device),
                       self._index(key[1], device))
            else:
                got = (None, self._index(key[0], device), self._index(key[1], device))
            self.move_cache[key] = got
        return got

    def _gather(self, lam: Tensor, ks: list[int], rows: list[int],
                shape: torch.Size) -> Tensor:
        """A record's cotangent: row rows[i] is lam[ks[i]], the others zero.  Where the
        rows are one span (the steps next to a rank boundary leave out one row of a
        record), they are read straight into it and only the other rows are zeroed:
        one pass over the rows instead of a zeroed record, a gathered copy and its
        scatter."""
        span, at, frm = self._plan(rows, ks, lam.device)
        if span is None:
            cot = lam.new_zeros(shape)
            cot.index_copy_(0, at, lam.index_select(0, frm))
            return cot
        lo, hi = span
        cot = lam.new_empty(shape)
        torch.index_select(lam, 0, at, out=cot[lo:hi])
        cot[:lo].zero_()
        cot[hi:].zero_()
        return cot

    def _scatter(self, out: Tensor, ks: list[int], dx: Tensor, rows: list[int]) -> None:
        """out[ks[i]] = dx[rows[i]]: straight into out's rows where ks are one span."""
        span, at, frm = self._plan(ks, rows, out.device)
        if span is None:
            out.index_copy_(0, at, dx.index_select(0, frm))
            return
        lo, hi = span
        torch.index_select(dx, 0, at, out=out[lo:hi])

    def _final_rows(self, rec: Any, count: int) -> None:
        """The final sweep added `count` rows' parameter gradients to record `rec`;
        once all its rows are in, their average over the replicas can start."""
        n_rec = rec.y.shape[0]
        if rec.final_rows >= n_rec and self.averager is not None:
            raise RuntimeError("internal: a step of the final adjoint sweep ran "
                               "twice after its gradients were sent for averaging")
        rec.final_rows += count
        if rec.final_rows == n_rec and self.averager is not None:
            # each step of the final sweep runs once: this record's gradients
            # are complete, so their average over the replicas can start now
            self.averager.add(rec.grads.values())

    def _rows_vjp(self, rec: Any, rows: list[int], cot: Tensor, final: int) -> Tensor:
        """Transposed Jacobians of a few rows of record `rec` (cot: their cotangents,
        in `rows` order), by stepping just those rows again from the recorded inputs
        and parameters: a VJP through the whole record would cost a full batched step
        for each of them (the rows next to a rank boundary are swept alone, after the
        neighbour's message).  The batched path has no random layers, so the step is
        the recorded one.  At the final sweep the rows' parameter gradients are added
        to the record's."""
        bb = self.bb
        if bb is None:
            raise RuntimeError("internal: a batched adjoint step on the per-step path")
        at = self._index(tuple(rows), cot.device)
        names = [n for n, t in rec.params.items() if t.requires_grad] if final else []
        with torch.enable_grad():
            x = rec.x.detach().index_select(0, at).requires_grad_()
            params = {n: t.detach().index_select(0, at).requires_grad_(n in names)
                      for n, t in rec.params.items()}
            y = bb.step(x, tuple(rec.pairs[r] for r in rows), params=params)
        got = vjp(y, [x, *(params[n] for n in names)], cot)
        for name, g in zip(names, got[1:]):
            if g is None:  # a parameter the blocks never read (see adjoint_fine)
                continue
            acc = rec.grads.get(name)
            if acc is None:
                acc = rec.grads[name] = torch.zeros_like(rec.params[name])
            acc.index_add_(0, at, g)
        if final:
            self._final_rows(rec, len(rows))
        return _state_grad(got[0])

    def adjoint_coarse(self, lam: Tensor, pairs: tuple[tuple[int, int], ...]) -> Tensor:
        """Transposed Jacobians of coarse steps a -> b, linearised at the forward states
        u_a of the final sweep; the batched coarse graph is built once per backward pass
        and reused by every adjoint iteration."""
        rec = self.tape.coarse_graphs.get(pairs)
        if rec is None:
            bb = self.bb
            if bb is None:
                raise RuntimeError("internal: a batched adjoint step on the per-step path")
            states = [self.forward_state(a) for a, _ in pairs]
            with torch.enable_grad():
                x = stack_rows(states).detach().requires_grad_()
                rec = (x, bb.step(x, pairs))
            self.tape.coarse_graphs[pairs] = rec
        return _state_grad(vjp(rec[1], [rec[0]], lam, retain_graph=True)[0])

    def forward_state(self, a: int) -> Row:
        """u_a, the input of layer a in the final forward sweep (batched records)."""
        rid, row = self.tape.where[a]
        rec = self.tape.brecords[rid]
        if rec.xd is None:
            rec.xd = rec.x.detach()
        return Row(rec.xd, row)

    def gradients(self, extra: list[tuple[int, Tensor]]) -> dict[int, Tensor]:
        """id(parameter) -> gradient of this rank's layers, from the final adjoint
        sweep (handed to the replicas' averaging first, where there is one).  A
        parameter several layers share (`SegmentRunner.shares`) gets its first use's
        there, and each further use's (id, gradient) in `extra` (`sharing.add`)."""
        if self.bb is not None:
            return self.batched_grads(extra)
        grads: dict[int, Tensor] = {}
        tape = self.tape
        if self.averager is not None:
            self.averager.add(g for k in sorted(tape.param_grads)
                              for g in tape.param_grads[k])
        if self.r.shares:
            for k, pg in tape.param_grads.items():
                add(grads, extra, ((id(p), gp) for p, gp in zip(self.layer_params[k], pg)
                                   if gp is not None))
            return grads
        for k, pg in tape.param_grads.items():
            for p, gp in zip(self.layer_params[k], pg):
                if gp is not None:
                    grads[id(p)] = gp
        return grads

    def batched_grads(self, extra: list[tuple[int, Tensor]]) -> dict[int, Tensor]:
        """id(parameter) -> gradient of this rank's layers, from the records of the
        final adjoint sweep: rows of stacked gradients, as views (no copy per layer),
        matched to their parameters without a Python step per layer
        (`BatchedBlocks.column`).  Frozen parameters get none; a shared parameter's
        further uses go to `extra` (`gradients`)."""
        bb = self.bb
        if bb is None:
            raise RuntimeError("the batched adjoint has no batched blocks (no batched path)")
        recs = [r for r in self.tape.brecords if r.grads]
        out: dict[int, Tensor] = {}
        if not recs:
            return out
        if self.averager is not None:
            self.averager.add(g for r in recs for g in r.grads.values())  # not yet added
        layers = recs[0].layers if len(recs) == 1 else \
            tuple(a for r in recs for a in r.layers)
        for k, name in enumerate(bb.param_names):
            got_parts = [r.grads.get(name) for r in recs]
            if all(g is None for g in got_parts):
                # a parameter the blocks never read: it gets no gradient, not a zero
                # one, as in serial autograd (an optimizer skips it)
                self.row_cache.pop(k, None)
                continue
            # a record none of whose layers trains this parameter has no gradient of it
            parts = [torch.zeros_like(r.params[name]) if g is None else g
                     for r, g in zip(recs, got_parts)]
            rows: Sequence[Tensor]
            if self.averager is not None:
                # each record's rows as views, not concatenated: the average over the
                # replicas, done in place on the records' tensors later, reaches them
                rows = list(chain.from_iterable(g.unbind(0) for g in parts))
            else:
                # one tensor, row-major like the parameters (a weight's gradient comes
                # out of the batched GEMM transposed): torch's fused CPU Adam reads a
                # non-contiguous gradient wrongly
                got = self._rows_reused(k, layers, parts) if self.reuse_rows else None
                if got is not None:
                    out.update(got)
                    continue
                rows = (torch.cat(parts) if len(parts) > 1
                        else parts[0].contiguous()).unbind(0)
            params = bb.column(k, layers)
            # frozen layers' rows dropped; C-level iteration throughout
            pairs = list(compress(zip(map(id, params), rows), map(_REQUIRES_GRAD, params)))
            if self.r.shares:
                add(out, extra, pairs)
            else:
                out.update(pairs)
            if self.averager is None and self.reuse_rows:
                self._keep_rows(k, layers, rows, params, pairs)
        return out

    def _keep_rows(self, k: int, layers: tuple[int, ...], rows: Sequence[Tensor],
                   params: list[Tensor], pairs: list[tuple[int, Tensor]]) -> None:
        """Keep a pass's gradient rows of parameter `k` (their base tensor and the
        pairs handed over), for the next pass to write its own into them."""
        base = rows[0]._base
        if base is None or len(rows) != base.shape[0] or not pairs or _capturing(base):
            self.row_cache.pop(k, None)
            return
        self.row_cache[k] = _Rows(base, layers, params, list(map(_REQUIRES_GRAD, params)),
                                  pairs)

    def _rows_reused(self, k: int, layers: tuple[int, ...], parts: list[Tensor]
                     ) -> Optional[list[tuple[int, Tensor]]]:
        """This pass's gradients of parameter `k` written into the last pass's rows,
        where nothing but this cache holds them any more (the user zeroed the `.grad`s
        to None, as `zero_grad()` does, and kept no view of them): the (id, row) pairs
        to deliver, without making 2 x 512 row views and pairs anew every pass (about
        1.5 ms of a 75 ms step at 1,024 layers x 32, 2 ranks).  None where
        they cannot be: a row, its base or a view of them held (their values must
        stay), other layers, shapes or trainable flags, another dtype or device."""
        got = self.row_cache.get(k)
        if got is None or got.layers != layers or _capturing(got.base):
            return None
        p0 = parts[0]
        if sum(g.shape[0] for g in parts) != got.base.shape[0] or p0.shape[1:] != \
                got.base.shape[1:] or p0.dtype != got.base.dtype or \
                p0.device != got.base.device:
            return None
        # held: the base's storage by one tensor more than the base and the rows handed
        # over (a view a user made, a `.grad` autograd stole), or a row or the base by
        # a reference more than this cache's (a row's count is 2: the cache's and the
        # call's; the base's 3: torch holds the Python object of a tensor that views
        # still use; tests/test_batched.py pins both)
        if torch._C._storage_Use_Count(got.base.untyped_storage()._cdata) != \
                len(got.pairs) + 2 or sys.getrefcount(got.base) != 3 or \
                any(c != 2 for c in map(sys.getrefcount, map(_SECOND, got.pairs))) or \
                list(map(_REQUIRES_GRAD, got.params)) != got.flags:
            return None
        if len(parts) > 1:
            torch.cat(parts, out=got.base)
        else:
            got.base.copy_(p0)
        return got.pairs
