"""One Segment on one rank: what it owns, its one propagator, and its two solves.

The runner holds what does not change from pass to pass: the rank's share of the
placement (its `SegmentPlan`: owned layers, partitions, ghosts), the one propagator
Φ over the blocks it evaluates (`layerpar.ode.propagator`), the choice between vectorised
and per-step cycles, and the forward and adjoint engine sessions.  What one pass
needs lives elsewhere: the pass's records on its tape (`tape.py`, owned by the
autograd context), the pass's state in the callback objects that step it
(`forward.py`, `adjoint.py`, `direct.py`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from ..mgrit.options import MGRITOptions
from ..mgrit.result import MGRITResult
from ..mgrit.session import EngineSession
from ..ode.flat import flatten
from ..ode.net import Segment
from ..ode.propagator import Propagator
from ..ode.rng import needs_rng, own_generators
from .adjoint import AdjointApp
from .batched import (
    BatchedBlocks,
    as_tensor,
    buffer_message,
    buffer_versions,
    generator_states,
    inplace_message,
    output_message,
    own_buffers,
    random_message,
    unbatchable_reason,
    warn_once,
)
from .bn_dropout import batch_norms, layer_function
from .direct import DirectApp
from .forward import ForwardApp
from .ghosts import Ghosts
from .grads import hooks_held
from .plan import SegmentPlan
from .sharing import shares_parameters
from .tape import Tape, autocast_as, autocast_dtype
from .timing import best_seconds

__all__ = ["PathChoice", "SegmentRunner"]


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
    """One Segment on one rank: ownership, ghosts, the propagator, the two engines.

    plan: the segment's part of the model's `Plan` (built from the same `fwd`, `bwd`,
        `coarsening` and the transport's size): partitions, levels, ghosts.
    direct_ok: direct passes are possible here (one rank, no replicas, the native
        engine); the runner then runs them where its solves are sequential both ways
        (`direct`; `forward_direct`, see `direct.py`), and always for exact propagation.
    """

    def __init__(self, seg: Segment, plan: SegmentPlan, transport: Any, fwd: MGRITOptions,
                 bwd: MGRITOptions, coarsening: str, batched: Union[bool, str] = "auto",
                 engine: str = "native", direct_ok: bool = False) -> None:
        self.plan = plan
        self.seg_index = plan.index
        self.n = n = seg.n_steps
        self.coarsening = coarsening
        rank = transport.rank
        self.bounds = list(plan.forward.bounds)
        self.owned = plan.layers(rank)
        self.times = [seg.time(i) for i in range(n + 1)]
        self.scheme = seg.scheme
        # blocks this rank evaluates: its own, plus ghosts of its neighbours' layers
        self.ghosts = Ghosts(seg, plan, rank)
        self.blocks: dict[int, nn.Module] = {k: seg.blocks[k] for k in self.owned}
        self.blocks.update(self.ghosts.blocks)
        # one parameter tensor serves several of this rank's layers (one block module
        # for every step: a time-invariant ODE): each recorded step gets a graph of its
        # own (a chain's graph would hand a layer's parameter gradient the earlier
        # layers' uses too), and the uses' gradients are summed (`sharing`)
        self.shares = shares_parameters(self.blocks[k] for k in self.owned)
        # the one propagator over them, which every app steps through
        self.prop = Propagator(self.blocks, self.times, self.scheme, coarsening)
        # trainable parameters per owned layer; refreshed when requires_grad changes
        self.all_params = [(k, p) for k in self.owned for p in seg.blocks[k].parameters()]
        self.trainable: Optional[tuple[bool, ...]] = None
        self.layer_params: dict[int, list[Tensor]] = {}
        self._trainable_names: dict[tuple, frozenset[str]] = {}  # per record's layers
        self.refresh_trainable()
        self.bn = {k: batch_norms(blk) for k, blk in self.blocks.items()}
        self.sequential_adjoint = len(plan.adjoint.levels) == 1
        self.sequential_forward = len(plan.forward.levels) == 1
        # vectorised steps (batched.py): for MGRIT in both directions (either parameter
        # coarsening); sequential solves have nothing to batch
        # `vectorised`: the segment's BatchedBlocks where its blocks allow them; `bb`: the
        # same where the latest pass used them (per input: "auto" measures both paths at
        # the first pass for an input shape, see choose_path), else None (per-step path)
        self.vectorised: Optional[BatchedBlocks] = None
        self.bb: Optional[BatchedBlocks] = None
        self.paths: dict[tuple, PathChoice] = {}
        # what every rank has alike (agreed options): whether vectorised cycles are
        # possible at all, and whether the ranks time them against per-step cycles
        # (collectively: a rank whose own blocks cannot be vectorised takes part too)
        possible = bool(batched) and not \
            self.sequential_forward and not self.sequential_adjoint
        self.measure = possible and batched == "auto"
        if possible:
            why = unbatchable_reason(list(self.blocks.values()))
            if why is None:
                # the segment's parameters flat (a no-op where the Segment made them so;
                # a copy of a net, `copy.deepcopy`, has them apart): steps read views
                flatten(seg.blocks)
                self.vectorised = BatchedBlocks(self.blocks, self.scheme, self.times,
                                                coarsening, owned=self.owned)
            else:
                warn_once(seg.blocks[self.owned[0]], why)
        self.check_finite = True  # set by LayerParallel
        self.transport = transport
        # the data group of a process grid (set by LayerParallel): the path choice is
        # agreed with the other replicas too (their gradients are averaged bucket by
        # bucket, and a batched and a per-step pass hand them over differently)
        self.replicas: Any = None
        self.rtransport = transport.reversed()
        self._seg, self._engine = seg, engine
        self.fwd_options = fwd.replace(final_fc_relax=True)
        self.bwd_options = bwd.replace(final_fc_relax=True)
        self.direct = direct_ok and self.sequential_forward and self.sequential_adjoint
        self.fapp, self.bapp, self.fsession, self.bsession = self._solver(
            self.fwd_options, self.bwd_options, self.direct, self.sequential_adjoint, "")
        # exact propagation on the same plan (sequential solves both ways), built at
        # first use: `forward(..., exact=True)`
        self._exact: Optional[tuple] = None
        self._exact_direct = direct_ok

    def _solver(self, fwd: MGRITOptions, bwd: MGRITOptions, direct: bool,
                sequential_adjoint: bool, label: str) -> tuple:
        """(forward app, adjoint app, forward session, adjoint session) for these
        options, over this runner's plan and propagator."""
        seg, engine = self._seg, self._engine
        # fixed iteration counts: residual norms stay on the device during the solve
        # (the native engine's: XBraid reads every norm)
        defer_f = fwd.tol == 0.0 and fwd.rtol == 0.0 and engine == "native"
        defer_b = bwd.tol == 0.0 and bwd.rtol == 0.0 and engine == "native"
        fapp: ForwardApp = DirectApp(self) if direct else ForwardApp(self)
        bapp = AdjointApp(self, sequential_adjoint)
        name = f"{label}of segment {self.seg_index}"
        fsession = EngineSession(self.n, seg.t_start, seg.t_final, self.transport,
                                 self.bounds, fapp, fwd, what=f"forward MGRIT {name}",
                                 defer_norms=defer_f, engine=engine)
        bsession = EngineSession(self.n, seg.t_start, seg.t_final, self.rtransport,
                                 self.plan.adjoint.bounds, bapp, bwd,
                                 what=f"backward MGRIT {name}", defer_norms=defer_b,
                                 engine=engine)
        fapp.deferred = fsession.deferred
        bapp.deferred = bsession.deferred
        return fapp, bapp, fsession, bsession

    def _mode(self, exact: bool) -> tuple:
        """The apps and sessions of a pass: this runner's MGRIT, or exact propagation."""
        if not exact:
            return self.fapp, self.bapp, self.fsession, self.bsession
        if self._exact is None:
            one = MGRITOptions(max_levels=1, final_fc_relax=True)
            self._exact = self._solver(one, one, self._exact_direct, True,
                                       "(exact propagation) ")
            self._exact[1].averager = self.bapp.averager
        return self._exact

    @property
    def averager(self) -> Optional[Any]:
        """Averages gradients over a process grid's replicas (set by LayerParallel)."""
        return self.bapp.averager

    @averager.setter
    def averager(self, value: Optional[Any]) -> None:
        self.bapp.averager = value
        if self._exact is not None:
            self._exact[1].averager = value

    def set_iterations(self, fwd: int, bwd: int) -> None:
        """Forward / adjoint MGRIT iterations from the next pass on (adaptive accuracy;
        exact propagation has none to set)."""
        if fwd != self.fwd_options.max_iter:
            self.fwd_options = self.fwd_options.replace(max_iter=fwd)
            self.fsession.core.set_options(**self.fwd_options.engine_kwargs())
        if bwd != self.bwd_options.max_iter:
            self.bwd_options = self.bwd_options.replace(max_iter=bwd)
            self.bsession.core.set_options(**self.bwd_options.engine_kwargs())

    # -- the propagator, as layer-parallel passes step it ----------------------------------
    def phi(self, u: Tensor, a: int, b: int, tape: Tape, *, update_stats: bool,
            check: bool = False, own_buffers: bool = True) -> Tensor:
        """Φ(u; a, b) (`self.prop`) with layer a's dropout generator of the pass
        (`tape`), its batch norms' running statistics frozen unless `update_stats`, and,
        where `check` (the first pass for an input shape), the checks that the block
        keeps the state's shape and changes neither its input nor (`own_buffers`) its
        own buffers in place."""
        seg_index = self.seg_index
        bb = tape.bb  # the path of the pass that owns the tape (a later pass may differ)
        if bb is not None and b > a + 1 and bb.coarsening != "injection" and not (
                check or self.bn.get(a) or a in tape.rng_layers):
            # an averaged coarse step stepped alone (a sequential stretch of a coarse
            # level): the pass's averaged parameters (`BatchedBlocks.averaged`), not a
            # new average of every spanned layer at every step
            return bb.step(u.unsqueeze(0), ((a, b),))[0]

        def wrap(f: Callable[[Tensor], Tensor], a: int, b: int) -> Callable[[Tensor], Tensor]:
            f = layer_function(f, a, seg_index, tape.seed, a in tape.rng_layers,
                               self.bn.get(a, []), update_stats)
            return _checked(f, self.blocks[a], a, seg_index, own_buffers) if check else f

        try:
            return self.prop(u, a, b, wrap)
        except RuntimeError as exc:  # torch's words for it, when the input is a leaf
            if "in-place operation" in str(exc):
                raise ValueError(inplace_message(self.blocks[a], a, seg_index)) from exc
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
        vectorised and one by one; the faster path (summed over the ranks, and over
        the replicas of a process grid) wins."""
        bb = self.vectorised
        k = max(1, len(self.owned) // self.fwd_options.cfactor_at(0))
        layers = tuple(self.owned[:k])
        pairs = tuple((a, a + 1) for a in layers)
        g = torch.Generator(device=like.device).manual_seed(4321)
        x = torch.randn((k, *like.shape), generator=g, dtype=like.dtype, device=like.device)

        trainable = set() if bb is None else self.trainable_names(layers, bb)
        tape = Tape()
        if bb is not None:
            bb.new_pass()  # (parameters moved since the last pass, `.double()`: found)

        def vectorised() -> None:
            if bb is None:  # (timed only where there are vectorised steps)
                raise RuntimeError("internal: vectorised cycles timed without their steps")
            with torch.enable_grad():
                stacked, _ = bb.stacked(layers)
                leaves = {n: t.detach().requires_grad_(n in trainable)
                          for n, t in stacked.items()}
                xin = x.detach().requires_grad_()
                y = bb.step(xin, pairs, params=leaves)
                torch.autograd.grad(y, [xin, *(t for t in leaves.values()
                                               if t.requires_grad)], x, allow_unused=True)
            bb.new_pass(check=False)  # as a pass would, each repeat makes its own

        def per_step() -> None:
            with torch.enable_grad():
                for r, a in enumerate(layers):
                    xin = x[r].detach().requires_grad_()
                    y = self.phi(xin, a, a + 1, tape, update_stats=False)
                    # (a parameter the block does not use has no gradient: allowed)
                    torch.autograd.grad(y, [xin, *self.layer_params[a]], x[r],
                                        allow_unused=True)

        # a rank whose blocks cannot be vectorised votes for per-step cycles
        mine = (math.inf, 0.0) if bb is None else (best_seconds(vectorised, like.device, repeats),
                                                   best_seconds(per_step, like.device, repeats))
        got = [mine] if self.transport.size == 1 else self.transport.allgather_object(
            mine, "the timing of vectorised and per-step cycles")
        t_vec, t_seq = sum(t for t, _ in got), sum(t for _, t in got)
        if self.replicas is not None and self.replicas.size > 1:
            # every replica takes the same path: the sums of all replicas' layer groups
            # (the same list on every process), not each replica's own timing
            sums = self.replicas.allgather_object(
                (t_vec, t_seq), "the replicas' timings of vectorised and per-step cycles")
            t_vec, t_seq = sum(t for t, _ in sums), sum(t for _, t in sums)
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
            self._trainable_names = {}
            self.layer_params = {k: [] for k in self.owned}
            for (k, p), f in zip(self.all_params, flags):
                if f:
                    self.layer_params[k].append(p)

    def trainable_names(self, layers: tuple[int, ...], bb: BatchedBlocks) -> frozenset[str]:
        """Parameter names that require grad in at least one of these (owned) layers;
        kept until `refresh_trainable` sees a flag change (a record's layers are the
        same every pass: without the cache, every pass read each owned parameter's
        flag once more per record)."""
        got = self._trainable_names.get(layers)
        if got is None:
            got = self._trainable_names[layers] = frozenset(
                name for a in layers
                for name, p in zip(bb.param_names, bb.layer_tensors(a)) if p.requires_grad)
        return got

    # -- per batch ----------------------------------------------------------------------------
    def new_tape(self, record: bool, seed: Optional[int]) -> Tape:
        """An empty tape for a pass (recording for a backward or not; its dropout
        seed), the layers that draw from the seed marked."""
        return Tape(record, seed, frozenset(
            k for k, blk in self.blocks.items() if seed is not None and needs_rng(blk)))

    def forward(self, u0: Optional[Tensor], like: Tensor, tape: Tape, *,
                check_shapes: bool = False, exact: bool = False
                ) -> tuple[Optional[Tensor], MGRITResult]:
        """Forward solve of the pass that owns `tape` (recorded onto it when it
        records): MGRIT with this runner's options, or exact propagation (sequential
        stepping over the same ranks) where `exact`; the tape remembers which, for the
        backward.  Returns (u_N on the last rank else None, stats).  `check_shapes`: the
        first pass for an input shape checks what the blocks do (see `phi`)."""
        if tape.recording:
            self.refresh_trainable()
        self.transport.set_template(like)
        # sequential solves have nothing to batch
        bb = self.bb = None if exact else self.use_path(like)
        if bb is not None:
            bb.new_pass()
            tape.versions = bb.param_versions() if tape.recording else None
        self.prop.new_pass()
        tape.bb = bb  # as recorded: the backward steps through the same path
        tape.layer_params = self.layer_params
        tape.exact = exact
        tape.autocast = autocast_dtype(like.device)
        app, _, session, _ = self._mode(exact)
        app.begin(tape, u0 if u0 is not None else like, like, bb, check_shapes)
        try:
            stats = session.drive(lazy_history=not self.check_finite)
        finally:
            app.end()
        last = self.transport.size - 1
        out = as_tensor(session.state(self.n)) if self.transport.rank == last else None
        return out, stats

    def forward_direct(self, u0: Tensor, tape: Tape, *, check_shapes: bool = False,
                       exact: bool = False) -> tuple[Tensor, MGRITResult]:
        """Direct mode (one rank, sequential solves; see `direct.py`): the sweep is
        recorded onto `u0`'s own graph; returns u_N with its graph, and the stats."""
        app, _, session, _ = self._mode(exact)
        if not isinstance(app, DirectApp):
            raise RuntimeError("internal: a direct pass on a runner that cannot run one")
        self.transport.set_template(u0)
        # sequential solves have nothing to batch (the runner's own pass still notes
        # its path, None, in `paths`)
        self.bb = None if exact else self.use_path(u0)
        if self.bb is not None:
            raise RuntimeError("internal: a direct pass was given a batched path")
        app.begin(tape, u0, u0, None, check_shapes)
        app.begin_direct(u0)
        try:
            stats = session.drive(lazy_history=not self.check_finite)
            out = app.out
        finally:
            app.end()
        if out is None:
            raise RuntimeError("the direct pass produced no output")
        return out, stats

    def backward(self, lam_n: Optional[Tensor], like: Tensor, tape: Tape,
                 extra: list[tuple[int, Tensor]]
                 ) -> tuple[Optional[Tensor], MGRITResult, dict[int, Tensor]]:
        """Adjoint solve of the pass that recorded `tape` (MGRIT, or exact propagation
        as that pass ran); returns (lambda_0 on rank 0 else None, stats, id(parameter)
        -> gradient of this rank's layers; a shared parameter's further uses are put in
        `extra`, see `AdjointApp.gradients`).  The tape's records are consumed."""
        self.rtransport.set_template(like)
        if tape.bb is not None and tape.versions is not None:
            tape.bb.check_versions(tape.versions, self.seg_index)
        _, app, _, session = self._mode(tape.exact)
        app.begin(tape, lam_n if lam_n is not None else like, like)
        try:
            # the steps recomputed here run in the dtypes the forward's ran in
            # the parameters' own hooks run once, where the pass hands their gradients
            # on (`grads.hooks_held`), not inside the adjoint's autograd calls too
            with autocast_as(like.device, tape.autocast), hooks_held(
                    p for ps in self.layer_params.values() for p in ps):
                stats = session.drive(lazy_history=not self.check_finite)
                out = as_tensor(session.state(self.n)) if self.transport.rank == 0 else None
                grads = app.gradients(extra)
        except RuntimeError as exc:
            if "donated buffer" not in str(exc):
                raise
            raise ValueError(
                f"segment {self.seg_index}: a torch.compile'd block gave up its saved "
                "tensors after one backward (torch's donated buffers), but the adjoint "
                "solve differentiates each recorded step more than once. Compile the "
                "block's inner modules instead (its dropout outside them), or set "
                "torch._functorch.config.donated_buffer = False before compiling"
            ) from exc
        finally:
            app.end()
            tape.clear()  # consumed: drop the records and their graphs
        return out, stats, grads


def _checked(f: Callable[[Tensor], Tensor], block: nn.Module, a: int, seg_index: int,
             with_buffers: bool) -> Callable[[Tensor], Tensor]:
    """`f` with the checks of a first pass: the block keeps the state's shape, leaves
    its input alone and (`with_buffers`: not in direct mode, which is serial stepping)
    updates none of its own buffers and draws no random numbers from the global
    generators, nor from a generator the block holds (a dropout layer's `f` draws from
    the global ones, seeded per layer and batch, and puts them back)."""
    bufs = own_buffers(block) if with_buffers else []

    own = own_generators(block) if with_buffers else []

    def checked(v: Tensor) -> Tensor:
        version, before = v._version, buffer_versions(bufs)
        rng = generator_states(v.device) if with_buffers else []
        states = [g.get_state() for _, g in own]
        out = f(v)
        if v._version != version:
            raise ValueError(inplace_message(block, a, seg_index))
        if buffer_versions(bufs) != before:
            raise ValueError(buffer_message(block, a, seg_index, bufs, before))
        if any(not torch.equal(s, t) for s, t in zip(rng, generator_states(v.device))):
            raise ValueError(random_message(block, a, seg_index))
        for (name, g), state in zip(own, states):
            if not torch.equal(state, g.get_state()):
                raise ValueError(random_message(block, a, seg_index, name))
        bad = output_message(block, a, seg_index, v, out)
        if bad is not None:
            raise ValueError(bad)
        return out

    return checked
