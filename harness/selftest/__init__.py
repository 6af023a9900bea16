"""``g4h selftest``: mutation testing of the harness itself.

Each *mutant* (:mod:`.mutants`) is one known fault class injected into the fast path by
overriding one of :class:`fast.model.FastModel`'s block functions in a subclass (or by
building it from an altered config, weights or RoPE table; ``fast/`` itself is never
modified). The selftest traces the mutant and the float64
reference on the built-in synthetic cases, compares the traces with the
selftest's rule (per trace point cosine >= 0.99999, :data:`harness.core.gates.SELFTEST_MIN_COSINE`; max |Δlogit|
<= 1e-3 at ``result_output``, the ``reference~fast.max_abs_logit`` gate of
:data:`harness.core.gates.DEFAULT_GATES`) through
:func:`harness.traces.compare.compare`, and checks that

* the unmutated fast path passes every gate (the *control*: a mutant's detection is then
  the fault's doing);
* every mutant is detected on every case that exercises it, and the first failing
  (point, layer) in trace order is the one the fault must first show at
  (:attr:`Mutant.expected`, derived from the case's config);
* every mutant listed as *equivalent* stays within the gates (the claim that it
  cannot change the model's output is checked, not just stated).

The multimodal mutants (:data:`.mutants.MM_MUTANTS`) run the same way on the built-in
multimodal cases (``cases/models/multimodal/``), on the multimodal prompts of
:data:`MM_SELFTEST_PROMPTS`: the fast path's encoders, merge and decoder traced
(encoder points ``v<i>.`` / ``a<j>.`` first) against the reference's, with the
unmutated fast path as their control.

Exit status 0 only when all three hold; 1 otherwise; 2 on bad input (an unknown
case or prompt id). The report goes to ``reports/<ts>-selftest/`` (``report.md``
with the mutant table, ``results.json``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterator, Sequence

import numpy as np

from gemma4_harness.fast.model import FastModel
from gemma4_harness.reference import model as ref_model
from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.mm_model import MultimodalModel, MultimodalPrompt, load_multimodal, prepare_prompt
from gemma4_harness.reference.weights import load_model

from .. import synth
from ..core.cases import builtin_specs
from ..core.engine_kinds import ORACLE, TWIN
from ..core.gates import DEFAULT_GATES, SELFTEST_MIN_COSINE, resolve
from ..core.io import markdown_table, staged_run_dir, write_json_atomic, write_text_atomic
from ..core.mm_prompts import load_mm_prompts, prompt_media, resolve_ids
from ..core.prompts import load_prompts
from ..engines.mm import ReferenceMM
from ..engines.mm_fast import FastMM
from ..synth.mm_case import builtin_mm_specs, ensure_mm_built, load_mm_spec
from ..traces.compare import DivergenceRule, compare
from ..traces.format import Trace, TraceWriter
from .mutants import EQUIVALENT, MM_MUTANTS, MUTANTS, MMMutant

RESULTS_VERSION = 1

MM_SELFTEST_PROMPTS = ("image-audio", "two-images")
"""Prompts of ``cases/prompts/multimodal.jsonl`` the multimodal mutants run on (an image and a clip; two images)."""


# --------------------------------------------------------------------------- running


def fast_reference_rule(gates: dict | None = None) -> DivergenceRule:
    """The selftest's rule as a :class:`harness.traces.compare.DivergenceRule`: per-point cosine
    (:data:`harness.core.gates.SELFTEST_MIN_COSINE`, why not the pair's relative L2 there) and max |Δlogit| at
    ``result_output`` (``reference~fast.max_abs_logit``, from ``gates`` or :data:`harness.core.gates.DEFAULT_GATES`)."""
    g = gates or DEFAULT_GATES
    return DivergenceRule(tol=None, min_cosine=SELFTEST_MIN_COSINE,
                          max_abs={"result_output": g["reference~fast.max_abs_logit"].limit})


def trace_fast(fm: FastModel, ids: Sequence[int], case: str, engine: str) -> Trace:
    """Trace one prompt through a fast model, keeping the tensors. Returns an in-memory trace."""
    w = TraceWriter(engine, ids, case=case, dtype="float32", keep_tensors=True)
    fm.logits(ids, trace=w)
    return w.trace()


def trace_reference(cfg: ModelConfig, W, ids: Sequence[int], case: str) -> Trace:
    """Trace one prompt through the float64 reference, keeping the tensors."""
    w = TraceWriter(ORACLE, ids, case=case, dtype="float64", keep_tensors=True)
    ref_model.forward(cfg, W, ids, trace=w)
    return w.trace()


def _run_one(tr: Trace, ref: Trace, rule: DivergenceRule) -> dict[str, Any]:
    res = compare(tr, ref, rule)
    f = res.first
    out_row = next((r for r in res.rows if r.point == "result_output"), None)
    cos = [r.cosine for r in res.rows if r.cosine is not None]
    return {"detected": f is not None, "first": None if f is None else f.where, "why": "" if f is None else f.why,
            "n_diverged": sum(r.diverged for r in res.rows), "n_points": len(res.rows),
            "min_cosine": min(cos) if cos else None,
            "max_abs_logit": None if out_row is None else out_row.max_abs}


def trace_mm(engine: Any, prompt: MultimodalPrompt, case: str, name: str, dtype: str) -> Trace:
    """Trace one prepared multimodal prompt through a multimodal engine (:mod:`harness.engines.mm`), keeping the
    tensors."""
    w = TraceWriter(name, prompt.ids, case=case, dtype=dtype, keep_tensors=True)
    engine.logits(prompt, trace=w)
    return w.trace()


def _prepare(mm: MultimodalModel, p: dict[str, Any]) -> MultimodalPrompt:
    images, clips = prompt_media(p)
    return prepare_prompt(mm, resolve_ids(p["prompt_ids"], mm.tok), images, clips)


@contextlib.contextmanager
def _patched(m: MMMutant) -> Iterator[None]:
    """While inside, the mutant's module function is in place (restored on exit, also on an error)."""
    if m.patch is None:
        yield
        return
    module, name, fn = m.patch
    saved = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, saved)


def run_mm_case(spec_path, rule: DivergenceRule, mut_runs: dict[str, list[dict[str, Any]]],
                progress) -> dict[str, Any]:
    """The multimodal mutants on one multimodal case; returns the control's row, appends the mutants' runs."""
    ms = load_mm_spec(spec_path)
    mm = load_multimodal(ensure_mm_built(ms).hf_dir)
    prompts = [p for p in load_mm_prompts() if p["id"] in MM_SELFTEST_PROMPTS]
    prompts = [p for p in prompts if (mm.vision or not p["images"]) and (mm.audio or not p["audio"])]
    progress(f"[{ms.name}] reference traces on {len(prompts)} multimodal prompts")
    prepared = {p["id"]: _prepare(mm, p) for p in prompts}
    refs = {pid: trace_mm(ReferenceMM(mm), pr, ms.name, ORACLE, "float64") for pid, pr in prepared.items()}
    ctl = {"case": ms.name, "runs": []}
    control = FastMM(mm, "cpu", "float32")
    for pid, pr in prepared.items():
        r = _run_one(trace_mm(control, pr, ms.name, TWIN, "float32"), refs[pid], rule)
        ctl["runs"].append({"prompt": pid, **r})
    ctl["pass"] = not any(r["detected"] for r in ctl["runs"])
    progress(f"[{ms.name}] control {'ok' if ctl['pass'] else 'FAILED'}; multimodal mutants")
    for m in MM_MUTANTS:
        for p in prompts:
            pr = prepared[p["id"]]
            if not m.applies(mm, pr):
                continue
            exp = "{}@{}".format(*m.expected(mm, pr))
            with _patched(m):
                eng = FastMM(mm, "cpu", "float32", model=None if m.model is None else m.model(mm.cfg, mm.W, "cpu",
                                                                                            "float32"))
                if m.weights is not None:
                    m.weights(eng)
                tr = trace_mm(eng, _prepare(mm, p), ms.name, f"fast-mutant-{m.name}", "float32")
            r = _run_one(tr, refs[p["id"]], rule)
            mut_runs[m.name].append({"case": ms.name, "prompt": p["id"], "tokens": len(pr.ids), "expected": exp,
                                     "ok": r["detected"] and r["first"] == exp, **r})
    return ctl


def select_prompts(prompts: list[dict[str, Any]], ids: Sequence[str] | None, cfg: ModelConfig) -> list[dict[str, Any]]:
    """The prompts to use on one case: those named in ``ids`` (in that order), or by default every prompt
    longer than the case's sliding window (a window fault shows only there).

    Raises:
        InputError: an id that is not in the prompt set.
    """
    if ids:
        by_id = {str(p["id"]): p for p in prompts}
        missing = [i for i in ids if str(i) not in by_id]
        if missing:
            raise InputError(f"selftest: unknown prompt id {missing[0]!r} (known: {', '.join(by_id)})")
        return [by_id[str(i)] for i in ids]
    w = cfg.sliding_window or 1
    return [p for p in prompts if len(p["prompt_ids"]) > w]


def run_selftest(cases: Sequence[str] | None = None, prompt_ids: Sequence[str] | None = None,
                 out: str | None = None, quiet: bool = False, write: bool = True) -> tuple[dict[str, Any], int]:
    """Run every mutant on the built-in cases that exercise it; write the report.

    Args:
        cases: built-in case names (``cases/models/<name>.toml``); None = all.
        prompt_ids: prompt ids of ``cases/prompts/synthetic.jsonl``; None = per case, every prompt longer
            than its sliding window.
        out: parent folder of the run directory (default ``reports/``).
        quiet: no progress lines on stderr.
        write: write ``reports/<ts>-selftest/`` (``report.md``, ``results.json``).

    Returns:
        ``(results, status)``: status 0 when the controls pass, every mutant is detected with the
        expected first point on every case that exercises it, and every equivalent mutant stays within
        the gates; else 1.

    Raises:
        InputError: an unknown case name or prompt id.
    """
    def progress(msg: str) -> None:
        if not quiet:
            print(f"g4h selftest: {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    specs = builtin_specs()
    if cases:
        known = [s.stem for s in specs + builtin_mm_specs()]
        bad = [c for c in cases if c not in known]
        if bad:
            raise InputError(f"selftest: unknown case {bad[0]!r} (known: {', '.join(known)})")
    mm_specs = builtin_mm_specs()
    if cases:
        known_text, known_mm = {s.stem: s for s in specs}, {s.stem: s for s in mm_specs}
        specs = [known_text[c] for c in cases if c in known_text]  # in the order asked for
        mm_specs = [known_mm[c] for c in cases if c in known_mm]
    prompts = load_prompts(ids_only=True)
    mut_runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in MUTANTS + EQUIVALENT + MM_MUTANTS}
    controls = []
    rules = {}
    for spec_path in specs:
        spec = synth.load_spec(spec_path)
        built = synth.ensure_built(spec_path)
        cfg, W = load_model(built.gguf["F32"])
        rule = fast_reference_rule(resolve(spec.gates, str(spec_path)))
        rules[spec.name] = rule.describe()
        use = select_prompts(prompts, prompt_ids, cfg)
        progress(f"[{spec.name}] reference traces on {len(use)} prompts")
        refs = {p["id"]: trace_reference(cfg, W, p["prompt_ids"], spec.name) for p in use}
        control = FastModel(cfg, W, "cpu", "float32")
        ctl = {"case": spec.name, "runs": []}
        for p in use:
            r = _run_one(trace_fast(control, p["prompt_ids"], spec.name, TWIN), refs[p["id"]], rule)
            ctl["runs"].append({"prompt": p["id"], **r})
        ctl["pass"] = not any(r["detected"] for r in ctl["runs"])
        controls.append(ctl)
        progress(f"[{spec.name}] control {'ok' if ctl['pass'] else 'FAILED'}; mutants")
        for m in MUTANTS + EQUIVALENT:
            if not m.applies(cfg):
                continue
            fm = m.make(cfg, W)
            exp = None if m.expected is None else "{}@{}".format(*m.expected(cfg))
            for p in use:
                r = _run_one(trace_fast(fm, p["prompt_ids"], spec.name, f"fast-mutant-{m.name}"), refs[p["id"]], rule)
                ok = (not r["detected"]) if m.equivalent else (r["detected"] and r["first"] == exp)
                if m.equivalent:  # how far from the unmutated copy (0 = bit-identical)
                    r["max_abs_logit_vs_control"] = float(np.max(np.abs(
                        fm.logits(p["prompt_ids"]).numpy() - control.logits(p["prompt_ids"]).numpy())))
                mut_runs[m.name].append({"case": spec.name, "prompt": p["id"], "tokens": len(p["prompt_ids"]),
                                         "expected": exp, "ok": ok, **r})
    for spec_path in mm_specs:
        rule = fast_reference_rule(resolve(load_mm_spec(spec_path).spec.gates, str(spec_path)))
        rules[spec_path.stem] = rule.describe()
        controls.append(run_mm_case(spec_path, rule, mut_runs, progress))
    mutants, excluded = [], []
    for m in (MUTANTS if specs else ()) + (MM_MUTANTS if mm_specs else ()) + (EQUIVALENT if specs else ()):
        runs = mut_runs[m.name]
        row = {"name": m.name, "fault": m.fault, "exercised_by": m.exercised_by,
               "cases": sorted({r["case"] for r in runs}), "runs": runs,
               "detected": bool(runs) and all(r["detected"] for r in runs),
               "first": _summarise(runs, "first"), "expected": _summarise(runs, "expected"),
               "pass": bool(runs) and all(r["ok"] for r in runs)}
        if not runs:
            row["note"] = "no selected case exercises this fault"
        if getattr(m, "equivalent", None):
            row["why_equivalent"] = m.equivalent
            row["any_detected"] = any(r["detected"] for r in runs)
            row["max_abs_logit"] = max((r["max_abs_logit"] or 0.0 for r in runs), default=None)
            row["min_cosine"] = min((r["min_cosine"] for r in runs if r["min_cosine"] is not None), default=None)
            row["max_abs_logit_vs_control"] = max((r["max_abs_logit_vs_control"] for r in runs), default=None)
            row["pass"] = not row["any_detected"]  # the equivalence claim holds (no runs: nothing to refute)
            excluded.append(row)
        else:
            mutants.append(row)
    status = 0 if all(c["pass"] for c in controls) and all(m["pass"] for m in mutants) and \
        all(e["pass"] for e in excluded) else 1
    data = {"version": RESULTS_VERSION, "kind": "selftest",
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": time.perf_counter() - t0, "status": status, "rules": rules,
            "cases": [s.stem for s in specs + mm_specs], "prompt_filter": list(prompt_ids) if prompt_ids else None,
            "controls": controls, "mutants": mutants, "excluded": excluded}
    if write:
        with staged_run_dir("selftest", out) as run_dir:
            write_json_atomic(run_dir.path / "results.json", data)
            write_text_atomic(run_dir.path / "report.md", render_report(data))
        data["run_dir"] = str(run_dir.final)
    return data, status


def _summarise(runs: list[dict[str, Any]], key: str) -> str:
    """``attn_out@0`` when every run agrees, else ``case: value; ...`` (one value per case)."""
    vals = {r[key] for r in runs}
    if len(vals) <= 1:
        return next(iter(vals), None) or "-"
    per_case: dict[str, set] = {}
    for r in runs:
        per_case.setdefault(r["case"], set()).add(r[key] or "-")
    return "; ".join(f"{c}: {'/'.join(sorted(v))}" for c, v in per_case.items())


def mutant_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the report table: mutant, cases, detected, first point, expected, result."""
    rows = []
    for m in data["mutants"]:
        rows.append({"mutant": m["name"], "cases": ", ".join(m["cases"]) or "(none)",
                     "detected": "yes" if m["detected"] else "NO", "first point": m["first"],
                     "expected": m["expected"], "result": "PASS" if m["pass"] else "FAIL"})
    return rows


def render_report(data: dict[str, Any]) -> str:
    """``report.md``: verdict, mutant table, controls, excluded equivalent mutants with reasons, per-run details."""
    verdict = ("PASS: every mutant detected, first divergence named correctly" if data["status"] == 0 else
               "FAIL: a mutant escaped, was named wrongly, a control failed, or an equivalence claim was refuted")
    rule = next(iter(data["rules"].values()), "")
    lines = ["# Selftest (mutation testing of the harness)", "",
             f"**{verdict}** (created {data['created_utc']}; cases {', '.join(data['cases'])})", "",
             f"Each mutant is one fault injected into the fast path (fp32, CPU) by overriding one function; its traces "
             f"are compared "
             f"with the float64 reference's under the selftest's rule ({rule}). *first point* is the first "
             f"(point, layer) in trace order that breaks a gate.", "",
             markdown_table(mutant_table(data), ["mutant", "cases", "detected", "first point", "expected", "result"]),
             "", "## Faults", ""]
    lines += [f"- **{m['name']}**: {m['fault']} (exercised by {m['exercised_by']})" for m in data["mutants"]]
    lines += ["", "## Controls (the unmutated fast path)", ""]
    rows = [{"case": c["case"],
             "min cosine": min((r["min_cosine"] for r in c["runs"] if r["min_cosine"] is not None), default=None),
             "max |Δlogit|": max((r["max_abs_logit"] or 0.0 for r in c["runs"]), default=None),
             "result": "PASS" if c["pass"] else "FAIL"} for c in data["controls"]]
    lines += [markdown_table(rows, ["case", "min cosine", "max |Δlogit|", "result"]), ""]
    lines += ["## Excluded: mathematically equivalent mutants", "",
              "Run anyway; each must stay within the gates (else the equivalence claim is wrong and the selftest "
              "fails).", ""]
    rows = [{"mutant": e["name"], "cases": ", ".join(e["cases"]) or "(none)",
             "min cosine": e.get("min_cosine"), "max |Δlogit| vs reference": e.get("max_abs_logit"),
             "max |Δlogit| vs unmutated": e.get("max_abs_logit_vs_control"),
             "claim holds": "yes" if e["pass"] else "NO"} for e in data["excluded"]]
    lines += [markdown_table(rows, ["mutant", "cases", "min cosine", "max |Δlogit| vs reference",
                                    "max |Δlogit| vs unmutated", "claim holds"]), ""]
    lines += [f"- **{e['name']}** ({e['fault']}): {e['why_equivalent']}" for e in data["excluded"]]
    lines += ["", "## Runs", ""]
    rows = []
    for m in data["mutants"] + data["excluded"]:
        for r in m["runs"]:
            rows.append({"mutant": m["name"], "case": r["case"], "prompt": r["prompt"], "first": r["first"] or "-",
                         "expected": r["expected"] or "(none: equivalent)", "diverged": f"{r['n_diverged']}/{r['n_points']}",
                         "why": r["why"], "ok": "yes" if r["ok"] else "NO"})
    lines += [markdown_table(rows, ["mutant", "case", "prompt", "first", "expected", "diverged", "why", "ok"]), ""]
    return "\n".join(lines)


def selftest_command(cases: Sequence[str] | None, prompt_ids: Sequence[str] | None, out: str | None,
                     quiet: bool) -> int:
    """``g4h selftest``: run, print the mutant table and the report path; return the exit status."""
    data, status = run_selftest(cases, prompt_ids, out, quiet)
    print(markdown_table(mutant_table(data), ["mutant", "cases", "detected", "first point", "expected", "result"]))
    bad_eq = [e["name"] for e in data["excluded"] if not e["pass"]]
    bad_ctl = [c["case"] for c in data["controls"] if not c["pass"]]
    if bad_eq:
        print(f"equivalence claims refuted: {', '.join(bad_eq)}")
    if bad_ctl:
        print(f"controls failed: {', '.join(bad_ctl)}")
    print(f"\nreport: {data['run_dir']}/report.md  (exit {status})")
    return status
