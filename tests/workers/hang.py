"""MPI worker that never finishes: rank 0 waits for a message nobody sends.

Usage: mpiexec -n P python -m mpi4py tests/workers/hang.py
Every rank prints ``RANK <r> pid <pid>`` first; used to test that `run_mpi` kills a
hanging job (every rank) at its timeout.
"""

import os
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
sys.stdout.write(f"RANK {comm.Get_rank()} pid {os.getpid()}\n")
sys.stdout.flush()
if comm.Get_rank() == 0:
    comm.recv(source=MPI.ANY_SOURCE, tag=99)
else:
    while True:
        time.sleep(1)
