"""Train a small convolutional ODE-net on scikit-learn's 8×8 digits with MGRIT.

The images (bundled with scikit-learn, no download) go through Conv2d(1, 8, 3) →
8 residual layers u ← u + h·relu(conv3x3(u)) on [0, 2] → 2×2 average pooling →
Linear(128, 10); about 97% validation accuracy after 8 epochs.

Run it:

    python examples/digits.py --serial         # the serial oracle: plain autograd
    python examples/digits.py                  # LayerParallel on one process (no MPI)
    mpiexec -n 2 python -m mpi4py examples/digits.py --levels 2 --cfactor 4 \\
        --fwd-iters 2 --bwd-iters 1            # 2 ranks, 4 layers each, inexact MGRIT

(`python -m mpi4py` makes an error on one rank abort the job instead of hanging it.)
rank 0 prints the summary line (validation accuracy, time per batch, and the MGRIT
iterations and residual norms reached), and above it, where the line cannot say it, a
note: training stopped by a time budget, steps that ran exactly, a forward residual
that reads n/a.  The adjoint's ``res n/a`` at its default single iteration has no
note: with skip, a solve's first iteration does no fine-level work, so a
one-iteration solve measures no residual.  Needs scikit-learn
(`pip install "layerpar[examples]"`).
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
        problems=("digits",))
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    try:  # bad values name the option, before any layer is built
        check_arguments(args)
        check_problem(args, "digits", 1 if args.serial else world.Get_size())
    except ValueError as exc:
        parser.error(str(exc))
    comm = world if world.Get_size() > 1 else None  # one process: no MPI traffic at all
    return train_from_arguments("digits", args, comm)


if __name__ == "__main__":
    main()
