"""``python -m layerpar.studies``: alias of ``python -m layerpar.apps.studies``."""
import sys

from ..apps.studies.cli import main

sys.exit(main())
