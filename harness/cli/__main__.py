"""``python -m harness.cli``: the same as ``g4h``."""

import sys

from . import main

sys.exit(main())
