"""The ``g4h bench`` report: ``results.json``, a llama-bench-style ``report.md``, PNG plots, and the ratio baseline.

Layout of ``results.json`` (``version`` :data:`harness.bench.run.RESULT_VERSION`)::

    {"version": 1, "kind": "bench", "created_utc": "...", "machine": {...},
     "model": {"name": ..., "path": ..., "params": N, "size_bytes": B, "arch": ...},
     "plan": {...}, "read_bandwidth_gbs": 21.3,
     "rows": [{"engine", "dtype", "test", "n", "depth", "batch", "label", "mean_tok_s", "std_tok_s",
               "reps_tok_s", "bytes_per_token", "read_gbs", "roofline_share", "error"}, ...],
     "ratios": {"tg128 b1 fast-float32/transformers-float32": 2.1, ...},
     "baseline": {...}}          # only with --baseline

The speed gate compares *ratios* of engines measured in the same run, never
absolute times, so a slower or busier machine does not fail it: a ratio fails
when it falls below ``(1 - margin)`` times its baseline value, with ``margin``
from :data:`harness.core.gates.SPEED_RATIO_MARGIN`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_json

from ..core.io import write_json_atomic, write_text_atomic

BASELINE_KIND = "bench-baseline"


def results(rows, plan, machine: Mapping[str, Any], model: Mapping[str, Any], bandwidth: float | None,
            ratios: Mapping[str, float]) -> dict[str, Any]:
    """Assemble the JSON-able results of one run (see the module docstring for the layout)."""

    out = [r.as_dict(bandwidth) for r in rows]
    spec = machine.get("hbm_spec_gbs")
    for r in out:  # a GPU's datasheet bandwidth beside the measured one (harness.bench.run.HBM_SPEC_GBS)
        if spec:
            r["spec_share"] = None if r["read_gbs"] is None else r["read_gbs"] / spec
    return {"version": 1, "kind": "bench", "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": dict(machine), "model": dict(model), "plan": dataclasses.asdict(plan),
            "read_bandwidth_gbs": bandwidth, "rows": out, "ratios": dict(ratios)}


def _fmt_size(n: float | None) -> str:
    if n is None:
        return ""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_params(n: int | None) -> str:
    if not n:
        return ""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _not_run(error: str | None) -> str:
    """Table text for a row without figures: a known limit reads ``not run``, anything else ``failed``."""
    return f"not run: {error}" if error and "one sequence at a time" in error else f"failed: {error}"


def table_frame(data: Mapping[str, Any]):
    """A pandas DataFrame of the rows, with llama-bench's columns plus batch, GB/s and roofline share."""
    m = data["model"]
    recs = []
    for r in data["rows"]:
        ok = r["mean_tok_s"] is not None
        recs.append({
            "model": m.get("name", ""), "size": _fmt_size(m.get("size_bytes")), "params": _fmt_params(m.get("params")),
            "engine": r["engine"], "dtype": r["dtype"], "threads": data["machine"].get("threads"),
            "batch": r["batch"], "test": r["label"],
            "t/s": f"{r['mean_tok_s']:.2f} ± {r['std_tok_s']:.2f}" if ok else _not_run(r["error"]),
            "GB/s": f"{r['read_gbs']:.1f}" if r.get("read_gbs") is not None else "",
            "roofline": f"{100 * r['roofline_share']:.0f} %" if r.get("roofline_share") is not None else "",
        })
        if "spec_share" in r:  # a GPU in harness.bench.run.HBM_SPEC_GBS
            recs[-1]["of datasheet"] = f"{100 * r['spec_share']:.0f} %" if r["spec_share"] is not None else ""
    return pd.DataFrame.from_records(recs)


def ratio_frame(data: Mapping[str, Any]):
    """A DataFrame of the same-run ratios (and their baseline verdicts when present)."""
    base = (data.get("baseline") or {}).get("ratios", {})
    recs = []
    for key, value in data["ratios"].items():
        rec = {"ratio": key, "value": f"{value:.2f}x"}
        if key in base:
            b = base[key]
            rec.update({"baseline": f"{b['baseline']:.2f}x", "floor": f"{b['floor']:.2f}x",
                        "result": "pass" if b["pass"] else "**FAIL**"})
        recs.append(rec)
    return pd.DataFrame.from_records(recs)


def _plot(run_dir: Path, data: Mapping[str, Any]) -> list[str]:
    """Draw ``tps_vs_batch.png`` and ``roofline.png``; return the names written."""
    rows = [r for r in data["rows"] if r["mean_tok_s"] is not None]
    if not rows:
        return []
    written = []
    labels = sorted({r["label"] for r in rows})
    fig = Figure(figsize=(5.5 * len(labels), 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(labels), squeeze=False)
    for ax, label in zip(axes[0], labels):
        series: dict[str, list[tuple[int, float, float]]] = {}
        for r in rows:
            if r["label"] == label:
                series.setdefault(f"{r['engine']}-{r['dtype']}", []).append((r["batch"], r["mean_tok_s"], r["std_tok_s"]))
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("tokens/s")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['model'].get('name', '')}: tokens/s against batch size")
    fig.tight_layout()
    written.append(_save(fig, run_dir, "tps_vs_batch.png"))

    roof = [r for r in rows if r.get("roofline_share") is not None]
    if roof:
        fig = Figure(figsize=(max(6, 0.5 * len(roof) + 2), 4))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        names = [f"{r['engine']}-{r['dtype']}\n{r['label']} b{r['batch']}" for r in roof]
        ax.bar(range(len(roof)), [100 * r["roofline_share"] for r in roof], color="tab:blue")
        ax.axhline(100, color="black", lw=1, ls="--")
        ax.set_xticks(range(len(roof)), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("% of measured read bandwidth")
        ax.set_title(f"Decode roofline share (read bandwidth {data['read_bandwidth_gbs']:.1f} GB/s, same run)")
        fig.tight_layout()
        written.append(_save(fig, run_dir, "roofline.png"))
    return written


def _save(fig, run_dir: Path, name: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    tmp = run_dir / f".{name}.tmp"
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, run_dir / name)
    return name


def _load_text(load: Mapping[str, Any] | None) -> str:
    """``; load average 1.2 at the start, 3.4 at the end`` (1-minute figures), or nothing when not recorded."""
    if not load or not load.get("start") or not load.get("end"):
        return ""
    return f"; load average {load['start'][0]:g} at the start, {load['end'][0]:g} at the end (other processes)"


def render_markdown(data: Mapping[str, Any], plots: list[str]) -> str:
    """The report text: machine and roofline, the llama-bench-style table, ratios (and baseline), plots."""
    mach = data["machine"]
    model = data["model"]
    lines = [f"# g4h bench: {model.get('name', '')}", ""]
    if data.get("baseline"):
        ok = data["baseline"]["pass"]
        lines += [f"**Speed baseline: {'PASS' if ok else 'FAIL'}** against `{data['baseline']['path']}` "
                  f"(margin {100 * data['baseline']['margin']:.0f} %)", ""]
    lines += [f"- machine: {mach.get('cpu')} ({mach.get('cores')} cores), torch {mach.get('torch')}, "
              f"{mach.get('threads')} threads, device `{mach.get('device')}`"
              + (f" ({mach['gpu']})" if mach.get("gpu") else "") + _load_text(mach.get("load_avg")),
              f"- model: `{model.get('path', model.get('name'))}`, {_fmt_params(model.get('params'))} parameters, "
              f"{_fmt_size(model.get('size_bytes'))}"
              + (f"; fast weights **{data['fast_weights']}**" if data.get("fast_weights") else ""),
              f"- read bandwidth (same run, 1 GiB streamed sum): **{data['read_bandwidth_gbs']:.1f} GB/s**"
              if data.get("read_bandwidth_gbs") else "- read bandwidth: not measured",
              f"- {data['plan']['reps']} timed repetitions after {data['plan']['warmup']} warm-up; t/s is mean ± std; "
              "pp and tg count the tokens of every sequence in the batch", ""]
    lines += [table_frame(data).to_markdown(index=False), ""]
    for name, why in sorted((data.get("skipped") or {}).items()):
        lines += [f"- **{name} skipped:** {why}"]
    if data.get("skipped"):
        lines += [""]
    for name, b in sorted((data.get("engine_builds") or {}).items()):
        lines += [f"- {name}: {b.get('error') or b.get('system_info')} ({b.get('libraries', '')})"]
    if data.get("engine_builds"):
        lines += [""]
    lines += ["GB/s: weights and KV bytes read per generated token (weights once per step, shared by the batch) × "
              "tokens/s; roofline: that as a share of the read bandwidth.", ""]
    if data["ratios"]:
        lines += ["## Ratios (same run)", "", ratio_frame(data).to_markdown(index=False), ""]
    if data.get("speculative"):
        sp = data["speculative"]
        lines += ["## Speculative decoding (same run)", "",
                  f"Drafter `{sp.get('draft_model')}`, K = {sp.get('draft_tokens')} drafts per round; `fast-spec` "
                  "rows time the same tg test with the drafter (drafting included); output is the plain greedy "
                  "output (`g4h parity` checks it).", ""]
        for r in sp["runs"]:
            acc = "n/a" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f} %"
            speed = "not run" if r["speedup"] is None else (f"{r['spec_tok_s']:.1f} vs {r['plain_tok_s']:.1f} t/s, "
                                                            f"**{r['speedup']:.2f}x**")
            lines += [f"- {r['test']} @ d{r['depth']} b{r['batch']} ({r['dtype']}): acceptance {acc}, "
                      f"{r['tokens_per_forward']:.2f} tokens per target forward; {speed}"]
        lines += [""]
    for p in plots:
        lines += [f"![{p}]({p})", ""]
    return "\n".join(lines)


def write_report(run_dir: Path, data: dict[str, Any]) -> None:
    """Write ``results.json``, the PNGs and ``report.md`` into ``run_dir`` (each file atomically)."""
    write_json_atomic(run_dir / "results.json", data)
    plots = _plot(run_dir, data)
    write_text_atomic(run_dir / "report.md", render_markdown(data, plots))


# --------------------------------------------------------------------------- baseline


def write_baseline(path: str | os.PathLike, data: Mapping[str, Any]) -> Path:
    """Write the ratios of ``data`` as a speed baseline; never overwrites an existing file.

    Raises:
        InputError: ``path`` exists or cannot be written.
    """
    p = Path(path)
    doc = {"version": 1, "kind": BASELINE_KIND, "created_utc": data.get("created_utc"),
           "machine": data.get("machine"), "model": {k: data["model"].get(k) for k in ("name", "params")},
           "ratios": data["ratios"]}
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise InputError(f"{p}: a baseline is there already; remove it or choose another path") from None
    except OSError as e:
        raise InputError(f"{p}: cannot write the baseline ({e.strerror})") from None
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")
    return p


def read_baseline(path: str | os.PathLike) -> dict[str, float]:
    """The ratios of a baseline file, or of an earlier bench ``results.json``.

    Raises:
        InputError: unreadable file, not JSON, wrong kind or version, or no ``ratios`` table.
    """
    p = Path(path)
    doc = read_json(p, "baseline")  # the one reader: a regular file or a pipe, bounded (reference.files)
    if not isinstance(doc, dict) or doc.get("kind") not in (BASELINE_KIND, "bench") or doc.get("version") != 1:
        raise InputError(f"{p}: expected a g4h bench baseline or results.json (kind bench, version 1)")
    ratios = doc.get("ratios")
    if not isinstance(ratios, dict) or not all(isinstance(v, (int, float)) for v in ratios.values()):
        raise InputError(f"{p}: 'ratios' must map names to numbers")
    return {k: float(v) for k, v in ratios.items()}


def compare_baseline(data: dict[str, Any], baseline: Mapping[str, float], path: str, margin: float) -> dict[str, Any]:
    """Judge this run's ratios against a baseline; stores and returns ``data["baseline"]``.

    A ratio present on both sides fails when ``now < (1 - margin) * baseline``.
    Ratios on one side only are listed, not judged.
    """
    out: dict[str, Any] = {"path": str(path), "margin": margin, "ratios": {}, "only_baseline": [], "only_now": []}
    for key, b in baseline.items():
        if key not in data["ratios"]:
            out["only_baseline"].append(key)
            continue
        now = data["ratios"][key]
        floor = (1.0 - margin) * b
        out["ratios"][key] = {"baseline": b, "now": now, "floor": floor, "pass": bool(now >= floor)}
    out["only_now"] = sorted(set(data["ratios"]) - set(baseline))
    out["pass"] = all(v["pass"] for v in out["ratios"].values())
    data["baseline"] = out
    return out


def summary_lines(data: Mapping[str, Any]) -> list[str]:
    """Short console summary: one line per row, then the ratios."""
    out = []
    for r in data["rows"]:
        tps = f"{r['mean_tok_s']:9.2f} ± {r['std_tok_s']:.2f} t/s" if r["mean_tok_s"] is not None else _not_run(r["error"])
        share = f"  {100 * r['roofline_share']:.0f} % roofline" if r.get("roofline_share") is not None else ""
        out.append(f"{r['engine'] + '-' + r['dtype']:<22} {r['label']:<14} b{r['batch']:<3} {tps}{share}")
    for k, v in data["ratios"].items():
        out.append(f"ratio {k}: {v:.2f}x")
    for r in (data.get("speculative") or {}).get("runs", []):
        acc = "n/a" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f} %"
        gain = "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        out.append(f"speculative {data['speculative']['draft_model']} K={data['speculative']['draft_tokens']} "
                   f"{r['test']} d{r['depth']} b{r['batch']}: acceptance {acc}, {r['tokens_per_forward']:.2f} tokens "
                   f"per target forward, speed-up {gain}")
    if data.get("fast_weights"):
        out.append(f"fast weights: {data['fast_weights']}")
    if not math.isnan(data.get("read_bandwidth_gbs") or math.nan):
        out.append(f"read bandwidth: {data['read_bandwidth_gbs']:.1f} GB/s")
    return out
