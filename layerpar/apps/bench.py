"""A small benchmark of the MGRIT engine: what one step costs beyond the user's work.

    python -m layerpar.bench [--quick] [--csv PATH]
    python -m layerpar.bench ops [--quick]                  # operations per batch
    python -m layerpar.bench gpu [--csv PATH]               # one GPU (layerpar.apps.gpubench)
    python -m layerpar.bench grid [--np 4] [--csv PATH]     # data x layer (layerpar.apps.gridbench)
    python -m layerpar.bench engines [--quick] [--csv PATH] # native engine vs XBraid
    python -m layerpar.bench tta [--smoke] [--cases a,b,c,d] # time to accuracy (layerpar.apps.tta)
    python -m layerpar.bench versus [--smoke] [--cases ...]  # against data, pipeline parallelism
    python -m layerpar.bench sync [--csv PATH]              # replica sync (layerpar.apps.syncbench)
    python -m layerpar.bench paths [--csv PATH]             # batched vs per-step cycles
    mpiexec -n 2 python -m mpi4py -m layerpar.bench        # the same at 2 ranks

It reports numbers and asserts nothing.  Rows:

- engine overhead: a trivial step (``lambda u, ts, te, lvl: u`` on a 1-element tensor),
  so everything measured is the engine and its Python callbacks: the fixed cost of a
  tiny solve, a one-level solve (sequential stepping through the engine) and a 3-level
  FCF solve, as wall time divided by the number of step calls (all ranks), next to a
  plain Python loop calling the same step;
- sequential vs MGRIT max_levels=1: a small tanh layer on a [32, 32] tensor stepped by
  a plain Python loop and by a one-level solve, and their ratio.

Under mpiexec the solves run on ``MPI.COMM_WORLD`` (timings are the slowest rank's);
alone, with ``comm=None``.  Every figure is the min (and median) over repeats.

To add rows (e.g. LayerParallel), write ``def my_rows(ctx: BenchContext) -> list[Row]``
and append it to `BENCHMARKS` (or decorate it with `@benchmark`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from ..defaults import TRAINING
from ..mgrit import MGRITOptions, grid_time, solve
from .benchkit import (
    CSV_HELP,
    check_shared_options,
    dense_ode_net,
    interleaved_train_times,
    write_dict_rows,
)
from .launch import world_comm
from .loop import train_step
from .nets import sequential_twin
from .parsing import OneLineParser

__all__ = ["BENCHMARKS", "BenchContext", "Row", "benchmark", "main", "run", "subcommands"]


@dataclass
class Row:
    """One line of the table: a timed case."""

    benchmark: str
    case: str
    ranks: int
    steps: int  # step calls timed (all ranks together); 0 where not meaningful
    min_s: float
    median_s: float
    note: str = ""

    @property
    def us_per_step(self) -> float:
        """Minimum wall time per step call, in microseconds (NaN without steps)."""
        return 1e6 * self.min_s / self.steps if self.steps else float("nan")


@dataclass
class BenchContext:
    """What a benchmark function gets: size (quick or not), repeats, the communicator."""

    quick: bool = False
    repeats: int = 5
    comm: Any = None  # an mpi4py communicator when run under mpiexec with > 1 rank
    info: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return 1 if self.comm is None else self.comm.Get_size()

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.Get_rank()

    def sum(self, value: float) -> float:
        return value if self.comm is None else self.comm.allreduce(value)

    def time(self, fn: Callable[[], Any]) -> tuple[list[float], Any]:
        """Wall times of `repeats` calls of fn (the slowest rank's), and fn's last value.

        One untimed call first (lazy initialisation, caches, allocator)."""
        out = fn()
        times = []
        for _ in range(self.repeats):
            if self.comm is not None:
                self.comm.Barrier()
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            if self.comm is not None:
                from mpi4py import MPI

                dt = self.comm.allreduce(dt, op=MPI.MAX)
            times.append(dt)
        return times, out


BenchFn = Callable[[BenchContext], "list[Row]"]
BENCHMARKS: list[BenchFn] = []
MAX_THREADS = 1024  # torch threads per rank a command line may ask for


def benchmark(fn: BenchFn) -> BenchFn:
    """Register a benchmark function (it is run in order of registration)."""
    BENCHMARKS.append(fn)
    return fn


def _row(ctx: BenchContext, bench: str, case: str, steps: int, times: list[float],
         note: str = "") -> Row:
    return Row(bench, case, ctx.size, steps, min(times), statistics.median(times), note)


def _loop(step: Callable, u0: torch.Tensor, n: int, t_final: float) -> torch.Tensor:
    u = u0
    for i in range(n):
        u = step(u, grid_time(i, n, 0.0, t_final), grid_time(i + 1, n, 0.0, t_final), 0)
    return u


@benchmark
def engine_overhead(ctx: BenchContext) -> list[Row]:
    """A step that does nothing: the cost of the engine per step call."""
    n = 2000 if ctx.quick else 20000

    def step(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
        return u

    u0 = torch.ones(1, dtype=torch.float64)
    rows = []
    times, _ = ctx.time(lambda: _loop(step, u0, n, 1.0))
    rows.append(_row(ctx, "engine overhead", "python loop, trivial step (rank 0)", n, times,
                     "the call itself"))
    one = MGRITOptions(max_levels=1)
    tiny = 2 * ctx.size
    times, _ = ctx.time(lambda: solve(step, u0, tiny, 1.0, one, comm=ctx.comm))
    rows.append(_row(ctx, "engine overhead", f"solve max_levels=1, N={tiny}", 0, times,
                     "fixed cost of one solve (checks, transport, setup)"))
    times, res = ctx.time(lambda: solve(step, u0, n, 1.0, one, comm=ctx.comm))
    rows.append(_row(ctx, "engine overhead", "solve max_levels=1", n, times))
    fcf = MGRITOptions(max_levels=3, cfactor=2, nrelax=1, tol=0.0, max_iter=3)
    times, res = ctx.time(lambda: solve(step, u0, n, 1.0, fcf, comm=ctx.comm))
    total = int(ctx.sum(sum(res.step_counts)))
    rows.append(_row(ctx, "engine overhead", "solve 3-level FCF, cf 2", total, times,
                     f"{res.iterations} iterations, steps per level (rank 0) "
                     f"{res.step_counts}"))
    return rows


@benchmark
def sequential_vs_one_level(ctx: BenchContext) -> list[Row]:
    """A small tanh layer: a plain loop against the same steps through the engine."""
    n = 500 if ctx.quick else 2000
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 32, generator=g) / 32**0.5
    b = torch.randn(32, generator=g) * 0.1
    u0 = torch.randn(32, 32, generator=g)

    def step(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
        return u + (te - ts) * torch.tanh(torch.addmm(b, u, w.t()))

    loop_times, u_loop = ctx.time(lambda: _loop(step, u0, n, 1.0))
    times, res = ctx.time(lambda: solve(step, u0, n, 1.0, MGRITOptions(max_levels=1),
                                        comm=ctx.comm))
    same = bool(torch.equal(res.final_state, u_loop))
    ratio = min(times) / min(loop_times)
    return [
        _row(ctx, "tanh [32,32]", "python loop (rank 0)", n, loop_times),
        _row(ctx, "tanh [32,32]", "solve max_levels=1", n, times,
             f"{ratio:.2f}x the loop; same result: {same}"),
    ]


def _train_time(ctx: BenchContext, model: torch.nn.Module, x: torch.Tensor,
                y: torch.Tensor) -> list[float]:
    """Seconds per batch (`loop.train_step` without an optimiser: forward, loss on every
    rank, backward) over the repeats."""

    def one() -> None:
        train_step(model, x, y)

    reps = ctx.repeats
    ctx.repeats = max(reps, 7)
    try:
        times, _ = ctx.time(one)
    finally:
        ctx.repeats = reps
    return times


def _train_times_interleaved(ctx: BenchContext, models: list[torch.nn.Module],
                             x: torch.Tensor, y: torch.Tensor) -> list[list[float]]:
    """Seconds per batch of each model, one rank, the models taking turns call by call
    (`interleaved_train_times`), at least 21 times each."""
    return interleaved_train_times(models, x, y, repeats=max(21, ctx.repeats))


def _layer_parallel_rows(ctx: BenchContext, name: str, make: Callable[[], Any],
                         x: torch.Tensor, y: torch.Tensor) -> list[Row]:
    import copy

    from ..parallel import LayerParallel

    torch.manual_seed(0)
    net = make()
    rows = []
    if ctx.size == 1:
        # the three serial cases take turns call by call (see _train_times_interleaved)
        lp1 = LayerParallel(copy.deepcopy(net), None)
        t_plain, t_oracle, t = _train_times_interleaved(
            ctx, [sequential_twin(copy.deepcopy(net)), copy.deepcopy(net), lp1], x, y)
        base = min(t_plain)
        rows.append(_row(ctx, name, "plain PyTorch nn.Sequential", 0, t_plain, "baseline"))
        rows.append(_row(ctx, name, "ODENet (serial oracle)", 0, t_oracle,
                         f"{min(t_oracle) / base:.2f}x plain"))
        rows.append(_row(ctx, name, "LayerParallel max_levels=1", 0, t,
                         f"{min(t) / base:.2f}x plain (target <= 1.05; median "
                         f"{statistics.median(t) / statistics.median(t_plain):.2f}x)"))
    elif ctx.rank == 0:
        base = min(_train_time(BenchContext(quick=ctx.quick, repeats=ctx.repeats),
                               sequential_twin(copy.deepcopy(net)), x, y))
    else:
        base = float("nan")
    fwd, bwd = TRAINING.fwd_options(), TRAINING.bwd_options()
    lp = LayerParallel(copy.deepcopy(net), ctx.comm, fwd, bwd)
    t = _train_time(ctx, lp, x, y)
    if ctx.comm is not None:
        base = ctx.comm.bcast(base, root=0)
    rows.append(_row(ctx, name, "LayerParallel 3 levels cf 4, 2 fwd / 1 bwd iters", 0, t,
                     f"{min(t) / base:.2f}x plain (1 rank)"))
    return rows


@benchmark
def layer_parallel_training(ctx: BenchContext) -> list[Row]:
    """Time per batch (forward + backward) of the digits conv net and a deep narrow dense
    net: plain PyTorch, the serial oracle, LayerParallel exact (max_levels=1, 1 rank)
    and MGRIT 3 levels / cf 4 / 2 forward and 1 backward iterations."""
    from ..ode import ODENet
    from .nets import problem_net

    torch.set_num_threads(1)
    n_dense = 64 if ctx.quick else 256
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)

    def dense() -> ODENet:
        return dense_ode_net(32, n_dense, 10, t_final=n_dense / 8)

    def digits() -> ODENet:  # the digits problem's net (8 channels), 16 layers
        return problem_net("digits", n_layers=16)

    xi = torch.randn(50, 1, 8, 8, generator=g)
    yi = torch.randint(0, 10, (50,), generator=g)
    rows = _layer_parallel_rows(ctx, f"dense {n_dense}x32, batch 64", dense, x, y)
    rows += _layer_parallel_rows(ctx, "digits conv 16 layers, batch 50", digits, xi, yi)
    return rows


def engine_rows(ctx: BenchContext) -> list[Row]:
    """Both MGRIT engines at the same settings (needs the XBraid engine, XBRAID_DIR).

    `solve()` of a tanh layer on a float64 [32, 32] state (256 steps on [0, 1], 3
    levels, cf 4, FCF, to tol 1e-10), and the time per training batch (forward +
    backward, `train_step`) of LayerParallel on the Peaks net (32 layers, width 8,
    batch 100; 3 levels, cf 4, 2 forward / 1 adjoint iterations), per-step path for
    both (XBraid steps one layer per call) and the native engine's batched default
    beside them."""
    import copy

    from ..mgrit.xbraid import require_xbraid
    from ..parallel import LayerParallel
    from .data import peaks
    from .nets import problem_net

    require_xbraid()
    rows: list[Row] = []
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 32, generator=g, dtype=torch.float64) / 32 ** 0.5
    u0 = torch.randn(32, 32, generator=g, dtype=torch.float64)

    def step(u: torch.Tensor, ts: float, te: float, level: int) -> torch.Tensor:
        return u + (te - ts) * torch.tanh(u @ w)

    n = 64 if ctx.quick else 256
    opts = MGRITOptions(max_levels=3, cfactor=4, tol=1e-10, max_iter=30)
    base = None
    for engine in ("native", "xbraid"):
        times, res = ctx.time(lambda e=engine: solve(step, u0, n, 1.0, opts, ctx.comm,
                                                     engine=e))
        steps = int(ctx.sum(float(sum(res.step_counts))))
        base = min(times) if base is None else base
        rows.append(_row(ctx, f"solve() tanh 32x32, {n} steps, 3 levels cf 4", engine, steps,
                         times, f"{res.iterations} iterations, {min(times) / base:.2f}x native"))
    xt, yt, _, _ = peaks(500, 0, seed=0)
    x, y = xt[:100], yt[:100]
    torch.manual_seed(0)
    net = problem_net("peaks")
    fwd, bwd = TRAINING.fwd_options(), TRAINING.bwd_options()
    cases = [("native, per step", dict(engine="native", batched=False)),
             ("xbraid, per step", dict(engine="xbraid", batched=False)),
             ("native, batched (its default)", dict(engine="native", batched=True))]
    models = [LayerParallel(copy.deepcopy(net), ctx.comm, fwd, bwd, **kw) for _, kw in cases]
    if ctx.size == 1:  # the models take turns call by call (see _train_times_interleaved)
        per_model = _train_times_interleaved(ctx, models, x, y)
    else:
        per_model = [_train_time(ctx, m, x, y) for m in models]
    base = min(per_model[0])
    for (label, _), t in zip(cases, per_model):
        rows.append(_row(ctx, "LayerParallel Peaks 32x8, batch 100, 3 levels cf 4, "
                         "2 fwd / 1 bwd iters", label, 0, t,
                         f"{min(t) / base:.2f}x native per step"))
    return rows


def _engines_main(argv: list[str]) -> int:
    """`python -m layerpar.bench engines`: the native engine against XBraid."""
    p = OneLineParser(prog="python -m layerpar.bench engines",
                      description=engine_rows.__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller solve, 3 repeats")
    p.add_argument("--csv", metavar="PATH", help=CSV_HELP)
    args = p.parse_args(argv)
    check_shared_options(p, args, "benchmark,case,ranks")
    comm = world_comm()
    torch.set_num_threads(1)
    ctx = BenchContext(quick=args.quick, repeats=3 if args.quick else 7, comm=comm)
    rows = engine_rows(ctx)
    if ctx.rank == 0:
        # (at one rank the LayerParallel models take turns call by call, more often)
        turns = (f" ({max(21, ctx.repeats)} for LayerParallel, the models taking turns)"
                 if ctx.size == 1 else "")
        print(f"layerpar.bench engines: {ctx.size} rank(s), torch {torch.__version__}, "
              f"1 thread per rank, {ctx.repeats} repeats{turns}")
        print(format_table(rows))
        if args.csv:
            _write_csv(args.csv, rows)
    return 0


def _write_csv(path: str, rows: list[Row]) -> None:
    """The rows as CSV (with us_per_step)."""
    write_dict_rows(path, [{**asdict(r), "us_per_step": r.us_per_step} for r in rows])


def run(ctx: BenchContext, only: Optional[list[str]] = None) -> list[Row]:
    """Run the registered benchmarks (or those named in `only`) and return their rows."""
    rows: list[Row] = []
    for fn in BENCHMARKS:
        if only and fn.__name__ not in only:
            continue
        rows.extend(fn(ctx))
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table."""
    head = ["benchmark", "case", "ranks", "steps", "min ms", "median ms", "us/step", "note"]
    body = [[r.benchmark, r.case, str(r.ranks), str(r.steps), f"{1e3 * r.min_s:.2f}",
             f"{1e3 * r.median_s:.2f}", f"{r.us_per_step:.2f}" if r.steps else "-", r.note]
            for r in rows]
    widths = [max(len(x[k]) for x in [head] + body) for k in range(len(head))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(line, widths)).rstrip()
             for line in [head] + body]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    return "\n".join(lines)


def subcommands() -> dict[str, Callable[[list[str]], int]]:
    """The subcommands of ``python -m layerpar.bench`` by name: each module's `main`
    (imported here, when one is asked for; none of them imports this module)."""
    from . import gpubench, gridbench, opcount, pathbench, syncbench, tta

    return {"ops": opcount.main, "gpu": gpubench.main, "paths": pathbench.main,
            "engines": _engines_main, "tta": tta.main, "versus": tta.versus_main,
            "grid": gridbench.main,
            "sync": syncbench.main}


def main(argv: Optional[list[str]] = None) -> int:
    """Command line: run the benchmarks, print the table on rank 0, optionally write CSV.
    A subcommand's name as the first argument runs that benchmark instead
    (`subcommands`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-"):
        commands = subcommands()
        if argv[0] in commands:
            return commands[argv[0]](argv[1:])
    doc = __doc__.split("\n")
    p = OneLineParser(
        prog="python -m layerpar.bench", description=doc[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands (each has its own --help):\n" + "\n".join(
            line for line in doc[2:doc.index("", 2)]))
    p.add_argument("--quick", action="store_true", help="smaller sizes, 3 repeats")
    p.add_argument("--repeats", type=int, default=None, help="repeats per case (default 5)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (default 1: the cases are tiny)")
    p.add_argument("--csv", metavar="PATH", help=CSV_HELP)
    p.add_argument("--only", nargs="*", metavar="NAME",
                   help=f"run only these: {', '.join(f.__name__ for f in BENCHMARKS)}")
    args = p.parse_args(argv)
    # checked before any measurement: one line and exit 2, as argparse reports
    if not 1 <= args.threads <= MAX_THREADS:
        p.error(f"`--threads` must be in [1, {MAX_THREADS}], got {args.threads}")
    names = [f.__name__ for f in BENCHMARKS]
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        p.error(f"`--only` {', '.join(unknown)}: no such benchmark (choose from "
                f"{', '.join(names)})")
    check_shared_options(p, args, "benchmark,case,ranks")

    comm = world_comm()
    size = 1 if comm is None else comm.Get_size()
    torch.set_num_threads(max(1, args.threads))
    ctx = BenchContext(quick=args.quick, repeats=args.repeats or (3 if args.quick else 5),
                       comm=comm)
    rows = run(ctx, args.only)
    if ctx.rank == 0:
        print(f"layerpar.bench: {size} rank(s), torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread(s) per rank, {ctx.repeats} repeats, "
              f"python {sys.version.split()[0]}")
        print(format_table(rows))
        if args.csv:
            _write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
