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


def test_mpi_world_refuses_a_world_smaller_than_the_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An mpiexec of another MPI library than mpi4py's starts singletons that would each
    train alone and report as the job: `mpi_world` compares the launcher's size with the
    world's (this test process is a singleton, as such a rank would be)."""
    pytest.importorskip("mpi4py")
    for var in launch.MPI_SIZE_ENV:
        monkeypatch.delenv(var, raising=False)
    assert launch.launcher_size() is None
    assert launch.mpi_world().Get_size() == 1  # no launcher: nothing to compare
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert launch.mpi_world().Get_size() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "16")
    assert launch.launcher_size() == 16
    with pytest.raises(launch.ForeignLauncherError,
                       match=r"one of 16 .* a world of 1: the mpiexec"):
        launch.mpi_world()
    with pytest.raises(RuntimeError, match="one of 16"):
        launch.world_comm()


def test_a_foreign_mpiexec_fails_the_training_with_the_reason() -> None:
    """End to end: `layerpar train` on a rank whose launcher said 2 processes while its
    MPI sees one (the environment of an Open MPI job, the MPICH of the venv's mpi4py)
    stops with the reason instead of training alone."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in launch.MPI_SIZE_ENV}
    env.update(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    got = subprocess.run([sys.executable, "-m", "layerpar.apps.cli", "train", "peaks",
                          "--epochs", "1", "--no-progress"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode != 0
    assert "one of 2 by its launcher, but mpi4py's MPI sees a world of 1" in got.stderr, \
        got.stderr[-2000:]
    assert "val_acc" not in got.stdout and "Traceback" not in got.stderr
