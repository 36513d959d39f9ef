"""Vectorised or per-step MGRIT cycles: the default (``batched="auto"``) against both.

    python -m layerpar.bench paths [--ranks 1 2] [--coarsening average] [--quick]
        [--csv PATH]

For each case (a user's two-convolution block as in TorchBraid's MNIST example, a
dense net, a pre-norm MLP block) and each rank count, three `LayerParallel` models of
the same net take turns batch by batch: ``batched="auto"`` (the default, which times
both paths at its first pass), ``batched=True`` and ``batched=False``.  Seconds per
training batch (forward, loss, backward; the first batches, the auto choice's
measurement included, are warm-up) are rank 0's, the median of the timed batches.
The default must be within 5% of the faster of the other two in every row.
A fourth model runs vectorised cycles as they ran before the blocks' parameters were
kept flat (`layerpar.ode.flat`) and a pass's gradient rows reused: its parameters are
given storage of their own after it is built, so each step stacks copies of them, and
its adjoint makes new gradient rows every pass (``before ms``); ``batched / before`` is
the new default path over the one it replaced.
``--coarsening average``: the coarse levels evaluate the spanned layers' mean
parameters (before vectorised average coarsening, such a model ran per-step cycles:
the per-step column is what it cost then).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from typing import Callable, Optional

import torch
from torch import nn

from ..defaults import TRAINING
from ..ode.net import ODENet, Segment
from .benchkit import CSV_HELP, check_shared_options, dense_ode_net, interleaved_train_times, report
from .launch import world_comm
from .parsing import OneLineParser

FWD, BWD = TRAINING.fwd_options(), TRAINING.bwd_options()
MODES = (("auto", "auto"), ("batched", True), ("per-step", False))


class PreNormMLP(nn.Module):
    """A user's own residual branch: LayerNorm, then a two-layer GELU MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(self.norm(u))))


def two_conv(channels: int) -> nn.Module:
    """TorchBraid's MNIST step: conv3x3 - ReLU - conv3x3 - ReLU."""
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())


def cases(quick: bool) -> list[tuple[str, Callable[[], ODENet], tuple, int]]:
    """(name, net factory, input shape, classes)."""
    def conv(n: int) -> Callable[[], ODENet]:
        return lambda: ODENet(layers=[nn.Conv2d(1, 4, 3, padding=1),
                                      Segment(lambda k: two_conv(4), n, 1.0),
                                      nn.Flatten(), nn.Linear(4 * 28 * 28, 10)])

    def dense(n: int, width: int) -> Callable[[], ODENet]:
        return lambda: dense_ode_net(width, n, 10, inputs=8)

    def mlp(n: int, width: int) -> Callable[[], ODENet]:
        return lambda: ODENet(open=nn.Linear(8, width), steps=lambda k: PreNormMLP(width),
                              n_steps=n, t_final=1.0, close=nn.Linear(width, 10))

    if quick:
        return [("conv 2x(3x3) 4ch 28x28 b50, 16 layers", conv(16), (50, 1, 28, 28), 10),
                ("dense 64x32 b64", dense(64, 32), (64, 8), 10)]
    return [("conv 2x(3x3) 4ch 28x28 b50, 32 layers", conv(32), (50, 1, 28, 28), 10),
            ("conv 2x(3x3) 4ch 28x28 b50, 64 layers", conv(64), (50, 1, 28, 28), 10),
            ("dense 256x32 b64", dense(256, 32), (64, 8), 10),
            ("dense 1024x32 b128", dense(1024, 32), (128, 8), 10),
            ("pre-norm MLP 128x32 b64", mlp(128, 32), (64, 8), 10)]


def _worker(args: argparse.Namespace) -> None:
    from ..parallel import LayerParallel

    comm = world_comm()
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    torch.set_num_threads(1)
    for name, make, shape, classes in cases(args.quick):
        torch.manual_seed(0)
        net = make()
        x, y = torch.randn(*shape), torch.randint(0, classes, (shape[0],))
        models = [LayerParallel(copy.deepcopy(net), comm, FWD, BWD, batched=b,
                                coarsening=args.coarsening) for _, b in MODES]
        before = LayerParallel(copy.deepcopy(net), comm, FWD, BWD, batched=True,
                               coarsening=args.coarsening)
        with torch.no_grad():
            for p in before.parameters():
                p.data = p.data.clone()  # apart: the steps stack copies (no flat rows)
        for runner in before._runners.values():
            runner.bapp.reuse_rows = False
        models.append(before)
        # two warm-up calls each: the auto model measures both paths there
        times = interleaved_train_times(models, x, y, args.repeats, warmup=2)
        choice = next(iter(models[0].cycle_paths[0].values()))  # the one input shape
        if rank == 0:
            labels = [label for label, _ in MODES] + ["before"]
            med = {label: statistics.median(t) for label, t in zip(labels, times)}
            best = min(med["batched"], med["per-step"])
            print("PATHBENCH " + json.dumps({
                "case": name, "ranks": size, "coarsening": args.coarsening,
                **{f"{label}_ms": round(1e3 * v, 2) for label, v in med.items()},
                "auto_chose": "batched" if choice.batched else "per-step",
                "auto_vs_best": round(med["auto"] / best, 3),
                "before_ms": round(1e3 * med["before"], 2),
                "batched_vs_before": round(med["batched"] / med["before"], 3)}), flush=True)
        for m in models:
            m.close()


def format_rows(rows: list[dict]) -> str:
    head = f"{'case':<42} {'ranks':>5} {'auto ms':>9} {'batched ms':>10} " \
           f"{'per-step ms':>11} {'auto chose':>10} {'auto / best':>11} " \
           f"{'before ms':>10} {'batched / before':>16}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:<42} {r['ranks']:>5} {r['auto_ms']:>9.1f} "
                     f"{r['batched_ms']:>10.1f} {r['per-step_ms']:>11.1f} "
                     f"{r['auto_chose']:>10} {r['auto_vs_best']:>11.3f} "
                     f"{r['before_ms']:>10.1f} {r['batched_vs_before']:>16.3f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = OneLineParser(prog="python -m layerpar.bench paths",
                      description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts")
    p.add_argument("--quick", action="store_true", help="small cases, 3 repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed batches (default 9)")
    p.add_argument("--csv", metavar="PATH", help=CSV_HELP)
    p.add_argument("--coarsening", choices=("injection", "average"), default="injection",
                   help="parameter coarsening of the coarse levels (default injection)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(r < 1 for r in args.ranks):
        p.error(f"`--ranks` must be >= 1, got {args.ranks}")
    check_shared_options(p, args, "case,ranks,coarsening")
    args.repeats = args.repeats or (3 if args.quick else 9)
    if args.worker:
        _worker(args)
        return 0
    from .launch import run_worker_job

    inner = ["--worker", "--repeats", str(args.repeats), "--coarsening", args.coarsening] + (
        ["--quick"] if args.quick else [])
    rows = [r for n in args.ranks for r in run_worker_job(
        "layerpar.apps.pathbench", n, inner, marker="PATHBENCH", timeout=args.timeout)]
    return report(f"layerpar.bench paths: 3 levels cf 4, 2/1 iterations, {args.coarsening} "
                  f"coarsening, 1 thread per rank, median of {args.repeats} batches (forward "
                  f"+ loss + backward), models taking turns", format_rows(rows), rows,
                  args.csv)


if __name__ == "__main__":
    sys.exit(main())
