"""Training time per batch on one GPU: layer-parallel MGRIT against serial PyTorch.

    python -m layerpar.bench gpu [--csv PATH] [--models dense,conv] [--steps 20]
    make bench-gpu                      # the same, CSV to docs/gpu/bench-gpu.csv

One training batch is zero_grad, forward, cross-entropy, backward and an SGD step
(foreach).  Three ways to run it, all on the same GPU, same model and batch:

- eager serial: plain PyTorch `nn.Sequential` of u + h F(u), one kernel sequence per
  layer;
- graph serial: the same step captured once in a CUDA graph and replayed (the fastest
  serial baseline: no launch or dispatch cost per kernel);
- MGRIT: `LayerParallel` on one rank, batched cycle, cfactor 4, levels down to at most
  16 coarsest intervals, 2 forward / 1 backward iterations (`layerpar.opcount`), the
  step captured in one CUDA graph (`layerpar.parallel.capture_step`); its eager time,
  with the per-pass finiteness checks, is the column mgrit_eager_seconds_per_batch.
  The operation counts (profiler, on the GPU) are in the last two columns.

Times are medians over repeats, measured with CUDA events.  `loss_rel_diff` compares
the loss after `--steps` SGD steps (same initial weights, same batch) of MGRIT and of
eager serial training.  Models: (a) dense ODE-net 1,024 layers x 64, batch 256;
(b) conv ODE-net 256 layers x 16 channels, 32x32 images, batch 64.
"""
from __future__ import annotations

import argparse
import copy
import csv
import statistics
import sys
from typing import Any, Callable, Optional

import torch

from . import opcount

COLUMNS = ["device", "model", "layers", "seconds_per_batch", "eager_seconds_per_batch",
           "graph_seconds_per_batch", "speedup_vs_eager", "speedup_vs_graph",
           "loss_rel_diff", "mgrit_eager_seconds_per_batch", "mgrit_ops", "serial_ops"]


def time_cuda(fn: Callable[[], Any], warmup: int = 3, repeats: int = 15) -> float:
    """Median seconds of fn() over `repeats` calls, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graphed(step: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> Callable[[], Any]:
    """The training step captured in one CUDA graph (whole-network capture): warm up on
    a side stream, capture, return the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def losses_after(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
                 lr: float) -> float:
    """Loss after `steps` SGD steps on one batch."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=True)
    step = opcount.train_step(model, opt, x, y)
    for _ in range(steps):
        step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


def bench_model(name: str, device: str, steps: int, lr: float = 0.05,
                count_ops: bool = True) -> dict[str, Any]:
    """One CSV row: the three timings, speedups and the loss difference."""
    from .nets import sequential_twin
    from .parallel import LayerParallel, capture_step

    make, kw = opcount.CONFIGS[name]
    torch.manual_seed(0)
    net, x, y = make(**kw, device=device)
    net = net.to(device)
    fwd, bwd = opcount.mgrit_options(kw["n_steps"])

    plain = sequential_twin(copy.deepcopy(net))
    opt = torch.optim.SGD(plain.parameters(), lr=1e-4, foreach=True)
    t_eager = time_cuda(opcount.train_step(plain, opt, x, y))
    plain_g = sequential_twin(copy.deepcopy(net))
    opt_g = torch.optim.SGD(plain_g.parameters(), lr=1e-4, foreach=True)
    t_graph = time_cuda(graphed(opcount.train_step(plain_g, opt_g, x, y), opt_g))

    # MGRIT eager (with its per-pass finiteness checks), then captured in a CUDA graph
    lp = LayerParallel(copy.deepcopy(net), None, fwd, bwd)
    opt_m = torch.optim.SGD(lp.parameters(), lr=1e-4, foreach=True)
    t_mgrit_eager = time_cuda(opcount.train_step(lp, opt_m, x, y))
    lpc = LayerParallel(copy.deepcopy(net), None, fwd, bwd, check_finite=False)
    opt_c = torch.optim.SGD(lpc.parameters(), lr=1e-4, foreach=True)
    captured = capture_step(lpc, opt_c, torch.nn.functional.cross_entropy, x, y)
    t_mgrit = time_cuda(lambda: captured(x, y))

    # loss after `steps` SGD steps from the same weights: eager serial vs captured MGRIT
    loss_serial = losses_after(sequential_twin(copy.deepcopy(net)), x, y, steps, lr)
    lpl = LayerParallel(copy.deepcopy(net), None, fwd, bwd, check_finite=False)
    opt_l = torch.optim.SGD(lpl.parameters(), lr=lr, foreach=True)
    warm = min(3, steps)
    cl = capture_step(lpl, opt_l, torch.nn.functional.cross_entropy, x, y, warmup=warm)
    for _ in range(steps - warm):
        cl(x, y)
    with torch.no_grad():
        loss_mgrit = float(torch.nn.functional.cross_entropy(lpl(x), y))
    ops = opcount.ops_rows(models=(name,), device=device)[0] if count_ops else None
    row = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "model": name, "layers": kw["n_steps"], "seconds_per_batch": t_mgrit,
           "eager_seconds_per_batch": t_eager, "graph_seconds_per_batch": t_graph,
           "speedup_vs_eager": t_eager / t_mgrit, "speedup_vs_graph": t_graph / t_mgrit,
           "loss_rel_diff": abs(loss_mgrit - loss_serial) / abs(loss_serial),
           "mgrit_eager_seconds_per_batch": t_mgrit_eager,
           "mgrit_ops": ops.mgrit_ops if ops else "", "serial_ops": ops.serial_ops if ops else ""}
    return row


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerpar.bench gpu",
                                description=__doc__.split("\n")[0])
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    p.add_argument("--models", default="dense,conv", help="comma-separated: dense, conv")
    p.add_argument("--steps", type=int, default=20, help="SGD steps for the loss check")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="let cuDNN pick its fastest algorithms (for all three variants)")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in opcount.CONFIGS:
            p.error(f"--models: unknown model {m!r}; choose from {sorted(opcount.CONFIGS)}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if not torch.cuda.is_available():
        print("layerpar.bench gpu: no CUDA device here; run it on a GPU machine "
              "(make bench-gpu)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    rows = [bench_model(m, "cuda", args.steps) for m in models]
    print(f"layerpar.bench gpu: torch {torch.__version__}, {rows[0]['device']}, "
          f"cudnn.benchmark={args.cudnn_benchmark}, fp32 (no TF32)")
    print("  ".join(f"{c}" for c in COLUMNS[1:]))
    for r in rows:
        print("  ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                        for c in COLUMNS[1:]))
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS)
            w.writeheader()
            for r in rows:
                w.writerow(r)
    return 0
