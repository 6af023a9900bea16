"""Traces: what an engine reports at the trace points while it runs one prompt.

Trace points use llama.cpp's graph-callback names (:data:`KNOWN_POINTS`). A trace callback is a
:data:`TraceFn`, ``(point, layer, array [T, ...]) -> None``; engines call it, and these classes
collect what it receives:

* :class:`TraceRecorder` keeps the arrays in memory (parity checks, the self-test);
* :class:`ConcatRecorder` joins the arrays of a forward run in several steps (chunked prefill);
* :class:`~harness.traces.format.TraceWriter` keeps checksums (and optionally tensors) for a trace
  file (``docs/trace-format.md``).

Modules: :mod:`.format` (checksums, the trace object, read and write), :mod:`.compare` (per-point
errors and the first divergence), :mod:`.llama_dump` (llama.cpp eval-callback dumps).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gemma4_harness.reference.model import TraceFn

from ..core.metrics import rel_l2
from .format import INPUT_POINTS, KNOWN_POINTS, LAYER_POINTS, OUTPUT_POINTS

__all__ = ["ConcatRecorder", "INPUT_POINTS", "KNOWN_POINTS", "LAYER_POINTS", "OUTPUT_POINTS", "TraceFn",
           "TraceRecorder", "layer_errors"]


class TraceRecorder:
    """A :data:`TraceFn` that keeps every array as float64: ``points[(point, layer)]``, in call order."""

    def __init__(self) -> None:
        self.points: dict[tuple[str, int], np.ndarray] = {}

    def __call__(self, point: str, layer: int, arr: np.ndarray) -> None:
        self.points[(point, layer)] = np.asarray(arr, dtype=np.float64)


class ConcatRecorder:
    """A :data:`TraceFn` for a forward run in several steps: each point's arrays joined along the token axis."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, int], list[np.ndarray]] = {}

    def __call__(self, point: str, layer: int, arr: np.ndarray) -> None:
        self.parts.setdefault((point, layer), []).append(np.asarray(arr, dtype=np.float64))

    def recorder(self) -> TraceRecorder:
        """The joined arrays as a :class:`TraceRecorder` (same order of points)."""
        rec = TraceRecorder()
        rec.points = {k: np.concatenate(v, axis=0) for k, v in self.parts.items()}
        return rec


def layer_errors(ours: TraceRecorder, oracle: TraceRecorder) -> list[dict[str, Any]]:
    """Relative L2 (:func:`harness.core.metrics.rel_l2`, the oracle's norm below) of every trace point
    present in both recordings with the same shape, in our call order.

    Returns:
        ``[{"point", "layer", "rel_l2"}, ...]``.
    """
    rows = []
    for key, a in ours.points.items():
        if key in oracle.points and oracle.points[key].shape == a.shape:
            rows.append({"point": key[0], "layer": key[1], "rel_l2": rel_l2(a, oracle.points[key])})
    return rows
