"""`LayerParallel`: an `ODENet` distributed over the ranks of a communicator.

model.py      LayerParallel, its autograd Function, runners of the forward/adjoint solves
batched.py    vectorised steps: a level's independent intervals advance in one call
grads.py      parameter gradients delivered to `.grad` from stacked per-layer gradients
"""
from .model import LayerParallel

__all__ = ["LayerParallel"]
