"""Parameter gradients from the adjoint solve to `.grad`, without one copy per layer.

An autograd Function hands each gradient it returns to the parameter's
AccumulateGrad node, which (with no `.grad` yet) may steal the tensor or clone it,
and which costs operations per parameter either way.  When PyTorch would only
accumulate the gradient into `.grad` (a plain `backward()`), layerpar writes it there
itself: a row of the segment's stacked gradient becomes `.grad` as it is, so a
segment's thousands of per-layer gradients cost no operation at all.

Serial semantics are kept exactly: a parameter whose AccumulateGrad does not run in
this backward pass (`torch.autograd.grad`, `backward(inputs=...)` naming other
tensors) or that has hooks gets its gradient through the engine as usual.
"""
from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Iterable, Iterator
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge

__all__ = ["GradDelivery", "hooks_held"]


#: every live `GradDelivery`: models share parameters (auto's candidates and its chosen
#: setting, a captured twin), and a node is the parameter's, so one `reset` must make
#: them all forget it; each cache still dies with its model (a process-wide cache of
#: nodes would keep every model's parameters alive: a node holds its parameter)
_ALL: weakref.WeakSet[GradDelivery] = weakref.WeakSet()


class GradDelivery:
    """Decides, per parameter and per backward pass, who accumulates its gradient."""

    def __init__(self) -> None:
        # id(p) -> (p, its AccumulateGrad node); holding the node keeps it p's node
        self._nodes: dict[int, tuple[Tensor, Node]] = {}
        # the last pass's parameters and their nodes, in order: a model hands the same
        # parameters every pass, whose nodes are then read from one list, not looked up
        # one by one (1,024 lookups per pass at 512 layers of two tensors each)
        self._last: tuple[tuple[Tensor, ...], list[Node]] = ((), [])
        _ALL.add(self)

    @staticmethod
    def reset() -> None:
        """Forget the cached nodes, every model's: they are remade on the current
        stream when next needed.  A node is bound to the CUDA stream it was made on
        and lives as long as something holds it, so a node made by an eager pass on
        the default stream (auto's tuning, a user's own steps) and kept by any model
        broke a later graph capture on the H100 (the backward made the default stream
        wait on the capturing one: `cudaErrorStreamCaptureImplicit`)."""
        for delivery in list(_ALL):
            delivery._nodes = {}
            delivery._last = ((), [])

    def _node(self, p: Tensor) -> Node:
        got = self._nodes.get(id(p))
        if got is None or got[0] is not p:
            got = self._nodes[id(p)] = (p, get_gradient_edge(p).node)
        return got[1]

    def _nodes_of(self, params: tuple[Tensor, ...]) -> list[Node]:
        """The AccumulateGrad nodes of `params`, in order (the last pass's list where
        the parameters are the same objects: one identity test each, in C)."""
        last, nodes = self._last
        if len(last) == len(params) and all(map(operator.is_, last, params)):
            return nodes
        nodes = [self._node(p) for p in params]
        self._last = (tuple(params), nodes)
        return nodes

    def __call__(self, params: tuple[Tensor, ...],
                 grads: dict[int, Tensor]) -> list[Optional[Tensor]]:
        """The gradients to return from the Function's backward for `params`
        (None where this wrote `.grad` itself).  Must run inside that backward."""
        will_run = torch._C._will_engine_execute_node
        out: list[Optional[Tensor]] = []
        for p, node in zip(params, self._nodes_of(params)):
            g = grads.get(id(p))
            if g is None or p._backward_hooks or p._post_accumulate_grad_hooks:
                out.append(g)
                continue
            try:
                runs = will_run(node)
            except RuntimeError:
                # torch.autograd.grad(): no AccumulateGrad runs in this pass (torch
                # refuses the question for leaves then); the engine captures them all
                return [grads.get(id(q)) for q in params]
            if not runs:
                out.append(g)  # not asked for (backward(inputs=...) names others)
                continue
            if p.grad is None:
                p.grad = g if g.dtype is p.dtype else g.to(p.dtype)
            else:
                p.grad.add_(g)
            out.append(None)
        return out


@contextlib.contextmanager
def hooks_held(params: Iterable[Tensor]) -> Iterator[None]:
    """Inside, the tensor hooks (``p.register_hook``) of `params` are held back (their
    dict emptied, then refilled): the passes compute a parameter's gradient inside
    autograd calls of their own, where its hooks would run, and then hand it to the
    parameter through the pass's autograd node, where they run: once, on the whole
    gradient, as in serial autograd."""
    held = [(p._backward_hooks, dict(p._backward_hooks)) for p in params
            if p._backward_hooks]
    for hooks, _ in held:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in held:
            hooks.update(saved)
