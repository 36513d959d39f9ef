"""A time-invariant neural ODE, u' = tanh(K u + b) with one K and b for all time,
trained layer-parallel with MGRIT.

The net is the Peaks classifier (`peaks.py`) with one residual block shared by all
its 32 steps: ``ODENet(open, lambda k: block, 32, 5.0, close)`` hands every step the
same module.  Each rank steps its own slice of the layers, so it holds its own copy
of the block; the gradient of the block is the sum of every layer's use, over the
ranks (the serial net's gradient), so the copies, stepped by the same optimizer,
stay equal.

Run it:

    python examples/03_time_invariant.py --serial       # the serial net, plain autograd
    python examples/03_time_invariant.py                # LayerParallel on one process
    mpiexec -n 4 python -m mpi4py examples/03_time_invariant.py --levels 3 --cfactor 4 \\
        --fwd-iters 2 --bwd-iters 1                     # 4 ranks, 8 layers each

(`python -m mpi4py` makes an error on one rank abort the job instead of hanging it.)
Same seed, same data order: the runs are directly comparable.  Rank 0 prints the
loss and validation accuracy per epoch, then the MGRIT iterations and residuals
reached (layer-parallel runs; where one reads n/a, a line says why) and how far apart
the ranks' copies of the shared block ended (0: they stayed equal).
"""

from __future__ import annotations

import argparse
import time

import torch
from mpi4py import MPI

from layerpar import LayerParallel, MGRITOptions
from layerpar.apps.data import peaks
from layerpar.ode import ODENet
from layerpar.ode.blocks import Dense


def make_net(width: int, layers: int, t_final: float) -> ODENet:
    """Linear(2, width) -> `layers` steps of ONE shared Dense(width) block on
    [0, t_final] -> Linear(width, 5)."""
    block = Dense(width)
    return ODENet(torch.nn.Linear(2, width), lambda k: block, layers, t_final,
                  torch.nn.Linear(width, 5))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32, help="residual steps (default 32)")
    p.add_argument("--width", type=int, default=8, help="state width (default 8)")
    p.add_argument("--t-final", type=float, default=5.0, help="final time T (default 5)")
    p.add_argument("--epochs", type=int, default=6, help="epochs (default 6)")
    p.add_argument("--batch", type=int, default=50, help="batch size (default 50)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    p.add_argument("--levels", type=int, default=2, help="max MGRIT levels (1: exact)")
    p.add_argument("--cfactor", type=int, default=4, help="coarsening factor (default 4)")
    p.add_argument("--fwd-iters", type=int, default=2, help="forward MGRIT iterations")
    p.add_argument("--bwd-iters", type=int, default=1, help="adjoint MGRIT iterations")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data")
    p.add_argument("--serial", action="store_true",
                   help="train the serial ODENet with plain autograd, for comparison")
    args = p.parse_args()
    for name in ("layers", "width", "epochs", "batch", "levels", "cfactor", "fwd_iters",
                 "bwd_iters"):
        if getattr(args, name) < 1:
            p.error(f"`--{name.replace('_', '-')}` must be at least 1, got "
                    f"{getattr(args, name)}")

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    x_train, y_train, x_val, y_val = peaks(n_train=1000, n_val=200, seed=args.seed)
    torch.manual_seed(args.seed)  # the same weights on every rank
    net = make_net(args.width, args.layers, args.t_final)
    if args.serial:
        model: torch.nn.Module = net
        where = "serial"
    else:
        fwd = MGRITOptions(max_levels=args.levels, cfactor=args.cfactor,
                           max_iter=args.fwd_iters, tol=0.0)
        bwd = fwd.replace(max_iter=args.bwd_iters)
        comm = world if world.Get_size() > 1 else None  # one process: no MPI traffic
        model = LayerParallel(net, comm, fwd, bwd)
        where = f"layer-parallel on {world.Get_size()} rank(s)"
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.functional.cross_entropy
    order = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(x_train), generator=order)
        total = 0.0
        for lo in range(0, len(perm), args.batch):
            idx = perm[lo:lo + args.batch]
            opt.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        model.eval()
        with torch.no_grad():
            acc = float((model(x_val).argmax(1) == y_val).double().mean())
        if rank == 0:
            print(f"{where}: epoch {epoch + 1}  train loss {total / len(perm):.4f}  "
                  f"validation accuracy {acc:.3f}", flush=True)
    elapsed = time.perf_counter() - t0
    if args.serial:
        if rank == 0:
            print(f"time {elapsed:.2f} s")
        return
    assert isinstance(model, LayerParallel)
    # every rank's copy of the shared block against the others'
    mine = {n: t.detach().clone() for n, t in model.state_dict().items()}
    apart = max((float((mine[n] - t).abs().max()) for part in world.allgather(mine)
                 for n, t in part.items() if n in mine), default=0.0)
    apart = world.allreduce(apart, op=MPI.MAX)
    if rank == 0:
        passes = (model.last_forward[0], model.last_backward[0])
        print(f"MGRIT, last pass: forward {passes[0].message}; adjoint {passes[1].message}")
        if any(not p.residual_history for p in passes):
            print("(residual n/a: with skip, a solve's first iteration does no fine-level "
                  "work, so a one-iteration solve measures no residual; nor does one "
                  "level's single sweep)")
        print(f"the ranks' copies of the shared block differ by at most {apart:.1e}; "
              f"time {elapsed:.2f} s")
    model.close()


if __name__ == "__main__":
    main()
