"""Tensor operations per training batch: the proxy for GPU time that any CPU can measure.

    python -m layerpar.bench ops [--quick] [--csv PATH]

On a GPU a deep, narrow layer costs a few microseconds of launch and dispatch per
operation, more than its arithmetic, so the number of operations a training batch
issues is what its time is made of.  This counts top-level aten operations (those
not called from inside another aten operation) with the torch profiler, for one
training batch: zero_grad, forward, loss, backward and an SGD step (foreach, as on
a GPU).  Plain serial PyTorch (`nn.Sequential` of u + h F(u)) is the baseline.

The configurations are the issue's: (a) a dense ODE-net of 1,024 layers, width 64,
batch 256; (b) a conv ODE-net of 256 layers, 16 channels, 32x32 images, batch 64.
MGRIT: cfactor 4, levels down to a coarsest grid of at most 16 intervals, FCF,
2 forward / 1 backward iterations, fixed iteration counts (tol 0).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..defaults import TRAINING
from .benchkit import CSV_HELP, check_shared_options, write_dict_rows
from .parsing import OneLineParser

__all__ = ["CONFIGS", "OpsRow", "count_ops", "levels_for", "main", "mgrit_options",
           "ops_rows", "train_step"]


@contextlib.contextmanager
def _without_profiler_trace() -> Iterator[None]:
    """Standard error without the profiler's own trace lines: some torch builds
    (2.13.0+cpu here) print ``USDT:... profiler_start`` and ``profiler_stop`` from C++
    at every profile, two lines per counted model that drowned the table.  The
    process's stderr goes to a temporary file meanwhile; every other line written
    there (a warning, an error) is written back to stderr afterwards, in order."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


def count_ops(fn: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """(number of top-level aten operations in one call of fn, count per name); fn is
    called once before, untimed, so lazy set-up is not counted."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with _without_profiler_trace(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names: dict[str, int] = {}
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        if p is None:
            names[e.name] = names.get(e.name, 0) + 1
    return sum(names.values()), names


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One training batch (`layerpar.apps.loop.train_step`: zero_grad, forward,
    cross-entropy, backward, step) as a closure, to count or to capture.  The closure
    returns the loss (detached)."""
    from .loop import train_step as one_step

    def step() -> torch.Tensor:
        return one_step(model, x, y, opt).loss

    return step


def levels_for(n_steps: int, cfactor: int, coarsest: int = 16) -> int:
    """Number of levels that coarsens n_steps by cfactor until at most `coarsest`
    intervals are left."""
    levels, n = 1, n_steps
    while n > coarsest and n // cfactor >= 2:
        n //= cfactor
        levels += 1
    return levels


def mgrit_options(n_steps: int, cfactor: int = TRAINING.cfactor,
                  fwd_iters: int = TRAINING.fwd_iters,
                  bwd_iters: int = TRAINING.bwd_iters) -> tuple[Any, Any]:
    """(forward, backward) MGRITOptions of the counted configuration."""
    from ..mgrit import MGRITOptions

    lv = levels_for(n_steps, cfactor)
    return (MGRITOptions(max_levels=lv, cfactor=cfactor, max_iter=fwd_iters, tol=0.0),
            MGRITOptions(max_levels=lv, cfactor=cfactor, max_iter=bwd_iters, tol=0.0))


def dense_model(n_steps: int = 1024, width: int = 64, batch: int = 256,
                device: str = "cpu") -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(a): dense ODE-net, tanh, T = 4 (h = 4 / n_steps: the coarsest MGRIT step stays
    at most 0.25, where 2/1 iterations train like serial); data on `device`."""
    from ..ode import ODENet
    from ..ode.blocks import Dense

    net = ODENet(open=nn.Linear(width, width), steps=lambda k: Dense(width), n_steps=n_steps,
                 t_final=4.0, close=nn.Linear(width, 10))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    return net, x, y


def conv_model(n_steps: int = 256, channels: int = 16, batch: int = 64, size: int = 32,
               device: str = "cpu") -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(b): conv ODE-net (3x3, ReLU), T = 4, on size x size RGB images."""
    from ..ode import ODENet, Segment
    from ..ode.blocks import Conv

    net = ODENet(layers=[nn.Conv2d(3, channels, 3, padding=1),
                         Segment(lambda k: Conv(channels), n_steps, 4.0),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    return net, x, y


def transformer_model(n_steps: int = 256, d_model: int = 128, heads: int = 4,
                      seq: int = 64, batch: int = 16, device: str = "cpu"
                      ) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(d): pre-norm transformer ODE-net (`blocks.Transformer`), T = 4, on batch x seq
    x d_model inputs, classified from the flattened last state."""
    from ..ode import ODENet, Segment
    from ..ode.blocks import Transformer

    net = ODENet(layers=[nn.Linear(d_model, d_model),
                         Segment(lambda k: Transformer(d_model, heads), n_steps, 4.0),
                         nn.Flatten(), nn.Linear(seq * d_model, 10)])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, d_model, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    return net, x, y


#: the counted configurations by name: (builder, its arguments); not the studies'
#: synthetic models of the same names (`layerpar.apps.nets.SYNTHETIC_MODELS`).  dense, conv,
#: conv16 and transformer are the GPU issue's rows (a) to (d) (`layerpar.apps.gpubench`).
CONFIGS: dict[str, tuple[Callable[..., Any], dict[str, int]]] = {
    "dense": (dense_model, {"n_steps": 1024, "width": 64, "batch": 256}),
    "conv": (conv_model, {"n_steps": 256, "channels": 16, "batch": 64, "size": 32}),
    "conv16": (conv_model, {"n_steps": 1024, "channels": 16, "batch": 16, "size": 16}),
    "transformer": (transformer_model, {"n_steps": 256, "d_model": 128, "heads": 4,
                                        "seq": 64, "batch": 16}),
}
QUICK = {"dense": {"n_steps": 64, "width": 8, "batch": 4},
         "conv": {"n_steps": 64, "channels": 4, "batch": 2, "size": 8},
         "conv16": {"n_steps": 64, "channels": 4, "batch": 2, "size": 4},
         "transformer": {"n_steps": 16, "d_model": 8, "heads": 2, "seq": 3, "batch": 2}}
TARGETS = {"dense": 10.0, "conv": 4.0}  # serial ops / MGRIT ops, at least


@dataclass
class OpsRow:
    model: str
    layers: int
    serial_ops: int
    mgrit_ops: int
    levels: int

    @property
    def ratio(self) -> float:
        return self.serial_ops / self.mgrit_ops


def ops_rows(quick: bool = False, models: tuple[str, ...] = ("dense", "conv"),
             batched: bool = True, device: str = "cpu") -> list[OpsRow]:
    """Count serial and LayerParallel (1 rank) operations per training batch."""
    import copy

    from ..parallel import LayerParallel
    from .nets import sequential_twin

    rows = []
    for name in models:
        make, kw = CONFIGS[name]
        kw = QUICK[name] if quick else kw
        torch.manual_seed(0)
        net, x, y = make(**kw, device=device)
        net = net.to(device)
        plain = sequential_twin(copy.deepcopy(net))
        serial, _ = count_ops(train_step(plain, torch.optim.SGD(plain.parameters(), lr=1e-3,
                                                                 foreach=True), x, y))
        fwd, bwd = mgrit_options(kw["n_steps"])
        lp = LayerParallel(copy.deepcopy(net), None, fwd, bwd, batched=batched)
        mgrit, _ = count_ops(train_step(lp, torch.optim.SGD(lp.parameters(), lr=1e-3,
                                                             foreach=True), x, y))
        rows.append(OpsRow(name, kw["n_steps"], serial, mgrit, fwd.max_levels))
    return rows


def format_ops(rows: list[OpsRow], quick: bool = False) -> str:
    """The rows as a table; a model's target ratio only where the model has its full
    size (`quick` shrinks the nets, whose ratios then say nothing about the targets)."""
    lines = ["model  layers  levels  serial ops  MGRIT ops  serial/MGRIT  target",
             "-----  ------  ------  ----------  ---------  ------------  ------"]
    for r in rows:
        lines.append(f"{r.model:<5s}  {r.layers:6d}  {r.levels:6d}  {r.serial_ops:10d}  "
                     f"{r.mgrit_ops:9d}  {r.ratio:11.1f}x  "
                     + (f">= {TARGETS[r.model]:g}x" if r.model in TARGETS and not quick
                        else "-"))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Command line of ``python -m layerpar.bench ops``: the table, optionally the CSV."""
    argv = sys.argv[1:] if argv is None else argv
    p = OneLineParser(prog="python -m layerpar.bench ops",
                      description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small models (seconds)")
    p.add_argument("--unbatched", action="store_true",
                   help="LayerParallel(batched=False): the per-step path, for comparison")
    p.add_argument("--csv", metavar="PATH", help=CSV_HELP)
    args = p.parse_args(argv)
    check_shared_options(p, args, "model,layers,levels")
    torch.set_num_threads(1)
    rows = ops_rows(quick=args.quick, batched=not args.unbatched)
    print(f"layerpar.bench ops: top-level aten ops per training batch (zero_grad, forward, "
          f"backward, SGD step), torch {torch.__version__}, 1 rank")
    print(format_ops(rows, quick=args.quick))
    if args.csv:
        write_dict_rows(args.csv, [
            {"model": r.model, "layers": r.layers, "levels": r.levels,
             "serial_ops": r.serial_ops, "mgrit_ops": r.mgrit_ops, "ratio": f"{r.ratio:.2f}"}
            for r in rows])
    return 0
