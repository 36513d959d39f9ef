"""Data x layer parallelism (`ProcessGrid`) and the torch.distributed backend.

Each case runs 4 processes under a timeout that kills the whole job: under mpiexec
(mpi4py), under torchrun (torch.distributed with gloo), and as plain spawned processes
(env://, no launcher that would stop the others when one dies: what layerpar itself
does about a lost process shows).  The worker is `workers/lp_grid.py`.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from mpi_util import describe, run_command, run_mpi, run_spawned, run_torchrun

import layerpar
from layerpar.apps.train import parse_summary
from layerpar.mgrit.transport import make_transport

WORKERS = Path(__file__).parent / "workers"
LINE = re.compile(r"RANK (\d+) ([A-Za-z]+?)(?=:| |$|RANK )", re.MULTILINE)
LAUNCHERS = {"mpiexec": run_mpi, "torchrun": run_torchrun}


def reports(proc) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LINE.finditer(proc.stdout)}


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_grids_match_serial_training(launcher: str) -> None:
    """2x2, 1x4, 4x1 (exact and converged) = serial on the full batch; inexact 2x2 =
    1x2 with the same global batch; a 2x2 checkpoint resumes on 4x1 and 1x4."""
    proc = LAUNCHERS[launcher](WORKERS / "lp_grid.py", 4, "correct", timeout=300)
    seen = reports(proc)
    assert seen == {0: "OK", 1: "OK", 2: "OK", 3: "OK"}, describe(proc)
    assert proc.stdout.count("exact: 2x2=") == 4, describe(proc)


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_replicas_take_one_path_whatever_their_timings(launcher: str) -> None:
    """batched="auto" times vectorised and per-step cycles; where the replicas' own
    timings disagree, every process takes the path of the summed timings (it hung
    before: a batched and a per-step pass hand gradients to the replicas' averaging
    in different buckets) and trains as that path given explicitly does."""
    proc = LAUNCHERS[launcher](WORKERS / "lp_grid.py", 4, "paths_differ", timeout=200)
    seen = reports(proc)
    assert seen == {0: "OK", 1: "OK", 2: "OK", 3: "OK"}, describe(proc)


# case -> (the error of the rank that fails, of the others, a text every rank prints)
FAILURES = {
    "raise_in_layer": ("RuntimeError", "RemoteError", "a layer exploded on rank 3"),
    "options_differ": ("RankMismatchError", "RankMismatchError", "`options.max_iter`"),
    "nan_one_replica": ("DivergenceError", "RemoteError",
                        "data replica 1 (global ranks [2, 3])"),
    "grid_not_divide": ("ValueError", "ValueError", "does not match the 4 processes"),
    "shapes_differ": ("RankMismatchError", "RankMismatchError",
                      "the input differs between data replicas"),
    "shapes_differ_in_replica": ("RankMismatchError", "RankMismatchError",
                                 "the input differs between the ranks of data replica 0: "
                                 "rank 0 has shape (4, 3)"),
    "skip_backward": ("RankMismatchError", "RankMismatchError",
                      "rank 1 is in the forward pass's agreement on the input (whole grid) "
                      "(batch 3, forward pass)"),
    "exact_differs": ("RankMismatchError", "RankMismatchError",
                      "run this pass with exact propagation and the others with MGRIT"),
    "auto_replicas": ("ValueError", "ValueError",
                      "options='auto' cannot be used with data replicas"),
    "accuracy_replicas": ("ValueError", "ValueError",
                          "`accuracy` cannot be used with data replicas"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("case", sorted(FAILURES))
def test_bad_input_raises_on_every_process(launcher: str, case: str) -> None:
    proc = LAUNCHERS[launcher](WORKERS / "lp_grid.py", 4, case, timeout=120)
    seen = reports(proc)
    local, remote, text = FAILURES[case]
    assert sorted(seen) == [0, 1, 2, 3], describe(proc)
    assert set(seen.values()) <= {local, remote} and local in seen.values(), describe(proc)
    assert proc.stdout.count(text) >= 4, describe(proc)
    took = [float(t) for t in re.findall(r"took ([0-9.]+) s", proc.stdout)]
    assert all(t < 20 for t in took), describe(proc)  # within seconds, not the timeout


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["sigkill", "raise_one_rank"])
def test_a_lost_process_is_named_on_every_other(case: str) -> None:
    """torch.distributed without a launcher: rank 2 is SIGKILLed mid-batch (or rank 3
    raises in user code and exits); every other process ends within seconds, each
    naming the lost rank."""
    proc = run_spawned(WORKERS / "lp_grid.py", 4, case, timeout=120)
    seen = reports(proc)
    lost = 2 if case == "sigkill" else 3
    others = [q for q in range(4) if q != lost]
    assert sorted(seen) == (others if case == "sigkill" else [0, 1, 2, 3]), describe(proc)
    assert all(seen[q] == "RankLostError" for q in others), describe(proc)
    assert proc.stdout.count(f"rank {lost} was lost") == 3, describe(proc)


@pytest.mark.mpi
def test_sigkill_under_mpiexec_ends_the_job() -> None:
    """Under mpiexec a killed rank ends the whole job (MPICH's launcher stops the others
    and names the killed rank); nothing hangs."""
    proc = run_mpi(WORKERS / "lp_grid.py", 4, "sigkill", timeout=120)
    assert proc.returncode != 0, describe(proc)
    assert "RANK 2" not in proc.stdout, describe(proc)
    assert re.search(r"KILLED BY SIGNAL: 9|signal 9|Killed", proc.stdout + proc.stderr), \
        describe(proc)


def test_one_process_grid() -> None:
    grid = layerpar.ProcessGrid(None)
    assert (grid.data, grid.layers, grid.data_rank, grid.layer_rank) == (1, 1, 0, 0)
    torch.manual_seed(0)
    net = layerpar.ODENet(open=torch.nn.Linear(3, 4),
                          steps=lambda k: layerpar.ode.blocks.Dense(4), n_steps=4,
                          t_final=1.0, close=torch.nn.Linear(4, 2))
    model = layerpar.LayerParallel(net, grid=grid)
    assert model(torch.randn(5, 3)).shape == (5, 2)
    with pytest.raises(TypeError, match="`comm` or `grid`, not both"):
        layerpar.LayerParallel(net, comm=object(), grid=grid)
    with pytest.raises(TypeError, match="`grid` must be a ProcessGrid"):
        layerpar.LayerParallel(net, grid="2x2")


@pytest.mark.parametrize("kw, err, text", [
    ({"data": 0}, ValueError, "`data` must be a positive int"),
    ({"data": 1.5}, TypeError, "`data` must be a positive int"),
    ({"data": 2}, ValueError, "`data`=2 x `layers`=0"),
    ({"data": 1, "layers": 2}, ValueError, "does not match the 1 processes"),
    ({"layers": True}, TypeError, "`layers` must be a positive int"),
    ({"timeout": -1}, ValueError, "`timeout` must be a positive"),
])
def test_grid_arguments_are_checked(kw: dict, err: type, text: str) -> None:
    with pytest.raises(err, match=re.escape(text)):
        layerpar.ProcessGrid(None, **kw)


def test_comm_of_another_kind_is_named() -> None:
    with pytest.raises(TypeError, match="`comm` must be an mpi4py communicator, a "
                       "torch.distributed process group or None, got str"):
        make_transport("world")


def test_sampler_gives_each_replica_an_equal_disjoint_shard() -> None:
    class Fake:
        data, data_rank = 3, 0

    data = list(range(10))
    shards = []
    for d in range(3):
        Fake.data_rank = d
        s = layerpar.ProcessGrid.sampler(Fake(), data, shuffle=True, seed=1)
        s.set_epoch(0)
        shards.append(list(s))
    assert [len(s) for s in shards] == [3, 3, 3]
    assert len(set(sum(shards, []))) == 9


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_layerpar_train_data_parallel_equals_one_replica(launcher: str) -> None:
    """`layerpar train peaks --np 4 --data-parallel 2` trains exactly as `--np 2` (the
    same global batches, float64, inexact MGRIT: each sample's trajectory is its own)."""
    base = [sys.executable, "-m", "layerpar.cli", "train", "peaks", "--epochs", "1",
            "--float64", "--no-progress", "--launcher", launcher]
    grid = run_command(base + ["--np", "4", "--data-parallel", "2"], timeout=240)
    one = run_command(base + ["--np", "2"], timeout=240)
    assert grid.returncode == 0 and one.returncode == 0, describe(grid) + describe(one)
    a, b = parse_summary(grid.stdout), parse_summary(one.stdout)
    assert (a["ranks"], a["data_parallel"], b["ranks"], b["data_parallel"]) == (4, 2, 2, 1)
    assert a["val_acc"] == b["val_acc"] and a["train_loss"] == b["train_loss"], (a, b)
