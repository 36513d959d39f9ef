"""Engine callbacks of a segment's forward solve on this rank (the forward app).

Steps go through the segment runner: one vectorised step per batch of independent
intervals when the segment is batched, else one block call per step.  The final
sweep records what the adjoint needs (per batch, or per layer as chains that share
one graph); in direct mode it records onto the input's own graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .batched import StateOps, as_tensor, as_tensors, stack_rows, unstack_rows
from .direct import direct_sweep

if TYPE_CHECKING:
    from .runner import SegmentRunner

__all__ = ["ForwardApp"]


class ForwardApp(StateOps):
    """Engine callbacks of a segment's forward solve on this rank."""

    def __init__(self, runner: SegmentRunner) -> None:
        self.r = runner
        # the session's list of this solve's local residual norms (device scalars),
        # when norms are deferred; None otherwise
        self.deferred: Optional[list[Tensor]] = None

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
        if final and r.tape.recording:
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
            return direct_sweep(r, [a], [b])[0]
        if r.bb is not None:
            if final and r.tape.recording:  # recorded as a batch of one
                return self.step_batch([u], None if f is None else [f], [ts], [te], [a], [b],
                                       level, final)[0]
            u, f = as_tensor(u), None if f is None else as_tensor(f)
        if final and r.tape.recording:
            prev = r.tape.records.get(a - 1)
            with torch.enable_grad():
                if prev is not None and u is prev[2]:
                    u_in = prev[1]  # continue the previous step's graph (a chain)
                    r.tape.chain_head[a] = r.tape.chain_head[a - 1]
                else:
                    u_in = u.detach().requires_grad_()
                    r.tape.chain_head[a] = a
                out = r.phi(u_in, a, b, update_stats=True)
            det = out.detach()
            r.tape.records[a] = (u_in, out, det)
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
            return direct_sweep(r, as_, bs)
        outs = []
        if not (final and r.tape.recording and fs is None and level == 0):
            if r.bb is not None:
                fs = as_tensors(fs, r.zero)
            for k in range(len(ts)):
                u = self.step(u, None if fs is None else fs[k], ts[k], te[k], as_[k], bs[k],
                              level, final)
                outs.append(u)
            return outs
        prev = r.tape.records.get(as_[0] - 1)
        with torch.enable_grad():
            if prev is not None and u is prev[2]:
                x, head = prev[1], r.tape.chain_head[as_[0] - 1]
            else:
                x, head = u.detach().requires_grad_(), as_[0]
            for a, b in zip(as_, bs):
                x_in = x
                x = r.phi(x_in, a, b, update_stats=True)
                det = x.detach()
                r.tape.records[a] = (x_in, x, det)
                r.tape.chain_head[a] = head
                outs.append(det)
        return outs

    def init(self, t: float, i: int) -> Tensor:
        return self.r.u0 if i == 0 else self.r.zero


