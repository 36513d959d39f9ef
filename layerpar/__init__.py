"""layerpar: layer-parallel training of deep residual networks with MGRIT."""
from . import ode
from .mgrit import MGRITOptions, MGRITResult, solve
from .ode import ODENet
from .parallel import LayerParallel

__all__ = ["LayerParallel", "MGRITOptions", "MGRITResult", "ODENet", "ode", "solve"]
__version__ = "0.1.0"
