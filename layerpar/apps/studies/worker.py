"""The two sides of a study's measurement: layer-parallel runs under MPI, and the
serial baseline in this process.

    mpiexec -n P python -m mpi4py -m layerpar.apps.studies.worker CONFIG

CONFIG is a JSON object (inline, or ``@path`` to a file) ``{"out": PATH, "runs":
[run, ...]}`` (a single run object with an ``"out"`` key also works).  A run holds
the settings of `runs.DEFAULTS` (model, layers, width, batch, levels, cfactor,
fwd_iters, bwd_iters, threads, steps, warmup, ...).  For each run every rank builds the
same network (`runs.build_study_net`, fixed seed), wraps it in `LayerParallel` over
COMM_WORLD and trains ``warmup + steps`` SGD batches; the last ``steps`` are timed.
Rank 0 appends one JSON line per run to PATH: median seconds per batch (the slowest
rank's), split into forward, backward (+ optimizer) and communication + idle time (the
engines' ``wait`` and ``reduce`` timers), MGRIT iterations and final residuals, the
training loss after the last step, and residual histories of one extra diagnostic
solve run to ``diag_iters`` iterations.

`serial_baseline` trains the same network on the same batches with plain PyTorch
(`layerpar.apps.nets.sequential_twin`, and the ODENet oracle) at the best thread count.
Both sides run the same SGD loop (`_sgd`: `layerpar.apps.loop.train_steps`), so the runner
compares like with like.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ...mgrit.options import MGRITOptions
from ..launch import load_average, mpi_world
from ..loop import Step, available_cores, train_steps
from ..nets import sequential_twin
from .files import append_line
from .runs import build_study_net, config, layer_parallel_flags, make_batches

__all__ = ["main", "run_layer_parallel", "serial_baseline"]


def _sgd(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]], lr: float,
         before: Optional[Callable[[], None]] = None) -> Iterator[Step]:
    """SGD (learning rate `lr`) on `model`'s trainable parameters over `batches`, one
    `Step` per batch; `before` runs untimed before each."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    return train_steps(model, batches, opt, before=before)


def _thread_candidates(cores: int) -> list[int]:
    """1..cores on small machines; powers of two and `cores` above 8 cores."""
    if cores <= 8:
        return list(range(1, cores + 1))
    cands = [1 << k for k in range(cores.bit_length()) if (1 << k) <= cores]
    return sorted(set(cands + [cores]))


def serial_baseline(cfg: dict[str, Any], threads: Optional[Sequence[int]] = None
                    ) -> dict[str, Any]:
    """Plain PyTorch training of the study model in this process, done right.

    Both the nn.Sequential of residual modules and the ODENet oracle (same weights,
    same data, same SGD steps) are timed at every thread count in `threads` (default
    1..cores, see `_thread_candidates`); the fastest median seconds per batch wins.
    Returns ``serial_seconds_per_batch``, ``serial_threads``, ``serial_variant`` and
    ``serial_loss`` (the training loss after ``warmup + steps`` steps, as the workers
    report it).
    """
    cfg = config(cfg, strict=False)
    warm, steps = int(cfg["warmup"]), int(cfg["steps"])
    batches = make_batches(cfg, warm + steps)
    old = torch.get_num_threads()
    measured: list[dict[str, Any]] = []
    try:
        for t in threads or _thread_candidates(available_cores()):
            torch.set_num_threads(t)
            for variant in ("sequential", "oracle"):
                net = build_study_net(cfg)
                model = sequential_twin(net) if variant == "sequential" else net
                times, loss = [], float("nan")
                for step in _sgd(model, batches, float(cfg["lr"])):
                    times.append(step.seconds)
                    loss = float(step.loss)
                measured.append({"serial_seconds_per_batch": statistics.median(times[warm:]),
                                 "serial_threads": t, "serial_variant": variant,
                                 "serial_loss": loss})
    finally:
        torch.set_num_threads(old)
    # the fastest; the first measured of equally fast ones
    return min(measured, key=lambda r: r["serial_seconds_per_batch"])


# ------------------------------------------------------------------------------------------
# the layer-parallel run (under MPI)
# ------------------------------------------------------------------------------------------
def run_layer_parallel(cfg: dict[str, Any], comm: Any) -> dict[str, Any]:
    """Train the study model layer-parallel over `comm`; the measurements (same on
    every rank: times are the slowest rank's)."""
    from mpi4py import MPI

    from ...parallel import LayerParallel

    cfg = config(cfg, strict=False)
    torch.set_num_threads(int(cfg["threads"]))
    P = comm.Get_size()
    warm, steps = int(cfg["warmup"]), int(cfg["steps"])
    levels, cf = int(cfg["levels"]), int(cfg["cfactor"])
    fwd = MGRITOptions(max_levels=levels, cfactor=cf, nrelax=int(cfg["nrelax"]),
                       max_iter=int(cfg["fwd_iters"]))
    bwd = fwd.replace(max_iter=int(cfg["bwd_iters"]))
    net = build_study_net(cfg)
    lp = LayerParallel(net, comm, fwd, bwd)
    batches = make_batches(cfg, warm + steps)
    rows: list[list[float]] = []
    for step in _sgd(lp, batches, float(cfg["lr"]), before=comm.Barrier):
        f, b = step.fwd, step.bwd
        if f is None or b is None:
            raise RuntimeError(
                f"the layer-parallel run ({levels} levels, cfactor {cf}) reported no "
                f"{'forward' if f is None else 'adjoint'} MGRIT solve for a batch: the "
                "study's communication figures need both")
        rows.append([step.seconds, step.forward_seconds, step.backward_seconds,
                     f.comm_idle_seconds, b.comm_idle_seconds,
                     f.comm_idle_seconds + b.comm_idle_seconds])
    loss = float(step.loss)
    worst = torch.tensor(rows, dtype=torch.float64).numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
    timed = worst[warm:]

    def med(col: int) -> float:
        return float(statistics.median(timed[:, col].tolist()))

    out: dict[str, Any] = {
        **cfg, "ranks": P,
        "seconds_per_batch": med(0), "forward_seconds": med(1), "backward_seconds": med(2),
        "fwd_comm_idle_seconds": med(3), "bwd_comm_idle_seconds": med(4),
        "comm_idle_seconds": med(5),
        "fwd_iterations": f.iterations, "bwd_iterations": b.iterations,
        "fwd_residual": math.nan if f.residual is None else f.residual,
        "bwd_residual": math.nan if b.residual is None else b.residual,
        "loss": loss, **layer_parallel_flags(lp), "load_avg": load_average()[0],
        "fwd_residual_history": [], "bwd_residual_history": [],
    }
    diag = int(cfg["diag_iters"])
    if diag > 0:  # residual reduction per iteration: one untimed solve pair, no tolerance
        lp2 = LayerParallel(net, comm, fwd.replace(max_iter=diag, tol=0.0),
                            bwd.replace(max_iter=diag, tol=0.0))
        x, y = batches[0]
        nn.functional.cross_entropy(lp2(x), y).backward()
        out["fwd_residual_history"] = lp2.last_forward[0].residual_history
        out["bwd_residual_history"] = lp2.last_backward[0].residual_history
    return out


def _load_config(arg: str) -> dict[str, Any]:
    text = Path(arg[1:]).read_text() if arg.startswith("@") else arg
    obj = json.loads(text)
    if not isinstance(obj, dict) or "out" not in obj:
        raise ValueError("the worker config must be a JSON object with an \"out\" path")
    return obj


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under mpiexec: run every run of the config on COMM_WORLD."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: mpiexec -n P python -m mpi4py -m layerpar.apps.studies.worker "
                         "'{\"out\": PATH, \"runs\": [...]}' | @config.json\n")
        return 2
    obj = _load_config(args[0])
    runs = obj.get("runs", [obj])
    comm = mpi_world()
    out = Path(obj["out"])
    for run in runs:
        run = {k: v for k, v in run.items() if k != "out"}
        try:
            result = run_layer_parallel(run, comm)
        except Exception as exc:
            if comm.Get_rank() == 0:
                append_line(out, json.dumps({**run, "ranks": comm.Get_size(),
                                             "error": f"{type(exc).__name__}: {exc}"}))
            raise
        if comm.Get_rank() == 0:  # whole or not at all: the runner resumes from this file
            append_line(out, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
