"""Parity baselines: strip a results.json to its deterministic part, and find regressions against one.

``g4h parity --baseline FILE`` compares the run with an earlier ``results.json``
(or a baseline written by ``--write-baseline FILE``) and fails (exit 1) on a
regression; a baseline is only ever written on explicit request.

Determinism: two runs of the same parity job give identical results apart from
the fields :func:`strip_volatile` removes (timestamps, timings, paths). The
figures themselves come from fixed seeds, fixed prompts and a fixed order of
work; torch's CPU kernels are deterministic for a given thread count and
machine (a different thread count or BLAS may change float32 summation order
in the last bits, which the regression factor absorbs).

Regression rules (:func:`compare_to_baseline`), per check matched by
(case, gate, prompt, qtype, variant, occurrence):

1. a case that ran in the baseline cannot run now (``error`` set);
2. a gating check that passed in the baseline fails now;
3. a measured figure got worse by more than ``factor`` (default 10):
   for ``le`` gates (error figures, lower is better)
   ``now > factor * max(baseline, limit / 1000)``; for ``ge`` gates (cosine,
   agreement fractions; higher is better, at most 1) the same on the deficit
   ``1 - value`` with floor ``(1 - limit) / 1000``. The floor keeps noise far
   below a gate (say 1e-14 -> 1e-13) from counting. Where the floor and the
   baseline figure are both 0 (bit-exact gates), rule 2 alone applies.

Informational checks (a case's non-gating override) are not judged. Cases or
checks present on one side only are listed, not counted as regressions.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_json

from ..core.io import dataframe_markdown, write_json_atomic
from ..core.names import upgrade_results
from .result import RESULTS_VERSION

DEFAULT_FACTOR = 10.0
"""A figure more than this many times worse than the baseline is a regression."""

VOLATILE_KEYS = frozenset({"created_utc", "seconds", "run_dir", "timings", "path", "baseline", "s_per_token"})
"""Keys dropped at any depth by :func:`strip_volatile`."""

DETAIL_KEYS = ("qtype", "variant")
"""Check fields that tell apart checks of one gate and prompt."""


def strip_volatile(obj: Any) -> Any:
    """A copy of parity results without what changes from run to run of the same job.

    Removed at any depth: the keys in :data:`VOLATILE_KEYS` (timestamps, durations, run directory,
    file paths, an earlier baseline comparison), keys ending in ``_s`` whose value is a number
    (per-step timings such as ``generate_s``), and ``model`` where it is a string (a case's model
    path, which depends on the checkout and cache location).

    Args:
        obj: results as returned by :func:`harness.parity.run` or read from ``results.json``.

    Returns:
        the stripped copy (dicts, lists and scalars; the input is not modified).
    """
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if k in VOLATILE_KEYS:
                continue
            if isinstance(k, str) and k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
                continue
            if k == "model" and isinstance(v, str):
                continue
            out[k] = strip_volatile(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [strip_volatile(v) for v in obj]
    return obj


def load_baseline(path: str | os.PathLike) -> dict[str, Any]:
    """Read a baseline: a parity ``results.json`` or a file written by :func:`write_baseline`, of this version or an
    earlier one (its gates renamed as this version names them: :func:`harness.core.names.upgrade_results`).

    Raises:
        InputError: unreadable, not JSON, not parity results (``kind``), a version this g4h does not read, or no
            ``cases`` list. One line, naming the file.
    """
    p = Path(path)
    try:
        data = read_json(p)  # the one reader: a regular file or a pipe, bounded (reference.files)
    except InputError as e:
        why = str(e).removeprefix(f"{p}: ")
        raise InputError(f"{p}: cannot read baseline: {why} (expected a parity results.json)") from None
    if not isinstance(data, dict) or data.get("kind") != "parity":
        raise InputError(f"{p}: not a parity results file (expected \"kind\": \"parity\")")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= RESULTS_VERSION:
        raise InputError(f"{p}: parity results version {version!r}; this g4h reads 1 to {RESULTS_VERSION}")
    data = upgrade_results(data, version)  # an earlier version's gate names read as this one's
    cases = data.get("cases")
    if not isinstance(cases, list) or not all(isinstance(c, dict) and isinstance(c.get("case"), str)
                                              and isinstance(c.get("checks", []), list) for c in cases):
        raise InputError(f"{p}: baseline has no valid \"cases\" list")
    return data


def write_baseline(path: str | os.PathLike, results: Mapping[str, Any]) -> Path:
    """Write ``strip_volatile(results)`` as a baseline (JSON, atomic; the folder is created).

    Raises:
        InputError: the file cannot be written.
    """
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        return write_json_atomic(p, strip_volatile(results))
    except OSError as e:
        raise InputError(f"{p}: cannot write baseline ({e.strerror or e})") from None


def _keyed(checks: list[Mapping[str, Any]]) -> dict[tuple, Mapping[str, Any]]:
    out, seen = {}, {}
    for c in checks:
        base = (c.get("gate"), str(c.get("prompt")), *(str(c.get(k)) for k in DETAIL_KEYS))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out[base + (n,)] = c
    return out


def _badness(c: Mapping[str, Any]) -> float:
    """The figure where larger is worse: the value for ``le`` gates, ``1 - value`` for ``ge`` gates."""
    v = c.get("measured")
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return math.inf  # "NaN"/"Infinity" strings in results.json, or missing
    v = float(v)
    if math.isnan(v):
        return math.inf
    return v if c.get("op") == "le" else 1.0 - v


def _floor(c: Mapping[str, Any]) -> float:
    lim = c.get("limit")
    if not isinstance(lim, (int, float)):
        return 0.0
    return max(0.0, float(lim) / 1000.0) if c.get("op") == "le" else max(0.0, (1.0 - float(lim)) / 1000.0)


def compare_to_baseline(current: Mapping[str, Any], baseline: Mapping[str, Any], source: str = "",
                        factor: float = DEFAULT_FACTOR) -> dict[str, Any]:
    """Regressions of ``current`` against ``baseline`` (rules in the module docstring).

    Args:
        current: this run's results (``cases`` with ``checks``).
        baseline: the earlier results (:func:`load_baseline`).
        source: the baseline file, for the report.
        factor: how many times worse a figure may get before it counts.

    Returns:
        ``{"file", "factor", "compared", "regressions": [...], "improved": [...], "cases_only_in_baseline",
        "cases_only_now", "checks_only_in_baseline", "checks_only_now"}``; each regression names the case,
        gate, prompt, rule (``case error`` / ``now fails`` / ``worse``), both figures and the limit.

    Raises:
        ValueError: ``factor`` < 1.
    """
    if not factor >= 1:
        raise ValueError(f"regression factor {factor}: expected >= 1")
    base_cases = {c["case"]: c for c in baseline.get("cases", [])}
    now_cases = {c["case"]: c for c in current.get("cases", [])}
    regressions, improved = [], []
    compared = only_base = only_now = 0
    for name, nc in now_cases.items():
        bc = base_cases.get(name)
        if bc is None:
            continue
        if nc.get("error") and not bc.get("error"):
            regressions.append({"case": name, "gate": "(case)", "prompt": None, "rule": "case error",
                                "baseline": "ran", "now": nc["error"]})
            continue
        bk, nk = _keyed(bc.get("checks", [])), _keyed(nc.get("checks", []))
        only_base += sum(1 for k in bk if k not in nk)
        only_now += sum(1 for k in nk if k not in bk)
        for k, n in nk.items():
            b = bk.get(k)
            if b is None or n.get("informational") or b.get("informational"):
                continue
            compared += 1
            row = {"case": name, "gate": n.get("gate"), "prompt": n.get("prompt"),
                   **{d: n[d] for d in DETAIL_KEYS if n.get(d) is not None},
                   "baseline": b.get("measured"), "now": n.get("measured"), "limit": n.get("limit"), "op": n.get("op")}
            if b.get("pass") and not n.get("pass"):
                regressions.append({**row, "rule": "now fails"})
                continue
            ref = max(_badness(b), _floor(n))
            if ref > 0 and _badness(n) > factor * ref:
                ratio = _badness(n) / ref if math.isfinite(_badness(n)) else math.inf
                regressions.append({**row, "rule": "worse", "ratio": ratio})
            elif not b.get("pass") and n.get("pass"):
                improved.append({**row, "rule": "now passes"})
    return {"file": str(source), "factor": factor, "compared": compared, "regressions": regressions,
            "improved": improved, "cases_only_in_baseline": sorted(set(base_cases) - set(now_cases)),
            "cases_only_now": sorted(set(now_cases) - set(base_cases)),
            "checks_only_in_baseline": only_base, "checks_only_now": only_now}


def baseline_section(data: Mapping[str, Any]) -> list[str]:
    """Markdown lines for the parity report's "Baseline comparison" section (empty when no baseline)."""

    b = data.get("baseline")
    if not b:
        return []
    regs = b["regressions"]
    lines = ["## Baseline comparison", "",
             f"Against `{b['file']}`: {b['compared']} checks compared; "
             f"**{len(regs)} regression{'s' if len(regs) != 1 else ''}** (a gate that passed now fails, or a figure "
             f"more than {b['factor']:g}x worse; see harness/parity/baseline.py)."]
    if b["cases_only_in_baseline"]:
        lines.append(f"Cases in the baseline but not in this run (not compared): {', '.join(b['cases_only_in_baseline'])}.")
    if b["cases_only_now"]:
        lines.append(f"New cases (no baseline): {', '.join(b['cases_only_now'])}.")
    if b["checks_only_in_baseline"] or b["checks_only_now"]:
        lines.append(f"Checks only in the baseline: {b['checks_only_in_baseline']}; only now: {b['checks_only_now']}.")
    lines.append("")
    if regs:
        rows = [{"case": r["case"], "gate": r["gate"], "prompt": r.get("prompt") or "", "rule": r["rule"],
                 "baseline": r.get("baseline"), "now": r.get("now"),
                 "ratio": f"{r['ratio']:.3g}x" if "ratio" in r else ""} for r in regs]
        cols = ["case", "gate", "prompt", "rule", "baseline", "now", "ratio"]
        frame = pd.DataFrame(rows, columns=cols, dtype=object)
        lines += [dataframe_markdown(frame, right=["baseline", "now", "ratio"]), ""]
    if b["improved"]:
        lines += ["Now passing (failed in the baseline): "
                  + ", ".join(f"{r['case']} {r['gate']} {r.get('prompt') or ''}".strip() for r in b["improved"]), ""]
    return lines
