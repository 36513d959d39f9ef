"""Data x layer parallelism on the same processes: which split of N processes is fastest.

    python -m layerpar.bench grid [--np 4] [--launcher mpiexec|torchrun|both]
                                  [--quick] [--repeats K] [--csv PATH]

Starts one job of N processes per launcher (mpiexec: mpi4py; torchrun:
torch.distributed with gloo).  Inside it, every split R x L of the N processes
(R replicas of a layer-parallel model over L ranks: N x 1, ..., 1 x N) trains the
same net on the same global batches, interleaved batch by batch so that drifts of
the machine hit every split alike.  Rows: time per batch (the slowest process's,
median over batches), and the gradient average's part of it (time spent starting
and waiting for the replicas' reductions, slowest process), with N x 1 and 1 x N as
the pure data- and pure layer-parallel ends.  The reduction's time includes waiting
for the slowest replica (load imbalance), not only moving the `KiB reduced`.

The net: a dense ODE-net (width 16, 256 layers; --quick: 64), global batch 128,
MGRIT 3 levels, cfactor 4, 2 forward / 1 backward iterations, fixed counts (tol 0),
float32, one thread per process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

from ..defaults import TRAINING
from .benchkit import CSV_HELP, check_shared_options, dense_ode_net, report
from .parsing import OneLineParser

BATCH = 128  # the global batch every split trains on

__all__ = ["main"]


def _splits(n: int) -> list[tuple[int, int]]:
    return [(r, n // r) for r in range(n, 0, -1) if n % r == 0]


def _worker(args: argparse.Namespace) -> None:
    """One process of the job: time every split, print one JSON line on rank 0."""
    import torch
    from torch import nn

    import layerpar

    torch.set_num_threads(1)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        comm: Any = dist.group.WORLD
        launcher = "torchrun"
    else:
        from .launch import mpi_world

        comm = mpi_world()
        launcher = "mpiexec"
    width, batch = 16, BATCH
    fwd, bwd = TRAINING.fwd_options(tol=0.0), TRAINING.bwd_options(tol=0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, 4, (batch,), generator=g)
    runs = []
    for R, L in _splits(args.np):
        grid = layerpar.ProcessGrid(comm, data=R, layers=L)
        torch.manual_seed(0)
        net = dense_ode_net(width, args.layers, 4)
        model = layerpar.LayerParallel(net, None, fwd, bwd, grid=grid)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        runs.append({"R": R, "L": L, "grid": grid, "model": model, "opt": opt,
                     "x": grid.shard(x), "y": grid.shard(y), "times": [], "reduce": []})
    world = runs[0]["grid"].world
    for rep in range(args.repeats + 2):  # two warm-up rounds
        for run in runs:
            model, opt = run["model"], run["opt"]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(run["x"]), run["y"]).backward()
            opt.step()
            dt = time.perf_counter() - t0
            ar = model.averager.last_seconds if model.averager is not None else 0.0
            got = world.allgather_object((dt, ar), "a benchmark batch's times")
            if rep >= 2:
                run["times"].append(max(t for t, _ in got))
                run["reduce"].append(max(a for _, a in got))
    if world.group_rank == 0:
        for run in runs:
            ms = 1000 * statistics.median(run["times"])
            ar = 1000 * statistics.median(run["reduce"])
            print("GRIDBENCH " + json.dumps({
                "launcher": launcher, "processes": args.np, "data": run["R"],
                "layers": run["L"], "net_layers": args.layers,
                "ms_per_batch": round(ms, 2), "min_ms": round(1000 * min(run["times"]), 2),
                "allreduce_ms": round(ar, 3), "allreduce_share": round(ar / ms, 4),
                "reduced_kib": round((run["model"]._averager.bytes
                                      if run["model"]._averager is not None else 0) / 1024,
                                     1)}),
                flush=True)
    for run in runs:
        run["model"].close()


def _launch(launcher: str, n: int, argv: list[str], timeout: float) -> list[dict]:
    from .launch import run_worker_job

    return run_worker_job("layerpar.apps.gridbench", n, ["--worker", *argv], marker="GRIDBENCH",
                          launcher=launcher, timeout=timeout)


def format_rows(rows: list[dict]) -> str:
    head = (f"{'launcher':<9} {'grid R x L':>10} {'ms/batch':>9} {'min ms':>8} "
            f"{'allreduce ms':>12} {'share':>6} {'KiB reduced':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['launcher']:<9} {str(r['data']) + ' x ' + str(r['layers']):>10} "
                     f"{r['ms_per_batch']:>9.1f} {r['min_ms']:>8.1f} "
                     f"{r['allreduce_ms']:>12.2f} {100 * r['allreduce_share']:>5.1f}% "
                     f"{r['reduced_kib']:>11.1f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = OneLineParser(prog="python -m layerpar.bench grid",
                      description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=4, help="processes (default 4)")
    p.add_argument("--launcher", choices=("mpiexec", "torchrun", "both"), default="both",
                   help="how the processes are started and talk (default both: one job each)")
    p.add_argument("--quick", action="store_true", help="64 layers, 3 repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed batches (default 10)")
    p.add_argument("--csv", metavar="PATH", help=CSV_HELP)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--procs", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.np < 1:
        p.error(f"`--np` must be >= 1, got {args.np}")
    if BATCH % args.np:
        p.error(f"`--np` must divide the global batch of {BATCH} (its N x 1 split has N "
                f"replicas of it), got {args.np}")
    check_shared_options(p, args, "launcher,processes,data")
    args.layers = args.layers or (64 if args.quick else 256)
    args.repeats = args.repeats or (3 if args.quick else 10)
    if args.worker:  # (--procs: torchrun's own parser would take --np)
        args.np = args.procs
        _worker(args)
        return 0
    inner = ["--procs", str(args.np), "--layers", str(args.layers), "--repeats",
             str(args.repeats)]
    launchers = ["mpiexec", "torchrun"] if args.launcher == "both" else [args.launcher]
    rows = [r for lau in launchers for r in _launch(lau, args.np, inner, args.timeout)]
    return report(f"layerpar.bench grid: {args.np} processes, dense ODE-net {args.layers} "
                  f"layers x width 16, global batch 128, 3 levels cf 4, 2/1 iterations, 1 "
                  f"thread each, median of {args.repeats} batches",
                  format_rows(rows), rows, args.csv)


if __name__ == "__main__":
    sys.exit(main())
