"""`LayerParallel`: an `ODENet` distributed over the ranks of a communicator.

model.py      LayerParallel (the nn.Module) and its autograd Function: one fixed setting,
              the pass over plain layers and segments, gradients out; a narrow seam
              for the policy above it (`exact()`, `set_iterations`, `like`, ...)
auto.py       Auto: the policy above the model (auto-tuning, adaptive accuracy), called
              like the model; ``LayerParallel(..., "auto")`` and ``accuracy=`` build one
agree.py      what ranks must agree on before a pass (digests, fingerprints, refusals)
passes.py     one pass: the forward over plain layers and segments, the backward in
              reverse, direct mode's forward onto the caller's graph
plan.py       Plan: which rank owns which layers on each level, ghosts, sends (printable)
runner.py     one segment on one rank: its share of the plan, its one propagator (Φ,
              `layerpar.ode.propagator`), its two engine sessions, and the choice of
              vectorised or per-step cycles
tape.py       what one forward pass leaves for its backward pass (owned by the pass):
              per segment a Tape, plain layers' records, the PassRecord that holds them
forward.py    the forward solve's callbacks (steps through Φ, records of the final sweep)
adjoint.py    the adjoint solve's callbacks (VJPs of Φ: transposed Jacobians, gradients)
direct.py     direct mode's callbacks: one rank, sequential solves, PyTorch's backward
move.py       move(): activations and layers handed between ranks
batched.py    vectorised steps: a level's independent intervals advance in one call
kernels/      fused Triton steps for the vectorised path on CUDA (chosen per shape)
timing.py     first-use timings that choose between two ways of computing a step
bn_dropout.py batch norm and dropout inside solves that evaluate a layer many times
ghosts.py     read-only copies of neighbours' blocks that coarse steps use
grads.py      parameter gradients delivered to `.grad` from stacked per-layer gradients
capture.py    a whole training step captured in one CUDA graph and replayed (auto's too)
grid.py       ProcessGrid: data replicas x layer ranks over one communicator
replicas.py   gradients averaged over the replicas (bucketed, overlapped reductions)
checkpoint.py state dicts and optimizer state gathered, loaded on any rank count
accuracy.py   check_gradients: the inexact gradient against the exact one, measured
              (a measurement: it imports no model)
adaptive.py   adaptive accuracy: iteration counts against a bound on gradient error
autotune.py   Auto's tuning: candidates timed, gradient error against a measured bound
tuner.py      AutoTuner: the tuning's choice run, checked during training, tuned again
replicated.py every rank runs the whole net serially: auto's step aside at P > 1 ranks
choose.py     choose_method: layer-parallel, data-parallel and pipelined training timed on
              the user's batch, the fastest kept (above the model and the baselines)
refine.py     nested iteration on a LayerParallel (refinement in depth, in place)
sync.py       how replicas stay in step: all-reduce, DASO, Lion Cub; bytes; slow link
lion.py       the Lion optimizer
flatadam.py   FlatAdam: Adam stepping each run of a segment's parameter rows as one tensor
scaler.py     GradScaler: torch's loss scaler with its overflow check agreed between ranks
optimizers.py what a user's optimizer over a rank's part cannot do, refused at its step
              (another rank's loaded state, LBFGS)
"""
# The first `torch.autograd.grad` with tensor `grad_outputs` in a process imports this
# module (and sympy: ~0.3-0.5 s); every layer-parallel backward makes such calls, so it
# is imported with the package rather than inside the first training step, where it
# would be charged to whichever setting ran first (auto's timings, time to target).
import torch.fx.experimental.symbolic_shapes  # noqa: F401, E402

from .auto import Auto
from .baselines import DataParallelNet, PipelineNet, TrainingMethod
from .capture import AutoCapturedStep, CapturedStep, capture_step
from .choose import choose_method
from .flatadam import FlatAdam
from .grid import ProcessGrid
from .lion import Lion
from .model import LayerParallel
from .plan import Plan
from .scaler import GradScaler
from .sync import DASO, AllReduce, LionCub, SlowLink, SyncStrategy

__all__ = ["DASO", "AllReduce", "Auto", "AutoCapturedStep", "CapturedStep", "FlatAdam",
           "LayerParallel", "Lion",
           "LionCub", "Plan", "ProcessGrid", "SlowLink", "SyncStrategy", "capture_step"]
__all__ += ["DataParallelNet", "PipelineNet", "TrainingMethod"]  # baselines/
__all__ += ["choose_method", "GradScaler"]
