"""Message latency and bandwidth over mpi4py: a two-rank ping-pong.

    mpiexec -n 2 python -m mpi4py -m layerpar.apps.studies.pingpong [--out FILE] [--quick]

Rank 0 sends a buffer of each size to rank 1, which sends it back; the one-way time
is half the median round trip.  The times are fitted to t(bytes) = alpha + bytes/beta
(least squares on relative error, so small and large messages count alike): alpha is
the latency in seconds, beta the bandwidth in bytes per second.  Messages travel as
the MGRIT transport sends states: nonblocking send and receive of byte buffers.
Rank 0 prints one summary line and, with --out, writes the samples and the fit as
JSON.  Ranks beyond the first two only take part in the final barrier.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..launch import mpi_world
from ..parsing import OneLineParser
from .files import write_text

__all__ = ["fit_alpha_beta", "main", "measure"]

SIZES = [8 << (2 * k) for k in range(11)]  # 8 B .. 8 MiB
QUICK_SIZES = [8 << (3 * k) for k in range(6)]  # 8 B .. 256 KiB


def measure(comm: Any, sizes: Sequence[int] = SIZES, repeats: int = 30,
            budget: float = 0.2) -> list[tuple[int, float]]:
    """(bytes, one-way seconds) per size, between communicator ranks 0 and 1.

    After 2000 warm-up round trips of 8 bytes, each size runs for about `budget`
    seconds (at least 3 and at most `repeats` round trips after one more warm-up); the
    one-way time is half the median round trip.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    out: list[tuple[int, float]] = []
    warm = np.zeros(8, dtype=np.uint8)
    for _ in range(2000):  # warm-up: connection setup, clocks, caches
        if rank == 0:
            comm.Send([warm, MPI.BYTE], dest=1, tag=6)
            comm.Recv([warm, MPI.BYTE], source=1, tag=6)
        elif rank == 1:
            comm.Recv([warm, MPI.BYTE], source=0, tag=6)
            comm.Send([warm, MPI.BYTE], dest=0, tag=6)
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)
        rounds: list[float] = []
        k = 0
        start = time.perf_counter()
        while True:
            comm.Barrier()
            t0 = time.perf_counter()
            if rank == 0:
                MPI.Request.Wait(comm.Isend([buf, MPI.BYTE], dest=1, tag=7))
                MPI.Request.Wait(comm.Irecv([buf, MPI.BYTE], source=1, tag=8))
            elif rank == 1:
                MPI.Request.Wait(comm.Irecv([buf, MPI.BYTE], source=0, tag=7))
                MPI.Request.Wait(comm.Isend([buf, MPI.BYTE], dest=0, tag=8))
            t1 = time.perf_counter()
            if k > 0:
                rounds.append(t1 - t0)
            k += 1
            # rank 0 decides when to stop, so both ranks loop equally often
            more = len(rounds) < 3 or (len(rounds) < repeats
                                       and time.perf_counter() - start < budget)
            if not comm.bcast(more, root=0):
                break
        out.append((n, statistics.median(rounds) / 2.0))
    return out


def fit_alpha_beta(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(alpha, beta) of t = alpha + bytes/beta, least squares weighted by 1/t.

    alpha >= 0; beta is inf when the times do not grow with size.
    """
    x = np.array([s[0] for s in samples], dtype=float)
    t = np.array([s[1] for s in samples], dtype=float)
    w = 1.0 / t
    a = np.stack([w, w * x], axis=1)
    (alpha, slope), *_ = np.linalg.lstsq(a, w * t, rcond=None)
    if alpha < 0:  # refit the slope alone
        alpha = 0.0
        slope = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    if slope <= 0:
        slope = 0.0
        alpha = float(np.sum(w * w * t) / np.sum(w * w))
    return float(alpha), (1.0 / slope if slope > 0 else float("inf"))


def _check_out(path: Path) -> None:
    """`--out` must be writable and, where it exists, an earlier ping-pong's JSON (its
    samples and fit): a person's file there was replaced without a word
    (`StudyFileError`, a ValueError, otherwise)."""
    from .files import StudyFileError, check_output_file

    check_output_file(path, "--out")
    if path.is_file():
        try:
            obj = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            obj = None
        if not (isinstance(obj, dict) and {"samples", "alpha_s", "beta_Bps"} <= set(obj)):
            raise StudyFileError(f"`--out` {path} exists and is not a ping-pong's JSON, so "
                                 "it is not replaced; nothing was changed.  Move it away or "
                                 "give another path")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(
        prog="python -m mpi4py -m layerpar.apps.studies.pingpong",
        description="Two-rank ping-pong: message latency and bandwidth over mpi4py.")
    parser.add_argument("--out", help="write samples and fit as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller sizes")
    args = parser.parse_args(argv)
    if args.out:  # before any message, alike on every rank (they read the same file)
        try:
            _check_out(Path(args.out))
        except ValueError as exc:
            parser.error(str(exc))
    from mpi4py import MPI

    comm = mpi_world()
    if comm.Get_size() < 2:
        parser.error("needs at least 2 ranks: run it as `mpiexec -n 2 python -m mpi4py -m "
                     "layerpar.apps.studies.pingpong`")
    pair = comm.Split(0 if comm.Get_rank() < 2 else MPI.UNDEFINED, comm.Get_rank())
    if pair != MPI.COMM_NULL:
        samples = measure(pair, QUICK_SIZES if args.quick else SIZES,
                          budget=0.05 if args.quick else 0.2)
        if comm.Get_rank() == 0:
            alpha, beta = fit_alpha_beta(samples)
            result = {"samples": [[n, t] for n, t in samples], "alpha_s": alpha,
                      "beta_Bps": beta, "library": MPI.Get_library_version().strip()}
            if args.out:  # whole or not at all: the study reads it back as a cache
                write_text(args.out, json.dumps(result, indent=1))
            print(f"pingpong: alpha = {alpha * 1e6:.2f} us, beta = {beta / 1e9:.3f} GB/s "
                  f"({len(samples)} sizes)", flush=True)
        pair.Free()
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
