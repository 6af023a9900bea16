"""``python -m gemma4_harness``: the same as ``g4h``."""

import sys

from gemma4_harness.harness.cli import main

if __name__ == "__main__":  # not when a spawned worker imports this module again
    sys.exit(main())
