"""Parity baselines (harness/parity/baseline.py) and determinism of the parity job.

The rules are tested on small hand-made results; the determinism test runs the
e2b parity case twice (on two short prompts, so that it stays near a minute)
and compares the results apart from timestamps, timings and paths, then uses
the first run as the second one's baseline.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemma4_harness.harness.parity import baseline as bl
from gemma4_harness.harness.parity.result import RESULTS_VERSION

REPO_ROOT = Path(__file__).resolve().parent.parent


def check(gate, measured, limit, op="le", passed=None, prompt="p1", **kw):
    ok = (measured <= limit) if op == "le" else (measured >= limit)
    return {"gate": gate, "prompt": prompt, "measured": measured, "limit": limit, "op": op,
            "pass": ok if passed is None else passed, **kw}


def results(*cases, version=RESULTS_VERSION):
    return {"version": version, "kind": "parity", "created_utc": "2026-01-01T00:00:00Z", "seconds": 12.5, "status": 0,
            "cases": list(cases)}


def case(name, checks, error=None):
    return {"case": name, "kind": "synthetic", "model": f"/somewhere/{name}/hf", "checks": checks, "error": error,
            "error_kind": None, "info": {"timings": {"load_s": 1.0}, "x": {"generate_s": 0.2, "n": 3}},
            "seconds": 3.3}


BASE = results(case("e2b", [
    check("reference~fast.max_abs_logit", 2e-5, 1e-3),
    check("reference~llamacpp.mm_vision_cosine", 0.9999999, 0.99999, "ge"),
    check("reference.cached~uncached.max_abs_logit", 1e-15, 1e-10),
    check("reference.gguf_quant~gguf_quants.max_abs_weight", 0.0, 0.0, prompt=None, qtype="Q8_0"),
    check("reference.gguf_quant~gguf_quants.max_abs_weight", 0.0, 0.0, prompt=None, qtype="Q4_0"),
    check("reference~fast_bf16.mean_kld", 5e-4, 1e-3, informational=True),
]), case("31b", [check("reference~fast.max_abs_logit", 2e-5, 1e-3)]))


def test_strip_volatile():
    s = bl.strip_volatile(BASE)
    assert "created_utc" not in s and "seconds" not in s
    c = s["cases"][0]
    assert "seconds" not in c and "model" not in c and "timings" not in c["info"]
    assert c["info"]["x"] == {"n": 3}
    assert c["checks"] == BASE["cases"][0]["checks"]
    assert "created_utc" in BASE  # the input is not modified


def test_no_regression_against_itself():
    out = bl.compare_to_baseline(copy.deepcopy(BASE), BASE, "b.json")
    assert out["regressions"] == [] and out["compared"] == 6  # the informational check is not judged


def test_regression_rules():
    now = copy.deepcopy(BASE)
    e2b = now["cases"][0]["checks"]
    e2b[0]["measured"] = 5e-4  # 25x worse, still within its gate
    e2b[1]["measured"] = 0.99999995  # deficit 5e-8 vs 1e-7: better
    e2b[2]["measured"] = 9e-15  # 9x worse but far below the gate (floor limit/1000 = 1e-13): not counted
    e2b[4].update(measured=0.5, **{"pass": False})  # Q4_0 weights now differ: gate fails
    e2b[5]["measured"] = 1.0  # informational: not judged
    now["cases"][1] = case("31b", [], error="engine crashed: boom")
    out = bl.compare_to_baseline(now, BASE, "b.json", factor=10)
    rules = {(r["case"], r["gate"], r.get("qtype"), r["rule"]) for r in out["regressions"]}
    assert rules == {("e2b", "reference~fast.max_abs_logit", None, "worse"),
                     ("e2b", "reference.gguf_quant~gguf_quants.max_abs_weight", "Q4_0", "now fails"),
                     ("31b", "(case)", None, "case error")}
    worse = next(r for r in out["regressions"] if r["rule"] == "worse")
    assert worse["ratio"] == pytest.approx(25.0)
    # a bigger factor lets the 25x pass
    out = bl.compare_to_baseline(now, BASE, factor=30)
    assert {r["rule"] for r in out["regressions"]} == {"now fails", "case error"}


def test_ge_gate_deficit_and_missing_cases():
    base = results(case("a", [check("reference~llamacpp.mm_vision_cosine", 0.9999999, 0.99999, "ge")]),
                   case("gone", [check("x", 0.0, 1.0)]))
    now = results(case("a", [check("reference~llamacpp.mm_vision_cosine", 0.999995, 0.99999, "ge")]),
                  case("new", [check("x", 0.0, 1.0)]))
    out = bl.compare_to_baseline(now, base)
    assert [r["rule"] for r in out["regressions"]] == ["worse"]  # deficit 5e-6 vs 1e-7: 50x
    assert out["cases_only_in_baseline"] == ["gone"] and out["cases_only_now"] == ["new"]
    now["cases"][0]["checks"][0]["measured"] = "NaN"  # as results.json stores a NaN figure
    now["cases"][0]["checks"][0]["pass"] = False
    assert [r["rule"] for r in bl.compare_to_baseline(now, base)["regressions"]] == ["now fails"]


V1 = results(case("e2b", [  # results version 1, written by hand with its names (harness/core/names.py)
    check("fast~reference.max_abs_logit", 2e-5, 1e-3),
    check("fast~reference.layer_cosine", 0.9999999, 0.99999, "ge"),
    check("llamacpp~reference.runs", 1.0, 1.0, "ge", prompt=None),
    check("llamacpp~reference.mean_kld", 1e-8, 1e-5, prompt=None, vs_exact_gelu=2e-8),
    check("drafter.llamacpp~reference.max_abs", 1e-3, 2e-2),
]), version=1)


def test_v1_baseline_still_compares(tmp_path):
    """A baseline of results version 1 is read with its gates renamed (harness.core.names): a renamed figure is
    compared with this version's, one that is another measure now is listed, not judged."""
    (tmp_path / "v1.json").write_text(json.dumps(V1))
    base = bl.load_baseline(tmp_path / "v1.json")
    assert base["version"] == RESULTS_VERSION
    gates = [c["gate"] for c in base["cases"][0]["checks"]]
    assert gates == ["reference~fast.max_abs_logit", "reference~fast.layer_rel_l2", "reference~llamacpp.runs",
                     "reference~llamacpp.mean_kld", "drafter.reference~llamacpp.max_abs"]
    assert base["cases"][0]["checks"][3]["vs_exact_reference"] == 2e-8
    now = results(case("e2b", [
        check("reference~fast.max_abs_logit", 5e-4, 1e-3),  # 25x worse, still within its gate
        check("reference~fast.layer_rel_l2", 0.5, 1e-3, passed=False),  # another measure: not judged against v1
        check("reference~llamacpp.runs", 0.0, 1.0, "ge", prompt=None),  # failed: llama.cpp no longer runs
        check("drafter.reference~llamacpp.max_abs", 1e-3, 2e-2),
    ]))
    out = bl.compare_to_baseline(now, base, "v1.json")
    assert {(r["gate"], r["rule"]) for r in out["regressions"]} == {("reference~fast.max_abs_logit", "worse"),
                                                                   ("reference~llamacpp.runs", "now fails")}
    assert out["compared"] == 3 and out["checks_only_in_baseline"] == 1  # the pooled KLD: per prompt now



V2 = results(case("compare", [  # results version 2: the shared bounds named engine~oracle (harness/core/names.py)
    check("engine~oracle.max_abs_logit", 1e-3, 2e-2),
    check("engine~oracle.mean_kld", 1e-8, 1e-5),
    check("engine_bf16~oracle.same_top1_decisive", 1.0, 0.99, "ge"),
    check("reference~fast.max_abs_logit", 2e-5, 1e-3),
]), version=2)


def test_v2_baseline_with_engine_oracle_names_still_compares(tmp_path):
    """A baseline of results version 2 is read with its ``engine~oracle`` pairs named ``oracle~engine`` (version 3),
    every figure compared with this version's (the same measures, renamed): a regression under the new name is
    found, nothing is listed as only in the baseline."""
    (tmp_path / "v2.json").write_text(json.dumps(V2))
    base = bl.load_baseline(tmp_path / "v2.json")
    assert base["version"] == RESULTS_VERSION == 3
    assert [c["gate"] for c in base["cases"][0]["checks"]] == [
        "oracle~engine.max_abs_logit", "oracle~engine.mean_kld", "oracle~engine_bf16.same_top1_decisive",
        "reference~fast.max_abs_logit"]
    assert not any(c.get("informational") for c in base["cases"][0]["checks"])
    now = results(case("compare", [
        check("oracle~engine.max_abs_logit", 1e-3, 2e-2),
        check("oracle~engine.mean_kld", 5e-7, 1e-5),  # 50x worse, still within its gate
        check("oracle~engine_bf16.same_top1_decisive", 0.98, 0.99, "ge", passed=False),  # fails now
        check("reference~fast.max_abs_logit", 2e-5, 1e-3),
    ]))
    out = bl.compare_to_baseline(now, base, "v2.json")
    assert {(r["gate"], r["rule"]) for r in out["regressions"]} == {
        ("oracle~engine.mean_kld", "worse"), ("oracle~engine_bf16.same_top1_decisive", "now fails")}
    assert out["compared"] == 4 and out["checks_only_in_baseline"] == 0 and out["checks_only_now"] == 0


def test_load_baseline_bad_input(tmp_path):
    with pytest.raises(bl.InputError, match="cannot read"):
        bl.load_baseline(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(bl.InputError, match="not valid JSON"):
        bl.load_baseline(tmp_path / "x.json")
    (tmp_path / "x.json").write_text(json.dumps({"kind": "bench", "version": 1, "cases": []}))
    with pytest.raises(bl.InputError, match="not a parity results file"):
        bl.load_baseline(tmp_path / "x.json")
    (tmp_path / "x.json").write_text(json.dumps({"kind": "parity", "version": 99, "cases": []}))
    with pytest.raises(bl.InputError, match="version 99"):
        bl.load_baseline(tmp_path / "x.json")
    bl.write_baseline(tmp_path / "sub" / "base.json", BASE)
    loaded = bl.load_baseline(tmp_path / "sub" / "base.json")
    assert loaded == bl.strip_volatile(BASE)


def test_cli_bad_baseline_is_one_line_exit_2(tmp_path):
    (tmp_path / "bad.json").write_text("[]")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "parity", "--case", "e2b", "--no-real", "--quiet",
                           "--out", str(tmp_path), "--baseline", str(tmp_path / "bad.json")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "bad.json" in lines[0], proc.stderr
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # nothing ran


@pytest.mark.slow
def test_parity_is_deterministic_and_baseline_round_trips(tmp_path, monkeypatch):
    import gemma4_harness.harness.parity as parity
    from gemma4_harness.harness.core.prompts import load_prompts

    short = [p for p in load_prompts() if p["id"] in ("len5", "len17-window+1")]
    assert len(short) == 2
    prompts = tmp_path / "short.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in short))
    cases = ["e2b", "edge-no-softcap"]  # two at once, then one at a time: the figures may not depend on --jobs
    d1, s1 = parity.run(case_filter=cases, real=False, out=str(tmp_path / "a"), quiet=True,
                        write_baseline=str(tmp_path / "base.json"), prompts=prompts, jobs=2)
    assert s1 == 0
    d2, s2 = parity.run(case_filter=cases, real=False, out=str(tmp_path / "b"), quiet=True,
                        baseline=str(tmp_path / "base.json"), prompts=prompts, jobs=1)
    f1 = json.loads((Path(d1["run_dir"]) / "results.json").read_text())
    f2 = json.loads((Path(d2["run_dir"]) / "results.json").read_text())
    assert f1["created_utc"] and f1["cases"][0]["seconds"] > 0  # the volatile fields exist ...
    assert bl.strip_volatile(f1) == bl.strip_volatile(f2)  # ... and are all that differs
    assert s2 == 0 and f2["baseline"]["regressions"] == [] and f2["baseline"]["compared"] > 10
    assert "## Baseline comparison" in (Path(d2["run_dir"]) / "report.md").read_text()
    # the same results with one figure 50x worse (still inside its gate) are a regression
    doctored = copy.deepcopy(f2)
    for c in doctored["cases"][0]["checks"]:
        if c["gate"] == "reference~fast.max_abs_logit":
            c["measured"] = c["measured"] * 50.0
    out = bl.compare_to_baseline(doctored, bl.load_baseline(tmp_path / "base.json"), "base.json")
    assert out["regressions"] and {(r["gate"], r["rule"]) for r in out["regressions"]} == {
        ("reference~fast.max_abs_logit", "worse")}
