"""Per-batch time of every way to train a deep dense ODE-net on P ranks, by width.

    MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 mpiexec -n 2 python -m mpi4py \
        -m layerpar.apps.versusbench [--layers 256] [--widths 32,128] [--batch 128] \
        [--steps 5] [--csv PATH]

Where the line between layer-parallel and pipeline (or data) parallelism falls: a
narrow layer leaves a core idle, and MGRIT stacks layers into larger operations; a
wide one fills the core, and splitting the batch or the pipeline adds no work per
layer.  One table per width (and one CSV row per width and method).

(MPICH's waits poll busily; the throttle leaves the core to the ranks that work while
the others wait, e.g. for the serial row, which runs one thread.  The solo row is
serial with every core: rank 0 at as many torch threads as it has cores, the others
waiting patiently, `SoloMethod`.)

One job: the same net (rank 0's initial weights everywhere) trained by each method of
`layerpar.parallel.baselines` for a warm-up step and `--steps` timed steps (a
`train_step` and an SGD step each): serial (on rank 0 while the others wait, one
thread), solo (rank 0 with every core), data
parallelism (layerpar's all-reduce over MPI; DistributedDataParallel over the gloo
group made from the communicator), pipelines (GPipe, 1F1B with 2 and 4
micro-batches) and LayerParallel with MGRIT (3 levels, cfactor 8, one forward and one
adjoint iteration).  A row: the median over the steps of the slowest rank's time.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from ..mgrit.options import MGRITOptions
from ..ode.net import ODENet
from ..parallel.baselines import (
    DataParallelNet,
    LayerParallelMethod,
    PipelineNet,
    SerialMethod,
    SoloMethod,
    TrainingMethod,
    process_group_from_mpi,
)
from .benchkit import dense_ode_net


def _net(layers: int, width: int, state: Any = None) -> ODENet:
    """The compared net (`dense_ode_net`, 10 classes): seeded, or loaded from `state`."""
    torch.manual_seed(0)
    net = dense_ode_net(width, layers, 10)
    if state is not None:
        net.load_state_dict(state)
    return net


def _time(method: TrainingMethod, x: torch.Tensor, y: torch.Tensor, steps: int,
          comm: Any) -> float:
    loss_fn = nn.functional.cross_entropy
    opt = torch.optim.SGD(method.parameters(), lr=1e-3)
    method.train_step(x, y, loss_fn)
    opt.step()
    times = []
    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        method.train_step(x, y, loss_fn)
        opt.step()
        times.append(time.perf_counter() - t0)
    worst = [max(ts) for ts in zip(*comm.allgather(times))]
    return statistics.median(worst)


def main(argv: Any = None) -> None:
    from mpi4py import MPI

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=256)
    p.add_argument("--widths", default="32", help="comma-separated widths (default 32)")
    p.add_argument("--csv", default=None, help="write the rows here (rank 0)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    group = process_group_from_mpi(comm)
    table = []
    for width in widths:
        for name, t, base in _rows(comm, group, args.layers, width, args.batch, args.steps):
            table.append((width, name, t, base))
    if comm.rank == 0 and args.csv:
        import csv

        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["ranks", "layers", "width", "batch", "method", "ms_per_batch",
                        "speedup_vs_serial"])
            for width, name, t, base in table:
                w.writerow([comm.size, args.layers, width, args.batch, name,
                            f"{1e3 * t:.2f}", f"{base / t:.2f}"])


def _rows(comm: Any, group: Any, layers: int, width: int, batch: int, steps: int
          ) -> list[tuple[str, float, float]]:
    """Every method on the net of this width: (name, seconds per batch, serial's)."""
    from mpi4py import MPI

    # (clones: the state dict's tensors view the segment's whole per-name storage,
    # which mpi4py's pickling would send once per layer)
    state = comm.bcast({k: v.clone() for k, v in _net(layers, width).state_dict().items()},
                       root=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def make() -> ODENet:
        return _net(layers, width, state)

    mgrit = MGRITOptions(max_levels=3, cfactor=8, max_iter=1)
    methods: dict[str, Callable[[], TrainingMethod]] = {
        # the best serial inside the job: rank 0 with every core, the others waiting
        "solo (rank 0, every core)": lambda: SoloMethod(make(), comm),
        "data (allreduce, MPI)": lambda: DataParallelNet(make(), comm, engine="allreduce"),
        "data (DDP, gloo)": lambda: DataParallelNet(make(), group, engine="ddp"),
        "pipeline gpipe m=2": lambda: PipelineNet(make(), group, schedule="gpipe",
                                                  microbatches=2),
        "pipeline gpipe m=4": lambda: PipelineNet(make(), group, schedule="gpipe",
                                                  microbatches=4),
        "pipeline 1f1b m=2": lambda: PipelineNet(make(), group, schedule="1f1b",
                                                 microbatches=2),
        "pipeline 1f1b m=4": lambda: PipelineNet(make(), group, schedule="1f1b",
                                                 microbatches=4),
        "layerparallel MGRIT (3 lv, cf 8, 1/1 it)": lambda: LayerParallelMethod(
            make(), comm, mgrit, mgrit),
    }
    rows = []
    if comm.rank == 0:
        rows.append(("serial (rank 0 alone)", _time(SerialMethod(make()), x, y, steps,
                                                    MPI.COMM_SELF)))
    comm.Barrier()
    for name, build in methods.items():
        method = build()
        rows.append((name, _time(method, x, y, steps, comm)))
        method.close()
    base = comm.bcast(rows[0][1] if comm.rank == 0 else None, root=0)
    if comm.rank == 0:
        print(f"{comm.size} ranks, dense ODE-net {layers} layers x width {width}, "
              f"batch {batch}, float32, median of {steps} steps (slowest rank)", flush=True)
        for name, t in rows:
            print(f"  {name:42s} {t * 1e3:8.1f} ms  x{base / t:5.2f} vs serial", flush=True)
    return [(name, t, base) for name, t in rows] if comm.rank == 0 else []


if __name__ == "__main__":
    main()
