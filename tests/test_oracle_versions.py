"""The oracle moves: a problem with one oracle stays in its own rows, and oracle drift is reported.

* an oracle that cannot run (transformers failing to load the case, or unable to construct its assistant) fails
  its ``.runs`` row with the reason; every other check of the case still runs, and the verdict is FAIL, never
  BAD INPUT;
* ``g4h parity --oracle-drift PINNED/results.json`` lists every figure that moved between two runs with its first
  diverging point, flags a moved figure outside the oracle's pairs, and leaves the exit status to the gates.
"""

from __future__ import annotations

import copy
import json

import pytest

from gemma4_harness.harness.cli import main as g4h
from gemma4_harness.harness.core import hf_assistant
from gemma4_harness.harness.core.cases import MODELS_DIR
from gemma4_harness.harness.core.gates import resolve
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.parity import cases as parity_cases
from gemma4_harness.harness.parity.checks.oracle import oracle_rows
from gemma4_harness.harness.parity.drift import drift_section, first_moved_point, oracle_drift
from gemma4_harness.harness.parity.job import exit_status, verdict
from gemma4_harness.harness.parity.result import CaseResult, fig

PROMPTS = [p for p in load_prompts() if p["id"] in ("len5", "len17-window+1")]


def test_oracle_rows_keep_an_oracle_problem_in_its_row():
    ok = oracle_rows("reference~transformers.runs", lambda: [fig("reference~transformers.max_abs_logit", 1e-6, "p")])
    assert [f.gate for f in ok] == ["reference~transformers.runs", "reference~transformers.max_abs_logit"]
    assert ok[0].measured == 1.0 and ok[0].detail["transformers"]

    def broken():
        raise OSError("Gemma4ForCausalLM does not exist in this version\nsecond line")

    bad = oracle_rows("reference~transformers.runs", broken)
    assert len(bad) == 1 and bad[0].measured == 0.0
    got = bad[0].detail["got"]
    assert got.startswith("not run: transformers ") and "OSError: Gemma4ForCausalLM does not exist" in got
    assert "second line" not in got


@pytest.mark.slow
def test_an_oracle_that_cannot_run_fails_only_its_own_rows(monkeypatch):
    """edge-no-softcap with transformers unable to load the target and to construct the assistant: the two
    ``runs`` rows fail with their reasons, every other check runs as before, FAIL (exit 1), not BAD INPUT."""
    from gemma4_harness.harness.synth.drafter import ensure_drafter_built

    ensure_drafter_built(MODELS_DIR / "edge-no-softcap-assistant.toml")  # built (cached) before the oracle breaks
    real_make = parity_cases.make_engine

    def make_engine(name, *a, **k):
        if name == "transformers":
            raise ValueError("Unrecognized configuration class Gemma4TextConfig (a newer transformers, say)")
        return real_make(name, *a, **k)

    monkeypatch.setattr(parity_cases, "make_engine", make_engine)
    monkeypatch.setattr(hf_assistant, "construction", lambda: (_ for _ in ()).throw(hf_assistant.AssistantUnavailable(
        "transformers 9.9 cannot construct Gemma4AssistantForCausalLM: TypeError: new argument")))
    res = parity_cases.synthetic_case(MODELS_DIR / "edge-no-softcap.toml", PROMPTS, lambda m: None,
                                      skip=("llamacpp",))
    assert res.error is None
    rows = {c["gate"]: c for c in res.checks}
    ref_runs, drafter_runs = rows["reference~transformers.runs"], rows["drafter.reference~transformers.runs"]
    assert not ref_runs["pass"] and "Unrecognized configuration class" in ref_runs["got"]
    assert not drafter_runs["pass"] and "cannot construct Gemma4AssistantForCausalLM" in drafter_runs["got"]
    assert "reference~transformers.max_abs_logit" not in rows and "drafter.reference~transformers.max_abs" not in rows
    for gate in ("reference.gguf_f32~safetensors.max_abs_logit", "reference~fast.max_abs_logit",
                 "drafter.gguf_f32~safetensors.max_abs", "drafter.reference~fast.max_abs",
                 "speculative.lossless.same_tokens", "speculative.model.drafted"):
        assert gate in rows and all(c["pass"] for c in res.checks if c["gate"] == gate), gate
    failing = {c["gate"] for c in res.checks if not c["pass"] and not c.get("informational")}
    assert failing == {"reference~transformers.runs", "drafter.reference~transformers.runs"}
    assert exit_status([res]) == 1
    line = verdict([res], 1)
    assert line.startswith("FAIL:") and "BAD INPUT" not in line and "reference~transformers.runs" in line


def test_a_drafter_transformers_cannot_write_is_its_row_and_the_case_goes_on(monkeypatch):
    """The synthetic drafter is written through transformers' own class: when this transformers cannot construct
    it, the writer refuses in one line and the case's drafter row says so (the speculative checks with the other
    drafters still run)."""
    from gemma4_harness.harness.synth import drafter as synth_drafter

    def refuse():
        raise hf_assistant.AssistantUnavailable("transformers 9.9 cannot construct Gemma4AssistantForCausalLM: x")

    monkeypatch.setattr(hf_assistant, "construction", refuse)
    spec = synth_drafter.load_drafter_spec(MODELS_DIR / "edge-no-softcap-assistant.toml")
    with pytest.raises(hf_assistant.AssistantUnavailable):
        synth_drafter.write_drafter_hf(spec, synth_drafter.make_drafter_weights(spec), "/nonexistent-never-written")
    monkeypatch.setattr(parity_cases, "ensure_drafter_built", lambda d: refuse())
    res = CaseResult(case="edge-no-softcap", kind="synthetic", model="m")
    gates = resolve(None, "edge-no-softcap")
    assert parity_cases._drafter(res, gates, MODELS_DIR / "edge-no-softcap-assistant.toml", lambda m: None, "x") \
        is None
    (row,) = res.checks
    assert row["gate"] == "drafter.reference~transformers.runs" and not row["pass"]
    assert row["got"].startswith("not run: the drafter edge-no-softcap-assistant could not be written: transformers")


# --------------------------------------------------------------------------- drift


def check(gate, measured, prompt="p1", passed=True, **kw):
    return {"gate": gate, "prompt": prompt, "measured": measured, "limit": 1e-4, "op": "le", "pass": passed, **kw}


def results(version, checks, error=None):
    return {"version": 1, "kind": "parity", "status": 0, "versions": {"transformers": version},
            "cases": [{"case": "e2b", "kind": "synthetic", "checks": checks, "error": error}]}


PROFILE = [["inp_scaled", -1, 1e-7], ["attn_out", 0, 2e-7], ["l_out", 0, 3e-7], ["attn_out", 1, 4e-7],
           ["l_out", 1, 5e-7], ["result_output", -1, 6e-7]]


def test_drift_lists_moved_figures_with_their_first_diverging_point():
    moved = copy.deepcopy(PROFILE)
    moved[3][2] = 9e-7  # attn_out of layer 1 is where the newer oracle's computation first differs
    moved[4][2] = 8e-7
    pinned = results("5.23.0", [
        check("reference~transformers.max_abs_logit", 3e-5),
        check("reference~transformers.layer_rel_l2", 6e-7, per_point=list(reversed(PROFILE))),
        check("reference~fast.max_abs_logit", 2e-5),
        check("drafter.store_kv.reference~transformers.max_abs", float("nan"), prompt=None, got="not run",
              informational=True),
        check("reference~transformers.runs", 1.0, prompt=None),
        check("drafter.reference~transformers.runs", 1.0, prompt=None, construction="patched")])
    newest = results("5.24.0", [
        check("reference~transformers.max_abs_logit", 3e-5),
        check("reference~transformers.layer_rel_l2", 9e-7, per_point=moved),
        check("reference~fast.max_abs_logit", 2.5e-5),
        check("drafter.store_kv.reference~transformers.max_abs", 5e-6, prompt=None),
        check("drafter.reference~transformers.runs", 1.0, prompt=None, construction="native"),
        check("speculative.model.drafted", 1000.0, prompt=None)])
    d = oracle_drift(pinned, newest, "pinned/results.json")
    assert (d["pinned"], d["newest"], d["compared"]) == ("5.23.0", "5.24.0", 5)
    rows = {r["gate"]: r for r in d["moved"]}
    assert set(rows) == {"reference~transformers.layer_rel_l2", "reference~fast.max_abs_logit",
                         "drafter.store_kv.reference~transformers.max_abs"}
    layer = rows["reference~transformers.layer_rel_l2"]
    assert layer["first_diverging_point"] == "attn_out@1" and layer["oracle"]
    assert layer["rel_change"] == pytest.approx(1 / 3)
    assert not rows["reference~fast.max_abs_logit"]["oracle"]  # moved outside the oracle: said, not hidden
    store = rows["drafter.store_kv.reference~transformers.max_abs"]
    assert store["pinned"] != store["pinned"] and store["newest"] == 5e-6 and "not run -> None" in store["got"]
    assert [r["gate"] for r in d["only_newest"]] == ["speculative.model.drafted"]
    assert [r["gate"] for r in d["only_pinned"]] == ["reference~transformers.runs"]
    assert d["assistant_construction"] == [{"case": "e2b", "gate": "drafter.reference~transformers.runs",
                                            "pinned": "patched", "newest": "native"}]
    text = "\n".join(drift_section({"oracle_drift": d}))
    assert "transformers 5.23.0" in text and "5.24.0" in text and "**3 moved**" in text and "attn_out@1" in text
    assert "1 of them outside the oracle's pairs" in text and "The MTP assistant: patched -> native" in text
    assert "speculative.model.drafted: 1 check, 1e+03, 1 within the gate" in text
    assert first_moved_point({"per_point": PROFILE}, {"per_point": list(PROFILE)}) is None


def test_oracle_drift_option_reads_the_pinned_results_or_refuses_in_one_line(tmp_path, capsys):
    bad = tmp_path / "pinned.json"
    bad.write_text("{}")
    assert g4h(["parity", "--case", "e2b", "--no-real", "--oracle-drift", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "parity results" in err[0]
    assert not list(tmp_path.glob("*-parity"))
    json.dumps(oracle_drift(results("a", []), results("b", [])))  # JSON-able, as results.json holds it
