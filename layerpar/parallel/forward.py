"""Engine callbacks of a segment's forward solve on this rank (the forward app).

Steps go through the segment's one propagator (`SegmentRunner.phi`): one vectorised
step per batch of independent intervals when the pass is batched, else one block call
per step.  The final sweep records what the adjoint needs onto the pass's tape (per
batch, or per layer as chains that share one graph).  The app holds the state of the
pass it runs (`begin` ... `end`), nothing between passes.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .batched import BatchedBlocks, StateOps, as_tensor, as_tensors, stack_rows, unstack_rows
from .tape import BatchRecord, Tape

#: a `layerpar.parallel.runner.SegmentRunner`: not imported, as the runner imports this module
_Runner = Any

__all__ = ["ForwardApp"]


class ForwardApp(StateOps):
    """Engine callbacks of a segment's forward solve on this rank."""

    def __init__(self, runner: _Runner) -> None:
        self.r = runner
        # the session's list of this solve's local residual norms (device scalars),
        # when norms are deferred; None otherwise
        self.deferred: Optional[list[Tensor]] = None
        # the pass being solved (`begin` ... `end`)
        self.tape: Tape
        self.bb: Optional[BatchedBlocks]
        self.check_shapes: bool
        self.u0: Optional[Tensor]
        self.zero: Optional[Tensor]
        self.end()

    # -- the pass ------------------------------------------------------------------------
    def begin(self, tape: Tape, u0: Tensor, like: Tensor, bb: Optional[BatchedBlocks],
              check_shapes: bool) -> None:
        """Start a pass: its tape, initial state, vectorised steps (None: per-step) and
        whether the blocks' shapes and buffers are checked (the first pass for an
        input shape)."""
        self.tape, self.u0, self.bb, self.check_shapes = tape, u0, bb, check_shapes
        self.zero = torch.zeros_like(like)

    def end(self) -> None:
        """Forget the pass (its tape lives with the pass, not here)."""
        self.tape = Tape()
        self.bb = None
        self.check_shapes = False
        self.u0 = None
        self.zero = None

    def phi(self, u: Tensor, a: int, b: int, update_stats: bool) -> Tensor:
        return self.r.phi(u, a, b, self.tape, update_stats=update_stats,
                          check=self.check_shapes)

    # -- the engine's callbacks -------------------------------------------------------------
    def step_batch(self, us: list, fs: Optional[list], ts: list, te: list, as_: list,
                   bs: list, level: int, final: int) -> list:
        """Independent steps at once: one vectorised step over the stacked states when
        the pass is batched (see batched.py), else one by one."""
        bb = self.bb
        if bb is None:
            return [self.step(u, None if fs is None else fs[k], ts[k], te[k], as_[k], bs[k],
                              level, final) for k, u in enumerate(us)]
        pairs = tuple(zip(as_, bs))
        x = stack_rows(us)
        if final and self.tape.recording:
            y = self.record_batch(x, pairs)
        else:
            y = bb.step(x, pairs)
        if fs is not None:
            y = y + stack_rows([self.zero if g is None else g for g in fs])
        return unstack_rows(y)

    def step(self, u: Tensor, f: Optional[Tensor], ts: float, te: float, a: int, b: int,
             level: int, final: int) -> Tensor:
        tape = self.tape
        if self.bb is not None:
            if final and tape.recording:  # recorded as a batch of one
                return self.step_batch([u], None if f is None else [f], [ts], [te], [a], [b],
                                       level, final)[0]
            u, f = as_tensor(u), None if f is None else as_tensor(f)
        if final and tape.recording:
            prev = tape.records.get(a - 1)
            with torch.enable_grad():
                if prev is not None and u is prev[2] and not self.r.shares:
                    u_in = prev[1]  # continue the previous step's graph (a chain)
                    tape.chain_head[a] = tape.chain_head[a - 1]
                else:
                    u_in = u.detach().requires_grad_()
                    tape.chain_head[a] = a
                out = self.phi(u_in, a, b, True)
            det = out.detach()
            tape.records[a] = (u_in, out, det)
            return det if f is None else torch.add(det, f)
        out = self.phi(u, a, b, bool(final))
        return out if f is None else torch.add(out, f)

    def step_seq(self, u: Tensor, fs: Optional[list], ts: list, te: list, as_: list,
                 bs: list, level: int, final: int) -> list:
        """A rank's stretch of a sequential solve in one call; when it is the final
        (recorded) sweep, the stretch is recorded as one graph, like plain PyTorch."""
        tape = self.tape
        outs = []
        if not (final and tape.recording and fs is None and level == 0):
            if self.bb is not None:
                if self.zero is None:
                    raise RuntimeError("internal: a forward step outside a pass (`begin`)")
                fs = as_tensors(fs, self.zero)
            for k in range(len(ts)):
                u = self.step(u, None if fs is None else fs[k], ts[k], te[k], as_[k], bs[k],
                              level, final)
                outs.append(u)
            return outs
        prev = tape.records.get(as_[0] - 1)
        with torch.enable_grad():
            shares = self.r.shares  # (then each step its own graph: see the runner)
            if prev is not None and u is prev[2] and not shares:
                x, head = prev[1], tape.chain_head[as_[0] - 1]
            else:
                x, head = u.detach().requires_grad_(), as_[0]
            for a, b in zip(as_, bs):
                if shares and a != as_[0]:
                    x, head = x.detach().requires_grad_(), a
                x_in = x
                x = self.phi(x_in, a, b, True)
                det = x.detach()
                tape.records[a] = (x_in, x, det)
                tape.chain_head[a] = head
                outs.append(det)
        return outs

    def init(self, t: float, i: int) -> Tensor:
        got = self.u0 if i == 0 else self.zero
        if got is None:
            raise RuntimeError("internal: the forward solve's initial states outside a "
                               "pass (`begin`)")
        return got

    # -- batched records (bb is not None) ---------------------------------------------------
    def record_batch(self, x: Tensor, pairs: tuple[tuple[int, int], ...]) -> Tensor:
        """A final forward step of several layers, recorded with its graph: the input
        and the stacked parameters are leaves, so the adjoint gets the stacked parameter
        gradients in one autograd call.  Returns the detached output."""
        bb = self.bb
        if bb is None:
            raise RuntimeError("the batched forward has no batched blocks (no batched path)")
        tape = self.tape
        layers = tuple(a for a, _ in pairs)
        with torch.enable_grad():
            xin = x.detach().requires_grad_()
            stacked, _ = bb.stacked(layers)
            trainable = self.r.trainable_names(layers, bb)
            # the stacked copies are this pass's own (made under no_grad, never used by
            # another record: each layer's final step is recorded once): leaves as they are
            leaves = {n: t.requires_grad_(n in trainable) for n, t in stacked.items()}
            y = bb.step(xin, pairs, params=leaves)
        rid = len(tape.brecords)
        tape.brecords.append(BatchRecord(xin, leaves, y, pairs))
        for k, a in enumerate(layers):
            tape.where[a] = (rid, k)
        return y.detach()
