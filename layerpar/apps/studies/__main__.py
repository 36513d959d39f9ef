"""``python -m layerpar.studies [options]``: the ``layerpar scale`` study, stand-alone."""
import sys

from .cli import main

sys.exit(main())
