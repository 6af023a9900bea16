"""Trace files: write, read, compare (``g4h trace`` / ``g4h diff``), and import llama.cpp eval-callback dumps.

A *trace* is what an engine reports at the trace points of DESIGN.md ("Trace
points and the trace file") while it runs one prompt: per (point, layer) the
shape, dtype and a few checksums of the activation ``[T, ...]``. The file
format (versioned JSONL, ``g4h-trace`` version 1) is specified in
``docs/trace-format.md``; this module is its one reader and writer.

* :class:`TraceWriter` is a trace callback ``(point, layer, array)`` that
  collects records (and, on request, the full tensors, dumped beside the trace
  as safetensors named ``point.layer``).
* :func:`read_trace` reads a file back, refusing anything that is not a
  complete ``g4h-trace`` of a version this code reads (:class:`InputError`, one line).
* :func:`compare` lines two traces up per (point, layer) in the canonical
  trace order (:func:`canonical_key`) and names the first point that diverges.
  From checksums alone it computes *lower bounds* of the relative error
  (:func:`checksum_error`); with tensor dumps on both sides the full relative
  L2 error, cosine and max |a - b|.
* :func:`import_llama_dump` converts a llama.cpp eval-callback dump (the text
  ``llama-eval-callback`` prints, or a JSONL written by a ``cb_eval`` callback,
  both described in ``docs/trace-format.md``) into a trace that lines up with ours.

Shapes: T = prompt tokens; a record's ``shape`` is numpy (row-major) order,
``[T, n]`` for most points, ``[T, L, P]`` for ``inp_per_layer``. llama.cpp's
``ne`` lists dimensions fastest first, so ``shape == reversed(ne)`` (trailing
1s dropped down to the point's rank).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from reference.errors import InputError

TRACE_FORMAT = "g4h-trace"
"""Value of the header's ``format`` field."""

TRACE_VERSION = 1
"""The trace format version this module writes and reads."""

N_LEADING = 8
"""How many leading values (flattened, row-major) a record keeps."""

DEFAULT_TOL = 1e-3
"""``g4h diff`` default tolerance on the relative error (see :func:`compare`)."""

INPUT_POINTS = ("inp_scaled", "inp_per_layer")
"""Points before the first layer (layer -1), in trace order."""

LAYER_POINTS = ("attn_out", "ffn_mlp", "ffn_moe", "ffn_out", "per_layer_embd_out", "l_out")
"""Per-layer points, in trace order (llama.cpp graph-callback names)."""

OUTPUT_POINTS = ("result_norm", "result_output")
"""Points after the last layer (layer -1), in trace order."""

KNOWN_POINTS = INPUT_POINTS + LAYER_POINTS + OUTPUT_POINTS

POINT_RANK = {"inp_per_layer": 3}
"""Number of numpy dimensions of a point's array when not 2 (``[T, L, P]``)."""

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


# --------------------------------------------------------------------------- checksums


def _num(x: float) -> float | str:
    """A float for JSON: finite as is, NaN/Inf as ``"NaN"``/``"Infinity"``/``"-Infinity"`` (as harness.report)."""
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _unnum(x: Any, where: str) -> float | None:
    """Inverse of :func:`_num`; None stays None (a checksum the source could not give)."""
    if x is None:
        return None
    if isinstance(x, bool):
        raise InputError(f"{where}: expected a number, got {x!r}")
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and x in _NONFINITE:
        return _NONFINITE[x]
    raise InputError(f"{where}: expected a number, got {x!r:.40}")


def checksums(arr: np.ndarray, n_leading: int = N_LEADING) -> dict[str, Any]:
    """Checksums of one activation, computed in float64 over all elements (row-major order).

    Args:
        arr: any shape, any real dtype (``[T, ...]`` for a trace point).
        n_leading: how many leading values to keep.

    Returns:
        ``{"sum", "mean", "l2", "absmax", "first"}``: ``sum(x)``, ``sum(x)/n``,
        ``sqrt(sum(x^2))``, ``max|x|`` and ``x.ravel()[:n_leading]`` (floats;
        NaN/Inf kept as floats here, encoded as strings in the file). An empty
        array gives zeros and ``first = []``.

    Source: ``docs/trace-format.md`` (the format this module defines).
    """
    x = np.asarray(arr, dtype=np.float64).ravel()
    if x.size == 0:
        return {"sum": 0.0, "mean": 0.0, "l2": 0.0, "absmax": 0.0, "first": []}
    with np.errstate(over="ignore", invalid="ignore"):
        s = float(np.sum(x))
        l2 = float(np.linalg.norm(x))
        am = float(np.max(np.abs(x)))
    return {"sum": s, "mean": s / x.size, "l2": l2, "absmax": am, "first": [float(v) for v in x[:n_leading]]}


# --------------------------------------------------------------------------- the trace object


def tensor_name(point: str, layer: int) -> str:
    """Name of a dumped tensor: ``"<point>.<layer>"`` (``"l_out.3"``, ``"inp_scaled.-1"``)."""
    return f"{point}.{int(layer)}"


def canonical_key(point: str, layer: int) -> tuple[int, int, int]:
    """Sort key of the canonical trace order: inputs, then layers 0.. (points in :data:`LAYER_POINTS`
    order), then outputs. Unknown point names sort after the known ones of their layer (Python's sort is
    stable, so among themselves they keep file order).

    Returns:
        ``(section, layer, rank)`` with section 0 = input, 1 = layer, 2 = output.
    """
    if layer < 0:
        if point in OUTPUT_POINTS or point.startswith("result"):
            sec, order = 2, OUTPUT_POINTS
        else:
            sec, order = 0, INPUT_POINTS
        return sec, 0, order.index(point) if point in order else len(order)
    return 1, int(layer), LAYER_POINTS.index(point) if point in LAYER_POINTS else len(LAYER_POINTS)


@dataclass
class Trace:
    """One trace: the header, the records in file order, and (optionally) the full tensors.

    Attributes:
        header: the header object (see ``docs/trace-format.md``).
        records: one dict per (point, layer): ``engine, case, point, layer, shape, dtype, checksums``
            (checksum values are floats or None; see :func:`checksums`).
        path: the file it was read from (None for an in-memory trace).
        tensors: ``{"point.layer": float64 array}`` when held in memory (a :class:`TraceWriter` with
            ``keep_tensors``), else None; see :meth:`tensor`.
    """

    header: dict[str, Any]
    records: list[dict[str, Any]]
    path: Path | None = None
    tensors: dict[str, np.ndarray] | None = None
    _loaded: bool = field(default=False, repr=False)

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (header ``prompt_ids``)."""
        return list(self.header.get("prompt_ids", []))

    @property
    def label(self) -> str:
        """The file path, or ``<engine>`` for an in-memory trace (for messages)."""
        return str(self.path) if self.path is not None else f"<{self.header.get('engine', 'trace')}>"

    def by_key(self) -> dict[tuple[str, int], dict[str, Any]]:
        """``{(point, layer): record}``."""
        return {(r["point"], int(r["layer"])): r for r in self.records}

    def has_tensors(self) -> bool:
        """True when full tensors are in memory or a dump file is named in the header."""
        return self.tensors is not None or bool(self.header.get("tensors"))

    def tensor(self, point: str, layer: int) -> np.ndarray | None:
        """The full tensor of (point, layer) as float64, or None when there is no dump or it lacks it.

        Raises:
            InputError: the header names a dump file that cannot be read.
        """
        if self.tensors is None and self.header.get("tensors") and not self._loaded:
            self.tensors = load_dump(self)
            self._loaded = True
        if self.tensors is None:
            return None
        t = self.tensors.get(tensor_name(point, layer))
        return None if t is None else np.asarray(t, dtype=np.float64)


class TraceWriter:
    """A trace callback ``(point, layer, array)`` that collects a trace of one prompt.

    Args:
        engine: engine name for the header and every record (``reference``, ``fast-cpu-float32`` ...).
        prompt_ids: the prompt's token ids (the header's ``prompt_ids``: ``g4h diff`` refuses to compare
            traces of different prompts).
        case: case name (a built-in case, or the model's name).
        model: model path or description.
        dtype: dtype the engine holds the traced activations in (``float64`` for the reference,
            ``float32`` otherwise); default: the dtype of the array handed to the callback.
        device: device the engine ran on (header only).
        keep_tensors: also keep a float64 copy of every array (for ``--dump-tensors`` or in-memory diffs).
        extra: more header fields.

    Raises:
        ValueError: (from the callback) the same (point, layer) reported twice, or a non-array.
    """

    def __init__(self, engine: str, prompt_ids: Sequence[int], *, case: str | None = None, model: str | None = None,
                 dtype: str | None = None, device: str | None = None, keep_tensors: bool = False,
                 extra: Mapping[str, Any] | None = None):
        self.engine = str(engine)
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.case = case
        self.model = model
        self.dtype = dtype
        self.device = device
        self.keep_tensors = keep_tensors
        self.extra = dict(extra or {})
        self.records: list[dict[str, Any]] = []
        self.tensors: dict[str, np.ndarray] = {}
        self._seen: set[tuple[str, int]] = set()

    def __call__(self, point: str, layer: int, arr) -> None:
        """Record one trace point. ``arr``: ``[T, ...]`` numpy array (any real dtype)."""
        key = (str(point), int(layer))
        if key in self._seen:
            raise ValueError(f"trace point {key[0]}@{key[1]} reported twice")
        self._seen.add(key)
        a = np.asarray(arr)
        self.records.append({
            "engine": self.engine, "case": self.case, "point": key[0], "layer": key[1],
            "shape": [int(s) for s in a.shape], "dtype": self.dtype or str(a.dtype),
            "checksums": checksums(a),
        })
        if self.keep_tensors:
            self.tensors[tensor_name(*key)] = np.array(a, dtype=np.float64, copy=True)

    def header(self) -> dict[str, Any]:
        """The header object (``n_records`` = records so far; ``tensors`` filled in by :meth:`write`)."""
        h = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "engine": self.engine, "case": self.case,
             "model": self.model, "prompt_ids": self.prompt_ids, "n_tokens": len(self.prompt_ids),
             "dtype": self.dtype, "device": self.device,
             "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "n_records": len(self.records), "tensors": None}
        h.update(self.extra)
        return h

    def trace(self) -> Trace:
        """The collected trace in memory (tensors included when ``keep_tensors``)."""
        return Trace(header=self.header(), records=[dict(r) for r in self.records],
                     tensors=dict(self.tensors) if self.keep_tensors else None)

    def write(self, path: str | os.PathLike, dump_dir: str | os.PathLike | None = None) -> Path:
        """Write the trace (and with ``dump_dir`` the tensors) atomically; see :func:`write_trace`.

        Raises:
            ValueError: ``dump_dir`` given but the writer was made without ``keep_tensors``.
            InputError: a destination cannot be written.
        """
        if dump_dir is not None and not self.keep_tensors:
            raise ValueError("TraceWriter: dump_dir needs keep_tensors=True")
        return write_trace(path, self.header(), self.records, self.tensors if dump_dir is not None else None,
                           dump_dir)


# --------------------------------------------------------------------------- writing / reading


def _record_json(rec: Mapping[str, Any]) -> dict[str, Any]:
    cs = rec["checksums"]
    out = {k: rec[k] for k in ("engine", "case", "point", "layer", "shape", "dtype")}
    out["checksums"] = {k: (None if cs.get(k) is None else _num(cs[k])) for k in ("sum", "mean", "l2", "absmax")}
    out["checksums"]["first"] = [_num(v) for v in cs.get("first", [])]
    for k, v in rec.items():  # optional fields (abs_precision, source_name, ...)
        if k not in out and k != "checksums":
            out[k] = v
    return out


def write_trace(path: str | os.PathLike, header: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
                tensors: Mapping[str, np.ndarray] | None = None, dump_dir: str | os.PathLike | None = None) -> Path:
    """Write a trace file (JSONL: header line, then one record per line), atomically.

    With ``tensors`` and ``dump_dir``, the tensors go to ``<dump_dir>/<trace stem>.safetensors``
    (names ``point.layer``; float32 when the record dtype is a 32- or 16-bit float, else float64)
    and the header's ``tensors`` field gets that file's path relative to the trace's folder.

    Args:
        path: destination ``.jsonl``; its folder is created if missing.
        header: header fields (``format``/``version``/``n_records`` are set here).
        records: the records (see :class:`Trace`).
        tensors: ``{"point.layer": array}``.
        dump_dir: folder for the safetensors dump (created if missing).

    Returns:
        ``path``.

    Raises:
        InputError: a destination cannot be written (named).
    """
    from .report import to_jsonable, write_bytes_atomic, write_text_atomic

    dest = Path(path)
    head = dict(header)
    head.update(format=TRACE_FORMAT, version=TRACE_VERSION, n_records=len(records), tensors=None)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if tensors is not None and dump_dir is not None:
            from safetensors.numpy import save

            ddir = Path(dump_dir)
            ddir.mkdir(parents=True, exist_ok=True)
            dump = ddir / (dest.stem + ".safetensors")
            dtypes = {tensor_name(r["point"], r["layer"]): str(r.get("dtype")) for r in records}
            arrays = {}
            for name, arr in tensors.items():
                small = dtypes.get(name) in ("float32", "float16", "bfloat16")
                arrays[name] = np.ascontiguousarray(arr, dtype=np.float32 if small else np.float64)
            meta = {"format": "g4h-trace-tensors", "version": str(TRACE_VERSION),
                    "prompt_ids": json.dumps(head.get("prompt_ids", []))}
            write_bytes_atomic(dump, save(arrays, metadata=meta))
            head["tensors"] = os.path.relpath(dump.resolve(), dest.parent.resolve())
        lines = [json.dumps(to_jsonable(head), ensure_ascii=False, allow_nan=False)]
        lines += [json.dumps(_record_json(r), ensure_ascii=False, allow_nan=False) for r in records]
        write_text_atomic(dest, "\n".join(lines) + "\n")
    except OSError as e:
        raise InputError(f"{e.filename or dest}: cannot write trace ({e.strerror or e})") from None
    return dest


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def _parse_record(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object (a trace record)")
    for k in ("point", "layer", "shape", "checksums"):
        if k not in obj:
            raise InputError(f"{where}: record has no {k!r} field")
    if not isinstance(obj["point"], str) or not obj["point"]:
        raise InputError(f"{where}: point: expected a non-empty string")
    if not isinstance(obj["layer"], int) or isinstance(obj["layer"], bool):
        raise InputError(f"{where}: layer: expected an integer")
    if not _is_int_list(obj["shape"]) or any(s < 0 for s in obj["shape"]):
        raise InputError(f"{where}: shape: expected a list of non-negative integers")
    cs = obj["checksums"]
    if not isinstance(cs, dict):
        raise InputError(f"{where}: checksums: expected an object")
    out = dict(obj)
    first = cs.get("first", [])
    if not isinstance(first, list):
        raise InputError(f"{where}: checksums.first: expected a list")
    out["checksums"] = {k: _unnum(cs.get(k), f"{where}: checksums.{k}") for k in ("sum", "mean", "l2", "absmax")}
    out["checksums"]["first"] = [_unnum(v, f"{where}: checksums.first") for v in first]
    return out


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a ``g4h-trace`` file (see ``docs/trace-format.md``).

    Args:
        path: the ``.jsonl`` file.

    Returns:
        :class:`Trace` (tensors are loaded lazily from the dump the header names).

    Raises:
        InputError: unreadable file; empty; a first line that is not a ``g4h-trace`` header; a version
            other than :data:`TRACE_VERSION`; bad ``prompt_ids``; a malformed or duplicate record; fewer
            or more records than the header's ``n_records`` (a truncated file). One line, naming the file.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{p}: not a g4h trace (not UTF-8 text)") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read trace ({e.strerror or e})") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise InputError(f"{p}: empty file (expected a g4h trace: a JSON header line, then records)")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != TRACE_FORMAT:
        raise InputError(f"{p}: not a g4h trace (the first line must be a JSON header with "
                         f"\"format\": \"{TRACE_FORMAT}\")")
    ver = head.get("version")
    if ver != TRACE_VERSION:
        raise InputError(f"{p}: g4h trace version {ver!r}; this g4h reads version {TRACE_VERSION}")
    if not _is_int_list(head.get("prompt_ids")):
        raise InputError(f"{p}: header prompt_ids: expected a list of integer token ids")
    records, seen = [], set()
    for n, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(f"{where}: not valid JSON (truncated trace?)") from None
        rec = _parse_record(obj, where)
        key = (rec["point"], rec["layer"])
        if key in seen:
            raise InputError(f"{where}: second record for {key[0]}@{key[1]}")
        seen.add(key)
        records.append(rec)
    want = head.get("n_records")
    if isinstance(want, int) and want != len(records):
        raise InputError(f"{p}: header says {want} records, the file holds {len(records)} (truncated?)")
    return Trace(header=head, records=records, path=p)


def load_dump(trace: Trace) -> dict[str, np.ndarray]:
    """Load the safetensors dump named by a trace's header (path relative to the trace's folder).

    Raises:
        InputError: the file is missing or not a safetensors file.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    rel = trace.header["tensors"]
    base = trace.path.parent if trace.path is not None else Path.cwd()
    dump = (base / rel) if not os.path.isabs(rel) else Path(rel)
    try:
        return dict(load_file(str(dump)))
    except FileNotFoundError:
        raise InputError(f"{trace.label}: tensor dump {dump} named in the header does not exist") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{dump}: cannot read tensor dump ({str(e).splitlines()[0] if str(e) else e})") from None


# --------------------------------------------------------------------------- comparing


def check_same_prompt(a: Trace, b: Trace) -> None:
    """Refuse to compare traces of different prompts.

    Raises:
        InputError: the header ``prompt_ids`` differ (the message gives both lengths and the first
            differing position).
    """
    pa, pb = a.prompt_ids, b.prompt_ids
    if pa == pb:
        return
    pos = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
    raise InputError(f"{a.label} and {b.label} trace different prompts ({len(pa)} vs {len(pb)} tokens, "
                     f"first difference at position {pos})")


def _maxabs_known(*vals: float | None) -> float | None:
    known = [abs(v) for v in vals if v is not None and not math.isnan(v)]
    return max(known) if known else None


def checksum_error(ca: Mapping[str, Any], cb: Mapping[str, Any], n: int, precision: float = 0.0) -> dict[str, float]:
    """Lower bounds of the relative error of two tensors of ``n`` elements from their checksums alone.

    With ``L = max(l2_a, l2_b)`` and ``M = max(absmax_a, absmax_b)`` (whichever are known):

    * ``l2``:     ``| l2_a - l2_b | / L``                  <= ||a-b||_2 / L  (triangle inequality)
    * ``sum``:    ``| sum_a - sum_b | / (sqrt(n) L)``      <= ||a-b||_2 / L  (Cauchy-Schwarz)
    * ``absmax``: ``| absmax_a - absmax_b | / M``          <= max|a-b| / M
    * ``first``:  ``max_i | first_a[i] - first_b[i] | / M``  <= max|a-b| / M

    so each figure is at most the true relative L2 error or the true max error relative to the larger
    max|x|: a value above a tolerance proves a divergence; a value below does not prove agreement.
    When M is unknown (a source that gave no absmax) the leading values are scaled by ``L / sqrt(n)``
    (the RMS). A statistic either side lacks is skipped. Identical checksums (NaN equal to NaN) give 0;
    any other NaN gives inf.

    ``precision`` (> 0 for printed dumps: the sum of both sides' absolute value rounding) is allowed for
    before dividing: ``precision`` off each leading-value and absmax difference, ``sqrt(n) * precision``
    off the l2 difference, and for the sum (printed with 6 decimals, accumulated in float32 by ggml)
    1e-6 off the difference and ``2^-24 sqrt(n)`` off the bound.

    Args:
        ca, cb: checksum dicts (:func:`checksums`, values may be None).
        n: number of elements (product of the shape).
        precision: absolute rounding of the values the checksums came from, both sides together.

    Returns:
        ``{stat: bound}`` for the statistics both sides have.

    Source: ``docs/trace-format.md`` ("Comparing traces").
    """
    def same(x, y):
        return x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))

    def rel(d: float, den: float | None) -> float:
        if d == 0:
            return 0.0
        if den is None or den == 0 or math.isnan(d) or math.isnan(den):
            return math.inf
        return d / den

    def less(d: float, allowance: float) -> float:
        return d if math.isnan(d) else max(0.0, d - allowance)

    out: dict[str, float] = {}
    L = _maxabs_known(ca.get("l2"), cb.get("l2"))
    M = _maxabs_known(ca.get("absmax"), cb.get("absmax"))
    scale_vals = M if M else (L / math.sqrt(n) if L and n else None)
    root_n = math.sqrt(max(n, 1))
    for stat in ("l2", "sum", "absmax"):
        x, y = ca.get(stat), cb.get(stat)
        if x is None or y is None:
            continue
        if same(x, y):
            out[stat] = 0.0
            continue
        d = abs(x - y)
        if stat == "sum":
            b = rel(less(d, 1e-6 if precision else 0.0), (root_n * L) if L else None)
            out[stat] = less(b, 2.0**-24 * root_n if precision else 0.0)
        elif stat == "l2":
            out[stat] = rel(less(d, root_n * precision), L)
        else:
            out[stat] = rel(less(d, precision), M)
    fa, fb = ca.get("first") or [], cb.get("first") or []
    k = min(len(fa), len(fb))
    if k:
        ds = [0.0 if same(x, y) else less(abs(x - y), precision) for x, y in zip(fa[:k], fb[:k])]
        dmax = math.nan if any(math.isnan(d) for d in ds) else max(ds)
        out["first"] = rel(dmax, scale_vals)
    return out


@dataclass(frozen=True)
class DivergenceRule:
    """When a (point, layer) counts as diverged.

    Attributes:
        tol: relative error bound: the full relative L2 error when both sides have tensors, else the
            checksum lower bound (:func:`checksum_error`); None = not used.
        min_cosine: cosine bound (tensors only); None = not used.
        max_abs: ``{point: bound on max|a - b|}`` (tensors only), e.g. ``{"result_output": 1e-3}``.
    """

    tol: float | None = DEFAULT_TOL
    min_cosine: float | None = None
    max_abs: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: the bounds in force."""
        parts = []
        if self.tol is not None:
            parts.append(f"relative error <= {self.tol:g}")
        if self.min_cosine is not None:
            parts.append(f"cosine >= {self.min_cosine}")
        parts += [f"max|a-b| <= {v:g} at {k}" for k, v in self.max_abs.items()]
        return "; ".join(parts) or "no bounds"


@dataclass
class PointDiff:
    """The comparison of one (point, layer).

    Attributes:
        point, layer: the trace point.
        shape_a, shape_b: the two shapes.
        basis: ``tensors`` (full tensors compared), ``checksums`` (lower bounds only) or ``shape``
            (shapes differ: counts as diverged, error inf).
        bounds: :func:`checksum_error` figures.
        rel_l2: ``||a - b|| / ||b||`` (tensors only; b = the second trace).
        cosine: cosine similarity (tensors only).
        max_abs: ``max|a - b|`` (tensors only).
        err: the figure compared with ``tol``: ``rel_l2`` with tensors, else ``max(bounds)``.
        diverged: beyond the rule.
        why: which bound it broke ("" when not diverged).
    """

    point: str
    layer: int
    shape_a: list[int]
    shape_b: list[int]
    basis: str
    bounds: dict[str, float]
    err: float
    rel_l2: float | None = None
    cosine: float | None = None
    max_abs: float | None = None
    diverged: bool = False
    why: str = ""

    @property
    def where(self) -> str:
        """``point@layer``."""
        return f"{self.point}@{self.layer}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"point": self.point, "layer": self.layer, "shape_a": self.shape_a, "shape_b": self.shape_b,
                "basis": self.basis, "err": self.err, "rel_l2": self.rel_l2, "cosine": self.cosine,
                "max_abs": self.max_abs, "bounds": self.bounds, "diverged": self.diverged, "why": self.why}


@dataclass
class DiffResult:
    """The comparison of two traces.

    Attributes:
        rows: one :class:`PointDiff` per (point, layer) in both traces, canonical trace order.
        only_a, only_b: ``point@layer`` present in one trace only (not counted as divergences).
        skipped: points left out on request.
        rule: the :class:`DivergenceRule` applied.
    """

    rows: list[PointDiff]
    only_a: list[str]
    only_b: list[str]
    skipped: list[str]
    rule: DivergenceRule

    @property
    def first(self) -> PointDiff | None:
        """The first diverged (point, layer) in canonical trace order, or None."""
        return next((r for r in self.rows if r.diverged), None)

    def growth(self) -> list[dict[str, Any]]:
        """Error growth: one row per section (``input``, each layer, ``output``): points compared, the worst
        point and its error, the ``l_out`` error, the cosine minimum (tensors), diverged points."""
        groups: dict[tuple[int, int], list[PointDiff]] = {}
        for r in self.rows:
            sec, layer, _ = canonical_key(r.point, r.layer)
            groups.setdefault((sec, layer), []).append(r)
        out = []
        for (sec, layer), rs in sorted(groups.items()):
            worst = max(rs, key=lambda r: (r.err if not math.isnan(r.err) else math.inf))
            lout = next((r for r in rs if r.point == "l_out"), None)
            cos = [r.cosine for r in rs if r.cosine is not None]
            out.append({"layer": {0: "input", 2: "output"}.get(sec, layer), "points": len(rs),
                        "worst_point": worst.point, "worst_err": worst.err,
                        "l_out_err": None if lout is None else lout.err,
                        "min_cosine": min(cos) if cos else None,
                        "diverged": sum(r.diverged for r in rs)})
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        f = self.first
        return {"first_divergence": None if f is None else f.where, "rule": self.rule.describe(),
                "rows": [r.as_dict() for r in self.rows], "only_a": self.only_a, "only_b": self.only_b,
                "skipped": self.skipped}


def _product(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def compare_point(ra: Mapping[str, Any], rb: Mapping[str, Any], ta: np.ndarray | None, tb: np.ndarray | None,
                  rule: DivergenceRule) -> PointDiff:
    """Compare one (point, layer) of two traces.

    Args:
        ra, rb: the two records (b is the baseline side: ``rel_l2`` divides by ``||b||``).
        ta, tb: the full tensors, or None (then only checksums are compared).
        rule: the bounds.

    Returns:
        :class:`PointDiff`. Shapes that differ count as diverged (error inf).

    Source: ``docs/trace-format.md`` ("Comparing traces"); metrics from :mod:`harness.metrics`.
    """
    from . import metrics

    point, layer = ra["point"], int(ra["layer"])
    sa, sb = list(ra["shape"]), list(rb["shape"])
    if sa != sb:
        return PointDiff(point, layer, sa, sb, "shape", {}, math.inf, diverged=True,
                         why=f"shape {sa} vs {sb}")
    prec = float(ra.get("abs_precision") or 0.0) + float(rb.get("abs_precision") or 0.0)
    bounds = checksum_error(ra["checksums"], rb["checksums"], _product(sa), prec)
    res = PointDiff(point, layer, sa, sb, "checksums", bounds, max(bounds.values()) if bounds else 0.0)
    if ta is not None and tb is not None and list(ta.shape) == sa and list(tb.shape) == sb and ta.size:
        res.basis = "tensors"
        same = np.array_equal(ta, tb, equal_nan=True)
        if same:
            res.rel_l2, res.cosine, res.max_abs = 0.0, 1.0, 0.0
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                res.rel_l2 = metrics.rel_l2(ta, tb)
                res.max_abs = metrics.max_abs_err(ta, tb)
                finite = np.all(np.isfinite(ta)) and np.all(np.isfinite(tb))
                res.cosine = metrics.cosine(ta, tb) if finite else math.nan
            if math.isnan(res.rel_l2):
                res.rel_l2 = math.inf
        res.err = res.rel_l2
    why = []
    if rule.tol is not None and not res.err <= rule.tol:
        why.append(f"{'rel L2' if res.basis == 'tensors' else 'checksum bound'} {res.err:.3g} > {rule.tol:g}")
    if rule.min_cosine is not None and res.cosine is not None and not res.cosine >= rule.min_cosine:
        why.append(f"cosine {res.cosine:.8f} < {rule.min_cosine}")
    lim = rule.max_abs.get(point)
    if lim is not None and res.max_abs is not None and not res.max_abs <= lim:
        why.append(f"max|a-b| {res.max_abs:.3g} > {lim:g}")
    res.diverged, res.why = bool(why), "; ".join(why)
    return res


def compare(a: Trace, b: Trace, rule: DivergenceRule | None = None, skip: Iterable[str] = (),
            use_tensors: bool = True) -> DiffResult:
    """Compare two traces of the same prompt per (point, layer), in canonical trace order.

    Args:
        a: the trace under test.
        b: the baseline trace (relative errors divide by its norms).
        rule: when a point counts as diverged (default: relative error > :data:`DEFAULT_TOL`).
        skip: points to leave out, as a name (every layer) or ``point@layer`` (e.g. ``result_output``
            when one engine kept only the last position's logits).
        use_tensors: compare full tensors when both traces have them.

    Returns:
        :class:`DiffResult`; its ``first`` is the first diverged point.

    Raises:
        InputError: different prompts (:func:`check_same_prompt`); an unreadable tensor dump.
    """
    check_same_prompt(a, b)
    rule = rule or DivergenceRule()
    skip = set(skip)

    def skipped_key(k: tuple[str, int]) -> bool:
        return k[0] in skip or f"{k[0]}@{k[1]}" in skip

    ka, kb = a.by_key(), b.by_key()
    order_a = {k: i for i, k in enumerate(ka)}
    both = [k for k in ka if k in kb and not skipped_key(k)]
    both.sort(key=lambda k: (canonical_key(*k), order_a[k]))
    tensors = use_tensors and a.has_tensors() and b.has_tensors()
    rows = []
    for k in both:
        ta = a.tensor(*k) if tensors else None
        tb = b.tensor(*k) if tensors else None
        rows.append(compare_point(ka[k], kb[k], ta, tb, rule))
    only_a = [f"{p}@{l}" for (p, l) in ka if (p, l) not in kb and not skipped_key((p, l))]
    only_b = [f"{p}@{l}" for (p, l) in kb if (p, l) not in ka and not skipped_key((p, l))]
    skipped = sorted({f"{p}@{l}" for (p, l) in list(ka) + list(kb) if skipped_key((p, l))},
                     key=lambda w: canonical_key(w.rsplit("@", 1)[0], int(w.rsplit("@", 1)[1])))
    return DiffResult(rows=rows, only_a=only_a, only_b=only_b, skipped=skipped, rule=rule)


def render_diff(res: DiffResult, a: Trace, b: Trace) -> str:
    """The text ``g4h diff`` prints: the two traces, the verdict (first divergence), and the
    error-growth table (:meth:`DiffResult.growth`)."""
    from .report import markdown_table

    def who(t: Trace) -> str:
        h = t.header
        bits = [f"engine {h.get('engine')}"] + ([f"case {h['case']}"] if h.get("case") else [])
        return f"{t.label} ({', '.join(bits)})"

    basis = {r.basis for r in res.rows}
    how = ("full tensors: relative L2 error, cosine" if basis == {"tensors"} else
           "checksums: lower bounds of the relative error" if "tensors" not in basis else
           "full tensors where both have them, else checksums")
    lines = [f"A: {who(a)}", f"B: {who(b)}",
             f"prompt: {len(a.prompt_ids)} tokens; {len(res.rows)} points compared by {how}; "
             f"rule: {res.rule.describe()}"]
    f = res.first
    if f is None:
        lines.append("no divergence: every common point is within the rule")
    else:
        n_div = sum(r.diverged for r in res.rows)
        lines.append(f"FIRST DIVERGENCE: {f.where} ({f.why}); {n_div} of {len(res.rows)} points beyond the rule")
    lines += ["", "error growth (err = rel L2 with tensors, else the checksum lower bound):", ""]
    cols = ["layer", "points", "worst_point", "worst_err", "l_out_err", "min_cosine", "diverged"]
    g = res.growth()
    if not any(r["min_cosine"] is not None for r in g):
        cols.remove("min_cosine")
    lines.append(markdown_table(g, cols).rstrip("\n"))
    if res.only_a:
        lines.append(f"only in A ({len(res.only_a)}): {', '.join(res.only_a[:12])}{' ...' if len(res.only_a) > 12 else ''}")
    if res.only_b:
        lines.append(f"only in B ({len(res.only_b)}): {', '.join(res.only_b[:12])}{' ...' if len(res.only_b) > 12 else ''}")
    if res.skipped:
        lines.append(f"skipped: {', '.join(res.skipped)}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- llama.cpp eval-callback dumps

GGML_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64",
               "i32": "int32", "i16": "int16", "i8": "int8", "i64": "int64"}
"""ggml type names (as ``ggml_type_name`` prints them) -> numpy-style dtype names."""

TEXT_ABS_PRECISION = 5e-5
"""Rounding of values in eval-callback text (``%12.4f``)."""

_HEADER_RE = re.compile(r"^(?P<func>[A-Za-z_]\w*):\s+(?P<name>\S.*?) = \((?P<type>\w+)\)\s+(?P<op>[^\s(]+)\("
                        r"(?P<srcs>.*)\) = \{(?P<ne>\s*\d+\s*(?:,\s*\d+\s*){3})\}\s*$")
_SUM_RE = re.compile(r"^\s*sum\s*=\s*(?P<v>\S+)\s*$")
_NAME_RE = re.compile(r"^(?P<point>[A-Za-z_][A-Za-z0-9_]*?)(?:-(?P<layer>\d+))?$")


def llama_name(point: str, layer: int) -> str:
    """llama.cpp's graph-callback tensor name of a trace point: ``point-<layer>``, or ``point`` for layer -1
    (``cb(cur, "l_out", il)`` names the tensor ``l_out-<il>``; ``il = -1`` leaves the name bare)."""
    return point if layer < 0 else f"{point}-{int(layer)}"


def parse_llama_name(name: str) -> tuple[str, int] | None:
    """Inverse of :func:`llama_name` for known trace points; None for any other tensor name."""
    m = _NAME_RE.match(name.strip())
    if not m or m.group("point") not in KNOWN_POINTS:
        return None
    layer = -1 if m.group("layer") is None else int(m.group("layer"))
    if (layer < 0) != (m.group("point") not in LAYER_POINTS):
        return None
    return m.group("point"), layer


def ne_to_shape(ne: Sequence[int], point: str, where: str) -> list[int]:
    """ggml ``ne`` (fastest dimension first, 4 entries) -> numpy shape of the point's rank.

    ``[ne1, ne0]`` for 2-D points (``[T, n]``), ``[ne2, ne1, ne0]`` for ``inp_per_layer`` (``[T, L, P]``).

    Raises:
        InputError: a dimension beyond the point's rank that is not 1.
    """
    rank = POINT_RANK.get(point, 2)
    ne = [int(x) for x in ne] + [1] * (4 - len(ne))
    if any(x != 1 for x in ne[rank:]):
        raise InputError(f"{where}: ne = {ne} has more than {rank} dimensions, but {point} is {rank}-D")
    return list(reversed(ne[:rank]))


def _printed_indices(n_dim: int, n: int = 3) -> list[int]:
    """Indices eval-callback prints along a dimension of size ``n_dim``: all, or the first and last ``n``
    when ``n_dim > 2n``."""
    return list(range(n_dim)) if n_dim <= 2 * n else list(range(n)) + list(range(n_dim - n, n_dim))


def _text_record(name: str, gtype: str, ne: list[int], values: list[float], sums: list[float], sum_scope: str,
                 where: str) -> tuple[dict[str, Any], np.ndarray | None] | None:
    key = parse_llama_name(name)
    if key is None:
        return None
    point, layer = key
    shape = ne_to_shape(ne, point, where)
    grids = [_printed_indices(x) for x in ne]  # i0..i3
    want = _product([len(g) for g in grids])
    if len(values) != want:
        raise InputError(f"{where}: tensor {name}: expected {want} printed values for ne = {ne}, found {len(values)}")
    full = all(len(g) == x for g, x in zip(grids, ne))
    known: dict[int, float] = {}
    strides = [1, ne[0], ne[0] * ne[1], ne[0] * ne[1] * ne[2]]
    it = iter(values)
    for i3 in grids[3]:
        for i2 in grids[2]:
            for i1 in grids[1]:
                for i0 in grids[0]:
                    known[i0 + i1 * strides[1] + i2 * strides[2] + i3 * strides[3]] = next(it)
    first = []
    for i in range(min(N_LEADING, _product(ne))):
        if i not in known:
            break
        first.append(known[i])
    cs: dict[str, Any] = {"sum": None, "mean": None, "l2": None, "absmax": None, "first": first}
    n_el = _product(ne)
    if sums and (sum_scope == "all" or full):
        cs["sum"] = sums[-1]
        cs["mean"] = sums[-1] / n_el if n_el else 0.0
    arr = None
    if full:  # every value printed (rounded to 4 decimals): l2 / absmax from them
        arr = np.array([known[i] for i in range(n_el)], dtype=np.float64).reshape(shape)
        c = checksums(arr)
        cs["l2"], cs["absmax"] = c["l2"], c["absmax"]
    rec = {"point": point, "layer": layer, "shape": shape, "dtype": GGML_DTYPES.get(gtype, gtype),
           "checksums": cs, "abs_precision": TEXT_ABS_PRECISION, "source_name": name}
    return rec, arr


def parse_eval_callback_text(text: str, source: str, sum_scope: str = "all") -> tuple[list[dict[str, Any]], int]:
    """Parse the text ``llama-eval-callback`` prints into trace records.

    Each tensor is a header line ``<func>: <name> = (<type>) <OP>(<srcs>) = {ne0, ne1, ne2, ne3}`` followed by
    its values in nested brackets (``%12.4f``; along any dimension longer than 6 only the first and last 3
    indices, with ``...`` between) and a ``sum = <value>`` line per ``ne3`` slice. Lines that belong to
    neither (model loading logs, timings) are ignored.

    Args:
        text: the captured output.
        source: file name for messages.
        sum_scope: ``all`` (llama.cpp ``common/debug.cpp``: the sum is over every element) or ``printed``
            (the older ``examples/eval-callback/eval-callback.cpp`` summed only the printed values; then the
            sum is kept only for tensors printed in full).

    Returns:
        ``(records, skipped)``: records for tensors named like a trace point (``l_out-3``, ``result_output``),
        file order; ``skipped`` counts the other tensors.

    Raises:
        InputError: a tensor whose printed values do not match its ``ne``, a value that is not a number,
            a trace point that appears twice (several ubatches or decode calls: run with ``-ub`` >= the
            prompt length and one decode), or no tensor at all.

    Source: llama.cpp ``common/debug.cpp`` ``common_debug_cb_eval`` / ``common_debug_print_tensor``
    (before 2025: ``examples/eval-callback/eval-callback.cpp`` ``ggml_debug`` / ``ggml_print_tensor``).
    """
    if sum_scope not in ("all", "printed"):
        raise InputError(f"sum scope {sum_scope!r}: expected 'all' or 'printed'")
    records: list[dict[str, Any]] = []
    tensors: list[tuple[str, int, list[float], list[float], str, list[int], int]] = []
    cur = None
    n_tensors = 0
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        m = _HEADER_RE.match(line)
        if m:
            n_tensors += 1
            cur = {"name": m.group("name").strip(), "type": m.group("type"),
                   "ne": [int(x) for x in m.group("ne").split(",")], "values": [], "sums": [], "line": n}
            tensors.append(cur)
            continue
        if cur is None:
            continue
        s = _SUM_RE.match(line)
        if s:
            try:
                cur["sums"].append(float(s.group("v")))
            except ValueError:
                raise InputError(f"{source}:{n}: sum {s.group('v')!r} is not a number") from None
            continue
        body = line.strip()
        if body.startswith("[") and len(body) > 1 and body.rstrip(",").endswith("]") and body not in ("[", "],"):
            inner = body.rstrip(",").strip()[1:-1]
            for tok in inner.split(","):
                tok = tok.strip()
                if not tok or tok == "...":
                    continue
                try:
                    cur["values"].append(float(tok))
                except ValueError:
                    raise InputError(f"{source}:{n}: value {tok!r} of tensor {cur['name']} is not a number") from None
    if n_tensors == 0:
        raise InputError(f"{source}: no eval-callback tensor found (expected lines like "
                         f"'common_debug_cb_eval: l_out-0 = (f32) ADD(...) = {{n, T, 1, 1}}')")
    seen: dict[tuple[str, int], int] = {}
    skipped = 0
    for t in tensors:
        where = f"{source}:{t['line']}"
        out = _text_record(t["name"], t["type"], t["ne"], t["values"], t["sums"], sum_scope, where)
        if out is None:
            skipped += 1
            continue
        rec, _ = out
        key = (rec["point"], rec["layer"])
        if key in seen:
            raise InputError(f"{where}: {t['name']} appears twice (first at line {seen[key]}): several ubatches "
                             f"or decode calls in one dump; run one decode with -ub >= the prompt length")
        seen[key] = t["line"]
        records.append(rec)
    return records, skipped


def parse_eval_jsonl(text: str, source: str) -> tuple[list[dict[str, Any]], dict[str, np.ndarray], dict[str, Any], int]:
    """Parse a JSONL dump written by a ``cb_eval`` callback (format in ``docs/trace-format.md``).

    Lines: an optional header ``{"format": "llama.cpp-eval-jsonl", "version": 1, "prompt_ids": [...], ...}``,
    then one object per tensor: ``{"name": "l_out-3", "type": "f32", "ne": [ne0, ne1, ne2, ne3], ...}`` with
    either ``"data"`` (every value, ``ne0`` fastest, i.e. the contiguous ggml buffer) or checksums
    ``"sum"``, ``"sumsq"`` (or ``"l2"``), ``"absmax"``, ``"first"`` (leading values in memory order).

    Returns:
        ``(records, tensors, header, skipped)``: records of trace-point tensors; ``{"point.layer": array}``
        for those with ``data``; the header object (``{}`` if none); count of other tensors.

    Raises:
        InputError: a line that is not JSON or not such an object, ``data`` of the wrong length, a
            duplicate trace point, an unknown header format or version.
    """
    records, tensors, header, seen, skipped = [], {}, {}, {}, 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(f"{where}: not valid JSON") from None
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object")
        if "format" in obj:
            if obj["format"] != "llama.cpp-eval-jsonl" or obj.get("version", 1) != 1:
                raise InputError(f"{where}: format {obj.get('format')!r} version {obj.get('version')!r}: "
                                 f"expected llama.cpp-eval-jsonl version 1")
            header = obj
            continue
        name, ne = obj.get("name"), obj.get("ne")
        if not isinstance(name, str) or not _is_int_list(ne) or not 1 <= len(ne) <= 4:
            raise InputError(f"{where}: expected {{\"name\": str, \"type\": str, \"ne\": [up to 4 ints], ...}}")
        key = parse_llama_name(name)
        if key is None:
            skipped += 1
            continue
        point, layer = key
        shape = ne_to_shape(ne, point, where)
        if key in seen:
            raise InputError(f"{where}: {name} appears twice (first at line {seen[key]}): several ubatches or "
                             f"decode calls in one dump")
        seen[key] = n
        n_el = _product(shape)
        if "data" in obj:
            data = obj["data"]
            if not isinstance(data, list) or len(data) != n_el:
                raise InputError(f"{where}: {name}: data must hold {n_el} values (ne = {ne})")
            arr = np.array([_unnum(v, f"{where}: {name}.data") for v in data], dtype=np.float64).reshape(shape)
            cs = checksums(arr)
            tensors[tensor_name(point, layer)] = arr
        else:
            l2 = obj.get("l2")
            if l2 is None and obj.get("sumsq") is not None:
                l2 = math.sqrt(max(0.0, float(_unnum(obj["sumsq"], f"{where}: sumsq"))))
            s = _unnum(obj.get("sum"), f"{where}: sum")
            first = obj.get("first") or []
            if not isinstance(first, list):
                raise InputError(f"{where}: first: expected a list")
            cs = {"sum": s, "mean": None if s is None else s / max(n_el, 1), "l2": _unnum(l2, f"{where}: l2"),
                  "absmax": _unnum(obj.get("absmax"), f"{where}: absmax"),
                  "first": [_unnum(v, f"{where}: first") for v in first[:N_LEADING]]}
        records.append({"point": point, "layer": layer, "shape": shape,
                        "dtype": GGML_DTYPES.get(str(obj.get("type", "f32")), str(obj.get("type"))),
                        "checksums": cs, "source_name": name})
    if not records and not skipped:
        raise InputError(f"{source}: no tensor records")
    return records, tensors, header, skipped


def import_llama_dump(path: str | os.PathLike, prompt_ids: Sequence[int] | None = None, *, case: str | None = None,
                      model: str | None = None, sum_scope: str = "all") -> Trace:
    """Convert a llama.cpp eval-callback dump into a trace that lines up with ours.

    The format is recognised from the content: a file whose first non-blank line is a JSON object is the
    JSONL callback format (:func:`parse_eval_jsonl`), anything else the eval-callback text
    (:func:`parse_eval_callback_text`). Tensor names ``<point>-<il>`` become (point, il), bare names layer -1;
    other tensors are dropped (counted in the header's ``skipped_tensors``). ``ne`` becomes a numpy shape
    (:func:`ne_to_shape`); leading values follow ggml's memory order, which is our row-major order.

    Args:
        path: the dump.
        prompt_ids: the prompt's token ids (eval-callback text does not print them); None = take them
            from the JSONL header.
        case, model: header fields.
        sum_scope: see :func:`parse_eval_callback_text`.

    Returns:
        :class:`Trace` (engine ``llama.cpp``; tensors in memory when the JSONL held full data).

    Raises:
        InputError: unreadable or malformed dump, no prompt ids, or no trace point in it.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise InputError(f"{p}: cannot read llama.cpp dump ({e.strerror or e})") from None
    first_line = next((ln for ln in text.splitlines() if ln.strip()), "")
    tensors: dict[str, np.ndarray] = {}
    head: dict[str, Any] = {}
    if first_line.lstrip().startswith("{"):
        records, tensors, head, skipped = parse_eval_jsonl(text, str(p))
        source = "llama.cpp cb_eval JSONL"
    else:
        records, skipped = parse_eval_callback_text(text, str(p), sum_scope)
        source = "llama.cpp eval-callback text"
    if not records:
        raise InputError(f"{p}: no tensor named like a trace point (l_out-N, attn_out-N, result_output, ...)")
    ids = list(prompt_ids) if prompt_ids is not None else head.get("prompt_ids")
    if not _is_int_list(ids) or not ids:
        raise InputError(f"{p}: no prompt ids (pass --prompt-ids; eval-callback text does not print them)")
    engine = str(head.get("engine", "llama.cpp"))
    for r in records:
        r["engine"] = engine
        r["case"] = case
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "engine": engine, "case": case,
              "model": model or head.get("model"), "prompt_ids": [int(i) for i in ids], "n_tokens": len(ids),
              "dtype": None, "device": None, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "n_records": len(records), "tensors": None, "source": source, "imported_from": str(p),
              "skipped_tensors": skipped, "sum_scope": sum_scope if source.endswith("text") else "all"}
    return Trace(header=header, records=records, tensors=tensors or None)


def render_eval_callback_text(items: Iterable[tuple[str, int, np.ndarray]], func: str = "common_debug_cb_eval",
                              gtype: str = "f32") -> str:
    """Render arrays the way llama.cpp's eval callback prints them (mainline ``common/debug.cpp`` layout).

    For tests and for engines that want to emit a dump llama.cpp users can read: each item
    ``(point, layer, array [T, ...])`` becomes a header line with the llama.cpp name and ``ne`` (numpy
    shape reversed, padded with 1s to 4), the nested value print (``%12.4f``, first and last 3 indices
    of any dimension longer than 6) and ``sum = %f`` over all elements (float32 accumulation, as ggml).

    Returns:
        the text.
    """
    out = []
    ind = "    "
    for point, layer, arr in items:
        a = np.asarray(arr, dtype=np.float32)
        ne = list(reversed(a.shape)) + [1] * (4 - a.ndim)
        name = llama_name(point, layer)
        out.append(f"{func}: {name:>24} = (f32) {'ADD':>10}(src0{{{', '.join(map(str, ne))}}}, }}) = "
                   f"{{{', '.join(map(str, ne))}}}")
        v = a.reshape(ne[3], ne[2], ne[1], ne[0])
        total = float(np.sum(v, dtype=np.float32))
        for i3 in range(ne[3]):
            out.append(ind + "[")
            g2, g1, g0 = _printed_indices(ne[2]), _printed_indices(ne[1]), _printed_indices(ne[0])
            for j2, i2 in enumerate(g2):
                if j2 == 3 and len(g2) < ne[2]:
                    out.append(ind * 2 + "..., ")
                out.append(ind * 2 + "[")
                for j1, i1 in enumerate(g1):
                    if j1 == 3 and len(g1) < ne[1]:
                        out.append(ind * 3 + "..., ")
                    cells = []
                    for j0, i0 in enumerate(g0):
                        if j0 == 3 and len(g0) < ne[0]:
                            cells.append("   ..., ")
                        cells.append(f"{float(v[i3, i2, i1, i0]):12.4f}" + (", " if i0 < ne[0] - 1 else ""))
                    out.append(ind * 3 + "[" + "".join(cells) + "  ],")
                out.append(ind * 2 + "],")
            out.append(ind + "]")
            out.append(ind + f"sum = {total:f}")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- commands


def _case_name(model: str) -> str:
    p = Path(model)
    return p.parent.name if p.name == "hf" else p.stem if p.suffix == ".gguf" else p.name


def trace_command(model: str | None, engine: str, prompt_ids_file: str, out: str, dump_dir: str | None = None,
                  device: str | None = None, dtype: str | None = None, case: str | None = None,
                  llama_dump: str | None = None, sum_scope: str = "all") -> Path:
    """``g4h trace``: run ``engine`` on the prompt with a :class:`TraceWriter` and write the trace; or, with
    ``llama_dump``, convert that dump (:func:`import_llama_dump`) instead of running an engine.

    Returns:
        the trace path.

    Raises:
        InputError: bad model, engine, prompt file or dump; an output that cannot be written.
    """
    from .cli import read_prompt_ids

    ids = read_prompt_ids(prompt_ids_file)
    if llama_dump is not None:
        tr = import_llama_dump(llama_dump, ids, case=case, model=model, sum_scope=sum_scope)
        if dump_dir is not None and not tr.tensors:
            raise InputError(f"{llama_dump}: --dump-tensors needs full tensor data (a JSONL dump with \"data\")")
        return write_trace(out, tr.header, tr.records, tr.tensors if dump_dir else None, dump_dir)
    if model is None:
        raise InputError("g4h trace: --model is required (or --llama-dump to import a llama.cpp dump)")
    from .engines import make_engine

    eng = make_engine(engine, model, device=device, dtype=dtype)
    act_dtype = "float64" if engine == "reference" else "float32"
    dev = getattr(getattr(eng, "model", None), "device", None)
    writer = TraceWriter(getattr(eng, "name", engine), ids, case=case or _case_name(model), model=str(model),
                         dtype=act_dtype, device=None if dev is None else str(dev),
                         keep_tensors=dump_dir is not None,
                         extra={"weights_dtype": dtype} if dtype else None)
    eng.logits(ids, trace=writer)
    return writer.write(out, dump_dir)


def diff_command(path_a: str, path_b: str, tol: float = DEFAULT_TOL, skip: Sequence[str] = (),
                 min_cosine: float | None = None, json_out: str | None = None, stream=None) -> int:
    """``g4h diff A B``: print the comparison (:func:`render_diff`); return 0 (no divergence) or 1.

    Raises:
        InputError: unreadable/invalid trace, different prompts, bad ``--tol`` (exit 2 in the CLI).
    """
    if not (tol >= 0):
        raise InputError(f"--tol {tol}: expected a non-negative number")
    a, b = read_trace(path_a), read_trace(path_b)
    res = compare(a, b, DivergenceRule(tol=tol, min_cosine=min_cosine), skip=skip)
    print(render_diff(res, a, b), end="", file=stream or sys.stdout)
    if json_out:
        from .report import write_json_atomic

        try:
            write_json_atomic(json_out, {"a": str(a.path), "b": str(b.path), **res.as_dict()})
        except OSError as e:
            raise InputError(f"{json_out}: cannot write ({e.strerror or e})") from None
    return 1 if res.first is not None else 0
