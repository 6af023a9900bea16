"""``python -m gemma4_harness.harness.engines.variants``: print ``docs/spec-variants.md``
(:func:`harness.engines.variants.markdown`)."""

import sys

from . import main

sys.exit(main())
