"""Module hooks on the net a LayerParallel model trains (`workers/lp_hooks.py`) at 1,
2 and 4 ranks: a hook that a layer-parallel pass cannot run as serial training runs it
is refused by name on every rank; a plain layer's hook, and a block's on one rank with
sequential passes, give serial's output, gradients and number of calls."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mpi_util import WORKERS, run_mpi
from tolerances import F64

sys.path.insert(0, str(WORKERS))
import lp_hooks  # noqa: E402

#: what each refused case says (every rank says the same: the first rank holding one)
REFUSED = {
    "block forward hook": "layer 0 of segment 0 (Dense) has a forward hook (_noop): "
                          "layer-parallel passes evaluate a residual block several times",
    "block pre-hook": "layer 2 of segment 0 (Dense) has a forward pre-hook (_noop)",
    "block backward hook": "layer 3 of segment 0 (Dense) has a backward hook (_noop)",
    "submodule hook": "layer 7 of segment 0 (Dense), its module `linear` has a "
                      "forward hook (_noop)",
    "hook on the last rank only": "layer 7 of segment 0 (Dense) has a forward hook (_noop)",
    "segment hook": "segment 0 (layer 1 of the ODENet) has a forward hook (_noop), "
                    "which would never run",
    "ODENet hook": "the ODENet has a forward pre-hook (_noop), which would never run",
    "global hook": "a global module forward hook is registered (torch's "
                   "register_module_forward_hook)",
    "block hook, auto": "layer 0 of segment 0 (Dense) has a forward hook (_noop)",
    "old weight norm": "layer 1 of segment 0 (Sequential), its module `0` has a forward "
                       "pre-hook (WeightNorm)",
    "block hook mid-training": "layer 0 of segment 0 (Dense) has a forward hook (_noop)",
    "block hook mid-training, last rank only": "layer 7 of segment 0 (Dense) has a "
                                               "forward hook (_noop)",
}


def check(results: dict[str, list[Any]], ranks: int) -> None:
    for name, says in REFUSED.items():
        for r in results[name]:
            assert says in r.get("error", ""), (name, r)
            assert r["error"].startswith("ValueError: "), (name, r)
            if ranks > 1:
                q = ranks - 1 if "last rank only" in name else 0
                assert f"(found on rank {q})" in r["error"], (name, r)
    for r in results["plain layer hook"]:
        assert "error" not in r, r
        assert r["output"] <= F64.converged and r["grads"] <= F64.converged, r
    # the opening runs once per pass on its owner, rank 0, as in serial training
    assert [r["calls"] for r in results["plain layer hook"]] == \
        [[1, 1]] + [[1, 0]] * (ranks - 1)
    for r in results.get("block hook, sequential", []):
        assert r == {"output": 0.0, "grads": 0.0, "calls": [1, 1]}, r


def test_one_rank() -> None:
    check({k: [v] for k, v in lp_hooks.run_all(None).items()}, 1)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_several_ranks(tmp_path: Path, ranks: int) -> None:
    out = tmp_path / "hooks.json"
    proc = run_mpi(WORKERS / "lp_hooks.py", ranks, str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check(json.loads(out.read_text()), ranks)
