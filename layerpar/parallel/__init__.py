"""`LayerParallel`: an `ODENet` distributed over the ranks of a communicator.

model.py      LayerParallel, its autograd Function, runners of the forward/adjoint solves
batched.py    vectorised steps: a level's independent intervals advance in one call
grads.py      parameter gradients delivered to `.grad` from stacked per-layer gradients
capture.py    a whole training step captured in one CUDA graph and replayed
grid.py       ProcessGrid: data replicas x layer ranks over one communicator
replicas.py   gradients averaged over the replicas (bucketed, overlapped reductions)
sync.py       how replicas stay in step: all-reduce, DASO, Lion Cub; bytes; slow link
lion.py       the Lion optimizer
"""
from .capture import CapturedStep, capture_step
from .grid import ProcessGrid
from .lion import Lion
from .model import LayerParallel
from .sync import DASO, AllReduce, LionCub, SlowLink, SyncStrategy

__all__ = ["DASO", "AllReduce", "CapturedStep", "LayerParallel", "Lion", "LionCub",
           "ProcessGrid", "SlowLink", "SyncStrategy", "capture_step"]
