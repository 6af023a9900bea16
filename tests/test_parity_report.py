"""The parity report's summary table: verdict rows per case and gate."""

from __future__ import annotations

from gemma4_harness.harness.parity.report import render_markdown, summarize


def _check(measured, ok, info=False, reason=""):
    c = {"gate": "tokenizer.check", "measured": measured, "limit": 1.0, "op": "ge", "pass": ok, "prompt": "p"}
    if info:
        c.update(informational=True, reason=reason)
    return c


def test_informational_check_never_hides_a_gating_failure():
    data = {"status": 1, "created_utc": "x", "cases": [{"case": "t", "kind": "tokenizer", "model": "m",
                                                      "error": None, "info": {}, "checks": [
        _check(0.0, False), _check(0.0, False, info=True, reason="documented difference"), _check(1.0, True)]}]}
    rows = summarize(data)
    assert [r["result"] for r in rows] == ["FAIL", "INFO"]
    assert "documented difference" in rows[1]["note"]
    text = render_markdown(data, None)
    assert "| FAIL" in text and "First divergence" in text


def test_all_informational_group_is_info_not_fail():
    data = {"cases": [{"case": "t", "error": None, "info": {}, "checks": [_check(0.0, False, info=True, reason="r")]}]}
    assert [r["result"] for r in summarize(data)] == ["INFO"]


def test_an_informational_figure_without_a_value_shows_no_nan():
    """An informational figure that holds no value (``agreeing_positions`` beside ``local_median``: its null is not
    computed) shows a blank and "no value" with its reason in a PASS table, not ``nan`` and "0/1 within"; a gating
    figure without a value still shows ``nan`` and fails."""
    for nan in (float("nan"), "NaN"):  # in memory, and as results.json spells it
        (r,) = summarize({"cases": [{"case": "t", "error": None, "info": {}, "checks": [
            _check(nan, False, info=True, reason="local_median judges")]}]})
        assert (r["worst"], r["result"]) == ("", "INFO") and r["note"].startswith("no value"), r
        assert "local_median judges" in r["note"] and "within" not in r["note"], r
    (r,) = summarize({"cases": [{"case": "t", "error": None, "info": {}, "checks": [_check(float("nan"), False)]}]})
    assert (r["worst"], r["result"]) == ("nan", "FAIL")


def test_limits_raised_per_figure_show_the_row_nearest_its_own_limit():
    """Declared approximations raise each figure's limit by its own effect: the row shows the figure nearest (or
    furthest beyond) its own limit with that limit, never a worst value beside another figure's smaller limit."""
    def chk(measured, limit, prompt):
        return {"gate": "reference~cmd.max_abs_logit", "measured": measured, "limit": limit, "op": "le",
                "pass": measured <= limit, "prompt": prompt}

    def row(*checks):
        (r,) = summarize({"cases": [{"case": "m", "error": None, "info": {}, "checks": list(checks)}]})
        return r

    r = row(chk(0.0095, 0.0103, "a"), chk(0.0131, 0.0190, "b"))  # a: 92 % of its limit, b: 69 %
    assert (r["worst"], r["limit"], r["result"]) == ("0.0095", "<= 0.0103", "PASS")
    assert "limit per figure 0.0103..0.019" in r["note"]
    r = row(chk(0.0131, 0.0190, "b"), chk(0.0110, 0.0103, "a"))  # a fails below b's value
    assert (r["worst"], r["limit"], r["result"]) == ("0.011", "<= 0.0103", "FAIL")
    r = row(chk(0.001, 0.002, "a"), chk(float("nan"), 0.002, "b"))
    assert (r["worst"], r["result"]) == ("nan", "FAIL")


# --------------------------------------------------------------------------- plots and tables

import json  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gemma4_harness.harness.core.metrics import kld_histogram  # noqa: E402
from gemma4_harness.harness.parity.report import (kld_hists, merge_kld_hists, pair_slug, per_layer_frame,  # noqa: E402
                                   write_parity_report)
from gemma4_harness.harness.parity.result import RESULTS_VERSION  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _layer_check(gate, prompt, values, point="l_out", **kw):
    per_point = [["inp_scaled", -1, 1e-9]] + [[point, i, v] for i, v in enumerate(values)]
    return {"gate": gate, "prompt": prompt, "measured": max(values), "limit": 1.0, "op": "le", "pass": True,
            "per_point": per_point, **kw}


def _case(name, kld_scale):
    rng = np.random.default_rng(len(name))
    hist = kld_histogram(np.concatenate([[0.0], kld_scale * rng.lognormal(0.0, 1.0, 200)]))
    return {"case": name, "kind": "synthetic", "model": "m", "error": None, "info": {}, "checks": [
        _layer_check("reference~transformers.layer_rel_l2", "p1", [1e-7, 2e-7, 4e-7]),
        _layer_check("reference~transformers.layer_rel_l2", "p2", [3e-7, 1e-7, 5e-7]),
        _layer_check("reference~fast.layer_rel_l2", "p1", [1e-7, 1e-6, 1e-5]),
        _layer_check("fast.chunked~oneshot.max_abs_logit", "p1", [0.0, 0.0, 1e-8], variant="chunk=window"),
        {**_layer_check("reference~fast_bf16.mean_kld", None, [1e-3, 2e-3, 4e-3]), "kld_hist": hist},
        {"gate": "fast.batched~solo.same_tokens", "prompt": None, "measured": 1.0, "limit": 1.0, "op": "ge",
         "pass": True},
        {"gate": "reference~llamacpp.max_abs_logit", "prompt": None, "measured": 1e-3, "limit": 2e-2, "op": "le",
         "pass": True, "per_point": [["l_out", 0, 1e-6], ["l_out", 1, "NaN"], ["attn_out", 1, 1e-5]]},
    ]}


def _data():
    return {"version": RESULTS_VERSION, "kind": "parity", "status": 0, "created_utc": "2025-01-01T00:00:00Z",
            "seconds": 1.0,
            "cases": [_case("e2b", 1e-4), _case("e4b", 1e-3),
                      {"case": "broken", "kind": "synthetic", "model": "m", "error": "engine crashed: X",
                       "info": {}, "checks": []}]}


def _table_rows(text, header_start, after=""):
    """The body rows of the first Markdown table after the line ``after`` whose header starts with
    ``header_start``, as lists of cells."""
    lines = text.splitlines()
    first = lines.index(after) if after else 0
    i = next(k for k, ln in enumerate(lines) if k > first and ln.startswith(header_start))
    rows = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split(" | ")])
    return rows


def test_pngs_are_written_valid_and_linked(tmp_path):
    data = _data()
    write_parity_report(tmp_path, data)
    pairs = ["reference~transformers", "reference~fast", "fast.chunked~oneshot", "reference~fast_bf16",
             "reference~llamacpp"]
    names = [f"layer_error-{pair_slug(p)}.png" for p in pairs] + ["kld_hist.png"]
    assert "layer_error-reference_vs_transformers.png" in names
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(names + ["report.md", "results.json"])  # no temporary file left, no other plot
    for n in names:
        blob = (tmp_path / n).read_bytes()
        assert len(blob) > 1000 and blob.startswith(PNG_MAGIC), n
    report = (tmp_path / "report.md").read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert sorted(linked) == sorted(names)
    assert report.index("## Per-layer error") < report.index("## Per-position KLD") < report.index("## Details")
    assert json.loads((tmp_path / "results.json").read_text())["cases"][0]["checks"][4]["kld_hist"]["n"] == 201


def test_report_tables_have_the_right_rows(tmp_path):
    data = _data()
    write_parity_report(tmp_path, data)
    report = (tmp_path / "report.md").read_text()
    summary = _table_rows(report, "| case ")
    # per case: one row per gate (batched~solo included); the broken case one ERROR row
    assert len(summary) == 2 * 6 + 1
    assert summary[-1][:2] == ["broken", "(case could not run)"] and summary[-1][4] == "ERROR"
    assert {r[4] for r in summary[:-1]} == {"PASS"}
    layers = _table_rows(report, "| pair ", after="## Per-layer error")
    assert [(r[0], r[1]) for r in layers] == [(p, c) for p in ("reference~transformers", "reference~fast",
                                                               "fast.chunked~oneshot", "reference~fast_bf16",
                                                               "reference~llamacpp") for c in ("e2b", "e4b")]
    ref = layers[0]
    # largest over the two prompts per layer: 3e-7, 2e-7, 5e-7
    assert ref[2:] == ["3", "3e-07", "5e-07", "5e-07", "1.67"]
    chunked = layers[4]
    assert chunked[3] == "0" and chunked[6] == ""  # bit-identical first layer: no growth factor
    assert layers[8][2] == "1"  # llama.cpp: the NaN layer is left out; l_out preferred over attn_out
    kld = _table_rows(report, "| pair ", after="## Per-position KLD")
    assert [(r[0], r[1], r[2], r[3]) for r in kld] == [("reference~fast_bf16", "e2b", "201", "1"),
                                                       ("reference~fast_bf16", "e4b", "201", "1")]
    details = _table_rows(report, "| gate ")
    assert len(details) == 7 and details[0][0] == "reference~transformers.layer_rel_l2"


def test_no_per_layer_or_kld_data_means_no_plots(tmp_path):
    data = {"status": 1, "created_utc": "x", "cases": [{"case": "t", "kind": "tokenizer", "model": "m",
                                                      "error": None, "info": {}, "checks": [_check(0.0, False)]}]}
    write_parity_report(tmp_path, data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.json"]
    report = (tmp_path / "report.md").read_text()
    assert "Per-layer error" not in report and "Per-position KLD" not in report and ".png" not in report


def test_per_layer_frame_takes_the_worst_over_prompts():
    frame = per_layer_frame(_data())
    ref = frame[(frame["pair"] == "reference~transformers") & (frame["case"] == "e2b")]
    assert ref["layer"].tolist() == [0, 1, 2] and ref["rel_l2"].tolist() == [3e-7, 2e-7, 5e-7]
    assert "broken" not in set(frame["case"])


def test_kld_histogram_fixed_grid_and_merge():
    h = kld_histogram([0.0, 1e-20, 1e-3, 1.5e-3, 0.5, np.nan, np.inf])
    assert h["n"] == 7 and h["below"] == 2 and h["nonfinite"] == 2 and sum(h["counts"]) == 3
    assert h["log10_lo"] == -3.0 and h["bins_per_decade"] == 4
    assert h["counts"][0] == 2 and h["counts"][-1] == 1  # 0.5 lies in [10**-0.5, 1)
    assert kld_histogram([1e-3, 1.5e-3]) == kld_histogram(np.array([1.5e-3, 1e-3]))  # order does not matter
    empty = kld_histogram([0.0])
    assert empty["counts"] == [] and empty["below"] == 1
    m = merge_kld_hists([h, kld_histogram([1e-6]), empty])
    assert m["n"] == 9 and m["below"] == 3 and m["log10_lo"] == -6.0 and sum(m["counts"]) == 4
    assert m["counts"][0] == 1 and m["counts"][12] == 2
    assert merge_kld_hists([]) is None
    with pytest.raises(ValueError):
        merge_kld_hists([h, {**h, "bins_per_decade": 2}])
    groups = kld_hists(_data())
    assert list(groups) == [("reference~fast_bf16", "e2b"), ("reference~fast_bf16", "e4b")]


def test_fast_checks_carry_per_layer_and_kld_data(tiny_gguf):
    """The pair pipeline's figures carry what the report plots: ``layer_rel_l2`` its ``per_point`` (every layer's
    ``l_out``), ``mean_kld`` its per-position KLD histogram; the chunked check its per-point errors per variant."""
    from gemma4_harness.fast.model import FastModel
    from gemma4_harness.harness.engines.checked import CheckedEngine
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.fast import chunked_vs_oneshot
    from gemma4_harness.harness.parity.checks.pair import pair_checks
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
    from gemma4_harness.reference import load_model

    cfg, w = load_model(tiny_gguf)
    fm = FastModel(cfg, w, "cpu", "float32")
    prompts = [{"id": "a", "prompt_ids": [2, 5, 6, 7, 8, 9, 10]}, {"id": "b", "prompt_ids": [2, 11, 12]}]
    runs = ReferenceRuns(CheckedEngine(ReferenceEngine(tiny_gguf), "reference"))
    figs = pair_checks(runs, "fast", tiny_gguf, prompts, lambda m: None, "tiny", options={"device": "cpu"})
    layers = [f for f in figs if f.gate == "reference~fast.layer_rel_l2"]
    assert [f.prompt for f in layers] == ["a", "b"]
    for f in layers:
        assert {layer for p, layer, _ in f.detail["per_point"] if p == "l_out"} == set(range(cfg.n_layer))
        assert f.measured == max(v for _, _, v in f.detail["per_point"])
    kld = [f for f in figs if f.gate == "reference~fast.mean_kld"]
    assert [f.detail["kld_hist"]["n"] for f in kld] == [7, 3]
    ids = list(range(2, 14))
    per_point: dict = {}
    plain = chunked_vs_oneshot(fm, ids)
    assert chunked_vs_oneshot(fm, ids, per_point=per_point) == plain  # tracing does not change the figures
    assert set(per_point) == {"chunk<window", "chunk=window", "chunk>window"}
    for rows_ in per_point.values():
        assert {layer for p, layer, _ in rows_ if p == "l_out"} == set(range(cfg.n_layer))


def test_gemma3_fast_comparison_carries_kld_hist(tiny_gguf):
    """The real-Gemma-3 reference~fast rows (harness.parity.checks.gemma3_real) carry a per-position KLD histogram;
    run here on the tiny model with a stand-in tokenizer."""
    from gemma4_harness.harness.parity.checks.gemma3_real import PROMPTS, _compare_fast
    from gemma4_harness.reference import load_model
    from gemma4_harness.reference.model import forward

    class Tok:
        def encode(self, text, add_bos=True):
            return [2, 5, 6]

        def decode(self, ids):
            return " ".join(map(str, ids))

    cfg, w = load_model(tiny_gguf)
    seqs = [[2, 5, 6, 7, 8 + i] for i in range(len(PROMPTS))]
    out = _compare_fast(cfg, w, seqs, [(forward(cfg, w, s), {}) for s in seqs], Tok())
    for item, seq in zip(out["prompts"], seqs):
        h = item["kld_hist"]
        assert h["n"] == len(seq) and h["below"] + sum(h["counts"]) == len(seq) and h["nonfinite"] == 0


def test_run_gemma3_passes_the_kld_hist_to_its_check(monkeypatch):
    import gemma4_harness.harness.parity.cases as cases

    hist = kld_histogram([1e-9, 2e-9, 0.0])
    fake = {"prompts": [], "transformers": {"available": False, "reason": "test"},
            "fast": {"prompts": [{"name": "p", "n_tokens": 3, "max_abs_logit_diff": 1e-5, "top1_agreement": 1.0,
                                  "kld_hist": hist}]}}
    monkeypatch.setattr(cases, "run_gemma3_real", lambda packed=True: fake)
    res = cases.gemma3_case(lambda msg: None)
    (chk,) = [c for c in res.checks if c["gate"] == "reference~fast.max_abs_logit"]
    assert chk["kld_hist"] == hist
    assert list(kld_hists({"cases": [res.__dict__]})) == [("reference~fast", "gemma3-270m-real")]


def test_junit_xml_one_testcase_per_check_failures_named():
    import xml.etree.ElementTree as ET

    from gemma4_harness.harness.parity.report import junit_xml

    failing = dict(_check(0.0, False), got="not_run", why="llamacpp: not installed")
    data = {"status": 1, "created_utc": "x", "cases": [
        {"case": "t", "kind": "tokenizer", "model": "m", "error": None, "info": {}, "seconds": 1.5,
         "checks": [failing, _check(0.0, False, info=True, reason="documented difference"), _check(1.0, True)]},
        {"case": "u", "kind": "user", "model": "m", "error": "x.gguf: truncated", "error_kind": "input",
         "info": {}, "checks": []}]}
    root = ET.fromstring(junit_xml(data).split("\n", 1)[1])
    assert root.get("tests") == "4" and root.get("failures") == "1" and root.get("errors") == "1"
    (fail,) = [tc for tc in root.iter("testcase") if tc.find("failure") is not None]
    assert fail.get("classname") == "t" and fail.get("name") == "tokenizer.check[p]"
    msg = fail.find("failure").get("message")
    assert "tokenizer.check = 0" in msg and ">= 1" in msg and "llamacpp: not installed" in msg
    (err,) = [tc for tc in root.iter("testcase") if tc.find("error") is not None]
    assert err.find("error").get("message") == "x.gguf: truncated"


# --------------------------------------------------------------------------- the terminal


def test_g4h_parity_prints_its_verdict_table_once(monkeypatch, tmp_path, capsys):
    """``g4h parity`` prints the verdict table and the explanation lines once (``execute`` prints nothing, ``run``
    prints them); the job itself is replaced by a fixed result, so only the printing is under test."""
    from gemma4_harness.harness.cli import build_parser
    from gemma4_harness.harness.cli import parity as cli_parity

    data = {"verdict": "FAIL", "run_dir": str(tmp_path), "cases": [{"case": "tiny-case", "error": None, "info": {},
            "checks": [_check(0.0, False) | {"explanation": {"line": "explained by spec variant X"}}]}]}
    monkeypatch.setattr(cli_parity, "run_parity", lambda **kw: (data, 1))
    args = build_parser("parity").parse_args(["parity", "--quiet", "--out", str(tmp_path)])
    assert cli_parity.execute(args) == (data, 1)
    assert capsys.readouterr().out == ""  # execute prints nothing (the pytest plugin runs through it)
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert out.count("tiny-case") == 2, out  # one table row, one explanation line
    assert sum("tokenizer.check" in ln and "FAIL" in ln for ln in out.splitlines()) == 1, out
    assert out.count("explained by spec variant X") == 1, out


def test_a_pass_whose_fault_figure_had_no_resolution_says_so():
    """A quantized server's ``agreeing_positions`` where int8 rounding flips are too dense to judge by positions is
    reported, not gated; the run may pass on its other gates, and its verdict line then names the figure that could
    not judge (a rows x1.02 fault on the real Gemma 3 270M Q4_K_M behind llama-server passed with "PASS: every gate
    passed" and nothing else on the line: the field table of issue 35)."""
    from gemma4_harness.harness.core.gates import DEFAULT_GATES
    from gemma4_harness.harness.parity.job import exit_status, verdict
    from gemma4_harness.harness.parity.result import CaseResult, fig

    res = CaseResult(case="m.gguf", kind="user", model="m.gguf")
    res.apply([fig("reference~openai.greedy", 1.0, None),
               fig("reference~openai_q8.agreeing_positions", float("nan"), None, informational_reason="too dense",
                   no_resolution="the greedy streams gate alone")], DEFAULT_GATES)
    assert exit_status([res]) == 0
    line = verdict([res], 0)
    assert line.startswith("PASS:") and "no resolution: m.gguf/reference~openai_q8.agreeing_positions" in line, line
    res = CaseResult(case="m.gguf", kind="user", model="m.gguf")
    res.apply([fig("reference~openai.greedy", 1.0, None)], DEFAULT_GATES)
    assert "no resolution" not in verdict([res], 0)
