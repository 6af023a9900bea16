"""The parity report: ``report.md`` (verdict first), ``results.json``, per-layer error plot.

Layout of ``report.md``: the overall verdict; one row per case and gate with the
worst measured value; for every failing case the first diverging trace point;
then details per prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import markdown_table, write_json_atomic, write_text_atomic


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, gate): worst measured value, limit, pass. Errors get a row of their own."""
    rows = []
    for c in data["cases"]:
        if c["error"]:
            rows.append({"case": c["case"], "gate": "(case could not run)", "worst": "", "limit": "",
                         "result": "ERROR", "note": c["error"]})
            continue
        by_gate: dict[str, list[dict[str, Any]]] = {}
        for chk in c["checks"]:
            by_gate.setdefault(chk["gate"], []).append(chk)
        for gate, checks in by_gate.items():
            # gating and informational checks of one gate get separate rows, so an informational
            # check can never hide a gating failure
            gating = [k for k in checks if not k.get("informational")]
            info = [k for k in checks if k.get("informational")]
            for group, is_info in ((gating, False), (info, True)):
                if not group:
                    continue
                op = group[0]["op"]
                pick = max if op == "le" else min
                worst = pick(group, key=lambda k: k["measured"])
                note = f"{sum(k['pass'] for k in group)}/{len(group)} within"
                if is_info:
                    reasons = sorted({k.get("reason", "") for k in group if k.get("reason")})
                    note += "; not gating: " + " / ".join(reasons)
                if worst.get("first_divergence"):
                    note += f"; first divergence {worst['first_divergence']}"
                ok = all(k["pass"] for k in group)
                rows.append({"case": c["case"], "gate": gate, "worst": f"{worst['measured']:.3g}",
                             "limit": f"{'<=' if op == 'le' else '>='} {worst['limit']:g}",
                             "result": "INFO" if is_info else ("PASS" if ok else "FAIL"), "note": note})
        if c.get("info", {}).get("skipped"):
            rows.append({"case": c["case"], "gate": "(oracle)", "worst": "", "limit": "", "result": "SKIP",
                         "note": c["info"]["skipped"]})
    return rows


def _plot_layers(run_dir: Path, data: dict[str, Any]) -> str | None:
    """PNG of max relative L2 at ``l_out`` per layer, one line per case; returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for c in data["cases"]:
        per_layer: dict[int, float] = {}
        for chk in c["checks"]:
            for point, layer, v in chk.get("per_point", []) or []:
                if point == "l_out":
                    per_layer[layer] = max(per_layer.get(layer, 0.0), v)
        if per_layer:
            xs = sorted(per_layer)
            ax.semilogy(xs, [max(per_layer[x], 1e-18) for x in xs], marker="o", label=c["case"])
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("max rel. L2 at l_out (reference vs oracle)")
    ax.set_title("per-layer error growth")
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = "layer_error.png"
    tmp = run_dir / (".tmp-" + name)
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(run_dir / name)
    return name


def render_markdown(data: dict[str, Any], plot: str | None) -> str:
    """The report text (see module docstring)."""
    status = {0: "PASS: every gate passed", 1: "FAIL: a gate failed", 2: "BAD INPUT: a model could not be read"}
    if data.get("baseline", {}).get("regressions"):
        status[1] += f" or a figure regressed against the baseline ({len(data['baseline']['regressions'])})"
    lines = [f"# Parity report", "", f"**{status[data['status']]}** "
             f"({len(data['cases'])} cases, created {data['created_utc']})", ""]
    lines += [markdown_table(summarize(data), ["case", "gate", "worst", "limit", "result", "note"]), ""]
    from .baseline import baseline_section

    lines += baseline_section(data)  # empty without --baseline
    failing = [c for c in data["cases"]
               if c["error"] or not all(k["pass"] or k.get("informational") for k in c["checks"])]
    if failing:
        lines += ["## First divergence", ""]
        for c in failing:
            if c["error"]:
                lines.append(f"- **{c['case']}**: {c['error']}")
                continue
            for chk in c["checks"]:
                if not chk["pass"] and not chk.get("informational"):
                    where = chk.get("first_divergence") or "logits"
                    lines.append(f"- **{c['case']}** prompt `{chk['prompt']}`: {chk['gate']} = "
                                 f"{chk['measured']:.3g} (limit {chk['limit']:g}); first diverging point: {where}")
                    break
        lines.append("")
    if plot:
        lines += ["## Per-layer error", "", f"![per-layer error]({plot})", ""]
    lines += ["## Details", ""]
    for c in data["cases"]:
        lines += [f"### {c['case']} ({c['kind']})", ""]
        if c.get("description"):
            lines += [c["description"], ""]
        lines += [f"model: `{c['model']}`", ""]
        if c["kind"] == "synthetic":
            lines += ["(cached~uncached needs at least two tokens, so the 1-token prompt has no such row.)", ""]
        if c["error"]:
            lines += [f"error: {c['error']}", ""]
            continue
        rows = [{"gate": k["gate"], "prompt": (k["prompt"] or "").replace("\n", "\\n"),
                 "measured": f"{k['measured']:.3g}",
                 "pass": "yes" if k["pass"] else ("info" if k.get("informational") else "NO"),
                 "extra": ", ".join(f"{x}={k[x]!r}" if isinstance(k[x], str) else f"{x}={k[x]}" for x in ("tokens", "same_top1", "worst_point", "qtype", "variant",
                                                         "positions", "expected", "got")
                                    if x in k and k[x] is not None)} for k in c["checks"]]
        lines += [markdown_table(rows, ["gate", "prompt", "measured", "pass", "extra"]), ""]
        drift = c.get("info", {}).get("quant_logit_drift")
        if drift:
            lines += ["Quantized GGUF logit drift vs F32 (informational, longest prompt, max |Δlogit|): "
                      + ", ".join(f"{k} {v:.3g}" for k, v in sorted(drift.items()))
                      + (". On an MoE model a rounded weight can flip a top-k routing choice, which moves "
                         "that token's logits by whole units; dense models drift far less." if
                         c.get("info", {}).get("config", {}).get("n_expert") else ""), ""]
    return "\n".join(lines) + "\n"


def write_parity_report(run_dir: Path, data: dict[str, Any]) -> None:
    """Write ``results.json``, ``layer_error.png`` and ``report.md`` into ``run_dir`` atomically."""
    write_json_atomic(run_dir / "results.json", data)
    plot = _plot_layers(run_dir, data)
    write_text_atomic(run_dir / "report.md", render_markdown(data, plot))


def short_table(data: dict[str, Any]) -> str:
    """The table printed on the terminal: one line per case and gate."""
    return markdown_table(summarize(data), ["case", "gate", "worst", "limit", "result"])
