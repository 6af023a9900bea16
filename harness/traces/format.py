"""Trace files: write, read, compare (``g4h trace`` / ``g4h diff``), and import llama.cpp eval-callback dumps.

A *trace* is what an engine reports at the trace points of ``docs/design.md`` ("Trace
points") while it runs one prompt: per (point, layer) the
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_bytes

from ..core.io import to_jsonable, write_bytes_atomic, write_text_atomic
from .store import TensorStore, default_store

TRACE_FORMAT = "g4h-trace"
"""Value of the header's ``format`` field."""

TRACE_VERSION = 1
"""The trace format version this module writes and reads."""

N_LEADING = 8
"""How many leading values (flattened, row-major) a record keeps."""

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
    """A float for JSON: finite as is, NaN/Inf as ``"NaN"``/``"Infinity"``/``"-Infinity"`` (as harness.core.io)."""
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

    ``l2`` is summed by NumPy's own ``einsum`` loop, not by ``np.linalg.norm`` (a BLAS dot): a trace callback
    runs between the torch operations of the fast engine, and waking BLAS's own thread pool there made the two
    pools fight for the cores (its traced forwards took 1.7x their untraced time on 2 cores, 1.1x without BLAS).
    No temporary the size of the array is made: on a ``[83, 262144]`` head output 28 ms, where squares and
    absolute values took 140 ms.

    Source: ``docs/trace-format.md`` (the format this module defines).
    """
    x = np.asarray(arr, dtype=np.float64).ravel()
    if x.size == 0:
        return {"sum": 0.0, "mean": 0.0, "l2": 0.0, "absmax": 0.0, "first": []}
    with np.errstate(over="ignore", invalid="ignore"):
        s = float(np.sum(x))
        l2 = float(np.sqrt(np.einsum("i,i->", x, x)))
        am = float(np.maximum(np.abs(x.max()), np.abs(x.min())))  # NaN propagates; no |x| temporary
    return {"sum": s, "mean": s / x.size, "l2": l2, "absmax": am, "first": [float(v) for v in x[:n_leading]]}


# --------------------------------------------------------------------------- the trace object


def tensor_name(point: str, layer: int) -> str:
    """Name of a dumped tensor: ``"<point>.<layer>"`` (``"l_out.3"``, ``"inp_scaled.-1"``)."""
    return f"{point}.{int(layer)}"


def is_encoder_point(point: str) -> bool:
    """An encoder trace point of a multimodal prompt: ``v<i>.<name>`` (image i) or ``a<j>.<name>`` (audio clip j),
    :func:`reference.mm_model.item_prefix`."""
    head, dot, _ = point.partition(".")
    return bool(dot) and len(head) > 1 and head[0] in "va" and head[1:].isdigit()


def canonical_key(point: str, layer: int) -> tuple[int, int, int]:
    """Sort key of the canonical trace order: the encoders' points (multimodal prompts; :func:`is_encoder_point`),
    then inputs, then layers 0.. (points in :data:`LAYER_POINTS` order), then outputs. Encoder points all share one
    key, so they keep the order the engine reported them in (the encoders' computation order, item by item), as
    unknown point names keep theirs among themselves (Python's sort is stable).

    Returns:
        ``(section, layer, rank)`` with section -1 = encoders, 0 = input, 1 = layer, 2 = output.
    """
    if is_encoder_point(point):
        return -1, 0, 0
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
        keep_tensors: also keep a copy of every array (for ``--dump-tensors`` or in-memory diffs): float32 as float32,
            any other as float64 (both exact; :meth:`Trace.tensor` reads float64), in ``store``.
        store: where the copies are kept (:class:`harness.traces.store.TensorStore`); default this process's
            (:func:`harness.traces.store.default_store`: in memory up to a budget, then in mapped files).
        extra: more header fields.

    Raises:
        ValueError: (from the callback) the same (point, layer) reported twice, or a non-array.
    """

    def __init__(self, engine: str, prompt_ids: Sequence[int], *, case: str | None = None, model: str | None = None,
                 dtype: str | None = None, device: str | None = None, keep_tensors: bool = False,
                 extra: Mapping[str, Any] | None = None, store: TensorStore | None = None):
        self.engine = str(engine)
        self.store = store
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
            self.tensors[tensor_name(*key)] = (self.store or default_store()).keep(a)

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

    dest = Path(path)
    head = dict(header)
    head.update(format=TRACE_FORMAT, version=TRACE_VERSION, n_records=len(records), tensors=None)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if tensors is not None and dump_dir is not None:

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
        data = read_bytes(p)
    except InputError as e:
        raise InputError(f"{e} (a g4h trace)") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{p}: not a g4h trace (not UTF-8 text)") from None
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

    rel = trace.header["tensors"]
    base = trace.path.parent if trace.path is not None else Path.cwd()
    dump = (base / rel) if not os.path.isabs(rel) else Path(rel)
    try:
        return dict(load_file(str(dump)))
    except FileNotFoundError:
        raise InputError(f"{trace.label}: tensor dump {dump} named in the header does not exist") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{dump}: cannot read tensor dump ({str(e).splitlines()[0] if str(e) else e})") from None

def _product(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
