"""Replica synchronisation strategies: bytes sent and time per batch, with and without a
slow link between nodes.

    python -m layerpar.bench sync [--quick] [--batches K] [--layers N] [--width W]
                                  [--batch B] [--gbits G] [--grids 2x2,4x1] [--csv PATH]

One mpiexec job of 4 processes.  For the grids 2x2 and 4x1, the replicas are put in 2
simulated nodes (``ProcessGrid(nodes=2)``: 2 processes per node), and each strategy
(allreduce, DASO with S cycling 4, 2, 1 and bfloat16 parameters between nodes, Lion Cub
with momentum averaged every 64 batches) trains a dense ODE-net (default 256 layers x
width 128) for K
batches (default 64: Lion Cub's momentum average falls in the window; DASO's cycle of
7 batches repeats), first without, then with the slow-link model (`SlowLink`: 1 Gbit/s,
50 us; --gbits), each process's inter-node operations delayed by latency + bytes / bandwidth).

Rows: bytes sent per process per batch (the grid's meter: what each process handed to
the transport, averaged over processes and batches) by kind -- MGRIT's point-to-point
messages in the layer group, data-dimension collectives inside a node, and
inter-node -- and the time per batch: the slowest process's time of each batch,
averaged over the batches after the first two (the mean, so that DASO's exchange
batches and Lion Cub's momentum average count; the median is in the CSV too).  Four
runs per grid and link: allreduce and DASO with Adam (fused where torch has it), and
allreduce and Lion Cub with `Lion`; each strategy's bytes and speed-up are relative to
allreduce with the same optimizer (the optimizer's own cost is in the time).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any, Optional

from ..defaults import TRAINING
from .benchkit import CSV_HELP, check_shared_options, dense_ode_net, report
from .launch import mpi_world
from .parsing import OneLineParser

__all__ = ["main"]

MIN_GBITS = 0.01  # Gbit/s: the slowest simulated link a command line may ask for

#: (strategy, optimizer): DASO is compared with all-reduce under Adam, Lion Cub with
#: all-reduce under Lion (the same optimizer: the speed-up is the strategy's)
CONFIGS = (("allreduce", "adam"), ("daso", "adam"), ("allreduce", "lion"), ("lioncub", "lion"))
GRIDS = ((2, 2), (4, 1))


def _worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import layerpar
    from layerpar.parallel import DASO, Lion, LionCub, SlowLink

    torch.set_num_threads(1)
    comm = mpi_world()
    width, batch = args.width, args.batch
    fwd, bwd = TRAINING.fwd_options(tol=0.0), TRAINING.bwd_options(tol=0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, 4, (batch,), generator=g)
    grids = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",")]
    for R, L in grids:
        for link in (None, SlowLink(args.gbits * 1e9, 50e-6)):
            for name, optim in CONFIGS:
                sync: Any = {"allreduce": "allreduce", "daso": DASO(cycle=(4, 2, 1)),
                             "lioncub": LionCub(momentum_every=64)}[name]
                grid = layerpar.ProcessGrid(comm, data=R, layers=L, sync=sync, nodes=2,
                                            link=link)
                torch.manual_seed(0)
                net = dense_ode_net(width, args.layers, 4)
                model = layerpar.LayerParallel(net, None, fwd, bwd, grid=grid)
                opt = Lion(model.parameters(), lr=3e-4) if optim == "lion" else \
                    _adam(model.parameters())
                grid.sync.attach(model, opt)
                xs, ys = grid.shard(x), grid.shard(y)
                times = []
                grid.world.allreduce_sum([0.0])  # start together
                for _ in range(args.batches):
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(model(xs), ys).backward()
                    opt.step()
                    times.append(time.perf_counter() - t0)
                kinds = ("p2p", "data", "internode")
                sums = grid.world.allreduce_sum([float(grid.meter.get(k, 0)) for k in kinds])
                slow = grid.world.allgather_object(times, "a benchmark's times")
                per = [max(ts[i] for ts in slow) for i in range(args.batches)]
                n_params = sum(p.numel() for p in model.parameters())
                params = grid.world.allreduce_sum([float(n_params)])[0] / R
                if grid.world.group_rank == 0:
                    row = {"grid": f"{R}x{L}", "sync": name, "optimizer": optim,
                           "link": "none" if link is None else f"{args.gbits:g}Gbit/s+50us",
                           "layers": args.layers, "width": width, "batch": batch,
                           "params": int(params),
                           **{f"{k}_bytes": round(v / (R * L) / args.batches)
                              for k, v in zip(kinds, sums)},
                           "ms_per_batch": round(1000 * statistics.mean(per[2:]), 2),
                           "ms_median": round(1000 * statistics.median(per[2:]), 2)}
                    row["data_dim_bytes"] = row["data_bytes"] + row["internode_bytes"]
                    print("SYNCBENCH " + json.dumps(row), flush=True)
                model.close()
                grid.close()


def _adam(params: Any) -> Any:
    """Adam, fused where torch has it (`layerpar.apps.loop.adam`)."""
    from .loop import adam

    return adam(params, lr=1e-3)


def _launch(argv: list[str], timeout: float) -> list[dict]:
    from .launch import run_worker_job

    return run_worker_job("layerpar.apps.syncbench", 4, ["--worker", *argv], marker="SYNCBENCH",
                          timeout=timeout)


def format_rows(rows: list[dict]) -> str:
    """The table: bytes by kind and ms/batch per grid, strategy and link, with the
    data-dimension and inter-node bytes and the slow-link time relative to allreduce."""
    base = {(r["grid"], r["link"], r["optimizer"]): r for r in rows
            if r["sync"] == "allreduce"}
    head = (f"{'grid':<5} {'sync':<9} {'opt':<4} {'link':<12} {'p2p B':>9} {'data B':>9} "
            f"{'internode B':>11} {'data-dim x':>10} {'internode x':>11} {'ms/batch':>9} "
            f"{'speed-up':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        b = base[(r["grid"], r["link"], r["optimizer"])]
        fewer = b["data_dim_bytes"] / max(r["data_dim_bytes"], 1)
        inter = b["internode_bytes"] / max(r["internode_bytes"], 1)
        lines.append(f"{r['grid']:<5} {r['sync']:<9} {r['optimizer']:<4} {r['link']:<12} "
                     f"{r['p2p_bytes']:>9} "
                     f"{r['data_bytes']:>9} {r['internode_bytes']:>11} {fewer:>9.1f}x "
                     f"{inter:>10.1f}x {r['ms_per_batch']:>9.1f} "
                     f"{b['ms_per_batch'] / r['ms_per_batch']:>7.2f}x")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = OneLineParser(prog="python -m layerpar.bench sync",
                      description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="64 layers, 14 batches")
    p.add_argument("--batches", type=int, default=None, help="batches per run (default 64)")
    p.add_argument("--width", type=int, default=128, help="width of the dense net (128)")
    p.add_argument("--batch", type=int, default=32, help="global batch (32)")
    p.add_argument("--gbits", type=float, default=1.0,
                   help="the slow link's bandwidth in Gbit/s (default 1)")
    p.add_argument("--grids", default="2x2,4x1", help="R x L grids (default 2x2,4x1)")
    p.add_argument("--csv", metavar="PATH", help=CSV_HELP)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the dense net (default 256; --quick 64)")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = 64 if args.quick else 256
    if args.batches is None:
        args.batches = 14 if args.quick else 64
    for name in ("batches", "width", "batch", "layers"):
        if getattr(args, name) < 1:
            p.error(f"`--{name}` must be >= 1")
    if args.batches < 3:
        p.error("`--batches` must be >= 3 (the first two are not timed)")
    if not MIN_GBITS <= args.gbits < math.inf:
        p.error(f"`--gbits` must be a finite number >= {MIN_GBITS:g} (Gbit/s; slower "
                f"links make a run take hours), got {args.gbits}")
    check_shared_options(p, args, "grid,sync,optimizer")
    try:
        shapes = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",")]
    except ValueError:
        p.error(f"`--grids` must be like 2x2,4x1, got {args.grids!r}")
    if any(len(g) != 2 or g[0] * g[1] != 4 or g[0] % 2 for g in shapes):
        p.error("`--grids`: R x L = 4 processes, R even (2 nodes)")
    if args.batch % 4:
        p.error("`--batch` must be divisible by 4 (the replicas of the 4x1 grid)")
    if args.worker:
        _worker(args)
        return 0
    rows = _launch(["--gbits", str(args.gbits), "--grids", args.grids,
                    "--layers", str(args.layers), "--batches", str(args.batches),
                    "--width", str(args.width), "--batch", str(args.batch)], args.timeout)
    return report(f"layerpar.bench sync: 4 processes (mpiexec) in 2 simulated nodes, dense "
                  f"ODE-net {args.layers} layers x width {args.width}, global batch "
                  f"{args.batch}, float32, 3 levels cf 4, 2/1 iterations, {args.batches} "
                  f"batches per run; bytes sent per process per batch; 'x' = allreduce's "
                  f"bytes / this row's; ms/batch: the slowest process, mean of batches "
                  f"3..{args.batches}", format_rows(rows), rows, args.csv)


if __name__ == "__main__":
    sys.exit(main())
