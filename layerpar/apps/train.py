"""A small, reusable training loop for the bundled problems (Peaks, digits).

The examples (``examples/peaks.py``, ``examples/digits.py``) and the command line
(``layerpar train``) are thin front ends to `train`, so all of them train the same
networks the same way and print the same summary line.  `train` runs either the plain
`ODENet` with ordinary autograd (``serial=True``: the serial oracle) or a
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
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from .._checks import nonneg_int, positive_float, positive_int
from ..defaults import TRAINING
from ..mgrit.options import ENGINE_INT_MAX, MAX_LEVELS, MGRITOptions
from ..mgrit.transport import DEFAULT_TIMEOUT
from ..mgrit.xbraid import BUILD_HINT, ENGINES, xbraid_available
from ..ode.net import ODENet
from ..ode.refine import refine
from ..ode.rng import MAX_SEED
from ..parallel import DASO, Auto, AutoCapturedStep, LayerParallel, Lion, ProcessGrid, SlowLink
from ..parallel.adaptive import AccuracyPolicy, as_policy
from ..parallel.autotune import auto_policy
from ..parallel.timing import SpanTimer
from . import data
from .arguments import AUTO_CHOOSES, add_arguments
from .loop import Batches, Progress, adam, available_cores, train_steps
from .nets import PROBLEMS, RECIPES, Recipe, problem_name, problem_net

__all__ = [
    "MODELS",
    "Recipe",
    "RECIPES",
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

DEVICES = ("cpu", "cuda")


def load_data(model_name: str, seed: int = 0,
              dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_val, y_val) of a problem, deterministic given ``seed``
    (`layerpar.apps.data.splits`).

    peaks: 5000 training and 200 validation points; digits: 1500 training and 297
    validation images; mnist1d: 16,000 training and 4,000 validation signals.
    """
    return data.splits(problem_name(model_name), seed=seed, dtype=dtype)


def threads_per_rank(comm: Any = None) -> int:
    """Torch threads per rank so that the ranks on one node share its cores.

    The cores this process may use, divided by the number of ranks of ``comm`` on the
    same node (all of them if ``comm`` is None); at least 1.
    """
    cores = available_cores()
    local = 1
    if comm is not None and hasattr(comm, "Split_type"):
        if comm.Get_size() > 1:
            from mpi4py import MPI

            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            local = node.Get_size()
            node.Free()
    elif comm is not None:  # a torch.distributed group: its launcher says how many here
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // local)


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


def train(
    model_name: str,
    *,
    serial: bool = False,
    epochs: Optional[int] = None,
    batch_size: Optional[int] = None,
    lr: Optional[float] = None,
    seed: int = 0,
    fwd: Optional[MGRITOptions] = None,
    bwd: Optional[MGRITOptions] = None,
    comm: Any = None,
    progress: bool = True,
    dtype: torch.dtype = torch.float32,
    n_layers: Optional[int] = None,
    width: Optional[int] = None,
    data_parallel: int = 1,
    adaptive: Union[bool, AccuracyPolicy] = False,
    check_every: int = 0,
    nested: int = 0,
    nested_epochs: int = 2,
    timeout: Optional[float] = DEFAULT_TIMEOUT,
    engine: str = "native",
    arch: Optional[str] = None,
    t_final: Optional[float] = None,
    device: str = "cpu",
    auto: Union[bool, AccuracyPolicy] = False,
    target_acc: Optional[float] = None,
    time_budget: Optional[float] = None,
    sync: str = "allreduce",
    nodes: Optional[int] = None,
    optimizer: Optional[str] = None,
    slow_link: Optional[float] = None,
    compile: bool = False,
) -> TrainResult:
    """Train the Peaks or digits network and return what happened (a `TrainResult`).

    model_name: "peaks", "digits" or "mnist1d" (see `build_net`, `load_data`).
    serial: train the plain `ODENet` with ordinary autograd (the serial oracle);
        ``comm`` then only decides which rank prints.  Otherwise the net is wrapped
        in `LayerParallel` over ``comm`` (None: one process without MPI).
    epochs, batch_size, lr: None takes the problem's `Recipe`.
    seed: fixes the data split, the initial parameters (``torch.manual_seed`` before
        building the net, on every rank) and the batch order.
    fwd, bwd: MGRIT options of the forward and adjoint solves (default: 3 levels,
        coarsening factor 4, 2 forward and 1 backward iteration: inexact training).
    progress: a progress bar on rank 0's stderr, when that is a terminal.
    timeout: seconds any one wait for another rank may take (`LayerParallel`'s).
    dtype: parameter and data dtype (torch.float32 or torch.float64).
    n_layers, width: override the number of residual layers / the width (channels).
    data_parallel: replicas R of a `ProcessGrid` over ``comm`` (R x L processes; the
        layer-parallel model of each replica spans L = size / R ranks).  Every process
        draws the same global batches; each replica trains on its share
        (`ProcessGrid.shard`) and gradients are averaged, so results equal training on
        the global batch.  ``comm`` may be an mpi4py communicator or a
        torch.distributed process group.
    adaptive: adaptive accuracy (`LayerParallel(accuracy=...)`: True for the default
        bound, or an `AccuracyPolicy`): iteration counts follow the gradient error
        measured every `check_every` batches (default: the policy's), exact
        propagation where MGRIT stalls.  Decisions go to ``accuracy_log``.
    check_every: measure the gradient error (`LayerParallel.check_gradients`) on every
        K-th batch (0: never, unless adaptive); the last one is shown in the progress
        bar, each epoch's record and ``checks``.
    nested: nested iteration (Cyr et al. 2019): train nets with n/2^K, ..., n/2 layers
        first, `nested_epochs` epochs each, refining (`refine`, factor 2, piecewise
        constant) onto the next; then the n-layer net trains `epochs` epochs.  Each
        epoch's record says its ``layers``.
    engine: the MGRIT engine of `LayerParallel`, "native" or "xbraid" (XBraid itself,
        when built; it steps layer by layer, so the per-step path is used).
    arch, t_final: the architecture ("dense" or "conv" for mnist1d) and the final time
        of the ODE segment (default: the problem's; `layerpar.apps.nets.problem_net`).
    device: "cpu" or "cuda".  On CUDA a layer-parallel step is captured in a CUDA
        graph (`capture_step`) where the settings allow it (one rank, fixed iteration
        counts: tol = 0, no adaptive accuracy, no nested iteration), else run
        eagerly; ``step_mode`` says which, and why.  Under auto at one rank, the
        setting auto chose is captured after its tuning (`AutoCapturedStep`) and
        captured again after a gradient check that changed it.
    auto: MGRIT settings chosen by measurement (``LayerParallel(options="auto")``,
        tuned on the first batch with this loss, then watched by the adaptive policy:
        ``adaptive``'s, the policy given as ``auto``, or by default a bound measured
        on the batch's own gradient noise, `layerpar.parallel.autotune`); the
        candidate table goes to ``auto_log``.
    target_acc: stop once the validation accuracy reaches it; ``time_to_target`` is
        the training time until then (None: not reached).
    time_budget: stop training after this many seconds (checked after every batch).
    Times (``train_seconds`` in each epoch's record, ``time_to_target``) count from
    the first batch, with tuning and gradient checks, without evaluation.
    sync, nodes, slow_link: how the replicas stay in step (`ProcessGrid`'s `sync`:
        "allreduce", "daso" with 3/10 of the batches as warm-up, 1/10 as cool-down,
        "lioncub"), in how many (simulated) nodes (None: as launched), and a
        `SlowLink` of that many Gbit/s (50 us latency) between nodes (None: none).
        ``sync_bytes`` in the result and the summary: bytes each process sent for
        the data dimension per batch, averaged over processes (``bytes_by_kind``:
        every kind, including MGRIT's point-to-point messages).
    optimizer: "adam" (default) or "lion" (`layerpar.parallel.Lion`, lr a third of
        Adam's by default; "lioncub" needs it and is its default).
    compile: with `serial`, train the net compiled by ``torch.compile`` (default mode;
        the serial baseline issue 20 asks for on a GPU beside eager and CUDA-graph
        capture).  The compilation runs in the first steps and counts in the training
        time, as auto's tuning does; evaluation runs the same net uncompiled (same
        parameters; no second compilation for eval mode, which is not timed anyway).

    Returns a `TrainResult` (its fields say what each figure means).
    """
    model_name = problem_name(model_name)
    recipe = RECIPES[model_name]
    if not isinstance(serial, bool):
        raise TypeError(f"`serial` must be a bool, got {type(serial).__name__}")
    if not isinstance(compile, bool):
        raise TypeError(f"`compile` must be a bool, got {type(compile).__name__}")
    epochs = recipe.epochs if epochs is None else positive_int("epochs", epochs)
    batch_size = recipe.batch_size if batch_size is None else positive_int("batch_size",
                                                                         batch_size)
    lr_given = lr is not None
    lr = recipe.lr if lr is None else lr
    lr = positive_float("lr", lr)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"`seed` must be an int in [0, 2**64 - 1], got {seed!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"`dtype` must be torch.float32 or torch.float64, got {dtype!r}")
    if auto is not False and (fwd is not None or bwd is not None or engine != "native"):
        raise ValueError("`fwd`, `bwd` and `engine` with `auto`: auto chooses the MGRIT "
                         "settings (with layerpar's own engine) by measurement; give one "
                         "or the other")
    fwd = TRAINING.fwd_options() if fwd is None else fwd
    bwd = TRAINING.bwd_options() if bwd is None else bwd
    for name, o in (("fwd", fwd), ("bwd", bwd)):
        if not isinstance(o, MGRITOptions):
            raise TypeError(f"`{name}` must be an MGRITOptions, got {type(o).__name__}")
    data_parallel = positive_int("data_parallel", data_parallel)
    policy = as_policy(adaptive)
    check_every = nonneg_int("check_every", check_every)
    nested = nonneg_int("nested", nested)
    nested_epochs = positive_int("nested_epochs", nested_epochs)
    if compile and not serial:
        raise ValueError("`compile` compiles the serial net with torch.compile: give "
                         "`serial` (a LayerParallel step is captured on CUDA instead)")
    if compile and nested:
        raise ValueError("`compile` with `nested`: each refinement is a new net, which "
                         "would compile again; train the compiled net without `nested`")
    if serial and (policy is not None or check_every):
        raise ValueError("`adaptive` and `check_every` need a layer-parallel run (they "
                         "compare MGRIT with exact propagation), not `serial`")
    if policy is not None and data_parallel > 1:
        raise ValueError("`adaptive` needs a run without data parallelism (each replica "
                         "would decide from its own batches: see LayerParallel's `accuracy`)")
    bound = auto if isinstance(auto, AccuracyPolicy) else None
    if bound is not None:
        auto = True
    if not isinstance(auto, bool):
        raise TypeError(f"`auto` must be a bool or an AccuracyPolicy, got "
                        f"{type(auto).__name__}")
    if auto and (serial or data_parallel > 1 or nested):
        raise ValueError("`auto` needs a layer-parallel run without data parallelism or "
                         "nested iteration")
    if auto and check_every:
        raise ValueError("`check_every` with `auto`: auto spreads its own gradient checks "
                         "(about 3 % of the training's time)")
    if auto and policy is None:
        policy = auto_policy(None)  # the bound measured on the batch's gradient noise
    elif auto and bound is not None:
        policy = bound
    if device not in DEVICES:
        raise ValueError(f"`device` must be one of {DEVICES}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("`device` 'cuda': CUDA is not available here")
    for name, v, lo, hi in (("target_acc", target_acc, 0.0, 1.0),
                            ("time_budget", time_budget, 0.0, math.inf)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not (lo < v <= hi)):
            raise ValueError(f"`{name}` must be a number in ({lo:g}, {hi:g}], got {v!r}")
    if policy is not None and not auto:
        # the controller schedules the checks (`check_due`): at the interval asked for
        # (under auto, the chosen setting's controller says when; exact needs none)
        if check_every:
            policy = replace(policy, check_every=check_every)
        check_every = policy.check_every
    if sync not in ("allreduce", "daso", "lioncub"):
        raise ValueError(f"`sync` must be 'allreduce', 'daso' or 'lioncub', got {sync!r}")
    optimizer = ("lion" if sync == "lioncub" else "adam") if optimizer is None else optimizer
    if optimizer not in ("adam", "lion"):
        raise ValueError(f"`optimizer` must be 'adam' or 'lion', got {optimizer!r}")
    if sync == "lioncub" and optimizer != "lion":
        raise ValueError("`sync`='lioncub' exchanges Lion updates: use `optimizer`='lion'")
    if nodes is not None:
        nodes = positive_int("nodes", nodes)
        if data_parallel % nodes:
            raise ValueError(f"`nodes`={nodes} must divide `data_parallel`={data_parallel}")
    if slow_link is not None:
        positive_float("slow_link", slow_link)  # Gbit/s
    if optimizer == "lion" and not lr_given:
        lr = recipe.lr / 3  # Lion's steps are signs: it wants a smaller rate than Adam
    rank, size = _rank_size(comm)
    ranks = 1 if serial else size
    if data_parallel > 1 and not serial:
        if size % data_parallel:
            raise ValueError(f"`data_parallel`={data_parallel} does not divide the {size} "
                             "processes")
        if batch_size % data_parallel:
            raise ValueError(f"the batch size {batch_size} is not divisible by "
                             f"`data_parallel`={data_parallel}")

    x_train, y_train, x_val, y_val = load_data(model_name, seed, dtype)
    n_fine = RECIPES[model_name].n_layers if n_layers is None else n_layers
    if nested and (n_fine % 2 ** nested or n_fine // 2 ** nested < max(1, size // max(
            data_parallel, 1)) and not serial):
        raise ValueError(f"`nested`={nested}: the net's {n_fine} layers must halve "
                         f"{nested} time(s) and still give each rank at least one layer")
    torch.manual_seed(seed)  # same initial parameters on every rank
    net = build_net(model_name, n_fine // 2 ** nested, width, arch=arch,
                    t_final=t_final).to(device=device, dtype=dtype)
    grid: Optional[ProcessGrid] = None
    step_mode = "eager"
    capture = _capture_refusal(device, serial, auto, policy, check_every, nested, size,
                               data_parallel, fwd, bwd)
    if device == "cuda":
        step_mode = "eager (not captured: " + capture + ")" if capture else "captured"
    recursion = sys.getrecursionlimit()
    if serial:
        model: nn.Module = torch.compile(net) if compile else net
        if compile:
            step_mode = "compiled (torch.compile; its compilation counts in the time)"
            # inductor walks the graph recursively, at least two frames per layer: at
            # 1,024 layers Python's default limit (1,000) ended the compilation with a
            # RecursionError, and 50,000 let it finish (docs/tta/ceilings/
            # compile_serial.txt), so 50 a layer with room; given back at the end
            sys.setrecursionlimit(max(recursion, 50 * n_fine + 10_000))
    elif data_parallel > 1 or not (comm is None or hasattr(comm, "Split_type")):
        grid = ProcessGrid(comm, data=data_parallel, sync=_sync_strategy(
            sync, (epochs + nested * nested_epochs) * -(-len(x_train) // batch_size)),
            nodes=nodes, link=None if slow_link is None else SlowLink(slow_link * 1e9))
        model = LayerParallel(net, None, fwd, bwd, grid=grid, accuracy=policy,
                              timeout=timeout, engine=engine)
    elif auto:
        model = LayerParallel(net, comm, "auto", accuracy=policy, timeout=timeout)
    else:
        model = LayerParallel(net, comm, fwd, bwd, accuracy=policy,
                              check_finite=step_mode != "captured", timeout=timeout,
                              engine=engine)
    # the DataLoader's batches, gathered whole (`Batches`); on a GPU (without a process
    # grid, whose shard takes host tensors) the training data lives there, so no batch
    # is copied from the host
    home = device if grid is None else "cpu"
    loader = Batches(x_train.to(home), y_train.to(home), batch_size=batch_size,
                     generator=torch.Generator().manual_seed(seed))

    to_device = None if device == "cpu" else (lambda t: t.to(device, non_blocking=True))
    shard = grid.shard if grid is not None else to_device
    x_val, y_val = x_val.to(device), y_val.to(device)
    clock = _Clock(model if isinstance(model, (LayerParallel, Auto)) else None, device)
    time_to_target: Optional[float] = None
    epochs_to_target: Optional[int] = None
    stop = stopped_by_budget = False
    frozen_before = gc.get_freeze_count() > 0  # the caller's own gc.freeze() is kept
    # what exists now (torch, its imports, the data, the net) out of the cyclic
    # collector's sight before the clock runs: a full collection scans every tracked
    # object, 75-125 ms here with torch's imports, and lands on the ranks at different
    # batches, so that the others wait for it (digits, 2 ranks: 83 ms of a first
    # epoch's 300); `gc.freeze` moves objects to a permanent generation, collects nothing
    gc.freeze()
    if auto:  # tune on the first batch, with the training loss; the time counts
        assert isinstance(model, (LayerParallel, Auto))
        x0, y0 = _first_batch(loader)
        with clock:
            # (online: small nets time their exact settings on the training's steps)
            model.tune(x0.to(device), y0.to(device), nn.functional.cross_entropy,
                       steps=epochs * len(loader), online=True)
    history: list[dict[str, Any]] = []
    batch_losses: list[float] = []
    checks: list[dict[str, Any]] = []
    step_time = 0.0
    total_steps = 0
    batch = 0  # over all levels: names a check or an adaptive decision
    stages = [(n_fine // 2 ** k, nested_epochs) for k in range(nested, 0, -1)]
    stages.append((n_fine, epochs))
    for stage, (layers, stage_epochs) in enumerate(stages):
        if stage:  # nested iteration: the trained net, refined, goes on training
            model = (model.refine(2) if isinstance(model, Auto) else refine(model, 2)
                     if isinstance(model, (ODENet, LayerParallel)) else model)
        # this rank's parameters; a captured step reads the learning rate from a tensor
        if optimizer == "lion":
            opt: torch.optim.Optimizer = Lion(model.parameters(), lr=lr)
        elif step_mode != "captured":
            opt = adam(model.parameters(), lr=lr)  # fused where torch has it
        else:
            opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(lr, device=device),
                                   capturable=True)
        if grid is not None and isinstance(model, (LayerParallel, Auto)):
            grid.sync.attach(model, opt)
        steps_here = stage_epochs * len(loader)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps_here)
        captured: Any = None
        if step_mode == "captured":
            from ..parallel.capture import capture_step

            x0, y0 = _first_batch(loader)
            with clock:  # capture's warm-up steps train too: counted in the time
                if auto:  # (step_mode then says, at the end, how it went)
                    captured = AutoCapturedStep(model, opt,  # type: ignore[arg-type]
                                                nn.functional.cross_entropy,
                                                x0.to(device), y0.to(device))
                else:
                    captured = capture_step(model, opt,  # type: ignore[arg-type]
                                            nn.functional.cross_entropy, x0.to(device),
                                            y0.to(device))
        for epoch in range(1, stage_epochs + 1):
            if stop:
                break
            label = f"{model_name} epoch {epoch}/{stage_epochs}" + (
                f" ({layers} layers)" if nested else "")
            bar = Progress(len(loader), label, enabled=progress and rank == 0)
            model.train()
            losses, correct, seen = [], 0, 0
            fwd_it, fwd_res, bwd_it, bwd_res = [], [], [], []
            exact_kinds: list[str] = []  # steps of this epoch that ran no MGRIT cycle
            t_epoch = time.perf_counter()
            clock.start()
            replays = SpanTimer(torch.device(device))  # captured steps' times
            steps = train_steps(model, loader, opt, scheduler=schedule,
                                shard=shard) if captured is None else \
                _captured_steps(captured, loader, schedule, shard, replays)
            for b, step in enumerate(steps, 1):
                batch += 1
                total_steps += 1
                if total_steps == 1:
                    # what the tuning and the first step made (settings, optimizer
                    # state) out of the collector's sight too (~130 ms a full collection
                    # at 1,024 layers: 4 % of case a's step, issue 20)
                    gc.freeze()
                step_time += step.seconds
                # (kept on the device and read once an epoch: `.item()` here waited for
                # the GPU at every step, so the host could not queue the next one)
                losses.append(step.loss)
                if step.output is not None:
                    correct += (step.output.detach().argmax(1) == step.target).sum()
                    seen += len(step.target)
                kind = _exact_kind(step.fwd_stats, _runs_plain(model))
                if kind is not None:  # iteration figures are MGRIT's; these ran none
                    exact_kinds.append(kind)
                else:
                    for stats, its, res in ((step.fwd, fwd_it, fwd_res),
                                            (step.bwd, bwd_it, bwd_res)):
                        if stats is not None:
                            its.append(stats.iterations)
                            res += [] if stats.residual is None else [stats.residual]
                ctl = getattr(model, "accuracy", None)
                due = ctl.check_due(batch) if ctl is not None else \
                    bool(check_every) and batch % check_every == 0
                if due:
                    if isinstance(captured, AutoCapturedStep):
                        captured.observe_step(replays.mean())  # a replayed step's time
                    exact = ctl is not None and ctl.exact  # training ran exactly
                    got = model.check_gradients(step.input, step.target,  # type: ignore
                                                nn.functional.cross_entropy)
                    checks.append({"batch": batch, "layers": layers, "exact": exact,
                                   "cosine": 1.0 if exact else got.cos,
                                   "rel_error": 0.0 if exact else got.error,
                                   "mgrit_cosine": got.cos,
                                   "mgrit_rel_error": got.error,
                                   "note": _auto_check_note(model, batch, got)})
                    if isinstance(captured, AutoCapturedStep):
                        # a re-tuning or the controller may have changed the setting
                        captured.refresh(step.input, step.target)
                    gc.freeze()  # a check may have tuned again: new settings, new objects
                bar.update(b, partial(_bar_note, losses[-1], fwd_res, bwd_res, checks))
                if time_budget is not None and clock.over(time_budget):
                    stop = stopped_by_budget = True
                    break
            clock.stop()
            step_time += replays.total()[0]
            losses = torch.stack(losses).tolist() if losses else []
            correct = int(correct)
            if grid is not None and grid.data > 1:  # the global batch's figures
                losses, correct, seen = _replica_totals(grid, losses, correct, seen)
            batch_losses += losses
            val_loss, val_acc = _evaluate(net if compile else model, x_val, y_val)
            record = {
                "epoch": len(history) + 1, "layers": layers,
                "train_loss": sum(losses) / len(losses),
                "train_acc": correct / seen if seen else math.nan, "val_loss": val_loss,
                "val_acc": val_acc, "seconds": time.perf_counter() - t_epoch,
                "train_seconds": clock.seconds, "batches": batch,
                "fwd_iters": _mean(fwd_it), "fwd_res": _mean(fwd_res),
                "bwd_iters": _mean(bwd_it), "bwd_res": _mean(bwd_res),
                "grad_cosine": checks[-1]["cosine"] if checks else None,
                "grad_error": checks[-1]["rel_error"] if checks else None,
                "steps": len(losses), "exact_steps": len(exact_kinds),
                "exact_kind": exact_kinds[-1] if exact_kinds else None,
            }
            history.append(record)
            bar.close(f"train_loss {record['train_loss']:.3f} | val_acc {val_acc:.3f} | "
                      + _bar_note(None, fwd_res, bwd_res, checks))
            if target_acc is not None and time_to_target is None and val_acc >= target_acc:
                time_to_target, epochs_to_target = clock.seconds, record["epoch"]
                stop = True
        if stop:
            break

    if not frozen_before:
        gc.unfreeze()  # what this training froze is the collector's again
    sys.setrecursionlimit(recursion)
    last = history[-1]
    tuner = model.tuner if isinstance(model, (LayerParallel, Auto)) else None
    sync_figures: dict[str, Any] = {}
    if grid is not None and isinstance(model, (LayerParallel, Auto)) and model.averager is not None:
        sync_figures["allreduce_ms_per_batch"] = (1000.0 * model.averager.total_seconds
                                                  / total_steps)
    if grid is not None:
        sync_figures.update(_sync_bytes(grid, total_steps))
    if isinstance(captured, AutoCapturedStep):  # auto's setting, captured again on change
        step_mode = (f"captured ({captured.captures} capture(s) of auto's setting)"
                     if captured.captures else
                     f"eager (not captured: {captured.why_eager})")
        captured.close()
    result = TrainResult(
        model=model_name, serial=serial, ranks=ranks,
        data_parallel=1 if serial else data_parallel, epochs=epochs,
        batch_size=batch_size, lr=lr, seed=seed, dtype=str(dtype),
        fwd=None if serial else fwd, bwd=None if serial else bwd,
        val_acc=last["val_acc"], val_loss=last["val_loss"],
        train_loss=last["train_loss"], train_acc=last["train_acc"],
        ms_per_batch=1000.0 * step_time / total_steps,
        fwd_iters=last["fwd_iters"], fwd_res=last["fwd_res"],
        bwd_iters=last["bwd_iters"], bwd_res=last["bwd_res"],
        history=history, batch_losses=batch_losses, module=model,
        checks=checks, nested=nested,
        seconds=sum(r["seconds"] for r in history),
        accuracy_log=[] if getattr(model, "accuracy", None) is None else
        [str(e) for e in model.accuracy.log],  # type: ignore[union-attr]
        device=device, step_mode=step_mode, arch=arch, t_final=t_final,
        train_seconds=clock.seconds, target_acc=target_acc,
        time_to_target=time_to_target, epochs_to_target=epochs_to_target,
        auto=auto, auto_log=[] if tuner is None else tuner.log(size),
        auto_choice=None if tuner is None else tuner.choice_name(size),
        sync=sync, optimizer=optimizer, exact_steps=last["exact_steps"],
        exact_kind=last["exact_kind"], last_epoch_steps=last["steps"],
        stopped_by_budget=stopped_by_budget, **sync_figures)
    if rank == 0:
        if device == "cuda" or compile:
            print(f"{model_name}: step on {device}: {step_mode}", flush=True)
        for line in result.auto_log:
            print(f"{model_name}: {line}", flush=True)
        for line in result.accuracy_log:
            print(f"{model_name}: adaptive accuracy: {line}", flush=True)
        if checks:
            print(f"{model_name}: {last_check_line(checks[-1])}", flush=True)
        if grid is not None and grid.data > 1:
            print(f"{model_name}: {_replicas_note(grid, result)}", flush=True)
        levels = None if serial or auto else _levels_note(model, fwd)
        if levels is not None:
            print(f"{model_name}: {levels}", flush=True)
        for line in _summary_notes(result, time_budget, len(loader),
                                   sum(e for _, e in stages)):
            print(f"{model_name}: {line}", flush=True)
        print(result.summary, flush=True)
    return result


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


def _evaluate(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    """(loss, accuracy) on a validation set: eval mode, no graph, on every rank."""
    model.eval()
    with torch.no_grad():
        out = model(x)
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
    if get("serial"):
        parts.append("serial")
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
    r" \| (?:(?P<serial>serial)|exact \((?P<exact>[^)]*)\)|fwd iters "
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
                    "exact_kind": g["exact"]}
    raise ValueError(f"`text` holds no training summary line: {text[-500:]!r}")


# -- command-line options shared by the examples and `layerpar train` -----------------------
# (the options themselves: layerpar.apps.arguments, which the help reads without torch)

def check_arguments(args: argparse.Namespace, *, built: bool = True) -> None:
    """Raise ValueError naming the option (e.g. ``--cfactor``) for a value out of range
    or options that conflict.

    `built`: last, refuse an engine this installation lacks (`check_engine_built`).  A
    conflict between options is a usage error whatever was built, so it is reported
    first; a caller with conflicts of its own to check passes False and calls
    `check_engine_built` after them."""
    checks = [("--levels", args.levels, 1), ("--cfactor", args.cfactor, 2),
              ("--fwd-iters", args.fwd_iters, 1), ("--bwd-iters", args.bwd_iters, 1),
              ("--nrelax", args.nrelax, 0), ("--epochs", args.epochs, 1),
              ("--batch-size", args.batch_size, 1), ("--seed", args.seed, 0),
              ("--check-every", getattr(args, "check_every", 0), 0),
              ("--nested", getattr(args, "nested", 0), 0),
              ("--nested-epochs", getattr(args, "nested_epochs", 1), 1),
              ("--layers", getattr(args, "layers", None), 1),
              ("--width", getattr(args, "width", None), 1)]
    for flag, value, lo in checks:
        if value is not None and value < lo:
            raise ValueError(f"`{flag}` must be >= {lo}, got {value}")
    if args.levels > MAX_LEVELS:
        raise ValueError(f"`--levels` must be <= {MAX_LEVELS}, got {args.levels}")
    # what the engine holds in C ints, and torch in a 64-bit seed: checked here, so a
    # bad value is one line naming the option, not an OverflowError on every rank
    for flag, value, hi in [("--cfactor", args.cfactor, ENGINE_INT_MAX),
                            ("--fwd-iters", args.fwd_iters, ENGINE_INT_MAX),
                            ("--bwd-iters", args.bwd_iters, ENGINE_INT_MAX),
                            ("--nrelax", args.nrelax, ENGINE_INT_MAX),
                            ("--layers", getattr(args, "layers", None) or 1, ENGINE_INT_MAX),
                            ("--width", getattr(args, "width", None) or 1, ENGINE_INT_MAX),
                            ("--seed", args.seed, MAX_SEED)]:
        if value > hi:
            raise ValueError(f"`{flag}` must be <= {hi}, got {value}")
    timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"`--timeout` must be a positive number of seconds, got {timeout}")
    if not (math.isfinite(args.tol) and args.tol >= 0):
        raise ValueError(f"`--tol` must be a finite number >= 0, got {args.tol}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"`--lr` must be a positive number, got {args.lr}")
    if getattr(args, "engine", "native") not in ENGINES:
        raise ValueError(f"`--engine` must be one of {', '.join(ENGINES)}, got {args.engine!r}")
    if getattr(args, "nested_epochs", None) is not None and not getattr(args, "nested", 0):
        raise ValueError("`--nested-epochs` sets the epochs of each `--nested` stage: "
                         "give `--nested`")
    for flag, value, hi in (("--t-final", getattr(args, "t_final", None), math.inf),
                            ("--target-acc", getattr(args, "target_acc", None), 1.0),
                            ("--time-budget", getattr(args, "time_budget", None), math.inf)):
        if value is not None and not (math.isfinite(value) and 0 < value <= hi):
            what = "in (0, 1]" if hi == 1.0 else "a finite number > 0"
            raise ValueError(f"`{flag}` must be {what}, got {value}")
    bound = _bound(args)
    if bound and not (getattr(args, "adaptive", False) or getattr(args, "auto", False)):
        raise ValueError(f"`--{next(iter(bound)).replace('_', '-').replace('rel-', 'grad-')}"
                         "` sets the bound of `--adaptive` or `--auto`: give one of them")
    if bound:
        try:
            AccuracyPolicy(**bound)
        except ValueError as exc:
            flag = "--max-grad-error" if "max_rel_error" in str(exc) else "--min-cosine"
            raise ValueError(f"`{flag}`: {exc}") from None
    device = getattr(args, "device", "cpu")
    if device not in DEVICES:
        raise ValueError(f"`--device` must be one of {list(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("`--device` cuda: CUDA is not available on this machine")
    if getattr(args, "auto", False) and (args.serial or getattr(args, "nested", 0)
                                         or getattr(args, "data_parallel", 1) > 1):
        raise ValueError("`--auto` chooses layer-parallel settings: not with `--serial`, "
                         "`--nested` or `--data-parallel`")
    if getattr(args, "adaptive", False) and getattr(args, "data_parallel", 1) > 1:
        raise ValueError("`--adaptive` decides from each replica's own batches: not with "
                         "`--data-parallel`")
    if getattr(args, "auto", False):
        for flag in AUTO_CHOOSES:
            if flag in getattr(args, "given", ()):
                raise ValueError(f"`{flag}` with `--auto`: auto chooses the MGRIT settings "
                                 "(and the engine) by measurement; give one or the other")
    if getattr(args, "auto", False) and getattr(args, "check_every", 0):
        raise ValueError("`--check-every` with `--auto`: auto spreads its own gradient "
                         "checks (about 3 % of the training's time)")
    if getattr(args, "compile", False) and not args.serial:
        raise ValueError("`--compile` compiles the serial net with torch.compile: give "
                         "`--serial` (a layer-parallel step is captured on CUDA instead)")
    if getattr(args, "compile", False) and getattr(args, "nested", 0):
        raise ValueError("`--compile` with `--nested`: each refinement is a new net, "
                         "which would compile again")
    if args.serial and (getattr(args, "adaptive", False) or getattr(args, "check_every", 0)):
        raise ValueError("`--adaptive` and `--check-every` compare MGRIT with exact "
                         "propagation: not with `--serial`")
    if args.serial:
        for flag in AUTO_CHOOSES:
            if flag in getattr(args, "given", ()):
                raise ValueError(f"`{flag}` with `--serial`: the serial oracle runs no MGRIT "
                                 "solve (nor an engine); give one or the other")
    if built:
        check_engine_built(args)


def check_engine_built(args: argparse.Namespace) -> None:
    """ValueError when ``--engine xbraid`` names an engine this installation did not
    build (XBRAID_DIR at build time), saying how to build it.  Checked after every
    conflict between options (`check_arguments`), so that a command line refused for
    its options is refused alike with and without the XBraid engine."""
    if getattr(args, "engine", "native") == "xbraid" and not xbraid_available():
        raise ValueError("`--engine` xbraid: layerpar's XBraid engine was not built: "
                         + BUILD_HINT)


def check_problem(args: argparse.Namespace, problem: str, ranks: int) -> None:
    """What a problem's net allows (ValueError naming the option), checked before any
    layer is built: `--model` among its architectures, and `--nested` K halvings that
    leave each of the `ranks` ranks per replica a layer.  ``layerpar train`` and the
    examples share it (the examples ended in a traceback on `--model conv` for Peaks or
    `--nested 9`, which ``layerpar train`` refused in one line)."""
    from .nets import ARCHITECTURES

    arch = getattr(args, "arch", None)
    if arch is not None and arch not in ARCHITECTURES[problem]:
        raise ValueError(f"`--model` must be one of {list(ARCHITECTURES[problem])} for "
                         f"{problem}, got {arch!r}")
    layers = getattr(args, "layers", None) or RECIPES[problem].n_layers
    nested = max(0, getattr(args, "nested", 0) or 0)
    if nested and (layers % 2 ** nested or layers // 2 ** nested < ranks):
        raise ValueError(f"`--nested` {nested}: {problem}'s {layers} layers must halve "
                         f"{nested} time(s) and still give each of the {ranks} rank(s) "
                         "per replica at least one layer")


def _bound(args: argparse.Namespace) -> dict[str, float]:
    """The accuracy bound given by ``--max-grad-error`` / ``--min-cosine`` (as
    `AccuracyPolicy` fields; empty: the default bound)."""
    got = {"max_rel_error": getattr(args, "max_grad_error", None),
           "min_cosine": getattr(args, "min_cosine", None)}
    return {k: v for k, v in got.items() if v is not None}


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
    `layerpar train` share this).  With a communicator of several ranks, each rank's
    intra-op threads are set so the ranks on one node share its cores."""
    fwd, bwd = (None, None) if getattr(args, "auto", False) else options_from_arguments(args)
    if comm is not None:
        torch.set_num_threads(threads_per_rank(comm))
    return train(model_name, serial=args.serial, epochs=args.epochs,
                 batch_size=args.batch_size, lr=args.lr, seed=args.seed, fwd=fwd, bwd=bwd,
                 comm=comm, progress=not args.no_progress, dtype=dtype_from_arguments(args),
                 data_parallel=getattr(args, "data_parallel", 1),
                 adaptive=AccuracyPolicy(**_bound(args)) if args.adaptive and _bound(args)
                 else args.adaptive, check_every=args.check_every, nested=args.nested,
                 nested_epochs=2 if args.nested_epochs is None else args.nested_epochs,
                 n_layers=getattr(args, "layers", None),
                 width=getattr(args, "width", None), arch=getattr(args, "arch", None),
                 t_final=getattr(args, "t_final", None),
                 device=getattr(args, "device", "cpu"),
                 auto=AccuracyPolicy(**_bound(args)) if getattr(args, "auto", False)
                 and _bound(args) else getattr(args, "auto", False),
                 target_acc=getattr(args, "target_acc", None),
                 time_budget=getattr(args, "time_budget", None),
                 timeout=getattr(args, "timeout", DEFAULT_TIMEOUT),
                 engine=getattr(args, "engine", "native"),
                 sync=getattr(args, "sync", "allreduce"), nodes=getattr(args, "nodes", None),
                 optimizer=getattr(args, "optimizer", None),
                 slow_link=getattr(args, "slow_link", None),
                 compile=getattr(args, "compile", False))
