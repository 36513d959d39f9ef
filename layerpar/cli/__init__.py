"""Alias of `layerpar.apps.cli`, kept so documented commands stay valid:
``python -m layerpar.cli`` (and ``torchrun -m layerpar.cli``, ``python -m mpi4py -m
layerpar.cli``) run the ``layerpar`` command."""
from ..apps.cli import main

__all__ = ["main"]
