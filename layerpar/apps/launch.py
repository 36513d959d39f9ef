"""Finding `mpiexec`, building a job's command line, running an MPI job that dies with
its launcher, stopping it; and how busy the machine is (`load_average`).

Shared by the `layerpar` command line (which relaunches itself under mpiexec), the
scaling studies (one job per rank count), the benchmarks and the test suite (workers
under a timeout).  `job_command` is the one place an ``mpiexec`` or ``torchrun`` command
line is written.

`run_job` is how a launcher should start a job: the job gets a session of its own
(so `kill_job` can find all of it), SIGTERM, SIGINT and SIGHUP sent to the launcher
kill the job before the launcher reacts to them as it otherwise would, and on Linux
the job's mpiexec gets a parent-death signal, so even a SIGKILLed launcher takes its
job with it (mpiexec's proxy then stops the ranks).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

__all__ = ["LAUNCHERS", "ForeignLauncherError", "JobStatus", "job_command", "kill_job",
           "launcher_size", "load_average", "mpi_world", "mpiexec_path", "run_job",
           "run_worker_job", "world_comm"]

#: how a job's processes are started: MPI (mpi4py) or torch.distributed's elastic agent
LAUNCHERS = ("mpiexec", "torchrun")
# signals a launcher forwards to its job (as a kill) before handling them itself
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: what an MPI launcher puts in each rank's environment as the job's size: MPICH's and
#: Intel MPI's Hydra and Slurm (PMI), Open MPI, PMIx
MPI_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def mpiexec_path() -> Optional[str]:
    """The mpiexec beside sys.executable (a venv's `mpich` wheel), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def job_command(nprocs: int, python_args: Sequence[str], launcher: str = "mpiexec"
                ) -> list[str]:
    """The command line that runs ``python <python_args>`` (``-m MODULE ARGS...`` or
    ``SCRIPT ARGS...``, with this process's Python) on `nprocs` processes.

    ``mpiexec``: ``mpiexec -n N python -m mpi4py <python_args>`` (`mpiexec_path`;
    under mpi4py an exception on any rank aborts the whole job instead of hanging it);
    ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node N
    <python_args>`` (one node, a free port).  Raises FileNotFoundError, saying how to
    get one, when mpiexec is asked for and none is found."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nprocs), *python_args]
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise FileNotFoundError(
            f"no mpiexec found beside {sys.executable} or on PATH; install one with "
            f"`pip install \"layerpar[mpich]\"` (or use your cluster's MPI)")
    return [mpiexec, "-n", str(nprocs), sys.executable, "-m", "mpi4py", *python_args]


class ForeignLauncherError(RuntimeError):
    """The job's launcher and mpi4py's MPI library disagree on the job (`mpi_world`)."""


def launcher_size() -> Optional[int]:
    """The job's size as the MPI launcher that started this process wrote it into the
    environment (`MPI_SIZE_ENV`); None where none did."""
    for var in MPI_SIZE_ENV:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return None


def mpi_world() -> Any:
    """``MPI.COMM_WORLD``, once it is known to hold the whole job.

    An ``mpiexec`` of another MPI library than the one mpi4py loaded (Open MPI's on the
    PATH, mpi4py built with MPICH, say) starts N processes that each see a world of
    one: each would then train alone and report its figures as the job's.  Where the
    launcher's environment gives the job's size (`launcher_size`) and the world has
    another, this raises `ForeignLauncherError` naming both, on every rank alike."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    want, size = launcher_size(), world.Get_size()
    if want is not None and want != size:
        try:
            library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        except Exception:  # noqa: BLE001 - only for the message
            library = "unknown"
        raise ForeignLauncherError(
            f"this process was started as one of {want} by its launcher, but mpi4py's "
            f"MPI sees a world of {size}: the mpiexec that started the job belongs to "
            f"another MPI library than mpi4py's ({library}). Start the job with that "
            f"library's mpiexec (layerpar uses the one beside {sys.executable}, else "
            f"the one on PATH: {mpiexec_path()})")
    return world


def world_comm() -> Any:
    """``MPI.COMM_WORLD`` when this process is one of several mpiexec ranks, else None
    (one process, or no mpi4py); checked by `mpi_world`."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    world = mpi_world()
    return world if world.Get_size() > 1 else None


def load_average() -> tuple[float, float, float]:
    """The machine's 1-, 5- and 15-minute load averages (NaN where the platform has
    none): reported beside timings, since other processes on the machine disturb them."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):  # no getloadavg (Windows) or no value
        return (math.nan, math.nan, math.nan)
    return (one, five, fifteen)


def _descendants(root: int) -> list[int]:
    """Process ids below `root` in the process tree (read from Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_job(pid: int) -> None:
    """SIGKILL mpiexec `pid` (started with start_new_session=True), its process group and
    every process below it.

    The process group alone is not enough: MPICH's hydra starts its proxy and every
    rank in sessions of their own (they would die a moment later, once the proxy
    notices, but a busy-polling rank burns a core until then).
    """
    tree = _descendants(pid)
    targets: list[tuple[Any, int]] = [(os.killpg, pid)] + [(os.kill, p) for p in tree]
    for kill, target in targets:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _die_with_parent_hook() -> Optional[Callable[[], None]]:
    """A `preexec_fn` that makes the child receive SIGKILL when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), or None where that is not available.

    libc is loaded here, in the parent: between fork and exec the child only calls
    prctl and getppid.  If the parent died before prctl took effect, the child exits
    at once instead of running orphaned.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher is already gone
            os._exit(1)

    return hook


@dataclass
class JobStatus:
    """How a job started by `run_job` ended: its exit status (negative: killed by that
    signal), whether the timeout killed it, and the signal the launcher received that
    made it kill the job (None if none)."""

    returncode: Optional[int]
    timed_out: bool = False
    interrupted_by: Optional[int] = None


def run_job(cmd: Sequence[str], *, env: Optional[dict[str, str]] = None,
            timeout: Optional[float] = None,
            stdout: Union[None, int, IO[Any]] = None, stderr: Union[None, int, IO[Any]] = None,
            poll: Optional[Callable[[], None]] = None, poll_interval: float = 0.2) -> JobStatus:
    """Run `cmd` (an ``mpiexec ...`` line) so that it never outlives this process.

    The job runs in a session of its own.  It is killed with everything below it
    (`kill_job`) when `timeout` seconds pass, when `poll` or anything else raises here
    (e.g. KeyboardInterrupt), and when this process receives SIGTERM, SIGINT or SIGHUP:
    then, once the job is gone, the signal is delivered again to this process with its
    previous handling restored, so the launcher ends as it would have without a job
    (SIGTERM: killed by SIGTERM; SIGINT: KeyboardInterrupt).  Signal handlers can only
    be set from the main thread; elsewhere only the parent-death signal (Linux; it
    fires when the *thread* that started the job ends) and the exception path apply.
    `poll()` is called about every `poll_interval` seconds while the job runs.
    """
    received: list[int] = []
    proc: Optional[subprocess.Popen] = None

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if proc is not None and proc.returncode is None:  # never a reaped (reusable) pid
            kill_job(proc.pid)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED_SIGNALS:
            old = signal.getsignal(sig)
            if old is signal.SIG_IGN:  # e.g. SIGHUP under nohup: stays ignored
                continue
            signal.signal(sig, forward)
            previous[sig] = signal.SIG_DFL if old is None else old  # None: set outside Python
    status = JobStatus(None)
    try:
        proc = subprocess.Popen(list(cmd), env=env, stdout=stdout, stderr=stderr,
                                start_new_session=True, preexec_fn=_die_with_parent_hook())
        deadline = None if timeout is None else time.monotonic() + timeout
        while not received:
            try:
                status.returncode = proc.wait(timeout=poll_interval)
                break
            except subprocess.TimeoutExpired:
                pass
            if deadline is not None and time.monotonic() > deadline:
                kill_job(proc.pid)
                status.timed_out = True
                status.returncode = proc.wait()
                break
            if poll is not None:
                poll()
        if received:  # the handler killed the job (again here: it may have come first)
            if proc.returncode is None:
                kill_job(proc.pid)
            status.returncode = proc.wait()
            status.interrupted_by = received[0]
    except BaseException:
        if proc is not None and proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if status.interrupted_by is not None:
        # the job is gone: now react to the signal as this process would have
        os.kill(os.getpid(), status.interrupted_by)
        time.sleep(0.1)  # a Python-level handler (KeyboardInterrupt) runs here
    return status


def run_worker_job(module: str, nprocs: int, argv: Sequence[str], *, marker: str,
                   launcher: str = "mpiexec", timeout: Optional[float] = None
                   ) -> list[dict[str, Any]]:
    """Run ``python -m <module> <argv>`` on `nprocs` processes (mpiexec, with the
    worker under ``python -m mpi4py``, or torchrun) and return the JSON objects its
    processes printed on lines ``<marker> {...}``.  One thread per process (they share
    the cores); a failed or timed-out job raises RuntimeError with the tail of its
    output, stderr included (where the workers' errors are).  The benchmarks that
    launch their own jobs use this one runner."""
    import json
    import tempfile

    cmd = job_command(nprocs, ["-m", module, *argv], launcher)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIR_CVAR_CH4_PROGRESS_THROTTLE="1")
    with tempfile.TemporaryFile("w+") as out:
        status = run_job(cmd, env=env, timeout=timeout, stdout=out, stderr=subprocess.STDOUT)
        out.seek(0)
        text = out.read()
    if status.returncode != 0:
        raise RuntimeError(f"{launcher} job failed (status {status.returncode}"
                           f"{', timed out' if status.timed_out else ''}):\n{text[-3000:]}")
    return [json.loads(line.split(marker + " ", 1)[1]) for line in text.splitlines()
            if marker + " " in line]
