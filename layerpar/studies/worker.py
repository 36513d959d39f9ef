"""One rank count's study runs, under MPI; and the study model, data and serial baseline.

    mpiexec -n P python -m mpi4py -m layerpar.studies.worker CONFIG

CONFIG is a JSON object (inline, or ``@path`` to a file) ``{"out": PATH, "runs":
[run, ...]}`` (a single run object with an ``"out"`` key also works).  A run holds
the settings of `DEFAULTS` (model, layers, width, batch, levels, cfactor, fwd_iters,
bwd_iters, threads, steps, warmup, ...).  For each run every rank builds the same
network (fixed seed), wraps it in `LayerParallel` over COMM_WORLD and trains
``warmup + steps`` SGD batches; the last ``steps`` are timed.  Rank 0 appends one JSON
line per run to PATH: median seconds per batch (the slowest rank's), split into
forward, backward (+ optimizer) and communication + idle time (the engines' ``wait``
and ``reduce`` timers), MGRIT iterations and final residuals, the training loss after
the last step, and residual histories of one extra diagnostic solve run to
``diag_iters`` iterations.

The same module builds the network (`build_net`), the data (`make_batches`) and the
serial baseline (`serial_baseline`: plain PyTorch, in-process, best thread count), so
the runner and the workers train exactly the same thing.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..mgrit.options import MGRITOptions
from ..ode import blocks
from ..ode.net import ODENet, Segment
from .files import append_line

__all__ = ["DEFAULTS", "MODELS", "build_net", "input_shape", "main", "make_batches",
           "run_layer_parallel", "sequential_net", "serial_baseline", "train"]

MODELS = ("dense", "conv")

DEFAULTS: dict[str, Any] = {
    "model": "dense",   # "dense": Dense(width, tanh) steps; "conv": Conv(width) on images
    "layers": 1024,     # residual steps (the ODE segment's N)
    "width": 32,        # features (dense) or channels (conv)
    "batch": 64,
    "image": 8,         # conv: image side
    "classes": 10,
    "t_final": 1.0,
    "levels": 3,        # MGRIT max_levels (forward and adjoint)
    "cfactor": 4,
    "nrelax": 1,        # FCF relaxation
    "fwd_iters": 2,     # MGRIT iterations per forward solve
    "bwd_iters": 1,     # ... per adjoint solve
    "threads": 1,       # torch intra-op threads per rank
    "steps": 4,         # timed SGD batches
    "warmup": 1,        # untimed SGD batches before them
    "lr": 0.05,
    "seed": 0,
    "diag_iters": 6,    # iterations of the diagnostic solve (0: none)
}


def config(run: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """`run` completed with `DEFAULTS`; unknown keys are an error when `strict`, else
    dropped (a CSV row carries many more columns than settings)."""
    if not strict:
        run = {k: v for k, v in run.items() if k in DEFAULTS}
    unknown = set(run) - set(DEFAULTS) - {"ranks", "scaling", "out"}
    if unknown:
        raise ValueError(f"unknown study setting(s) {sorted(unknown)}; valid: "
                         f"{sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **run}
    if cfg["model"] not in MODELS:
        raise ValueError(f"`model` must be one of {MODELS}, got {cfg['model']!r}")
    return cfg


# ------------------------------------------------------------------------------------------
# the network and the data
# ------------------------------------------------------------------------------------------
def build_net(cfg: dict[str, Any]) -> ODENet:
    """The study network, with parameters drawn from ``torch.manual_seed(cfg["seed"])``
    (identical on every rank and in the serial baseline)."""
    cfg = config(cfg, strict=False)
    w, k = int(cfg["width"]), int(cfg["classes"])
    torch.manual_seed(int(cfg["seed"]))
    steps: Callable[[int], nn.Module]
    if cfg["model"] == "dense":
        def steps(n: int) -> nn.Module:
            return blocks.Dense(w, activation="tanh")
        close: nn.Module = nn.Linear(w, k)
    else:
        def steps(n: int) -> nn.Module:
            return blocks.Conv(w, activation="tanh")
        close = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, k))
    return ODENet(steps=steps, n_steps=int(cfg["layers"]), t_final=float(cfg["t_final"]),
                  close=close)


def input_shape(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Shape of one input batch (= the ODE state)."""
    cfg = config(cfg, strict=False)
    b, w = int(cfg["batch"]), int(cfg["width"])
    if cfg["model"] == "dense":
        return (b, w)
    s = int(cfg["image"])
    return (b, w, s, s)


def make_batches(cfg: dict[str, Any], count: int) -> list[tuple[Tensor, Tensor]]:
    """`count` (input, label) batches from a fixed generator: Gaussian inputs labelled
    by a fixed random linear teacher (learnable, so the loss moves)."""
    cfg = config(cfg, strict=False)
    g = torch.Generator().manual_seed((int(cfg["seed"]) + 1) % 2**64)  # seed <= 2**64 - 1
    shape = input_shape(cfg)
    feats = math.prod(shape[1:])
    teacher = torch.randn(feats, int(cfg["classes"]), generator=g)
    out = []
    for _ in range(count):
        x = torch.randn(shape, generator=g)
        out.append((x, (x.reshape(shape[0], -1) @ teacher).argmax(1)))
    return out


class _Residual(nn.Module):
    """u + dt * F(u) with the block F of one layer (forward Euler, as the ODENet's)."""

    def __init__(self, block: nn.Module, dt: float) -> None:
        super().__init__()
        self.block = block
        self.dt = dt

    def forward(self, u: Tensor) -> Tensor:
        return torch.add(u, self.block(u), alpha=self.dt)


def sequential_net(net: ODENet) -> nn.Sequential:
    """`net` as a plain nn.Sequential of residual modules sharing its blocks (same
    weights, same step sizes); forward Euler segments only."""
    mods: list[nn.Module] = []
    for layer in net.layers:
        if isinstance(layer, Segment):
            if layer.scheme.name != "euler":
                raise ValueError("sequential_net needs forward Euler segments")
            mods += [_Residual(layer.blocks[n], layer.time(n + 1) - layer.time(n))
                     for n in range(layer.n_steps)]
        else:
            mods.append(layer)
    return nn.Sequential(*mods)


# ------------------------------------------------------------------------------------------
# training loops
# ------------------------------------------------------------------------------------------
def train(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]], lr: float,
          before: Optional[Callable[[], None]] = None,
          after: Optional[Callable[[], None]] = None) -> tuple[list[list[float]], float]:
    """SGD over `batches`; per batch [total, forward, backward] seconds; the last loss.

    `before` runs untimed before each batch (e.g. a barrier), `after` untimed after it.
    """
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    times = []
    loss_value = float("nan")
    for x, y in batches:
        if before is not None:
            before()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        opt.step()
        t2 = time.perf_counter()
        times.append([t2 - t0, t1 - t0, t2 - t1])
        loss_value = float(loss.detach())
        if after is not None:
            after()
    return times, loss_value


def _thread_candidates(cores: int) -> list[int]:
    """1..cores on small machines; powers of two and `cores` above 8 cores."""
    if cores <= 8:
        return list(range(1, cores + 1))
    cands = [1 << k for k in range(cores.bit_length()) if (1 << k) <= cores]
    return sorted(set(cands + [cores]))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    best: Optional[dict[str, Any]] = None
    try:
        for t in threads or _thread_candidates(available_cores()):
            torch.set_num_threads(t)
            for variant in ("sequential", "oracle"):
                net = build_net(cfg)
                model = sequential_net(net) if variant == "sequential" else net
                times, loss = train(model, batches, float(cfg["lr"]))
                sec = statistics.median(r[0] for r in times[warm:])
                if best is None or sec < best["serial_seconds_per_batch"]:
                    best = {"serial_seconds_per_batch": sec, "serial_threads": t,
                            "serial_variant": variant, "serial_loss": loss}
    finally:
        torch.set_num_threads(old)
    assert best is not None
    return best


# ------------------------------------------------------------------------------------------
# the layer-parallel run (under MPI)
# ------------------------------------------------------------------------------------------
def _app_flags(lp: Any) -> dict[str, bool]:
    """Whether the forward / adjoint apps of `lp` give the engine a batched step
    (``step_batch``) and a sequential-stretch step (``step_seq``)."""
    from .model import app_flags

    out = {"fwd_batched": False, "bwd_batched": False, "fwd_seq": False, "bwd_seq": False}
    for runner in getattr(lp, "_runners", {}).values():
        for side, app in (("fwd", getattr(runner, "fapp", None)),
                          ("bwd", getattr(runner, "bapp", None))):
            batched, seq = app_flags(app)
            out[f"{side}_batched"] |= batched
            out[f"{side}_seq"] |= seq
    return out


def _load_avg() -> float:
    """The 1-minute load average right after the timed batches (other processes on
    the machine disturb the timings; this says how busy it was)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _residual(stats: list[dict]) -> float:
    """Final residual (root-sum-square over segments); NaN where none was measured
    (one iteration with `skip` measures none)."""
    res = [s["residual_history"][-1] for s in stats if s["residual_history"]]
    return math.sqrt(sum(r * r for r in res)) if res else float("nan")


def _comm_idle(stats: list[dict]) -> float:
    return sum(s["timings"]["wait"] + s["timings"]["reduce"] for s in stats)


def run_layer_parallel(cfg: dict[str, Any], comm: Any) -> dict[str, Any]:
    """Train the study model layer-parallel over `comm`; the measurements (same on
    every rank: times are the slowest rank's)."""
    from mpi4py import MPI

    from ..parallel import LayerParallel

    cfg = config(cfg, strict=False)
    torch.set_num_threads(int(cfg["threads"]))
    P = comm.Get_size()
    warm, steps = int(cfg["warmup"]), int(cfg["steps"])
    levels, cf = int(cfg["levels"]), int(cfg["cfactor"])
    fwd = MGRITOptions(max_levels=levels, cfactor=cf, nrelax=int(cfg["nrelax"]),
                       max_iter=int(cfg["fwd_iters"]))
    bwd = fwd.replace(max_iter=int(cfg["bwd_iters"]))
    net = build_net(cfg)
    lp = LayerParallel(net, comm, fwd, bwd)
    batches = make_batches(cfg, warm + steps)
    idle: list[list[float]] = []

    def after() -> None:
        fi, bi = _comm_idle(lp.last_forward), _comm_idle(lp.last_backward)
        idle.append([fi, bi, fi + bi])

    times, loss = train(lp, batches, float(cfg["lr"]), before=comm.Barrier, after=after)
    local = torch.tensor([t + i for t, i in zip(times, idle)], dtype=torch.float64)
    worst = local.numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
    timed = worst[warm:]

    def med(col: int) -> float:
        return float(statistics.median(timed[:, col].tolist()))

    out: dict[str, Any] = {
        **cfg, "ranks": P,
        "seconds_per_batch": med(0), "forward_seconds": med(1), "backward_seconds": med(2),
        "fwd_comm_idle_seconds": med(3), "bwd_comm_idle_seconds": med(4),
        "comm_idle_seconds": med(5),
        "fwd_iterations": max(s["iterations"] for s in lp.last_forward),
        "bwd_iterations": max(s["iterations"] for s in lp.last_backward),
        "fwd_residual": _residual(lp.last_forward),
        "bwd_residual": _residual(lp.last_backward),
        "loss": loss, **_app_flags(lp), "load_avg": _load_avg(),
        "fwd_residual_history": [], "bwd_residual_history": [],
    }
    diag = int(cfg["diag_iters"])
    if diag > 0:  # residual reduction per iteration: one untimed solve pair, no tolerance
        lp2 = LayerParallel(net, comm, fwd.replace(max_iter=diag, tol=0.0),
                            bwd.replace(max_iter=diag, tol=0.0))
        x, y = batches[0]
        nn.functional.cross_entropy(lp2(x), y).backward()
        out["fwd_residual_history"] = lp2.last_forward[0]["residual_history"]
        out["bwd_residual_history"] = lp2.last_backward[0]["residual_history"]
    return out


def _load_config(arg: str) -> dict[str, Any]:
    text = Path(arg[1:]).read_text() if arg.startswith("@") else arg
    obj = json.loads(text)
    if not isinstance(obj, dict) or "out" not in obj:
        raise ValueError("the worker config must be a JSON object with an \"out\" path")
    return obj


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under mpiexec: run every run of the config on COMM_WORLD."""
    from mpi4py import MPI

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: mpiexec -n P python -m mpi4py -m layerpar.studies.worker "
                         "'{\"out\": PATH, \"runs\": [...]}' | @config.json\n")
        return 2
    obj = _load_config(args[0])
    runs = obj.get("runs", [obj])
    comm = MPI.COMM_WORLD
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
