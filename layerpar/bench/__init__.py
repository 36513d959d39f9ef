"""Alias of `layerpar.apps.bench`, kept so documented commands stay valid:
``python -m layerpar.bench [sub] ...`` runs ``python -m layerpar.apps.bench [sub] ...``."""
from ..apps.bench import main

__all__ = ["main"]
