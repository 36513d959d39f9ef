"""Training time per batch on one GPU: layer-parallel MGRIT against serial PyTorch.

    python -m layerpar.bench gpu [--csv PATH] [--models dense,conv] [--steps 20]
    make bench-gpu                      # the same, CSV to docs/results/gpu/bench-gpu-rows.csv

One training batch is zero_grad, forward, cross-entropy, backward and an SGD step
(foreach).  Three ways to run it, all on the same GPU, same model and batch:

- eager serial: plain PyTorch `nn.Sequential` of u + h F(u), one kernel sequence per
  layer;
- graph serial: the same step captured once in a CUDA graph and replayed (the fastest
  serial baseline: no launch or dispatch cost per kernel);
- MGRIT: `LayerParallel` on one rank, batched cycle, cfactor 4, levels down to at most
  16 coarsest intervals, 2 forward / 1 backward iterations (`layerpar.apps.opcount`), the
  step captured in one CUDA graph (`layerpar.parallel.capture_step`); its eager time,
  with the per-pass finiteness checks, is the column mgrit_eager_seconds_per_batch.
  The operation counts (profiler, on the GPU) are in the last two columns.

Times are medians over repeats, measured with CUDA events.  `loss_rel_diff` compares
the loss after `--steps` SGD steps (same initial weights, same batch) of MGRIT and of
eager serial training.  Models (`layerpar.apps.opcount.CONFIGS`): (a) dense ODE-net 1,024
layers x 64, batch 256; (b) conv ODE-net 256 layers x 16 channels, 32x32 images, batch
64; (c) conv16: 1,024 layers x 16 channels, 16x16, batch 16; (d) transformer: 256
pre-norm transformer blocks, d = 128, 4 heads, sequence 64, batch 16.

More serial baselines (columns after `serial_ops`): the eager and graph-captured serial
step with ``cudnn.benchmark`` on, and the serial model under ``torch.compile``
(``--no-compile`` skips it: compiling a thousand layers takes minutes);
`best_serial_seconds` is the fastest of all serial variants and `speedup_vs_best`
MGRIT's speedup over it.  `mgrit_torch_seconds_per_batch`: captured MGRIT with the
fused Triton steps switched off (``LAYERPAR_TRITON=0``); `fused_steps` whether the
first-use measurement chose the fused steps for any shape.  `predicted_*`: the GPU
model (`layerpar.apps.studies.gpumodel`, H100 constants) for this net and these operation
counts, and `model_error` = (predicted - measured) / measured of the MGRIT time.
"""
from __future__ import annotations

import copy
import statistics
import sys
from typing import Any, Callable, Optional

import torch

from . import opcount
from .benchkit import CSV_HELP, check_shared_options, write_dict_rows
from .parsing import OneLineParser

COLUMNS = ["device", "model", "layers", "seconds_per_batch", "eager_seconds_per_batch",
           "graph_seconds_per_batch", "speedup_vs_eager", "speedup_vs_graph",
           "loss_rel_diff", "mgrit_eager_seconds_per_batch", "mgrit_ops", "serial_ops",
           "cudnn_eager_seconds_per_batch", "cudnn_graph_seconds_per_batch",
           "compile_seconds_per_batch", "best_serial_seconds", "best_serial",
           "speedup_vs_best", "mgrit_torch_seconds_per_batch", "fused_steps", "regime",
           "predicted_seconds_per_batch", "predicted_speedup_vs_graph", "model_error"]
#: the issue's rows: model -> (label, target speedup over graph-captured serial)
ROWS = {"dense": ("(a) dense 1024 x 64, batch 256", 15.0),
        "conv": ("(b) conv 256 x 16 ch, 32x32, batch 64", 1.0),
        "conv16": ("(c) conv 1024 x 16 ch, 16x16, batch 16", 3.0),
        "transformer": ("(d) transformer 256 x d128, 4 heads, seq 64, batch 16", 2.0)}


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


def model_args(name: str) -> tuple[str, int, int, int, int, int]:
    """(gpumodel kind, layers, batch, width, size, heads) of a CONFIGS net."""
    kw = opcount.CONFIGS[name][1]
    if name == "dense":
        return "dense", kw["n_steps"], kw["batch"], kw["width"], 1, 4
    if name == "transformer":
        return "transformer", kw["n_steps"], kw["batch"], kw["d_model"], kw["seq"], kw["heads"]
    return "conv", kw["n_steps"], kw["batch"], kw["channels"], kw["size"], 4


def prediction(name: str, serial_ops: Optional[int] = None,
               mgrit_ops: Optional[int] = None) -> Any:
    """The GPU model's prediction (`gpumodel.predict_gpu`) for a CONFIGS net with the
    MGRIT options of `opcount.mgrit_options`."""
    from .studies.gpumodel import predict_gpu

    kind, layers, batch, width, size, heads = model_args(name)
    fwd, bwd = opcount.mgrit_options(layers)
    return predict_gpu(kind, layers, batch, width, size, levels=fwd.max_levels,
                       cfactor=fwd.cfactor, fwd_iters=fwd.max_iter, bwd_iters=bwd.max_iter,
                       heads=heads, serial_ops=serial_ops, mgrit_ops=mgrit_ops)


def _serial_time(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, graph: bool,
                 compile: bool = False) -> float:
    from .nets import sequential_twin

    plain = sequential_twin(copy.deepcopy(net))
    opt = torch.optim.SGD(plain.parameters(), lr=1e-4, foreach=True)
    model = torch.compile(plain) if compile else plain
    step = opcount.train_step(model, opt, x, y)
    return time_cuda(graphed(step, opt) if graph else step)


def _captured_mgrit(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, fwd: Any,
                    bwd: Any, fused: bool) -> tuple[float, bool]:
    """(seconds per captured MGRIT batch, whether fused steps were chosen anywhere)."""
    import os

    from ..parallel import LayerParallel, capture_step

    old = os.environ.get("LAYERPAR_TRITON")
    os.environ["LAYERPAR_TRITON"] = "1" if fused else "0"
    try:
        lpc = LayerParallel(copy.deepcopy(net), None, fwd, bwd, check_finite=False)
    finally:
        if old is None:
            os.environ.pop("LAYERPAR_TRITON")
        else:
            os.environ["LAYERPAR_TRITON"] = old
    opt_c = torch.optim.SGD(lpc.parameters(), lr=1e-4, foreach=True)
    captured = capture_step(lpc, opt_c, torch.nn.functional.cross_entropy, x, y)
    t = time_cuda(lambda: captured(x, y))
    used = any(any(getattr(getattr(r.bb, "fast", None), "choice", {}).values())
               for r in lpc.runners if r.bb is not None)
    return t, used


def bench_model(name: str, device: str, steps: int, lr: float = 0.05,
                count_ops: bool = True, compile: bool = True) -> dict[str, Any]:
    """One CSV row: the serial baselines, captured MGRIT (fused steps where faster, and
    with them off), speedups, the loss difference and the model's prediction."""
    from ..parallel import LayerParallel, capture_step
    from .nets import sequential_twin

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
    # more serial baselines: cudnn.benchmark (eager, graph) and torch.compile
    bench = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        serial = {"eager": t_eager, "graph": t_graph,
                  "cudnn-eager": _serial_time(net, x, y, graph=False),
                  "cudnn-graph": _serial_time(net, x, y, graph=True)}
    finally:
        torch.backends.cudnn.benchmark = bench
    row["cudnn_eager_seconds_per_batch"] = serial["cudnn-eager"]
    row["cudnn_graph_seconds_per_batch"] = serial["cudnn-graph"]
    row["compile_seconds_per_batch"] = ""
    if compile:
        try:
            serial["compile"] = row["compile_seconds_per_batch"] = _serial_time(
                net, x, y, graph=False, compile=True)
        except Exception as exc:  # noqa: BLE001 - a failed compile is reported, not fatal
            print(f"layerpar.bench gpu: torch.compile of {name} failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
    best = min(serial, key=serial.get)  # type: ignore[arg-type]
    row["best_serial_seconds"], row["best_serial"] = serial[best], best
    row["speedup_vs_best"] = serial[best] / t_mgrit
    # the fused Triton steps: chosen per shape on first use; and the torch path alone
    t_torch, _ = _captured_mgrit(net, x, y, fwd, bwd, fused=False)
    _, used = _captured_mgrit(net, x, y, fwd, bwd, fused=True)
    row["mgrit_torch_seconds_per_batch"], row["fused_steps"] = t_torch, used
    pred = prediction(name, ops.serial_ops if ops else None, ops.mgrit_ops if ops else None)
    row["regime"] = pred.regime
    row["predicted_seconds_per_batch"] = pred.mgrit_graph
    row["predicted_speedup_vs_graph"] = pred.speedup_vs_graph
    row["model_error"] = (pred.mgrit_graph - t_mgrit) / t_mgrit
    return row


def main(argv: Optional[list[str]] = None) -> int:
    p = OneLineParser(prog="python -m layerpar.bench gpu",
                      description=__doc__.split("\n")[0])
    p.add_argument("--csv", metavar="PATH", help=CSV_HELP)
    p.add_argument("--models", default="dense,conv",
                   help="comma-separated: dense, conv, conv16, transformer (rows a to d)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile serial baseline")
    p.add_argument("--unmeasured", action="store_true",
                   help="no GPU: write the rows with every measured column UNMEASURED and "
                        "only the model's prediction (operation counts from the CPU)")
    p.add_argument("--steps", type=int, default=20, help="SGD steps for the loss check")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="let cuDNN pick its fastest algorithms (for all three variants)")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in opcount.CONFIGS:
            p.error(f"--models: unknown model {m!r}; choose from {sorted(opcount.CONFIGS)}")
    if not models:
        p.error("`--models` names no model; choose from " + ", ".join(sorted(opcount.CONFIGS)))
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    check_shared_options(p, args, ",".join(COLUMNS[:3]))
    if args.unmeasured:
        rows = [unmeasured_row(m) for m in models]
        for r in rows:
            print(f"{ROWS.get(r['model'], (r['model'],))[0]}: UNMEASURED; model predicts "
                  f"{r['predicted_seconds_per_batch'] * 1e3:.2f} ms per batch, "
                  f"{r['predicted_speedup_vs_graph']:.2f}x graph serial, {r['regime']}")
        _write(args.csv, rows)
        return 0
    if not torch.cuda.is_available():
        p.error("no CUDA device here: run it on a GPU machine (`make DEVICE=1 bench-gpu` "
                "there), or give `--unmeasured` for the model's predictions alone")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    rows = [bench_model(m, "cuda", args.steps, compile=args.compile) for m in models]
    print(f"layerpar.bench gpu: torch {torch.__version__}, {rows[0]['device']}, "
          f"cudnn.benchmark={args.cudnn_benchmark}, fp32 (no TF32)")
    print("  ".join(f"{c}" for c in COLUMNS[1:]))
    for r in rows:
        print("  ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                        for c in COLUMNS[1:]))
    for r in rows:
        label, target = ROWS.get(r["model"], (r["model"], float("nan")))
        print(f"{label}: {r['speedup_vs_graph']:.2f}x graph serial (target >= {target:g}x), "
              f"{r['speedup_vs_best']:.2f}x best serial ({r['best_serial']}), loss diff "
              f"{r['loss_rel_diff'] * 100:.2f}% (<= 2%), model "
              f"{r['predicted_seconds_per_batch'] * 1e3:.2f} ms vs "
              f"{r['seconds_per_batch'] * 1e3:.2f} ms measured "
              f"({r['model_error'] * 100:+.0f}%)")
    _write(args.csv, rows)
    return 0


def _write(path: Optional[str], rows: list[dict[str, Any]]) -> None:
    if path:
        write_dict_rows(path, rows, COLUMNS)


def unmeasured_row(name: str) -> dict[str, Any]:
    """A row for a machine without a GPU: measured columns UNMEASURED, operation counts
    (CPU, `gpumodel.kernel_counts`: the same aten operations) and the model's
    prediction."""
    from .studies.gpumodel import kernel_counts

    kind, layers, _, _, _, heads = model_args(name)
    fwd, bwd = opcount.mgrit_options(layers)
    s_ops, m_ops = kernel_counts(kind, layers, fwd.max_levels, fwd.cfactor, fwd.max_iter,
                                 bwd.max_iter, heads)
    pred = prediction(name, s_ops, m_ops)
    row: dict[str, Any] = {c: "UNMEASURED" for c in COLUMNS}
    row.update({"model": name, "layers": opcount.CONFIGS[name][1]["n_steps"],
                "regime": pred.regime, "predicted_seconds_per_batch": pred.mgrit_graph,
                "predicted_speedup_vs_graph": pred.speedup_vs_graph, "model_error": "",
                "mgrit_ops": m_ops, "serial_ops": s_ops})
    return row
