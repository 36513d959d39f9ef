"""`layerpar.apps.launch`: the one builder of mpiexec / torchrun command lines and the one
load-average reader (no job is started here; tests/test_signals.py runs real jobs)."""
from __future__ import annotations

import math
import sys

import pytest

from layerpar.apps import launch


def test_job_command_mpiexec_and_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "mpiexec_path", lambda: "/opt/mpi/bin/mpiexec")
    assert launch.job_command(3, ["-m", "pkg.mod", "--x", "1"]) == [
        "/opt/mpi/bin/mpiexec", "-n", "3", sys.executable, "-m", "mpi4py", "-m", "pkg.mod",
        "--x", "1"]
    assert launch.job_command(2, ["script.py", "a"], "torchrun") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        "2", "script.py", "a"]


def test_job_command_refuses_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "mpiexec_path", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"no mpiexec.*layerpar\[mpich\]"):
        launch.job_command(2, ["-m", "pkg.mod"])
    assert launch.job_command(2, ["-m", "m"], "torchrun")[0] == sys.executable  # no MPI
    with pytest.raises(ValueError, match="launcher"):
        launch.job_command(2, ["-m", "m"], "srun")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="nprocs"):
            launch.job_command(bad, ["-m", "m"], "torchrun")


def test_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    got = launch.load_average()
    assert len(got) == 3 and all(isinstance(v, float) for v in got)
    if hasattr(launch.os, "getloadavg"):
        assert all(v >= 0 for v in got)

    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average")

    monkeypatch.setattr(launch.os, "getloadavg", unavailable, raising=False)
    assert all(math.isnan(v) for v in launch.load_average())


@pytest.mark.skipif(launch.mpiexec_path() is None, reason="no mpiexec")
def test_a_failed_worker_job_says_why() -> None:
    """A benchmark job whose workers fail raises with their error in the message
    (their stderr is in the tail: the message used to show an empty tail)."""
    with pytest.raises(RuntimeError, match="No module named layerpar.no_such_worker"):
        launch.run_worker_job("layerpar.no_such_worker", 1, [], marker="NONE", timeout=120)
