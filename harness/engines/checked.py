"""Every engine's output, checked: :class:`CheckedEngine` wraps what :func:`harness.engines.make_engine` builds.

The check itself is :mod:`harness.core.finite`: logits and greedy log-probs must be finite, and so must every
trace point when the engine is traced. This wrapper applies it to whatever an engine returns, so a new engine is
checked without a line of its own:

* ``logits(ids, trace=...)``: the trace callback is wrapped (:class:`harness.core.finite.FiniteTrace`: the first
  non-finite point ends the run, named); the logits are checked; when only they fail, the same prompt runs again
  with a trace to find the first layer and point (in-process engines: a callback; an engine that writes trace
  files, ``cmd:``: its ``trace`` request, read and scanned record by record);
* ``logits_many(seqs, trace=...)`` (llama.cpp: several prompts in one worker): the logits and the trace points
  of each;
* ``logits_chains(chains)`` (the reference's many forwards in one pass over the weights,
  :func:`reference.batch.forward_chains`): each chain's trace points, and the logits of every call;
* ``trace_file(...)`` (``cmd:``): the trace the engine wrote, record by record (its checksums: a non-finite
  activation has a non-finite sum, L2 norm or largest magnitude);
* ``generate_full(...)``, ``generate_speculative(...)``: the top log-probabilities of every step; the fast engine
  checks every step's whole logits row in its own loop (:class:`fast.engine.NonFiniteLogits`), turned here into
  the same line.

A failure is :class:`harness.core.workers.EngineOutputError` (exit 1, "the engine is wrong"), except for the
reference, the specification: its non-finite float64 output means the model cannot be computed at all
(:class:`harness.core.finite.ModelOverflow`, exit 2). Every other attribute is the engine's own.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_text

from ..core.finite import (
    FiniteTrace,
    ModelOverflow,
    check_logits,
    check_logprobs,
    describe,
    first_nonfinite,
    locate,
    point_name,
)
from ..core.workers import EngineOutputError, temp_folder
from ..core.engine_kinds import ORACLE

WRAPPED = ("logits", "logits_many", "logits_chains", "generate_full", "generate_speculative", "trace_file")
"""The methods whose results are checked; the rest pass through untouched."""


class CheckedEngine:
    """An engine whose outputs go through the output check (see the module docstring).

    Args:
        engine: any engine (:class:`harness.engines.base.Engine`).
        kind: its kind (``reference``, ``fast``, ``cmd`` ...): the reference's failures are bad input.
    """

    def __init__(self, engine: Any, kind: str) -> None:
        self.__dict__["_engine"] = engine
        self.__dict__["_fault"] = ModelOverflow if kind == ORACLE else EngineOutputError
        self.__dict__["_kind"] = kind

    @property
    def unchecked(self) -> Any:
        """The engine itself."""
        return self._engine

    @property  # type: ignore[misc]
    def __class__(self):  # isinstance(checked, FastEngine) holds, as for the engine itself (unittest.mock's way)
        return type(self._engine)

    def _label(self) -> str:
        name = getattr(self._engine, "name", None) or self._kind
        return f"engine {name}" if self._kind != ORACLE else "reference (float64)"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name in WRAPPED and callable(attr):
            return getattr(self, f"_checked_{name}")
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def __enter__(self) -> "CheckedEngine":  # dunders are looked up on the class, not through __getattr__
        enter = getattr(self._engine, "__enter__", None)
        if enter is not None:
            enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        exit_ = getattr(self._engine, "__exit__", None)
        if exit_ is not None:
            exit_(*exc)
        elif hasattr(self._engine, "close"):
            self._engine.close()

    # ------------------------------------------------------------------ logits

    def _checked_logits(self, ids: Any, trace: Callable | None = None, **kw: Any) -> Any:
        eng = self._engine
        wrapped = None if trace is None else FiniteTrace(trace, self._label(), self._fault)
        z = eng.logits(ids, trace=wrapped, **kw) if wrapped is not None else eng.logits(ids, **kw)
        check_logits(self._label(), z, locate_fn=lambda: self._locate(ids), fault=self._fault)
        return z

    def _locate(self, ids: Any) -> str | None:
        """The first non-finite layer and point of the forward of ``ids``, from a traced run (None: the engine gives
        no trace points, or all were finite)."""
        eng = self._engine
        if hasattr(eng, "trace_file"):
            return _locate_in_trace_file(eng, ids)
        if "trace" not in (getattr(eng, "ops", None) or ("trace",)):
            return None
        try:
            return locate(lambda tr: eng.logits(ids, trace=tr))
        except (InputError, NotImplementedError, TypeError):  # the engine cannot trace this input
            return None

    def _checked_logits_many(self, seqs: Sequence[Sequence[int]], trace: bool = False, **kw: Any) -> Any:
        out = self._engine.logits_many(seqs, trace=trace, **kw)
        for k, (z, points) in enumerate(out):
            for point, layer, arr in points or ():
                at = first_nonfinite(arr)
                if at is not None:
                    raise self._fault(f"{self._label()}: non-finite output, first at "
                                      f"{point_name(point, int(layer))}: {describe(arr, at)} (prompt {k})")
            check_logits(self._label(), z, where=f"prompt {k}",
                         locate_fn=None if trace else (lambda ids=seqs[k]: self._locate_many(ids)), fault=self._fault)
        return out

    def _checked_logits_chains(self, chains: Sequence[Any], **kw: Any) -> Any:
        for c in chains:  # the caller's chains, built for this call: their trace callbacks wrapped in place
            if c.traces:
                c.traces = [None if t is None else FiniteTrace(t, self._label(), self._fault) for t in c.traces]
        out = self._engine.logits_chains(chains, **kw)
        for i, calls in enumerate(out):
            for j, z in enumerate(calls):
                if z is not None:
                    check_logits(self._label(), z, where=f"forward {i}" + (f", call {j}" if len(calls) > 1 else ""),
                                 fault=self._fault)
        return out

    def _locate_many(self, ids: Sequence[int]) -> str | None:
        try:
            (_, points), = self._engine.logits_many([ids], trace=True)
        except (InputError, NotImplementedError, TypeError, ValueError):
            return None
        for point, layer, arr in points or ():
            at = first_nonfinite(arr)
            if at is not None:
                return f"{point_name(point, int(layer))}: {describe(arr, at)}"
        return None

    def _checked_trace_file(self, ids: Any, out: Any, *args: Any, **kw: Any) -> Any:
        path = self._engine.trace_file(ids, out, *args, **kw)
        first = _first_nonfinite_record(path)
        if first is not None:
            raise self._fault(f"{self._label()}: non-finite output, first at {first} (its trace {path})")
        return path

    # ------------------------------------------------------------------ generation

    def _checked_generate_full(self, prompts: Any, max_new_tokens: int, *args: Any, **kw: Any) -> Any:
        return self._checked_streams("generate_full", prompts, max_new_tokens, *args, **kw)

    def _checked_generate_speculative(self, prompts: Any, max_new_tokens: int, *args: Any, **kw: Any) -> Any:
        return self._checked_streams("generate_speculative", prompts, max_new_tokens, *args, **kw)

    def _checked_streams(self, method: str, prompts: Any, max_new_tokens: int, *args: Any, **kw: Any) -> Any:
        eng = self._engine
        try:
            out = getattr(eng, method)(prompts, max_new_tokens, *args, **kw)
        except ArithmeticError as e:  # the fast engine's own loop: the whole logits row of every step
            if not _is_nonfinite_logits(e):
                raise
            first = self._locate(e.ids)
            first_txt = f"first at {first}" if first else "first at the logits"
            raise self._fault(f"{self._label()}: non-finite output, {first_txt}; generate: request {e.request}, "
                              f"step {e.step}: logits {e.what}") from None
        streams = out if isinstance(out, (list, tuple)) else [out]
        seqs = prompts if isinstance(out, (list, tuple)) else [prompts]

        def where(k: int, step: int) -> str | None:
            p = seqs[k]
            ids = getattr(p, "ids", p)
            if not isinstance(ids, (list, tuple)):
                return None
            return self._locate(list(ids) + list(streams[k].tokens[:step]))

        check_logprobs(self._label(), streams, locate_fn=where, fault=self._fault)
        return out


def _is_nonfinite_logits(e: BaseException) -> bool:
    """``e`` is :class:`fast.engine.NonFiniteLogits` (looked up, not imported: checking the reference must not
    import torch)."""
    cls = getattr(sys.modules.get("gemma4_harness.fast.engine"), "NonFiniteLogits", None)
    return cls is not None and isinstance(e, cls)


def _locate_in_trace_file(eng: Any, ids: Any) -> str | None:
    """The first non-finite record (:func:`_first_nonfinite_record`) of a ``cmd:`` engine's trace of ``ids``; None
    when the engine does not trace, its trace cannot be read, or every record is finite."""
    if "trace" not in (getattr(eng, "ops", None) or ()):
        return None
    try:
        with temp_folder("g4h-locate-") as tmp:
            return _first_nonfinite_record(eng.trace_file(list(ids), Path(tmp) / "trace.jsonl"))
    except (InputError, OSError, EngineOutputError):
        return None


def _first_nonfinite_record(path: Any) -> str | None:
    """The first record of a trace file (in the order the engine wrote them: its computation order) whose checksums
    are not finite (``sum``, ``l2`` or ``absmax``: ``"NaN"``, ``"Infinity"`` in the file, ``docs/trace-format.md``),
    as ``layer L, point P: its sum is NaN``; None when every record is finite or the file is no trace (its reader
    says so later). The file is scanned here, not through :mod:`harness.traces`, a sibling layer."""
    try:
        lines = read_text(path, streams=False).splitlines()
    except InputError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            return None
        sums = rec.get("checksums") if isinstance(rec, dict) else None
        if not isinstance(sums, dict) or "point" not in rec:
            continue  # the header
        bad = [k for k in ("sum", "l2", "absmax") if not _finite(sums.get(k, 0.0))]
        if bad:
            layer = rec.get("layer", -1)
            return (f"{point_name(str(rec['point']), layer if isinstance(layer, int) else -1)}: its {bad[0]} is "
                    f"{sums[bad[0]]}")
    return None


def _finite(x: Any) -> bool:
    if isinstance(x, str):
        return x not in ("NaN", "Infinity", "-Infinity")
    return not isinstance(x, float) or math.isfinite(x)
