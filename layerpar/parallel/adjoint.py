"""Engine callbacks of a segment's adjoint solve on this rank (the adjoint app).

The adjoint runs in reverse time: reverse point m holds lambda_{N-m}.  Fine steps
apply transposed Jacobians through the forward's recorded final sweep (per batch, or
per layer/chain), coarse steps through coarse graphs linearised at the forward
states; the final sweep also yields the parameter gradients.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .batched import StateOps, as_tensor, as_tensors, stack_rows, unstack_rows

if TYPE_CHECKING:
    from .runner import SegmentRunner

__all__ = ["AdjointApp"]


class AdjointApp(StateOps):
    """Engine callbacks of a segment's adjoint solve (reverse time).

    Reverse point m holds lambda_{N-m}.  The reverse step from m_a to m_b applies the
    transposed Jacobian of the forward step from N-m_b to N-m_a (one layer on the fine
    grid, a coarse step on coarse levels), linearised at the forward state u_{N-m_b}.
    """

    def __init__(self, runner: SegmentRunner) -> None:
        self.r = runner
        self.deferred: Optional[list[Tensor]] = None  # see ForwardApp

    def step(self, lam: Tensor, f: Optional[Tensor], ts: float, te: float, ma: int, mb: int,
             level: int, final: int) -> Tensor:
        r = self.r
        n = r.n
        a, b = n - mb, n - ma
        if r.bb is not None:
            if level == 0:  # through the batched records of the final forward sweep
                return self.step_batch([lam], None if f is None else [f], [ts], [te], [ma],
                                       [mb], level, final)[0]
            # a lone coarse step (the sequential coarsest solve): the block itself costs
            # fewer operations than a one-row vectorised step
            lam, f = as_tensor(lam), None if f is None else as_tensor(f)
        if level == 0:
            u_in, out, _ = r.tape.records[a]
            if final and r.sequential_adjoint:
                res = r.chain_vjp(a, lam)
            elif final:
                params = r.layer_params[a]
                grads = torch.autograd.grad(out, [u_in, *params], lam, allow_unused=True)
                r.tape.param_grads[a] = grads[1:]
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
            heads = {r.tape.chain_head[a] for a, _ in pairs}
            one_by_one = len(heads) < len(pairs)
        if one_by_one:
            return [self.step(lam, None if fs is None else fs[k], ts[k], te[k], mas[k], mbs[k],
                              level, final) for k, lam in enumerate(lams)]
        recs = [r.tape.records[a][:2] if level == 0 else r.coarse_graph(a, b) for a, b in pairs]
        with_params = bool(final) and level == 0
        params = [p for a, _ in pairs for p in r.layer_params[a]] if with_params else []
        grads = torch.autograd.grad([o for _, o in recs], [u for u, _ in recs] + params, lams,
                                    retain_graph=not with_params, allow_unused=True)
        outs = list(grads[:len(recs)])
        if with_params:
            off = len(recs)
            for a, _ in pairs:
                k = len(r.layer_params[a])
                r.tape.param_grads[a] = grads[off:off + k]
                off += k
        if fs is not None:
            outs = [o if g is None else torch.add(o, g) for o, g in zip(outs, fs)]
        return outs

    def step_seq(self, lam: Tensor, fs: Optional[list], ts: list, te: list, mas: list,
                 mbs: list, level: int, final: int) -> list:
        """A rank's stretch of a sequential adjoint solve in one call."""
        if self.r.bb is not None:
            fs = as_tensors(fs, self.r.lam_zero)
        outs = []
        for k in range(len(ts)):
            lam = self.step(lam, None if fs is None else fs[k], ts[k], te[k], mas[k], mbs[k],
                            level, final)
            outs.append(lam)
        return outs

    def init(self, t: float, i: int) -> Tensor:
        return self.r.lam_n if i == 0 else self.r.lam_zero


