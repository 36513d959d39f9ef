"""When does layer parallelism win on one GPU?  A launch + work model of a training batch.

    python -m layerpar.studies predict-gpu --model conv --layers 256 --width 16 \\
        --size 32 --batch 64 [--levels 3 --cfactor 4 --fwd-iters 2 --bwd-iters 1]
    python -m layerpar.studies predict-gpu --validate      # error on docs/results/gpu/*.csv

A GPU runs a training batch as a sequence of kernels.  Each costs a fixed latency (the
host's dispatch per operation when eager; launch plus minimum kernel time when the batch
is replayed from a CUDA graph) plus its work: floating-point operations at the device's
rate and bytes at its memory bandwidth.  So, for serial training of N layers and for
one rank of LayerParallel (the batched cycle, `layerpar.parallel.batched`):

    T = kernels x latency + flops / (efficiency x peak FLOP/s) + bytes / bandwidth
        (+ engine steps x host seconds per step, for MGRIT run eagerly)

- kernels: the top-level operations of one training batch, counted by
  `layerpar.apps.opcount` on the CPU with the user's layers and MGRIT options (the count does
  not depend on batch, width or image size, so a tiny instance is counted);
- flops: serial does one forward evaluation F of each layer and two of its cost
  backwards (state and weight gradients): 3·N·F.  MGRIT does Sf forward steps and Sb
  adjoint steps (counted by replaying the engine's program,
  `layerpar.apps.studies.perfmodel.count_steps`), an adjoint step costing 2·F, and the
  weight gradients once: (Sf + 2·Sb + N)·F;
- bytes: state-sized tensor passes (`PASSES`: reads and writes of the layer's state
  per forward step and per backward step) times the state's size;
- the host's own time per engine step (the cycle's Python bookkeeping) counts when
  MGRIT runs eagerly; a graph replay has none;
- efficiency: the fraction of peak FP32 a layer's main operation reaches
  (`GPU.conv_efficiency` for cuDNN convolutions, fitted on one row; `MATMUL_EFFICIENCY`
  for the matmuls of dense and transformer blocks, an assumption).

The regime of a net is the largest of the three terms of its serial time per layer:
launch-bound (latency dominates: MGRIT's O(levels x cfactor x iterations) kernels
replace serial's O(layers), and it wins), bandwidth-bound or compute-bound (MGRIT's
extra work, (Sf + 2 Sb + N) / 3N of serial's, is paid in full: it cannot win).

Calibration and validation (`validate`): the four fitted constants of `H100` were
derived (`calibrate`) from four measurements in ``docs/results/gpu/bench-gpu.csv``: the dense
graph-captured serial time (latency_graph), the dense eager serial time
(latency_eager), the conv graph-captured serial time (conv_efficiency) and the dense
eager MGRIT time (engine_step_host).  The model's error is reported on the other
measured quantities, which played no part in fitting.  The conv efficiency is what the
model cannot derive: it is cuDNN's, per algorithm choice (``cudnn.benchmark`` rows run
at another rate, and the model with the default rate is off on them, as reported).
"""
from __future__ import annotations

import csv
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ...defaults import TRAINING
from ..parsing import OneLineParser

__all__ = ["GPU", "GPUPrediction", "H100", "MATMUL_EFFICIENCY", "PASSES", "calibrate",
           "kernel_counts", "main", "predict_gpu", "step_work", "validate"]

#: state-sized tensor passes (read or written) per forward step and per backward step
#: (conv: conv reads x and writes z, the activation reads z and writes a, the update
#: reads u, a and writes u+ha; the backward about 1.5 times that)
PASSES: dict[str, tuple[float, float]] = {"dense": (8.0, 12.0), "conv": (8.0, 12.0),
                                          "transformer": (40.0, 60.0)}
#: fraction of peak FP32 a dense or transformer block's matmuls reach (an assumption;
#: the measured dense rows are launch-bound and cannot pin it)
MATMUL_EFFICIENCY = 0.5
MAX_PREDICT_LAYERS = 16384  # predict-gpu builds and runs the whole net on the CPU


@dataclass(frozen=True)
class GPU:
    """A GPU's rates: FP32 FLOP/s (no tensor cores), bandwidth (B/s), seconds per kernel
    in a CUDA-graph replay and per operation when eager, and the fraction of peak FP32
    cuDNN's convolutions reach on the nets' small-channel convolutions, and the host
    seconds per engine step of an eager MGRIT cycle."""

    name: str
    flops: float
    bandwidth: float
    latency_graph: float
    latency_eager: float
    conv_efficiency: float
    engine_step_host: float = 0.0


#: NVIDIA H100 SXM (80 GB HBM3): 67 TFLOP/s FP32 and 3.35 TB/s from the data sheet; the
#: last four constants from `calibrate` on docs/results/gpu/bench-gpu.csv (dense graph and
#: eager serial, conv graph serial, dense eager MGRIT), rounded
H100 = GPU("NVIDIA H100 80GB HBM3", flops=67e12, bandwidth=3.35e12, latency_graph=2.59e-6,
           latency_eager=11.25e-6, conv_efficiency=0.0768, engine_step_host=9.18e-6)


def step_work(model: str, batch: int, width: int, size: int = 1, heads: int = 4,
              kernel_size: int = 3) -> tuple[float, float]:
    """(FLOPs of one forward evaluation of one residual block, bytes of one state).

    dense: F = act(W u + b), width x width; conv: k x k convolution, width channels,
    size x size images; transformer: d = width, sequence length `size` (attention
    4·B·T²·d, projections and MLP (ratio 4) 24·B·T·d²)."""
    if model == "dense":
        return 2.0 * batch * width * width, 4.0 * batch * width
    if model == "conv":
        px = size * size
        return 2.0 * batch * px * width * width * kernel_size ** 2, 4.0 * batch * width * px
    if model == "transformer":
        t, d = size, width
        return 24.0 * batch * t * d * d + 4.0 * batch * t * t * d, 4.0 * batch * t * d
    raise ValueError(f"`model` must be dense, conv or transformer, got {model!r}")


def _efficiency(model: str, gpu: GPU) -> float:
    return gpu.conv_efficiency if model == "conv" else MATMUL_EFFICIENCY


def mgrit_steps(layers: int, levels: int, cfactor: int, fwd_iters: int,
                bwd_iters: int) -> tuple[int, int]:
    """(forward steps, adjoint steps) of one LayerParallel batch on one rank: the
    engine's program replayed (`perfmodel.count_steps`, batched app, fixed
    iterations, final FC sweep as LayerParallel runs it)."""
    from .perfmodel import count_steps, solve_options

    f, _ = count_steps(layers, 1, solve_options(levels, cfactor, fwd_iters), batched=True,
                       seq=True)
    b, _ = count_steps(layers, 1, solve_options(levels, cfactor, bwd_iters), batched=True,
                       seq=True)
    return sum(f[0]), sum(b[0])


def kernel_counts(model: str, layers: int, levels: int, cfactor: int, fwd_iters: int,
                  bwd_iters: int, heads: int = 4) -> tuple[int, int]:
    """(serial operations, MGRIT operations) per training batch, counted by
    `layerpar.apps.opcount` on the CPU on a tiny instance with these layers and options."""
    import copy

    import torch
    from torch import nn

    from ...mgrit import MGRITOptions
    from ...ode import ODENet, Segment
    from ...ode.blocks import Transformer
    from ...parallel import LayerParallel
    from .. import opcount
    from ..nets import sequential_twin

    torch.manual_seed(0)
    if model == "transformer":
        d = 2 * heads
        net = ODENet(layers=[nn.Linear(3, d), Segment(lambda k: Transformer(d, heads),
                                                      layers, 4.0),
                             nn.Flatten(), nn.Linear(3 * d, 10)])
        x, y = torch.randn(2, 3, 3), torch.randint(0, 10, (2,))
    else:
        make = opcount.dense_model if model == "dense" else opcount.conv_model
        kw = {"width": 4} if model == "dense" else {"channels": 2, "size": 4}
        net, x, y = make(n_steps=layers, batch=2, **kw)
    plain = sequential_twin(copy.deepcopy(net))
    serial, _ = opcount.count_ops(opcount.train_step(
        plain, torch.optim.SGD(plain.parameters(), lr=1e-3, foreach=True), x, y))
    fo = MGRITOptions(max_levels=levels, cfactor=cfactor, max_iter=fwd_iters, tol=0.0)
    bo = MGRITOptions(max_levels=levels, cfactor=cfactor, max_iter=bwd_iters, tol=0.0)
    lp = LayerParallel(copy.deepcopy(net), None, fo, bo)
    mgrit, _ = opcount.count_ops(opcount.train_step(
        lp, torch.optim.SGD(lp.parameters(), lr=1e-3, foreach=True), x, y))
    lp.close()
    return serial, mgrit


@dataclass
class GPUPrediction:
    """Predicted seconds per batch, the parts of serial's time per layer, the regime."""

    serial_graph: float
    serial_eager: float
    mgrit_graph: float
    mgrit_eager: float
    regime: str
    per_layer: dict[str, float]
    work_ratio: float  # MGRIT's flops over serial's

    @property
    def speedup_vs_graph(self) -> float:
        return self.serial_graph / self.mgrit_graph

    @property
    def speedup_vs_eager(self) -> float:
        """Eager serial over graph-captured MGRIT (as `layerpar.apps.gpubench` reports it)."""
        return self.serial_eager / self.mgrit_graph


def predict_gpu(model: str, layers: int, batch: int, width: int, size: int = 1, *,
                levels: int = TRAINING.levels, cfactor: int = TRAINING.cfactor,
                fwd_iters: int = TRAINING.fwd_iters, bwd_iters: int = TRAINING.bwd_iters,
                heads: int = 4, gpu: GPU = H100, serial_ops: Optional[int] = None,
                mgrit_ops: Optional[int] = None,
                batched_efficiency: Optional[float] = None) -> GPUPrediction:
    """Predicted time per training batch of serial training and of LayerParallel (one
    rank, batched cycle) on `gpu`, eager and graph-captured, and the regime.

    serial_ops / mgrit_ops: operations per batch when known (else counted,
    `kernel_counts`); batched_efficiency: the FP32 fraction the batched steps reach
    (default: the serial blocks'; the measured grouped-convolution rows agree with
    that)."""
    flop, state = step_work(model, batch, width, size, heads)
    if serial_ops is None or mgrit_ops is None:
        serial_ops, mgrit_ops = kernel_counts(model, layers, levels, cfactor, fwd_iters,
                                              bwd_iters, heads)
    eff = _efficiency(model, gpu)
    beff = eff if batched_efficiency is None else batched_efficiency
    pf, pb = PASSES[model]
    sf, sb = mgrit_steps(layers, levels, cfactor, fwd_iters, bwd_iters)
    s_compute = 3 * layers * flop / (eff * gpu.flops)
    s_bytes = layers * (pf + pb) * state / gpu.bandwidth
    m_compute = (sf + 2 * sb + layers) * flop / (beff * gpu.flops)
    m_bytes = (sf * pf + sb * pb) * state / gpu.bandwidth
    per_layer = {"launch": serial_ops * gpu.latency_graph / layers,
                 "compute": s_compute / layers, "bandwidth": s_bytes / layers}
    top = max(per_layer, key=per_layer.get)  # type: ignore[arg-type]
    regime = {"launch": "launch-bound (layer parallelism wins)",
              "compute": "compute-bound (layer parallelism cannot win)",
              "bandwidth": "bandwidth-bound (layer parallelism cannot win)"}[top]
    return GPUPrediction(
        serial_graph=serial_ops * gpu.latency_graph + s_compute + s_bytes,
        serial_eager=serial_ops * gpu.latency_eager + s_compute + s_bytes,
        mgrit_graph=mgrit_ops * gpu.latency_graph + m_compute + m_bytes,
        mgrit_eager=(mgrit_ops * gpu.latency_eager + (sf + sb) * gpu.engine_step_host
                     + m_compute + m_bytes),
        regime=regime, per_layer=per_layer, work_ratio=(sf + 2 * sb + layers) / (3 * layers))


# ------------------------------------------------------------------------------------------
# calibration and validation on the measured rows (docs/results/gpu/*.csv)
# ------------------------------------------------------------------------------------------
#: the nets of the measured rows (`layerpar.apps.opcount.CONFIGS`) as predict_gpu arguments
ROW_NETS: dict[str, dict[str, int]] = {
    "dense": {"layers": 1024, "batch": 256, "width": 64, "size": 1},
    "conv": {"layers": 256, "batch": 64, "width": 16, "size": 32},
}
#: measured column -> the prediction it is compared with
QUANTITIES = {"graph_seconds_per_batch": "serial_graph",
              "eager_seconds_per_batch": "serial_eager",
              "seconds_per_batch": "mgrit_graph",
              "mgrit_eager_seconds_per_batch": "mgrit_eager"}
#: (file, model, column) of the three measurements the H100 constants come from
FIT_ROWS = (("bench-gpu.csv", "dense", "graph_seconds_per_batch"),
            ("bench-gpu.csv", "dense", "eager_seconds_per_batch"),
            ("bench-gpu.csv", "conv", "graph_seconds_per_batch"),
            ("bench-gpu.csv", "dense", "mgrit_eager_seconds_per_batch"))
DOCS = Path(__file__).resolve().parents[3] / "docs" / "results" / "gpu"


def _row_prediction(row: dict[str, Any], gpu: GPU) -> GPUPrediction:
    net = ROW_NETS[row["model"]]
    levels = _levels(net["layers"])
    return predict_gpu(row["model"], net["layers"], net["batch"], net["width"], net["size"],
                       levels=levels, cfactor=TRAINING.cfactor, fwd_iters=TRAINING.fwd_iters,
                       bwd_iters=TRAINING.bwd_iters, gpu=gpu,
                       serial_ops=int(row["serial_ops"]), mgrit_ops=int(row["mgrit_ops"]))


def read_rows(folder: Path = DOCS) -> list[tuple[str, dict[str, Any]]]:
    """(file name, row) of every measured row of the dense and conv nets in
    folder/*.csv (rows marked unmeasured and other models are left out)."""
    out = []
    for path in sorted(folder.glob("*.csv")):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                if row.get("model") in ROW_NETS and row.get("serial_ops") \
                        and row.get("seconds_per_batch") not in (None, "", "UNMEASURED"):
                    out.append((path.name, row))
    return out


def calibrate(rows: Sequence[tuple[str, dict[str, Any]]], base: GPU = H100) -> GPU:
    """`base` with latency_graph, latency_eager, conv_efficiency and engine_step_host
    solved from the `FIT_ROWS` measurements (each the one unknown of its equation)."""
    got = {(f, r["model"]): r for f, r in rows}
    dense, conv = got[FIT_ROWS[0][:2]], got[FIT_ROWS[2][:2]]
    zero = replace(base, latency_graph=0.0, latency_eager=0.0)
    p = _row_prediction(dense, zero)  # work only
    ops = int(dense["serial_ops"])
    lat_g = (float(dense["graph_seconds_per_batch"]) - p.serial_graph) / ops
    lat_e = (float(dense["eager_seconds_per_batch"]) - p.serial_eager) / ops
    g = replace(base, latency_graph=lat_g, latency_eager=lat_e, conv_efficiency=1.0)
    q = _row_prediction(conv, g)
    compute_at_peak = q.per_layer["compute"] * ROW_NETS["conv"]["layers"]
    rest = q.serial_graph - compute_at_peak
    eff = compute_at_peak / (float(conv["graph_seconds_per_batch"]) - rest)
    g = replace(g, conv_efficiency=eff, engine_step_host=0.0)
    d = _row_prediction(dense, g)
    net = ROW_NETS["dense"]
    sf, sb = mgrit_steps(net["layers"], _levels(net["layers"]), 4, 2, 1)
    host = (float(dense["mgrit_eager_seconds_per_batch"]) - d.mgrit_eager) / (sf + sb)
    return replace(g, engine_step_host=host)


def _levels(layers: int) -> int:
    from .. import opcount

    return opcount.levels_for(layers, 4)


def validate(folder: Path = DOCS, gpu: GPU = H100) -> list[dict[str, Any]]:
    """Predicted against measured for every measured quantity of every row in folder:
    dicts with file, model, quantity, measured, predicted, rel_error (signed:
    (predicted - measured) / measured) and fitted (whether the H100 constants were
    derived from it)."""
    out = []
    for name, row in read_rows(folder):
        if row.get("device") != gpu.name:
            continue
        p = _row_prediction(row, gpu)
        for col, attr in QUANTITIES.items():
            if not row.get(col):
                continue
            meas, pred = float(row[col]), float(getattr(p, attr))
            out.append({"file": name, "model": row["model"], "quantity": col,
                        "measured": meas, "predicted": pred,
                        "rel_error": (pred - meas) / meas,
                        "fitted": (name, row["model"], col) in FIT_ROWS,
                        "regime": p.regime})
    return out


def _rms(xs: Sequence[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else float("nan")


def format_validation(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["file                                  model  quantity                       "
             "measured  predicted  error  role",
             "-" * 104]
    for r in rows:
        lines.append(f"{r['file']:<37s} {r['model']:<6s} {r['quantity']:<30s} "
                     f"{r['measured'] * 1e3:7.2f}ms {r['predicted'] * 1e3:8.2f}ms "
                     f"{r['rel_error'] * 100:+5.0f}%  {'fit' if r['fitted'] else 'held out'}")
    held = [r["rel_error"] for r in rows if not r["fitted"]]
    lines.append(f"held-out rows: {len(held)}, rms relative error {_rms(held) * 100:.0f}%, "
                 f"largest {max((abs(e) for e in held), default=float('nan')) * 100:.0f}%")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m layerpar.studies predict-gpu``: the prediction for a net, or
    (--validate) the model against the measured rows of docs/results/gpu."""
    p = OneLineParser(prog="python -m layerpar.studies predict-gpu",
                      description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dense", choices=sorted(PASSES),
                   help="block type (dense)")
    p.add_argument("--layers", type=int, default=1024,
                   help=f"residual layers (1024; at most {MAX_PREDICT_LAYERS})")
    p.add_argument("--width", type=int, default=64,
                   help="features, channels or d_model (64)")
    p.add_argument("--size", type=int, default=32,
                   help="conv: image side; transformer: sequence length (32)")
    p.add_argument("--batch", type=int, default=256, help="batch size (256)")
    p.add_argument("--heads", type=int, default=4, help="transformer heads (4)")
    p.add_argument("--levels", type=int, help="MGRIT levels (default: down to 16 coarsest "
                                              "intervals, as layerpar.apps.opcount)")
    p.add_argument("--cfactor", type=int, default=TRAINING.cfactor,
                   help=f"coarsening factor ({TRAINING.cfactor})")
    p.add_argument("--fwd-iters", dest="fwd_iters", type=int, default=TRAINING.fwd_iters,
                   help=f"forward MGRIT iterations ({TRAINING.fwd_iters})")
    p.add_argument("--bwd-iters", dest="bwd_iters", type=int, default=TRAINING.bwd_iters,
                   help=f"adjoint MGRIT iterations ({TRAINING.bwd_iters})")
    p.add_argument("--validate", action="store_true",
                   help="compare the model with the measured rows in docs/results/gpu/*.csv")
    args = p.parse_args(argv)
    if args.validate:
        rows = validate()
        if not rows:
            print(f"no measured {H100.name} rows in {DOCS}", file=sys.stderr)
            return 1
        print(format_validation(rows))
        return 0
    for name in ("layers", "width", "size", "batch", "heads", "cfactor", "fwd_iters",
                 "bwd_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.cfactor < 2:
        p.error(f"--cfactor must be >= 2, got {args.cfactor}")
    from ...mgrit.options import MAX_LEVELS
    from .. import opcount

    levels = args.levels if args.levels is not None else opcount.levels_for(args.layers,
                                                                            args.cfactor)
    if not 1 <= levels <= MAX_LEVELS:
        p.error(f"--levels must be in [1, {MAX_LEVELS}], got {levels}")
    if args.layers > MAX_PREDICT_LAYERS:
        p.error(f"--layers must be <= {MAX_PREDICT_LAYERS}, got {args.layers} (the "
                "prediction counts the operations of the whole net, built and run once "
                f"on this CPU: {MAX_PREDICT_LAYERS} dense layers take about 2 minutes)")
    if args.model == "transformer" and args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    size = 1 if args.model == "dense" else args.size
    r = predict_gpu(args.model, args.layers, args.batch, args.width, size, levels=levels,
                    cfactor=args.cfactor, fwd_iters=args.fwd_iters,
                    bwd_iters=args.bwd_iters, heads=args.heads)
    pl = r.per_layer
    print(f"{H100.name}, {args.model}: {args.layers} layers, width {args.width}, "
          f"size {size}, batch {args.batch}; MGRIT {levels} levels, cfactor "
          f"{args.cfactor}, {args.fwd_iters}/{args.bwd_iters} iterations")
    print(f"serial per layer: launch {pl['launch'] * 1e6:.1f} us, compute "
          f"{pl['compute'] * 1e6:.1f} us, bandwidth {pl['bandwidth'] * 1e6:.1f} us -> "
          f"{r.regime}")
    print(f"MGRIT does {r.work_ratio:.2f}x serial's arithmetic")
    print(f"predicted s/batch: serial eager {r.serial_eager * 1e3:.2f} ms, serial graph "
          f"{r.serial_graph * 1e3:.2f} ms, MGRIT graph {r.mgrit_graph * 1e3:.2f} ms, "
          f"MGRIT eager {r.mgrit_eager * 1e3:.2f} ms")
    print(f"predicted speedup: {r.speedup_vs_graph:.2f}x graph-captured serial, "
          f"{r.speedup_vs_eager:.2f}x eager serial")
    return 0
