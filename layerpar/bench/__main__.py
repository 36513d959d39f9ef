"""``python -m layerpar.bench``: alias of ``python -m layerpar.apps.bench``."""
import sys

from ..apps.bench import main

sys.exit(main())
