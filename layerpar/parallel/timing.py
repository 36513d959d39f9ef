"""One home for the first-use timings that choose between two ways of computing the
same thing (vectorised or per-step cycles, fused Triton steps or the torch path).

Such a timing is a one-time cost of the pass that first meets a shape, and on a GPU
the first one also compiles the Triton kernels (on an H200, the auto-tuning's first
candidate's first pass took 2.6 s where the candidates' passes took 27-46 ms), so
`first_uses` counts them: the auto-tuning does not judge a candidate by a pass that
ran one (`autotune._time_passes`)."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["best_seconds", "first_uses"]

_count = 0  # calls of best_seconds in this process


def first_uses() -> int:
    """How many first-use timings (`best_seconds` calls) this process has run."""
    return _count


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds, after one warm-up call; on
    a CUDA device each call is bracketed by synchronisations (only at first use: the
    choices this serves are cached)."""
    global _count
    _count += 1
    cuda = device.type == "cuda"
    best = float("inf")
    for rep in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best
