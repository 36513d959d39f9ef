"""The training options of ``layerpar train`` and the examples, and the table of each
problem's defaults that ``layerpar train --help`` prints.

This module imports only the standard library and torch-free parts of layerpar
(`layerpar.defaults`, `layerpar.apps.recipes`), so that ``layerpar --help`` and
``layerpar train --help`` print without loading torch.  The values are checked by
`layerpar.apps.config.TrainConfig.from_args`.
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

from ..defaults import (
    DEFAULT_TIMEOUT,
    MAX_REL_ERROR,
    MGRIT_NRELAX,
    MGRIT_TOL,
    MIN_COSINE,
    TRAINING,
)
from .recipes import ARCHITECTURES, PROBLEMS, recipe_groups

__all__ = ["AUTO_CHOOSES", "add_arguments", "problem_defaults"]

#: where an option's default depends on the problem (`problem_defaults` lists them)
_PER_PROBLEM = "per problem, listed below"


def problem_defaults(problems: tuple[str, ...] = PROBLEMS) -> str:
    """The defaults each problem trains with when no option overrides them (its
    recipes and architectures): the table under ``layerpar train --help``, one row per
    recipe (architectures that share one share its row, the default's row first)."""
    head = ("problem", "--model", "--epochs", "--batch-size", "--lr", "--layers", "--width",
            "--t-final")
    rows = [head]
    for name in problems:
        for archs, r in recipe_groups(name):
            rows.append((name, "|".join(archs), str(r.epochs), str(r.batch_size),
                         f"{r.lr:g}", str(r.n_layers), str(r.width), f"{r.t_final:g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    return ("defaults per problem and architecture (an option given overrides its column; "
            "--model: the first row's first)\n" + "\n".join("  " + line for line in lines))


#: every architecture of any problem (``--model``; `check_problem` refuses one the
#: problem lacks)
_ARCHS = tuple(dict.fromkeys(a for archs in ARCHITECTURES.values() for a in archs))


class _Given(argparse.Action):
    """Store the option's value and note that the command line gave it (``given``):
    `TrainConfig.from_args` refuses MGRIT settings that ``--auto`` would replace, even
    where their value is the default's."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), option_string}


#: ``--method``'s choices (`layerpar.parallel.choose.METHOD_NAMES`) and ``--schedule``'s
#: (`layerpar.parallel.baselines.SCHEDULES`), written here so that help imports no torch
METHOD_CHOICES = ("layerparallel", "data", "pipeline")
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zero-bubble", "zbv")

#: the options whose settings ``--auto`` chooses itself (refused beside it)
AUTO_CHOOSES = ("--levels", "--cfactor", "--fwd-iters", "--bwd-iters", "--tol", "--nrelax",
                "--engine")


def add_arguments(parser: argparse.ArgumentParser,
                  problems: tuple[str, ...] = PROBLEMS) -> argparse.ArgumentParser:
    """Add the training and MGRIT options (--levels, --cfactor, ... --float64) to ``parser``.

    Values are checked by `TrainConfig.from_args`, not by argparse, so that a bad value
    is a ValueError naming its option.  The options whose default depends on the problem
    say so; the parser's epilog, unless it has one, becomes the table of those defaults
    for `problems` (`problem_defaults`), printed as it is written.
    """
    if parser.epilog is None:
        parser.epilog = problem_defaults(problems)
        if parser.formatter_class is argparse.HelpFormatter:
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("MGRIT (forward and adjoint solves)")
    g.add_argument("--levels", action=_Given, type=int, default=TRAINING.levels,
                   help="MGRIT levels at most (1: exact; default %(default)s)")
    g.add_argument("--cfactor", action=_Given, type=int, default=TRAINING.cfactor,
                   help="coarsening factor (default %(default)s)")
    g.add_argument("--fwd-iters", action=_Given, type=int, default=TRAINING.fwd_iters,
                   help="forward MGRIT iterations (default %(default)s)")
    g.add_argument("--bwd-iters", action=_Given, type=int, default=TRAINING.bwd_iters,
                   help="adjoint MGRIT iterations (default %(default)s)")
    g.add_argument("--tol", action=_Given, type=float, default=MGRIT_TOL,
                   help="absolute residual tolerance (halts earlier if reached; default "
                        "%(default)g)")
    g.add_argument("--nrelax", action=_Given, type=int, default=MGRIT_NRELAX,
                   help="relaxation sweeps (0: F, 1: FCF; default %(default)s)")
    g.add_argument("--engine", action=_Given, default="native", metavar="{native,xbraid}",
                   help="MGRIT engine: layerpar's own (default) or XBraid itself (when "
                        "built with XBRAID_DIR)")
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=None, help=f"epochs (default: {_PER_PROBLEM})")
    t.add_argument("--batch-size", type=int, default=None,
                   help=f"batch size (default: {_PER_PROBLEM})")
    t.add_argument("--lr", type=float, default=None,
                   help=f"peak Adam learning rate (default: {_PER_PROBLEM})")
    t.add_argument("--seed", type=int, default=0,
                   help="data, initialisation and order (default %(default)s)")
    t.add_argument("--serial", action="store_true",
                   help="train the plain ODENet with autograd (the serial oracle)")
    t.add_argument("--compile", action="store_true",
                   help="with --serial: the net compiled by torch.compile (its "
                        "compilation counts in the training time)")
    t.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads per process (default: with --serial, the count "
                        "whose batch runs fastest here, measured at start unless "
                        "OMP_NUM_THREADS is set; layer-parallel: the node's cores shared "
                        "among its ranks)")
    t.add_argument("--float64", action="store_true", help="train in double precision")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds any one wait for another rank may take before the job "
                        f"stops with a message naming it (default {DEFAULT_TIMEOUT:g})")
    a = parser.add_argument_group("accuracy")
    a.add_argument("--check-every", type=int, default=0, metavar="K",
                   help="measure the gradient error against exact propagation every K "
                        "batches (0: never)")
    a.add_argument("--adaptive", action="store_true",
                   help="adaptive accuracy: MGRIT iterations follow the measured gradient "
                        f"error (cosine >= {MIN_COSINE:g}, relative error <= "
                        f"{100 * MAX_REL_ERROR:g}%%), exact propagation "
                        "where MGRIT stalls")
    a.add_argument("--nested", type=int, default=0, metavar="K",
                   help="nested iteration: train K coarser nets (n/2^K ... n/2 layers) "
                        "first, refining each onto the next")
    a.add_argument("--nested-epochs", type=int, default=None, metavar="E",
                   help="epochs of each coarser net (default 2)")
    a.add_argument("--auto", action="store_true",
                   help="MGRIT settings chosen by measurement on the first batch (time "
                        "and gradient error of a few candidates; the fastest within the "
                        "bound, exact/serial where nothing parallel pays), then watched "
                        "by the adaptive policy")
    a.add_argument("--method", default=None, choices=METHOD_CHOICES,
                   help="how the ranks share the work: layerparallel (MGRIT, the "
                        "default), data (the batch split, gradients averaged) or pipeline "
                        "(torch.distributed.pipelining); with --auto on several ranks the "
                        "three are timed on the first batch and the fastest trains, or "
                        "only the one named here")
    a.add_argument("--schedule", default=None, choices=SCHEDULE_CHOICES,
                   help="pipeline schedule (default: the fastest of gpipe and 1f1b, "
                        "measured)")
    a.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="pipeline micro-batches per batch (default: the fastest of 1, 2, "
                        "4, 8, measured)")
    a.add_argument("--max-grad-error", type=float, default=None, metavar="E",
                   help="the bound of --adaptive and --auto: largest relative gradient "
                        f"error (default {MAX_REL_ERROR:g}; --auto by default measures its "
                        "bound: half the batch gradient's sampling error)")
    a.add_argument("--min-cosine", type=float, default=None, metavar="C",
                   help="the bound of --adaptive and --auto: smallest cosine between "
                        f"inexact and exact gradients (default {MIN_COSINE:g}; --auto's "
                        "measured bound implies its own: sqrt(1 - error^2))")
    n = parser.add_argument_group("network, device and stopping")
    n.add_argument("--model", dest="arch", default=None, choices=_ARCHS,
                   help=f"architecture (mnist1d: {', '.join(ARCHITECTURES['mnist1d'])}; "
                        f"each with its own recipe where the table below lists one; "
                        f"default: {_PER_PROBLEM})")
    n.add_argument("--layers", type=int, default=None, metavar="N",
                   help=f"residual layers (default: {_PER_PROBLEM})")
    n.add_argument("--width", type=int, default=None, metavar="W",
                   help=f"width: features (dense, prenorm) or channels (conv; resnet: of "
                        f"its first segment) (default: {_PER_PROBLEM})")
    n.add_argument("--t-final", type=float, default=None, metavar="T",
                   help=f"final time of the ODE (of each segment; step size = T / "
                        f"layers per segment; default: {_PER_PROBLEM})")
    n.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    n.add_argument("--target-acc", type=float, default=None, metavar="A",
                   help="stop once the validation accuracy reaches A (in (0, 1]); the "
                        "summary then gives time_to_target")
    n.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="stop training after S seconds (evaluation not counted)")
    return parser
