"""MPI worker: a pre-norm transformer ODE-net trained by LayerParallel against the
serial ODENet, float64, converged MGRIT.

Run: mpiexec -n P python -m mpi4py tests/workers/lp_transformer.py OUT.json
Three SGD steps from the same weights on the same batch; rank 0 writes the largest
relative difference (over all ranks) of the losses and of the gathered parameters after
training to OUT.json, and whether every segment ran the batched cycle.
"""
import json
import sys

from mpi4py import MPI

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from test_transformer import compare  # noqa: E402

comm = MPI.COMM_WORLD


def main():
    res = compare(comm)
    worst = comm.allreduce(res["diff"], op=MPI.MAX)
    batched = comm.allreduce(int(res["batched"]), op=MPI.MIN) == 1
    if comm.Get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump({"diff": worst, "batched": batched, "losses": res["losses"]}, fh)


if __name__ == "__main__":
    main()
