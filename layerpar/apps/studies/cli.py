"""The ``scale`` subcommand: run a scaling study from the command line.

    layerpar scale --ranks 1,2,4 --layers 1024 --width 32 --batch 64 --levels 3 \\
        --cfactor 4 --fwd-iters 2 --bwd-iters 1 --threads 1 --out DIR
    python -m layerpar.studies --quick --out /tmp/study        # the same, stand-alone
    python -m layerpar.studies accuracy --out DIR      # gradient accuracy (studies/accuracy.py)
    python -m layerpar.studies predict-gpu --model conv ...   # GPU model (studies/gpumodel.py)

Every grid option takes a comma-separated list (``--levels 2,3 --cfactor 2,4``).
``--weak`` runs ``layers × ranks`` layers per run (weak scaling).  Results go to
``DIR/results.csv`` (resumable: rows already there are not run again), with
``model.json``, the ping-pong and the plots beside it.  ``--quick`` is a tiny study
(ranks 1,2; 64 layers, width 8, batch 16, 2 timed batches) for a smoke test; options
given explicitly still win.

A bad value, an ``--out`` that cannot be written and a damaged file to resume from
are one line on stderr and exit status 2, before anything is measured; Ctrl-C stops
the running job too and exits 130 (the finished runs stay in the CSV).

`add_parser(subparsers)` registers the subcommand on another parser (the ``layerpar``
command); `run(args)` runs it and returns the exit status.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from ...defaults import TRAINING
from ..parsing import OneLineParser

__all__ = ["add_arguments", "add_parser", "build_parser", "main", "run"]

_NORMAL = {"ranks": "1,2,4", "layers": "1024", "width": "32", "batch": "64",
           "levels": str(TRAINING.levels), "cfactor": str(TRAINING.cfactor),
           "fwd_iters": str(TRAINING.fwd_iters), "bwd_iters": str(TRAINING.bwd_iters),
           "threads": "1", "steps": 4,
           "warmup": 1, "diag_iters": 6, "model": "dense"}
_QUICK = {**_NORMAL, "ranks": "1,2", "layers": "64", "width": "8", "batch": "16",
          "steps": 2, "diag_iters": 4}
_LISTS = ("ranks", "layers", "width", "batch", "levels", "cfactor", "fwd_iters",
          "bwd_iters", "threads", "model")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The study options (defaults resolved in `run`, so --quick can change them)."""
    g = p.add_argument_group("grid (comma-separated lists)")
    g.add_argument("--ranks", help=f"MPI ranks (default {_NORMAL['ranks']})")
    g.add_argument("--layers", help="residual layers; with --weak, layers per rank "
                                    f"(default {_NORMAL['layers']})")
    g.add_argument("--width", help=f"features / channels (default {_NORMAL['width']})")
    g.add_argument("--batch", help=f"batch size (default {_NORMAL['batch']})")
    g.add_argument("--levels", help=f"MGRIT levels (default {_NORMAL['levels']})")
    g.add_argument("--cfactor", help=f"coarsening factor (default {_NORMAL['cfactor']})")
    g.add_argument("--fwd-iters", dest="fwd_iters",
                   help=f"forward MGRIT iterations (default {_NORMAL['fwd_iters']})")
    g.add_argument("--bwd-iters", dest="bwd_iters",
                   help=f"adjoint MGRIT iterations (default {_NORMAL['bwd_iters']})")
    g.add_argument("--threads", help=f"torch threads per rank (default {_NORMAL['threads']})")
    g.add_argument("--model", help="dense or conv (default dense)")
    p.add_argument("--weak", action="store_true", help="weak scaling: layers × ranks")
    p.add_argument("--max-cores", dest="max_cores", type=int,
                   help="skip runs with ranks × threads above this (scan the splits of a "
                        "machine: --ranks 1,2,4 --threads 1,2,4 --max-cores 4)")
    p.add_argument("--steps", type=int, help="timed batches per run (default 4)")
    p.add_argument("--warmup", type=int, help="untimed batches first (default 1)")
    p.add_argument("--diag-iters", dest="diag_iters", type=int,
                   help="iterations of the residual diagnostic solve (default 6, 0: none)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (0.05)")
    p.add_argument("--seed", type=int, default=0, help="parameter and data seed (0)")
    p.add_argument("--serial-threads", dest="serial_threads",
                   help="thread counts tried for the serial baseline (default 1..cores)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds allowed per run before the job is killed (900)")
    p.add_argument("--out", default="study", help="output folder (default ./study)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke-test study")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")
    p.set_defaults(_prog=p.prog)  # for one-line errors in `run`, as argparse words them
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``scale`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "scale", help="scaling study: time per batch vs ranks, CSV, model, plots",
        description="Run layer-parallel training over a grid of ranks and MGRIT settings, "
                    "compare with the best serial PyTorch baseline and a performance "
                    "model; write CSV and plots.")
    return add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    """Stand-alone parser of ``python -m layerpar.studies``."""
    return add_arguments(OneLineParser(
        prog="python -m layerpar.studies",
        description="Layer-parallel scaling study (the `layerpar scale` command).  "
                    "`python -m layerpar.studies accuracy --help`: the gradient-accuracy "
                    "study (inexact vs exact MGRIT gradients); `python -m layerpar.studies "
                    "predict-gpu --help`: the GPU performance model's prediction for a "
                    "net."))


def _split(name: str, text: str) -> list[Any]:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError(f"`--{name.replace('_', '-')}` needs at least one value")
    if name == "model":
        return items
    try:
        return [int(s) for s in items]
    except ValueError:
        raise ValueError(f"`--{name.replace('_', '-')}` takes comma-separated integers, "
                         f"got {text!r}") from None


def grid_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `run_study` grid the options describe."""
    base = _QUICK if getattr(args, "quick", False) else _NORMAL
    grid: dict[str, Any] = {}
    for k in _LISTS:
        v = getattr(args, k, None)
        grid[k] = _split(k, base[k] if v is None else v)
    for k in ("steps", "warmup", "diag_iters"):
        v = getattr(args, k, None)
        grid[k] = int(base[k] if v is None else v)
    grid["lr"] = float(args.lr)
    grid["seed"] = int(args.seed)
    grid["weak"] = bool(args.weak)
    if getattr(args, "max_cores", None) is not None:
        grid["max_cores"] = int(args.max_cores)
    return grid


FITTED_CONSTANTS = 3  # call, step and batch overheads (`perfmodel.fit`)


def _g(v: Any) -> str:
    if v is None:
        return "n/a"
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return "n/a" if math.isnan(f) else f"{f:.4g}"


def _error(args: argparse.Namespace, message: str) -> int:
    """Write one ``prog: error: message`` line to stderr (as argparse does); return 2."""
    sys.stderr.write(f"{getattr(args, '_prog', 'layerpar scale')}: error: {message}\n")
    return 2


def _structure(row: dict[str, Any]) -> str:
    """A run's MGRIT structure as "L<levels> cf<cfactor>", with the levels its layers
    give where those are fewer than asked (``--levels`` is a maximum)."""
    from ...mgrit.grid import build_levels
    from ...mgrit.options import MGRITOptions

    asked, cf = int(float(row["levels"])), int(float(row["cfactor"]))
    built = len(build_levels(int(float(row["layers"])),
                             MGRITOptions(max_levels=asked, cfactor=cf)))
    return f"L{built} cf{cf}" + ("" if built == asked else f" (asked {asked} levels)")


def run(args: argparse.Namespace) -> int:
    """Run the study the parsed options describe; print a summary; 0 if all runs ran.

    Bad options, an output folder that cannot be written and a damaged results file are
    reported as one line on stderr with exit status 2, before anything is measured.
    """
    from .runner import StudyFileError, check_output_dir, expand_grid, fastest_per_ranks, run_study

    out = Path(args.out)
    try:
        grid = grid_from_args(args)
        st = _split("serial_threads", args.serial_threads) if args.serial_threads else None
        if st is not None and min(st) < 1:
            raise ValueError(f"`--serial-threads` must be >= 1, got {args.serial_threads!r}")
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise ValueError(f"`--timeout` must be a finite number of seconds > 0, got "
                             f"{args.timeout}")
        expand_grid(grid, flags=True)  # every value, named as its option
        check_output_dir(out, "--out", ("results.csv", "model.json", "pingpong.json"))
    except ValueError as exc:  # StudyFileError is one
        return _error(args, str(exc))
    quick = bool(getattr(args, "quick", False))
    # --quick: the same 64..4096 ranks x 1024..16384 layers map, sampled coarsely
    map_grid = {"map_ranks": (64, 512, 4096), "map_layers": (1024, 4096, 16384)} \
        if quick else {}
    try:
        res = run_study(grid, out / "results.csv", out_dir=out,
                        timeout_per_run=float(args.timeout), progress=bool(args.progress),
                        plots=bool(args.plots), serial_threads=st, quick_pingpong=quick,
                        **map_grid)
    except StudyFileError as exc:  # a damaged file found on resume: left as it was
        return _error(args, str(exc))
    except KeyboardInterrupt:  # the running job was killed first (launch.run_job)
        sys.stderr.write(f"{getattr(args, '_prog', 'layerpar scale')}: interrupted; the "
                         f"runs finished so far are in {out / 'results.csv'}: the same "
                         f"command resumes the study\n")
        return 130
    cols = ("ranks", "threads", "layers", "levels", "cfactor", "fwd_iters", "bwd_iters",
            "seconds_per_batch", "predicted_seconds_per_batch", "model_role",
            "serial_seconds_per_batch", "serial_threads", "speedup", "efficiency",
            "loss_rel_diff")
    print(" ".join(f"{c:>10.10s}" for c in cols))
    for r in res.rows:
        print(" ".join(f"{_g(r.get(c)):>10.10s}" for c in cols))
    fastest = fastest_per_ranks(res.rows)
    if len(fastest) < len(res.rows):  # (a scan: several runs per rank count)
        print("fastest per rank count (seconds per batch; speed-up over the best serial):")
        for r in fastest:
            print(f"  {r.get('layers')} layers, {r.get('ranks')} rank(s): "
                  f"{_structure(r)} {r.get('fwd_iters')}/"
                  f"{r.get('bwd_iters')}, {r.get('threads')} thread(s): "
                  f"{_g(r.get('seconds_per_batch'))} s, {_g(r.get('speedup'))}x")
    s = res.summary
    if s:
        print(f"model: call overhead {s['call_overhead_s'] * 1e6:.1f} us, step overhead "
              f"{s['step_overhead_s'] * 1e6:.1f} us, batch overhead "
              f"{s['batch_overhead_s'] * 1e3:.2f} ms; fit rms rel. error "
              f"{_g(s['fit_rms_rel_error'])} on {s['fit_rows']} run(s); " + (
                  f"validation rms rel. error {_g(s['validate_rms_rel_error'])} on "
                  f"{s['validate_rows']} run(s)" if s["validate_rows"] else
                  "no validation (one depth: every run was used to fit; add a deeper "
                  "--layers value to test the model on runs it did not see)"))
        if s["fit_rows"] <= FITTED_CONSTANTS:
            print(f"model: {s['fit_rows']} run(s) fit {FITTED_CONSTANTS} constants: the fit "
                  "error says nothing about the model; run more settings")
    print(f"{res.launched} run(s) launched, {res.skipped} already in {res.csv_path}")
    for p in res.files:
        print(f"wrote {p}")
    for f in res.failed:
        sys.stderr.write(f"FAILED {f}\n")
    return 1 if res.failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m layerpar.studies [options]`` runs the scaling study;
    ``python -m layerpar.studies accuracy [options]`` the gradient-accuracy study
    (`layerpar.apps.studies.accuracy`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["accuracy"]:
        from .accuracy import main as accuracy_main

        return accuracy_main(argv[1:])
    if argv[:1] == ["predict-gpu"]:
        from .gpumodel import main as gpu_main

        return gpu_main(argv[1:])
    return run(build_parser().parse_args(argv))
