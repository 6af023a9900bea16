"""The output check: an engine that returns NaN or Inf has failed, and the line says where it first went wrong.

One check for every engine (:class:`harness.engines.checked.CheckedEngine` applies it to whatever an engine returns;
the fast engine's decode loop applies its torch twin to every step, :mod:`fast.engine`):

* **logits** ``[T, V]``: every value finite (NaN, +Inf and -Inf all fail: a Gemma 4 logit is bounded, by the final
  softcap when the model has one, and an engine masks nothing in a logits request);
* **trace points**, when the engine is traced: every activation finite; the first non-finite point in the order
  the engine reports them (its computation order) ends the run (:class:`FiniteTrace`);
* **greedy streams**: no top log-probability NaN or +Inf (-Inf is a probability of exactly 0: a server that lists
  tokens after greedy sampling reports it, and an underflowing softmax gives it); an engine that returns only tokens
  is checked by its own loop, where the harness has one.

A failure is :class:`harness.core.workers.EngineOutputError` (exit 1: the engine is wrong), one line: the engine,
the first layer and trace point where a value stopped being finite (found by running the same prompt again with a
trace when the logits alone failed, :func:`locate`), and what was not finite there. The reference is the
specification, not an engine under test: when *its* float64 numbers overflow, the model cannot be computed by any
engine and the line is bad input instead (:class:`ModelOverflow`, exit 2).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from gemma4_harness.reference.errors import ModelFileError

from .workers import EngineOutputError


class ModelOverflow(ModelFileError):
    """The reference's float64 computation of this model is not finite: its weights (or its prompt) carry values
    no engine can compute with. Bad input (exit 2), one line naming the layer and point."""


class _Found(Exception):
    """Raised inside a traced forward to stop it at the first non-finite point (:func:`locate`)."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def first_nonfinite(arr: Any) -> tuple[int, ...] | None:
    """The index of the first value (row-major) that is NaN or +-Inf, or None when all are finite."""
    a = np.asarray(arr)
    if a.dtype.kind not in "fc":
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(a)
    if not bad.any():
        return None
    flat = int(np.argmax(bad.reshape(-1)))
    return tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.ndim else ()


def describe(arr: Any, at: tuple[int, ...]) -> str:
    """``NaN at [t, i] (k of N values NaN/Inf)`` for an array whose first non-finite value is at ``at``."""
    a = np.asarray(arr)
    v = float(a[at]) if a.ndim else float(a)
    what = "NaN" if np.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    with np.errstate(invalid="ignore"):
        n_bad = int(np.count_nonzero(~np.isfinite(a)))
    return f"{what} at {list(at)} ({n_bad} of {a.size} values NaN/Inf)"


def point_name(point: str, layer: int) -> str:
    """``layer 3, point ffn_out`` (``point result_output`` for a point outside the layers)."""
    return f"layer {layer}, point {point}" if layer >= 0 else f"point {point}"


class FiniteTrace:
    """A trace callback ``(point, layer, array)`` that passes every point on to ``inner`` (if any) and stops the run
    at the first non-finite one.

    Args:
        inner: the caller's trace (a :class:`harness.traces.format.TraceWriter`), or None.
        engine: the engine's name, for the line.
        fault: what to raise (``EngineOutputError``; ``_Found`` inside :func:`locate`; :class:`ModelOverflow` for
            the reference).
    """

    def __init__(self, inner: Callable | None, engine: str, fault: type[Exception] = EngineOutputError) -> None:
        self.inner, self.engine, self.fault = inner, engine, fault

    def __call__(self, point: str, layer: int, array: Any) -> None:
        at = first_nonfinite(array)
        if at is not None:
            where = f"{point_name(point, int(layer))}: {describe(array, at)}"
            if self.fault is _Found:
                raise _Found(where)
            raise self.fault(f"{self.engine}: non-finite output, first at {where}")
        if self.inner is not None:
            self.inner(point, layer, array)


def locate(run: Callable[[Callable], Any]) -> str | None:
    """Where a forward first stops being finite: ``run(trace)`` runs the same forward with a trace callback; the
    first non-finite trace point is returned as ``layer L, point P: NaN at [t, i] (...)``, or None when every point
    was finite (or the engine gives no trace points)."""
    try:
        run(FiniteTrace(None, "", _Found))
    except _Found as f:
        return f.where
    return None


def check_logits(engine: str, logits: Any, where: str = "", locate_fn: Callable[[], str | None] | None = None,
                 fault: type[Exception] = EngineOutputError) -> None:
    """Fail when ``logits`` holds a NaN or Inf.

    Args:
        engine: the engine's name, for the line.
        logits: ``[T, V]`` (or ``[V]``) array.
        where: what produced them (``prompt 3``, ``generate: prompt 0, step 5``), for the line.
        locate_fn: called only on a failure: the first non-finite layer and point (:func:`locate`), or None.
        fault: the exception class (:class:`EngineOutputError`, or :class:`ModelOverflow` for the reference).

    Raises:
        fault: one line: ``<engine>: non-finite output, first at layer L, point P: ...; logits: NaN at [t, v] ...``.
    """
    at = first_nonfinite(logits)
    if at is None:
        return
    logit = f"logits{f' of {where}' if where else ''}: {describe(logits, at)}"
    first = locate_fn() if locate_fn is not None else None
    if first is None:
        first_txt = "first at the logits (the engine's trace points were finite, or it reports none)"
    else:
        first_txt = f"first at {first}"
    raise fault(f"{engine}: non-finite output, {first_txt}; {logit}")


def check_logprobs(engine: str, streams: Sequence[Any], where: str = "generate",
                   locate_fn: Callable[[int, int], str | None] | None = None,
                   fault: type[Exception] = EngineOutputError) -> None:
    """Fail when a greedy stream's top log-probabilities hold a NaN or +Inf (``Generated``-like objects with ``top``,
    a list of steps of ``(id, logprob)`` pairs); -Inf, a probability of 0, is a log-probability.

    ``locate_fn(k, step)``: the first non-finite layer and point of stream ``k``'s forward at ``step``, or None.

    Raises:
        fault: one line naming the stream, the step and, when found, the layer and point.
    """
    for k, g in enumerate(streams):
        for step, pairs in enumerate(getattr(g, "top", None) or ()):
            vals = np.array([lp for _, lp in pairs], dtype=np.float64)
            if vals.size and (np.isnan(vals).any() or (vals == np.inf).any()):
                first = locate_fn(k, step) if locate_fn is not None else None
                first_txt = f"first at {first}" if first else "first at the logits"
                raise fault(f"{engine}: non-finite output, {first_txt}; {where}: prompt {k}, step {step}: "
                            f"top log-probs {[float(v) for v in vals[:3]]}")
