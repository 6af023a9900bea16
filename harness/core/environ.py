"""Environment variables set for a scope: what a run hands its worker processes (``--explain-budget``, ``--spec``,
thread counts) without leaving it behind in the caller's process (the pytest plugin and tests run ``g4h`` in
theirs)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The variables the OpenMP and BLAS pools of a process read their thread count from when they start: what a run
sets for the worker processes it spawns (``--jobs``) and for the tasks it sends to a cluster's nodes."""


@contextlib.contextmanager
def environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """While inside, ``os.environ[name] = value`` for each item (a None value leaves that name as it is); on exit,
    every name of ``values`` is as it was before (removed where it was not set), whatever happened inside."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
