"""Train the Peaks classifier (Günther et al., SIMODS 2020) layer-parallel with MGRIT.

Points of [-3, 3]² are sorted into five classes by the height of the "peaks" surface;
the network is a ResNet read as an ODE: Linear(2, 8) → 32 residual layers
u ← u + h·tanh(K u + b) on [0, 5] → Linear(8, 5).

Run it:

    python examples/peaks.py --serial          # the serial oracle: plain autograd
    python examples/peaks.py                   # LayerParallel on one process (no MPI)
    mpiexec -n 4 python -m mpi4py examples/peaks.py --levels 3 --cfactor 4 \\
        --fwd-iters 2 --bwd-iters 1            # 4 ranks, 8 layers each, inexact MGRIT

(`python -m mpi4py` makes an error on one rank abort the job instead of hanging it.)
Same seed, same epochs: the serial and layer-parallel runs are directly comparable.
rank 0 prints the summary line (validation accuracy, time per batch, and the MGRIT
iterations and residual norms reached, so the inexactness of the solves stays
visible), and above it, where the line cannot say it, a note: training stopped by a
time budget, steps that ran exactly, a forward residual that reads n/a.  The adjoint's
``res n/a`` at its default single iteration has no note: with skip, a solve's first
iteration does no fine-level work, so a one-iteration solve measures no residual.
"""

from __future__ import annotations

import argparse

from mpi4py import MPI

from layerpar.apps.parsing import OneLineParser
from layerpar.apps.train import (
    add_arguments,
    check_arguments,
    check_problem,
    train_from_arguments,
)


def main(argv: list[str] | None = None) -> dict:
    parser = add_arguments(OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter),
        problems=("peaks",))
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    try:  # bad values name the option, before any layer is built
        check_arguments(args)
        check_problem(args, "peaks", 1 if args.serial else world.Get_size())
    except ValueError as exc:
        parser.error(str(exc))
    comm = world if world.Get_size() > 1 else None  # one process: no MPI traffic at all
    return train_from_arguments("peaks", args, comm)


if __name__ == "__main__":
    main()
