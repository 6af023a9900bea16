"""A sweep's run directory, written as the sweep goes so that an interrupted sweep can continue.

Layout of ``<out>/<UTC timestamp>-sweep/``::

    plan.json          what was asked (models, engines, prompts, options): a resumed sweep reads it
    rows.jsonl         one JSON record a line, appended as each result arrives (fsynced): engine rows
                       ("kind": "row"), each group's 8-bit sensitivity ("sensitivity"), each file's cross-engine
                       figures ("agreement"); the newest record of a key wins
    base/<key>.pkl     each group's base (the float64 reference's logits, layers and greedy streams)
    pending/<key>.npz  an engine's logits on a file whose other engines have not finished (deleted once the file's
                       agreement is written)
    results.json  sweep.csv  report.md  *.png      written at the end (and again by a resumed sweep)

A record's key names what produced it (file version, engine and its options, prompts, base, greedy settings), so
a resumed sweep reruns exactly the tasks whose key has no record (and, with ``--retry-failed``, those whose
record failed).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from reference.errors import InputError

from ..core.io import dumps_json, run_timestamp, to_jsonable, write_bytes_atomic, write_json_atomic

ROWS = "rows.jsonl"
PLAN = "plan.json"


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
        if plan.get("schema") != "g4h-sweep-plan":
            raise InputError(f"--resume {path}: {PLAN} is not a g4h sweep plan")
        return cls(p), plan

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
            if isinstance(rec, dict) and "key" in rec and "kind" in rec:
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
        return self.path / "base" / f"{key}.pkl"

    def save_base(self, key: str, base: dict[str, Any]) -> None:
        """Keep a group's base (pickle protocol 5)."""
        write_bytes_atomic(self.base_file(key), pickle.dumps(base, protocol=5))

    def load_base(self, key: str) -> dict[str, Any] | None:
        """A kept base, or None (absent or unreadable)."""
        try:
            return pickle.loads(self.base_file(key).read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError):
            return None

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
