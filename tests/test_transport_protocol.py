"""The transport protocol's group methods (`split`, `subgroup`, `node_key`, `errors`,
`meter`), and `ProcessGrid` built on nothing else: a transport double stands for a
4-process world, so the grid's group building is checked without launching processes.
Also: the type-checked set of pyproject.toml (`layerpar/mgrit`, `layerpar/ode`,
`layerpar/parallel`) is clean under mypy.
"""
from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import layerpar
from layerpar.mgrit.errors import RemoteError
from layerpar.mgrit.transport import ChannelState, SerialTransport, Transport
from layerpar.parallel import grid as grid_module
from layerpar.parallel import sync as sync_module

ROOT = Path(__file__).resolve().parent.parent


# -- the serial and the mpi4py transports ----------------------------------------------------
def test_serial_transport_groups_meter_and_shared_state() -> None:
    t = SerialTransport()
    assert t.split([[0]]) is None and t.subgroup([[0]]) is None and t.subgroup([]) is None
    assert t.node_key() == 0
    assert t.errors is None and t.timeout is None and t.meter is None
    meter: dict[str, int] = {}
    t.meter = meter
    t.count_sent(16)
    t.count_sent(8, "data")
    assert meter == {"p2p": 16, "data": 8}
    with pytest.raises(TypeError, match="`meter` must be a dict"):
        t.meter = 3  # type: ignore[assignment]
    with pytest.raises(ValueError, match="must hold ranks in \\[0, 1\\)"):
        t.split([[0, 1]])
    with pytest.raises(ValueError, match="must cover the group's 1 ranks"):
        t.split([])
    with pytest.raises(ValueError, match="the root of a broadcast tensor must pass"):
        t.bcast_tensor(None, 0, (1,), torch.float64, torch.device("cpu"))


def test_state_is_shared_with_the_reversed_view() -> None:
    class Two(Transport):
        backend = "two"

    t = Two(2, 0)
    assert isinstance(t._state, ChannelState)
    r = t.reversed()
    assert r.rank == 1 and r._state is t._state
    t.meter = {}
    t.timeout = 5
    t.set_context("batch 3")
    assert r.meter is t.meter and r.timeout == 5.0 and r._state.context == "batch 3"
    with pytest.raises(ValueError, match="`timeout` must be a positive"):
        r.timeout = -1


def test_mpi_transport_groups_on_a_communicator_of_one() -> None:
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    from layerpar.mgrit.transport import MPITransport

    t = MPITransport(MPI.COMM_SELF)
    assert t.errors.rank == 0 and t.errors is t.reversed().errors
    one = t.split([[0]])
    assert one.Get_size() == 1
    assert t.subgroup([[0]]) is None  # a group of one is not made
    assert t.node_key() == 0
    with pytest.raises(ValueError, match="increasing order"):
        t.subgroup([[0, 0]])
    t.close()  # frees the split communicator too
    assert one == MPI.COMM_NULL


# -- ProcessGrid over a transport double ----------------------------------------------------
class Group:
    """A stand-in for a communicator: the world ranks it holds."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)


class Channel:
    """An error channel double."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.broken: Optional[RemoteError] = None

    def post(self, text: str) -> None:
        self.broken = RemoteError(self.rank, text)


class Double(Transport):
    """A transport over a `Group`, seen from world rank `me`: collectives answer as if
    every process passed what this one did; group calls are logged."""

    backend = "double"

    def __init__(self, group: Group, me: int, log: list, errors: Optional[Channel]) -> None:
        super().__init__(len(group.ranks), group.ranks.index(me))
        self.group, self.me, self.log = group, me, log
        self._errors = errors if errors is not None else Channel(me)

    @property
    def errors(self) -> Channel:
        return self._errors

    def agree(self, key: Any, error: BaseException | None, what: str) -> None:
        if error is not None:
            raise error

    def allgather_object(self, obj: Any, what: str = "") -> list[Any]:
        return [obj] * self.size

    def _mine(self, parts: Sequence[Sequence[int]], smallest: int) -> Optional[Group]:
        for g in parts:
            if self.group_rank in g and len(g) >= smallest:
                return Group([self.group.ranks[q] for q in g])
        return None

    def split(self, parts: Sequence[Sequence[int]]) -> Any:
        self.log.append(("split", self.group.ranks, [list(g) for g in parts]))
        return self._mine(parts, 1)

    def subgroup(self, parts: Sequence[Sequence[int]]) -> Any:
        self.log.append(("subgroup", self.group.ranks, [list(g) for g in parts]))
        return self._mine(parts, 2)

    def node_key(self) -> Hashable:
        return "one node"

    def close(self) -> None:
        self.log.append(("close", self.group.ranks))
        super().close()


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``world(me)`` -> (the 4-process Group, the log) with `make_transport` giving
    doubles as world rank `me`."""
    def setup(me: int) -> tuple[Group, list]:
        log: list = []

        def make(comm: Any, *, errors: Any = None, timeout: Any = None) -> Transport:
            return SerialTransport() if comm is None else Double(comm, me, log, errors)

        monkeypatch.setattr(grid_module, "make_transport", make)
        monkeypatch.setattr(sync_module, "make_transport", make)
        return Group(range(4)), log
    return setup


@pytest.mark.parametrize("me", range(4))
def test_grid_builds_its_groups_through_the_transport(world: Any, me: int) -> None:
    comm, log = world(me)
    grid = layerpar.ProcessGrid(comm, data=2, layers=2)
    assert (grid.data_rank, grid.layer_rank) == divmod(me, 2)
    assert log[:2] == [("split", (0, 1, 2, 3), [[0, 1], [2, 3]]),
                       ("split", (0, 1, 2, 3), [[0, 2], [1, 3]])]
    assert grid.layer_comm.ranks == (me // 2 * 2, me // 2 * 2 + 1)
    assert grid.data_comm.ranks == (me % 2, me % 2 + 2)
    assert grid.node_of == [0, 0, 0, 0]
    assert grid.errors is grid.world.errors
    layer, data = grid.transports()
    assert layer.errors is grid.errors and data is not None and data.errors is grid.errors
    assert layer.meter is grid.meter and data.meter is None
    layer.count_sent(24)
    assert grid.meter == {"p2p": 24}
    grid.close()
    assert ("close", (0, 1, 2, 3)) in log and grid.world._state.closed


def test_grid_node_groups_go_through_subgroup(world: Any) -> None:
    comm, log = world(3)
    grid = layerpar.ProcessGrid(comm, data=2, layers=2, sync="daso", nodes=2)
    assert grid.node_of == [0, 0, 1, 1]
    assert [e for e in log if e[0] == "subgroup"] == [
        ("subgroup", (0, 1, 2, 3), [[0], [2], [1], [3]]),
        ("subgroup", (0, 1, 2, 3), [[0, 2], [1, 3]])]
    node, leaders, leader = grid.node_split()
    assert node is None and leaders.ranks == (1, 3) and leader
    grid.close()


def test_grid_one_process_uses_the_serial_transport() -> None:
    grid = layerpar.ProcessGrid(None)
    assert grid.layer_comm is None and grid.data_comm is None and grid.errors is None
    assert grid.node_of == [0] and grid.node_split() == (None, None, True)
    layer, data = grid.transports()
    assert isinstance(layer, SerialTransport) and data is None and layer.meter is grid.meter
    grid.close()


def test_grid_has_no_backend_branches() -> None:
    src = inspect.getsource(grid_module)
    for text in ("backend ==", '"mpi"', '"nccl"', "._errors", "._state", "from mpi4py",
                 "import torch.distributed"):
        assert text not in src, text


# -- types -----------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy not installed")
def test_mypy_is_clean() -> None:
    """The type-checked set of pyproject.toml's [tool.mypy] (`make typecheck`): mgrit,
    ode and parallel (its baselines and kernels too); mypy comes with the `test` extra."""
    cache = Path(tempfile.gettempdir()) / "layerpar-mypy-cache"
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache)], cwd=ROOT,
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
