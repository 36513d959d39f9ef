"""Per-batch time of every way to train one deep narrow dense ODE-net on P ranks.

    MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 mpiexec -n 2 python -m mpi4py \
        -m layerpar.apps.versusbench [--layers 256] [--width 32] [--batch 128] [--steps 5]

(MPICH's waits poll busily; the throttle leaves the core to the ranks that work while
the others wait, e.g. for the serial row.)

One job: the same net (rank 0's initial weights everywhere) trained by each method of
`layerpar.parallel.baselines` for a warm-up step and `--steps` timed steps (a
`train_step` and an SGD step each): serial (on rank 0 while the others wait), data
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
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    state = comm.bcast(_net(args.layers, args.width).state_dict(), root=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    group = process_group_from_mpi(comm)

    def make() -> ODENet:
        return _net(args.layers, args.width, state)

    mgrit = MGRITOptions(max_levels=3, cfactor=8, max_iter=1)
    methods: dict[str, Callable[[], TrainingMethod]] = {
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
        solo = MPI.COMM_SELF
        rows.append(("serial (rank 0 alone)", _time(SerialMethod(make()), x, y,
                                                    args.steps, solo)))
    comm.Barrier()
    for name, build in methods.items():
        method = build()
        rows.append((name, _time(method, x, y, args.steps, comm)))
        method.close()
    if comm.rank == 0:
        print(f"{comm.size} ranks, dense ODE-net {args.layers} layers x width {args.width}, "
              f"batch {args.batch}, float32, median of {args.steps} steps (slowest rank)")
        base = rows[0][1]
        for name, t in rows:
            print(f"  {name:42s} {t * 1e3:8.1f} ms  x{base / t:5.2f} vs serial")


if __name__ == "__main__":
    main()
