"""Signals never orphan a job (issue 10, item 7).

`layerpar train --np 2` is stopped with SIGTERM or SIGKILL, and `layerpar scale` with
Ctrl-C (SIGINT), while its MPI job runs; within a few seconds no process of that job
(mpiexec, its proxy, the ranks) may be left.  A unique marker in the command line
finds the job's processes in /proc; whatever a failing test leaves is killed.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mpi_util import mpi_available

from layerpar.apps import cli
from layerpar.apps.launch import kill_job

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a dead process nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _marked(marker: str) -> list[int]:
    """Live processes (not this one) whose command line contains `marker`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and marker in _cmdline(int(entry)):
            if _alive(int(entry)):
                out.append(int(entry))
    return out


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _job_processes(marker: str, launcher: int) -> list[int]:
    """The launched job's processes: marked ones other than the launcher, and every
    process below them (MPICH's proxy carries no marker)."""
    found, todo = [], [p for p in _marked(marker) if p != launcher]
    while todo:
        p = todo.pop()
        if p not in found:
            found.append(p)
            todo += _children(p)
    return found


def _wait_for(marker: str, needle: str, proc: subprocess.Popen, count: int,
              timeout: float = 90) -> None:
    """Wait until `count` marked processes have `needle` in their command line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(needle in _cmdline(p) for p in _marked(marker)) >= count:
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the launcher ended first (exit {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.1)
    pytest.fail(f"no {count} process(es) with {needle!r} after {timeout} s")


@pytest.fixture
def cleanup() -> Iterator[list]:
    """Kill, after the test, whatever marked processes are still alive."""
    markers: list[str] = []
    yield markers
    for marker in markers:
        for pid in _marked(marker):
            kill_job(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (cli.LAUNCHED_ENV, *cli._MPI_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    env["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] = "1"
    return env


def _assert_gone(job: list[int], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_alive(p) for p in job):
        time.sleep(0.05)
    left = {p: _cmdline(p) for p in job if _alive(p)}
    assert not left, f"still running {within} s after the launcher was stopped: {left}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_train_launcher_stops_its_job(sig: int, cleanup: list) -> None:
    if not mpi_available():
        pytest.skip("no MPI (mpi4py and mpiexec) available")
    seed = str(10**11 + secrets.randbelow(10**11))  # the marker: a unique --seed
    cleanup.append(f"--seed {seed}")
    cmd = [sys.executable, "-m", "layerpar.cli", "train", "peaks", "--np", "2",
           "--epochs", "1000", "--no-progress", "--seed", seed]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=_env())
    try:
        # mpiexec and both ranks carry "mpi4py" and the marker
        _wait_for(f"--seed {seed}", "mpi4py", proc, count=3)
        job = _job_processes(f"--seed {seed}", proc.pid)
        assert len(job) >= 3, job  # mpiexec, proxy, 2 ranks
        os.kill(proc.pid, sig)
        proc.communicate(timeout=30)
        assert proc.returncode == -sig  # the launcher ends as the signal says
        _assert_gone(job)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_ctrl_c_on_scale_stops_its_worker_job(tmp_path: Path, cleanup: list) -> None:
    if not mpi_available():
        pytest.skip("no MPI (mpi4py and mpiexec) available")
    out = tmp_path / f"study-{secrets.token_hex(6)}"  # the marker: in the job's argv
    cleanup.append(str(out))
    # enough steps that the worker job (several times slower than the in-process
    # serial baseline measured first) is still running when Ctrl-C comes, also on a
    # loaded machine, where finding its processes takes longer (300 steps once ended first)
    cmd = [sys.executable, "-m", "layerpar.cli", "scale", "--quick", "--ranks", "2",
           "--layers", "32", "--steps", "1000", "--serial-threads", "1", "--no-plots",
           "--no-progress", "--out", str(out)]
    # SIGINT as at an interactive prompt: a shell that starts the test run in the
    # background (`make test &`) hands SIGINT down ignored, and the launcher keeps an
    # ignored signal ignored (as it must: nohup), so this Ctrl-C would never arrive
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # mpiexec and both ranks of the worker job (not the ping-pong job before it)
        _wait_for(str(out), "layerpar.apps.studies.worker", proc, count=3, timeout=120)
        job = _job_processes(str(out), proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0, err
        assert len(job) >= 3, job  # mpiexec, proxy, 2 ranks
        _assert_gone(job)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_run_job_restores_handlers_and_honours_its_timeout() -> None:
    from layerpar.apps.launch import FORWARDED_SIGNALS, run_job

    before = {s: signal.getsignal(s) for s in FORWARDED_SIGNALS}
    assert run_job([sys.executable, "-c", "raise SystemExit(3)"]).returncode == 3
    t0 = time.monotonic()
    st = run_job(["sleep", "30"], timeout=0.5)
    assert st.timed_out and st.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    assert {s: signal.getsignal(s) for s in FORWARDED_SIGNALS} == before
