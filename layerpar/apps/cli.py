"""The ``layerpar`` command.

    layerpar train {peaks,digits,mnist1d} [--np N [--data-parallel R] [--launcher torchrun]]
                   [--sync allreduce|daso|lioncub [--nodes K] [--slow-link GBITS]]
                   [--levels L --cfactor C --fwd-iters F ... | --auto]
                   [--model dense|conv --layers N --width W --t-final T]
                   [--device cpu|cuda] [--target-acc A] [--time-budget S]
    layerpar info

``train`` runs `layerpar.apps.train.train`.  With ``--np N`` (N > 1) and not already inside
an MPI job, it launches itself on N ranks: ``mpiexec -n N python -m mpi4py -m
layerpar.cli train ...`` with the mpiexec installed beside the running Python (a venv
with ``layerpar[mpich]``), else the one on PATH, and exits with that job's status.
Running under ``python -m mpi4py`` makes an exception on any rank abort the whole job
instead of leaving the other ranks waiting.  ``--np 1`` and ``--serial`` run in this
process.  Started by mpiexec or srun directly (``mpiexec -n 4 layerpar train peaks``),
it trains on all ranks of that job and ignores ``--np``.  ``--launcher torchrun``
starts the N processes with torchrun instead (torch.distributed, gloo); a process
started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) trains over its process
group.  ``--data-parallel R`` makes the N processes R replicas of N/R layer ranks;
``--sync`` picks how the replicas stay in step (`layerpar.parallel.sync`).

``info`` prints the versions of layerpar and its dependencies, the MPI library, the
mpiexec that ``--np`` would use, and whether the native MGRIT engine imports.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from .. import __version__
from .._checks import fits_in_memory
from .launch import (
    LAUNCHERS,
    MPI_SIZE_ENV,
    ForeignLauncherError,
    job_command,
    launcher_size,
    mpi_world,
    mpiexec_path,
    run_job,
)
from .parsing import OneLineParser

# set on the ranks of a job that `layerpar train --np N` launched (so they do not
# launch again); mpiexec / srun themselves are recognised by the PMI variables below
LAUNCHED_ENV = "LAYERPAR_LAUNCHED"
_MPI_ENV = ("PMI_RANK", "PMIX_RANK", *MPI_SIZE_ENV)
_TORCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _reports_errors() -> bool:
    """Whether this process prints a bad command line's error: outside a job, or as
    its rank 0 (every rank of a job parses the same command line and fails alike, so
    one line says it, not one per rank)."""
    if not launched():
        return True
    names = ("RANK",) if under_torchrun() else ("PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                                "PMIX_RANK")
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value) == 0
    return True  # a job whose launcher names no rank: every rank says it


def _error(message: str) -> None:
    """A bad command line's one line on standard error (`_reports_errors`)."""
    if _reports_errors():
        print(f"layerpar: error: {message}", file=sys.stderr, flush=True)


class _Parser(OneLineParser):
    """The ``layerpar`` command's parser: its own errors (an unknown problem, a missing
    argument, a value of the wrong type) are one line like every checked value's,
    ``layerpar: error: ...`` and exit 2, printed by a job's rank 0 only."""

    command = "layerpar"
    hint = True

    def reports(self) -> bool:
        return _reports_errors()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``layerpar`` command (all subcommands).

    Built, and its help printed, without importing torch: the options, and the table
    of each problem's defaults under ``train --help``, come from
    `layerpar.apps.arguments`, the problems from `layerpar.apps.recipes`."""
    from .arguments import add_arguments
    from .recipes import PROBLEMS

    parser = _Parser(
        prog="layerpar", description="Layer-parallel training of ResNets with MGRIT.")
    parser.add_argument("--version", action="version", version=f"layerpar {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = sub.add_parser(
        "train", help="train a bundled problem (peaks, digits, mnist1d)",
        description="Train a bundled problem serially or layer-parallel and print one\n"
                    "summary line (accuracy, time per batch, MGRIT iterations and\n"
                    "residuals).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("model", choices=PROBLEMS, help="which problem")
    train.add_argument("--np", type=int, default=1, metavar="N",
                       help="number of processes to launch (default 1: this process)")
    train.add_argument("--data-parallel", type=int, default=1, metavar="R",
                       help="replicas (data parallelism): N processes form R replicas "
                            "of a layer-parallel model over N/R ranks each (default 1)")
    train.add_argument("--sync", choices=("allreduce", "daso", "lioncub"),
                       default="allreduce",
                       help="how replicas stay in step: gradient all-reduce every batch "
                            "(default), DASO (node-local averaging, parameters averaged "
                            "between nodes every 4/2/1 batches, non-blocking) or Lion "
                            "Cub (Lion with 2-bit updates -1/0/+1, majority vote)")
    train.add_argument("--nodes", type=int, default=None, metavar="K",
                       help="group the replicas in K simulated nodes (default: as the "
                            "launcher placed the processes)")
    train.add_argument("--optimizer", choices=("adam", "lion"), default=None,
                       help="adam (default) or lion (the default with --sync lioncub)")
    train.add_argument("--slow-link", type=float, default=None, metavar="GBITS",
                       help="model a link of GBITS Gbit/s (50 us latency) between nodes: "
                            "inter-node exchanges of the replicas are delayed accordingly")
    train.add_argument("--launcher", choices=LAUNCHERS, default="mpiexec",
                       help="how --np N starts the processes: mpiexec (MPI, the bundled "
                            "one) or torchrun (torch.distributed with gloo)")
    add_arguments(train)

    sub.add_parser("info", help="versions, MPI library, native engine",
                   description="Print versions, the MPI library and whether the native "
                               "MGRIT engine imports.")

    # scaling studies (strong/weak over ranks, levels, cfactor, depth; CSV, plots and
    # the performance model): layerpar/studies
    from .studies.cli import add_parser as add_scale_parser

    add_scale_parser(sub)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line; ValueError names the option of a bad value."""
    args = build_parser().parse_args(argv)
    if args.command == "train":
        from .config import TrainConfig
        from .train import check_engine_built

        if args.np < 1:
            raise ValueError(f"`--np` must be >= 1, got {args.np}")
        # every value's own range and every conflict between options (so a negative
        # `--layers` names `--layers`), then the net's size: the checks below divide it
        # among the ranks
        config = TrainConfig.from_args(args)
        check_net_size(args)
        # inside a job (mpiexec, srun, torchrun) its size decides; every process checks
        # it alike, before any message
        nprocs = job_size() if launched() else args.np
        config.check_processes(nprocs, f"the job's processes ({nprocs})" if launched()
                               else f"`--np` {nprocs}")
        ranks = 1 if args.serial else nprocs // args.data_parallel
        layers = config.layers
        per = args.np // args.data_parallel
        if per > layers and not args.serial and not launched():  # once, not on N ranks
            what = "`--np`" if args.data_parallel == 1 else \
                "`--np` / `--data-parallel` (ranks per replica)"
            raise ValueError(f"{what} must be <= {layers}, the number of residual layers "
                             f"of {args.model} (each rank needs at least one), got {per}")
        if config.engine_name == "xbraid" and not args.serial:
            _check_xbraid_run(args, layers, ranks, config.nested)
        if args.launcher != "mpiexec" and args.np == 1 and not launched():
            raise ValueError(f"`--launcher` {args.launcher} starts the processes of `--np` "
                             "N > 1: give `--np`")
        # what this installation lacks, last: a conflict between options is a usage
        # error, refused alike with and without the XBraid engine
        check_engine_built(config)
    return args


def _check_xbraid_run(args: argparse.Namespace, layers: int, ranks: int,
                      nested: int) -> None:
    """What `--engine xbraid` cannot run, refused before any process starts (the ranks'
    `LayerParallel` refused it too, but in a traceback on every rank)."""
    from ..mgrit.xbraid import layer_partition_refusal

    for flag, given in (("--adaptive", args.adaptive),
                        ("--data-parallel", args.data_parallel > 1),
                        ("--launcher torchrun", args.launcher == "torchrun"
                         or under_torchrun())):
        if given:
            raise ValueError(f"`--engine xbraid` with `{flag}`: XBraid runs fixed iteration "
                             "counts over one MPI communicator; give `--engine native`")
    for k in range(nested, -1, -1):
        why = layer_partition_refusal(layers // 2 ** k, ranks)
        if why is not None:
            raise ValueError(f"`--engine xbraid`: {why.replace('engine=', '`--engine` ')}")


def check_net_size(args: argparse.Namespace) -> None:
    """Refuse a net whose parameters, gradients and Adam's two moments alone would not
    fit in this machine's memory: one line naming the options, not minutes of building
    layers and then an allocator's traceback (values already in range:
    `check_arguments`)."""
    from .recipes import ARCHITECTURES, recipe_for

    if args.layers is None and getattr(args, "width", None) is None:
        return  # the problem's own size
    archs = ARCHITECTURES[args.model]  # (an architecture it lacks is named elsewhere)
    arch = args.arch if args.arch in archs else archs[0]
    recipe = recipe_for(args.model, arch)
    n, w = args.layers or recipe.n_layers, args.width or recipe.width
    # weights of a layer in units of w^2: 3x3 bounds a 3-tap conv; the resnet's widest
    # segment has 4w channels (3 taps); a pre-norm block has two w x w maps
    per_layer = w * w * {"conv": 9, "resnet": 48, "prenorm": 2}.get(arch, 1) + w
    need = n * (per_layer * (8 if args.float64 else 4) * 4 + 2048)  # + a module's own
    fits_in_memory(need, f"`--layers` {n} x `--width` {w}: the net",
                   "parameters, gradients and Adam's state")


def under_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) started this process."""
    return all(v in os.environ for v in _TORCH_ENV) and not any(v in os.environ
                                                                 for v in _MPI_ENV)


def under_mpi() -> bool:
    """True when this process is a rank of an MPI job (ours, or started by mpiexec/srun)."""
    if under_torchrun():
        return False
    return os.environ.get(LAUNCHED_ENV) == "1" or any(v in os.environ for v in _MPI_ENV)


def job_size() -> int:
    """The number of processes of the job this process belongs to, from its launcher's
    environment (1 outside a job; the size as MPI reports it where no variable says)."""
    if under_torchrun():
        try:
            return int(os.environ["WORLD_SIZE"])
        except ValueError:
            pass
    size = launcher_size()
    if size is not None:
        return size
    if under_mpi():
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_size()
    return 1


def launched() -> bool:
    """True inside a job of several processes (so `--np` must not launch again)."""
    return under_mpi() or under_torchrun()


def launch(nprocs: int, argv: Sequence[str], launcher: str = "mpiexec") -> int:
    """Run ``layerpar <argv>`` on ``nprocs`` processes under mpiexec (or torchrun);
    return its exit status.

    The job never outlives this launcher (`launch.run_job`): SIGTERM, SIGINT or SIGHUP
    here kill mpiexec and every rank first, and a SIGKILL here kills mpiexec through
    its parent-death signal, which takes the ranks with it.
    Raises FileNotFoundError when no mpiexec can be found.
    """
    env = dict(os.environ)
    env[LAUNCHED_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores
    if launcher == "torchrun":
        # torchrun's agent hosts the rendezvous store and stops every worker when one
        # fails; --standalone: one node, a free port
        # (--np and --launcher stay here: torchrun's own parser would take --np)
        argv = _without(argv, "--np", "--launcher")
    try:
        cmd = job_command(nprocs, ["-m", "layerpar.apps.cli", *argv], launcher)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}, or run with --np 1") from None
    code = run_job(cmd, env=env).returncode
    if code is None:  # run_job returns once the job has ended, with its status
        raise RuntimeError(f"the job `{' '.join(cmd)}` returned without an exit status")
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as shells do


def _without(argv: Sequence[str], *options: str) -> list[str]:
    """`argv` without the given options and their values (``--opt V`` or ``--opt=V``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(o + "=") for o in options):
            out.append(a)
    return out


def _train(args: argparse.Namespace) -> int:
    from .train import train_from_arguments

    comm: Any = None
    if under_torchrun():
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
        if dist.get_world_size() > 1:
            comm = dist.group.WORLD
    elif under_mpi():
        world = mpi_world()
        if world.Get_size() > 1:
            comm = world
            if world.Get_rank() == 0 and args.np not in (1, world.Get_size()):
                print(f"layerpar: running on the {world.Get_size()} ranks of this MPI job; "
                      f"--np {args.np} ignored", file=sys.stderr)
    train_from_arguments(args.model, args, comm)
    return 0


def info() -> str:
    """The text `layerpar info` prints: versions, MPI library, mpiexec, native engine."""
    import numpy
    import torch

    lines = [f"layerpar {__version__} ({Path(__file__).resolve().parents[1]})",
             f"python {platform.python_version()} ({sys.executable})",
             f"torch {torch.__version__} (CUDA {'available' if torch.cuda.is_available() else 'not available'})",  # noqa: E501
             f"numpy {numpy.__version__}"]
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # library queries only: do not start MPI
        from mpi4py import MPI

        name, version = MPI.get_vendor()
        library = MPI.Get_library_version().strip().splitlines()[0]
        lines.append(f"mpi4py {mpi4py.__version__}")
        lines.append(f"MPI {name} {'.'.join(map(str, version))} ({library.strip()})")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        lines.append(f"mpi4py/MPI: not usable ({type(exc).__name__}: {exc})")
    mpiexec = mpiexec_path()
    lines.append(f"mpiexec {mpiexec}" if mpiexec else
                 "mpiexec: not found (pip install \"layerpar[mpich]\")")
    try:
        from .._native import _core  # noqa: F401

        lines.append(f"native engine: ok ({Path(_core.__file__).name})")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        lines.append(f"native engine: does not import ({type(exc).__name__}: {exc})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``layerpar`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except ValueError as exc:
        _error(str(exc))
        return 2
    if args.command == "info":
        print(info())
        return 0
    if args.command == "train":
        if args.np > 1 and args.serial and not launched():
            print(f"layerpar: --serial trains the plain net in this one process; --np "
                  f"{args.np} ignored", file=sys.stderr, flush=True)
        if args.np > 1 and not args.serial and not launched():
            try:
                return launch(args.np, argv, args.launcher)
            except FileNotFoundError as exc:
                print(f"layerpar: error: {exc}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:  # the job was killed before this was raised
                print("layerpar: interrupted; the job was stopped", file=sys.stderr)
                return 130
        try:
            return _train(args)
        except ForeignLauncherError as exc:  # every rank alike: each is alone
            print(f"layerpar: error: {exc}", file=sys.stderr)
            return 1
    if args.command == "scale":
        from .studies.cli import run as run_scale

        return run_scale(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse restricts it


if __name__ == "__main__":
    sys.exit(main())
