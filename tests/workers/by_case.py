"""What the case-by-case workers (`lp_hooks`, `lp_rng`, `lp_scaler`, `lp_replaced`)
write: every rank's results gathered on rank 0, as {case: [rank 0's, rank 1's, ...]}."""
from __future__ import annotations

import json
from typing import Any


def write_by_case(world: Any, results: dict[str, Any], path: str) -> None:
    """Gather each rank's `results` ({case: result}) and write them to `path` as JSON
    on rank 0 (collective over `world`, an mpi4py communicator)."""
    everyone = world.gather(results, root=0)
    if world.Get_rank() == 0:
        with open(path, "w") as f:
            json.dump({name: [r[name] for r in everyone] for name in results}, f)
