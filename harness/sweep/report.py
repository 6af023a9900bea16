"""A sweep's outputs: ``results.json``, ``sweep.csv``, ``report.md`` and its plots.

* ``results.json`` (``schema: g4h-sweep``, version :data:`SCHEMA_VERSION`): the verdict and exit status, the
  options, the nodes, the groups (base file, prompts, 8-bit yardstick), every file as ``g4h inspect`` read it, every
  row (llama-perplexity's full KLD set under ``kld``; its ``g4h parity`` pair under ``pair`` and ``checks``, the
  checks as a parity ``results.json`` holds them), every cross-engine agreement, the wall time.
* ``sweep.csv``: one line per file x engine (:data:`CSV_COLUMNS`).
* ``report.md``: the verdict; per group the table sorted by damage (failed rows first, then mean KLD against the
  base, largest first), the engines' agreement per file, where the damage does not follow the bits per weight, the
  files and their ``g4h inspect`` problems; the plots linked.
* ``kld_vs_bpw.png``: mean KLD (log scale) and same-top-p against bits per weight, one line per engine;
  ``first_divergence.png``: the first-divergence layer per file and engine, and each file's relative L2 per layer.

Plots are drawn with matplotlib's Agg canvas (no pyplot state), one file per group when a sweep has several
(``kld_vs_bpw-<group>.png``).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..core.gates import SWEEP_DIVERGENCE_REL_L2
from ..core.io import dataframe_markdown, write_bytes_atomic
from . import judge
from .files import Group, SweepFile

SCHEMA_VERSION = 2
"""Version of ``results.json``. 2: every row carries its ``g4h parity`` pair (``pair``, ``checks``: the reference on
the row's own file against the engine, :func:`harness.sweep.tasks.pair_figures`), ``against_base`` only on a row of an
earlier store; ``summary`` counts ``pair_checks`` and ``pair_failed``. Every field of version 1 is where it was."""

CSV_COLUMNS = ("group", "file", "label", "file_type", "bpw", "size", "engine", "status", "reason", "mean_kld",
               "mean_kld_unc", "kld_p99_0", "kld_p99_9", "maximum_kld", "median_kld", "same_top_p_pct",
               "same_top_p_pct_unc", "rms_dp_pct", "mean_ppl_ratio", "max_abs_logit", "greedy_identical_pct",
               "greedy_agree_pct", "greedy_first_diff_step", "greedy_mean_first_diff_step", "first_divergence_layer",
               "worst_layer_rel_l2", "problems", "node", "host", "cpus", "memory_gb", "seconds", "peak_rss_gb",
               "is_base")
"""The columns of ``sweep.csv``, in order."""


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _g(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}g}" if _num(x) else ""


# --------------------------------------------------------------------------- plots


def _figure(width: float, height: float, ncols: int) -> tuple[Any, list[Any]]:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _save(fig: Any, path: Path) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    write_bytes_atomic(path, buf.getvalue())
    return path.name


def plot_kld(rows: Sequence[dict[str, Any]], path: Path, title: str) -> str | None:
    """Mean KLD (log y, with its uncertainty) and same-top-p against bits per weight, one line per engine."""
    ok = [r for r in rows if r["status"] == "ok" and _num(r.get("mean_kld"))]
    if not ok:
        return None
    fig, (ax_k, ax_p) = _figure(12, 4.8, 2)
    for j, engine in enumerate(dict.fromkeys(r["engine"] for r in ok)):
        mine = sorted((r for r in ok if r["engine"] == engine), key=lambda r: r["bpw"])
        x = [r["bpw"] for r in mine]
        k = [max(r["mean_kld"], 1e-16) for r in mine]
        ax_k.errorbar(x, k, yerr=[r.get("mean_kld_unc") or 0 for r in mine], marker="o", capsize=3, label=engine)
        ax_p.plot(x, [r["same_top_p_pct"] for r in mine], marker="o", label=engine)
        for i, (r, kv) in enumerate(zip(mine, k)):  # labels once (the first engine), alternating sides
            if j == 0 or not any(o["label"] == r["label"] for o in ok if o["engine"] != engine):
                ax_k.annotate(r["label"], (r["bpw"], kv), fontsize=7, xytext=(4, 6 if i % 2 else -10),
                              textcoords="offset points")
    ax_k.set_yscale("log")
    ax_k.set_xlabel("bits per weight")
    ax_k.set_ylabel("mean KLD vs the float64 base (nats)")
    ax_k.set_title(f"{title}: KLD against bits per weight")
    ax_p.set_xlabel("bits per weight")
    ax_p.set_ylabel("same top token (%)")
    ax_p.set_title("same-top-p against bits per weight")
    for ax in (ax_k, ax_p):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    return _save(fig, path)


def plot_divergence(rows: Sequence[dict[str, Any]], n_layer: int, path: Path, title: str) -> str | None:
    """Left: the first layer beyond :data:`SWEEP_DIVERGENCE_REL_L2` per file and engine ("none" above the last
    layer). Right: each file's relative L2 per layer (the first engine that reports layers)."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("layer_rel_l2")]
    if not ok:
        return None
    labels = list(dict.fromkeys(r["label"] for r in sorted(ok, key=lambda r: -r["bpw"])))
    fig, (ax_d, ax_l) = _figure(13, 5, 2)
    engines = list(dict.fromkeys(r["engine"] for r in ok))
    for j, engine in enumerate(engines):
        mine = {r["label"]: r for r in ok if r["engine"] == engine}
        xs = [i + (j - (len(engines) - 1) / 2) * 0.2 for i, lab in enumerate(labels) if lab in mine]
        ys = [mine[lab]["first_divergence_layer"] if mine[lab]["first_divergence_layer"] is not None else n_layer
              for lab in labels if lab in mine]
        ax_d.scatter(xs, ys, label=engine, marker="os^v"[j % 4], s=40)
    ax_d.axhline(n_layer - 0.5, color="grey", lw=0.8, ls="--")
    ax_d.set_xticks(range(len(labels)))
    ax_d.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax_d.set_yticks(list(range(n_layer)) + [n_layer])
    ax_d.set_yticklabels([str(i) for i in range(n_layer)] + ["none"], fontsize=8)
    ax_d.set_ylabel(f"first layer with l_out rel. L2 > {SWEEP_DIVERGENCE_REL_L2:g}")
    ax_d.set_title(f"{title}: first-divergence layer per file")
    ax_d.legend()
    for lab in labels:  # per file, the first engine (in --against order) that reports its layers
        r = next(r for e in engines for r in ok if r["engine"] == e and r["label"] == lab)
        e = r["layer_rel_l2"]
        ax_l.plot([i for i, v in enumerate(e) if v is not None], [max(v, 1e-12) for v in e if v is not None],
                  marker=".", label=lab if r["engine"] == engines[0] else f"{lab} ({r['engine']})")
    ax_l.axhline(SWEEP_DIVERGENCE_REL_L2, color="grey", lw=0.8, ls="--")
    ax_l.set_yscale("log")
    ax_l.set_xlabel("layer")
    ax_l.set_ylabel("relative L2 of l_out vs the base")
    ax_l.set_title(f"per-layer error ({engines[0]} where it ran)")
    ax_l.grid(True, which="both", alpha=0.3)
    ax_l.legend(fontsize=7, ncol=2)
    return _save(fig, path)


# --------------------------------------------------------------------------- tables


def damage_inversions(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per engine, pairs of files where the one with fewer bits per weight shows less damage (mean KLD) than the one
    with more, beyond both uncertainties: a quantization mix worth a look (reported, not failed)."""
    out = []
    ok = [r for r in rows if r["status"] == "ok" and _num(r.get("mean_kld"))]
    for engine in dict.fromkeys(r["engine"] for r in ok):
        mine = sorted((r for r in ok if r["engine"] == engine), key=lambda r: -r["bpw"])
        for hi, lo in zip(mine, mine[1:]):
            margin = (hi.get("mean_kld_unc") or 0) + (lo.get("mean_kld_unc") or 0)
            if lo["bpw"] < hi["bpw"] and lo["mean_kld"] + margin < hi["mean_kld"]:
                out.append(f"{engine}: {lo['label']} ({lo['bpw']:.2f} bpw) has less damage ({_g(lo['mean_kld'])}) "
                           f"than {hi['label']} ({hi['bpw']:.2f} bpw, {_g(hi['mean_kld'])})")
    return out


def _row_table(rows: Sequence[dict[str, Any]]) -> str:
    body = []
    for r in sorted(rows, key=judge.damage_key):
        k = f"{_g(r.get('mean_kld'))} ± {_g(r.get('mean_kld_unc'), 2)}" if _num(r.get("mean_kld")) else ""
        div = r.get("first_divergence_layer")
        body.append({"file": r["label"], "bpw": r["bpw"], "engine": r["engine"], "status": r["status"],
                     "mean KLD": k, "KLD 99%": _g(r.get("kld_p99_0")), "same top %": _g(r.get("same_top_p_pct"), 4),
                     "RMS Δp %": _g(r.get("rms_dp_pct")), "PPL ratio": _g(r.get("mean_ppl_ratio"), 4),
                     "greedy same %": _g(r.get("greedy_identical_pct"), 3),
                     "first greedy diff": "" if r.get("greedy_first_diff_step") is None else
                     r["greedy_first_diff_step"],
                     "first div. layer": ("none" if r["status"] == "ok" and r.get("layer_rel_l2") else "")
                     if div is None else div,
                     "node": r.get("node") or "", "s": _g(r.get("seconds")), "reason": r.get("reason") or ""})
    return dataframe_markdown(pd.DataFrame(body), right=("mean KLD", "KLD 99%", "same top %", "RMS Δp %"))


def _agreement_table(agreements: Sequence[dict[str, Any]]) -> str:
    body = [{"file": a["label"], "bpw": a["bpw"], "engines": " vs ".join(a["engines"]), "gate": a["gate"],
             "measured": _g(a.get("measured")), "limit": _g(a["limit"]), "mean KLD": _g(a["mean_kld"]),
             "same top %": _g(a["same_top_p_pct"], 4), "max |Δlogit|": _g(a["max_abs_logit"]),
             "verdict": "info" if a.get("informational") else "PASS" if a["passed"] else "FAIL",
             "why": a.get("why") or ""}
            for a in sorted(agreements, key=lambda a: -a["bpw"])]
    return dataframe_markdown(pd.DataFrame(body), right=("measured", "limit", "mean KLD", "same top %"))


def _base_table(rows: Sequence[dict[str, Any]]) -> str:
    body = [{"file": r["label"], "engine": r["engine"], "gate": v["gate"],
             "emulated": ", ".join(v.get("emulated") or []) or "nothing", "measured": _g(v.get("measured")),
             "effect": _g(v.get("effect")), "limit": _g(v.get("limit")),
             "verdict": "info" if v.get("informational") else "PASS" if v["passed"] else "FAIL",
             "why": v.get("why") or ""}
            for r in rows for v in r.get("against_base") or ()]
    return dataframe_markdown(pd.DataFrame(body), right=("measured", "effect", "limit"))


def _pair_table(rows: Sequence[dict[str, Any]]) -> str:
    """Each row's parity pair (:func:`.tasks.pair_figures`), one line per gate: the worst figure over the prompts
    (against its own limit), the count of checks and of those that fail."""
    body = []
    for r in rows:
        by: dict[str, list[dict[str, Any]]] = {}
        for c in r.get("checks") or ():
            by.setdefault(c["gate"], []).append(c)
        for gate, cs in by.items():
            bad = [c for c in cs if not c["pass"] and not c.get("informational")]
            up = cs[0].get("op") == "ge"  # a figure that passes at or above its limit: the worst is the least
            worst = (min if up else max)(bad or cs, key=lambda c: c["measured"] if c["measured"] == c["measured"]
                                         else float("-inf") if up else float("inf"))
            body.append({"file": r["label"], "engine": r["engine"], "gate": gate, "checks": len(cs),
                         "worst": _g(worst["measured"]), "its limit": _g(worst["limit"]),
                         "verdict": ("FAIL" if bad else "info" if all(c.get("informational") for c in cs)
                                     else "PASS"),
                         "emulated": ", ".join(worst.get("emulated") or []) or ""})
    return dataframe_markdown(pd.DataFrame(body), right=("checks", "worst", "its limit"))


def _file_table(files: Sequence[SweepFile]) -> str:
    body = [{"file": Path(f.path).name, "type": f.label, "bpw": f.bpw, "MB": round(f.size / 1e6, 2),
             "tensor types": ", ".join(f"{t} x{n}" for t, n in f.types.items()),
             "problems": "; ".join(f"{p['severity']} {p['code']}: {p['where']}" for p in f.problems) or "none"}
            for f in files]
    return dataframe_markdown(pd.DataFrame(body))


def _verdict(status: int, interrupted: bool) -> str:
    if interrupted:
        return "INTERRUPTED"
    return {0: "PASS", 1: "FAIL", 2: "BAD INPUT"}[status]


def write_outputs(rd: Any, groups: Sequence[Group], bad: Sequence[SweepFile], gprompts: dict[str, list],
                  rows: Sequence[dict[str, Any]], agreements: Sequence[dict[str, Any]],
                  sens: dict[str, dict[str, Any]], opts: Any, nodes: Sequence[Any], timing: dict[str, float],
                  skipped: Sequence[str], interrupted: bool) -> dict[str, Any]:
    """Write ``results.json``, ``sweep.csv``, ``report.md`` and the plots into the run directory ``rd``
    (:class:`harness.sweep.store.RunDir`); returns the results."""
    status = judge.exit_status(rows, agreements)
    files = [f for g in groups for f in g.files] + list(bad)
    plots: dict[str, dict[str, str | None]] = {}
    for g in groups:
        mine = [r for r in rows if r.get("group") == g.name]
        suffix = "" if len(groups) == 1 else f"-{g.name}"
        plots[g.name] = {"kld": plot_kld(mine, rd.path / f"kld_vs_bpw{suffix}.png", g.name),
                         "divergence": plot_divergence(mine, g.base.n_layer, rd.path / f"first_divergence{suffix}.png",
                                                       g.name)}
    failed = [r for r in rows if judge.failed(r) or r["status"] == "bad_input"]
    data = {
        "schema": "g4h-sweep", "schema_version": SCHEMA_VERSION, "verdict": _verdict(status, interrupted),
        "exit_status": status, "run_dir": str(rd.path), "wall_s": timing.get("wall_s"),
        "timing": dict(timing),
        "options": {k: getattr(opts, k) for k in ("against", "prompts", "base", "new_tokens", "top_n",
                                                  "cpus_per_task", "engine_options", "task_timeout", "address",
                                                  "local_nodes")},
        "divergence_rel_l2": SWEEP_DIVERGENCE_REL_L2,
        "nodes": [{"node": n.node_id, "host": n.host, "address": n.address, "cpus": n.cpus, "memory": n.memory,
                   "object_store": n.object_store} for n in nodes],
        "groups": [{**g.as_dict(), "prompts": len(gprompts[g.name]),
                    "positions": sum(max(len(p["prompt_ids"]) - 1, 0) for p in gprompts[g.name]),
                    "sensitivity": sens.get(g.name), "plots": plots[g.name]} for g in groups],
        "files": [f.as_dict() for f in files], "skipped": list(skipped),
        "summary": {"rows": len(rows), "ok": sum(r["status"] == "ok" for r in rows), "failed": len(failed),
                    "against_base_failed": sum(not v["passed"] and not v["informational"] for r in rows
                                               for v in r.get("against_base") or ()),
                    "pair_checks": sum(len(r.get("checks") or ()) for r in rows),
                    "pair_failed": sum(len(judge.pair_failures(r)) for r in rows),
                    "declared_not_run": sum(r["status"] == "not_run" and bool(r.get("declared")) for r in rows),
                    "agreements": len(agreements), "disagreements": sum(not a["passed"] for a in agreements)},
        "rows": list(rows), "agreements": list(agreements), "damage_inversions": damage_inversions(rows),
    }
    rd.write_json("results.json", data)
    frame = pd.DataFrame([{c: (",".join(r.get(c) or []) if c == "problems" else r.get(c)) for c in CSV_COLUMNS}
                          for r in sorted(rows, key=lambda r: (r.get("group") or "", -r["bpw"], r["engine"]))],
                         columns=list(CSV_COLUMNS))
    rd.write_text("sweep.csv", frame.to_csv(index=False))
    rd.write_text("report.md", _markdown(data, groups, bad, rows, agreements, sens, plots, nodes))
    return data


def _markdown(data: dict[str, Any], groups: Sequence[Group], bad: Sequence[SweepFile], rows: Sequence[dict],
              agreements: Sequence[dict], sens: dict[str, dict], plots: dict, nodes: Sequence[Any]) -> str:
    s = data["summary"]
    lines = [f"# g4h sweep: {data['verdict']} (exit {data['exit_status']})", "",
             f"{s['rows']} rows ({s['ok']} ran, {s['failed']} failed, {s['declared_not_run']} out of an engine's "
             f"declared reach), {s['pair_checks']} g4h parity checks of the rows' pairs ({s['pair_failed']} fail), "
             f"{s['agreements']} cross-engine comparisons ({s['disagreements']} disagree); "
             f"{len(nodes)} Ray node(s), {data['wall_s']} s wall ({data['timing'].get('cluster_s')} s to have the "
             f"cluster, {data['timing'].get('tasks_s')} s of tasks).", ""]
    used = sorted({r["node"] for r in rows if r.get("node")})
    lines += [f"Nodes: {', '.join(f'{n.short} ({n.host}, {n.cpus:g} CPUs)' for n in nodes)}; rows ran on "
              f"{', '.join(used) or 'none'}.", ""]
    for g in groups:
        mine = [r for r in rows if r.get("group") == g.name]
        y = sens.get(g.name) or {}
        lines += [f"## {g.name}", "",
                  f"Base: `{g.base.path}` ({g.base.label}, {g.base.bpw:.2f} bpw): the float64 reference's logits on "
                  f"{data['groups'][groups.index(g)]['prompts']} prompts "
                  f"({data['groups'][groups.index(g)]['positions']} scored positions) are what every row is measured "
                  "against (llama-perplexity's --kl-divergence-base).",
                  f"8-bit yardstick (fast with every product's input rounded to 8 bits): mean KLD "
                  f"{_g(y.get('mean_kld'))}" + (f" ({y.get('status')}: {y.get('reason')})" if y.get("reason") else "")
                  + ".", "", "### Rows, by damage", "", _row_table(mine)]
        p = plots[g.name]
        lines += [f"![KLD against bits per weight]({p['kld']})" if p["kld"] else "", "",
                  f"![first-divergence layer]({p['divergence']})" if p["divergence"] else "", ""]
        paired = [r for r in mine if r.get("checks")]
        if paired:
            lines += ["### Each engine against the reference on the same file (the g4h parity pair)", "",
                      "`g4h parity --model FILE --against ENGINE` on the group's prompts: the float64 reference on "
                      "the file itself, making the approximations the engine declares, gated as parity gates them "
                      "(worst figure over the prompts per gate).", "", _pair_table(paired), ""]
        judged = [r for r in mine if r.get("against_base")]
        if judged:
            lines += ["### Engines on the base file against the base", "",
                      "Judged as `g4h parity` judges the pair: the reference makes the approximations each engine "
                      "declares, each figure gated at max(limit, 2 x their effect) (4 x for a KLD).", "",
                      _base_table(judged), ""]
        ag = [a for a in agreements if a.get("group") == g.name]
        if ag:
            lines += ["### Engines against each other, per file", "", _agreement_table(ag), ""]
        inv = damage_inversions(mine)
        if inv:
            lines += ["### Damage not in bits-per-weight order", ""] + [f"- {x}" for x in inv] + [""]
        lines += ["### Files", "", _file_table(g.files), ""]
    if bad:
        lines += ["## Unusable files", "", _file_table(bad), "",
                  _row_table([r for r in rows if r["status"] == "bad_input"]), ""]
    if data["skipped"]:
        lines += ["## Left out", ""] + [f"- {x}" for x in data["skipped"]] + [""]
    return "\n".join(lines) + "\n"
