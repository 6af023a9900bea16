"""``g4h parity``: run engine pairs over the case library, apply the gates, write the report.

The job itself is :mod:`.job` (:func:`harness.parity.job.run`, re-exported here as ``run``). Its names are
loaded on first use, so that a light part of the package (:mod:`.compare` for ``g4h compare``, :mod:`.result`)
is imported without the case library, the engines and transformers behind the job (about 3 s per process).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RESULTS_VERSION", "run"]


def __getattr__(name: str) -> Any:
    """``harness.parity.<name>``: a name of :mod:`.job` (``run``, ``RESULTS_VERSION``, ``plan_cases`` ...), imported
    on first use.

    Raises:
        AttributeError: :mod:`.job` has no such name.
    """
    job = importlib.import_module(f"{__name__}.job")  # heavy (the case library, engines, transformers)
    try:
        return getattr(job, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
