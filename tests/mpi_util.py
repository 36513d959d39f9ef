"""Launching MPI worker scripts from pytest, with a hard timeout.

`run_mpi(script, nprocs, *args)` starts ``mpiexec -n nprocs python -m mpi4py script
args...`` with the mpiexec installed beside the running Python (else the one on PATH;
the test is skipped when there is none).  The job runs in its own session; on a timeout
mpiexec, its process group and every process below it (hydra puts the ranks in sessions
of their own) are killed and the test fails with the output captured so far: a hanging
job never hangs the test suite.

Worker scripts report per rank with lines ``RANK <r> <text>``; `rank_lines` collects
them.  Running workers under ``python -m mpi4py`` makes an uncaught exception on any
rank abort the whole job instead of leaving the others waiting.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Union

import pytest

from layerpar.apps.launch import _descendants, job_command, kill_job, mpiexec_path

WORKERS = Path(__file__).resolve().parent / "workers"


def mpi_available() -> bool:
    """True when mpi4py imports and an mpiexec can be found."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return mpiexec_path() is not None


def run_mpi(script: Union[Path, str], nprocs: int, *args: object,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `script` on `nprocs` ranks and return the finished process (stdout, stderr).

    Skips the calling test when MPI is not available; fails it (with the output so far)
    when the job exceeds `timeout` seconds, after killing the whole job (`kill_job`).
    A nonzero exit status is returned, not raised: check `returncode` yourself.
    """
    if not mpi_available():
        pytest.skip("no MPI (mpi4py and mpiexec) available")
    cmd = job_command(nprocs, [str(script), *map(str, args)])
    env = dict(os.environ)
    # tests usually run more ranks than cores: one thread per rank, and MPICH's busy
    # polling backs off (usleep) when idle, leaving the cores to the ranks doing work
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    return _communicate(cmd, env, timeout, "MPI job")


def run_torchrun(script: Union[Path, str], nprocs: int, *args: object,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `script` on `nprocs` processes under torchrun (torch.distributed, env://)."""
    cmd = job_command(nprocs, [str(script), *map(str, args)], "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return _communicate(cmd, env, timeout, "torchrun job")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(script: Union[Path, str], nprocs: int, *args: object,
                timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `script` as `nprocs` plain processes that rendezvous through env:// (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without a launcher that would stop the
    others when one dies: what layerpar itself does about a lost process shows."""
    port = str(free_port())
    driver = (
        "import os, subprocess, sys\n"
        f"n = {nprocs}\n"
        "procs = [subprocess.Popen(sys.argv[1:], env=dict(os.environ, RANK=str(r), "
        "LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR='127.0.0.1', "
        f"MASTER_PORT='{port}')) for r in range(n)]\n"
        "codes = [p.wait() for p in procs]\n"
        "print('EXIT', codes, flush=True)\n")
    cmd = [sys.executable, "-c", driver, sys.executable, str(script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return _communicate(cmd, env, timeout, "spawned job")


def run_command(cmd: list, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a command (e.g. ``layerpar train ... --np 4``) under the same timeout rule."""
    return _communicate([str(c) for c in cmd], dict(os.environ, OMP_NUM_THREADS="1"),
                        timeout, "command")


def _dump_stacks(pid: int, settle: float = 3.0) -> None:
    """Make every Python process below `pid` write its threads' stacks to its stderr
    (SIGABRT, which the faulthandler `_communicate` enables turns into a dump), and
    give them `settle` seconds to: a job that timed out then says where it waited."""
    import signal
    import time

    hit = False
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                if b"python" not in fh.read():
                    continue
            os.kill(p, signal.SIGABRT)
            hit = True
        except OSError:  # (gone already, or not ours to signal)
            pass
    if hit:
        time.sleep(settle)


def _communicate(cmd: list, env: dict, timeout: float,
                 what: str) -> subprocess.CompletedProcess:
    env = dict(env)
    env.setdefault("PYTHONFAULTHANDLER", "1")  # (stacks on SIGABRT: `_dump_stacks`)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _dump_stacks(proc.pid)
        kill_job(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something still holds the pipes
            out, err = "(output lost)", ""
        pytest.fail(f"{what} timed out after {timeout:g} s: {' '.join(map(str, cmd))}\n"
                    f"--- stdout ---\n{out}\n--- stderr ---\n{err}", pytrace=False)
    except BaseException:  # e.g. Ctrl-C: do not leave the job running
        kill_job(proc.pid)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def rank_lines(output: str, prefix: str = "RANK") -> dict[int, list[str]]:
    """Reports ``<prefix> <r> <text>`` in `output`, as {r: [text, ...]} in output order.

    A report may start in the middle of a physical line: mpiexec interleaves the ranks'
    output, and a ``print`` under PYTHONUNBUFFERED writes its text and its newline
    separately (workers should write each report with one ``sys.stdout.write``).
    """
    found: dict[int, list[str]] = {}
    pattern = re.compile(rf"{re.escape(prefix)} (\d+)(?: |$)")
    for line in output.splitlines():
        starts = list(pattern.finditer(line))
        for k, m in enumerate(starts):
            end = starts[k + 1].start() if k + 1 < len(starts) else len(line)
            found.setdefault(int(m.group(1)), []).append(line[m.end():end].rstrip())
    return found


def describe(proc: subprocess.CompletedProcess) -> str:
    """The command, exit status and output of a finished job, for assertion messages."""
    cmd = " ".join(map(str, proc.args))
    return (f"{cmd}\nexit status {proc.returncode}\n--- stdout ---\n{proc.stdout}\n"
            f"--- stderr ---\n{proc.stderr}")
