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
import math
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from .._checks import nonneg_int
from ..mgrit.errors import DivergenceError, RankMismatchError, RemoteError
from ..mgrit.options import MGRITOptions
from ..mgrit.result import MGRITResult
from ..mgrit.transport import DEFAULT_TIMEOUT, Transport, check_timeout, make_transport
from ..mgrit.xbraid import check_engine
from ..ode.coarsening import COARSENINGS
from ..ode.net import ODENet, Segment
from ..ode.rng import DROPOUT_TYPES as _DROPOUT
from ..ode.rng import draw_seed, plain_rng
from . import checkpoint
from .agree import Agreed, check_xbraid, layer_key, same_values, values_fingerprint
from .bn_dropout import batch_norms
from .direct import direct_backward_started
from .grads import GradDelivery
from .grid import ProcessGrid
from .move import Like, move
from .plan import Plan
from .replicas import GradAverager
from .runner import SegmentRunner
from .sharing import SharedParams
from .sharing import add as add_grads
from .sharing import finish as finish_grads
from .tape import PassRecord, PlainRecord

_LINK_TAG = 31002

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


class _NetRef:
    """The whole net, held by the model but not registered as its submodule (only
    this rank's layers are)."""

    __slots__ = ("net",)

    def __init__(self, net: ODENet) -> None:
        self.net = net


class _GridsTimeout:
    """`LayerParallel`'s default `timeout`: `DEFAULT_TIMEOUT`, or the grid's."""

    def __repr__(self) -> str:
        return f"{DEFAULT_TIMEOUT:g} s (the grid's timeout with a grid)"


_GRIDS_TIMEOUT: Any = _GridsTimeout()

#: what ``LayerParallel(net, comm, "auto")`` and ``accuracy=`` build: the policy above
#: the model (`layerpar.parallel.auto.Auto`), which registers itself when imported (the
#: model never imports the policies above it)
_ABOVE: Optional[Callable[..., Any]] = None


def register_above(builder: Callable[..., Any]) -> None:
    """Set what ``LayerParallel(..., "auto")`` and ``LayerParallel(...,
    accuracy=...)`` build instead of a bare model (`layerpar.parallel.auto.Auto`)."""
    global _ABOVE
    _ABOVE = builder


class LayerParallel(nn.Module):
    """Run an `ODENet` layer-parallel over the ranks of `comm` with MGRIT.

    net: an `ODENet`, or a zero-argument factory returning one (called on every rank,
        so seed the global generator first to get the same network everywhere).
    comm: an mpi4py communicator (never COMM_WORLD implicitly), a `torch.distributed`
        process group (e.g. ``torch.distributed.group.WORLD``; gloo or NCCL), or None
        for one rank.
    options / backward_options: `MGRITOptions` of the forward and adjoint solves
        (`final_fc_relax` is always on: the final sweep records states and gradients).
        ``options="auto"`` (with no `backward_options`) builds a
        `layerpar.parallel.auto.Auto` instead, the policy above the model: settings
        chosen by measurement on the first batch (`layerpar.parallel.autotune`), then
        watched by the adaptive policy (`accuracy`, or the default bound).
    accuracy: an `AccuracyPolicy` (or True) builds an `Auto` too: adaptive iteration
        counts on these options (`layerpar.parallel.adaptive`).  The model itself runs
        one setting; None here.
    above: what the `Auto` building this model asks every rank to agree on (its
        settings' key, and the error it refuses them with, if any).
    coarsening: parameter coarsening on coarse levels, "injection" or "average".
    state_dict: optional whole-network state dict to load before distributing.
    batched: "auto" (default with the native engine): at the first pass for each input
        shape, time one fine-level batch of steps (with their vector-Jacobian products)
        vectorised and layer by layer, and run the faster (`cycle_paths` says what was
        chosen and measured; logged on the "layerpar" logger).  True: always advance all
        independent intervals of a level in one vectorised step (see
        `layerpar.parallel.batched`); False: step layer by layer, as a reference.
        Blocks that cannot be vectorised step layer by layer, with one warning.
    engine: "native" (default) or "xbraid": the MGRIT solves run through XBraid itself
        (when built; `layerpar.mgrit.xbraid`).  XBraid steps layer by layer (True for
        `batched` is refused), needs an mpi4py communicator, and partitions the layers
        itself: each segment's layers must be divisible by the ranks.
    timeout: seconds any one wait for another rank may take (messages, reductions; default
        10 minutes, or the `grid`'s `timeout` with a grid; None: unbounded).  On expiry
        the waiting rank raises `TimeoutError` naming what it waited for, the rank, and
        the batch, and tells the others: a rank that stopped, skipped a backward() or
        hangs ends the job with a message.
    check_inputs: for this many first batches (default 10; 0: never), compare a cheap
        fingerprint of the input and of the loss gradient between ranks and raise
        `RankMismatchError` when they differ.  Only rank 0's input and the last rank's
        loss gradient are used, so rank-dependent data would otherwise give a wrong
        model silently.
    check_finite: check every output and loss gradient for NaN/inf (one flag read back
        from the device per pass; a non-finite one raises `DivergenceError`).  With
        False and fixed iteration counts (tol = rtol = 0) a training step on one GPU
        has no host-device synchronisation at all; residual histories are then read
        back when `last_forward[i].residual_history` is first looked at.
    grid: a `ProcessGrid` instead of `comm`: data parallelism x layer parallelism.
        MGRIT runs over this process's layer group, and each parameter gradient is
        averaged over the replicas (bucketed reductions started as the adjoint's
        final sweep produces them, overlapped with the rest of the backward pass).
        Each replica passes its own shard of the batch (`ProcessGrid.sampler`); the
        gradients are then those of the mean loss over the global batch.  Buffers
        (batch-norm running statistics) stay per replica; checkpoints come from
        each replica's own layers and load on any grid shape.  With data > 1,
        ``options="auto"`` and `accuracy` are refused: they decide from each replica's
        own batches and clocks, and replicas that decided differently could not
        average their gradients.

    Same forward signature as the serial net: pass the input on every rank; the output
    (and so the loss) is returned on every rank.  `named_parameters()` yields only this
    rank's parameters, under the names they have in the serial net.  After each pass
    `last_forward` / `last_backward` report MGRIT iterations and residuals per segment.

    A parameter that several layers use (one block module for every step, a
    time-invariant ODE; weights tied between layers) gets, as in serial autograd, the
    sum of its uses' gradients: summed on each rank, then over the ranks whose layers
    use it (one all-reduce per backward pass, only for nets with such parameters;
    `layerpar.parallel.sharing`), so each rank's copy gets the same gradient and, with
    the same optimizer, stays equal to the others'.

    On one rank with sequential forward and adjoint solves (`max_levels=1` for both,
    the default) the model runs in *direct mode*: the forward sweep is recorded onto
    the input's own graph and PyTorch's engine runs the backward, which is then
    exactly the adjoint solve and costs what plain PyTorch costs.  Otherwise the
    forward and adjoint MGRIT solves run inside one autograd Function whose inputs are
    this rank's trainable parameters.  Both keep serial semantics for `backward()`,
    `torch.autograd.grad`, `backward(inputs=...)` and frozen parameters.
    """

    def __new__(cls, net: Any = None, comm: Any = None, options: Any = None,
                *args: Any, **kwargs: Any) -> Any:
        """``options="auto"`` or an `accuracy` policy: the `Auto` above a model of
        these settings (a thin constructor of it), else a model."""
        if (isinstance(options, str) and options == "auto") or \
                kwargs.get("accuracy") not in (None, False):
            if _ABOVE is None:  # (`layerpar.parallel` imports it)
                raise RuntimeError("options='auto' and `accuracy` need "
                                   "layerpar.parallel.auto imported")
            return _ABOVE(net, comm, options, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, net: Union[ODENet, Callable[[], ODENet]], comm: Any = None,
                 options: Optional[MGRITOptions] = None,
                 backward_options: Optional[MGRITOptions] = None, *,
                 coarsening: str = "injection",
                 state_dict: Optional[dict[str, Tensor]] = None,
                 batched: Union[bool, str, None] = None, check_finite: bool = True,
                 timeout: Any = _GRIDS_TIMEOUT, check_inputs: int = 10,
                 grid: Optional[ProcessGrid] = None, accuracy: Any = None,
                 engine: str = "native",
                 above: Optional[tuple[dict[str, Any], Optional[BaseException]]] = None
                 ) -> None:
        super().__init__()
        if grid is not None:
            if not isinstance(grid, ProcessGrid):
                raise TypeError(f"`grid` must be a ProcessGrid, got {type(grid).__name__}")
            if comm is not None:
                raise TypeError("pass `comm` or `grid`, not both (the grid holds the "
                                "communicator)")
            self.transport, self._data_transport = grid.transports()
            world: Transport = grid.world
            # the per-pass agreements, over the whole grid where it has replicas
            self._agreements = grid.whole() if self._data_transport is not None else None
            if timeout is _GRIDS_TIMEOUT:  # (a grid's timeout was silently overridden)
                timeout = grid.timeout
        else:
            self.transport = make_transport(comm)
            self._data_transport = None
            self._agreements = None
            world = self.transport
        if timeout is _GRIDS_TIMEOUT:
            timeout = DEFAULT_TIMEOUT
        self.grid = grid
        above_key, err = ({"accuracy": None, "auto": False}, None) if above is None \
            else above
        options = MGRITOptions(max_levels=1) if options is None else options
        backward_options = options if backward_options is None else backward_options
        key: Any = None
        try:
            if err is not None:
                raise err
            if not isinstance(net, ODENet):
                if not callable(net):
                    raise TypeError(f"`net` must be an ODENet or a factory returning one, got "
                                    f"{type(net).__name__}")
                net = net()
                if not isinstance(net, ODENet):
                    raise TypeError(f"the `net` factory returned {type(net).__name__}, "
                                    "not an ODENet")
            meta = next((n for n, t in [*net.named_parameters(), *net.named_buffers()]
                         if t.is_meta), None)
            if meta is not None:  # (it failed deep in the first pass, naming nothing)
                raise ValueError(f"`net` is on the meta device ({meta}, say): it has shapes "
                                 "but no values.  Materialise it first "
                                 "(`net.to_empty(device=...)`, then initialise it, or load "
                                 "a state dict with `assign=True`)")
            for name, o in (("options", options), ("backward_options", backward_options)):
                if not isinstance(o, MGRITOptions):
                    raise TypeError(f"`{name}` must be an MGRITOptions"
                                    + (" or 'auto'" if name == "options" else "")
                                    + f", got {o!r}")
            timeout = check_timeout(timeout)
            nonneg_int("check_inputs", check_inputs)
            check_engine(engine)
            if batched is None:
                batched = "auto" if engine == "native" else False
            if not (isinstance(batched, bool) or batched == "auto"):
                raise TypeError(f"`batched` must be True, False or \"auto\", got "
                                f"{batched!r}")
            if not isinstance(check_finite, bool):
                raise TypeError(f"`check_finite` must be a bool, got "
                                f"{type(check_finite).__name__}")
            if accuracy not in (None, False):  # (`__new__` builds an Auto for it)
                raise TypeError("`accuracy` needs the policy above the model: build "
                                "`layerpar.parallel.auto.Auto`")
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
            if engine == "xbraid":
                check_xbraid(self.transport, net, options, backward_options, batched,
                              grid is not None, None)
            key = {**{f"options.{k}": v for k, v in options.key().items()},
                   **{f"backward_options.{k}": v for k, v in backward_options.key().items()},
                   "coarsening": coarsening, "batched": batched, "check_finite": check_finite,
                   "engine": engine,
                   "timeout": timeout, "check_inputs": check_inputs,
                   **above_key,
                   **{name: v for k, m in enumerate(net.layers)
                      for name, v in layer_key(k, m).items()}}
        except Exception as exc:  # noqa: BLE001 - re-raised identically on every rank
            err = exc
        world.agree(key, err, "LayerParallel settings (options, coarsening, layers; "
                             "`layers.k.structure` is a digest of layer k's structure: "
                             "module types, parameter shapes, attributes such as the "
                             "activation)")
        assert isinstance(net, ODENet)
        self.options = options
        self.backward_options = backward_options
        self.transport.timeout = timeout
        for extra in (self._data_transport, self._agreements):
            if extra is not None:
                extra.timeout = timeout
        # gradients averaged over the replicas of a process grid (data parallelism)
        self._averager = grid.sync.averager() if grid is not None else None
        # and batch norms' running statistics, at the end of every backward pass
        # (`_average_running_stats`): the sync's metered transport where it has one
        stats_transport = None if grid is None or grid.data == 1 else \
            getattr(grid.sync, "data", None) or self._data_transport
        self._stats_averager = None if stats_transport is None else \
            GradAverager(stats_transport)
        self._running_stats: Optional[list[tuple[nn.Module, str]]] = None  # at first use
        self._batch = 0  # forward passes so far: named in a TimeoutError
        self.check_inputs = check_inputs
        self.coarsening = coarsening
        size, rank = self.transport.size, self.transport.rank
        self._layers_meta: list[tuple[str, Any]] = []
        shards: list[nn.Module] = []
        self._runners: dict[int, SegmentRunner] = {}
        first_seg = min(k for k, _ in net.segments)
        # direct passes (one rank, sequential forward and adjoint: see _forward_direct)
        direct_ok = size == 1 and self._averager is None and engine == "native"
        seg_index = 0
        for k, layer in enumerate(net.layers):
            if isinstance(layer, Segment):
                runner = SegmentRunner(layer, seg_index, self.transport, options,
                                        backward_options, coarsening, batched,
                                        engine=engine, direct_ok=direct_ok)
                runner.averager = self._averager
                runner.replicas = self._data_transport
                self._runners[k] = runner
                shards.append(_SegmentShard(layer, runner.owned))
                self._layers_meta.append(("segment", seg_index))
                seg_index += 1
            else:
                owner = 0 if k < first_seg else size - 1
                shards.append(layer if owner == rank else _Remote(owner))
                self._layers_meta.append(("plain", owner))
        self.layers = nn.ModuleList(shards)
        # parameters several layers use (one block for every step; tied weights):
        # every use's gradient summed, over the ranks too (`sharing`)
        self._shared = SharedParams.build(self._layer_owners(net))
        self._param_list: Optional[list[nn.Parameter]] = None
        self._deliver = GradDelivery()
        self._closed = False
        # joins the backward on a rank with nothing of its own to differentiate
        self._anchor = torch.zeros((), requires_grad=True)
        self.check_finite = check_finite
        for r in self._runners.values():
            r.check_finite = check_finite
        self._shape_cache: dict[tuple, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        self.engine = engine
        self._direct = all(r.direct for r in self._runners.values())
        self._direct_exact = direct_ok  # exact passes (see `exact`) run direct
        # what `like` needs to build the same model with other settings (the whole net
        # held outside nn.Module's registry: it is not this rank's submodule)
        self._whole, self._comm_arg = _NetRef(net), comm
        self._init_kwargs = {"grid": grid, "coarsening": coarsening, "batched": batched,
                             "engine": engine,
                             "check_finite": check_finite, "timeout": timeout,
                             "check_inputs": check_inputs}
        self._has_dropout = \
            any(isinstance(m, _DROPOUT) for m in net.modules())
        #: per segment, what the last forward / backward pass's solves reached
        self.last_forward: list[MGRITResult] = []
        self.last_backward: list[MGRITResult] = []
        self._checking = False  # inside `checking()`: a gradient check's passes
        self._exact_pass = False  # inside `exact()`: passes run exact propagation

    def _layer_owners(self, net: ODENet) -> list[tuple[str, nn.Module, int]]:
        """(name, module, owner rank) of every layer of the whole net, a segment's
        blocks one by one (the same on every rank)."""
        out: list[tuple[str, nn.Module, int]] = []
        for k, layer in enumerate(net.layers):
            kind, info = self._layers_meta[k]
            if kind == "plain":
                out.append((f"layers.{k}", layer, info))
                continue
            part = self._runners[k].part
            out.extend((f"layers.{k}.blocks.{n}", layer.blocks[n], q)
                       for q in range(self.size) for n in part.steps(q))
        return out

    @property
    def plan(self) -> Plan:
        """Where everything runs: per segment, the layers and level points of each rank,
        the ghost blocks and the states that cross ranks (`Plan`; print it)."""
        return Plan.build(self._whole.net, self.size, self.options, self.backward_options,
                          self.coarsening)

    @property
    def cycle_paths(self) -> list[dict[tuple, Any]]:
        """Per segment, input shape -> `PathChoice` (vectorised or per-step cycles, and
        the seconds measured for each where ``batched="auto"`` chose)."""
        return [{key[0]: c for key, c in r.paths.items()} for r in self._runners.values()]

    # -- hooks for the helper modules (accuracy, adaptive, autotune, refine, capture) --------
    @property
    def whole_net(self) -> ODENet:
        """The whole `ODENet` this model was built from, on every rank: this rank's
        layers are its modules; the others are not trained here (stale copies)."""
        return self._whole.net

    @property
    def layer_kinds(self) -> list[tuple[str, int]]:
        """Per layer of the net: ("segment", segment index) or ("plain", owner rank)."""
        return list(self._layers_meta)

    @property
    def batch(self) -> int:
        """Forward passes run so far (named in errors and timeouts); a policy above
        the model sets it back where it drops a pass (adaptive accuracy's recomputed
        batches, auto's batch numbering)."""
        return self._batch

    @batch.setter
    def batch(self, value: int) -> None:
        self._batch = value

    @property
    def has_dropout(self) -> bool:
        """Whether a layer of the net has dropout (each rank would draw its own masks
        outside a layer-parallel pass)."""
        return self._has_dropout

    @property
    def averages_replicas(self) -> bool:
        """Whether data replicas' gradients are averaged inside the pass (a grid with
        a data dimension)."""
        return self._averager is not None

    @property
    def averager(self) -> Any:
        """The data replicas' gradient averager (`parallel.replicas.GradAverager`: its
        `last_seconds`, `total_seconds`, bytes), None without a data dimension."""
        return self._averager

    #: the tuner and the adaptive controller of the policy above a model (`Auto`'s);
    #: a model alone runs its one setting
    tuner: None = None
    accuracy: None = None

    @property
    def runners(self) -> list[SegmentRunner]:
        """This rank's segment runners, in layer order (read them: cycle paths, the
        batched blocks and the fused-kernel choice each uses)."""
        return list(self._runners.values())

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Passes inside are a gradient check's: the batch counter is put back
        afterwards and batch norms' statistics are not averaged over the replicas
        (they are not training batches)."""
        checking, self._checking = self._checking, True
        batch = self._batch
        try:
            yield
        finally:
            self._checking = checking
            self._batch = batch

    @property
    def closed(self) -> bool:
        """Whether `close()` released this model's communicator."""
        return self._closed

    def set_iterations(self, fwd: int, bwd: int) -> None:
        """Forward / adjoint MGRIT iterations of every segment from the next pass on
        (adaptive accuracy; the options' other settings stay)."""
        for runner in self._runners.values():
            runner.set_iterations(fwd, bwd)

    def reset_grad_delivery(self) -> None:
        """Forget the cached gradient-accumulation nodes (`grads.GradDelivery`), every
        model's (models share parameters, and a node is its parameter's), so that the
        next pass makes them on its own stream: `capture_step` calls it before
        capturing."""
        self._deliver.reset()

    @contextlib.contextmanager
    def exact(self) -> Iterator[None]:
        """Passes run inside (and their backward passes, wherever those run) use exact
        propagation: sequential solves both ways, as with ``max_levels=1``, on this
        model's own plan, ranks, communicator and parameters; at one rank in direct
        mode (plain serial autograd).  Collective like any pass."""
        prev, self._exact_pass = self._exact_pass, True
        try:
            yield
        finally:
            self._exact_pass = prev

    def like(self, net: Optional[ODENet] = None, options: Optional[MGRITOptions] = None,
             backward_options: Optional[MGRITOptions] = None, **settings: Any
             ) -> LayerParallel:
        """A new LayerParallel over the same ranks (or grid) with this model's
        settings (collective: call on every rank; close() it when done).

        net: default this model's own whole net, so the new model's layers are these
            modules (the same parameter tensors).
        options / backward_options: default this model's; `backward_options` defaults
            to `options` where only those are given.
        settings: any other keyword of `LayerParallel` to change (e.g. ``batched``,
            ``accuracy``).
        """
        if options is None:
            options = self.options
            backward_options = self.backward_options if backward_options is None \
                else backward_options
        return type(self)(self._whole.net if net is None else net, self._comm_arg, options,
                          backward_options, **{**self._init_kwargs, **settings})

    # -- helpers ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

    def _move(self, t: Optional[Tensor], src: int, dst: int, shape: tuple,
              dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
        """An activation (or its gradient) handed from rank `src` to `dst`: the tensor
        received on `dst`, `t` as it was elsewhere."""
        item = Like(shape, dtype, device) if self.rank == dst else t
        return move(self.transport, [(src, dst, item)], tag=_LINK_TAG,  # type: ignore[return-value]
                    what="an activation")[0]

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
        return self.transport.bcast_tensor(t, root, shape, dtype, device,
                                           "the broadcast output or input gradient")

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run `fn`; an exception raised on this rank alone is sent to the others.
        Errors every rank raises by itself (same data, same check) are not sent: the
        notice could overtake the other ranks' own, clearer error.  A divergence in one
        data replica is sent (naming the replica): the other replicas saw other data."""
        try:
            return fn()
        except DivergenceError as exc:
            grid = self.grid
            if grid is None or grid.data == 1:
                raise  # the layer group's ranks all see it (adaptive accuracy recovers)
            # the other replicas hold other data and would wait for this one's gradients
            first = grid.data_rank * grid.layers
            named = DivergenceError(f"data replica {grid.data_rank} (global ranks "
                                    f"{list(range(first, first + grid.layers))}): {exc}")
            self.transport.broadcast_error(named)
            raise named from exc
        except (RemoteError, RankMismatchError):
            raise
        except BaseException as exc:
            self.transport.broadcast_error(exc)
            raise

    # -- passes ----------------------------------------------------------------------------------
    def _refuse_after_failure(self) -> None:
        """Refuse a pass once a pass of this model failed on any rank (at 2+ ranks): its
        messages may still be in flight, and the next pass would read them.  Every rank
        raises this (the one that failed too), with the first failure named; before,
        each later call raised the old error again as `RemoteError`, on the failing
        rank naming that rank itself, which read as a new failure."""
        if self.size == 1 and self._agreements is None:
            return
        for t in (self.transport, self._data_transport, self._agreements):
            broken = None if t is None else t.failure
            if broken is not None:
                raise RuntimeError(
                    f"this LayerParallel cannot run again: an earlier pass failed ({broken}),"
                    " and a pass that failed may leave messages in flight for the next one "
                    "to read. Build a new LayerParallel (and close() this one); under "
                    "`python -m mpi4py` the first failure ends the job instead") from broken

    def _agree(self, x: Tensor) -> Agreed:
        """One collective per forward pass, before any other message: every rank has the
        same input shape, dtype, training and grad mode, and every rank takes the same
        path.  A pass records for the backward if any rank has something to
        differentiate (its input or a trainable parameter), so a rank whose own
        parameters are all frozen still joins the backward; the input's gradient is
        sent back if any rank wants it.  Also brings rank 0's dropout seed."""
        grad_mode = torch.is_grad_enabled()
        x_rg = bool(x.requires_grad)
        p_rg = any(p.requires_grad for p in self._param_list)  # type: ignore[union-attr]
        # drawn on every rank (rank 0's is used): each rank's global generator then
        # advances as serial `ODENet.forward` advances it, and the ranks' generators
        # stay in step (a DataLoader shuffling from them gives every rank the same batches)
        seed = draw_seed() if self.training and self._has_dropout else None
        key = (tuple(x.shape), str(x.dtype), self.training, grad_mode)
        if self._agreements is not None:
            return self._agree_on_grid(x, key, x_rg, p_rg, seed)
        if self.size == 1:
            return Agreed(grad_mode and (x_rg or p_rg), x_rg, seed)
        probe = values_fingerprint(x) if self._batch <= self.check_inputs else None
        got = self.guard(lambda: self.transport.allgather_object(
            (key, x_rg, p_rg, seed, probe), "the forward pass's agreement on the input"))
        keys = [g[0] for g in got]
        if any(k != keys[0] for k in keys):
            raise RankMismatchError(f"the input differs between ranks (shape, dtype, "
                                    f"training, grad mode): {keys}")
        same_values([g[4] for g in got], "the input `x`", "pass the same batch on every "
                     "rank (only rank 0's is used)")
        any_x = any(g[1] for g in got)
        return Agreed(grad_mode and (any_x or any(g[2] for g in got)), any_x, got[0][3])

    def _agree_on_grid(self, x: Tensor, key: tuple, x_rg: bool, p_rg: bool,
                       seed: Optional[int]) -> Agreed:
        """`_agree` on a grid with replicas: one collective over the whole grid, each
        process checking every group from it, so a mismatch raises alike everywhere.
        Replicas hold other samples of the same shapes, and take the same kind of pass
        (exact propagation hands its gradients to the replicas' averaging layer by
        layer, MGRIT's batched records several layers at a time, and the reductions
        must pair up bucket by bucket); the ranks of a replica hold the same input.
        (Checked per group before, a mismatch inside one replica raised on some ranks
        and left the others waiting out the timeout, and a rank that skipped a
        backward() was found only by the timeout.)"""
        assert self.grid is not None and self._agreements is not None
        probe = values_fingerprint(x) if self.size > 1 and \
            self._batch <= self.check_inputs else None
        self._agreements.set_context(f"batch {self._batch}, forward pass")
        got = self.guard(lambda: self._agreements.allgather_object(
            (key, self._exact_pass, x_rg, p_rg, seed, probe),
            "the forward pass's agreement on the input (whole grid)"))
        layers = self.grid.layers
        replicas = [got[d * layers:(d + 1) * layers] for d in range(self.grid.data)]

        def what(k: tuple) -> str:
            return f"shape {k[0]}, dtype {k[1]}, training={k[2]}, grad mode={k[3]}"

        for d, group in enumerate(replicas):  # the ranks of one replica: the same batch
            if any(g[0] != group[0][0] for g in group):
                detail = "; ".join(f"rank {d * layers + q} has {what(g[0])}"
                                   for q, g in enumerate(group))
                raise RankMismatchError(
                    f"the input differs between the ranks of data replica {d}: {detail}. "
                    "Every rank of a replica must pass the same batch (only its first "
                    "rank's is used)")
        if any(group[0][0] != got[0][0] for group in replicas):
            detail = "; ".join(f"replica {d} has {what(group[0][0])}"
                               for d, group in enumerate(replicas))
            raise RankMismatchError(
                f"the input differs between data replicas: {detail}. Every replica must "
                "pass batches of the same shape (use ProcessGrid.sampler, drop_last=True, "
                "and the same per-replica batch size)")
        if any(g[1] != got[0][1] for g in got):
            exact = sorted({q // layers for q, g in enumerate(got) if g[1]})
            raise RankMismatchError(
                f"data replica(s) {exact} run this pass with exact propagation and the "
                "others with MGRIT: the replicas' gradients could not be averaged "
                "(`model.exact()` on some replicas only)")
        for d, group in enumerate(replicas):
            same_values([g[5] for g in group], f"the input `x` of data replica {d}",
                        "pass the same batch on every rank of a replica (only its first "
                        "rank's is used)")
        mine = replicas[self.grid.data_rank]
        # every replica records alike (their gradients are averaged pass by pass)
        record = key[3] and any(g[2] or g[3] for g in got)
        return Agreed(record, any(g[2] for g in mine), mine[0][4])

    def _forward_impl(self, ctx: PassRecord, x: Tensor, record: bool,
                      seed: Optional[int]) -> Tensor:
        size, rank = self.size, self.rank
        last = size - 1
        key = (tuple(x.shape), str(x.dtype), self.training, record)
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
                    h = self._move(h, holder, owner, shape, dtype, x.device)
                    holder = owner
                if rank == owner:
                    if ctx.direct:  # onto the caller's graph
                        with torch.enable_grad(), plain_rng(seed, k, self.layers[k]):
                            h = self.layers[k](h)
                        continue
                    prev = ctx.plain.get(k - 1) if record else None
                    with plain_rng(seed, k, self.layers[k]):
                        rec = PlainRecord(self.layers[k], h, record,  # type: ignore[arg-type]
                                           prev)
                    ctx.plain[k] = rec
                    h = rec.y.detach()
            else:
                runner = self._runners[k]
                if holder != 0:
                    shape, dtype = meta(h, holder)
                    h = self._move(h, holder, 0, shape, dtype, x.device)
                    holder = 0
                shape, dtype = meta(h, 0)
                ctx.shapes.append((shape, dtype))
                like = torch.empty(shape, dtype=dtype, device=x.device)
                runner.ghosts.set_training(self.training)
                if size > 1 and not ctx.exact:  # exact propagation has no coarse steps
                    runner.ghosts.sync(self.transport)
                tape = runner.new_tape(record and not ctx.direct, seed)
                if ctx.direct:
                    assert h is not None
                    h, stats = runner.forward_direct(h, tape, check_shapes=cached is None,
                                                     exact=ctx.exact)
                else:
                    h, stats = runner.forward(h if rank == 0 else None, like, tape,
                                              check_shapes=cached is None, exact=ctx.exact)
                if tape.recording:
                    ctx.tapes[k] = tape
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

    def _backward_impl(self, ctx: PassRecord, gy: Tensor) -> tuple[Optional[Tensor], dict]:
        probe = values_fingerprint(gy) \
            if self.size > 1 and self._batch <= self.check_inputs else None
        # on a grid with replicas and several layer ranks, over the whole grid (every
        # process checks every replica) instead of the layer group: a rank that skipped
        # a backward() then meets the others' check in its next forward's agreement,
        # and the labels say where each one is.  With one layer rank per replica there
        # was no exchange here, and one more per step cost 3-4 % of a small net's batch
        # (`make bench-grid`, 2 x 1): a skipped backward is then found by the timeout
        whole = self._agreements if self.size > 1 else None
        if self.check_finite or probe is not None or whole is not None:
            bad = 0.0 if not self.check_finite or bool(torch.isfinite(gy).all()) else 1.0
            if whole is not None:
                whole.set_context(f"batch {self._batch}, backward pass")
                got_all = whole.allgather_object((bad, probe), "the loss-gradient check "
                                                 "(whole grid)")
                layers = self.grid.layers  # type: ignore[union-attr]
                d0 = self.grid.data_rank * layers  # type: ignore[union-attr]
                got = got_all[d0:d0 + layers]
                bad_ranks = [q for q, (f, _) in enumerate(got) if f]
                if not any(f for f, _ in got_all):
                    for d in range(len(got_all) // layers):
                        same_values([p for _, p in got_all[d * layers:(d + 1) * layers]],
                                    f"the loss gradient of data replica {d}",
                                    "compute the loss from the same outputs and targets "
                                    "on every rank of a replica (only its last rank's "
                                    "gradient is used)")
            elif self.size > 1:  # one small exchange: every rank stops, none waits
                got = self.transport.allgather_object((bad, probe), "the loss-gradient check")
                bad_ranks = [q for q, (f, _) in enumerate(got) if f]
                if not bad_ranks:
                    same_values([p for _, p in got], "the loss gradient",
                                 "compute the loss from the same outputs and targets on "
                                 "every rank (only the last rank's gradient is used)")
            else:
                bad_ranks = [0] if bad else []
            if bad_ranks:
                where = "" if self.size == 1 else f" on rank(s) {bad_ranks}"
                raise DivergenceError(f"the loss gradient is not finite{where} (NaN or inf "
                                      "loss?)")
        size, rank = self.size, self.rank
        grads: dict[int, Tensor] = {}  # id(parameter) -> gradient (Tensor.__hash__ is slow)
        extra: list[tuple[int, Tensor]] = []  # a shared parameter's further uses
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
                    g = self._move(g, holder, owner, *g_meta, gy.device)
                    holder = owner
                if rank == owner:
                    rec = ctx.plain[k]
                    nxt = ctx.plain.get(k + 1)
                    if nxt is None or nxt.head is not rec.head:
                        # the last layer of a group: back-propagate the whole group
                        head = rec.head
                        wrt = [head.x] if head.x.requires_grad else []  # (not token ids)
                        outs = torch.autograd.grad(rec.y, [*wrt, *rec.group_params], g,
                                                   allow_unused=True)
                        g, outs = (outs[0], outs) if wrt else (None, (None, *outs))
                        if self._averager is not None:
                            self._averager.add(outs[1:])
                        add_grads(grads, extra, ((id(p), gp) for p, gp in
                                                 zip(rec.group_params, outs[1:])
                                                 if gp is not None))
            else:
                runner = self._runners[k]
                shape, dtype = seg_shapes.pop()
                like = torch.empty(shape, dtype=dtype, device=gy.device)
                if holder != size - 1:
                    g = self._move(g, holder, size - 1, shape, dtype, gy.device)
                    holder = size - 1
                g, stats, seg_grads = runner.backward(g if rank == size - 1 else None, like,
                                                      ctx.tapes.pop(k), extra)
                self.last_backward.append(stats)
                if self._shared is None:
                    grads.update(seg_grads)
                else:
                    add_grads(grads, extra, seg_grads.items())
                holder = 0
                g_meta = (shape, dtype)
        self.last_backward.reverse()
        if self._averager is not None:
            self._averager.finish()
        if self._shared is not None:
            # every use of a shared parameter, once the replicas averaged each use's
            # gradient in place, then over the ranks whose layers use it
            finish_grads(grads, extra)
            self._shared.reduce(grads, self.transport, rank)
        if self.training and self._stats_averager is not None and not self._checking:
            self._average_running_stats()
        gx = None
        if ctx.x_requires_grad:
            gx = self._bcast(g, holder, ctx.x_shape, ctx.x_dtype, gy.device)
        return gx, grads

    def forward(self, x: Tensor) -> Tensor:
        """Layer-parallel forward pass; pass the same `x` on every rank."""
        return self._forward_once(x)

    def _forward_once(self, x: Tensor) -> Tensor:
        if self._closed:
            raise RuntimeError("this LayerParallel was closed (close() released its "
                               "communicator); build a new one to run again")
        self._refuse_after_failure()
        if not isinstance(x, Tensor):
            raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
        if x.is_meta:
            raise ValueError("`x` is on the meta device: it has a shape but no values")
        if self._param_list is None:  # walking the module tree costs ~5 us per layer
            self._param_list = list(self.parameters())
        self._batch += 1
        self.transport.set_context(f"batch {self._batch}, forward pass")
        agreed = self._agree(x)
        if not agreed.record:
            ctx = PassRecord()
            ctx.exact = self._exact_pass
            return self.guard(lambda: self._forward_impl(ctx, x, False, agreed.seed))
        if self._direct_exact if self._exact_pass else self._direct:
            return self._forward_direct(x, agreed.seed)
        params = [p for p in self._param_list if p.requires_grad]
        if not params and not x.requires_grad:
            # nothing to differentiate here, but other ranks do: the output must still
            # carry a graph so that this rank's backward() joins theirs
            params = [self._anchor]
        return _LayerParallelFunction.apply(self, agreed, x, *params)

    def _average_running_stats(self) -> None:
        """Average this process's batch norms' running statistics over the data
        replicas (collective over the data group; at the end of each backward pass,
        when its graph is spent).
        Each replica updated them from its own share of the batch, so without this
        the replicas' statistics drift apart: an evaluation, and the state dict saved,
        would depend on the replica (PyTorch's DDP broadcasts replica 0's instead; the
        average of the replicas' updates is the update of the shares' mean statistics).
        """
        if self._running_stats is None:
            self._running_stats = [(m, name) for m in batch_norms(self)
                                   for name in ("running_mean", "running_var")]
        if not self._running_stats:
            return
        averager = self._stats_averager
        assert averager is not None
        # averaged in copies, which then become the buffers: a pass still waiting for
        # its backward (two forwards, one backward) saved the old ones in its graph
        copies = [getattr(m, name).clone() for m, name in self._running_stats]
        self.guard(lambda: (averager.add(copies), averager.finish()))
        for (m, name), t in zip(self._running_stats, copies):
            setattr(m, name, t)

    def _forward_direct(self, x: Tensor, seed: Optional[int]) -> Tensor:
        """Direct mode: one rank, forward and adjoint both sequential.

        The adjoint solve would then be exactly backpropagation through the recorded
        final sweep, which here is the serial network's own graph; so the steps are
        recorded onto `x`'s graph and PyTorch's engine runs the backward.  Parameters
        are the graph's leaves as in plain PyTorch: `autograd.grad`, `backward(inputs=)`
        and hooks behave as in serial code, and no autograd Function with one input per
        parameter stands in between (that cost ~4.5 us per parameter per backward pass).
        """
        ctx = PassRecord()
        ctx.direct, ctx.exact = True, self._exact_pass
        with torch.no_grad():  # only the recording itself builds a graph
            y = self.guard(lambda: self._forward_impl(ctx, x, True, seed))
        if y.requires_grad:
            y.register_hook(lambda gy: direct_backward_started(self, gy))
        return y

    def refine(self, factor: int = 2, interpolation: str = "constant") -> LayerParallel:
        """This model with `factor` times the layers per segment, parameters interpolated
        in time (`layerpar.ode.refine`): nested iteration on the same ranks, each rank
        receiving only the layers it needs from its neighbours (collective)."""
        from .refine import refine_parallel

        return refine_parallel(self, factor, interpolation)

    def check_gradients(self, x: Tensor, y: Any,
                        loss_fn: Callable[[Tensor, Any], Tensor]) -> Any:
        """How far this model's (inexact) gradient of one batch is from the exact one.

        Collective: every rank passes the same `x` and `y`.  Runs the batch with this
        model's options and exactly (`exact`: sequential solves on the same plan, ranks
        and parameters), without touching `.grad`, the
        training mode, the random generator or batch-norm statistics.  Returns a
        `layerpar.parallel.accuracy.GradientCheck` (relative errors of the output, the
        input and parameter gradients, per segment and in all, the cosine, and the
        inexact solves' iterations and residuals), identical on every rank.
        """
        from .accuracy import check_gradients  # (a measurement: it imports no model)

        with self.checking():
            return check_gradients(self, x, y, loss_fn)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole network (collective: call it on
        every rank, after ``backward()``).  Each rank holds only its layers' gradients,
        so ``clip_grad_norm_(model.parameters(), ...)`` on each rank clips by that rank's
        part of the norm: every rank scaled differently and training left serial's
        (a user's trial: parameters 6e-4 to 2e-3 off serial's after 3 steps).  Here the
        ranks' parts are summed (in rank order, so the norm is the same on every rank)
        and every gradient is scaled by ``max_norm / total`` where the total exceeds
        it.  With data replicas the gradients are already averaged, so each replica
        computes the same norm over its layer ranks.  Returns the total norm (float64).
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or \
                not max_norm >= 0:  # (NaN fails the comparison)
            raise ValueError(f"`max_norm` must be a number >= 0, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or \
                not norm_type > 0:
            raise ValueError(f"`norm_type` must be a number > 0 (or inf), got {norm_type!r}")
        p = float(norm_type)
        params = [q for q in self.parameters() if q.grad is not None]
        local = 0.0
        # a parameter whose layers lie on several ranks has the same gradient on each:
        # counted once, on the first of them
        counted = params if self._shared is None else \
            [q for q in params if self._shared.counts_here(q, self.rank)]
        if counted:
            part = float(torch.nn.utils.get_total_norm([q.grad for q in counted], p))
            local = part if p == float("inf") else part ** p
        parts = [local] if self.size == 1 else self.guard(
            lambda: self.transport.allgather_object(local, "clip_grad_norm_"))
        total = max(parts) if p == float("inf") else sum(parts) ** (1.0 / p)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"the total norm of order {p:g} of the gradients is "
                               f"{total}, so it cannot be clipped (error_if_nonfinite)")
        norm = torch.tensor(total, dtype=torch.float64)
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # -- portability ------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        """`nn.Module.load_state_dict`, which also takes the whole network's state dict
        (`gather_state_dict`, or the serial `ODENet`'s) on any number of ranks: each
        rank loads its own part.  Not collective, yet a whole-network dict is checked
        whole on every rank (each holds the whole net's names and shapes): a key of no
        layer, a wrong shape anywhere, and with `strict` a key missing anywhere raise
        alike on every rank, before anything is loaded.  A dict of this rank's keys
        only (its own ``state_dict()``) is this rank's part and is checked as such.

        assign: refused (`ValueError`).  layerpar holds this rank's parameter tensors
        beyond the modules (the segment solvers' per-layer lists, vectorised steps'
        stacked views, shared parameters' reductions, auto's candidates and
        replicated copies): new tensors put in the modules would be used by some of
        these and not by others, and the old ones would keep training.  Load with the
        default ``assign=False`` (the values are copied into the tensors layerpar and
        the optimizer hold), or load into the `ODENet` with ``assign=True`` before
        building the LayerParallel.
        """
        if assign:
            raise ValueError(
                "LayerParallel.load_state_dict does not support `assign=True`: layerpar "
                "holds this rank's parameter tensors in its solvers, vectorised steps and "
                "gradient reductions, which would go on using and training the old "
                "tensors. Load with assign=False (the values are copied into the "
                "parameters layerpar and your optimizer hold), or load the state into "
                "the ODENet with assign=True before building the LayerParallel")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"`state_dict` must be a mapping of names to tensors, got "
                            f"{type(state_dict).__name__}")
        mine = self.state_dict(keep_vars=True)
        # checked first, against this rank's part or the whole net's (torch's own
        # load copies what it can before it raises)
        whole = mine if all(k in mine for k in state_dict) else \
            self.whole_net.state_dict(keep_vars=True)
        unexpected = [k for k in state_dict if k not in whole]
        errors = []
        if strict and unexpected:
            errors.append("Unexpected key(s) in state_dict (no layer of this network has "
                          "them): " + ", ".join(f'"{k}"' for k in unexpected))
        if strict:
            missing = [k for k in whole if k not in state_dict]
            if missing:
                errors.append("Missing key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in missing))
        for k, v in state_dict.items():
            want = whole.get(k)
            if want is not None and isinstance(v, Tensor) and v.shape != want.shape:
                errors.append(f"size mismatch for {k}: copying a param with shape "
                              f"{v.shape} from checkpoint, the shape in current model is "
                              f"{want.shape}.")
        if errors:
            raise RuntimeError("Error(s) in loading state_dict for LayerParallel:\n\t"
                               + "\n\t".join(errors))
        got = super().load_state_dict({k: v for k, v in state_dict.items() if k in mine},
                                      strict)
        got.unexpected_keys.extend(unexpected)
        return got

    def gather_state_dict(self) -> dict[str, Tensor]:
        """The whole network's state dict (loads into the serial `ODENet`), on every rank
        (collective)."""
        return checkpoint.gather_state_dict(self)

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state of the whole network, keyed by parameter name, on every
        rank (collective).  `load_optimizer_state` restores it on any number of ranks."""
        return checkpoint.gather_optimizer_state(self, optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """Load a state from `gather_optimizer_state` into this rank's optimizer."""
        checkpoint.load_optimizer_state(self, optimizer, state)

    def _apply(self, fn: Callable, recurse: bool = True) -> LayerParallel:
        """`.to()`, `.double()`, `.cuda()` ... also reach the ghost blocks, which are not
        submodules (they hold no trainable parameters of this rank)."""
        super()._apply(fn, recurse)
        for runner in self._runners.values():
            runner.ghosts.apply(fn)
        return self

    def close(self) -> None:
        """Release the duplicated communicator (collective: call on every rank).

        Each LayerParallel holds one duplicate of `comm` so its messages never meet the
        user's; a program that builds many models should close the ones it drops
        (MPI has a limited number of communicators).  The model cannot run afterwards.
        """
        self._closed = True
        self.transport.close()
        if self._agreements is not None:
            self._agreements.close()

    def extra_repr(self) -> str:
        return (f"rank {self.rank} of {self.size}, coarsening={self.coarsening!r}, "
                f"options={self.options}, backward_options={self.backward_options}")


class _LayerParallelFunction(torch.autograd.Function):
    """Forward MGRIT / adjoint MGRIT as one autograd node over this rank's parameters."""

    @staticmethod
    def forward(ctx: Any, model: LayerParallel, agreed: Agreed, x: Tensor,
                *params: Tensor) -> Tensor:
        c = PassRecord()
        c.x_requires_grad = agreed.x_requires_grad  # on any rank: all take part
        c.x_shape, c.x_dtype = tuple(x.shape), x.dtype
        c.exact = model._exact_pass
        y = model.guard(lambda: model._forward_impl(c, x.detach(), True, agreed.seed))
        ctx.model, ctx.c, ctx.params = model, c, params
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple:
        model: LayerParallel = ctx.model
        if ctx.c is None:
            raise RuntimeError(
                "LayerParallel: a second backward through the same forward pass "
                "(retain_graph=True) is not supported: the adjoint solve has consumed "
                "this pass's records; run the forward pass again")
        if torch.is_grad_enabled():
            ctx.c = None
            raise RuntimeError(
                "LayerParallel: create_graph=True (higher-order gradients, e.g. gradient "
                "penalties) is not supported through the adjoint MGRIT solve; it works "
                "in direct mode (one rank, max_levels=1)")
        model.transport.set_context(f"batch {model._batch}, backward pass")
        gx, grads = model.guard(lambda: model._backward_impl(ctx.c, gy.contiguous()))
        ctx.c = None
        if not ctx.needs_input_grad[2]:
            gx = None  # wanted by another rank, sent to it; not by this one
        return (None, None, gx, *model._deliver(ctx.params, grads))
