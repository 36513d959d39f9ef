"""The edges of shared and tied parameters, and other inputs a serial user writes, at
2 ranks (`workers/lp_shared_edges.py`): each equals the serial net or is refused by
name, alike on every rank."""
from __future__ import annotations

import re

import pytest
from mpi_util import WORKERS, run_mpi


def _lines(case: str) -> list[str]:
    proc = run_mpi(WORKERS / "lp_shared_edges.py", 2, case, timeout=120)
    got = dict(re.findall(r"RANK (\d) (.*)", proc.stdout))
    assert sorted(got) == ["0", "1"], proc.stdout + proc.stderr[-2000:]
    return [got["0"], got["1"]]


@pytest.mark.mpi
def test_a_deduplicated_or_conflicting_state_dict_loads_as_into_serial() -> None:
    for line in _lines("dedup"):
        dedup, values = map(float, re.match(r"dedup (\S+) values (\S+)", line).groups())
        assert dedup == 0.0 and values == 0.0, line


@pytest.mark.mpi
@pytest.mark.parametrize("case, says", [
    ("freeze", "RankMismatchError: a parameter that layers on several ranks use "
               "(layers.0, layers.2) requires grad on some of them and not on others"),
    ("tied-on-one-rank", "`shared`: rank 0 has [('layers.0', 'layers.2')], rank 1 has []"),
    ("shared-bn", "BatchNorm1d with running statistics is used by several layers"),
    ("deepcopy", "TypeError: a LayerParallel cannot be deep-copied"),
    ("tuple-head", "TypeError: plain layer 2 (TupleHead) returned a tuple: a "
                   "LayerParallel model hands one tensor from layer to layer"),
])
def test_refused_by_name_on_every_rank(case: str, says: str) -> None:
    for line in _lines(case):
        assert says in line, line


@pytest.mark.mpi
def test_autocast_state_may_change_between_passes() -> None:
    for line in _lines("autocast-switch"):
        parts = line.split()[1:]
        assert [p.split(":")[0] for p in parts] == [
            "torch.bfloat16/torch.bfloat16", "torch.float16/torch.float16",
            "torch.float32/torch.float32"], line
        assert all(float(p.split(":")[1]) == 0.0 for p in parts), line


@pytest.mark.mpi
def test_two_forwards_one_backward_under_auto_with_a_tied_weight() -> None:
    for line in _lines("two-forwards-auto"):
        err = float(re.match(r"two forwards (\S+)", line).group(1))
        assert err <= 1e-12, line
