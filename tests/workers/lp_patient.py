"""Worker: a rank that waits out another's work patiently (`Transport.patiently`, as
`SoloMethod`'s waiting ranks do) sleeps instead of spinning, so the working rank keeps
every core.

Usage: mpiexec -n P python -m mpi4py tests/workers/lp_patient.py
Rank 0 works 10 ms (sleeps) before each of 20 broadcasts; the others wait for them,
first as every wait does (spinning up to 20 ms), then patiently.  Each waiting rank
prints ``RANK <r> <mode> cpu <seconds> wall <seconds>`` (its process's CPU time over
the 20 waits).  Then a run in which rank 1 sleeps 30 ms and rank 0 does nothing is
timed by `gauged_seconds` with every rank's clock counted, and with rank 0's alone
(`counted`, as `SoloMethod`'s steps are timed): every rank prints ``RANK <r> clock
all <seconds> root <seconds>``, then ``RANK <r> DONE``.
"""
import contextlib
import sys
import time

from mpi4py import MPI

from layerpar.mgrit.transport import make_transport
from layerpar.parallel.timing import gauged_seconds

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
t = make_transport(comm)
t.timeout = 60.0
for mode in ("spinning", "patient"):
    t.allgather_object(mode, "start")
    cpu, wall = time.process_time(), time.perf_counter()
    with t.patiently() if mode == "patient" and rank else contextlib.nullcontext():
        for k in range(20):
            if rank == 0:
                time.sleep(0.01)
            got = t.bcast_object(k if rank == 0 else None, 0)
            if got != k:
                raise SystemExit(f"rank {rank} got {got!r}, not {k}")
    if rank:
        sys.stdout.write(f"RANK {rank} {mode} cpu {time.process_time() - cpu:.4f} "
                         f"wall {time.perf_counter() - wall:.4f}\n")


def lagging() -> None:
    if rank == 1:
        time.sleep(0.03)


every = gauged_seconds(lagging, t, 2)
root = gauged_seconds(lagging, t, 2, counted=rank == 0)
sys.stdout.write(f"RANK {rank} clock all {every:.4f} root {root:.4f}\n")
sys.stdout.write(f"RANK {rank} DONE\n")
sys.stdout.flush()
t.close()
