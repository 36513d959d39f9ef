"""Alias of `layerpar.apps.studies`, kept so documented commands stay valid:
``python -m layerpar.studies [sub] ...`` runs ``python -m layerpar.apps.studies ...``."""
from ..apps.studies import *  # noqa: F403
from ..apps.studies import __all__  # noqa: F401
