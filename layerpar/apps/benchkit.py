"""What the benchmark commands share: their common options, their CSV, their nets and
their way of timing several models fairly.

Every benchmark module (`bench` and its subcommands `opcount`, `gpubench`, `gridbench`,
`pathbench`, `syncbench`, and `versusbench`) imports from here; this module imports
none of them, so the dispatcher (`bench.main`) can import its subcommands without a
circle.  Light to import: torch and the library are imported where a helper needs them.
"""
from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from ..ode.net import ODENet

__all__ = ["CSV_HELP", "check_shared_options", "dense_ode_net", "interleaved_train_times",
           "report", "write_dict_rows"]

CSV_HELP = ("also write the rows as CSV (this benchmark's earlier CSV there is replaced; "
            "any other file is refused)")


def check_shared_options(p: argparse.ArgumentParser, args: argparse.Namespace,
                         header: str) -> None:
    """The options every benchmark command line shares, checked before anything runs
    (one line naming the option, exit 2, as `p.error` does): ``--csv`` must be a file
    that can be written (`check_output_file`: not a folder, its folder present and
    writable; otherwise the whole measurement ran first and was lost in a traceback)
    and, where it exists, this benchmark's earlier CSV (its first line starts with
    `header`, the benchmark's first columns); ``--repeats``, where given, >= 1;
    ``--timeout`` a finite number of seconds > 0."""
    from .studies.files import StudyFileError, check_output_file

    if getattr(args, "csv", None) is not None:
        try:
            check_output_file(args.csv, "--csv", header=header)
        except StudyFileError as exc:
            p.error(str(exc))
    repeats = getattr(args, "repeats", None)
    if repeats is not None and repeats < 1:
        p.error(f"`--repeats` must be >= 1, got {repeats}")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        p.error(f"`--timeout` must be a finite number of seconds > 0, got {timeout}")


def write_dict_rows(path: str, rows: Sequence[dict[str, Any]],
                    fields: Optional[Sequence[str]] = None) -> None:
    """Rows of a benchmark (dicts with the same keys) as a CSV file; the columns are
    `fields`, or the first row's keys (no rows and no `fields`: an empty file)."""
    names = list(fields) if fields is not None else list(rows[0]) if rows else []
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names)
        if names:
            w.writeheader()
        w.writerows(rows)


def report(title: str, table: str, rows: Sequence[dict[str, Any]],
           csv_path: Optional[str]) -> int:
    """The end of a benchmark command: its title line and table on standard output,
    the rows as CSV where ``--csv`` asked for it; the command's exit status (0)."""
    print(title)
    print(table)
    if csv_path:
        write_dict_rows(csv_path, rows)
    return 0


def interleaved_train_times(models: Sequence[torch.nn.Module], x: torch.Tensor,
                            y: torch.Tensor, repeats: int,
                            warmup: int = 1) -> list[list[float]]:
    """Seconds per batch (`loop.train_step`) of each model on one rank, the models
    taking turns call by call after `warmup` untimed calls each, so that drifts of the
    machine (clock, cache, neighbours) hit all of them alike; ratios of these are what
    the benchmarks' comparisons are stated in."""
    from .loop import train_step

    for m in models:
        for _ in range(warmup):
            train_step(m, x, y)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for k, m in enumerate(models):
            times[k].append(train_step(m, x, y).seconds)
    return times


def dense_ode_net(width: int, layers: int, classes: int, *, inputs: Optional[int] = None,
                  t_final: float = 1.0) -> ODENet:
    """The benchmarks' dense ODE-net: Linear(inputs, width) -> `layers` tanh residual
    steps of `width` features on [0, t_final] -> Linear(width, classes); parameters
    from the global torch generator (`inputs` defaults to `width`)."""
    from torch import nn

    from ..ode import blocks
    from ..ode.net import ODENet

    return ODENet(open=nn.Linear(width if inputs is None else inputs, width),
                  steps=lambda k: blocks.Dense(width, activation="tanh"),
                  n_steps=layers, t_final=t_final, close=nn.Linear(width, classes))
