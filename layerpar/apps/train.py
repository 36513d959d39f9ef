"""A small, reusable training loop for the bundled problems (Peaks, digits).

The examples (``examples/peaks.py``, ``examples/digits.py``) and the command line
(``layerpar train``) are thin front ends to `train`: each builds one
`layerpar.apps.config.TrainConfig` (the Python API from `train`'s keywords), so all of
them train the same networks the same way and print the same summary line.  `train`
runs either the plain `ODENet` with ordinary autograd (``serial=True``: the serial oracle) or a
`LayerParallel` over ``comm`` (``comm=None``: one process, no MPI), which makes
serial and layer-parallel runs directly comparable: same seed, same network, same data
order, same optimiser and schedule.  The networks are `layerpar.apps.nets`' problems; each
step is `layerpar.apps.loop.train_step`, the one the studies and benchmarks time.

Every rank runs this loop in lockstep: it builds the same network (the global torch
generator is seeded before building), iterates the same batches (the data loader has
its own seeded generator), computes the same loss (the output is broadcast), and
evaluates validation accuracy itself.  Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from ..mgrit.options import MGRITOptions
from ..mgrit.xbraid import BUILD_HINT, xbraid_available
from ..ode.refine import refine
from ..parallel import (
    DASO,
    Auto,
    AutoCapturedStep,
    LayerParallel,
    Lion,
    ProcessGrid,
    SlowLink,
)
from ..parallel.baselines import (
    DataParallelNet,
    LayerParallelMethod,
    PipelineNet,
    SerialMethod,
    SoloMethod,
    TrainingMethod,
)
from ..parallel.choose import DEFAULT_SCHEDULES, METHOD_NAMES, choose_method
from ..parallel.timing import SpanTimer
from . import data
from .arguments import add_arguments
from .config import TrainConfig
from .loop import Batches, Progress, adam, train_steps
from .nets import PROBLEMS, RECIPES, Recipe, problem_name, problem_net
from .threads import serial_threads, threads_per_rank

__all__ = [
    "MODELS",
    "Recipe",
    "RECIPES",
    "TrainConfig",
    "TrainResult",
    "add_arguments",
    "build_net",
    "check_arguments",
    "check_engine_built",
    "dtype_from_arguments",
    "format_summary",
    "load_data",
    "options_from_arguments",
    "parse_summary",
    "threads_per_rank",
    "train",
]


# the problems `train` trains (the choices of ``layerpar train``) and their builder, under
# the names this module has always had for them; both live in layerpar.apps.nets
MODELS = PROBLEMS
build_net = problem_net

def load_data(model_name: str, seed: int = 0,
              dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_val, y_val) of a problem, deterministic given ``seed``
    (`layerpar.apps.data.splits`).

    peaks: 5000 training and 200 validation points; digits: 1500 training and 297
    validation images; mnist1d: 16,000 training and 4,000 validation signals.
    """
    return data.splits(problem_name(model_name), seed=seed, dtype=dtype)


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class TrainResult:
    """What `train` did: the settings it used, the final figures, the trained module and
    the per-epoch / per-batch records.  The same on every rank, except the timings.
    ``summary`` is the line rank 0 prints (`format_summary`)."""

    # -- the settings used (None where the problem's recipe or a default applied) --
    model: str
    """The problem trained: "peaks", "digits" or "mnist1d"."""
    serial: bool
    """True: the serial `ODENet` oracle with ordinary autograd."""
    ranks: int
    """Processes of the layer-parallel model times replicas (1 when serial)."""
    data_parallel: int
    """Data-parallel replicas R of the `ProcessGrid` (1: none)."""
    epochs: int
    """Epochs of the final net (nested iteration's coarser nets come on top)."""
    batch_size: int
    """Global batch size (every replica trains on its share)."""
    lr: float
    """Learning rate."""
    seed: int
    """Seed of the data split, the initial parameters and the batch order."""
    dtype: str
    """Parameter and data dtype, e.g. "torch.float32"."""
    fwd: Optional[MGRITOptions]
    """MGRIT options of the forward solves (None when serial)."""
    bwd: Optional[MGRITOptions]
    """MGRIT options of the adjoint solves (None when serial)."""
    nested: int
    """Levels of nested iteration (0: none)."""
    device: str
    """"cpu" or "cuda"."""
    arch: Optional[str]
    """Architecture asked for (None: the problem's)."""
    t_final: Optional[float]
    """Final time of the ODE segment asked for (None: the problem's)."""
    target_acc: Optional[float]
    """Validation accuracy at which training stopped early (None: train all epochs)."""
    auto: Any
    """The ``auto`` argument: False, True or an `AccuracyPolicy`."""
    sync: str
    """How the replicas stay in step: "allreduce", "daso" or "lioncub"."""
    optimizer: Optional[str]
    """"adam", "lion", or None (the default: Adam; Lion for lioncub)."""
    # -- final figures --
    val_acc: float
    """Validation accuracy after the last epoch."""
    val_loss: float
    """Validation loss after the last epoch."""
    train_loss: float
    """Mean training loss of the last epoch."""
    train_acc: float
    """Training accuracy of the last epoch."""
    ms_per_batch: float
    """Milliseconds per optimisation step (forward, backward, update), over all steps."""
    fwd_iters: Optional[float]
    """Forward MGRIT iterations, mean over the last epoch (None: serial/not measured)."""
    fwd_res: Optional[float]
    """Final forward residual norm, mean over the last epoch (None: not measured)."""
    bwd_iters: Optional[float]
    """Adjoint MGRIT iterations, mean over the last epoch (None: serial/not measured)."""
    bwd_res: Optional[float]
    """Final adjoint residual norm, mean over the last epoch (None: not measured)."""
    seconds: float
    """Wall time of all epochs, evaluation included."""
    train_seconds: float
    """Training time from the first batch (tuning and checks in, evaluation out)."""
    time_to_target: Optional[float]
    """`train_seconds` until `target_acc` was reached (None: not reached or none)."""
    epochs_to_target: Optional[int]
    """The epoch that reached `target_acc` (None: not reached or none)."""
    step_mode: str
    """"eager" (the CPU), or on CUDA "captured" or "eager (not captured: why)"."""
    # -- what was trained and the records --
    module: nn.Module
    """The trained `ODENet` (serial) or `LayerParallel`."""
    history: list[dict[str, Any]]
    """One record per epoch: epoch, layers, train/val loss and accuracy, seconds,
    train_seconds, batches, fwd/bwd iterations and residuals, grad_cosine/grad_error."""
    batch_losses: list[float]
    """Every step's training loss (the global batch's, with replicas)."""
    checks: list[dict[str, Any]]
    """Gradient checks (``check_every``): batch, layers, exact, cosine, rel_error, the
    MGRIT figures mgrit_cosine, mgrit_rel_error, and note (under auto, for a check
    above its bound: the bound and what auto did; else None)."""
    accuracy_log: list[str]
    """Decisions of the adaptive accuracy policy."""
    auto_log: list[str]
    """``auto``'s candidate tables and choices."""
    auto_choice: Optional[str]
    """Name of ``auto``'s last choice (None: not tuned)."""
    method: str = "layerparallel"
    """What trained: "serial", "layerparallel", "data", the pipeline by schedule and
    micro-batches ("pipeline 1f1b m=4"), or auto's serial choices in a parallel job
    ("serial (replicated)", "solo (rank 0, N threads)")."""
    # -- data-parallel figures (None without a `ProcessGrid`) --
    allreduce_ms_per_batch: Optional[float] = None
    """Milliseconds per batch spent averaging gradients across replicas."""
    sync_bytes: Optional[float] = None
    """Bytes each process sent for the data dimension per batch (mean over processes)."""
    bytes_by_kind: Optional[dict[str, float]] = None
    """Bytes per process per batch by kind: "p2p" (MGRIT), "data", "internode"."""
    # -- how the last epoch ran and why training ended --
    exact_steps: int = 0
    """Steps of the last epoch that ran no MGRIT cycle (`auto` or the adaptive policy
    stepped aside to `exact_kind`); the iteration figures are the other steps' means."""
    exact_kind: Optional[str] = None
    """What those steps ran: "replicated serial", "serial autograd" (auto's choice at
    one rank: the net itself) or "sequential sweeps" (exact propagation: one level);
    None where every step ran MGRIT."""
    last_epoch_steps: int = 0
    """Steps of the last epoch."""
    stopped_by_budget: bool = False
    """True: `time_budget` ended training before its epochs did (the figures are those
    of the epoch it stopped in, evaluated where it stopped)."""

    @property
    def summary(self) -> str:
        """The one-line summary rank 0 prints (`format_summary`)."""
        return format_summary(self)


def train(model_name: str, *, comm: Any = None, config: Optional[TrainConfig] = None,
          **options: Any) -> TrainResult:
    """Train a bundled problem and return what happened (a `TrainResult`).

    ``train(model_name, **options)`` trains ``TrainConfig(model=model_name, **options)``
    (`layerpar.apps.config.TrainConfig`: its fields are the options, each documented
    there; a bad value or a conflict raises naming the keyword); ``config`` gives a
    configuration already built instead (``layerpar train``'s, `TrainConfig.from_args`).

    comm: the processes (an mpi4py communicator, a torch.distributed group, or None:
        one process without MPI).  With ``serial`` it only decides which rank prints;
        otherwise the net is wrapped in `LayerParallel` over it, or, with
        ``data_parallel`` R > 1 (or a torch.distributed group), in a `ProcessGrid` of
        R replicas whose gradients are averaged, so results equal training on the
        global batch.

    Every rank runs this in lockstep (same seed, same net, same batches); only rank 0
    prints.  The run is `_build` (data, net, model), `_tune` (auto's first batch),
    then per stage of nested iteration `_stage` and per epoch `_epoch`, and last
    `_result` and `_report`.  On CUDA a layer-parallel step is captured in a CUDA graph
    where the settings allow it (`_capture_refusal`); ``step_mode`` says which, and why.
    """
    if config is None:
        config = TrainConfig(model=model_name, **options)
    elif options or problem_name(model_name) != config.model:
        raise ValueError("`config` with keyword options or another `model_name`: give "
                         "one or the other")
    rank, size = _rank_size(comm)
    config.check_processes(size)
    thread_note = _set_threads(config)
    if thread_note is not None and rank == 0:
        print(f"{config.model}: {thread_note}", flush=True)
    run = _build(config, comm, rank, size)
    recursion = sys.getrecursionlimit()
    if config.compile:
        # inductor walks the graph recursively, at least two frames per layer: at
        # 1,024 layers Python's default limit (1,000) ended the compilation with a
        # RecursionError, and 50,000 let it finish, so 50 a layer with room
        sys.setrecursionlimit(max(recursion, 50 * config.layers + 10_000))
    frozen_before = gc.get_freeze_count() > 0  # the caller's own gc.freeze() is kept
    # what exists now (torch, its imports, the data, the net) out of the cyclic
    # collector's sight before the clock runs: a full collection scans every tracked
    # object, 75-125 ms here with torch's imports, and lands on the ranks at different
    # batches, so that the others wait for it; `gc.freeze` moves objects to a permanent
    # generation, collects nothing
    gc.freeze()
    try:
        _tune(run)
        for stage, (layers, stage_epochs) in enumerate(run.stages):
            if stage:  # nested iteration: the trained net, refined, goes on training
                run.model = run.model.refine(2) if isinstance(run.model, Auto) \
                    else refine(run.model, 2)
            opt, schedule, captured = _stage(run, stage_epochs)
            for epoch in range(1, stage_epochs + 1):
                _epoch(run, layers, f"epoch {epoch}/{stage_epochs}", opt, schedule,
                       captured)
                if run.stop:
                    break
            if run.stop:
                break
    finally:
        if not frozen_before:
            gc.unfreeze()  # what this training froze is the collector's again
        sys.setrecursionlimit(recursion)
    result = _result(run)
    if rank == 0:
        _report(run, result)
    return result


@dataclass
class _Run:
    """One training's state, shared by its phases (`_build` makes it)."""

    config: TrainConfig
    rank: int
    size: int
    net: nn.Module
    """The `ODENet` trained (the serial oracle's, or the one `model` wraps)."""
    model: nn.Module
    """What steps: the net (serial, perhaps compiled) or a `LayerParallel`."""
    grid: Optional[ProcessGrid]
    loader: Any
    shard: Any
    x_val: Tensor
    y_val: Tensor
    clock: _Clock
    step_mode: str
    check_every: int
    fwd: MGRITOptions
    stages: list[tuple[int, int]]
    """(layers, epochs) of each stage: nested iteration's coarser nets, then the net."""
    history: list[dict[str, Any]] = field(default_factory=list)
    batch_losses: list[float] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    step_time: float = 0.0
    total_steps: int = 0
    batch: int = 0  # over all stages: names a check or an adaptive decision
    stop: bool = False
    stopped_by_budget: bool = False
    time_to_target: Optional[float] = None
    epochs_to_target: Optional[int] = None
    captured: Any = None
    comm: Any = None
    choose: Optional[dict[str, Any]] = None
    """`choose_method`'s arguments where the method is chosen by measurement (under
    auto on several ranks, or a pipeline without its schedule or micro-batches)."""
    choice: Any = None
    """`choose_method`'s `Choice` once made."""


def _set_threads(config: TrainConfig) -> Optional[str]:
    """Set torch's thread count as the configuration asks; what was set and why (for
    a serial run, which compares with layer-parallel ones; else None)."""
    flag = config.flag("threads")
    if config.threads == "best":
        best, per = serial_threads(config.model, config.n_layers, config.width,
                                   arch=config.arch, t_final=config.t_final,
                                   batch_size=config.batch_size, dtype=config.dtype)
        torch.set_num_threads(best)
        tried = ", ".join(f"{k}: {1000 * s:.1f}" for k, s in per.items())
        return (f"serial on {best} torch thread(s): its batch ran fastest here (ms at "
                f"{tried}; {flag} N sets it)")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
        why = f"as {flag} asks"
    else:
        env = os.environ.get("OMP_NUM_THREADS")
        why = f"as OMP_NUM_THREADS={env} asks" if env else \
            f"torch's setting ({flag} N or OMP_NUM_THREADS sets it)"
    return f"serial on {torch.get_num_threads()} torch thread(s), {why}" \
        if config.serial else None


def _build(config: TrainConfig, comm: Any, rank: int, size: int) -> _Run:
    """The data, the net (seeded alike on every rank) and what trains it."""
    c = config
    x_train, y_train, x_val, y_val = load_data(c.model, c.seed, c.dtype)
    fwd, bwd = c.mgrit_options()
    policy = c.policy()
    check_every = 0 if c.auto else policy.check_every if policy is not None \
        else c.check_every
    torch.manual_seed(c.seed)  # same initial parameters on every rank
    net = build_net(c.model, c.layers // 2 ** c.nested, c.width, arch=c.arch,
                    t_final=c.t_final).to(device=c.device, dtype=c.dtype)
    capture = _capture_refusal(c.device, c.serial, c.auto is not False, policy,
                               check_every, c.nested, size, c.data_parallel, fwd, bwd)
    step_mode = "eager"
    if c.device == "cuda":
        step_mode = "eager (not captured: " + capture + ")" if capture else "captured"
    stages = [(c.layers // 2 ** k, c.nested_epochs) for k in range(c.nested, 0, -1)]
    stages.append((c.layers, c.epochs))
    grid: Optional[ProcessGrid] = None
    choose = _method_choice(c, size, policy)
    if choose is not None:
        model: nn.Module | TrainingMethod = net  # replaced by the chosen method (`_tune`)
    elif c.method == "data":
        model = DataParallelNet(net, comm, timeout=c.timeout)
    elif c.method == "pipeline":
        model = PipelineNet(net, comm, schedule=c.schedule, microbatches=c.microbatches,
                            timeout=c.timeout)
    elif c.serial:
        model = torch.compile(net) if c.compile else net
        if c.compile:
            step_mode = "compiled (torch.compile; its compilation counts in the time)"
    elif c.data_parallel > 1 or not (comm is None or hasattr(comm, "Split_type")):
        batches = sum(e for _, e in stages) * -(-len(x_train) // c.batch_size)
        grid = ProcessGrid(comm, data=c.data_parallel, sync=_sync_strategy(c.sync, batches),
                           nodes=c.nodes,
                           link=None if c.slow_link is None else SlowLink(c.slow_link * 1e9))
        model = LayerParallel(net, None, fwd, bwd, grid=grid, accuracy=policy,
                              timeout=c.timeout, engine=c.engine_name)
    elif c.auto:
        model = LayerParallel(net, comm, "auto", accuracy=policy, timeout=c.timeout)
    else:
        model = LayerParallel(net, comm, fwd, bwd, accuracy=policy,
                              check_finite=step_mode != "captured", timeout=c.timeout,
                              engine=c.engine_name)
    # the DataLoader's batches, gathered whole (`Batches`); on a GPU (without a process
    # grid, whose shard takes host tensors) the training data lives there, so no batch
    # is copied from the host
    home = c.device if grid is None else "cpu"
    loader = Batches(x_train.to(home), y_train.to(home), batch_size=c.batch_size,
                     generator=torch.Generator().manual_seed(c.seed))
    to_device = None if c.device == "cpu" else (lambda t: t.to(c.device, non_blocking=True))
    return _Run(config=c, rank=rank, size=size, net=net, model=model,  # type: ignore[arg-type]
                grid=grid, loader=loader,
                shard=grid.shard if grid is not None else to_device,
                x_val=x_val.to(c.device), y_val=y_val.to(c.device),
                clock=_Clock(model if isinstance(model, (LayerParallel, Auto, TrainingMethod))
                             else None, c.device),
                step_mode=step_mode, check_every=check_every, fwd=fwd, stages=stages,
                comm=comm, choose=choose)


def _method_choice(c: TrainConfig, size: int, policy: Any) -> Optional[dict[str, Any]]:
    """`choose_method`'s arguments where the run chooses its method by measurement
    (else None): under auto on several ranks of one communicator on the CPU (every
    method, or the one `method` names), and for a pipeline not given both its
    schedule and micro-batches.  Auto on one method that is layer-parallel is
    `LayerParallel`'s own auto (`_tune`)."""
    pipeline = {"schedules": (c.schedule,) if c.schedule else DEFAULT_SCHEDULES,
                "microbatches": (c.microbatches,) if c.microbatches else (1, 2, 4, 8)}
    if c.method == "pipeline" and not c.auto:
        if c.schedule is not None and c.microbatches is not None:
            return None
        return {"methods": ("pipeline",), **pipeline}
    if not c.auto or c.serial or size < 2 or c.device != "cpu" or c.data_parallel > 1 \
            or c.method == "layerparallel":  # (auto's own tuning, online)
        return None
    return {"methods": (c.method,) if c.method else METHOD_NAMES, **pipeline,
            "layerparallel": {"options": "auto", "accuracy": policy, "timeout": c.timeout}}


def _tune(run: _Run) -> None:
    """Under auto: tune on the first batch, with the training loss; the time counts
    (online: small nets time their exact settings on the training's steps).  Where
    the method is chosen by measurement (`_method_choice`), that choice is made here,
    on the same batch, and a chosen `LayerParallel` trains under its own auto."""
    if run.choose is not None:
        x0, y0 = _first_batch(run.loader)
        with run.clock:
            chosen = choose_method(run.net, run.comm, x0, y0, nn.functional.cross_entropy,
                                   steps_to_come=run.config.epochs * len(run.loader),
                                   online=True, **run.choose)
        run.choice = chosen.choice  # type: ignore[attr-defined]
        run.model = chosen.model if isinstance(chosen, LayerParallelMethod) else \
            chosen  # type: ignore[assignment]
        run.clock.model = run.model  # type: ignore[assignment]
        return
    if not run.config.auto or isinstance(run.model, TrainingMethod):
        return
    if not hasattr(run.model, "tune"):
        raise RuntimeError("--auto built a model that cannot tune (expected options='auto')")
    x0, y0 = _first_batch(run.loader)
    device = run.config.device
    with run.clock:
        run.model.tune(x0.to(device), y0.to(device), nn.functional.cross_entropy,
                       steps=run.config.epochs * len(run.loader), online=True)


def _stage(run: _Run, epochs: int) -> tuple[torch.optim.Optimizer, Any, Any]:
    """The optimizer over this rank's parameters, its cosine schedule over the stage's
    `epochs`, and on CUDA the captured step (else None)."""
    c, model = run.config, run.model
    if c.optimizer == "lion":
        opt: torch.optim.Optimizer = Lion(model.parameters(), lr=c.lr)
    elif run.step_mode != "captured":
        # fused where torch has it; on the CPU each segment's rows stepped at once
        # (where torch's fused step batches its tensors, a GPU, unmeasured); a process
        # grid's synchronisation reads the optimizer's state per parameter
        opt = adam(model.parameters(), lr=c.lr, flat=run.grid is None and c.device == "cpu")
    else:  # a captured step reads the learning rate from a tensor
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(c.lr, device=c.device),
                               capturable=True)
    if run.grid is not None and isinstance(model, (LayerParallel, Auto)):
        run.grid.sync.attach(model, opt)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(run.loader))
    captured: Any = None
    if run.step_mode == "captured":
        from ..parallel.capture import capture_step

        x0, y0 = _first_batch(run.loader)
        x0, y0 = x0.to(c.device), y0.to(c.device)
        with run.clock:  # capture's warm-up steps train too: counted in the time
            if c.auto:  # (step_mode then says, at the end, how it went)
                captured = AutoCapturedStep(model, opt,  # type: ignore[arg-type]
                                            nn.functional.cross_entropy, x0, y0)
            else:
                captured = capture_step(model, opt,  # type: ignore[arg-type]
                                        nn.functional.cross_entropy, x0, y0)
    run.captured = captured
    return opt, schedule, captured


@dataclass
class _Tally:
    """One epoch's figures as its steps come."""

    losses: list = field(default_factory=list)
    correct: Any = 0
    seen: int = 0
    fwd_it: list = field(default_factory=list)
    fwd_res: list = field(default_factory=list)
    bwd_it: list = field(default_factory=list)
    bwd_res: list = field(default_factory=list)
    exact_kinds: list = field(default_factory=list)  # steps that ran no MGRIT cycle

    def add(self, step: Any, plain: bool) -> None:
        # (the loss kept on the device and read once an epoch: `.item()` here waited
        # for the GPU at every step, so the host could not queue the next one)
        self.losses.append(step.loss)
        if step.output is not None:
            self.correct += (step.output.detach().argmax(1) == step.target).sum()
            self.seen += len(step.target)
        kind = _exact_kind(step.fwd_stats, plain)
        if kind is not None:  # iteration figures are MGRIT's; these ran none
            self.exact_kinds.append(kind)
            return
        for stats, its, res in ((step.fwd, self.fwd_it, self.fwd_res),
                                (step.bwd, self.bwd_it, self.bwd_res)):
            if stats is not None:
                its.append(stats.iterations)
                res += [] if stats.residual is None else [stats.residual]


def _epoch(run: _Run, layers: int, label: str, opt: torch.optim.Optimizer, schedule: Any,
           captured: Any) -> None:
    """Train one epoch, evaluate, and record it (``run.history``); set ``run.stop``
    where the time budget or the target accuracy ends training."""
    c, model = run.config, run.model
    bar = Progress(len(run.loader), f"{c.model} {label}" + (
        f" ({layers} layers)" if c.nested else ""), enabled=c.progress and run.rank == 0)
    model.train()
    tally = _Tally()
    plain = _runs_plain(model)
    t_epoch = time.perf_counter()
    run.clock.start()
    replays = SpanTimer(torch.device(c.device))  # captured steps' times
    steps = train_steps(model, run.loader, opt, scheduler=schedule, shard=run.shard) \
        if captured is None else _captured_steps(captured, run.loader, schedule,
                                                   run.shard, replays)
    for b, step in enumerate(steps, 1):
        run.batch += 1
        run.total_steps += 1
        if run.total_steps == 1:
            # what the tuning and the first step made (settings, optimizer state) out
            # of the collector's sight too (~130 ms a full collection at 1,024 layers)
            gc.freeze()
        run.step_time += step.seconds
        tally.add(step, plain)
        _check(run, step, layers, captured, replays)
        bar.update(b, partial(_bar_note, tally.losses[-1], tally.fwd_res, tally.bwd_res,
                              run.checks))
        if c.time_budget is not None and run.clock.over(c.time_budget):
            run.stop = run.stopped_by_budget = True
            break
    run.clock.stop()
    run.step_time += replays.total()[0]
    losses = torch.stack(tally.losses).tolist() if tally.losses else []
    correct, seen = int(tally.correct), tally.seen
    if run.grid is not None and run.grid.data > 1:  # the global batch's figures
        losses, correct, seen = _replica_totals(run.grid, losses, correct, seen)
    run.batch_losses += losses
    val_loss, val_acc = _evaluate(run.net if c.compile else model, run.x_val, run.y_val)
    checks = run.checks
    record = {
        "epoch": len(run.history) + 1, "layers": layers,
        "train_loss": sum(losses) / len(losses),
        "train_acc": correct / seen if seen else math.nan, "val_loss": val_loss,
        "val_acc": val_acc, "seconds": time.perf_counter() - t_epoch,
        "train_seconds": run.clock.seconds, "batches": run.batch,
        "fwd_iters": _mean(tally.fwd_it), "fwd_res": _mean(tally.fwd_res),
        "bwd_iters": _mean(tally.bwd_it), "bwd_res": _mean(tally.bwd_res),
        "grad_cosine": checks[-1]["cosine"] if checks else None,
        "grad_error": checks[-1]["rel_error"] if checks else None,
        "steps": len(losses), "exact_steps": len(tally.exact_kinds),
        "exact_kind": tally.exact_kinds[-1] if tally.exact_kinds else None,
    }
    run.history.append(record)
    bar.close(f"train_loss {record['train_loss']:.3f} | val_acc {val_acc:.3f} | "
              + _bar_note(None, tally.fwd_res, tally.bwd_res, checks))
    if c.target_acc is not None and run.time_to_target is None and val_acc >= c.target_acc:
        run.time_to_target, run.epochs_to_target = run.clock.seconds, record["epoch"]
        run.stop = True


def _check(run: _Run, step: Any, layers: int, captured: Any, replays: SpanTimer) -> None:
    """A gradient check where one is due after this step (the accuracy controller's
    schedule, or every ``check_every`` batches), recorded in ``run.checks``."""
    model = run.model
    ctl = getattr(model, "accuracy", None)
    due = ctl.check_due(run.batch) if ctl is not None else \
        bool(run.check_every) and run.batch % run.check_every == 0
    if not due:
        return
    if isinstance(captured, AutoCapturedStep):
        captured.observe_step(replays.mean())  # a replayed step's time
    exact = ctl is not None and ctl.exact  # training ran exactly
    got = model.check_gradients(step.input, step.target,  # type: ignore[operator]
                                nn.functional.cross_entropy)
    run.checks.append({"batch": run.batch, "layers": layers, "exact": exact,
                       "cosine": 1.0 if exact else got.cos,
                       "rel_error": 0.0 if exact else got.error,
                       "mgrit_cosine": got.cos, "mgrit_rel_error": got.error,
                       "note": _auto_check_note(model, run.batch, got)})
    if isinstance(captured, AutoCapturedStep):
        # a re-tuning or the controller may have changed the setting
        captured.refresh(step.input, step.target)
    gc.freeze()  # a check may have tuned again: new settings, new objects


def _result(run: _Run) -> TrainResult:
    """What the training did, from its state."""
    c, model, grid = run.config, run.model, run.grid
    last = run.history[-1]
    tuner = model.tuner if isinstance(model, (LayerParallel, Auto)) else None
    sync_figures: dict[str, Any] = {}
    if grid is not None and isinstance(model, (LayerParallel, Auto)) and model.averager is not None:
        sync_figures["allreduce_ms_per_batch"] = (1000.0 * model.averager.total_seconds
                                                  / run.total_steps)
    if grid is not None:
        sync_figures.update(_sync_bytes(grid, run.total_steps))
    step_mode = run.step_mode
    captured = run.captured
    if isinstance(captured, AutoCapturedStep):  # auto's setting, captured again on change
        step_mode = (f"captured ({captured.captures} capture(s) of auto's setting)"
                     if captured.captures else
                     f"eager (not captured: {captured.why_eager})")
        captured.close()
    fwd, bwd = c.mgrit_options()
    ctl = getattr(model, "accuracy", None)
    method = _method_name(run)
    mgrit = not c.serial and method == "layerparallel"
    auto_log = [] if run.choice is None else run.choice.lines()
    if tuner is not None:
        auto_log += tuner.log(run.size)
    return TrainResult(
        model=c.model, serial=c.serial, ranks=1 if c.serial else run.size,
        data_parallel=1 if c.serial else c.data_parallel, epochs=c.epochs,
        batch_size=c.batch_size, lr=c.lr, seed=c.seed, dtype=str(c.dtype),
        fwd=fwd if mgrit else None, bwd=bwd if mgrit else None,
        val_acc=last["val_acc"], val_loss=last["val_loss"],
        train_loss=last["train_loss"], train_acc=last["train_acc"],
        ms_per_batch=1000.0 * run.step_time / run.total_steps,
        fwd_iters=last["fwd_iters"], fwd_res=last["fwd_res"],
        bwd_iters=last["bwd_iters"], bwd_res=last["bwd_res"],
        history=run.history, batch_losses=run.batch_losses, module=model,
        checks=run.checks, nested=c.nested,
        seconds=sum(r["seconds"] for r in run.history),
        accuracy_log=[] if ctl is None else [str(e) for e in ctl.log],
        device=c.device, step_mode=step_mode, arch=c.arch, t_final=c.t_final,
        train_seconds=run.clock.seconds, target_acc=c.target_acc,
        time_to_target=run.time_to_target, epochs_to_target=run.epochs_to_target,
        auto=c.auto is not False, auto_log=auto_log, method=method,
        auto_choice=tuner.choice_name(run.size) if tuner is not None else
        None if run.choice is None else run.choice.chosen,
        sync=c.sync, optimizer=c.optimizer, exact_steps=last["exact_steps"],
        exact_kind=last["exact_kind"], last_epoch_steps=last["steps"],
        stopped_by_budget=run.stopped_by_budget, **sync_figures)


def _method_name(run: _Run) -> str:
    """What trained, by name (`TrainResult.method`)."""
    if run.config.serial:
        return "serial"
    m = run.model
    if isinstance(m, PipelineNet):
        return f"pipeline {m.schedule} m={m.microbatches}"
    if isinstance(m, SoloMethod):
        return f"solo (rank 0, {m.threads} threads)"
    if isinstance(m, SerialMethod):
        return "serial (replicated)"
    return "data" if isinstance(m, DataParallelNet) else "layerparallel"


def _report(run: _Run, result: TrainResult) -> None:
    """What rank 0 prints: the notes the summary line cannot hold, then that line."""
    c, name = run.config, run.config.model
    lines = []
    if c.device == "cuda" or c.compile:
        lines.append(f"step on {c.device}: {result.step_mode}")
    lines += result.auto_log
    lines += [f"adaptive accuracy: {line}" for line in result.accuracy_log]
    if run.checks:
        lines.append(last_check_line(run.checks[-1]))
    if run.grid is not None and run.grid.data > 1:
        lines.append(_replicas_note(run.grid, result))
    levels = None if c.serial or c.auto or result.method != "layerparallel" else \
        _levels_note(run.model, run.fwd)
    if levels is not None:
        lines.append(levels)
    lines += _summary_notes(result, c.time_budget, len(run.loader),
                            sum(e for _, e in run.stages))
    for line in lines:
        print(f"{name}: {line}", flush=True)
    print(result.summary, flush=True)


def _auto_check_note(model: Any, batch: int, got: Any) -> Optional[str]:
    """Under auto, for a check (at `batch`, measuring `got`) outside the bound it was
    held to: the bound, and what auto did about it (`AutoTuner.last_check`); else
    None."""
    tuner = model.tuner if isinstance(model, (LayerParallel, Auto)) else None
    last = None if tuner is None else tuner.last_check
    if last is None or last[0] != batch:
        return None
    _, bound, what = last
    if got.cos >= bound.min_cosine and got.error <= bound.max_rel_error:
        return None
    return (f"above the bound (relative error <= {bound.max_rel_error:.3g}, cosine >= "
            f"{bound.min_cosine:.3g}): {what}")


def last_check_line(c: dict[str, Any]) -> str:
    """The line that ends a run with checks: the last check (an entry of
    `TrainResult.checks`), named by its own batch, and where it was above auto's
    bound, what auto did about it."""
    how = ("training propagated exactly; MGRIT at its counts would give cosine "
           f"{c['mgrit_cosine']:.4f}, relative error {c['mgrit_rel_error']:.3g}"
           if c["exact"] else f"cosine {c['cosine']:.4f}, relative error "
           f"{c['rel_error']:.3g}")
    note = c.get("note")
    return f"last gradient check (batch {c['batch']}): {how}" + (f"; {note}" if note else "")


def _exact_kind(fwd_stats: Optional[list], plain: bool = False) -> Optional[str]:
    """What a `LayerParallel` step ran where it ran no MGRIT cycle: "replicated serial"
    (no solves at all), "serial autograd" (`plain`: auto's choice at one rank, the
    net's own layers, whose setting reports one level) or "sequential sweeps" (exact
    propagation: every segment's solve has one level); None for an MGRIT step or the
    serial oracle (no stats)."""
    if fwd_stats is None:
        return None
    if not fwd_stats:
        return "replicated serial"
    if all(s.n_levels == 1 for s in fwd_stats):
        return "serial autograd" if plain else "sequential sweeps"
    return None


def _runs_plain(model: Any) -> bool:
    """Whether `model`'s passes are auto's serial choice at one rank, the net itself
    (`layerpar.parallel.autotune.plain_serial`)."""
    tuner = getattr(model, "tuner", None)
    return tuner is not None and tuner.plain is not None


def _replicas_note(grid: ProcessGrid, result: TrainResult) -> str:
    """How the data replicas kept in step, which the summary line does not say: the
    strategy, over how many nodes, the optimizer, and the bytes by kind (``sync_bytes``
    adds the data and inter-node ones; DASO's savings are the inter-node bytes)."""
    nodes = grid.data_node_count()
    kinds = result.bytes_by_kind or {}
    text = (f"{grid.data} data replicas x {grid.layers} rank(s), sync {result.sync} over "
            f"{nodes} node(s), optimizer {result.optimizer or 'adam'}; bytes sent per "
            f"process per batch: data {kinds.get('data', 0.0):.0f}, inter-node "
            f"{kinds.get('internode', 0.0):.0f}, MGRIT {kinds.get('p2p', 0.0):.0f}")
    if result.sync == "daso" and nodes == 1:
        text += ("; on one node DASO's node average is the global one, so it trains as "
                 "an all-reduce (`--nodes K` splits the replicas into K nodes)")
    return text


def _levels_note(model: Any, fwd: MGRITOptions) -> Optional[str]:
    """Why a layer-parallel run asked for MGRIT levels runs none (None where a segment
    has two or more): segments too short to coarsen, whose solves are then exact
    propagation, which the summary names without saying why.  (Fewer levels than
    asked, but two or more, is MGRIT's ordinary cap: `MGRITOptions.min_coarse`.)"""
    if fwd.max_levels <= 1 or not isinstance(model, (LayerParallel, Auto)):
        return None
    got = [(s.n_steps, len(s.forward.levels)) for s in model.plan.segments]
    if not got or any(k > 1 for _, k in got):
        return None
    n = max(n for n, _ in got)
    return (f"{fwd.max_levels} MGRIT levels asked, one built: a segment of {n} residual "
            f"layers is too short to coarsen (a coarser level needs at least "
            f"{fwd.min_coarse} intervals of cf {fwd.cfactor_at(0)}), so every step runs "
            "exact propagation (sequential sweeps); more layers or a smaller "
            "`--cfactor` give levels")


def _summary_notes(result: TrainResult, time_budget: Optional[float],
                   batches_per_epoch: int, total_epochs: int) -> list[str]:
    """Lines printed above the summary that say what its figures cannot: an early stop
    by the time budget, steps that ran exactly, and why a residual reads "n/a"."""
    notes = []
    last = result.history[-1]
    if result.stopped_by_budget:
        notes.append(f"stopped by the time budget ({time_budget:g} s) after "
                     f"{result.train_seconds:.2f} s of training, in epoch {last['epoch']} "
                     f"of {total_epochs} after "
                     f"{last['steps']} of its {batches_per_epoch} batches; the figures "
                     "are that epoch's, evaluated where it stopped")
    if result.exact_steps and result.fwd_iters is not None:
        notes.append(f"{result.exact_steps} of the last epoch's {result.last_epoch_steps} "
                     f"steps ran {result.exact_kind} (exact, no MGRIT cycle); the "
                     "iteration and residual figures are the other steps' means")
    # (the forward's only: the adjoint's one iteration, the default, reads "res n/a" in
    # every default run, which README's summary description explains; a note on each
    # run was noise on the first command a user types)
    skipped = result.fwd is None or result.fwd.skip
    if result.fwd_iters is not None and result.fwd_res is None and skipped:
        notes.append("res n/a: no residual was measured: with skip (the default), a "
                     "solve's first iteration does no fine-level work, so a one-iteration "
                     "solve computes none (the first residual comes with iteration 2)")
    return notes


def _capture_refusal(device: str, serial: bool, auto: bool, policy: Any, check_every: int,
                     nested: int, size: int, data_parallel: int, fwd: MGRITOptions,
                     bwd: MGRITOptions) -> str:
    """Why a training step on `device` cannot be captured in a CUDA graph ("" if it
    can: `layerpar.parallel.capture_step`'s conditions)."""
    if device != "cuda":
        return "not on CUDA"
    if serial:
        return "the serial oracle runs eagerly"
    if not auto and (policy is not None or check_every):  # (auto's are re-captured)
        return "adaptive settings change between batches"
    if nested:
        return "nested iteration changes the net"
    if size > 1 or data_parallel > 1:
        return "messages between ranks go through the host"
    if not auto and (fwd.tol or fwd.rtol or bwd.tol or bwd.rtol):  # auto's: fixed
        return "a residual tolerance is read on the host (use --tol 0)"
    return ""


class _Clock:
    """Training time: summed over the spans it runs (a ``with`` block, or `start` to
    `stop`), evaluation left out.  With a `LayerParallel`, `over` agrees between
    ranks (rank 0's clock decides), so every rank stops after the same batch.  On
    CUDA it waits for the GPU at both ends of a span: the steps do not wait for it
    (no host synchronisation per step), so the work they queued ends inside the span
    it belongs to, not in the evaluation after it."""

    def __init__(self, model: Optional[Union[LayerParallel, Auto]], device: str = "cpu"
                 ) -> None:
        self.model, self.seconds, self._t0 = model, 0.0, None
        self.cuda = torch.device(device).type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._t0 is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def __enter__(self) -> _Clock:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def now(self) -> float:
        return self.seconds + (0.0 if self._t0 is None else time.perf_counter() - self._t0)

    def over(self, budget: float) -> bool:
        late = self.now() >= budget
        if self.model is not None and self.model.size > 1:
            late = bool(self.model.transport.bcast_object(late, root=0))
        return late


def _first_batch(loader: Any) -> tuple[Tensor, Tensor]:
    """The loader's next first batch, leaving its shuffling generator as it was (so
    the epochs see the same batches, in the same order, as without this peek)."""
    gen = loader.generator
    state = None if gen is None else gen.get_state()
    x, y = next(iter(loader))
    if gen is not None:
        gen.set_state(state)
    return x, y


def _captured_steps(captured: Any, loader: Any, schedule: Any, to_device: Any,
                    timer: SpanTimer) -> Any:
    """`Step`s of a captured CUDA-graph step (no output: the loss only).  A batch of
    another shape than the captured one (a short last batch) is skipped: a graph
    replays fixed shapes.  Nothing here waits for the GPU: each step's time is a span
    of `timer` (CUDA events), read once an epoch, so the host queues the next batch
    while the GPU replays this one; a `Step`'s own seconds are 0."""
    from .loop import Step

    for x, y in loader:
        if x.shape != captured.x.shape:
            continue
        if to_device is not None:
            x, y = to_device(x), to_device(y)
        timer.start()
        loss = captured(x, y)
        schedule.step()
        timer.stop()
        yield Step(loss.detach().clone(), None, y, 0.0, 0.0, 0.0,  # type: ignore[arg-type]
                   input=x)


def _bar_note(loss: Union[None, float, Tensor], fwd_res: list, bwd_res: list,
              checks: list) -> str:
    """The progress bar's note: loss, the residuals reached, the last gradient check."""
    parts = [] if loss is None else [f"loss {float(loss):.3f}"]
    if fwd_res:
        parts.append(f"fwd res {fwd_res[-1]:.1e}")
    if bwd_res:
        parts.append(f"bwd res {bwd_res[-1]:.1e}")
    if checks and checks[-1]["exact"]:
        parts.append(f"exact propagation (MGRIT: grad err "
                     f"{checks[-1]['mgrit_rel_error']:.2g})")
    elif checks:
        parts.append(f"grad err {checks[-1]['rel_error']:.2g} (cos "
                     f"{checks[-1]['cosine']:.3f})")
    return " | ".join(parts)


def _rank_size(comm: Any) -> tuple[int, int]:
    """(rank, size) of an mpi4py communicator, a torch.distributed group or None."""
    if comm is None:
        return 0, 1
    if hasattr(comm, "Get_rank"):
        return comm.Get_rank(), comm.Get_size()
    import torch.distributed as dist

    return dist.get_rank(comm), dist.get_world_size(comm)


def _replica_totals(grid: ProcessGrid, losses: list[float], correct: int,
                    seen: int) -> tuple[list[float], int, int]:
    """An epoch's per-batch losses averaged over the replicas, and the correct and seen
    counts summed: the figures of the global batches (one exchange per epoch)."""
    got = grid.world.allgather_object((grid.data_rank, losses, correct, seen),
                                      "the epoch's training figures")
    per = {d: (ls, c, n) for d, ls, c, n in got}  # a replica's layer ranks agree
    mean = [sum(v[0][b] for v in per.values()) / len(per) for b in range(len(losses))]
    return mean, sum(v[1] for v in per.values()), sum(v[2] for v in per.values())


def _evaluate(model: Union[nn.Module, TrainingMethod], x: Tensor, y: Tensor) -> tuple[float, float]:
    """(loss, accuracy) on a validation set: eval mode, no graph, on every rank."""
    model.eval()
    with torch.no_grad():
        out = model.eval_forward(x) if isinstance(model, TrainingMethod) else model(x)
    model.train()
    loss = nn.functional.cross_entropy(out, y).item()
    return loss, float((out.argmax(1) == y).double().mean())


def _fmt_res(res: Optional[float]) -> str:
    return "n/a" if res is None else f"{res:.1e}"


def _fmt_iters(iters: Optional[float]) -> str:
    """A mean iteration count, or "n/a" where the steps reported none (a step
    replayed from a CUDA graph reports no solve statistics)."""
    return "n/a" if iters is None else f"{iters:g}"


def _sync_strategy(sync: str, total_batches: int) -> Any:
    """The grid's strategy for `train`: DASO (progress-keeping merge) with the first
    three tenths of the batches as warm-up and the last tenth as cool-down (synchronous
    all-reduce), the others by name.  A tenth of warm-up lost 1.3 points on MNIST-1D
    against all-reduce Adam, three tenths 0.7 (docs/sync/README.md, "Accuracy")."""
    if sync != "daso":
        return sync
    return DASO(warmup=3 * total_batches // 10, cooldown=total_batches // 10,
                total_batches=total_batches)


def _sync_bytes(grid: ProcessGrid, batches: int) -> dict[str, Any]:
    """Bytes sent per process per batch, averaged over the grid's processes
    (collective): ``sync_bytes`` (the data dimension) and ``bytes_by_kind``."""
    kinds = ("p2p", "data", "internode")
    sums = grid.world.allreduce_sum([float(grid.meter.get(k, 0)) for k in kinds])
    per = {k: v / grid.world_size / max(batches, 1) for k, v in zip(kinds, sums)}
    return {"sync_bytes": per["data"] + per["internode"], "bytes_by_kind": per}


def format_summary(result: Union[TrainResult, Mapping[str, Any]]) -> str:
    """The one-line summary of a `train` result (a `TrainResult`, or a mapping with
    its field names), e.g.

    ``peaks: val_acc 0.873 | train_loss 0.321 | 12.3 ms/batch | fwd iters 2 (res 3.1e-02)
    | bwd iters 1 (res n/a) | ranks 4`` (one line; "serial" instead of the MGRIT part
    for the serial oracle).  `parse_summary` reads it back.
    """
    def get(key: str, default: Any = None) -> Any:
        if isinstance(result, Mapping):
            return result.get(key, default)
        return getattr(result, key, default)

    parts = [f"{get('model')}: val_acc {get('val_acc'):.3f}",
             f"train_loss {get('train_loss'):.3f}",
             f"{get('ms_per_batch'):.1f} ms/batch"]
    data = get("data_parallel", 1)
    if get("sync_bytes") is not None and data > 1:
        parts.append(f"sync_bytes {get('sync_bytes'):.0f}")
    method = get("method", "layerparallel")
    if get("serial"):
        parts.append("serial")
    elif method not in (None, "layerparallel"):
        parts.append(f"method {method}")
    elif get("fwd_iters") is None and get("exact_kind"):  # no step ran MGRIT
        parts.append(f"exact ({get('exact_kind')})")
    else:
        parts.append(f"fwd iters {_fmt_iters(get('fwd_iters'))} (res "
                     f"{_fmt_res(get('fwd_res'))})")
        parts.append(f"bwd iters {_fmt_iters(get('bwd_iters'))} (res "
                     f"{_fmt_res(get('bwd_res'))})")
    parts.append(f"ranks {get('ranks')}" + (f" (data {data})" if data > 1 else ""))
    if get("target_acc") is not None:
        ttt = get("time_to_target")
        parts.append("time_to_target " + ("not reached" if ttt is None else f"{ttt:.2f}"))
    return " | ".join(parts)


_SUMMARY = re.compile(
    r"^(?P<model>\w+): val_acc (?P<val_acc>[\d.]+) \| train_loss (?P<train_loss>[\d.naif]+)"
    r" \| (?P<ms_per_batch>[\d.]+) ms/batch(?: \| sync_bytes (?P<sync_bytes>\d+))?"
    r" \| (?:(?P<serial>serial)|method (?P<method>[^|]+?)|exact \((?P<exact>[^)]*)\)|fwd iters "
    r"(?P<fwd_iters>[\d.]+|n/a) \(res (?P<fwd_res>\S+)\) \| bwd iters (?P<bwd_iters>[\d.]+|n/a) "
    r"\(res (?P<bwd_res>\S+)\)) \| ranks (?P<ranks>\d+)(?: \(data (?P<data>\d+)\))?"
    r"(?: \| time_to_target (?P<ttt>not reached|[\d.]+))?$")


def parse_summary(text: str) -> dict[str, Any]:
    """The fields of the last summary line in ``text`` (as `format_summary` writes it).

    Raises ValueError if ``text`` holds no such line.
    """
    for line in reversed(text.strip().splitlines()):
        m = _SUMMARY.match(line.strip())
        if m:
            g = m.groupdict()
            num = {k: None if g[k] in (None, "n/a") else float(g[k])
                   for k in ("fwd_iters", "fwd_res", "bwd_iters", "bwd_res")}
            return {"model": g["model"], "val_acc": float(g["val_acc"]),
                    "train_loss": float(g["train_loss"]),
                    "ms_per_batch": float(g["ms_per_batch"]), "serial": bool(g["serial"]),
                    **num, "ranks": int(g["ranks"]),
                    "data_parallel": int(g["data"]) if g["data"] else 1,
                    "time_to_target": None if g["ttt"] in (None, "not reached")
                    else float(g["ttt"]), "target_reached": g["ttt"] not in
                    (None, "not reached"),
                    "sync_bytes": int(g["sync_bytes"]) if g["sync_bytes"] else None,
                    "exact_kind": g["exact"],
                    "method": "serial" if g["serial"] else g["method"] or "layerparallel"}
    raise ValueError(f"`text` holds no training summary line: {text[-500:]!r}")


# -- command-line options shared by the examples and `layerpar train` -----------------------
# (the options themselves: layerpar.apps.arguments, which the help reads without torch)

def check_arguments(args: argparse.Namespace, *, built: bool = True,
                    model: Optional[str] = None) -> None:
    """Raise ValueError naming the option (e.g. ``--cfactor``) for a value out of range
    or options that conflict: the checks of `TrainConfig.from_args`.

    model: the problem (default ``args.model``; without one, the checks that depend on
    the problem wait for `check_problem`).  `built`: last, refuse an engine this
    installation lacks (`check_engine_built`); a conflict between options is a usage
    error whatever was built, so it is reported first."""
    model = model or getattr(args, "model", None)
    if model is None:  # `--model` (the architecture) is checked against its problem later
        args = argparse.Namespace(**{**vars(args), "arch": None})
    config = TrainConfig.from_args(args, model or PROBLEMS[0])
    if built:
        check_engine_built(config)


def check_engine_built(config: Union[TrainConfig, argparse.Namespace]) -> None:
    """ValueError when ``--engine xbraid`` names an engine this installation did not
    build (XBRAID_DIR at build time), saying how to build it.  Checked after every
    conflict between options, so that a command line refused for its options is
    refused alike with and without the XBraid engine."""
    if (getattr(config, "engine", None) or "native") == "xbraid" and not xbraid_available():
        raise ValueError("`--engine` xbraid: layerpar's XBraid engine was not built: "
                         + BUILD_HINT)


def check_problem(args: argparse.Namespace, problem: str, ranks: int) -> None:
    """What a problem's net allows of the parsed options on `ranks` ranks per replica
    (ValueError naming the option), checked before any layer is built: `--model`
    among its architectures, and `--nested` halvings that leave each rank a layer
    (`TrainConfig.check_processes`)."""
    config = TrainConfig.from_args(args, problem)
    config.check_processes(ranks * (1 if config.serial else config.data_parallel))


def options_from_arguments(args: argparse.Namespace) -> tuple[MGRITOptions, MGRITOptions]:
    """(forward, adjoint) `MGRITOptions` from parsed `add_arguments` options."""
    check_arguments(args)
    common = dict(max_levels=args.levels, cfactor=args.cfactor, nrelax=args.nrelax,
                  tol=args.tol)
    return (MGRITOptions(max_iter=args.fwd_iters, **common),
            MGRITOptions(max_iter=args.bwd_iters, **common))


def dtype_from_arguments(args: argparse.Namespace) -> torch.dtype:
    """torch.float64 with ``--float64``, else torch.float32."""
    return torch.float64 if args.float64 else torch.float32


def train_from_arguments(model_name: str, args: argparse.Namespace,
                         comm: Any = None) -> TrainResult:
    """`train` with the options parsed by `add_arguments` (the examples and
    ``layerpar train`` share this): ``TrainConfig.from_args(args, model_name)``.  With
    a communicator of several ranks and no ``--threads``, each rank's intra-op threads
    are set so the ranks on one node share its cores (`threads_per_rank`)."""
    config = TrainConfig.from_args(args, model_name)
    if comm is not None and config.threads is None:
        torch.set_num_threads(threads_per_rank(comm))
    return train(model_name, comm=comm, config=config)
