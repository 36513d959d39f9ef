"""How many torch threads a training process runs.

A serial baseline runs at the thread count whose batch is fastest on this machine,
measured (`serial_threads`): torch's default (every core) can be several times slower
than one thread for a small net, which would flatter any layer-parallel comparison.
Layer-parallel ranks share the cores of their node (`threads_per_rank`).

Torch is imported where it is used, so that importing this module (as the benchmark
commands do, for their help) loads none.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

__all__ = ["best_threads", "fastest_threads", "serial_threads", "thread_counts",
           "threads_per_rank"]


def thread_counts(cores: Optional[int] = None) -> list[int]:
    """The counts a probe tries: 1, 2, 4, ... below `cores`, and `cores` itself
    (default: the cores this process may use); `SoloMethod.tune_threads` tries the same."""
    from ..parallel.baselines.method import thread_counts as counts

    return counts(cores)


def fastest_threads(seconds_per_batch: Callable[[], float],
                    counts: Optional[list[int]] = None) -> tuple[int, dict[int, float]]:
    """The thread count at which `seconds_per_batch()` (run once at each of `counts`,
    default `thread_counts()`, with torch's threads set to it) is smallest, the fewest
    threads on a tie; and the seconds at each count.  Torch's thread count is left as
    it was."""
    import torch

    before = torch.get_num_threads()
    per: dict[int, float] = {}
    try:
        for k in thread_counts() if counts is None else counts:
            torch.set_num_threads(k)
            per[k] = seconds_per_batch()
    finally:
        torch.set_num_threads(before)
    return min(per, key=lambda k: (per[k], k)), per


def serial_threads(problem: str, n_layers: Optional[int] = None,
                   width: Optional[int] = None, *, arch: Optional[str] = None,
                   t_final: Optional[float] = None, batch_size: Optional[int] = None,
                   dtype: Optional[torch.dtype] = None,
                   batches: int = 4) -> tuple[int, dict[int, float]]:
    """`fastest_threads` of a serial training step (`train_step`, Adam) of the
    problem's net on one batch of its training data: the best of `batches` steps after
    a warm-up, at each count (`dtype` default: float32).  The global torch generator
    is left as it was."""
    import torch

    from .data import splits
    from .loop import adam, train_step
    from .nets import problem_net, recipe_for

    dtype = torch.float32 if dtype is None else dtype
    x, y, _, _ = splits(problem, dtype=dtype)
    batch = batch_size or recipe_for(problem, arch).batch_size
    xb, yb = x[:batch], y[:batch]
    rng = torch.get_rng_state()

    def seconds() -> float:
        torch.manual_seed(0)
        net = problem_net(problem, n_layers, width, arch=arch, t_final=t_final).to(dtype)
        opt = adam(net.parameters(), lr=1e-3, flat=True)  # as `train` does
        train_step(net, xb, yb, opt)  # warm-up
        return min(train_step(net, xb, yb, opt).seconds for _ in range(batches))

    try:
        return fastest_threads(seconds)
    finally:
        torch.set_rng_state(rng)


def best_threads(case: Any, batches: int = 4) -> tuple[int, dict[int, float], int]:
    """`serial_threads` of a benchmark case (anything with ``problem`` and
    ``train_args()``, the arguments of ``layerpar train``), and the steps of one epoch."""
    from .arguments import add_arguments
    from .data import splits
    from .nets import recipe_for
    from .parsing import OneLineParser

    p = OneLineParser()
    add_arguments(p)
    p.add_argument("problem")
    a = p.parse_args(case.train_args())
    best, per = serial_threads(case.problem, a.layers, a.width, arch=a.arch,
                               t_final=a.t_final, batch_size=a.batch_size, batches=batches)
    batch = a.batch_size or recipe_for(case.problem, a.arch).batch_size
    return best, per, -(-len(splits(case.problem)[0]) // batch)


def threads_per_rank(comm: Any = None) -> int:
    """Torch threads per rank so that the ranks on one node share its cores.

    The cores this process may use, divided by the number of ranks of ``comm`` on the
    same node (all of them if ``comm`` is None); at least 1.
    """
    from .loop import available_cores

    cores = available_cores()
    local = 1
    if comm is not None and hasattr(comm, "Split_type"):
        if comm.Get_size() > 1:
            from mpi4py import MPI

            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            local = node.Get_size()
            node.Free()
    elif comm is not None:  # a torch.distributed group: its launcher says how many here
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // local)
