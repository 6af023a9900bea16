"""The parity report: ``report.md`` (verdict first), ``results.json``, plots.

Layout of ``report.md``: the overall verdict; one row per case and gate with the
worst measured value; for every failing case the first diverging trace point;
per-layer error growth (a table and one plot per compared pair); the per-position
KLD histogram; then details per prompt. Tables are pandas DataFrames rendered with
:func:`harness.core.io.dataframe_markdown`.

Plots (matplotlib, Agg canvas, written atomically):

* ``layer_error-<pair>.png`` for every pair whose checks carry ``per_point`` data
  (reference~transformers, reference~fast, reference~fast_bf16,
  fast.chunked~oneshot, reference~llamacpp where llama.cpp ran): the relative L2
  at each layer's output (``l_out``) against the layer index, log y, one line
  per case (the largest over the pair's prompts / variants);
* ``kld_hist.png``: the per-position KLD of every check that carries a
  ``kld_hist`` (:func:`harness.core.metrics.kld_histogram`: every pair's ``mean_kld``, reference~fast on
  the real Gemma 3 GGUF), log x, one panel per pair and one line per case.
"""

from __future__ import annotations

import io
import math
import numbers
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..core.gates import DEFAULT_GATES
from ..core.io import dataframe_markdown, write_bytes_atomic, write_json_atomic, write_text_atomic
from ..core.metrics import KLD_HIST_FLOOR_LOG10
from ..core.text import for_markdown, for_markdown_code, for_terminal, for_xml
from .baseline import baseline_section
from .checks.server import report_lines as server_report_lines
from .drift import drift_section
from .explain_report import explanation_lines

LAYER_POINT = "l_out"
"""The trace point whose per-layer error the plots show (each layer's output)."""

PLOT_FLOOR = 1e-18
"""A relative error of exactly 0 (bit-identical) is drawn at this value on the log axis."""


LAYER_GATES: dict[str, tuple[float, str]] = {
    "reference~transformers": (DEFAULT_GATES["reference~transformers.layer_rel_l2"].limit,
                               "rel. L2 <= {:g}".format(DEFAULT_GATES["reference~transformers.layer_rel_l2"].limit)),
    "reference~fast": (DEFAULT_GATES["reference~fast.layer_rel_l2"].limit,
                       "rel. L2 <= {:g}".format(DEFAULT_GATES["reference~fast.layer_rel_l2"].limit)),
}
"""The gate line drawn on a pair's per-layer plot (default gates; a case override is in the tables): the
rel. L2 bound."""

DETAIL_KEYS = ("tokens", "same_top1", "worst_point", "max_abs_logit_at", "worst_at", "qtype", "variant", "positions",
               "steps", "request", "step", "expected", "got", "last_error")
"""The facts of a check that the details table shows (where they are set)."""

NOTE_CHARS = 140
"""Longest informational reason quoted in the summary table (the details section has every reason whole)."""


def worst_place(chk: dict[str, Any]) -> str | None:
    """Where a check's figure was measured at its worst, as ``request R position P token T`` (logits),
    ``request R step S token T`` (greedy log-probs), ``request R <point>@<layer>`` (trace points) or ``request R``;
    None when the check does not say."""
    at = chk.get("worst_at")
    if isinstance(at, str) and at:
        return at.split(":", 1)[0]
    request = f"request {chk['prompt']}" if chk.get("prompt") is not None else None
    pos = chk.get("max_abs_logit_at")
    if isinstance(pos, (list, tuple)) and len(pos) == 2:
        return " ".join(x for x in (request, f"position {pos[0]} token {pos[1]}") if x)
    if chk.get("worst_point"):
        return " ".join(x for x in (request, str(chk["worst_point"])) if x)
    return request


def _engine_note(chk: dict[str, Any]) -> str:
    """An engine failure in one line: where (request, step), what, and the engine's own last error line."""
    where = chk.get("first_divergence")
    last = chk.get("last_error")
    line = str(chk.get("got") or "")
    return (f"{'at ' + where + ': ' if where else ''}{line}"
            + (f" (the engine's last error: {last})" if last and str(last) not in line else ""))


def _worst(group: Sequence[dict[str, Any]], op: str) -> dict[str, Any]:
    """The check of ``group`` nearest its own limit or furthest beyond it: for an upper bound the largest
    measured / limit (the largest measured when the limits are one), else the smallest measured. A failing check
    is always picked before a passing one."""
    def key(k: dict[str, Any]) -> tuple[bool, float]:
        m, lim = _num(k["measured"]), k["limit"]
        if m != m:  # NaN: nothing is further from a limit
            return (not k["pass"], math.inf)
        if op != "le":
            return (not k["pass"], -m)
        return (not k["pass"], m / lim if lim and lim > 0 else m)
    return max(group, key=key)


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, gate): worst measured value (and where it was measured), limit, result. Errors get a row
    of their own; an engine failure is ``ENGINE FAILED``; a gate that measured nothing is ``NOT MEASURED``, never a
    pass."""
    rows = []
    for c in data["cases"]:
        if c["error"]:
            rows.append({"case": c["case"], "gate": "(case could not run)", "worst": "", "limit": "",
                         "result": "ENGINE FAILED" if c.get("error_kind") == "engine" else "ERROR",
                         "note": c["error"]})
            continue
        by_gate: dict[str, list[dict[str, Any]]] = {}
        for chk in c["checks"]:
            by_gate.setdefault(chk["gate"], []).append(chk)
        for gate, checks in by_gate.items():
            # gating, informational and unmeasured checks of one gate get separate rows, so an informational
            # check can never hide a gating failure, nor an unmeasured one read as a pass
            gating = [k for k in checks if not k.get("informational")]
            info = [k for k in checks if k.get("informational") and not k.get("not_measured")]
            unmeasured = [k for k in checks if k.get("informational") and k.get("not_measured")]
            op = checks[0]["op"]
            limit = f"{'<=' if op == 'le' else '>='} {checks[0]['limit']:g}"
            if unmeasured:
                reasons = sorted({str(k["not_measured"]) for k in unmeasured})
                rows.append({"case": c["case"], "gate": gate, "worst": "", "limit": limit, "result": "NOT MEASURED",
                             "note": f"not measured: {'; '.join(reasons)}"[:NOTE_CHARS + 40]})
            for group, is_info in ((gating, False), (info, True)):
                if not group:
                    continue
                worst = _worst(group, op)
                # an informational figure with no value (a ratio whose null was not computed): no "nan", no count
                blank = is_info and all(_num(k["measured"]) != _num(k["measured"]) for k in group)
                note = "no value" if blank else f"{sum(k['pass'] for k in group)}/{len(group)} within"
                limits = sorted({k["limit"] for k in group})
                if len(limits) > 1:  # raised per figure by the effect of the engine's declared approximations
                    note += f"; limit per figure {limits[0]:.3g}..{limits[-1]:.3g}, the worst's shown"
                place = worst_place(worst)
                if place:
                    note += f"; worst at {place}"
                if is_info:
                    reasons = sorted({k.get("reason", "") for k in group if k.get("reason")})
                    first = reasons[0] if len(reasons[0]) <= NOTE_CHARS else reasons[0][:NOTE_CHARS - 3] + "..."
                    more = f" (+{len(reasons) - 1} more reasons, see details)" if len(reasons) > 1 else ""
                    note += f"; not gating: {first}{more}"
                if worst.get("first_divergence") and not worst.get("engine_failure"):
                    note += f"; first divergence {worst['first_divergence']}"
                ok = all(k["pass"] for k in group)
                failing = [k for k in group if not k["pass"]]
                engine = [k for k in failing if k.get("engine_failure")]
                if not is_info and engine:
                    note = _engine_note(engine[0])[:NOTE_CHARS + 80]
                elif not is_info and failing:
                    why = failing[0].get("why") or failing[0].get("got")
                    said = str(worst.get("first_divergence") or "")
                    if isinstance(why, str) and why and not (said and said in why):
                        name = f"request {failing[0]['prompt']}: " if failing[0].get("prompt") is not None else ""
                        note += f"; {name}{why}"[:NOTE_CHARS + 40]
                result = "INFO" if is_info else ("PASS" if ok else ("ENGINE FAILED" if engine else "FAIL"))
                rows.append({"case": c["case"], "gate": gate,
                             "worst": "" if (engine and not is_info) or blank else f"{_num(worst['measured']):.3g}",
                             "limit": f"{'<=' if op == 'le' else '>='} {worst['limit']:g}", "result": result,
                             "note": note})
        if c.get("info", {}).get("skipped"):
            rows.append({"case": c["case"], "gate": "(oracle)", "worst": "", "limit": "", "result": "SKIP",
                         "note": c["info"]["skipped"]})
    return rows


def pair_of(gate: str) -> str:
    """The compared pair of a gate name: everything before the last ``.`` (``fast.chunked~oneshot.max_abs_logit``
    -> ``fast.chunked~oneshot``)."""
    return gate.rsplit(".", 1)[0] if "." in gate else gate


def pair_slug(pair: str) -> str:
    """A file-name-safe form of a pair name: ``~`` becomes ``_vs_``, anything but letters, digits, ``.``,
    ``_`` and ``-`` becomes ``-`` (``reference~transformers`` -> ``reference_vs_transformers``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", pair.replace("~", "_vs_"))


def _num(v: Any) -> float:
    """A measured value as a float; results.json spells non-finite values ``"NaN"`` / ``"Infinity"``."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _check_layers(chk: dict[str, Any]) -> dict[int, float]:
    """Layer -> relative L2 at :data:`LAYER_POINT` of one check's ``per_point``; a check without that point
    gives the largest value over its points of each layer. Non-finite values are left out."""
    at_out: dict[int, float] = {}
    any_point: dict[int, float] = {}
    for point, layer, v in chk.get("per_point") or []:
        v = _num(v)
        if not isinstance(layer, numbers.Integral) or isinstance(layer, bool) or layer < 0 or not math.isfinite(v):
            continue
        any_point[layer] = max(any_point.get(layer, v), v)
        if point == LAYER_POINT:
            at_out[layer] = max(at_out.get(layer, v), v)
    return at_out or any_point


def per_layer_frame(data: dict[str, Any]) -> Any:
    """Per-layer error of every pair and case as a long pandas DataFrame.

    Columns ``pair``, ``case``, ``layer``, ``rel_l2``: for each case and compared pair (see :func:`pair_of`)
    the largest relative L2 at each layer's output over the pair's checks that carry ``per_point``
    (prompts, variants). Rows in case order, pairs in the order met, layers ascending.
    """
    rows = []
    for c in data["cases"]:
        if c.get("error"):
            continue
        by_pair: dict[str, dict[int, float]] = {}
        for chk in c.get("checks", []):
            layers = _check_layers(chk)
            if not layers:
                continue
            acc = by_pair.setdefault(pair_of(chk["gate"]), {})
            for layer, v in layers.items():
                acc[layer] = max(acc.get(layer, v), v)
        for pair, acc in by_pair.items():
            rows += [{"pair": pair, "case": c["case"], "layer": layer, "rel_l2": acc[layer]} for layer in sorted(acc)]
    return pd.DataFrame(rows, columns=["pair", "case", "layer", "rel_l2"])


def layer_summary_frame(frame: Any) -> Any:
    """One row per pair and case from :func:`per_layer_frame`: number of layers, relative L2 at the first
    and last layer, the largest, and the growth from first to last layer (``last / first``; empty when
    the first is 0)."""
    cols = ["pair", "case", "layers", "first layer", "last layer", "max", "last / first"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    g = frame.sort_values("layer").groupby(["pair", "case"], sort=False)["rel_l2"]
    out = g.agg(layers="count", first="first", last="last", max="max").reset_index()
    out["growth"] = [last / first if first > 0 else None for first, last in zip(out["first"], out["last"])]
    out = out.rename(columns={"first": "first layer", "last": "last layer", "growth": "last / first"})
    for col in ("first layer", "last layer", "max", "last / first"):
        out[col] = out[col].map(lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v))
                                else f"{v:.3g}")
    order = {p: i for i, p in enumerate(dict.fromkeys(frame["pair"]))}
    return out.sort_values("pair", key=lambda s: s.map(order), kind="stable")[cols].reset_index(drop=True)


def _save_png(fig: Any, path: Path) -> None:
    """Render ``fig`` (a matplotlib Figure on an Agg canvas) to PNG bytes and write them atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    write_bytes_atomic(path, buf.getvalue())


def _figure(width: float, height: float, nrows: int = 1) -> tuple[Any, list[Any]]:
    """A matplotlib Figure on the Agg canvas (no pyplot, no global state) and its ``nrows`` axes."""

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, 1, i + 1) for i in range(nrows)]
    return fig, axes


def _plot_layers(run_dir: Path, data: dict[str, Any]) -> dict[str, str]:
    """``layer_error-<pair>.png`` per compared pair with per-layer data (see module docstring).

    Returns:
        pair -> file name (relative to ``run_dir``), in the order of :func:`per_layer_frame`; empty when no
        check carries per-layer data.
    """
    frame = per_layer_frame(data)
    out: dict[str, str] = {}
    for pair, sub in frame.groupby("pair", sort=False):
        fig, (ax,) = _figure(7, 4)
        zeros = False
        for case, rows in sub.groupby("case", sort=False):
            ys = [max(v, PLOT_FLOOR) for v in rows["rel_l2"]]
            zeros = zeros or any(v <= 0 for v in rows["rel_l2"])
            ax.semilogy(list(rows["layer"]), ys, marker="o", markersize=3, label=str(case))
        limit = LAYER_GATES.get(str(pair))
        if limit is not None:
            ax.axhline(limit[0], color="red", linestyle="--", linewidth=1, label=f"gate: {limit[1]}")
        ax.set_xlabel("layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(f"max rel. L2 at {LAYER_POINT}" + (f"\n(0 drawn at {PLOT_FLOOR:g})" if zeros else ""))
        ax.set_title(f"per-layer error growth: {pair}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"layer_error-{pair_slug(str(pair))}.png"
        _save_png(fig, run_dir / name)
        out[str(pair)] = name
    return out


def merge_kld_hists(hists: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """Add :func:`harness.core.metrics.kld_histogram` results bin by bin (they share one fixed grid).

    Returns:
        the combined histogram in the same form, or None when ``hists`` is empty.

    Raises:
        ValueError: the histograms use different ``bins_per_decade``.
    """
    hists = list(hists)
    if not hists:
        return None
    b = hists[0]["bins_per_decade"]
    if any(h["bins_per_decade"] != b for h in hists):
        raise ValueError("merge_kld_hists: histograms with different bins_per_decade")
    filled = [h for h in hists if h["counts"]]
    out = {"n": sum(h["n"] for h in hists), "bins_per_decade": b, "counts": [],
           "log10_lo": min(h["log10_lo"] for h in hists),
           "below": sum(h["below"] for h in hists), "nonfinite": sum(h.get("nonfinite", 0) for h in hists)}
    if filled:
        lo = min(round(h["log10_lo"] * b) for h in filled)
        hi = max(round(h["log10_lo"] * b) + len(h["counts"]) for h in filled)
        counts = [0] * (hi - lo)
        for h in filled:
            start = round(h["log10_lo"] * b) - lo
            for i, n in enumerate(h["counts"]):
                counts[start + i] += n
        out.update(log10_lo=lo / b, counts=counts)
    return out


def kld_hists(data: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(pair, case) -> the per-position KLD histogram of that case's checks of that pair, merged
    (:func:`merge_kld_hists`); in case order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in data["cases"]:
        for chk in c.get("checks", []) if not c.get("error") else []:
            if isinstance(chk.get("kld_hist"), dict):
                groups.setdefault((pair_of(chk["gate"]), c["case"]), []).append(chk["kld_hist"])
    return {k: merge_kld_hists(v) for k, v in groups.items()}


def kld_summary_frame(hists: dict[tuple[str, str], dict[str, Any]]) -> Any:
    """One row per pair and case of :func:`kld_hists`: positions, how many lie below the histogram floor
    (``1e-16``: rounding noise, exact zeros), the most populated bin and the highest non-empty bin."""

    def edges(h: dict[str, Any], i: int) -> str:
        b = h["bins_per_decade"]
        return f"[{10 ** (h['log10_lo'] + i / b):.2g}, {10 ** (h['log10_lo'] + (i + 1) / b):.2g})"

    rows = []
    for (pair, case), h in hists.items():
        counts = h["counts"]
        rows.append({"pair": pair, "case": case, "positions": h["n"],
                     f"< 1e{KLD_HIST_FLOOR_LOG10}": h["below"],
                     "most positions in": edges(h, counts.index(max(counts))) if counts else "",
                     "highest bin": edges(h, len(counts) - 1) if counts else ""})
    return pd.DataFrame(rows, columns=["pair", "case", "positions", f"< 1e{KLD_HIST_FLOOR_LOG10}",
                                       "most positions in", "highest bin"])


def _plot_kld(run_dir: Path, data: dict[str, Any]) -> str | None:
    """``kld_hist.png``: per-position KLD histograms (log x), one panel per pair, one line per case;
    returns the file name, or None when no check carries a ``kld_hist``."""
    hists = kld_hists(data)
    if not hists:
        return None
    pairs = list(dict.fromkeys(p for p, _ in hists))
    fig, axes = _figure(7, 3.2 * len(pairs), nrows=len(pairs))
    for ax, pair in zip(axes, pairs):
        drawn = False
        for (p, case), h in hists.items():
            if p != pair:
                continue
            b = h["bins_per_decade"]
            top = 10 ** (h["log10_lo"] + len(h["counts"]) / b) if h["counts"] else None
            label = (f"{case} ({h['n']} pos." + (f", {h['below']} < 1e-16" if h["below"] else "")
                     + (f", max < {top:.2g}" if top else "") + ")")
            if h["counts"]:
                edges = [10 ** (h["log10_lo"] + i / b) for i in range(len(h["counts"]) + 1)]
                ax.stairs(h["counts"], edges, label=label)
                drawn = True
            else:
                ax.plot([], [], label=label)
        ax.set_xscale("log")
        if not drawn:
            ax.set_xlim(1e-16, 1.0)
        ax.set_yscale("symlog", linthresh=1.0)  # a single position in a far bin stays visible beside hundreds
        ax.set_xlabel("KLD per position (reference = base)")
        ax.set_ylabel("positions (symlog)")
        ax.set_title(f"per-position KLD: {pair}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    name = "kld_hist.png"
    _save_png(fig, run_dir / name)
    return name


def _cell(text: str) -> str:
    """:func:`for_markdown` for a table cell (:func:`dataframe_markdown` escapes the pipes itself)."""
    return for_markdown(text).replace("\\|", "|")


def _table(rows: list[dict[str, Any]], columns: list[str], right: Iterable[str] = (), escape: Any = _cell) -> str:
    """``rows`` as a pandas DataFrame with ``columns`` (missing keys empty), rendered to Markdown; every text cell
    through ``escape`` (:mod:`harness.core.text`: an engine's words are text in the report, and on the terminal)."""
    frame = pd.DataFrame([{c: escape(v) if isinstance(v := r.get(c), str) else v for c in columns} for r in rows],
                         columns=columns, dtype=object)
    return dataframe_markdown(frame, right=list(right))


def render_markdown(data: dict[str, Any], layer_plots: dict[str, str] | None = None,
                    kld_plot: str | None = None) -> str:
    """The report text (see module docstring).

    Args:
        data: the parity results (as written to ``results.json``).
        layer_plots: pair -> file name of its per-layer plot (:func:`_plot_layers`); linked under
            "Per-layer error" together with the per-layer table.
        kld_plot: file name of the KLD histogram (:func:`_plot_kld`); linked under "Per-position KLD".
    """
    status = {0: "PASS: every gate passed", 1: "FAIL: a gate failed or an engine failed",
              2: "BAD INPUT: a model could not be read"}
    if data.get("baseline", {}).get("regressions"):
        status[1] += f" or a figure regressed against the baseline ({len(data['baseline']['regressions'])})"
    head = data.get("verdict") or f"{status[data['status']]} ({len(data['cases'])} cases)"
    versions = data.get("versions") or {}
    made = ", ".join(f"{k} {versions[k]}" for k in ("transformers", "torch", "llama-cpp-python") if k in versions)
    lines = ["# Parity report", "", f"**{for_markdown(head)}** (created {data['created_utc']}" + (f"; {made}" if made else "") + ")",
             ""]
    lines += explanation_lines(data)  # why a failing pair diverges (spec variants), one line each
    lines += [_table(summarize(data), ["case", "gate", "worst", "limit", "result", "note"], right=["worst"]), ""]
    lines += baseline_section(data)  # empty without --baseline
    lines += drift_section(data)  # empty without --oracle-drift
    failing = [c for c in data["cases"]
               if c["error"] or not all(k["pass"] or k.get("informational") for k in c["checks"])]
    if failing:
        lines += ["## First divergence", ""]
        for c in failing:
            lines += first_divergence_lines(c)
        lines.append("")
    if layer_plots:
        lines += ["## Per-layer error", "",
                  f"Relative L2 at each layer's output (`{LAYER_POINT}`) against the other side of the pair, the "
                  "largest over the pair's prompts; one plot per compared pair, one line per case.", ""]
        lines += [dataframe_markdown(layer_summary_frame(per_layer_frame(data)),
                                     right=["first layer", "last layer", "max", "last / first"]), ""]
        for pair, name in layer_plots.items():
            lines += [f"### `{pair}`", "", f"![per-layer error: {pair}]({name})", ""]
    hists = kld_hists(data)
    if hists:
        lines += ["## Per-position KLD", "",
                  "KL(reference || other) at every position, counted on fixed log bins (4 per decade).", ""]
        lines += [dataframe_markdown(kld_summary_frame(hists)), ""]
        if kld_plot:
            lines += [f"![per-position KLD]({kld_plot})", ""]
    lines += ["## Details", ""]
    for c in data["cases"]:
        lines += [f"### {c['case']} ({c['kind']})", ""]
        if c.get("description"):
            lines += [c["description"], ""]
        lines += [f"model: {for_markdown_code(c['model'])}", ""]
        if c["kind"] == "synthetic":
            lines += ["(cached~uncached needs at least two tokens, so the 1-token prompt has no such row.)", ""]
        if c["error"]:
            lines += [f"error: {for_markdown(c['error'])}", ""]
            continue
        rows = [{"gate": k["gate"], "prompt": "" if k["prompt"] is None else str(k["prompt"]).replace("\n", "\\n"),
                 "measured": "" if k.get("not_measured") else f"{_num(k['measured']):.3g}",
                 "pass": "yes" if k["pass"] else ("not measured" if k.get("not_measured") else
                                                  "info" if k.get("informational") else
                                                  "ENGINE FAILED" if k.get("engine_failure") else "NO"),
                 "extra": ", ".join(f"{x}={k[x]!r}" if isinstance(k[x], str) else f"{x}={k[x]}"
                                    for x in DETAIL_KEYS if x in k and k[x] is not None)} for k in c["checks"]]
        lines += [_table(rows, ["gate", "prompt", "measured", "pass", "extra"], right=["measured"]), ""]
        lines += server_report_lines(c)  # a server case: its dialect, per-request batch invariance
        why = {}
        for k in c["checks"]:
            if k.get("informational") and k.get("reason"):
                why.setdefault(k["gate"], [])
                if k["reason"] not in why[k["gate"]]:
                    why[k["gate"]].append(k["reason"])
        if why:
            lines += ["Not gating here, with the case's reasons:", ""]
            lines += [f"- `{g}`: " + " / ".join(map(for_markdown, rs)) for g, rs in sorted(why.items())] + [""]
        drift = c.get("info", {}).get("quant_logit_drift")
        if drift:
            lines += ["Quantized GGUF logit drift vs F32 (informational, longest prompt, max |Δlogit|): "
                      + ", ".join(f"{k} {v:.3g}" for k, v in sorted(drift.items()))
                      + (". On an MoE model a rounded weight can flip a top-k routing choice, which moves "
                         "that token's logits by whole units; dense models drift far less." if
                         c.get("info", {}).get("config", {}).get("n_expert") else ""), ""]
    return "\n".join(lines) + "\n"


def first_divergence_lines(c: dict[str, Any]) -> list[str]:
    """The "First divergence" lines of one failing case: its engine failures (where: request and step, what, the
    engine's own last error line), else its first failing gate, named by where it was measured and, for a trace or
    logits figure, the first diverging point."""
    case = c["case"]
    if c["error"]:
        head = "ENGINE FAILED" if c.get("error_kind") == "engine" else "could not run"
        return [f"- **{for_markdown(case)}**: {head}: {for_markdown(c['error'])}"]
    failing = [k for k in c["checks"] if not k["pass"] and not k.get("informational")]
    engine = [k for k in failing if k.get("engine_failure")]
    if engine:
        out = []
        for k in engine:
            pair = k["gate"].rsplit(".", 1)[0]
            where = ", ".join(x for x in (f"request {for_markdown_code(k['request'])}" if k.get("request") is not None else "",
                                          f"step {k['step']}" if k.get("step") is not None else "") if x)
            last = k.get("last_error")
            line = str(k.get("got") or "")
            out.append(f"- **{for_markdown(case)}** `{pair}`: ENGINE FAILED{' at ' + where if where else ''}: "
                       f"{for_markdown(line)}" + (f"; the engine's last error line: {for_markdown_code(last)}"
                                                  if last and str(last) not in line else ""))
        return out
    if not failing:
        return []
    k = failing[0]
    measured = "" if k.get("not_measured") else f" = {_num(k['measured']):.3g} (limit {_num(k['limit']):g})"
    place = worst_place(k)
    where = k.get("first_divergence")
    why = k.get("why") or k.get("got")
    text = f"- **{for_markdown(case)}** `{k['gate']}`{measured}" + (f" at {for_markdown(place)}" if place else "")
    if where:
        text += f"; first diverging point: {for_markdown(where)}"
    elif isinstance(why, str) and why:
        text += f"; {for_markdown(why)}"
    return [text]


def write_parity_report(run_dir: Path, data: dict[str, Any]) -> None:
    """Write ``results.json``, the plots (``layer_error-<pair>.png``, ``kld_hist.png``) and ``report.md``
    into ``run_dir``, each atomically (the report last, so the files it links exist)."""
    write_json_atomic(run_dir / "results.json", data)
    layer_plots = _plot_layers(run_dir, data)
    kld_plot = _plot_kld(run_dir, data)
    write_text_atomic(run_dir / "report.md", render_markdown(data, layer_plots, kld_plot))


def short_table(data: dict[str, Any]) -> str:
    """The table printed on the terminal: one line per case and gate."""
    return _table(summarize(data), ["case", "gate", "worst", "limit", "result"], right=["worst"],
                  escape=lambda t: for_terminal(t, newlines=False))


def junit_xml(data: dict[str, Any]) -> str:
    """The results as JUnit XML: one ``<testsuite>`` per case, one ``<testcase>`` per check.

    A check's name is its gate, with the prompt and variant when it has them (``reference~transformers.
    max_abs_logit[len17-window+1]``); a failing gating check is a ``<failure>`` whose message names the gate,
    the measured figure and the limit (and why, when the check says); an informational one is reported as
    passed with its reason in ``<system-out>``; a case that could not run is one ``<error>``. CI systems show
    parity as ordinary test results from it.
    """
    root = ET.Element("testsuites", name="g4h parity", tests="0", failures="0", errors="0")
    total = failures = errors = 0
    for c in data["cases"]:
        suite = ET.SubElement(root, "testsuite", name=str(c["case"]), time=f"{float(c.get('seconds') or 0):.3f}")
        n_fail = n_err = 0
        if c.get("error"):
            tc = ET.SubElement(suite, "testcase", classname=str(c["case"]), name="(case could not run)")
            ET.SubElement(tc, "error", message=str(c["error"]), type=str(c.get("error_kind") or "error"))
            n_err += 1
        for k in c.get("checks", []):
            label = k["gate"] + "".join(f"[{k[x]}]" for x in ("prompt", "variant", "qtype")
                                        if k.get(x) not in (None, ""))
            tc = ET.SubElement(suite, "testcase", classname=str(c["case"]), name=label)
            op = "<=" if k["op"] == "le" else ">="
            figure = f"{k['gate']} = {_num(k['measured']):.4g} (limit {op} {_num(k['limit']):g})"
            if k.get("not_measured"):
                ET.SubElement(tc, "skipped", message=f"not measured: {k['not_measured']}")
            elif k.get("informational"):
                ET.SubElement(tc, "system-out").text = f"informational: {figure}; {k.get('reason', '')}"
            elif not k["pass"] and k.get("engine_failure"):
                ET.SubElement(tc, "failure", message=f"ENGINE FAILED: {_engine_note(k)}", type="engine")
            elif not k["pass"]:
                why = k.get("why") or k.get("got") or k.get("first_divergence") or k.get("first_fault")
                ET.SubElement(tc, "failure", message=figure + (f"; {why}" if why else ""), type="gate")
                n_fail += 1
        n = len(suite)
        suite.set("tests", str(n))
        suite.set("failures", str(n_fail))
        suite.set("errors", str(n_err))
        total, failures, errors = total + n, failures + n_fail, errors + n_err
    root.set("tests", str(total))
    root.set("failures", str(failures))
    root.set("errors", str(errors))
    for el in root.iter():  # every text from an engine or a file: only what XML 1.0 can hold (harness.core.text)
        for name, value in el.attrib.items():
            el.set(name, for_xml(value))
        if el.text:
            el.text = for_xml(el.text)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
