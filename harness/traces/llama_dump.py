"""Import llama.cpp eval-callback dumps as traces that line up with ours.

Two inputs are read: the text ``llama-eval-callback`` prints (``common_debug_cb_eval``), and a
JSONL written by a ``cb_eval`` callback (with full tensor data when it was asked for); both are
described in ``docs/trace-format.md``. llama.cpp names a per-layer tensor ``<point>-<layer>``, the
graph-callback names our trace points use; ``ne`` lists dimensions fastest first, so a record's
numpy ``shape == reversed(ne)`` (trailing 1s dropped down to the point's rank).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_bytes

from .format import (
    KNOWN_POINTS,
    LAYER_POINTS,
    N_LEADING,
    POINT_RANK,
    TRACE_FORMAT,
    TRACE_VERSION,
    Trace,
    _is_int_list,
    _product,
    _unnum,
    checksums,
    tensor_name,
)

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
    text = read_bytes(p, "llama.cpp dump").decode("utf-8", errors="replace")
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

