"""`LayerParallel`: an `ODENet` distributed over the ranks of a communicator.

model.py      LayerParallel, its autograd Function, runners of the forward/adjoint solves
batched.py    vectorised steps: a level's independent intervals advance in one call
grads.py      parameter gradients delivered to `.grad` from stacked per-layer gradients
capture.py    a whole training step captured in one CUDA graph and replayed
grid.py       ProcessGrid: data replicas x layer ranks over one communicator
replicas.py   gradients averaged over the replicas (bucketed, overlapped reductions)
"""
from .capture import CapturedStep, capture_step
from .grid import ProcessGrid
from .model import LayerParallel

__all__ = ["CapturedStep", "LayerParallel", "ProcessGrid", "capture_step"]
