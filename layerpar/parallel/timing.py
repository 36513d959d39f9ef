"""One home for the first-use timings that choose between two ways of computing the
same thing (vectorised or per-step cycles, fused Triton steps or the torch path)."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["best_seconds"]


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds, after one warm-up call; on
    a CUDA device each call is bracketed by synchronisations (only at first use: the
    choices this serves are cached)."""
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
