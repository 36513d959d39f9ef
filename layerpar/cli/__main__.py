"""``python -m layerpar.cli``: alias of ``python -m layerpar.apps.cli``."""
import sys

from ..apps.cli import main

sys.exit(main())
