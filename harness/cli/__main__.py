"""``python -m gemma4_harness.harness.cli``: the same as ``g4h``."""

import sys

from . import main

if __name__ == "__main__":  # not when a spawned worker (g4h parity --jobs) imports this module again
    sys.exit(main())
