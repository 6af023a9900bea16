"""A sweep's run directory, written as the sweep goes so that an interrupted sweep can continue.

Layout of ``<out>/<UTC timestamp>-sweep/``::

    plan.json          what was asked (models, engines, prompts, options): a resumed sweep reads it
    rows.jsonl         one JSON record a line, appended as each result arrives (fsynced): engine rows
                       ("kind": "row"), each group's 8-bit sensitivity ("sensitivity"), each file's cross-engine
                       figures ("agreement"); the newest record of a key wins
    base/<key>.npz     each group's base (the float64 reference's logits, layers and greedy streams): arrays plus a
                       ``meta`` member holding JSON; read with ``allow_pickle=False`` and checked like any input
    pending/<key>.npz  an engine's logits on a file whose other engines have not finished (deleted once the file's
                       agreement is written)
    results.json  sweep.csv  report.md  *.png      written at the end (and again by a resumed sweep)

A record's key names what produced it (file version, engine and its options, prompts, base, greedy settings), so
a resumed sweep reruns exactly the tasks whose key has no record (and, with ``--retry-failed``, those whose
record failed).

Nothing read back runs code: a run folder may be shared or crafted, so it holds JSON and NPZ only (never pickle),
every NPZ is opened with ``allow_pickle=False``, and what a resume reads is checked like any other input (one
line naming the file and what was expected, exit 2). A ``base/*.pkl`` of an older harness is refused, not read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import open_regular

from ..core.io import dumps_json, run_timestamp, to_jsonable, write_bytes_atomic, write_json_atomic

ROWS = "rows.jsonl"
PLAN = "plan.json"
BASE_SCHEMA = "g4h-sweep-base"
_KEY = re.compile(r"[0-9a-f]{16}")


def key_of(*parts: Any) -> str:
    """16 hex digits of the JSON of ``parts``."""
    return hashlib.sha256(json.dumps(to_jsonable(list(parts)), sort_keys=True).encode()).hexdigest()[:16]


def new_run_dir(out: str | os.PathLike) -> Path:
    """A fresh ``<out>/<UTC timestamp>-sweep[-N]/`` (created)."""
    base = Path(out).expanduser().resolve()
    base.mkdir(parents=True, exist_ok=True)
    stem, n = f"{run_timestamp()}-sweep", 1
    while True:
        d = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            n += 1


class RunDir:
    """The run directory of one sweep (see the module docstring).

    Args:
        path: the folder (it exists).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        (self.path / "base").mkdir(exist_ok=True)
        (self.path / "pending").mkdir(exist_ok=True)

    @classmethod
    def resume(cls, path: str | os.PathLike) -> tuple["RunDir", dict[str, Any]]:
        """An existing run directory and its plan.

        Raises:
            InputError: not a sweep run directory (no ``plan.json``), or an unreadable plan.
        """
        p = Path(path)
        try:
            plan = json.loads((p / PLAN).read_text())
        except FileNotFoundError:
            raise InputError(f"--resume {path}: not a sweep run directory (no {PLAN})") from None
        except (OSError, ValueError) as e:
            raise InputError(f"--resume {path}: {PLAN} cannot be read ({e})") from None
        if not isinstance(plan, dict) or plan.get("schema") != "g4h-sweep-plan":
            raise InputError(f"--resume {path}: {PLAN} is not a g4h sweep plan")
        models, options = plan.get("models"), plan.get("options")
        if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
            raise InputError(f"--resume {path}: {PLAN} key 'models': expected a non-empty list of paths")
        if not isinstance(options, dict):
            raise InputError(f"--resume {path}: {PLAN} key 'options': expected an object")
        rd = cls(p)
        for f in sorted((p / "base").iterdir()):
            rd._check_base_file(f)
        return rd, plan

    def write_plan(self, plan: dict[str, Any]) -> None:
        """``plan.json``."""
        write_json_atomic(self.path / PLAN, {"schema": "g4h-sweep-plan", **plan})

    # ------------------------------------------------------------------ records

    def records(self) -> dict[str, dict[str, Any]]:
        """Key -> newest record of ``rows.jsonl`` (a line cut short by an interruption is skipped)."""
        out: dict[str, dict[str, Any]] = {}
        for rec in self._lines():
            out[rec["key"]] = rec
        return out

    def _lines(self) -> Iterator[dict[str, Any]]:
        f = self.path / ROWS
        if not f.is_file():
            return
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("kind"), str):
                yield rec

    def append(self, record: dict[str, Any]) -> None:
        """Append one record (one line, flushed and fsynced: a kill loses at most the line being written)."""
        line = json.dumps(to_jsonable(record), sort_keys=True, allow_nan=False) + "\n"
        with open(self.path / ROWS, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    # ------------------------------------------------------------------ bases and pending logits

    def base_file(self, key: str) -> Path:
        return self.path / "base" / f"{key}.npz"

    def save_base(self, key: str, base: dict[str, Any]) -> None:
        """Keep a group's base (:func:`base_to_npz`)."""
        write_bytes_atomic(self.base_file(key), base_to_npz(base))

    def _check_base_file(self, f: Path) -> None:
        """Refuse what a resume must not read: anything in ``base/`` but ``<16 hex>.npz`` (a pickle of an older
        harness included: it could run code), or an NPZ whose ``meta`` is not a base's."""
        if f.suffix != ".npz" or not _KEY.fullmatch(f.stem):
            why = "a pickle, which a resume never reads (it could run code)" if f.suffix == ".pkl" else "not a base"
            raise InputError(f"--resume {f}: {why}; expected only base/<16 hex digits>.npz (delete it to recompute)")
        with open_regular(f, "--resume") as fh:
            try:
                with np.load(fh, allow_pickle=False) as z:
                    _base_meta(z, f)
            except InputError:
                raise
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a cut or foreign file
                raise InputError(f"--resume {f}: not a readable NPZ base ({type(e).__name__}: {e})") from None

    def load_base(self, key: str) -> dict[str, Any] | None:
        """A kept base, or None (absent).

        Raises:
            InputError: the file is not a base this harness wrote (see :func:`base_from_npz`).
        """
        f = self.base_file(key)
        if not f.exists():
            return None
        with open_regular(f, "--resume") as fh:
            try:
                with np.load(fh, allow_pickle=False) as z:
                    return base_from_npz(z, f)
            except InputError:
                raise
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise InputError(f"--resume {f}: not a readable NPZ base ({type(e).__name__}: {e})") from None

    def pending_file(self, key: str) -> Path:
        return self.path / "pending" / f"{key}.npz"

    def save_logits(self, key: str, logits: dict[str, np.ndarray]) -> None:
        """Keep an engine's logits until its file's agreement is written (float32: the pair's KLD is ~1e-12
        from that rounding, far below any gate)."""
        buf = io.BytesIO()
        np.savez(buf, **{f"p{i}": v.astype(np.float32) for i, v in enumerate(logits.values())},
                 ids=np.array(list(logits), dtype=object).astype(str))
        write_bytes_atomic(self.pending_file(key), buf.getvalue())

    def load_logits(self, key: str) -> dict[str, np.ndarray] | None:
        """Kept logits by prompt id, or None."""
        try:
            with np.load(self.pending_file(key), allow_pickle=False) as z:
                ids = [str(i) for i in z["ids"]]
                return {pid: np.asarray(z[f"p{i}"], dtype=np.float64) for i, pid in enumerate(ids)}
        except (OSError, KeyError, ValueError):
            return None

    def drop_logits(self, key: str) -> None:
        self.pending_file(key).unlink(missing_ok=True)

    def write_text(self, name: str, text: str) -> Path:
        """A text file of the run directory, atomically."""
        return write_bytes_atomic(self.path / name, text.encode("utf-8"))

    def write_json(self, name: str, obj: Any) -> Path:
        return write_bytes_atomic(self.path / name, dumps_json(obj).encode("utf-8"))


# --------------------------------------------------------------------------- a base as NPZ


def base_to_npz(base: dict[str, Any]) -> bytes:
    """A group's base (:func:`harness.sweep.tasks.base_run`) as NPZ bytes: ``logits_<i>`` float64 ``[T, V]`` per
    prompt, ``layer_<i>`` float32 ``[T, hidden]`` per traced layer, ``emulated_<j>_<i>`` float64 ``[T, V]`` per
    emulation key and scored prompt (``meta``'s ``emulated``: ``[[key name, [prompt ids]]]``), and ``meta``: uint8, the UTF-8 JSON of the rest
    (``schema``, the prompt ids and layer indices in member order, greedy streams, file, timings). No object arrays:
    it loads with ``allow_pickle=False``."""
    logits = base.get("logits") or {}
    layers = base.get("layers") or {}
    emulated = base.get("emulated") or {}
    meta = {k: v for k, v in base.items() if k not in ("logits", "layers", "emulated")}
    meta.update(schema=BASE_SCHEMA, logits=[str(k) for k in logits], layers=[int(k) for k in layers])
    if "emulated" in base:
        meta["emulated"] = [[str(name), [str(k) for k in z]] for name, z in emulated.items()]
    arrays = {f"logits_{i}": np.asarray(v, dtype=np.float64) for i, v in enumerate(logits.values())}
    arrays.update({f"layer_{i}": np.asarray(v, dtype=np.float32) for i, v in enumerate(layers.values())})
    arrays.update({f"emulated_{j}_{i}": np.asarray(v, dtype=np.float64)
                   for j, z in enumerate(emulated.values()) for i, v in enumerate(z.values())})
    arrays["meta"] = np.frombuffer(json.dumps(to_jsonable(meta), allow_nan=False).encode("utf-8"), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _base_meta(z: Any, f: Path) -> dict[str, Any]:
    """The checked ``meta`` of an open base NPZ ``z`` (file ``f``, named in errors)."""
    def bad(what: str) -> InputError:
        return InputError(f"--resume {f}: {what}")
    if "meta" not in z.files:
        raise bad("no 'meta' member: not a base this harness wrote")
    raw = z["meta"]
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise bad("member 'meta': expected uint8 JSON bytes")
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except ValueError as e:
        raise bad(f"member 'meta': not UTF-8 JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("schema") != BASE_SCHEMA:
        raise bad(f"member 'meta': expected schema {BASE_SCHEMA!r}")
    ids, layers = meta.get("logits"), meta.get("layers")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise bad("meta key 'logits': expected a list of prompt ids")
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                               for i in layers):
        raise bad("meta key 'layers': expected a list of layer indices")
    if not isinstance(meta.get("trace_prompt"), str) or (ids and meta["trace_prompt"] not in ids):
        raise bad("meta key 'trace_prompt': expected one of the prompt ids")
    greedy = meta.get("greedy", {})
    if not isinstance(greedy, dict):
        raise bad("meta key 'greedy': expected an object")
    for pid, g in greedy.items():
        ok = isinstance(g, dict) and isinstance(g.get("tokens"), list) and isinstance(g.get("top"), list)
        ok = ok and all(isinstance(t, int) and not isinstance(t, bool) for t in g["tokens"])
        ok = ok and all(isinstance(s, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in s)
                        for s in g["top"])
        if not ok:
            raise bad(f"meta key 'greedy' prompt {pid!r}: expected {{'tokens': [int], 'top': [[int]]}}")
    emulated = meta.get("emulated", [])
    if not isinstance(emulated, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], list)
            and all(isinstance(i, str) for i in e[1]) for e in emulated):
        raise bad("meta key 'emulated': expected a list of [key name, [prompt ids]]")
    want = {"meta"} | {f"logits_{i}" for i in range(len(ids))} | {f"layer_{i}" for i in range(len(layers))}
    want |= {f"emulated_{j}_{i}" for j, (_, pids) in enumerate(emulated) for i in range(len(pids))}
    if set(z.files) != want:
        raise bad(f"members {sorted(z.files)}: expected {sorted(want)}")
    return meta


def base_from_npz(z: Any, f: Path) -> dict[str, Any]:
    """The base kept in the open NPZ ``z`` (:func:`base_to_npz`), checked: the ``meta`` as above, each logits
    member 2-D floating and finite, each layer member 2-D floating.

    Raises:
        InputError: one line naming the file, the member or key, and what was expected.
    """
    meta = _base_meta(z, f)
    logits: dict[str, np.ndarray] = {}
    for i, pid in enumerate(meta.pop("logits")):
        a = z[f"logits_{i}"]
        if a.ndim != 2 or a.dtype.kind != "f":
            raise InputError(f"--resume {f}: member logits_{i}: expected float [T, V], got {a.dtype} {a.shape}")
        a = np.asarray(a, dtype=np.float64)
        if not np.isfinite(a).all():
            raise InputError(f"--resume {f}: member logits_{i}: non-finite values (the reference's are finite)")
        logits[pid] = a
    layers: dict[int, np.ndarray] = {}
    for i, layer in enumerate(meta.pop("layers")):
        a = z[f"layer_{i}"]
        if a.ndim != 2 or a.dtype.kind != "f":
            raise InputError(f"--resume {f}: member layer_{i}: expected float [T, hidden], got {a.dtype} {a.shape}")
        layers[layer] = np.asarray(a, dtype=np.float32)
    emulated: dict[str, dict[str, np.ndarray]] = {}
    kept = "emulated" in meta  # a base written before the sweep emulated declared numerics has none
    for j, (name, pids) in enumerate(meta.pop("emulated", [])):
        emulated[name] = {}
        for i, pid in enumerate(pids):
            a = z[f"emulated_{j}_{i}"]
            if a.ndim != 2 or a.dtype.kind != "f" or not np.isfinite(a).all():
                raise InputError(f"--resume {f}: member emulated_{j}_{i}: expected finite float [T, V]")
            emulated[name][pid] = np.asarray(a, dtype=np.float64)
    meta.pop("schema")
    return {**meta, "logits": logits, "layers": layers, **({"emulated": emulated} if kept else {})}
