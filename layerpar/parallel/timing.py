"""One home for timing work: the first-use timings that choose between two ways of
computing the same thing (vectorised or per-step cycles, fused Triton steps or the
torch path), and `SpanTimer`, which times a training loop's steps without a
host-device synchronisation per step.

Such a timing is a one-time cost of the pass that first meets a shape, and on a GPU
the first one also compiles the Triton kernels (on an H200, the auto-tuning's first
candidate's first pass took 2.6 s where the candidates' passes took 27-46 ms, most
likely for that; not established), so `first_uses` counts them: the auto-tuning does
not judge a candidate by a pass that ran one (`autotune._time_passes`)."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

__all__ = ["SpanTimer", "best_seconds", "first_uses"]

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


class SpanTimer:
    """Summed duration of spans of work (`start` ... `stop`), read without waiting at
    each span.  On a CUDA device each span is a pair of CUDA events recorded on the
    current stream, so a training loop of captured replays never waits for the GPU to
    time its steps (a synchronisation per span would stall each replay); `total`
    waits once, for the last span.  Elsewhere the spans are `time.perf_counter`
    intervals, the same code path (and what the tests run)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._open: Any = None
        self._spans: list[tuple[Any, Any]] = []  # (start, end) events not yet summed
        self.seconds, self.count = 0.0, 0  # the spans summed so far

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._open = self._mark()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("SpanTimer.stop without start")
        self._spans.append((self._open, self._mark()))
        self._open = None

    def total(self) -> tuple[float, int]:
        """(seconds, spans) over all stopped spans; on CUDA it waits for the last
        span's end event (once, not per span)."""
        if self._spans:
            if self.cuda:
                self._spans[-1][1].synchronize()
                self.seconds += sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
            else:
                self.seconds += sum(b - a for a, b in self._spans)
            self.count += len(self._spans)
            self._spans.clear()
        return self.seconds, self.count

    def mean(self) -> Optional[float]:
        """Seconds per span so far, or None before the first."""
        seconds, count = self.total()
        return seconds / count if count else None
