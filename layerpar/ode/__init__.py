"""The problem side of layerpar: ODE networks, schemes, blocks and the serial oracle.

Never imports MPI or the MGRIT engine.
"""

from . import blocks, schemes
from .net import ODENet, Segment, sequential_segment
from .refine import refine
from .rng import layer_rng

__all__ = ["ODENet", "Segment", "blocks", "schemes", "sequential_segment", "layer_rng", "refine"]
