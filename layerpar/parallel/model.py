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
import sys
from collections.abc import Iterator
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
from . import checkpoint, optimizers
from .agree import Agreed, Layout, StaleNet, agree_pass, check_xbraid, layer_key
from .grads import GradDelivery
from .grid import ProcessGrid
from .passes import backward_pass, forward_direct, forward_pass, refuse_after_failure
from .plan import Plan, SegmentPlan
from .replicas import GradAverager
from .runner import SegmentRunner
from .sharing import SharedParams, shared_key
from .tape import PassRecord


class _Remote(nn.Module):
    """Placeholder for a layer that lives on another rank (holds no parameters)."""

    def __init__(self, owner: int) -> None:
        super().__init__()
        self.owner = owner

    def extra_repr(self) -> str:
        return f"on rank {self.owner}"


def untraced_pass(model: LayerParallel, x: Tensor) -> Tensor:
    """`model`'s pass on `x`, with what it cannot run under set aside.  Under
    ``torch.inference_mode()`` it runs as under ``torch.no_grad()``
    (`outside_inference`).  Where a compiler is loaded, dynamo is disabled inside the
    pass, so ``torch.compile(model)`` runs it eagerly, its compiled blocks still
    compiled: a pass exchanges messages between ranks and checks what the blocks do to
    their inputs, which a traced graph would neither hold nor keep."""
    if torch.is_inference_mode_enabled():
        return outside_inference(model.forward, x)
    dynamo = sys.modules.get("torch._dynamo")  # (loaded only where something compiles)
    if dynamo is None:
        return model._forward_once(x)
    untraced = _UNTRACED.get("pass")
    if untraced is None:  # made once per process
        untraced = _UNTRACED["pass"] = dynamo.disable(_forward_once, recursive=True)
    return untraced(model, x)


def _forward_once(model: LayerParallel, x: Tensor) -> Tensor:
    """`model._forward_once(x)`, the method looked up at each call."""
    return model._forward_once(x)


#: `_forward_once` with dynamo disabled inside, made where a compiler is loaded
_UNTRACED: dict[str, Callable[[LayerParallel, Tensor], Tensor]] = {}


def outside_inference(forward: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """`forward(x)` called inside ``torch.inference_mode()``, run under
    ``torch.no_grad()`` instead, on a copy of `x` where it is an inference tensor: a
    pass keeps and checks version counters (its first-pass check of what a block does
    to its input, the states it reuses), which inference tensors do not have.  The
    output is an ordinary tensor without a graph."""
    with torch.inference_mode(False), torch.no_grad():
        return forward(x.clone() if isinstance(x, Tensor) and x.is_inference() else x)


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


def _transports(comm: Any, grid: Optional[ProcessGrid], timeout: Any
                ) -> tuple[Transport, Optional[Transport], Optional[Transport], Transport, Any]:
    """(layer transport, data transport, the whole grid's agreements, the transport the
    settings are agreed over, the timeout) of a model over `comm` or `grid`."""
    if grid is not None:
        if not isinstance(grid, ProcessGrid):
            raise TypeError(f"`grid` must be a ProcessGrid, got {type(grid).__name__}")
        if comm is not None:
            raise TypeError("pass `comm` or `grid`, not both (the grid holds the "
                            "communicator)")
        transport, data = grid.transports()
        world: Transport = grid.world
        # the per-pass agreements, over the whole grid where it has replicas
        agreements = grid.whole() if data is not None else None
        if timeout is _GRIDS_TIMEOUT:  # (none passed: the grid's own timeout holds)
            timeout = grid.timeout
    else:
        transport = make_transport(comm)
        data = agreements = None
        world = transport
    if timeout is _GRIDS_TIMEOUT:
        timeout = DEFAULT_TIMEOUT
    return transport, data, agreements, world, timeout


def _agreed_settings(world: Transport, transport: Transport, net: Any, options: Any,
                     backward_options: Any, *, coarsening: str, state_dict: Any,
                     batched: Any, check_finite: Any, timeout: Any, check_inputs: Any,
                     grid: Optional[ProcessGrid], accuracy: Any, engine: str,
                     above: Optional[tuple[dict[str, Any], Optional[BaseException]]]
                     ) -> tuple[ODENet, MGRITOptions, MGRITOptions, Union[bool, str], Any]:
    """`LayerParallel`'s arguments checked, and agreed between the ranks over `world`
    (one collective: an error on any rank is raised on every rank, naming the
    argument): (the net, forward and adjoint options, `batched`, the timeout)."""
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
            if seg.n_steps < transport.size:
                raise ValueError(
                    f"a segment has {seg.n_steps} layers but the communicator has "
                    f"{transport.size} ranks: each rank needs at least one layer")
        if engine == "xbraid":
            check_xbraid(transport, net, options, backward_options, batched,
                          grid is not None, None)
        key = {**{f"options.{k}": v for k, v in options.key().items()},
               **{f"backward_options.{k}": v for k, v in backward_options.key().items()},
               "coarsening": coarsening, "batched": batched, "check_finite": check_finite,
               "engine": engine,
               "timeout": timeout, "check_inputs": check_inputs,
               **above_key,
               **{name: v for k, m in enumerate(net.layers)
                  for name, v in layer_key(k, m).items()},
               # which layers share a parameter (a net tied on some ranks only)
               "shared": shared_key(
                   [(f"layers.{k}.blocks.{n}", b, 0) for k, seg in net.segments
                    for n, b in enumerate(seg.blocks)]
                   + [(f"layers.{k}", m, 0) for k, m in enumerate(net.layers)
                      if not isinstance(m, Segment)])}
    except Exception as exc:  # noqa: BLE001 - re-raised identically on every rank
        err = exc
    world.agree(key, err, "LayerParallel settings (options, coarsening, layers; "
                         "`layers.k.structure` is a digest of layer k's structure: "
                         "module types, parameter shapes, attributes such as the "
                         "activation)")
    if not isinstance(net, ODENet):
        raise TypeError(f"`net` must build an ODENet, got {type(net).__name__}")
    return net, options, backward_options, batched, timeout


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
        model silently.  (Module hooks a pass cannot run as serial training does are
        looked for on every pass and refused by name: `agree.hook_refusal`.)
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
        self.transport, self._data_transport, self._agreements, world, timeout = \
            _transports(comm, grid, timeout)
        self.grid = grid
        net, options, backward_options, batched, timeout = _agreed_settings(
            world, self.transport, net, options, backward_options, coarsening=coarsening,
            state_dict=state_dict, batched=batched, check_finite=check_finite,
            timeout=timeout, check_inputs=check_inputs, grid=grid, accuracy=accuracy,
            engine=engine, above=above)
        if not isinstance(net, ODENet):
            raise TypeError(f"`net` must build an ODENet, got {type(net).__name__}")
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
        # the placement, built once: the runners, ghosts and passes read it
        self._plan = Plan.build(net, size, options, backward_options, coarsening)
        shards: list[nn.Module] = []
        self._runners: dict[int, SegmentRunner] = {}
        # direct passes (one rank, sequential forward and adjoint: see _forward_direct)
        direct_ok = size == 1 and self._averager is None and engine == "native"
        for k, (layer, item) in enumerate(zip(net.layers, self._plan.items)):
            if isinstance(item, SegmentPlan):
                if not isinstance(layer, Segment):  # the plan was built from this net
                    raise RuntimeError(f"internal: layer {k} has a segment's plan but is "
                                       f"a {type(layer).__name__}")
                runner = SegmentRunner(layer, item, self.transport, options,
                                        backward_options, coarsening, batched,
                                        engine=engine, direct_ok=direct_ok)
                runner.averager = self._averager
                runner.replicas = self._data_transport
                self._runners[k] = runner
                shards.append(_SegmentShard(layer, runner.owned))
            else:
                owner = item[2]
                shards.append(layer if owner == rank else _Remote(owner))
        self.layers = nn.ModuleList(shards)
        # parameters several layers use (one block for every step; tied weights):
        # every use's gradient summed, over the ranks too (`sharing`)
        self._shared = SharedParams.build(self._layer_owners(net))
        self._param_list: list[nn.Parameter] = list(self.parameters())
        self._layout = Layout(self, net)  # (what a pass refuses to find replaced)
        self._stale = StaleNet.guard(net, self._param_list, self.size)  # (net(x) refused)
        optimizers.watch(self, self._param_list)  # (another rank's optimizer state, LBFGS)
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
        # this rank's own dropout modules (a pass draws a seed where serial
        # `ODENet.forward` would: in training mode, some owner's dropout training)
        self._has_dropout = any(isinstance(m, _DROPOUT) for m in net.modules())
        self._dropouts = [m for m in self.modules() if isinstance(m, _DROPOUT)]
        #: per segment, what the last forward / backward pass's solves reached
        self.last_forward: list[MGRITResult] = []
        self.last_backward: list[MGRITResult] = []
        self._checking = False  # inside `checking()`: a gradient check's passes
        self._exact_pass = False  # inside `exact()`: passes run exact propagation

    def _layer_owners(self, net: ODENet) -> list[tuple[str, nn.Module, int]]:
        """(name, module, owner rank) of every layer of the whole net, a segment's
        blocks one by one (the same on every rank)."""
        segments = dict(net.segments)
        return [(f"layers.{k}", net.layers[k], q) if n is None else
                (f"layers.{k}.blocks.{n}", segments[k].blocks[n], q)
                for k, n, q in self._plan.placements()]

    @property
    def plan(self) -> Plan:
        """Where everything runs: per segment, the layers and level points of each rank,
        the ghost blocks and the states that cross ranks (`Plan`; print it).  Built
        once, at construction: the model's runners and passes run this placement."""
        return self._plan

    @property
    def cycle_paths(self) -> list[dict[tuple, Any]]:
        """Per segment, input shape -> `PathChoice` (vectorised or per-step cycles, and
        the seconds measured for each where ``batched="auto"`` chose)."""
        return [{key[0]: c for key, c in r.paths.items()} for r in self._runners.values()]

    # -- the seam: what the policy above (`Auto`) and the helper modules read --------------
    @property
    def whole_net(self) -> ODENet:
        """The whole `ODENet` this model was built from, on every rank: this rank's
        layers are its modules; the others are not trained here (stale copies)."""
        return self._whole.net

    @property
    def layer_kinds(self) -> list[tuple[str, int]]:
        """Per layer of the net: ("segment", segment index) or ("plain", owner rank)."""
        return list(self._plan.kinds)

    @property
    def batch(self) -> int:
        """Forward passes run so far (named in errors and timeouts); a policy above
        the model sets it back where it drops a pass (adaptive accuracy's recomputed
        batches, auto's batch numbering)."""
        return self._batch

    @batch.setter
    def batch(self, value: int) -> None:
        self._batch = value

    def apply(self, fn: Callable[[nn.Module], None]) -> LayerParallel:  # type: ignore[override]
        """`fn` over the whole net's modules in serial `ODENet.apply`'s order, on every
        rank: an initialisation drawing random numbers gives every layer serial's values
        (over this rank's layers alone, the draws would start where the net's first does)."""
        self._whole.net.apply(fn)
        return self

    def train(self, mode: bool = True) -> LayerParallel:
        """`nn.Module.train`, on the whole net too: its other ranks' layers are not this
        model's submodules, and their modes follow (`agree.seeded`)."""
        super().train(mode)
        self._whole.net.train(mode)
        return self

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

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

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
    def forward(self, x: Tensor) -> Tensor:
        """Layer-parallel forward pass; pass the same `x` on every rank (also under
        ``torch.compile`` and ``torch.inference_mode()``: `untraced_pass`)."""
        return untraced_pass(self, x)

    def _forward_once(self, x: Tensor) -> Tensor:
        if self._closed:
            raise RuntimeError("this LayerParallel was closed (close() released its "
                               "communicator); build a new one to run again")
        refuse_after_failure(self)
        if not isinstance(x, Tensor):
            raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
        if x.is_meta:
            raise ValueError("`x` is on the meta device: it has a shape but no values")
        self._batch += 1
        self.transport.set_context(f"batch {self._batch}, forward pass")
        agreed = agree_pass(self, x)
        if not agreed.record:
            ctx = PassRecord()
            ctx.exact = self._exact_pass
            return self.guard(lambda: forward_pass(self, ctx, x, False, agreed.seed))
        if self._direct_exact if self._exact_pass else self._direct:
            return forward_direct(self, x, agreed.seed)
        params: list[Tensor] = [p for p in self._param_list if p.requires_grad]
        if not params and not x.requires_grad:
            # nothing to differentiate here, but other ranks do: the output must still
            # carry a graph so that this rank's backward() joins theirs
            params = [self._anchor]
        return _LayerParallelFunction.apply(self, agreed, x, *params)

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
        so ``clip_grad_norm_(model.parameters(), ...)`` on each rank would clip by that
        rank's part of the norm, every rank differently.  Here the ranks' parts are
        summed (in rank order: the same norm on every rank) and every gradient is
        scaled by ``max_norm / total`` where the total exceeds it.  With data replicas
        (gradients already averaged) each replica computes the same norm.  Returns the
        total norm (float64)."""
        return checkpoint.clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite)

    # -- portability ------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        """`nn.Module.load_state_dict`, which also takes the whole network's state dict
        (`gather_state_dict`, or the serial `ODENet`'s) on any number of ranks: each
        rank loads its own part (`checkpoint.this_ranks_part`).  Not collective, yet a
        whole-network dict is checked whole on every rank before anything loads
        (`checkpoint.check_state_dict`), so a bad one raises alike everywhere.
        assign: refused (`checkpoint.ASSIGN_REFUSED` says why)."""
        if assign:
            raise ValueError(checkpoint.ASSIGN_REFUSED)
        mine = self.state_dict(keep_vars=True)
        unexpected = checkpoint.check_state_dict(self, mine, state_dict, strict)
        got = super().load_state_dict(checkpoint.this_ranks_part(self, state_dict, mine),
                                      strict)
        got.unexpected_keys.extend(unexpected)
        return got

    def __deepcopy__(self, memo: dict) -> LayerParallel:
        raise TypeError(checkpoint.DEEPCOPY_REFUSED)
    __reduce_ex__ = checkpoint.refuse_pickling  # torch.save(model), pickle

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
        y = model.guard(lambda: forward_pass(model, c, x.detach(), True, agreed.seed))
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
        gx, grads = model.guard(lambda: backward_pass(model, ctx.c, gy.contiguous()))
        ctx.c = None
        if not ctx.needs_input_grad[2]:
            gx = None  # wanted by another rank, sent to it; not by this one
        return (None, None, gx, *model._deliver(ctx.params, grads))
