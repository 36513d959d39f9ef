"""A small, reusable training loop for the bundled problems (Peaks, digits).

The examples (``examples/peaks.py``, ``examples/digits.py``) and the command line
(``layerpar train``) are thin front ends to `train`, so all of them train the same
networks the same way and print the same summary line.  `train` runs either the plain
`ODENet` with ordinary autograd (``serial=True``: the serial oracle) or a
`LayerParallel` over ``comm`` (``comm=None``: one process, no MPI), which makes
serial and layer-parallel runs directly comparable: same seed, same network, same data
order, same optimiser and schedule.  The networks are `layerpar.nets`' problems; each
step is `layerpar.loop.train_step`, the one the studies and benchmarks time.

Every rank runs this loop in lockstep: it builds the same network (the global torch
generator is seeded before building), iterates the same batches (the data loader has
its own seeded generator), computes the same loss (the output is broadcast), and
evaluates validation accuracy itself.  Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from . import data
from .loop import Progress, available_cores, train_steps
from .mgrit.options import ENGINE_INT_MAX, MAX_LEVELS, MGRITOptions
from .nets import PROBLEMS, RECIPES, Recipe, positive_int, problem_name, problem_net
from .ode.net import ODENet
from .ode.refine import refine
from .ode.rng import MAX_SEED
from .parallel import DASO, LayerParallel, Lion, ProcessGrid, SlowLink
from .parallel.adaptive import AccuracyPolicy, as_policy

__all__ = [
    "MODELS",
    "Recipe",
    "RECIPES",
    "add_arguments",
    "build_net",
    "check_arguments",
    "dtype_from_arguments",
    "format_summary",
    "load_data",
    "options_from_arguments",
    "parse_summary",
    "threads_per_rank",
    "train",
]


# the problems `train` trains (the choices of ``layerpar train``) and their builder, under
# the names layerpar.train has always had; both live in layerpar.nets
MODELS = PROBLEMS
build_net = problem_net

_PEAKS_TRAIN, _PEAKS_VAL = 5000, 200
_DIGITS_VAL = 297


def load_data(model_name: str, seed: int = 0,
              dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_val, y_val) of a problem, deterministic given ``seed``.

    peaks: 5000 training and 200 validation points; digits: 1500 training and 297
    validation images.
    """
    if problem_name(model_name) == "peaks":
        return data.peaks(_PEAKS_TRAIN, _PEAKS_VAL, seed=seed, dtype=dtype)
    return data.digits(_DIGITS_VAL, seed=seed, dtype=dtype)


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
    sync: str = "allreduce",
    nodes: Optional[int] = None,
    optimizer: Optional[str] = None,
    slow_link: Optional[float] = None,
) -> dict[str, Any]:
    """Train the Peaks or digits network and return what happened.

    model_name: "peaks" or "digits" (see `build_net`, `load_data`).
    serial: train the plain `ODENet` with ordinary autograd (the serial oracle);
        ``comm`` then only decides which rank prints.  Otherwise the net is wrapped
        in `LayerParallel` over ``comm`` (None: one process without MPI).
    epochs, batch_size, lr: None takes the problem's `Recipe`.
    seed: fixes the data split, the initial parameters (``torch.manual_seed`` before
        building the net, on every rank) and the batch order.
    fwd, bwd: MGRIT options of the forward and adjoint solves (default: 3 levels,
        coarsening factor 4, 2 forward and 1 backward iteration: inexact training).
    progress: a progress bar on rank 0's stderr, when that is a terminal.
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
    sync, nodes, slow_link: how the replicas stay in step (`ProcessGrid`'s `sync`:
        "allreduce", "daso" with a tenth of the batches as warm-up and as cool-down,
        "lioncub"), in how many (simulated) nodes (None: as launched), and a
        `SlowLink` of that many Gbit/s (50 us latency) between nodes (None: none).
        ``sync_bytes`` in the result and the summary: bytes each process sent for
        the data dimension per batch, averaged over processes (``bytes_by_kind``:
        every kind, including MGRIT's point-to-point messages).
    optimizer: "adam" (default) or "lion" (`layerpar.parallel.Lion`, lr a third of
        Adam's by default; "lioncub" needs it and is its default).

    Returns a dict: ``val_acc``, ``val_loss``, ``train_loss`` and ``train_acc`` (last
    epoch), ``ms_per_batch`` (one optimisation step: forward, backward, update,
    averaged over all steps), ``fwd_iters``/``fwd_res`` and ``bwd_iters``/``bwd_res``
    (MGRIT iterations and final residual norm, averaged over the last epoch's batches;
    None when serial or not measured), ``ranks``, ``history`` (one dict per epoch),
    ``batch_losses`` (every step's loss), ``summary`` (the line rank 0 prints) and
    ``module`` (the trained ODENet or LayerParallel), plus the settings used.
    """
    model_name = problem_name(model_name)
    recipe = RECIPES[model_name]
    if not isinstance(serial, bool):
        raise TypeError(f"`serial` must be a bool, got {type(serial).__name__}")
    epochs = recipe.epochs if epochs is None else positive_int(epochs, "epochs")
    batch_size = recipe.batch_size if batch_size is None else positive_int(batch_size,
                                                                         "batch_size")
    lr_given = lr is not None
    lr = recipe.lr if lr is None else lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (
            math.isfinite(lr) and lr > 0):
        raise ValueError(f"`lr` must be a positive finite number, got {lr!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"`seed` must be an int in [0, 2**64 - 1], got {seed!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"`dtype` must be torch.float32 or torch.float64, got {dtype!r}")
    fwd = MGRITOptions(max_levels=3, cfactor=4, max_iter=2) if fwd is None else fwd
    bwd = MGRITOptions(max_levels=3, cfactor=4, max_iter=1) if bwd is None else bwd
    for name, o in (("fwd", fwd), ("bwd", bwd)):
        if not isinstance(o, MGRITOptions):
            raise TypeError(f"`{name}` must be an MGRITOptions, got {type(o).__name__}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) \
            or data_parallel < 1:
        raise ValueError(f"`data_parallel` must be an int >= 1, got {data_parallel!r}")
    policy = as_policy(adaptive)
    check_every = _count(check_every, "check_every")
    nested = _count(nested, "nested")
    nested_epochs = positive_int(nested_epochs, "nested_epochs")
    if serial and (policy is not None or check_every):
        raise ValueError("`adaptive` and `check_every` need a layer-parallel run (they "
                         "compare MGRIT with exact propagation), not `serial`")
    if policy is not None and not check_every:
        check_every = policy.check_every
    if sync not in ("allreduce", "daso", "lioncub"):
        raise ValueError(f"`sync` must be 'allreduce', 'daso' or 'lioncub', got {sync!r}")
    optimizer = ("lion" if sync == "lioncub" else "adam") if optimizer is None else optimizer
    if optimizer not in ("adam", "lion"):
        raise ValueError(f"`optimizer` must be 'adam' or 'lion', got {optimizer!r}")
    if sync == "lioncub" and optimizer != "lion":
        raise ValueError("`sync`='lioncub' exchanges Lion updates: use `optimizer`='lion'")
    if nodes is not None:
        nodes = positive_int(nodes, "nodes")
        if data_parallel % nodes:
            raise ValueError(f"`nodes`={nodes} must divide `data_parallel`={data_parallel}")
    if slow_link is not None and (isinstance(slow_link, bool) or not isinstance(
            slow_link, (int, float)) or not (math.isfinite(slow_link) and slow_link > 0)):
        raise ValueError(f"`slow_link` must be a positive number of Gbit/s, got "
                         f"{slow_link!r}")
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
    net = build_net(model_name, n_fine // 2 ** nested, width).to(dtype)
    grid: Optional[ProcessGrid] = None
    if serial:
        model: nn.Module = net
    elif data_parallel > 1 or not (comm is None or hasattr(comm, "Split_type")):
        grid = ProcessGrid(comm, data=data_parallel, sync=_sync_strategy(
            sync, (epochs + nested * nested_epochs) * -(-len(x_train) // batch_size)),
            nodes=nodes, link=None if slow_link is None else SlowLink(slow_link * 1e9))
        model = LayerParallel(net, None, fwd, bwd, grid=grid, accuracy=policy)
    else:
        model = LayerParallel(net, comm, fwd, bwd, accuracy=policy)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train, y_train), batch_size=batch_size,
        shuffle=True, generator=torch.Generator().manual_seed(seed))

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
            model = (refine(model, 2) if isinstance(model, (ODENet, LayerParallel))
                     else model)
        # this rank's parameters
        opt = Lion(model.parameters(), lr=lr) if optimizer == "lion" else \
            torch.optim.Adam(model.parameters(), lr=lr)
        if grid is not None and isinstance(model, LayerParallel):
            grid.sync.attach(model, opt)
        steps_here = stage_epochs * len(loader)
        total_steps += steps_here
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps_here)
        for epoch in range(1, stage_epochs + 1):
            label = f"{model_name} epoch {epoch}/{stage_epochs}" + (
                f" ({layers} layers)" if nested else "")
            bar = Progress(len(loader), label, enabled=progress and rank == 0)
            model.train()
            losses, correct, seen = [], 0, 0
            fwd_it, fwd_res, bwd_it, bwd_res = [], [], [], []
            t_epoch = time.perf_counter()
            steps = train_steps(model, loader, opt, scheduler=schedule,
                                shard=None if grid is None else grid.shard)
            for b, step in enumerate(steps, 1):
                batch += 1
                step_time += step.seconds
                losses.append(step.loss.item())
                correct += int((step.output.detach().argmax(1) == step.target).sum())
                seen += len(step.target)
                for stats, its, res in ((step.fwd, fwd_it, fwd_res),
                                        (step.bwd, bwd_it, bwd_res)):
                    if stats is not None:
                        its.append(stats.iterations)
                        res += [] if stats.residual is None else [stats.residual]
                ctl = getattr(model, "accuracy", None)
                due = ctl.check_due(batch) if ctl is not None else \
                    bool(check_every) and batch % check_every == 0
                if due:
                    exact = ctl is not None and ctl.exact  # training ran exactly
                    got = model.check_gradients(step.input, step.target,  # type: ignore
                                                nn.functional.cross_entropy)
                    checks.append({"batch": batch, "layers": layers, "exact": exact,
                                   "cosine": 1.0 if exact else got.cosine,
                                   "rel_error": 0.0 if exact else got.param_grad_error,
                                   "mgrit_cosine": got.cosine,
                                   "mgrit_rel_error": got.param_grad_error})
                bar.update(b, _bar_note(losses[-1], fwd_res, bwd_res, checks))
            if grid is not None and grid.data > 1:  # the global batch's figures
                losses, correct, seen = _replica_totals(grid, losses, correct, seen)
            batch_losses += losses
            val_loss, val_acc = _evaluate(model, x_val, y_val)
            record = {
                "epoch": len(history) + 1, "layers": layers,
                "train_loss": sum(losses) / len(losses),
                "train_acc": correct / seen, "val_loss": val_loss, "val_acc": val_acc,
                "seconds": time.perf_counter() - t_epoch,
                "fwd_iters": _mean(fwd_it), "fwd_res": _mean(fwd_res),
                "bwd_iters": _mean(bwd_it), "bwd_res": _mean(bwd_res),
                "grad_cosine": checks[-1]["cosine"] if checks else None,
                "grad_error": checks[-1]["rel_error"] if checks else None,
            }
            history.append(record)
            bar.close(f"train_loss {record['train_loss']:.3f} | val_acc {val_acc:.3f} | "
                      + _bar_note(None, fwd_res, bwd_res, checks))

    last = history[-1]
    result: dict[str, Any] = {
        "model": model_name, "serial": serial, "ranks": ranks,
        "data_parallel": 1 if serial else data_parallel, "epochs": epochs,
        "batch_size": batch_size, "lr": lr, "seed": seed, "dtype": str(dtype),
        "fwd": None if serial else fwd, "bwd": None if serial else bwd,
        "val_acc": last["val_acc"], "val_loss": last["val_loss"],
        "train_loss": last["train_loss"], "train_acc": last["train_acc"],
        "ms_per_batch": 1000.0 * step_time / total_steps,
        "fwd_iters": last["fwd_iters"], "fwd_res": last["fwd_res"],
        "bwd_iters": last["bwd_iters"], "bwd_res": last["bwd_res"],
        "history": history, "batch_losses": batch_losses, "module": model,
        "checks": checks, "nested": nested,
        "seconds": sum(r["seconds"] for r in history),
        "accuracy_log": [] if getattr(model, "accuracy", None) is None else
        [str(e) for e in model.accuracy.log],  # type: ignore[union-attr]
    }
    if grid is not None and isinstance(model, LayerParallel) and model._averager is not None:
        result["allreduce_ms_per_batch"] = 1000.0 * model._averager.total_seconds / total_steps
    result["sync"], result["optimizer"] = sync, optimizer
    if grid is not None:
        result.update(_sync_bytes(grid, total_steps))
    result["summary"] = format_summary(result)
    if rank == 0:
        for line in result["accuracy_log"]:
            print(f"{model_name}: adaptive accuracy: {line}", flush=True)
        if checks:
            c = checks[-1]
            how = ("training propagated exactly; MGRIT at its counts would give cosine "
                   f"{c['mgrit_cosine']:.4f}, relative error {c['mgrit_rel_error']:.3g}"
                   if c["exact"] else f"cosine {c['cosine']:.4f}, relative error "
                   f"{c['rel_error']:.3g}")
            print(f"{model_name}: last gradient check (batch {c['batch']}): {how}",
                  flush=True)
        print(result["summary"], flush=True)
    return result


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be an int >= 0, got {value!r}")
    return value


def _bar_note(loss: Optional[float], fwd_res: list, bwd_res: list, checks: list) -> str:
    """The progress bar's note: loss, the residuals reached, the last gradient check."""
    parts = [] if loss is None else [f"loss {loss:.3f}"]
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


def _sync_strategy(sync: str, total_batches: int) -> Any:
    """The grid's strategy for `train`: DASO with a tenth of the batches as warm-up and
    as cool-down (synchronous all-reduce), the others by name."""
    if sync != "daso":
        return sync
    edge = total_batches // 10
    return DASO(warmup=edge, cooldown=edge, total_batches=total_batches)


def _sync_bytes(grid: ProcessGrid, batches: int) -> dict[str, Any]:
    """Bytes sent per process per batch, averaged over the grid's processes
    (collective): ``sync_bytes`` (the data dimension) and ``bytes_by_kind``."""
    kinds = ("p2p", "data", "internode")
    sums = grid.world.allreduce_sum([float(grid.meter.get(k, 0)) for k in kinds])
    per = {k: v / grid.world_size / max(batches, 1) for k, v in zip(kinds, sums)}
    return {"sync_bytes": per["data"] + per["internode"], "bytes_by_kind": per}


def format_summary(result: dict[str, Any]) -> str:
    """The one-line summary of a `train` result, e.g.

    ``peaks: val_acc 0.873 | train_loss 0.321 | 12.3 ms/batch | fwd iters 2 (res 3.1e-02)
    | bwd iters 1 (res n/a) | ranks 4`` (one line; "serial" instead of the MGRIT part
    for the serial oracle).  `parse_summary` reads it back.
    """
    parts = [f"{result['model']}: val_acc {result['val_acc']:.3f}",
             f"train_loss {result['train_loss']:.3f}",
             f"{result['ms_per_batch']:.1f} ms/batch"]
    if result.get("sync_bytes") is not None and result.get("data_parallel", 1) > 1:
        parts.append(f"sync_bytes {result['sync_bytes']:.0f}")
    if result["serial"]:
        parts.append("serial")
    else:
        parts.append(f"fwd iters {result['fwd_iters']:g} (res {_fmt_res(result['fwd_res'])})")
        parts.append(f"bwd iters {result['bwd_iters']:g} (res {_fmt_res(result['bwd_res'])})")
    data = result.get("data_parallel", 1)
    parts.append(f"ranks {result['ranks']}" + (f" (data {data})" if data > 1 else ""))
    return " | ".join(parts)


_SUMMARY = re.compile(
    r"^(?P<model>\w+): val_acc (?P<val_acc>[\d.]+) \| train_loss (?P<train_loss>[\d.naif]+)"
    r" \| (?P<ms_per_batch>[\d.]+) ms/batch(?: \| sync_bytes (?P<sync_bytes>\d+))?"
    r" \| (?:(?P<serial>serial)|fwd iters "
    r"(?P<fwd_iters>[\d.]+) \(res (?P<fwd_res>\S+)\) \| bwd iters (?P<bwd_iters>[\d.]+) "
    r"\(res (?P<bwd_res>\S+)\)) \| ranks (?P<ranks>\d+)(?: \(data (?P<data>\d+)\))?$")


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
                    "sync_bytes": int(g["sync_bytes"]) if g["sync_bytes"] else None}
    raise ValueError(f"`text` holds no training summary line: {text[-500:]!r}")


# -- command-line options shared by the examples and `layerpar train` -----------------------

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training and MGRIT options (--levels, --cfactor, ... --float64) to ``parser``.

    Values are checked by `check_arguments`, not by argparse, so that a bad value is a
    ValueError naming its option.
    """
    g = parser.add_argument_group("MGRIT (forward and adjoint solves)")
    g.add_argument("--levels", type=int, default=3, help="MGRIT levels at most (1: exact)")
    g.add_argument("--cfactor", type=int, default=4, help="coarsening factor")
    g.add_argument("--fwd-iters", type=int, default=2, help="forward MGRIT iterations")
    g.add_argument("--bwd-iters", type=int, default=1, help="adjoint MGRIT iterations")
    g.add_argument("--tol", type=float, default=1e-9,
                   help="absolute residual tolerance (halts earlier if reached)")
    g.add_argument("--nrelax", type=int, default=1, help="relaxation sweeps (0: F, 1: FCF)")
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=None, help="epochs (default: per problem)")
    t.add_argument("--batch-size", type=int, default=None,
                   help="batch size (default: per problem)")
    t.add_argument("--lr", type=float, default=None,
                   help="peak Adam learning rate (default: per problem)")
    t.add_argument("--seed", type=int, default=0, help="data, initialisation and order")
    t.add_argument("--serial", action="store_true",
                   help="train the plain ODENet with autograd (the serial oracle)")
    t.add_argument("--float64", action="store_true", help="train in double precision")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = parser.add_argument_group("accuracy")
    a.add_argument("--check-every", type=int, default=0, metavar="K",
                   help="measure the gradient error against exact propagation every K "
                        "batches (0: never)")
    a.add_argument("--adaptive", action="store_true",
                   help="adaptive accuracy: MGRIT iterations follow the measured gradient "
                        "error (cosine >= 0.99, relative error <= 5%%), exact propagation "
                        "where MGRIT stalls")
    a.add_argument("--nested", type=int, default=0, metavar="K",
                   help="nested iteration: train K coarser nets (n/2^K ... n/2 layers) "
                        "first, refining each onto the next")
    a.add_argument("--nested-epochs", type=int, default=2, metavar="E",
                   help="epochs of each coarser net (default 2)")
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the option (e.g. ``--cfactor``) for a value out of range."""
    checks = [("--levels", args.levels, 1), ("--cfactor", args.cfactor, 2),
              ("--fwd-iters", args.fwd_iters, 1), ("--bwd-iters", args.bwd_iters, 1),
              ("--nrelax", args.nrelax, 0), ("--epochs", args.epochs, 1),
              ("--batch-size", args.batch_size, 1), ("--seed", args.seed, 0),
              ("--check-every", getattr(args, "check_every", 0), 0),
              ("--nested", getattr(args, "nested", 0), 0),
              ("--nested-epochs", getattr(args, "nested_epochs", 1), 1)]
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
                            ("--seed", args.seed, MAX_SEED)]:
        if value > hi:
            raise ValueError(f"`{flag}` must be <= {hi}, got {value}")
    if not (math.isfinite(args.tol) and args.tol >= 0):
        raise ValueError(f"`--tol` must be a finite number >= 0, got {args.tol}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"`--lr` must be a positive number, got {args.lr}")
    if args.serial and (getattr(args, "adaptive", False) or getattr(args, "check_every", 0)):
        raise ValueError("`--adaptive` and `--check-every` compare MGRIT with exact "
                         "propagation: not with `--serial`")


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
                         comm: Any = None) -> dict[str, Any]:
    """`train` with the options parsed by `add_arguments` (the examples and
    `layerpar train` share this).  With a communicator of several ranks, each rank's
    intra-op threads are set so the ranks on one node share its cores."""
    fwd, bwd = options_from_arguments(args)
    if comm is not None:
        torch.set_num_threads(threads_per_rank(comm))
    return train(model_name, serial=args.serial, epochs=args.epochs,
                 batch_size=args.batch_size, lr=args.lr, seed=args.seed, fwd=fwd, bwd=bwd,
                 comm=comm, progress=not args.no_progress, dtype=dtype_from_arguments(args),
                 data_parallel=getattr(args, "data_parallel", 1),
                 adaptive=args.adaptive, check_every=args.check_every, nested=args.nested,
                 nested_epochs=args.nested_epochs, sync=getattr(args, "sync", "allreduce"),
                 nodes=getattr(args, "nodes", None),
                 optimizer=getattr(args, "optimizer", None),
                 slow_link=getattr(args, "slow_link", None))
