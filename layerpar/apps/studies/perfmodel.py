"""A performance model of layer-parallel (MGRIT) training, pinned to the engine.

The model replays the engine's program (``layerpar/_native/drive.c``, ``relax.c``,
``restrict.c``, ``interp.c``, ``residual.c``) on every rank of a partition, without
any tensors: the same levels (`build_levels`), the same block partition
(`block_bounds`, and `reversed_bounds` for the adjoint), the same C/F loops, the
same messages.  Each rank keeps a clock; a step advances it by a per-step cost, a
receive waits until the message arrives (sent at the sender's clock, arriving
``alpha + bytes / beta`` later), an allreduce synchronises all clocks.  Every
dependency in an MGRIT cycle goes from a rank to a rank on its right (later in
time), so one pass over the ranks in order per phase gives every clock exactly.
The sequential coarsest-level solve thereby becomes the critical path it is.

Costs come from measurements (`measure_costs`: forward step, forward step that
records its graph, vector–Jacobian products, vector sums, the parameter update, each
as one step and batched as the apps batch them, all on the real blocks in this
process) and from the ping-pong (`layerpar.apps.studies.pingpong`: ``alpha``, ``beta``).
Three constants are fitted on small runs (`fit`): the cost of one step callback
through the engine beyond the torch work (``call_overhead``), of one step beyond it
(``step_overhead``: the apps' Python bookkeeping), and a fixed cost per batch
(``batch_overhead``: loss, plain layers, collectives' Python side).

`count_steps` exposes the replay's work counters; tests check them against the
engine's ``step_counts`` / ``batch_counts`` for exact equality.  `predict` gives time
per batch at any scale; `pipeline_seconds` is the bubble model of pipeline
parallelism it is compared with.
"""
from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

from ...defaults import TRAINING
from ...mgrit.grid import block_bounds, build_levels, reversed_bounds
from ...mgrit.options import MGRITOptions
from .runs import app_flags  # the flags `count_steps` and `predict` take, per app

__all__ = ["Costs", "ExtrapolationMap", "Fit", "Prediction", "app_flags", "count_steps",
           "extrapolate",
           "fit", "measure_costs", "pipeline_seconds", "predict", "predict_row",
           "serial_per_layer", "simulate_solve", "solve_options"]


# ------------------------------------------------------------------------------------------
# costs
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """Seconds per operation (per rank, at that rank's thread count) and message costs.

    Step kinds have a per-call part (``*_call``: Python and autograd entry, paid once
    per callback) and a per-step part; a callback that batches m steps costs
    ``call + m * step``, m unbatched steps cost ``m * (call + step)``.

    fwd, fwd_call: a forward step without a graph (relaxation, coarse levels).
    fwd_rec: a forward step that records its graph (final fine sweep; never batched).
    vjp, vjp_call: a vector–Jacobian product w.r.t. the state (adjoint relaxation).
    vjp_full, vjp_full_call: w.r.t. state and parameters (the adjoint's final sweep).
    vsum: one vector sum alpha*x + beta*y (restriction, interpolation, residual).
    opt, opt_call: a batch's parameter update per layer (gradient delivery through
        autograd + SGD step), and per batch.
    state_bytes: bytes of one state (one message); param_bytes: of one layer's
        parameters (ghost-layer messages, sent as float64).
    alpha, beta: message latency (s) and bandwidth (bytes/s), from the ping-pong.
    call_overhead: fitted seconds per engine step callback beyond the measured work.
    step_overhead: fitted seconds per step beyond the measured work (the apps' Python
        bookkeeping per step).
    batch_overhead: fitted seconds per batch (loss, plain layers, bookkeeping).
    """

    fwd: float
    fwd_rec: float
    vjp: float
    vjp_full: float
    fwd_call: float = 0.0
    vjp_call: float = 0.0
    vjp_full_call: float = 0.0
    vsum: float = 0.0
    opt: float = 0.0
    opt_call: float = 0.0
    state_bytes: int = 0
    param_bytes: int = 0
    alpha: float = 0.0
    beta: float = math.inf
    call_overhead: float = 0.0
    step_overhead: float = 0.0
    batch_overhead: float = 0.0

    def message(self, nbytes: float) -> float:
        """Time for one message of `nbytes` bytes: alpha + nbytes / beta."""
        return self.alpha + (nbytes / self.beta if self.beta > 0 else 0.0)

    def with_fit(self, f: Fit) -> Costs:
        return replace(self, call_overhead=f.call_overhead, step_overhead=f.step_overhead,
                       batch_overhead=f.batch_overhead)


ZERO = Costs(0.0, 0.0, 0.0, 0.0)


def _timeit(fn: Callable[[], Any], budget: float = 0.05, repeats: int = 5) -> float:
    """Seconds per call of `fn`: the fastest of `repeats` loops of about `budget`
    seconds each (the minimum rejects interference from other processes best)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, min(2000, int(budget / once)))
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n)
    return min(per)


def _update(params: list[list[Any]]) -> Callable[[], None]:
    """One batch's parameter update as LayerParallel does it: an autograd node hands
    every layer's gradient to its parameters (accumulation), then an SGD step."""
    import torch

    flat = [p for ps in params for p in ps]
    grads = [torch.ones_like(p) for p in flat]

    class _Deliver(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, *ps: Any) -> Any:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: Any) -> tuple:
            return (g, *grads)

    opt = torch.optim.SGD(flat, lr=1e-6)
    x = torch.zeros(1, requires_grad=True)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        _Deliver.apply(x, *flat).sum().backward()
        opt.step()

    return run


def _split(t1: float, tm: float, m: int) -> tuple[float, float]:
    """(per call, per step) from the time of 1 step and of m steps in one call."""
    step = max(0.0, (tm - t1) / (m - 1))
    return max(0.0, t1 - step), step


def _forward_costs(scheme: Any, blks: list[Any], us: list[Any], dt: float,
                   budget: float) -> tuple[float, float]:
    """(cost per call, cost per step) of forward steps without a graph: one step, and
    for the dense block with Euler also `len(blks)` steps in one batched GEMM over
    stacked weights, as LayerParallel runs them (other blocks' forward steps are not
    batched: no cost per call, each step costs one step)."""
    import torch

    from ...ode import blocks as blocks_mod

    m = len(blks)

    def fwd1() -> None:
        with torch.no_grad():
            scheme.step(blks[0], us[0], dt)

    t_fwd1 = _timeit(fwd1, budget)
    if not (all(type(b) is blocks_mod.Dense for b in blks) and scheme.name == "euler"):
        return 0.0, t_fwd1
    act = blocks_mod.get_activation(blks[0].activation)
    wt = torch.stack([b.linear.weight.detach().t() for b in blks])
    bias = torch.stack([b.linear.bias.detach() for b in blks]).unsqueeze(1)

    def fwdm() -> None:
        u = torch.stack(us)
        d = torch.tensor([dt] * m, dtype=u.dtype).view(-1, 1, 1)
        list(torch.addcmul(u, d, act(torch.baddbmm(bias, u, wt))).unbind(0))

    return _split(t_fwd1, _timeit(fwdm, budget), m)


def _full_vjp_costs(record: Callable[[int], tuple], params: list[list[Any]],
                    lams: list[Any]) -> tuple[float, float]:
    """(cost per call, cost per step) of vector-Jacobian products w.r.t. state and
    parameters, one autograd call over the graphs of 1 and of `len(params)` steps
    (`record(k)`: step k's (input, output) with its graph); the best of 5, each call
    on freshly recorded graphs (the call frees them)."""
    import torch

    def timed_full(n: int) -> float:
        best = math.inf
        for _ in range(5):
            r = [record(k) for k in range(n)]
            t0 = time.perf_counter()
            torch.autograd.grad([o for _, o in r], [i for i, _ in r]
                                + [p for ps in params[:n] for p in ps], lams[:n])
            best = min(best, time.perf_counter() - t0)
        return best

    return _split(timed_full(1), timed_full(len(params)), len(params))


def measure_costs(cfg: dict, threads: int = 1, budget: float = 0.05,
                  batch_of: Optional[int] = None) -> Costs:
    """Measure the per-step costs of the study model `cfg` in this process.

    Builds the network of `cfg` (`layerpar.apps.studies.runs.build_study_net`) and times its
    residual steps the ways the layer-parallel apps run them, each as one step and as
    `batch_of` independent steps of distinct layers in one call (default: the
    fine-grid batch of one rank, layers / cfactor, clamped to 16..256): forward
    without a graph (for the dense block one batched GEMM over stacked weights, as
    LayerParallel does), forward recording a graph, vector–Jacobian products w.r.t.
    the state and w.r.t. state and parameters (one autograd call over many graphs),
    a vector sum and the SGD update.  Runs with `threads` intra-op threads (restored
    afterwards).
    """
    import copy

    import torch

    from ...mgrit.solve import vec_sum
    from ...ode.net import Segment
    from .runs import build_study_net, config, input_shape

    cfg = config(cfg, strict=False)
    m = batch_of or min(256, max(16, int(cfg["layers"]) // int(cfg["cfactor"])))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        net = build_study_net(cfg)
        seg = next(layer for layer in net.layers if isinstance(layer, Segment))
        scheme = seg.scheme
        blks = [seg.blocks[k % seg.n_steps] for k in range(m)]
        if len({id(b) for b in blks}) < m:  # fewer layers than m: distinct copies
            blks = [copy.deepcopy(seg.blocks[0]) for _ in range(m)]
        dt = seg.time(1) - seg.time(0)
        g = torch.Generator().manual_seed(0)
        us = [torch.randn(input_shape(cfg), generator=g) for _ in range(m)]
        lams = [torch.randn(input_shape(cfg), generator=g) for _ in range(m)]

        fwd_call, fwd = _forward_costs(scheme, blks, us, dt, budget)

        def record(k: int) -> tuple:
            with torch.enable_grad():
                u_in = us[k].detach().requires_grad_()
                return u_in, scheme.step(blks[k], u_in, dt)

        fwd_rec = _timeit(lambda: record(0), budget)
        graphs = [record(k) for k in range(m)]

        def vjp(n: int) -> None:
            torch.autograd.grad([o for _, o in graphs[:n]], [i for i, _ in graphs[:n]],
                                lams[:n], retain_graph=True)

        vjp_call, vjp_step = _split(_timeit(lambda: vjp(1), budget),
                                    _timeit(lambda: vjp(m), budget), m)
        params = [[p for p in b.parameters() if p.requires_grad] for b in blks]
        full_call, full_step = _full_vjp_costs(record, params, lams)
        c_sum = _timeit(lambda: vec_sum(1.0, us[0], -1.0, us[1]), budget)
        opt_call, opt = _split(_timeit(_update(params[:1]), budget),
                               _timeit(_update(params), budget), m)
        state_bytes = us[0].numel() * us[0].element_size()
        param_bytes = 8 * sum(t.numel() for t in blks[0].state_dict().values())
    finally:
        torch.set_num_threads(old)
    return Costs(fwd=fwd, fwd_rec=fwd_rec, vjp=vjp_step, vjp_full=full_step,
                 fwd_call=fwd_call, vjp_call=vjp_call, vjp_full_call=full_call, vsum=c_sum,
                 opt=opt, opt_call=opt_call, state_bytes=state_bytes,
                 param_bytes=param_bytes)


# ------------------------------------------------------------------------------------------
# the engine's program, replayed
# ------------------------------------------------------------------------------------------
@dataclass
class _Lv:
    """One level on one rank, as grid.c computes it."""

    n: int
    stride: int
    cf: int
    nrelax: int
    lo: int
    hi: int
    left: int
    right: int

    @property
    def count(self) -> int:
        return self.hi - self.lo + 1 if self.hi >= self.lo else 0


@dataclass
class SolveSim:
    """What one replayed solve did: per rank and level, steps and step callbacks; per
    rank, its clock at the end, seconds waiting for messages and in reductions."""

    step_counts: list[list[int]]
    batch_counts: list[list[int]]
    clocks: list[float]
    wait: list[float]
    reduce: list[float]
    n_levels: int
    messages: int = 0


class _Replay:
    """Replays lpm_drive on all ranks at once; costs and clocks are optional."""

    def __init__(self, n_steps: int, bounds: Sequence[int], options: MGRITOptions,
                 iterations: Optional[int], batched: bool, seq: bool, costs: Costs,
                 adjoint: bool, clocks: Optional[Sequence[float]]) -> None:
        self.P = len(bounds) - 1
        self.bounds = list(bounds)
        self.levels = build_levels(n_steps, options)
        self.nl = len(self.levels)
        self.opts = options
        self.iters = options.max_iter if iterations is None else min(iterations,
                                                                     options.max_iter)
        self.batched = batched
        self.seq = seq
        self.c = costs
        self.adjoint = adjoint
        self.msg = costs.message(costs.state_bytes)
        self.nrelax = [options.nrelax_at(lv.index) for lv in self.levels]
        self.lv: list[list[_Lv]] = [[self._level(q, lv.index) for lv in self.levels]
                                    for q in range(self.P)]
        self.steps = [[0] * self.nl for _ in range(self.P)]
        self.calls = [[0] * self.nl for _ in range(self.P)]
        self.t = list(clocks) if clocks is not None else [0.0] * self.P
        self.wait = [0.0] * self.P
        self.red = [0.0] * self.P
        self.seen: list[list[set]] = [[set() for _ in range(self.nl)] for _ in range(self.P)]
        self.chain_done = [False] * self.P
        # ranks owning points of each level (the others skip every phase on it)
        self.active = [[q for q in range(self.P) if self.lv[q][lv].count > 0]
                       for lv in range(self.nl)]
        self.mail: dict[tuple[int, int], float] = {}
        self.messages = 0

    # -- grid ------------------------------------------------------------------------------
    def _owner(self, level: int, j: int) -> int:
        return bisect.bisect_right(self.bounds, j * self.levels[level].stride) - 1

    def _level(self, q: int, level: int) -> _Lv:
        L = self.levels[level]
        flo, fhi = self.bounds[q], self.bounds[q + 1] - 1
        lo = -(-flo // L.stride)
        hi = min(fhi // L.stride, L.n_intervals)
        m = hi - lo + 1 if hi >= lo else 0
        left = self._owner(level, lo - 1) if m > 0 and lo > 0 else -1
        right = self._owner(level, hi + 1) if m > 0 and hi < L.n_intervals else -1
        return _Lv(L.n_intervals, L.stride, L.cfactor, self.nrelax[level], lo, hi, left,
                   right)

    # -- primitive actions -----------------------------------------------------------------
    @staticmethod
    def _kind(call: float, step: float, m: int, batched: bool) -> float:
        """m steps of one kind: batched by the app (one call) or one by one."""
        return call + m * step if batched and m > 1 else m * (call + step)

    def _step_cost(self, q: int, level: int, js: Sequence[int], final: int,
                   batched: bool) -> float:
        c, m = self.c, len(js)
        if not self.adjoint:
            if final:  # recorded one by one (each step's graph is kept)
                return m * c.fwd_rec
            return self._kind(c.fwd_call, c.fwd, m, batched)
        if level == 0 and final:
            if self.nl == 1:  # sequential adjoint: one autograd call per rank's chain
                first = not self.chain_done[q]
                self.chain_done[q] = True
                return m * c.vjp_full + (c.vjp_full_call if first else 0.0)
            return self._kind(c.vjp_full_call, c.vjp_full, m, batched)
        cost = self._kind(c.vjp_call, c.vjp, m, batched)
        if level > 0:  # coarse graphs are built once per solve, on first use
            seen = self.seen[q][level]
            new = sum(1 for j in js if j not in seen)
            seen.update(js)
            cost += new * c.fwd_rec
        return cost

    def _batch(self, q: int, level: int, js: Sequence[int], final: int) -> None:
        """_lpm_step_batch: n steps, one callback if the app batches and n > 1."""
        n = len(js)
        if n == 0:
            return
        one = self.batched and n > 1
        calls = 1 if one else n
        self.steps[q][level] += n
        self.calls[q][level] += calls
        self.t[q] += (self._step_cost(q, level, js, final, one)
                      + calls * self.c.call_overhead + n * self.c.step_overhead)

    def _seq(self, q: int, level: int, js: Sequence[int], final: int) -> None:
        """seq_steps: n consecutive steps in one step_seq callback (the app still
        steps one by one inside it)."""
        self.steps[q][level] += len(js)
        self.calls[q][level] += 1
        self.t[q] += (self._step_cost(q, level, js, final, False) + self.c.call_overhead
                      + len(js) * self.c.step_overhead)

    def _sums(self, q: int, n: int) -> None:
        self.t[q] += n * self.c.vsum

    def _send(self, q: int, dest: int) -> None:
        self.mail[(q, dest)] = self.t[q] + self.msg
        self.messages += 1

    def _recv(self, q: int, src: int) -> None:
        arrival = self.mail.pop((src, q))
        if arrival > self.t[q]:
            self.wait[q] += arrival - self.t[q]
            self.t[q] = arrival

    def _phase(self, fn: Callable[[int], None], level: int) -> None:
        """Run one phase on the ranks owning points of `level`, left to right (all
        messages go rightwards; ranks without points there do nothing)."""
        self.mail = {}
        for q in self.active[level]:
            fn(q)

    # -- relax.c -----------------------------------------------------------------------------
    def fsweep(self, level: int, final: int) -> None:
        def run(q: int) -> None:
            L = self.lv[q][level]
            if L.count == 0:
                return
            cf, lo, hi = L.cf, L.lo, L.hi
            need_left = lo > 0 and lo % cf != 0
            send_right = L.right >= 0 and (hi + 1) % cf != 0
            c0 = -(-lo // cf) * cf
            clast = (hi // cf) * cf
            if send_right and hi % cf == 0:
                self._send(q, L.right)
            for k in range(1, cf):
                js = range(c0 + k, hi + 1, cf)
                if len(js) == 0:
                    break
                self._batch(q, level, js, final)
                if send_right and hi % cf != 0 and clast >= lo and hi - clast == k:
                    self._send(q, L.right)
            if need_left:
                self._recv(q, L.left)
                j = lo
                while j <= hi and j % cf != 0:
                    self._batch(q, level, (j,), final)
                    j += 1
                if send_right and hi < c0:
                    self._send(q, L.right)
        self._phase(run, level)

    def _cpoints(self, q: int, level: int, final: int) -> int:
        """The C-point steps of csweep / cpoint_steps; returns how many were done."""
        L = self.lv[q][level]
        if L.count == 0:
            return 0
        cf, lo, hi = L.cf, L.lo, L.hi
        need_left = lo > 0 and lo % cf == 0
        send_right = L.right >= 0 and (hi + 1) % cf == 0
        if send_right:
            self._send(q, L.right)
        first = -(-lo // cf) * cf
        if first == 0 or need_left:
            first += cf
        js = range(first, hi + 1, cf)
        self._batch(q, level, js, final)
        if need_left:
            self._recv(q, L.left)
            self._batch(q, level, (lo,), final)
        return len(js) + (1 if need_left else 0)

    def csweep(self, level: int, final: int) -> None:
        self._phase(lambda q: self._cpoints(q, level, final), level)

    def relax(self, level: int) -> None:
        for _ in range(self.lv[0][level].nrelax):
            self.fsweep(level, 0)
            self.csweep(level, 0)
        self.fsweep(level, 0)

    def coarse_solve(self, level: int, final: int) -> None:
        def run(q: int) -> None:
            L = self.lv[q][level]
            if L.count == 0:
                return
            if L.lo > 0:
                self._recv(q, L.left)
            start = L.lo if L.lo > 0 else 1
            if L.hi - start + 1 > 1 and self.seq:
                self._seq(q, level, range(start, L.hi + 1), final)
            else:
                for j in range(start, L.hi + 1):
                    self._batch(q, level, (j,), final)
            if L.right >= 0:
                self._send(q, L.right)
        self._phase(run, level)

    # -- restrict.c, residual.c, interp.c --------------------------------------------------------
    def restrict(self, level: int) -> None:
        # C-point steps (and on the fine grid the residual: one sum per C-point + norm)
        def cpts(q: int) -> None:
            n = self._cpoints(q, level, 0)
            if level == 0:
                self._sums(q, n + (1 if n else 0))
        self._phase(cpts, level)

        def fas(q: int) -> None:
            C = self.lv[q][level + 1]
            if C.count == 0:
                return
            need_left = C.lo > 0
            if C.right >= 0:
                self._send(q, C.right)
            js = range(C.lo + 1 if C.lo > 0 else 1, C.hi + 1)
            self._batch(q, level + 1, js, 0)
            self._sums(q, len(js))
            if need_left:
                self._recv(q, C.left)
                self._batch(q, level + 1, (C.lo,), 0)
                self._sums(q, 1)
        self._phase(fas, level + 1)

    def interpolate(self, level: int) -> None:
        for q in self.active[level + 1]:
            C = self.lv[q][level + 1]
            if C.count:
                self._sums(q, 2 * max(0, C.hi - max(C.lo, 1) + 1))
        if level > 0:
            self.fsweep(level, 0)

    # -- drive.c ---------------------------------------------------------------------------
    def _down(self, level: int, skip: bool, have_r: list[bool]) -> None:
        if skip:
            return  # injection: clones only
        self.relax(level)
        self.restrict(level)
        if level == 0:
            have_r[0] = True

    def _vcycle(self, level: int, skip: bool, have_r: list[bool]) -> None:
        if level == self.nl - 1:
            self.coarse_solve(level, 0)
            return
        self._down(level, skip, have_r)
        self._vcycle(level + 1, skip, have_r)
        self.interpolate(level)

    def _fcycle(self, level: int, skip: bool, have_r: list[bool]) -> None:
        if level == self.nl - 1:
            self.coarse_solve(level, 0)
            return
        self._down(level, skip, have_r)
        self._fcycle(level + 1, skip, have_r)
        self.interpolate(level)
        if level > 0:
            self._down(level, False, have_r)
            self._vcycle(level + 1, False, have_r)
            self.interpolate(level)

    def _allreduce(self) -> None:
        top = max(self.t)
        cost = 2 * self.c.alpha * math.ceil(math.log2(self.P)) if self.P > 1 else 0.0
        for q in range(self.P):
            self.red[q] += top + cost - self.t[q]
            self.t[q] = top + cost

    def run(self) -> SolveSim:
        if self.nl == 1:
            self.coarse_solve(0, 1)
        else:
            for k in range(self.iters):
                have_r = [False]
                skip = self.opts.skip and k == 0
                if self.opts.fmg:
                    self._fcycle(0, skip, have_r)
                else:
                    self._vcycle(0, skip, have_r)
                if have_r[0]:
                    self._allreduce()
            self.fsweep(0, 1)
            if self.opts.final_fc_relax:
                self.csweep(0, 1)
        return SolveSim(self.steps, self.calls, self.t, self.wait, self.red, self.nl,
                        self.messages)


def simulate_solve(n_steps: int, n_ranks: int, options: MGRITOptions, *,
                   iterations: Optional[int] = None, bounds: Optional[Sequence[int]] = None,
                   batched: bool = False, seq: bool = False, costs: Costs = ZERO,
                   adjoint: bool = False, clocks: Optional[Sequence[float]] = None
                   ) -> SolveSim:
    """Replay one MGRIT solve on `n_ranks` ranks (engine rank order).

    iterations: cycles done (default `options.max_iter`: training runs use a fixed
        number of iterations; pass the measured count when a tolerance stopped earlier).
    bounds: the partition (default `block_bounds`; the adjoint of LayerParallel uses
        `reversed_bounds(block_bounds(...))`).
    batched: the app has ``step_batch`` (the engine then makes one callback per batch
        of more than one step).
    seq: the app has ``step_seq`` (one callback per rank's stretch of the sequential
        coarsest-level solve).
    costs: per-operation costs (default zero: counting only); adjoint: use the adjoint
        cost kinds (vector–Jacobian products, coarse graphs built once per solve).
    clocks: the ranks' clocks at the start (engine rank order).
    """
    if bounds is None:
        bounds = block_bounds(n_steps, n_ranks)
    if len(bounds) != n_ranks + 1:
        raise ValueError(f"`bounds` must have n_ranks + 1 = {n_ranks + 1} entries, got "
                         f"{len(bounds)}")
    return _Replay(n_steps, bounds, options, iterations, batched, seq, costs, adjoint,
                   clocks).run()


def count_steps(n_steps: int, n_ranks: int, options: MGRITOptions, *,
                iterations: Optional[int] = None, bounds: Optional[Sequence[int]] = None,
                batched: bool = False, seq: bool = False
                ) -> tuple[list[list[int]], list[list[int]]]:
    """(step counts, step-callback counts), each per rank per level, of one solve:
    what the engine's ``step_counts()`` / ``batch_counts()`` report on each rank.
    `batched` / `seq`: the app has ``step_batch`` / ``step_seq`` (see `app_flags`)."""
    s = simulate_solve(n_steps, n_ranks, options, iterations=iterations, bounds=bounds,
                       batched=batched, seq=seq)
    return s.step_counts, s.batch_counts


# ------------------------------------------------------------------------------------------
# one training batch of LayerParallel
# ------------------------------------------------------------------------------------------
def solve_options(levels: int, cfactor: int, iters: int, nrelax: int = 1,
                  skip: bool = True) -> MGRITOptions:
    """The options LayerParallel's solves run with in a study (final FC sweep on)."""
    return MGRITOptions(max_levels=levels, cfactor=cfactor, max_iter=iters, nrelax=nrelax,
                        skip=skip, final_fc_relax=True)


@dataclass
class Prediction:
    """Predicted seconds per batch and its parts (max over ranks), with work counts."""

    seconds_per_batch: float
    forward_seconds: float
    backward_seconds: float
    comm_idle_seconds: float
    fwd_steps_max: int  # most steps any rank does in the forward solve
    bwd_steps_max: int
    fwd_levels: int
    bwd_levels: int
    details: dict = field(default_factory=dict)


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def predict(ranks: int, layers: int, costs: Costs, *, levels: int = TRAINING.levels,
            cfactor: int = TRAINING.cfactor, fwd_iters: int = TRAINING.fwd_iters,
            bwd_iters: int = TRAINING.bwd_iters, nrelax: int = 1, skip: bool = True,
            batched: tuple[bool, bool] = (False, False),
            seq: tuple[bool, bool] = (False, False)) -> Prediction:
    """Predicted time of one training batch of LayerParallel at `ranks` ranks.

    One batch: an allgather (inputs agree), ghost-layer parameters from the left
    neighbour, the forward MGRIT solve (`block_bounds`), the output broadcast from the
    last rank, the adjoint MGRIT solve on the reversed partition, the optimizer update
    of each rank's own layers, plus the fitted per-batch overhead.  `fwd_iters` /
    `bwd_iters` are the cycles done (the engine's max_iter when no tolerance is met).
    `batched` / `seq`: whether the forward / adjoint apps have ``step_batch`` /
    ``step_seq``.  Works for any scale (thousands of ranks): nothing is run, only
    replayed.
    """
    if ranks < 1 or layers < ranks:
        raise ValueError(f"need 1 <= ranks <= layers, got ranks={ranks}, layers={layers}")
    P, c = ranks, costs
    fo = solve_options(levels, cfactor, fwd_iters, nrelax, skip)
    bo = solve_options(levels, cfactor, bwd_iters, nrelax, skip)
    clocks = [0.0] * P
    sync = 2 * c.alpha * _log2(P)
    clocks = [sync] * P
    if P > 1:  # ghosts: the layers at coarse interval starts owned by the left neighbour
        ghosts = 2 * max(0, len(build_levels(layers, fo)) - 1)
        clocks = [t + (c.message(ghosts * c.param_bytes) if q else 0.0)
                  for q, t in enumerate(clocks)]
    bounds = block_bounds(layers, P)
    f = simulate_solve(layers, P, fo, bounds=bounds, batched=batched[0], seq=seq[0],
                       costs=c, clocks=clocks)
    # output broadcast from the last rank (the loss is computed everywhere)
    t_out = f.clocks[-1] + c.alpha * _log2(P)
    idle_bcast = [max(0.0, t_out - t) for t in f.clocks]
    clocks = [max(t, t_out) for t in f.clocks]
    forward = max(clocks)
    rb = reversed_bounds(bounds)
    b = simulate_solve(layers, P, bo, bounds=rb, batched=batched[1], seq=seq[1], costs=c,
                       adjoint=True, clocks=clocks[::-1])
    bclocks = b.clocks[::-1]  # back to communicator rank order
    own = [bounds[q + 1] - bounds[q] for q in range(P)]
    end = [t + c.opt_call + own[q] * c.opt for q, t in enumerate(bclocks)]
    total = max(end) + c.batch_overhead
    idle = [f.wait[q] + f.reduce[q] + idle_bcast[q] + b.wait[P - 1 - q] + b.reduce[P - 1 - q]
            for q in range(P)]
    return Prediction(
        seconds_per_batch=total, forward_seconds=forward,
        backward_seconds=total - forward, comm_idle_seconds=max(idle),
        fwd_steps_max=max(sum(s) for s in f.step_counts),
        bwd_steps_max=max(sum(s) for s in b.step_counts),
        fwd_levels=f.n_levels, bwd_levels=b.n_levels,
        details={"fwd_messages": f.messages, "bwd_messages": b.messages,
                 "fwd_wait_max": max(f.wait), "bwd_wait_max": max(b.wait)})


def pipeline_seconds(serial_seconds: float, ranks: int, micro_batches: int) -> float:
    """Pipeline parallelism's time per batch by the bubble model (no communication):
    serial / p * (1 + (p - 1) / m) for p stages and m micro-batches."""
    return serial_seconds / ranks * (1.0 + (ranks - 1) / micro_batches)


# ------------------------------------------------------------------------------------------
# CSV rows: costs in, prediction out; fitting the three constants
# ------------------------------------------------------------------------------------------
COST_COLUMNS = {"fwd": "cost_fwd_s", "fwd_call": "cost_fwd_call_s",
                "fwd_rec": "cost_fwd_rec_s", "vjp": "cost_vjp_s", "vjp_call": "cost_vjp_call_s",
                "vjp_full": "cost_vjp_full_s", "vjp_full_call": "cost_vjp_full_call_s",
                "vsum": "cost_sum_s", "opt": "cost_opt_s", "opt_call": "cost_opt_call_s",
                "state_bytes": "state_bytes", "param_bytes": "param_bytes",
                "alpha": "alpha_s", "beta": "beta_Bps"}


def costs_to_row(c: Costs) -> dict[str, Any]:
    """The CSV columns that carry `c` (measured parts only)."""
    d = asdict(c)
    return {col: d[name] for name, col in COST_COLUMNS.items()}


def costs_from_row(row: dict[str, Any]) -> Costs:
    vals = {name: float(row[col]) for name, col in COST_COLUMNS.items()}
    vals["state_bytes"] = int(vals["state_bytes"])
    vals["param_bytes"] = int(vals["param_bytes"])
    return Costs(**vals)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Fit:
    """Fitted constants (seconds) and how well they did on the fit rows."""

    call_overhead: float
    batch_overhead: float
    fit_rows: int
    fit_rms_rel_error: float
    step_overhead: float = 0.0


NO_FIT = Fit(0.0, 0.0, 0, float("nan"))


def predict_row(row: dict[str, Any], f: Optional[Fit] = None) -> Prediction:
    """Prediction for one study row (settings, measured costs, measured iterations)."""
    c = costs_from_row(row)
    if f is not None:
        c = c.with_fit(f)

    def flag(name: str) -> bool:
        return str(row.get(name, "")).lower() in ("1", "true", "yes")

    def iters(measured: str, cap: str) -> int:
        v = row.get(measured)
        try:
            return int(float(v))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return int(float(row[cap]))

    return predict(int(float(row["ranks"])), int(float(row["layers"])), c,
                   levels=int(float(row["levels"])), cfactor=int(float(row["cfactor"])),
                   fwd_iters=iters("fwd_iterations", "fwd_iters"),
                   bwd_iters=iters("bwd_iterations", "bwd_iters"),
                   nrelax=int(float(row.get("nrelax", 1) or 1)),
                   batched=(flag("fwd_batched"), flag("bwd_batched")),
                   seq=(flag("fwd_seq"), flag("bwd_seq")))


def fit(rows: Sequence[dict[str, Any]], delta: float = 1e-5) -> Fit:
    """Fit call_overhead, step_overhead and batch_overhead (all >= 0) to the measured
    seconds per batch of `rows`, minimising the squared relative error.

    Time is linear in batch_overhead and, to first order, in the two others (their
    slopes per row come from replays with each set to `delta`); the non-negative
    least-squares problem is solved exactly over its active sets.
    """
    import itertools

    import numpy as np

    if not rows:
        return NO_FIT
    probes = [Fit(0.0, 0.0, 0, 0.0), Fit(delta, 0.0, 0, 0.0), Fit(0.0, 0.0, 0, 0.0, delta)]
    base, cols, meas = [], [], []
    for r in rows:
        t0, ta, ts = (predict_row(r, p).seconds_per_batch for p in probes)
        base.append(t0)
        cols.append([(ta - t0) / delta, (ts - t0) / delta, 1.0])
        meas.append(float(r["seconds_per_batch"]))
    w = 1.0 / np.array(meas)
    a = np.array(cols) * w[:, None]
    y = (np.array(meas) - np.array(base)) * w
    best, best_x = math.inf, np.zeros(3)
    for k in range(4):
        for active in itertools.combinations(range(3), k):
            x = np.zeros(3)
            if active:
                sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
                if (sol < 0).any():
                    continue
                x[list(active)] = sol
            sse = float(np.sum((a @ x - y) ** 2))
            if sse < best:
                best, best_x = sse, x
    f = Fit(float(best_x[0]), float(best_x[2]), len(rows), 0.0, float(best_x[1]))
    errs = [(predict_row(r, f).seconds_per_batch - m) / m for r, m in zip(rows, meas)]
    return replace(f, fit_rms_rel_error=math.sqrt(sum(e * e for e in errs) / len(errs)))


# ------------------------------------------------------------------------------------------
# beyond the machine
# ------------------------------------------------------------------------------------------
MAP_RANKS = (64, 256, 1024, 4096)
MAP_LAYERS = (1024, 2048, 4096, 8192, 16384)


def serial_per_layer(rows: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(s0, s1) of serial seconds per batch ≈ s0 + s1 * layers, fitted to the measured
    serial baselines (s0 = 0 when only one depth was measured)."""
    pts = {}
    for r in rows:
        try:
            pts[int(float(r["layers"]))] = float(r["serial_seconds_per_batch"])
        except (KeyError, TypeError, ValueError):
            continue
    if not pts:
        raise ValueError("no rows with a serial baseline")
    if len(pts) == 1:
        (n, s), = pts.items()
        return 0.0, s / n
    xs, ys = list(pts), list(pts.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    s1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    s0 = my - s1 * mx
    if s1 <= 0 or s0 < 0:
        s0, s1 = 0.0, sum(y / x for x, y in zip(xs, ys)) / len(xs)
    return s0, s1


@dataclass
class ExtrapolationMap:
    """Predicted seconds per batch over ranks × layers (NaN where ranks > layers).

    mgrit[i][j] is the best over the tried level counts (levels[i][j] says which),
    serial[j] the serial baseline extrapolated linearly in depth, pipeline[i][j] the
    bubble model with `micro_batches` micro-batches."""

    ranks: list[int]
    layers: list[int]
    mgrit: list[list[float]]
    levels: list[list[int]]
    serial: list[float]
    pipeline: list[list[float]]
    micro_batches: int
    settings: dict = field(default_factory=dict)


def extrapolate(rows: Sequence[dict[str, Any]], f: Optional[Fit] = None, *,
                ranks: Sequence[int] = MAP_RANKS, layers: Sequence[int] = MAP_LAYERS,
                micro_batches: int = 8, max_level_choices: int = 3) -> ExtrapolationMap:
    """The model's map beyond this machine, from a study's rows.

    Uses the measured per-step costs and message costs of the deepest measured run
    (one thread per rank and the most MGRIT iterations preferred), its iterations
    and cfactor, the fitted
    constants `f`, and tries the deepest `max_level_choices` level counts (down to 2)
    at every point, keeping the fastest: more ranks need more levels, or the
    sequential coarsest solve dominates.
    """
    ok = [r for r in rows if r.get("cost_fwd_s") not in (None, "")]
    if not ok:
        raise ValueError("no rows with measured step costs")
    # the deepest run, one thread per rank, the most MGRIT iterations (conservative)
    ref = max(ok, key=lambda r: (int(float(r["threads"])) == 1, int(float(r["layers"])),
                                 int(float(r["fwd_iters"])) + int(float(r["bwd_iters"])),
                                 int(float(r["levels"]))))
    c = costs_from_row(ref)
    if f is not None:
        c = c.with_fit(f)
    cf = int(float(ref["cfactor"]))
    fi, bi = int(float(ref["fwd_iters"])), int(float(ref["bwd_iters"]))
    nrelax = int(float(ref.get("nrelax", 1) or 1))

    def flag(name: str) -> bool:
        return str(ref.get(name, "")).lower() in ("1", "true", "yes")

    batched = (flag("fwd_batched"), flag("bwd_batched"))
    seq = (flag("fwd_seq"), flag("bwd_seq"))
    s0, s1 = serial_per_layer(rows)
    serial = [s0 + s1 * n for n in layers]
    mg: list[list[float]] = []
    lv: list[list[int]] = []
    pipe: list[list[float]] = []
    for p in ranks:
        row_t, row_l, row_p = [], [], []
        for n, s in zip(layers, serial):
            if p > n:
                row_t.append(float("nan"))
                row_l.append(0)
                row_p.append(float("nan"))
                continue
            full = len(build_levels(n, MGRITOptions(cfactor=cf)))
            best = (math.inf, 0)
            for lvl in range(full, max(1, full - max_level_choices), -1):
                t = predict(p, n, c, levels=lvl, cfactor=cf, fwd_iters=fi, bwd_iters=bi,
                            nrelax=nrelax, batched=batched, seq=seq).seconds_per_batch
                best = min(best, (t, lvl))
            row_t.append(best[0])
            row_l.append(best[1])
            row_p.append(pipeline_seconds(s, p, micro_batches))
        mg.append(row_t)
        lv.append(row_l)
        pipe.append(row_p)
    return ExtrapolationMap(list(ranks), list(layers), mg, lv, serial, pipe, micro_batches,
                            {"cfactor": cf, "fwd_iters": fi, "bwd_iters": bi,
                             "width": ref.get("width"), "batch": ref.get("batch"),
                             "serial_s0": s0, "serial_s_per_layer": s1,
                             "alpha_s": c.alpha, "beta_Bps": c.beta,
                             "call_overhead_s": c.call_overhead,
                             "step_overhead_s": c.step_overhead,
                             "batch_overhead_s": c.batch_overhead})
