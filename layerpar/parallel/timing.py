"""One home for timing work: the first-use timings that choose between two ways of
computing the same thing (vectorised or per-step cycles, fused Triton steps or the
torch path), and `SpanTimer`, which times a training loop's steps without a
host-device synchronisation per step.

Such a timing is a one-time cost of the pass that first meets a shape, and on a GPU
the first one also compiles the Triton kernels (on an H200, the auto-tuning's first
candidate's first pass took 2.6 s where the candidates' passes took 27-46 ms, most
likely for that; not established), so `first_uses` counts them: the auto-tuning does
not judge a candidate by a pass that ran one (`gauged_seconds`).

`gauged_seconds` is the one rule by which candidates are timed against each other
across the ranks: the auto-tuning's passes (`autotune._time_passes`) and
`choose_method`'s training steps alike, so that their times compare; both run inside
`frozen_heap`, so that Python's full garbage collections do not land in them."""
from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = ["AGREE", "GIVE_UP", "SLOWER", "SpanTimer", "best_seconds", "first_uses",
           "frozen_heap", "gauged_seconds"]

#: a candidate whose untimed first run takes this many times the time to beat is not
#: timed further (its first run, one-time costs included, is what a table shows)
GIVE_UP = 3.0
#: two timed runs this close (relative) are taken as the candidate's time: a third is
#: not run
AGREE = 0.03
#: a candidate whose first timed run takes this many times the time to beat is not
#: timed further: it is slower (run-to-run spread on a quiet machine is ~3 %), and more
#: runs of it only cost (about 1 s per candidate on the 256-layer MNIST-1D conv net)
SLOWER = 1.2

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


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within it, Python's garbage collector leaves alone the objects that existed on
    entry (`gc.freeze`; `gc.unfreeze` on exit puts them back in the oldest
    generation): what is built and dropped inside (candidate models, copies of the
    net) is still collected, but a full collection no longer walks the whole heap.
    Choosing and tuning build copies of the net, which sets off full collections: on
    the 1,024-layer dense net at 2 ranks, three per rank, 0.13 s each, during a choice
    of about 4 s; and a collection that lands in a timed pass of 43 ms makes it
    several times slower than it is.  Frozen, they took 0.03-0.04 s each, and the
    choice 3.2-3.5 s (three runs) against 4.0-4.4 s (four runs).
    Nothing is done where objects are frozen already (the caller's own `gc.freeze`:
    ``layerpar train`` freezes what exists before it tunes, and again after its first
    step; or an outer `frozen_heap`) or the collector is off."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Gathers(Protocol):
    """What `gauged_seconds` agrees its timings over (a `Transport`)."""

    def allgather_object(self, obj: Any, what: str) -> list[Any]: ...


def gauged_seconds(run: Callable[[], Any], transport: _Gathers, repeats: int,
                   bound: float = float("inf"), warm: bool = False,
                   cuda: bool = False, what: str = "the timings",
                   counted: bool = True, untimed_out: Optional[list[float]] = None
                   ) -> float:
    """Fewest seconds of `run` (collective: every rank runs it alike), the slowest
    rank's, on every rank: one untimed run first (none if `warm`: it ran on this
    input's shape already), then at most `repeats` timed ones.

    An untimed run that ran first-use timings on some rank (`first_uses`: a shape met
    for the first time in this process, on a GPU with the Triton kernels' compilation;
    on an H200 the first candidate's first pass took 2.6 s against passes of 27-46 ms,
    most likely that) says nothing of the candidate's speed, so one more untimed run
    replaces it.  An untimed run above `GIVE_UP` x `bound` ends the timing there (its
    time is returned), as does a first timed run above `SLOWER` x `bound`, unless the
    untimed run was within `SLOWER` x `bound`: then that timed run was disturbed (on
    the 2-core machine, the 1,024-layer dense net's fastest setting once took 95 ms
    for a pass of 47-53 ms and was dropped), and the timing ends only if the next one
    is no faster.  Two timed runs within `AGREE` of each other on every rank end it
    early (a third would not move the minimum by more).  Every decision is taken on
    gathered times or flags, so every rank runs the same number of times.  `cuda`:
    each run is bracketed by synchronisations.  `counted` False: this rank's clock is
    not the run's (it only waits for another rank's work, whose end it sees up to a
    millisecond late: `SoloMethod`), so it reports 0 and the others' times decide.
    `untimed_out`: where given, the untimed run's seconds (slowest rank; the same on
    every rank) are appended to it, for a caller that times more runs itself."""

    def once() -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0 if counted else 0.0

    gauged = bound < float("inf")
    untimed: Optional[float] = None  # the untimed run, slowest rank (against a bound)
    for attempt in range(0 if warm else 2):
        uses = first_uses()
        seconds = once()
        got = transport.allgather_object((seconds, first_uses() != uses),
                                         f"{what} (first run)")
        if attempt == 0 and any(fresh for _, fresh in got):
            continue  # (the same on every rank: from gathered flags)
        untimed = max(t for t, _ in got)
        if untimed_out is not None:
            untimed_out.append(untimed)
        if gauged and untimed > GIVE_UP * bound:
            return untimed
        break
    times: list[float] = []
    retried = False  # a first timed run above SLOWER x bound was given a second
    for k in range(1, repeats + 1):
        times.append(once())
        if (len(times) == 1 or retried and len(times) == 2) and k < repeats and gauged:
            first = max(transport.allgather_object(min(times), f"{what} (first timed run)"))
            if first > SLOWER * bound:
                if retried or untimed is None or untimed > SLOWER * bound:
                    return first
                retried = True  # the same on every rank: from gathered times
                continue
        if len(times) == 2 and k < repeats:
            steady = abs(times[1] - times[0]) <= AGREE * min(times)
            if all(transport.allgather_object(steady, what)):
                break
    return float(max(transport.allgather_object(min(times), what)))


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
