"""What a user would run instead of layer-parallel MGRIT at the same rank count, from
the same `ODENet`, behind one training-step interface (`TrainingMethod`).

method.py    the interface; `SerialMethod` (alone, or replicated on every rank),
             `SoloMethod` (rank 0 with every core) and `LayerParallelMethod`
data.py      `DataParallelNet`: the batch split, gradients averaged (DDP or layerpar's
             transport)
pipeline.py  `PipelineNet`: stages cut as LayerParallel cuts, torch.distributed.pipelining
             schedules (GPipe, 1F1B, interleaved, zero bubble); `StagePlan`
dist.py      a torch.distributed process group from an mpi4py communicator
"""
from __future__ import annotations

from typing import Any

from .data import DataParallelNet
from .dist import process_group_from_mpi
from .method import LayerParallelMethod, SerialMethod, SoloMethod, TrainingMethod
from .pipeline import SCHEDULES, PipelineNet, StagePlan

__all__ = ["METHODS", "SCHEDULES", "DataParallelNet", "LayerParallelMethod", "PipelineNet",
           "SerialMethod", "SoloMethod", "StagePlan", "TrainingMethod", "make_method",
           "process_group_from_mpi"]

#: name -> class of every training method
METHODS: dict[str, type[TrainingMethod]] = {
    "serial": SerialMethod, "solo": SoloMethod, "layerparallel": LayerParallelMethod,
    "data": DataParallelNet, "pipeline": PipelineNet}


def make_method(name: str, net: Any, comm: Any = None, **settings: Any) -> TrainingMethod:
    """The method called `name` ("serial", "layerparallel", "data", "pipeline") for
    `net` over `comm`, with its own keyword `settings` ("serial" with a communicator:
    every rank trains a whole copy, `SerialMethod`)."""
    if name not in METHODS:
        raise ValueError(f"`name` must be one of {list(METHODS)}, got {name!r}")
    return METHODS[name](net, comm, **settings)  # type: ignore[call-arg]
