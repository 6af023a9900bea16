"""Oracle drift: the figures that moved between a parity run with one oracle version and a run with another.

The gates were set with the pinned transformers (noxfile ``ORACLE_PIN``); the newest release must work too
(``nox -s oracle-latest``). Everything but the oracle is the same in both runs (the same checkpoints from the
cache, the same torch, one thread per case), so the harness's own figures are bit-identical and a figure that
moved is the oracle's doing. :func:`oracle_drift` lists every such figure, matched by (case, gate, prompt,
qtype, variant, occurrence) as :mod:`.baseline` matches checks, with:

* both figures, the relative change and both verdicts;
* the first diverging point: for a figure with a per-trace-point profile (``per_point``, ``encoder_points``), the
  first point in trace order (:func:`harness.traces.format.canonical_key`) whose figure differs between the two
  oracles, that is where the newer oracle's computation starts to differ; else the check's own first divergence
  or worst point; else ``logits`` (a figure with no trace);
* whether the gate involves the oracle (its pair names ``transformers`` or ``hf_processor``): a moved figure of
  another pair means something besides the oracle differed between the runs, and is listed as such.

Checks that only one run has (a check transformers could not run before, a ``runs`` row) and cases whose error
changed are listed too. Drift is a report, not a verdict: the gates of each run decide its exit status.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import pandas as pd

from ..core.io import dataframe_markdown
from ..traces.format import canonical_key
from .baseline import DETAIL_KEYS, _keyed

ORACLE_MARKERS = ("transformers", "hf_processor", "tokenizer.check")
"""A gate whose name holds one of these compares with (or runs) an oracle that moves with transformers (the
tokenizer checks compare with HF tokenizers, which a transformers upgrade may upgrade too)."""

PROFILE_KEYS = ("per_point", "encoder_points")
"""Check fields holding ``[[point, layer, figure], ...]`` in trace order."""


def is_oracle_gate(gate: str) -> bool:
    """Whether ``gate``'s figure involves the transformers oracle."""
    return any(m in gate for m in ORACLE_MARKERS)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _same(a: Any, b: Any) -> bool:
    x, y = _num(a), _num(b)
    return (math.isnan(x) and math.isnan(y)) or x == y


def first_moved_point(pinned: Mapping[str, Any], newest: Mapping[str, Any]) -> str | None:
    """The first trace point (canonical order) whose figure differs between the two checks' profiles, as
    ``point@layer``; None when neither holds a profile or the profiles agree point for point."""
    for key in PROFILE_KEYS:
        a, b = pinned.get(key), newest.get(key)
        if not isinstance(a, list) or not isinstance(b, list):
            continue
        pa = {(str(p), int(layer)): v for p, layer, v in a}
        pb = {(str(p), int(layer)): v for p, layer, v in b}
        order = [k for k in pa if k in pb] + [k for k in pb if k not in pa]
        order.sort(key=lambda k: canonical_key(*k))
        for k in order:
            if k not in pa or k not in pb or not _same(pa[k], pb[k]):
                return f"{k[0]}@{k[1]}"
    return None


def _where(pinned: Mapping[str, Any], newest: Mapping[str, Any]) -> str:
    moved = first_moved_point(pinned, newest)
    if moved:
        return moved
    for c in (newest, pinned):
        for key in ("first_divergence", "worst_point", "worst_at"):
            v = c.get(key)
            if isinstance(v, dict):
                return f"{v.get('point')}@{v.get('layer')}"
            if isinstance(v, str) and v:
                return v
    return "logits" if "logit" in str(newest.get("gate", "")) else "(no trace)"


def _versions(results: Mapping[str, Any]) -> str:
    return str(results.get("versions", {}).get("transformers", "?"))


def oracle_drift(pinned: Mapping[str, Any], newest: Mapping[str, Any], source: str = "") -> dict[str, Any]:
    """The figures that moved between two parity results (module docstring).

    Args:
        pinned: the results with the oracle the gates were set with (``results.json`` as a dict).
        newest: the results with the other oracle (this run).
        source: the pinned results' file, for the report.

    Returns:
        ``{"file", "pinned", "newest" (transformers versions), "compared", "moved": [row, ...],
        "only_pinned": [...], "only_newest": [...], "case_errors": [...]}``; a row holds ``case``, ``gate``,
        ``prompt``, the detail keys, ``pinned``, ``newest``, ``rel_change``, ``pinned_pass``, ``newest_pass``,
        ``first_diverging_point``, ``oracle`` (whether the gate involves transformers) and, where a check was
        not measured on one side, its ``got``; ``assistant_construction`` lists the cases whose MTP assistant
        transformers built another way (``patched`` -> ``native``, :mod:`harness.core.hf_assistant`).
    """
    base = {c["case"]: c for c in pinned.get("cases", [])}
    moved, only_p, only_n, errors, constructions = [], [], [], [], []
    compared = 0
    for nc in newest.get("cases", []):
        name = nc["case"]
        bc = base.get(name)
        if bc is None:
            continue
        if (bc.get("error") or None) != (nc.get("error") or None):
            errors.append({"case": name, "pinned": bc.get("error") or "ran", "newest": nc.get("error") or "ran"})
        bk, nk = _keyed(bc.get("checks", [])), _keyed(nc.get("checks", []))
        for k, n in nk.items():
            b = bk.get(k)
            label = {"case": name, "gate": n.get("gate"), "prompt": n.get("prompt"),
                     **{d: n[d] for d in DETAIL_KEYS if n.get(d) is not None}}
            if b is None:
                only_n.append({**label, "newest": n.get("measured"), "newest_pass": n.get("pass"),
                               **({"got": n["got"]} if isinstance(n.get("got"), str) else {})})
                continue
            compared += 1
            if b.get("construction") != n.get("construction") and "construction" in n:
                constructions.append({"case": name, "gate": n.get("gate"), "pinned": b.get("construction"),
                                      "newest": n.get("construction")})
            if _same(b.get("measured"), n.get("measured")) and b.get("got") == n.get("got"):
                continue
            p, q = _num(b.get("measured")), _num(n.get("measured"))
            rel = abs(q - p) / max(abs(p), abs(q)) if math.isfinite(p) and math.isfinite(q) and max(abs(p), abs(q)) \
                else math.inf
            moved.append({**label, "pinned": b.get("measured"), "newest": n.get("measured"), "rel_change": rel,
                          "pinned_pass": b.get("pass"), "newest_pass": n.get("pass"),
                          "first_diverging_point": _where({**b, "gate": b.get("gate")}, {**n, "gate": n.get("gate")}),
                          "oracle": is_oracle_gate(str(n.get("gate"))),
                          **({"got": f"{b.get('got')} -> {n.get('got')}"} if b.get("got") != n.get("got") else {})})
        for k, b in bk.items():
            if k not in nk:
                only_p.append({"case": name, "gate": b.get("gate"), "prompt": b.get("prompt"),
                               "pinned": b.get("measured"), "pinned_pass": b.get("pass"),
                               **({"got": b["got"]} if isinstance(b.get("got"), str) else {})})
    return {"file": str(source), "pinned": _versions(pinned), "newest": _versions(newest), "compared": compared,
            "moved": moved, "only_pinned": only_p, "only_newest": only_n, "case_errors": errors,
            "assistant_construction": constructions}


def _fmt(v: Any) -> str:
    x = _num(v)
    return f"{x:.4g}" if math.isfinite(x) else str(v)


def drift_rows(drift: Mapping[str, Any]) -> list[dict[str, str]]:
    """The drift table's rows (for the report and the terminal)."""
    return [{"case": r["case"], "gate": r["gate"], "prompt": str(r.get("prompt") or ""),
             "pinned": _fmt(r["pinned"]), "newest": _fmt(r["newest"]),
             "change": f"{100 * r['rel_change']:.3g} %" if math.isfinite(r["rel_change"]) else "inf",
             "verdict": f"{'PASS' if r['pinned_pass'] else 'FAIL'} -> {'PASS' if r['newest_pass'] else 'FAIL'}",
             "first diverging point": r["first_diverging_point"], "oracle": "yes" if r["oracle"] else "NO"}
            for r in drift["moved"]]


def only_summary(rows: list[Mapping[str, Any]], side: str) -> list[str]:
    """Checks one run has and the other lacks, one phrase per (case, gate): how many, the range of the figures,
    the verdicts and the reason a check gave (``side``: ``newest`` or ``pinned``)."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["gate"]), []).append(r)
    out = []
    for (case, gate), rs in groups.items():
        vals = sorted(_num(r.get(side)) for r in rs)
        finite = [v for v in vals if math.isfinite(v)]
        fig = (f"{finite[0]:.3g}" if finite[0] == finite[-1] else f"{finite[0]:.3g}..{finite[-1]:.3g}") if finite \
            else _fmt(rs[0].get(side))
        passed = sum(bool(r.get(f"{side}_pass")) for r in rs)
        got = next((r["got"] for r in rs if r.get("got")), None)
        out.append(f"{case} {gate}: {len(rs)} check{'s' if len(rs) != 1 else ''}, {fig}, {passed} within the gate"
                   + (f" ({got})" if got else ""))
    return out


def drift_section(data: Mapping[str, Any]) -> list[str]:
    """Markdown lines of the report's "Oracle drift" section (empty without ``--oracle-drift``)."""
    d = data.get("oracle_drift")
    if not d:
        return []
    not_oracle = [r for r in d["moved"] if not r["oracle"]]
    lines = ["## Oracle drift", "",
             f"transformers {d['pinned']} (`{d['file']}`) -> {d['newest']} (this run): {d['compared']} figures "
             f"compared, **{len(d['moved'])} moved**"
             + (f", {len(not_oracle)} of them outside the oracle's pairs" if not_oracle else "") + ".", ""]
    if d["moved"]:
        cols = ["case", "gate", "prompt", "pinned", "newest", "change", "verdict", "first diverging point", "oracle"]
        lines += [dataframe_markdown(pd.DataFrame(drift_rows(d), columns=cols, dtype=object),
                                     right=["pinned", "newest", "change"]), ""]
    for key, title in (("only_newest", "Only with the newest oracle"), ("only_pinned", "Only with the pinned oracle")):
        if d[key]:
            lines += [f"{title}: " + "; ".join(only_summary(d[key], key.split("_")[1])) + ".", ""]
    for e in d["case_errors"]:
        lines += [f"Case {e['case']}: {e['pinned']} -> {e['newest']}.", ""]
    ways = sorted({(c["pinned"], c["newest"]) for c in d.get("assistant_construction", [])})
    for before, after in ways:
        cases = [c["case"] for c in d["assistant_construction"] if (c["pinned"], c["newest"]) == (before, after)]
        lines += [f"The MTP assistant: {before} -> {after} construction ({', '.join(cases)}).", ""]
    return lines
