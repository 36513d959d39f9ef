"""Vectorised steps: all intervals of a level advance in one call.

MGRIT's F-points at the same offset of every interval are independent, and so are
the C-points of a C-sweep, the residual's C-point steps and the FAS steps.  The
engine hands such a set to `step_batch` at once; here the set becomes one batched
evaluation of the residual block over stacked per-layer parameters, so a cycle
issues O(levels x cfactor x iterations) tensor operations instead of O(layers).

How the batch is evaluated, per block type:

- a block with a ``forward_batched(params, buffers, v)`` method (``Dense`` has one:
  one ``baddbmm``) is called with parameters stacked along a new leading layer
  dimension and states ``v`` of shape ``[n, *state]``;
- any other block, a user's own included, is evaluated with ``torch.func.vmap`` over
  ``functional_call`` of the first block with the stacked parameters.

Coarse steps evaluate the block of their interval's first layer (injection) or, with
"average" coarsening, that block with the interval's mean parameters: the means of a
level's intervals are one mean over a stack of all the blocks' parameters, made once
per pass (`BatchedBlocks.averaged`).

Engine states are tensors or `Row` handles: the outputs of a batch are the rows of
one tensor, and `stack_rows` turns a list of states back into one tensor without a
copy when they are exactly those rows in order (the common case: offset k+1 of an
F-sweep reads the outputs of offset k), or with one slice per run of rows.

A segment whose blocks cannot be vectorised (different structure from block to
block, batch-norm running statistics, per-layer random numbers, or a block whose
vmap fails or disagrees with its own forward) runs the per-step path, after one
warning naming the block.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from operator import attrgetter
from types import FrameType
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ..mgrit.solve import vec_norm_sq, vec_sum
from ..ode.flat import rows as flat_rows
from ..ode.rng import DROPOUT_TYPES, needs_rng
from ..ode.schemes import Scheme
from .kernels import fused_step_for
from .tape import autocast_dtype

__all__ = ["BatchedBlocks", "Row", "StateOps", "as_tensor", "stack_rows", "structure",
           "unbatchable_reason"]

_VERSION = attrgetter("_version")
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_WARNED: set[str] = set()


class Row:
    """An engine state that is row `k` of the batched tensor `base`, kept as a handle
    rather than a tensor view: creating a view costs about a microsecond of host time,
    and a level's batch has hundreds of rows.  `tensor()` makes the view when a single
    state is needed (a message, a lone step)."""

    __slots__ = ("base", "k")

    def __init__(self, base: Tensor, k: int) -> None:
        self.base, self.k = base, k

    def tensor(self) -> Tensor:
        return self.base[self.k]


def as_tensor(state: Any) -> Tensor:
    """An engine state (a tensor or a `Row`) as a tensor."""
    return state.tensor() if type(state) is Row else state


def stack_rows(states: list) -> Tensor:
    """The states ([n] of tensors or `Row`s) as one tensor [n, *state].

    Rows of one base tensor in order are that tensor (no operation); runs of rows of
    one base with a constant stride become one slice each (a reversed run also one
    flip); runs of plain tensors one stack each; the pieces one cat.  States from a
    few sources interleaved (a coarse level's points come from its cf sweeps, point i
    from sweep i mod cf) are copied source by source into one new tensor.  So the operation count
    depends on how many sources the states come from, not on how many there are."""
    n = len(states)
    first = states[0]
    if type(first) is Row and first.k == 0 and first.base.shape[0] == n:
        base = first.base
        for i, h in enumerate(states):
            if type(h) is not Row or h.base is not base or h.k != i:
                break
        else:
            return base
    runs = _runs(states)
    if len(runs) > 4:
        out = _interleaved(states)  # e.g. a coarse level's points from its cf sweeps
        if out is not None:
            return out
    pieces = [torch.stack(states[i:j]) if base is None else _rows_of(base, k0, step, j - i)
              for i, j, base, k0, step in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _runs(states: list) -> list[tuple[int, int, Optional[Tensor], int, int]]:
    """The states as consecutive runs (start, stop, base, first row, row step): rows of
    one base at a constant stride, or plain tensors (base None)."""
    n = len(states)
    runs: list[tuple[int, int, Optional[Tensor], int, int]] = []
    i = 0
    while i < n:
        h = states[i]
        if type(h) is not Row:
            j = i + 1
            while j < n and type(states[j]) is not Row:
                j += 1
            runs.append((i, j, None, 0, 0))
            i = j
            continue
        base, k0 = h.base, h.k
        j, step = i + 1, 0
        if j < n and type(states[j]) is Row and states[j].base is base:
            step = states[j].k - k0
        if step != 0:
            while j < n and type(states[j]) is Row and states[j].base is base \
                    and states[j].k == k0 + step * (j - i):
                j += 1
        else:
            j, step = i + 1, 1
        runs.append((i, j, base, k0, step))
        i = j
    return runs


def _rows_of(base: Tensor, k0: int, step: int, count: int) -> Tensor:
    """Rows k0, k0 + step, ... (count of them) of base: a view, or one flip."""
    last = k0 + step * (count - 1)
    if step == 1 and k0 == 0 and count == base.shape[0]:
        return base
    if step > 0:
        return base[k0:last + 1:step]
    return base[last:k0 + 1:-step].flip(0)


def _interleaved(states: list) -> Optional[Tensor]:
    """The states gathered source by source, when each source (a base tensor, or the
    plain tensors together) sits at positions p0, p0 + s, ... and gives rows k0, k0 + t,
    ...: one strided copy per source.  None when they do not fall into a few such."""
    groups: dict[int, list] = {}
    for p, h in enumerate(states):
        key = id(h.base) if type(h) is Row else 0
        g = groups.get(key)
        if g is None:
            if len(groups) == 8:
                return None
            g = groups[key] = [h.base if type(h) is Row else None, [], []]
        g[1].append(p)
        g[2].append(h.k if type(h) is Row else h)
    first = states[0]
    like = first.base[first.k] if type(first) is Row else first
    out = like.new_empty((len(states), *like.shape))
    for base, pos, rows in groups.values():
        ps = pos[1] - pos[0] if len(pos) > 1 else 1
        if any(pos[m] != pos[0] + ps * m for m in range(len(pos))):
            return None
        if base is None:
            src = torch.stack(rows)
        else:
            rs = rows[1] - rows[0] if len(rows) > 1 else 1
            if rs == 0 or any(rows[m] != rows[0] + rs * m for m in range(len(rows))):
                return None
            src = _rows_of(base, rows[0], rs, len(rows))
        out[pos[0]:pos[-1] + 1:ps] = src
    return out


def as_tensors(states: Optional[list], zero: Tensor) -> Optional[list]:
    """A list of states (None entries: `zero`) as tensors, rows materialised with one
    gather and one unbind rather than one select each (sequential stretches)."""
    if states is None:
        return None
    if not any(type(h) is Row for h in states):
        return [zero if h is None else h for h in states]
    return list(stack_rows([zero if h is None else h for h in states]).unbind(0))


def unstack_rows(t: Tensor) -> list:
    """The rows of `t` as engine states (`Row` handles: no tensor operation)."""
    return [Row(t, k) for k in range(t.shape[0])]


def batched_sum(alpha: float, xs: list[Tensor], beta: float, ys: list[Tensor]) -> list[Tensor]:
    """The engine's `sum_batch`: alpha*x + beta*y for all pairs in one operation
    (elementwise the same arithmetic as `vec_sum`, so bit-identical results)."""
    return unstack_rows(vec_sum(alpha, _operand(xs), beta, _operand(ys)))


def _operand(states: list) -> Tensor:
    """`stack_rows` of one side of a sum, except that one tensor repeated (the engine's
    zero state, e.g. every C-point's initial guess: 4 lists of 128 a pass of the
    1,024-layer dense net at one rank, each stacked into 2 MB) is broadcast, not
    copied: the sum reads it and writes a new tensor."""
    first = states[0]
    if type(first) is not Row and all(h is first for h in states):
        return first.expand(len(states), *first.shape)
    return stack_rows(states)


def batched_norm_sq(states: list[Tensor]) -> float:
    """Sum of squared 2-norms of all states, accumulated in float64, read back once."""
    s = stack_rows(states)
    return float(torch.linalg.vector_norm(s, dtype=torch.float64) ** 2)


class StateOps:
    """The engine's state arithmetic, shared by a segment's forward and adjoint apps:
    sums of tensors or rows, a whole phase's sums at once (`sum_batch`), and residual
    norms, kept on the device when the session defers them (`deferred`).  The
    per-step reference path (no `bb`) sums point by point, as before batching."""

    bb: Any = None  # the pass's BatchedBlocks, or None (per-step path)
    deferred: Optional[list[Tensor]] = None

    @staticmethod
    def sum(alpha: float, x: Any, beta: float, y: Any) -> Tensor:
        return vec_sum(alpha, as_tensor(x), beta, as_tensor(y))

    def sum_batch(self, alpha: float, xs: list, beta: float, ys: list) -> list:
        if self.bb is None:
            return [vec_sum(alpha, x, beta, y) for x, y in zip(xs, ys)]
        return batched_sum(alpha, xs, beta, ys)  # elementwise: bit-identical to vec_sum

    def norm_sq(self, states: list) -> float:
        if self.deferred is not None:  # fixed iterations: keep it on the device
            self.deferred.append(torch.linalg.vector_norm(stack_rows(states),
                                                          dtype=torch.float64))
            return 0.0
        return batched_norm_sq(states) if self.bb is not None else vec_norm_sq(states)


def own_buffers(block: nn.Module) -> list[tuple[str, Tensor]]:
    """The block's buffers other than batch-norm running statistics (which layerpar
    moves once per batch itself, see bn_dropout.py)."""
    skip = {id(t) for m in block.modules() if isinstance(m, _BN_TYPES)
            for t in m.buffers(recurse=False)}
    return [(n, t) for n, t in block.named_buffers() if id(t) not in skip]


def buffer_versions(buffers: list[tuple[str, Tensor]]) -> list[int]:
    return [t._version for _, t in buffers]


def buffer_message(block: nn.Module, layer: int, segment: Optional[int],
                   buffers: list[tuple[str, Tensor]], before: list[int]) -> str:
    """Why a residual block that updates its own buffers in forward() is refused."""
    names = [n for (n, t), v in zip(buffers, before) if t._version != v]
    where = f"layer {layer}" + ("" if segment is None else f" of segment {segment}")
    return (f"{where} ({type(block).__name__}) updates its buffer(s) {names} in forward(); "
            "MGRIT evaluates a layer several times per batch (relaxation sweeps, coarse "
            "levels, iterations), so such a buffer would not end with the values serial "
            "training gives it. Keep forward() free of buffer updates (batch norm's "
            "running statistics are handled by layerpar), or train this net serially "
            "(one rank, max_levels=1)")


def generator_states(device: torch.device) -> list[Tensor]:
    """The global generators' states a block on `device` may draw from: the CPU's and,
    on a CUDA device, that device's (compared before and after a block's forward to
    find one that draws random numbers; those the block holds: `ode.rng.own_generators`)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def random_message(block: nn.Module, layer: int, segment: Optional[int],
                   generator: Optional[str] = None) -> str:
    """Why a residual block that draws random numbers outside dropout is refused
    (`generator`: the name of the block's own generator it drew from)."""
    where = f"layer {layer}" + ("" if segment is None else f" of segment {segment}")
    kinds = ", ".join(t.__name__ for t in DROPOUT_TYPES)
    what = (f"from a torch.Generator of its own (`{generator}`)" if generator is not None
            else "(torch.randn_like, torch.rand, F.dropout, ...)")
    return (f"{where} ({type(block).__name__}) draws random numbers in forward() "
            f"{what} outside a dropout module ({kinds}); MGRIT evaluates a layer "
            "several times per batch (relaxation sweeps, coarse levels, the adjoint's "
            "recomputation), and each evaluation would draw other numbers (serial "
            "training evaluates it once), so forward and backward would see different "
            "noise. Use a dropout module (layerpar draws its mask once per layer and "
            "batch), or train this net serially (one rank, max_levels=1)")


def inplace_message(block: nn.Module, layer: int, segment: Optional[int]) -> str:
    """Why a residual block that changes its input in place is refused."""
    where = f"layer {layer}" + ("" if segment is None else f" of segment {segment}")
    return (f"{where} ({type(block).__name__}) modified its input in place; a residual "
            "block F must leave its input u unchanged, since MGRIT keeps and reuses the "
            "states it steps and records them for the backward pass (u + h*F(u) needs "
            "the u that came in). Use out-of-place operations in forward() (e.g. "
            "`torch.relu(u)`, not `u.relu_()`)")


def output_message(block: nn.Module, layer: int, segment: Optional[int], u: Tensor,
                   out: Any) -> Optional[str]:
    """Why a residual block's output cannot be F(u) (None where it can): F(u) is one
    tensor shaped like the state u; layerpar adds u + h F(u) itself."""
    where = f"layer {layer}" + ("" if segment is None else f" of segment {segment}")
    rule = ("a residual block's forward(u) returns F(u), one tensor shaped like u "
            "(layerpar takes the step u + h*F(u) itself)")
    if not isinstance(out, Tensor):
        return f"{where} ({type(block).__name__}) returned a {type(out).__name__}; {rule}"
    if out.shape != u.shape:
        return (f"{where} ({type(block).__name__}) changed the state's shape from "
                f"{tuple(u.shape)} to {tuple(out.shape)}; {rule}")
    if torch.promote_types(u.dtype, out.dtype) != u.dtype:
        # u + h*F(u) would change the state's dtype at this layer: every rank's
        # messages and buffers carry the dtype the state enters the layers with
        return (f"{where} ({type(block).__name__}) returned F(u) in {out.dtype} for a "
                f"state in {u.dtype}, which would turn the state into {out.dtype}; the "
                "state keeps one dtype through the residual layers: return F(u) in the "
                "state's dtype (under CUDA autocast, a block ending in layer_norm or "
                "softmax returns float32), or have the opening return the dtype F(u) "
                "comes in")
    return None


#: a memory address in a repr (``<... at 0x7f...>``): it differs per process
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _describe(value: Any) -> str:
    """A plain attribute as text that is the same in every process: functions and
    classes by qualified name, other objects by their repr with any memory address
    left out (a `functools.partial`, a `torch.Generator`: the default repr of many
    objects holds one, and identical nets on two ranks would read as different)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, functools.partial):
        return f"partial({_describe(value.func)}, {[_describe(a) for a in value.args]}, " \
            f"{ {k: _describe(v) for k, v in sorted(value.keywords.items())} })"
    return _ADDRESS.sub("0x", repr(value))


#: `structure` per module while `same_structures` is active (id -> (module, structure))
_STRUCTURES: Optional[dict[int, tuple[nn.Module, tuple]]] = None


@contextmanager
def same_structures() -> Iterator[None]:
    """Within it, `structure` is computed once per module: for a stretch of code that
    builds several models over the same modules without changing them (the
    auto-tuning builds one per candidate: on the 1,024-layer dense net the structures
    took about half of each 64 ms build).  Nested uses share the outer cache."""
    global _STRUCTURES
    outer = _STRUCTURES
    if outer is None:
        _STRUCTURES = {}
    try:
        yield
    finally:
        if outer is None:
            _STRUCTURES = None


def structure(module: nn.Module) -> tuple:
    """What makes two modules compute the same function given the same parameters:
    module types, parameter/buffer names, shapes and dtypes, and plain attributes
    (activation names, paddings, ...).  Comparable across processes: it is also the
    fingerprint ranks agree on before a LayerParallel runs."""
    cache = _STRUCTURES
    if cache is not None:
        got = cache.get(id(module))
        if got is not None and got[0] is module:
            return got[1]
    skip = {"_parameters", "_buffers", "_modules", "training"}
    out = []
    for name, m in module.named_modules():
        # a `torch.compile`d module's own attributes are its compiler's (a context
        # object, the wrapper's id: addresses that differ per process); it computes
        # what its original module, `_orig_mod`, computes, described as its submodule
        compiled = isinstance(getattr(m, "_orig_mod", None), nn.Module) and \
            type(m).__name__ == "OptimizedModule"
        attrs = () if compiled else tuple(sorted((k, _describe(v)) for k, v in vars(m).items()
                             if k not in skip and not k.startswith("_forward")
                             and not k.startswith("_backward") and not k.startswith("_state")
                             and not k.startswith("_load") and k != "_non_persistent_buffers_set"
                             and not k.startswith("_is_") and not k.endswith("_hooks")
                             and "hook" not in k))
        params = tuple((n, tuple(p.shape), str(p.dtype))
                       for n, p in m.named_parameters(recurse=False))
        bufs = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers(recurse=False))
        out.append((name, f"{type(m).__module__}.{type(m).__qualname__}", attrs, params, bufs))
    if cache is not None:
        cache[id(module)] = (module, tuple(out))
    return tuple(out)


def unbatchable_reason(blocks: list[nn.Module]) -> Optional[str]:
    """Why these blocks cannot share one vectorised evaluation, or None if they can."""
    first = blocks[0]
    if any(isinstance(m, _BN_TYPES) and m.track_running_stats for b in blocks
           for m in b.modules()):
        return "it has batch-norm running statistics (updated once per batch)"
    if any(needs_rng(b) for b in blocks):
        return "it draws random numbers (dropout) per layer"
    key = structure(first)
    for k, b in enumerate(blocks[1:], start=1):
        if structure(b) != key:
            return (f"its blocks differ in structure: the {k}-th block this rank evaluates "
                    f"({type(b).__name__}) has other module types, attributes or parameter "
                    f"shapes than the first ({type(first).__name__})")
    return None


def warn_once(block: nn.Module, reason: str) -> None:
    """One warning per block type and reason: this segment steps layer by layer."""
    key = f"{type(block).__qualname__}: {reason}"
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"layerpar: residual block {type(block).__qualname__} is not "
                      f"vectorised ({reason}); its segment steps one layer at a time, which "
                      "issues one set of tensor operations per layer",
                      stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The `warnings.warn` stack level, called from the function that calls this one,
    of the first frame outside layerpar and torch (a module's call, an autograd
    Function's apply): the user's line (``LayerParallel(...)``, the first pass),
    whatever path inside the packages led to the warning."""
    layerpar_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    packages = (layerpar_dir + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    frame: Optional[FrameType] = sys._getframe(2)  # the caller's caller: warn's level 2
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            packages):
        frame, level = frame.f_back, level + 1
    return level


class BatchedBlocks:
    """Stacked parameters and the batched residual branch of one segment's blocks.

    blocks: layer index -> block (this rank's own blocks and its ghosts); all have the
        structure of `proto`.
    scheme: the segment's time-stepping scheme (its `step_many` advances [n, *state]).
    times: the fine grid's times (step sizes are differences of these, as in `phi`).
    coarsening: what a coarse step a -> b evaluates (`layerpar.ode.coarsening`): the
        block of layer a ("injection"), or that block with the parameters averaged over
        layers a..b-1 ("average"; buffers stay layer a's).  Fine steps are the same.
    owned: the rank's own layers (a range of `blocks`' keys), whose parameters a step
        reads as views where they are flat (`check_flat`); None: stacked copies.
    """

    def __init__(self, blocks: dict[int, nn.Module], scheme: Scheme, times: list[float],
                 coarsening: str = "injection", owned: Optional[range] = None):
        self.blocks = blocks
        self.scheme = scheme
        self.times = times
        self.coarsening = coarsening
        # the blocks' layers as one range [lo, hi), where they are one (averaged coarse
        # steps are then slices of one stack, see `averaged`)
        lo, hi = min(blocks), max(blocks) + 1
        self._range = (lo, hi) if len(blocks) == hi - lo else None
        self._every = tuple(range(lo, hi))
        self.proto = blocks[min(blocks)]
        self.param_names = [n for n, _ in self.proto.named_parameters()]
        self.buffer_names = [n for n, _ in self.proto.named_buffers()]
        # per layer: its parameter and buffer tensors in name order (objects keep their
        # identity under .to()/.double(), which swap .data)
        self._tensors: dict[int, tuple[list[Tensor], list[Tensor]]] = {
            a: ([dict(b.named_parameters())[n] for n in self.param_names],
                [dict(b.named_buffers())[n] for n in self.buffer_names])
            for a, b in blocks.items()}
        own = getattr(type(self.proto), "forward_batched", None)
        self.fn: Callable[[dict, dict, Tensor], Tensor]
        if own is not None:
            self.fn = own.__get__(self.proto)
        else:
            proto = self.proto

            def one(p: dict, b: dict, v: Tensor) -> Tensor:
                return functional_call(proto, (p, b), (v,))

            self.fn = vmap(one)
        self._stacked: dict[tuple, tuple[dict, dict]] = {}
        self._dt: dict[tuple, Tensor] = {}  # made on the host once: step sizes, indices
        self._columns: dict[tuple, list[Tensor]] = {}
        self.fast = fused_step_for(self.proto, scheme)  # Triton step on CUDA (kernels/)
        # the rank's own layers (a range of `blocks`), whose parameters a vectorised
        # step reads as views where they are flat rows (`check_flat`)
        self._own_layers: tuple[int, ...] = ()
        self._own_span = (0, 0)
        if owned is not None and len(owned) > 1 and all(a in blocks for a in owned):
            self._own_layers, self._own_span = tuple(owned), (owned.start, owned.stop)
        self._flat: dict[int, tuple[Tensor, list[int], list[tuple[int, ...]]]] = {}
        self.check_flat()

    def layer_tensors(self, a: int) -> list[Tensor]:
        """Layer a's parameters in `param_names` order."""
        return self._tensors[a][0]

    def column(self, k: int, layers: tuple[int, ...]) -> list[Tensor]:
        """Parameter `param_names[k]` of each of these layers, in their order: the
        tensors whose gradients are the rows of a record's stacked gradient.  Kept
        across passes (the tensors are the blocks' own, as in `layer_tensors`), so a
        pass's gradients reach their parameters without a Python step per layer."""
        key = (k, layers)
        got = self._columns.get(key)
        if got is None:
            got = self._columns[key] = [self._tensors[a][0][k] for a in layers]
        return got

    def check_flat(self) -> None:
        """Find the rank's own layers' parameters as rows of one tensor per name (the
        layout `Segment` keeps, `layerpar.ode.flat`), so that a vectorised step's
        parameters are a strided view of them rather than a stack of copies.  Kept
        from pass to pass while every tensor is where it was (a pointer and a stride
        comparison each, about 0.3 us); looked for again when one moved (`.to()`, a
        `.data` a user set)."""
        own = self._own_layers
        if not own:
            return
        for k in range(len(self.param_names)):
            col = self.column(k, own)
            got = self._flat.get(k)
            if got is not None and list(map(Tensor.data_ptr, col)) == got[1] and \
                    list(map(Tensor.stride, col)) == got[2]:
                continue
            base = flat_rows(col)
            if base is None:
                self._flat.pop(k, None)
            else:
                self._flat[k] = (base, list(map(Tensor.data_ptr, col)),
                                 list(map(Tensor.stride, col)))

    def param_versions(self) -> Optional[dict[int, int]]:
        """Per flat parameter name (index), the sum of its own layers' version
        counters (which only grow), or None where no name is flat: a pass whose
        records read views of the parameters keeps this for its backward pass."""
        if not self._flat:
            return None
        return {k: sum(map(_VERSION, self.column(k, self._own_layers))) for k in self._flat}

    def check_versions(self, versions: dict[int, int], seg_index: int) -> None:
        """Refuse a backward pass whose forward pass read parameters (as views) that
        have been changed in place since: its gradient would mix the two values.
        Serial training refuses it the same way (autograd's version check)."""
        for k, was in versions.items():
            col = self.column(k, self._own_layers)
            if sum(map(_VERSION, col)) != was:
                name = self.param_names[k]
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been "
                    f"modified by an inplace operation: parameter `{name}` of a layer "
                    f"of segment {seg_index} (layers {self._own_layers[0]}.."
                    f"{self._own_layers[-1]} on this rank) changed after the forward "
                    f"pass and before its backward pass; run the forward pass again "
                    f"after changing parameters (an optimizer step between "
                    f"`loss.backward()` calls of one pass does this)")

    def new_pass(self, check: bool = True) -> None:
        """Parameters may have changed since the last pass: drop the stacked copies
        and views, and (`check`) look at the flat rows again."""
        self._stacked = {}
        if check:
            self.check_flat()

    def _rows(self, layers: tuple[int, ...]) -> Optional[slice]:
        """The rows of the flat parameters that are these layers, as a slice (they
        are own layers a, a + d, ..., d > 0), else None."""
        if not self._flat:
            return None
        lo, hi = self._own_span
        a, n = layers[0], len(layers)
        d = layers[1] - a if n > 1 else 1
        last = a + (n - 1) * d
        if d <= 0 or a < lo or last >= hi or \
                (n > 2 and layers != tuple(range(a, last + 1, d))):
            return None
        return slice(a - lo, last - lo + 1, d)

    def stacked(self, layers: tuple[int, ...]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(parameters, buffers) of these layers stacked along dim 0, detached; cached
        for the current pass (the parameters do not change during it).  Where they are
        rows of a flat parameter (`check_flat`) they are a view of it, not a copy, so
        a parameter changed in place between a forward pass and its backward pass
        would reach the backward pass: `check_versions` refuses that, as autograd
        does in serial training."""
        got = self._stacked.get(layers)
        if got is None:
            rows = self._rows(layers)
            flat = self._flat if rows is not None else {}
            with torch.no_grad():
                # the layers' tensors, only where something is stacked (no Python step
                # per layer where every parameter is a view)
                ts = [self._tensors[a] for a in layers] if self.buffer_names or \
                    len(flat) < len(self.param_names) else []
                params = {n: flat[k][0][rows] if k in flat else
                          torch.stack([t[0][k] for t in ts])
                          for k, n in enumerate(self.param_names)}
                bufs = {n: torch.stack([t[1][k] for t in ts])
                        for k, n in enumerate(self.buffer_names)}
            got = self._stacked[layers] = (params, bufs)
        return got

    def averaged(self, pairs: tuple[tuple[int, int], ...]) -> dict[str, Tensor]:
        """The parameters of the coarse steps a -> b averaged over layers a..b-1
        (`coarse_block`'s "average"), stacked along dim 0, detached (a coarse step's
        parameters get no gradient); cached for the current pass.

        Where the blocks are one range of layers, the averages of a level's aligned
        intervals [j s, (j + 1) s) come from one stack of all the blocks' parameters
        and one mean per parameter and span, made once per pass; the steps asked for
        are rows of it.  Other intervals (a segment's truncated last one) are averaged
        alone."""
        key = ("average", pairs)
        got = self._stacked.get(key)
        if got is not None:
            return got[0]
        span = pairs[0][1] - pairs[0][0]
        rows = self._span_rows(pairs, span)
        with torch.no_grad():
            if rows is not None:
                means, j0 = self._span_means(span)
                r0 = rows[0]
                if rows == list(range(r0, r0 + len(rows))):
                    params = {n: t[r0:r0 + len(rows)] for n, t in means.items()}
                else:
                    at = self._index(rows, next(iter(means.values())).device)
                    params = {n: t.index_select(0, at) for n, t in means.items()}
            else:
                each = [{n: t.mean(dim=0) for n, t in
                         self.stacked(tuple(range(a, b)))[0].items()} for a, b in pairs]
                params = {n: torch.stack([m[n] for m in each]) for n in self.param_names}
        self._stacked[key] = (params, {})
        return params

    def _span_rows(self, pairs: tuple[tuple[int, int], ...], span: int
                   ) -> Optional[list[int]]:
        """Rows of `_span_means(span)` of these steps, or None where one is not an
        aligned whole interval of the blocks' range."""
        if self._range is None:
            return None
        lo, hi = self._range
        j0 = -(-lo // span)
        rows = []
        for a, b in pairs:
            if b - a != span or a % span or a < lo or b > hi:
                return None
            rows.append(a // span - j0)
        return rows

    def _span_means(self, span: int) -> tuple[dict[str, Tensor], int]:
        """({name: [m, *shape]} the parameters averaged over each aligned interval
        [j s, (j + 1) s) inside the blocks' range, j from j0; j0) for this pass."""
        key = ("span", span)
        got = self._stacked.get(key)
        if got is None:
            if self._range is None:  # (`_span_rows` found the steps inside the range)
                raise RuntimeError("internal: span means of blocks that are not one range")
            lo, hi = self._range
            j0, j1 = -(-lo // span), hi // span
            flat = self.stacked(self._every)[0]
            m = max(0, j1 - j0)
            means = {n: t[j0 * span - lo:j0 * span - lo + m * span].view(
                m, span, *t.shape[1:]).mean(dim=1) for n, t in flat.items()}
            got = self._stacked[key] = (means, {"j0": j0})
        return got[0], got[1]["j0"]

    def _index(self, rows: list[int], device: torch.device) -> Tensor:
        """`rows` as an index tensor on `device`, made once and kept across passes (a
        new one each pass is a copy from the host: it made each pass wait for the
        GPU, and a graph capture cannot take it, which left auto's averaged setting
        uncaptured on the H200)."""
        key = ("index", tuple(rows), device)
        got = self._dt.get(key)
        if got is None:
            got = self._dt[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return got

    def dt(self, pairs: tuple[tuple[int, int], ...], like: Tensor) -> Tensor:
        """Step sizes times[b] - times[a] as a [n, 1, ...] tensor on like's device,
        exactly the floats the per-step path uses; cached across passes."""
        key = (pairs, like.dtype, like.device, like.dim())
        got = self._dt.get(key)
        if got is None:
            vals = [self.times[b] - self.times[a] for a, b in pairs]
            got = torch.tensor(vals, dtype=like.dtype, device=like.device)
            got = self._dt[key] = got.view(-1, *([1] * (like.dim() - 1)))
        return got

    def step(self, x: Tensor, pairs: tuple[tuple[int, int], ...],
             params: Optional[dict[str, Tensor]] = None) -> Tensor:
        """Advance the rows of x ([n, *state]) from fine point a_k to b_k with the block
        of layer a_k (injection); `params` replaces the stacked parameters (leaves whose
        gradients the adjoint wants)."""
        layers = tuple(a for a, _ in pairs)
        if params is None and self.coarsening == "average" and \
                any(b_ - a > 1 for a, b_ in pairs):
            p = self.averaged(pairs)  # buffers stay layer a's (`coarse_block`)
            b = self.stacked(layers)[1] if self.buffer_names else {}
        else:
            p, b = self.stacked(layers)
            if params is not None:
                p = params
        fn = self.fn

        def branch(v: Tensor) -> Tensor:
            # under autocast, vmap's linear with a bias returns float32 (its batching
            # rule adds the bias after the low-precision product) where the block's own
            # forward returns the autocast dtype: F(u) takes the state's dtype, as the
            # per-step path's does (`output_message` refuses a block that widens it)
            out = fn(p, b, v)
            return out if out.dtype == v.dtype else out.to(v.dtype)

        dt = self.dt(pairs, x)
        if self.fast is not None:  # fused kernels where measured faster, else torch
            return self.fast(x, p, dt, lambda: self.scheme.step_many(branch, x, dt))
        return self.scheme.step_many(branch, x, dt)

    def probe(self, like: Tensor) -> Optional[str]:
        """Check the vectorised evaluation against the blocks' own forward on a random
        input shaped like one state; the reason it cannot be used, or None."""
        layers = tuple(sorted(self.blocks))[:2]
        g = torch.Generator(device=like.device).manual_seed(1234)
        v = torch.randn((len(layers), *like.shape), generator=g, dtype=like.dtype,
                        device=like.device)
        version = v._version
        bufs = own_buffers(self.blocks[layers[0]])
        before = buffer_versions(bufs)
        self.new_pass()
        try:  # the block's own output first: not one like the state is an error
            with torch.no_grad():
                own = self.blocks[layers[0]](v[0])
        except Exception:  # noqa: BLE001 - the per-step path raises it in its own words
            own = v[0]
        bad = output_message(self.proto, layers[0], None, v[0], own)
        if bad is not None:
            raise ValueError(bad)
        try:
            with torch.no_grad():
                p, b = self.stacked(layers)
                got = self.fn(p, b, v)
                want = torch.stack([self.blocks[a](v[k]) for k, a in enumerate(layers)])
        except Exception as exc:  # noqa: BLE001 - any failure means: do not vectorise
            return f"vmap failed: {type(exc).__name__}: {exc}"
        finally:
            self._stacked = {}
        # not reasons to step layer by layer: errors
        if v._version != version:
            raise ValueError(inplace_message(self.proto, layers[0], None))
        if buffer_versions(bufs) != before:
            raise ValueError(buffer_message(self.proto, layers[0], None, bufs, before))
        if got.shape != want.shape:
            return f"the vectorised output has shape {tuple(got.shape)}, not {tuple(want.shape)}"
        if want.numel() == 0:  # an empty batch: nothing to compare (nor to get wrong)
            return None
        tol = 1e-5 if like.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-12
        if autocast_dtype(like.device) in (torch.float16, torch.bfloat16):
            tol = 3e-2  # products rounded to 8 or 11 bits, summed in another order
        err = float((got - want).abs().max())
        scale = float(want.abs().max()) + 1e-30
        if not err <= tol * max(scale, 1.0):
            return f"the vectorised output differs from the block's forward by {err:.3g}"
        return self._vjp_reason(layers, v, tol)

    def _vjp_reason(self, layers: tuple[int, ...], v: Tensor, tol: float) -> Optional[str]:
        """Why the vectorised step's vector-Jacobian products (the adjoint's and the
        final sweeps' gradients) cannot stand for the blocks' own, or None: vmap may run
        a forward it cannot differentiate (a block checkpointing its activations, say),
        or differentiate it otherwise.  Compared on `v` (one state per layer of
        `layers`) for the input and the parameters every one of them trains."""
        blocks = [dict(self.blocks[a].named_parameters()) for a in layers]
        names = [n for n in self.param_names if all(b[n].requires_grad for b in blocks)]
        g = torch.Generator(device=v.device).manual_seed(4321)
        w = torch.randn(v.shape, generator=g, dtype=v.dtype, device=v.device)
        try:
            with torch.enable_grad():
                p, b = self.stacked(layers)
                leaves = {n: t.detach().requires_grad_(n in names) for n, t in p.items()}
                vin = v.detach().requires_grad_()
                got = torch.autograd.grad(self.fn(leaves, b, vin),
                                          [vin, *(leaves[n] for n in names)], w,
                                          allow_unused=True)
                want = []
                for k, a in enumerate(layers):
                    vk = v[k].detach().requires_grad_()
                    want.append(torch.autograd.grad(
                        self.blocks[a](vk), [vk, *(blocks[k][n] for n in names)], w[k],
                        allow_unused=True))
        except Exception as exc:  # noqa: BLE001 - any failure means: do not vectorise
            return f"vmap's backward failed: {type(exc).__name__}: {exc}"
        finally:
            self._stacked = {}
        for i, mine in enumerate(got):  # (None: no gradient, zeros)
            shaped = [v[k] if i == 0 else blocks[k][names[i - 1]] for k in range(len(layers))]
            theirs = torch.stack([torch.zeros_like(t) if wk[i] is None else wk[i]
                                  for t, wk in zip(shaped, want)])
            if mine is None:
                mine = torch.zeros_like(theirs)
            if theirs.numel() == 0:
                continue
            err = float((mine - theirs).abs().max())
            scale = float(theirs.abs().max())
            if not err <= tol * max(scale, 1.0):
                what = "input" if i == 0 else f"`{names[i - 1]}`"
                return (f"the vectorised step's gradient for its {what} differs from the "
                        f"block's own by {err:.3g}")
        return None
