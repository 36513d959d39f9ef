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
records its graph, vector–Jacobian products, vector sums, optimizer update, all on
the real block in this process) and from the ping-pong (`layerpar.studies.pingpong`:
``alpha``, ``beta``).  Two constants are fitted on small runs (`fit`): the cost of
one step callback through the engine beyond the torch work (``call_overhead``), and
a fixed cost per batch (``batch_overhead``: loss, plain layers, collectives'
Python side).

`count_steps` exposes the replay's work counters; tests check them against the
engine's ``step_counts`` / ``batch_counts`` for exact equality.  `predict` gives time
per batch at any scale; `pipeline_seconds` is the bubble model of pipeline
parallelism it is compared with.
"""
from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from ..mgrit.grid import block_bounds, build_levels, reversed_bounds
from ..mgrit.options import MGRITOptions

__all__ = ["Costs", "Fit", "Prediction", "count_steps", "fit", "measure_costs",
           "pipeline_seconds", "predict", "predict_row", "simulate_solve", "solve_options"]


# ------------------------------------------------------------------------------------------
# costs
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """Seconds per operation (per rank, at that rank's thread count) and message costs.

    fwd: one forward step without a graph (MGRIT relaxation, coarse levels).
    fwd_rec: one forward step recording its graph (the final fine-grid sweep).
    vjp: one vector–Jacobian product with respect to the state (adjoint relaxation).
    vjp_full: one vector–Jacobian product with respect to state and parameters
        (the adjoint's final sweep, which yields the parameter gradients).
    vsum: one vector sum alpha*x + beta*y (restriction, interpolation, residual).
    opt: the optimizer update of one layer's parameters.
    state_bytes: bytes of one state (one message); param_bytes: of one layer's
        parameters (ghost-layer messages, sent as float64).
    alpha, beta: message latency (s) and bandwidth (bytes/s), from the ping-pong.
    call_overhead: fitted seconds per step callback beyond the torch work.
    batch_overhead: fitted seconds per batch (loss, plain layers, bookkeeping).
    """

    fwd: float
    fwd_rec: float
    vjp: float
    vjp_full: float
    vsum: float = 0.0
    opt: float = 0.0
    state_bytes: int = 0
    param_bytes: int = 0
    alpha: float = 0.0
    beta: float = math.inf
    call_overhead: float = 0.0
    batch_overhead: float = 0.0

    def message(self, nbytes: float) -> float:
        """Time for one message of `nbytes` bytes: alpha + nbytes / beta."""
        return self.alpha + (nbytes / self.beta if self.beta > 0 else 0.0)

    def with_fit(self, f: Fit) -> Costs:
        return replace(self, call_overhead=f.call_overhead, batch_overhead=f.batch_overhead)


ZERO = Costs(0.0, 0.0, 0.0, 0.0)


def _timeit(fn: Callable[[], Any], budget: float = 0.05, repeats: int = 5) -> float:
    """Median seconds per call of `fn` over `repeats` loops of about `budget` seconds."""
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
    return statistics.median(per)


def measure_costs(cfg: dict, threads: int = 1, budget: float = 0.05) -> Costs:
    """Measure the per-step costs of the study model `cfg` in this process.

    Builds the network of `cfg` (`layerpar.studies.worker.build_net`) and times one of
    its residual steps the ways the layer-parallel solves use it: forward without and
    with a graph, the two vector–Jacobian products, a vector sum and an SGD update of
    one layer.  Runs with `threads` intra-op threads (restored afterwards).
    """
    import torch

    from ..mgrit.solve import vec_sum
    from ..ode.net import Segment
    from .worker import build_net, input_shape

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        net = build_net(cfg)
        seg = next(m for m in net.layers if isinstance(m, Segment))
        block, scheme = seg.blocks[0], seg.scheme
        dt = seg.time(1) - seg.time(0)
        g = torch.Generator().manual_seed(0)
        u = torch.randn(input_shape(cfg), generator=g)
        v = torch.randn(input_shape(cfg), generator=g)
        params = [p for p in block.parameters() if p.requires_grad]

        def fwd() -> None:
            with torch.no_grad():
                scheme.step(block, u, dt)

        def record() -> tuple:
            with torch.enable_grad():
                u_in = u.detach().requires_grad_()
                return u_in, scheme.step(block, u_in, dt)

        u_in, out = record()

        def vjp() -> None:
            torch.autograd.grad(out, u_in, v, retain_graph=True)

        def rec_full() -> None:
            a, b = record()
            torch.autograd.grad(b, [a, *params], v)

        def vsum() -> None:
            vec_sum(1.0, u, -1.0, v)

        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.SGD(params, lr=1e-3)
        c_fwd = _timeit(fwd, budget)
        c_rec = _timeit(record, budget)
        c_vjp = _timeit(vjp, budget)
        c_full = max(_timeit(rec_full, budget) - c_rec, c_vjp)
        c_sum = _timeit(vsum, budget)
        c_opt = _timeit(opt.step, budget)
        state_bytes = u.numel() * u.element_size()
        param_bytes = 8 * sum(t.numel() for t in block.state_dict().values())
    finally:
        torch.set_num_threads(old)
    return Costs(fwd=c_fwd, fwd_rec=c_rec, vjp=c_vjp, vjp_full=c_full, vsum=c_sum,
                 opt=c_opt, state_bytes=state_bytes, param_bytes=param_bytes)


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
                 iterations: Optional[int], batched: bool, costs: Costs, adjoint: bool,
                 clocks: Optional[Sequence[float]]) -> None:
        self.P = len(bounds) - 1
        self.bounds = list(bounds)
        self.levels = build_levels(n_steps, options)
        self.nl = len(self.levels)
        self.opts = options
        self.iters = options.max_iter if iterations is None else min(iterations,
                                                                     options.max_iter)
        self.batched = batched
        self.c = costs
        self.adjoint = adjoint
        self.msg = costs.message(costs.state_bytes)
        self.lv: list[list[_Lv]] = [[self._level(q, lv.index) for lv in self.levels]
                                    for q in range(self.P)]
        self.steps = [[0] * self.nl for _ in range(self.P)]
        self.calls = [[0] * self.nl for _ in range(self.P)]
        self.t = list(clocks) if clocks is not None else [0.0] * self.P
        self.wait = [0.0] * self.P
        self.red = [0.0] * self.P
        self.seen: list[list[set]] = [[set() for _ in range(self.nl)] for _ in range(self.P)]
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
        return _Lv(L.n_intervals, L.stride, L.cfactor, self.opts.nrelax_at(level), lo, hi,
                   left, right)

    # -- primitive actions -----------------------------------------------------------------
    def _step_cost(self, q: int, level: int, js: Sequence[int], final: int) -> float:
        c = self.c
        if not self.adjoint:
            per = c.fwd_rec if final else c.fwd
            return per * len(js)
        if level == 0:
            return (c.vjp_full if final else c.vjp) * len(js)
        seen = self.seen[q][level]
        new = sum(1 for j in js if j not in seen)
        seen.update(js)
        return c.vjp * len(js) + c.fwd_rec * new  # coarse graphs are built once per solve

    def _batch(self, q: int, level: int, js: Sequence[int], final: int) -> None:
        """_lpm_step_batch: n steps, one callback if the app batches and n > 1."""
        n = len(js)
        if n == 0:
            return
        calls = 1 if (self.batched and n > 1) else n
        self.steps[q][level] += n
        self.calls[q][level] += calls
        self.t[q] += self._step_cost(q, level, js, final) + calls * self.c.call_overhead

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

    def _phase(self, fn: Callable[[int], None]) -> None:
        """Run one phase on every rank, left to right (all messages go rightwards)."""
        self.mail = {}
        for q in range(self.P):
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
        self._phase(run)

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
        self._phase(lambda q: self._cpoints(q, level, final))

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
            for j in range(start, L.hi + 1):
                self._batch(q, level, (j,), final)
            if L.right >= 0:
                self._send(q, L.right)
        self._phase(run)

    # -- restrict.c, residual.c, interp.c --------------------------------------------------------
    def restrict(self, level: int) -> None:
        # C-point steps (and on the fine grid the residual: one sum per C-point + norm)
        def cpts(q: int) -> None:
            n = self._cpoints(q, level, 0)
            if level == 0:
                self._sums(q, n + (1 if n else 0))
        self._phase(cpts)

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
        self._phase(fas)

    def interpolate(self, level: int) -> None:
        for q in range(self.P):
            C = self.lv[q][level + 1]
            if C.count:
                self._sums(q, 2 * max(0, C.hi - max(C.lo, 1) + 1))
        if level > 0:
            self.fsweep(level, 0)

    # -- drive.c ------------------------------------------------------------------------------------
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
                   batched: bool = False, costs: Costs = ZERO, adjoint: bool = False,
                   clocks: Optional[Sequence[float]] = None) -> SolveSim:
    """Replay one MGRIT solve on `n_ranks` ranks (engine rank order).

    iterations: cycles done (default `options.max_iter`: training runs use a fixed
        number of iterations; pass the measured count when a tolerance stopped earlier).
    bounds: the partition (default `block_bounds`; the adjoint of LayerParallel uses
        `reversed_bounds(block_bounds(...))`).
    batched: the app has ``step_batch`` (the engine then makes one callback per batch
        of more than one step).
    costs: per-operation costs (default zero: counting only); adjoint: use the adjoint
        cost kinds (vector–Jacobian products, coarse graphs built once per solve).
    clocks: the ranks' clocks at the start (engine rank order).
    """
    if bounds is None:
        bounds = block_bounds(n_steps, n_ranks)
    if len(bounds) != n_ranks + 1:
        raise ValueError(f"`bounds` must have n_ranks + 1 = {n_ranks + 1} entries, got "
                         f"{len(bounds)}")
    return _Replay(n_steps, bounds, options, iterations, batched, costs, adjoint,
                   clocks).run()


def count_steps(n_steps: int, n_ranks: int, options: MGRITOptions, *,
                iterations: Optional[int] = None, bounds: Optional[Sequence[int]] = None,
                batched: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """(step counts, step-callback counts), each per rank per level, of one solve:
    what the engine's ``step_counts()`` / ``batch_counts()`` report on each rank."""
    s = simulate_solve(n_steps, n_ranks, options, iterations=iterations, bounds=bounds,
                       batched=batched)
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


def predict(ranks: int, layers: int, costs: Costs, *, levels: int = 3, cfactor: int = 4,
            fwd_iters: int = 2, bwd_iters: int = 1, nrelax: int = 1, skip: bool = True,
            batched: tuple[bool, bool] = (False, False)) -> Prediction:
    """Predicted time of one training batch of LayerParallel at `ranks` ranks.

    One batch: an allgather (inputs agree), ghost-layer parameters from the left
    neighbour, the forward MGRIT solve (`block_bounds`), the output broadcast from the
    last rank, the adjoint MGRIT solve on the reversed partition, the optimizer update
    of each rank's own layers, plus the fitted per-batch overhead.  `fwd_iters` /
    `bwd_iters` are the cycles done (the engine's max_iter when no tolerance is met).
    Works for any scale (thousands of ranks): nothing is run, only replayed.
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
    f = simulate_solve(layers, P, fo, bounds=bounds, batched=batched[0], costs=c,
                       clocks=clocks)
    # output broadcast from the last rank (the loss is computed everywhere)
    t_out = f.clocks[-1] + c.alpha * _log2(P)
    idle_bcast = [max(0.0, t_out - t) for t in f.clocks]
    clocks = [max(t, t_out) for t in f.clocks]
    forward = max(clocks)
    rb = reversed_bounds(bounds)
    b = simulate_solve(layers, P, bo, bounds=rb, batched=batched[1], costs=c, adjoint=True,
                       clocks=clocks[::-1])
    bclocks = b.clocks[::-1]  # back to communicator rank order
    own = [bounds[q + 1] - bounds[q] for q in range(P)]
    end = [t + own[q] * c.opt for q, t in enumerate(bclocks)]
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
# CSV rows: costs in, prediction out; fitting the two constants
# ------------------------------------------------------------------------------------------
COST_COLUMNS = {"fwd": "cost_fwd_s", "fwd_rec": "cost_fwd_rec_s", "vjp": "cost_vjp_s",
                "vjp_full": "cost_vjp_full_s", "vsum": "cost_sum_s", "opt": "cost_opt_s",
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
    """Fitted constants and how well they did on the fit rows."""

    call_overhead: float
    batch_overhead: float
    fit_rows: int
    fit_rms_rel_error: float


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
                   batched=(flag("fwd_batched"), flag("bwd_batched")))


def fit(rows: Sequence[dict[str, Any]], delta: float = 1e-5) -> Fit:
    """Fit call_overhead and batch_overhead (both >= 0) to the measured seconds per batch
    of `rows`, minimising the squared relative error.

    Time is linear in batch_overhead and, to first order, in call_overhead (its
    slope per row is taken from two replays); a non-negative 2-parameter least-squares
    problem is solved over its active sets.
    """
    if not rows:
        return Fit(0.0, 0.0, 0, float("nan"))
    base, slope, meas = [], [], []
    for r in rows:
        t0 = predict_row(r, Fit(0.0, 0.0, 0, 0.0)).seconds_per_batch
        t1 = predict_row(r, Fit(delta, 0.0, 0, 0.0)).seconds_per_batch
        base.append(t0)
        slope.append((t1 - t0) / delta)
        meas.append(float(r["seconds_per_batch"]))
    w = [1.0 / m for m in meas]

    def sse(a: float, b: float) -> float:
        return sum((wi * (t0 + a * s + b - m)) ** 2
                   for wi, t0, s, m in zip(w, base, slope, meas))

    cands = [(0.0, 0.0)]
    # a only
    num = sum(wi * wi * s * (m - t0) for wi, t0, s, m in zip(w, base, slope, meas))
    den = sum((wi * s) ** 2 for wi, s in zip(w, slope))
    if den > 0:
        cands.append((max(0.0, num / den), 0.0))
    # b only
    num_b = sum(wi * wi * (m - t0) for wi, t0, m in zip(w, base, meas))
    den_b = sum(wi * wi for wi in w)
    cands.append((0.0, max(0.0, num_b / den_b)))
    # both (2x2 normal equations)
    saa = den
    sab = sum(wi * wi * s for wi, s in zip(w, slope))
    sbb = den_b
    ya, yb = num, num_b
    det = saa * sbb - sab * sab
    if abs(det) > 1e-30 * max(1.0, saa * sbb):
        a, b = (ya * sbb - yb * sab) / det, (saa * yb - sab * ya) / det
        if a >= 0 and b >= 0:
            cands.append((a, b))
    a, b = min(cands, key=lambda ab: sse(*ab))
    f = Fit(a, b, len(rows), 0.0)
    errs = [(predict_row(r, f).seconds_per_batch - m) / m for r, m in zip(rows, meas)]
    return Fit(a, b, len(rows), math.sqrt(sum(e * e for e in errs) / len(errs)))
