"""Adam over parameters laid out as rows of one tensor, one step per run of rows.

A `Segment` keeps its blocks' parameters flat (`layerpar.ode.flat`): block n's
``linear.weight`` is row n of one [N, out, in] tensor.  ``torch.optim.Adam`` still
steps each of them as a tensor of its own: fused, about 17 us per tensor on a CPU,
so the 1,024-layer dense MNIST-1D net's step cost 15 ms at one rank (against a
100 ms pass) and 8-9 ms at each of two.  `FlatAdam` is that optimizer with each run
of consecutive rows stepped as the one tensor they are rows of (1.5 ms for 512
layers' weights and biases, their gradients gathered included): the same update,
element by element, for every parameter, and the same `Parameter` objects, values and
gradients for the user.

Where a run's gradients are themselves rows of one tensor (a layer-parallel backward
hands them over that way, `layerpar.parallel.grads`), the step reads them in place,
or gathers them in one operation where their order is another; elsewhere (serial
autograd) they are stacked, one copy.
A parameter outside any run (a head, a stem, a tensor whose storage moved, a row
larger than `ROW_LIMIT` elements, whose copy would cost more than its own step) is
stepped on its own, as ``torch.optim.Adam`` steps it.

The layout is checked before every step (the rows' addresses): where it changed (a
``.to()``, a ``.data`` set, `flatten` moving storage) or a run's gradients are only
partly present (a frozen layer: Adam skips a parameter without a gradient), the
optimizer's state is split per parameter and laid out again, so the update stays
``torch.optim.Adam``'s.  Its `state_dict` is per run: it loads into a `FlatAdam`
over the same parameters, not into a ``torch.optim.Adam``.
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable
from itertools import repeat
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..ode.flat import rows

__all__ = ["FlatAdam"]

#: the most elements a row may have to be stepped in a run: a run's gradients are
#: stacked (serial autograd) or gathered (a layer-parallel backward) into one tensor, a
#: copy that costs about what torch.optim.Adam's ~17 us per tensor saves at some 10,000
#: elements a row on a CPU (the pre-norm MNIST-1D net's 128 x 128 weights: its step
#: took 38 ms in runs against 26 ms one by one; the dense net's 32 x 32: 6.7 against 22)
ROW_LIMIT = 4096

#: the per-tensor state entries of ``torch.optim.Adam`` (the scalar "step" aside)
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

_GRAD = operator.attrgetter("grad")
_DEREF = operator.methodcaller("__call__")  # a weak reference's object (Python 3.10)


class FlatAdam(torch.optim.Adam):
    """``torch.optim.Adam`` (one parameter group, fused where torch has it) that steps
    each run of parameters stored as consecutive rows of one tensor as that tensor.

    params: the parameters (an iterable of tensors; one group).  lr and the other
    keywords: as ``torch.optim.Adam`` takes them (``fused`` chosen here: fused where
    torch has it for the parameters' device and dtype, else the default).
    """

    def __init__(self, params: Iterable[Tensor], lr: Any = 1e-3, **kwargs: Any) -> None:
        self._params: list[Tensor] = []
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError("`params` must be an iterable of tensors (FlatAdam takes "
                                f"one parameter group), got an item of type "
                                f"{type(p).__name__}")
            self._params.append(p)
        if not self._params:
            raise ValueError("`params` is empty: FlatAdam needs parameters to optimise")
        if "fused" in kwargs or "foreach" in kwargs:
            raise TypeError("FlatAdam chooses `fused` itself; do not pass `fused` or "
                            "`foreach`")
        self._runs: list[tuple[Tensor, list[Tensor], list[int]]] = []
        # per run (by the view's id): the last step's gradients (weakly: a layer-parallel
        # backward reuses its rows only while nothing else holds them) and how they
        # became the run's gradient (`_Gather`), for the next step to reuse where its
        # gradients are the same tensors
        self._gathers: dict[int, tuple[list[weakref.ref], _Gather]] = {}
        self._alone: set[int] = set()  # ids of parameters kept out of runs
        proxies = self._layout()
        try:
            super().__init__(proxies, lr=lr, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            super().__init__(proxies, lr=lr, **kwargs)

    def _layout(self) -> list[Tensor]:
        """Group the parameters into runs of rows (`self._runs`: the view the step
        updates, its parameters in storage order, their addresses); the tensors Adam
        steps (runs first, in the order of their first parameter, then the others)."""
        groups: dict[tuple, list[Tensor]] = {}
        alone: list[Tensor] = []
        seen: set[int] = set()
        for p in self._params:
            if id(p) in seen:
                continue  # (torch.optim warns of a repeated parameter; one step each)
            seen.add(id(p))
            if id(p) in self._alone or not 0 < p.numel() <= ROW_LIMIT or \
                    not p.is_contiguous() or p.layout != torch.strided:
                alone.append(p)
                continue
            key = (p.untyped_storage().data_ptr(), p.dtype, p.device, tuple(p.shape))
            groups.setdefault(key, []).append(p)
        self._runs = []
        out: list[Tensor] = []
        for col in groups.values():
            col = sorted(col, key=Tensor.data_ptr)
            step = col[0].numel() * col[0].element_size()
            i = 0
            while i < len(col):
                j = i + 1
                while j < len(col) and col[j].data_ptr() == col[j - 1].data_ptr() + step:
                    j += 1
                run = col[i:j]
                view = rows(run) if len(run) >= 2 else None
                if view is None:
                    alone += run
                else:
                    self._runs.append((view, run, [p.data_ptr() for p in run]))
                    out.append(view)
                i = j
        return out + alone

    def _per_parameter_state(self) -> dict[int, dict[str, Any]]:
        """The state of every parameter as ``torch.optim.Adam`` would hold it (a run's
        moments split into its rows, copies), keyed by the parameter's id."""
        got: dict[int, dict[str, Any]] = {}
        by_view = {id(v): col for v, col, _ in self._runs}
        for t, st in self.state.items():
            col = by_view.get(id(t))
            if col is None:
                got[id(t)] = dict(st)
                continue
            for k, p in enumerate(col):
                got[id(p)] = {n: (v[k].clone() if n in _MOMENTS else
                                  v.clone() if isinstance(v, Tensor) else v)
                              for n, v in st.items()}
        return got

    def _relayout(self) -> None:
        """Lay the runs out again, the state carried over parameter by parameter (rows
        whose states differ, one stepped where another was not, step alone)."""
        old = self._per_parameter_state()
        while True:
            proxies = self._layout()
            apart = [col for _, col, _ in self._runs
                     if len({None if old.get(id(p)) is None else float(old[id(p)]["step"])
                             for p in col}) > 1]
            if not apart:
                break
            self._alone.update(id(p) for col in apart for p in col)
        self.state.clear()
        self._gathers.clear()  # (keyed by the old views)
        by_view = {id(v): col for v, col, _ in self._runs}
        for t in proxies:
            col = by_view.get(id(t))
            if col is None:
                if id(t) in old:
                    self.state[t] = old[id(t)]
                continue
            states = [old.get(id(p)) for p in col]
            if states[0] is not None:
                self.state[t] = {n: (torch.stack([s[n] for s in states]).to(t.device)  # type: ignore[index]
                                     if n in _MOMENTS else v)
                                 for n, v in states[0].items()}
        self.param_groups[0]["params"] = proxies

    def _grads(self) -> None:
        """Each run's view gets its gradient (in place or gathered, `_Gather`, else
        stacked); a run whose parameters moved or whose gradients are only partly
        present is laid out again first.  Where a run's gradients are the tensors of
        the last step (a layer-parallel backward writes each pass's into the same rows,
        `AdjointApp._rows_reused`), their layout is not worked out again: one identity
        test per parameter, in C (at 512 layers, working it out cost about as much as
        the step)."""
        got = []
        for _, col, ptrs in self._runs:
            grads = list(map(_GRAD, col))
            missing = sum(map(operator.is_, grads, repeat(None)))
            if list(map(Tensor.data_ptr, col)) != ptrs or 0 < missing < len(col):
                self._alone.update(id(p) for p, g in zip(col, grads) if g is None)
                self._relayout()
                return self._grads()
            got.append(grads)
        for (view, _, _), grads in zip(self._runs, got):
            if grads[0] is None:
                view.grad = None
                continue
            last = self._gathers.get(id(view))
            if last is not None and all(map(operator.is_, grads, map(_DEREF, last[0]))):
                view.grad = last[1].apply(grads[0])
                continue
            gather = _Gather.of(grads)
            if gather is None:  # (serial autograd: gradients of their own) one copy
                self._gathers.pop(id(view), None)
                stacked = rows(grads)
                view.grad = stacked if stacked is not None else torch.stack(grads)
            else:
                self._gathers[id(view)] = ([weakref.ref(g) for g in grads], gather)
                view.grad = gather.apply(grads[0])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One Adam step of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._grads()
        adam_step = torch.optim.Adam.step
        if getattr(adam_step, "hooked", False):
            # torch wraps each optimizer class's `step` once with the step hooks; this
            # class's wrapper has run them, Adam's would run them again
            adam_step = adam_step.__wrapped__  # type: ignore[attr-defined]
        adam_step(self)
        for view, _, _ in self._runs:
            view.grad = None  # (the parameters hold theirs)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the parameters' gradients."""
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()


class _Gather:
    """How gradients that are rows of one contiguous tensor (their `_base`) make the
    run's [len, *shape] gradient: rows `first` onwards in order (a view), or the rows
    `index` names (one gather: a layer-parallel backward stacks a segment's gradients
    in the order its sweeps computed them)."""

    __slots__ = ("first", "count", "index")

    def __init__(self, first: int, count: int, index: Optional[Tensor]) -> None:
        self.first, self.count, self.index = first, count, index

    @staticmethod
    def of(grads: list[Tensor]) -> Optional[_Gather]:
        """The gather that makes `grads` one tensor, None where they are not rows of
        one contiguous tensor."""
        g0 = grads[0]
        base = g0._base
        if base is None or not base.is_contiguous() or base.dim() != g0.dim() + 1 or \
                base.shape[1:] != g0.shape:
            return None
        strides = base.stride()[1:]
        if not all(t._base is base and t.stride() == strides for t in grads):
            return None
        size, start = g0.numel() * g0.element_size(), base.data_ptr()
        offsets = [t.data_ptr() - start for t in grads]
        if not all(o % size == 0 for o in offsets):
            return None
        index = [o // size for o in offsets]
        first = index[0]
        if index == list(range(first, first + len(index))):
            return _Gather(first, len(index), None)
        return _Gather(first, len(index), torch.tensor(index, device=base.device))

    def apply(self, g0: Tensor) -> Tensor:
        """The run's gradient from the base of its first row `g0` (a row: it has one)."""
        base = g0._base
        if base is None:
            raise RuntimeError("FlatAdam: a gathered run's gradient is not a row any more")
        if self.index is None:
            return base[self.first:self.first + self.count]
        return base.index_select(0, self.index)

