"""The parity report's summary table: verdict rows per case and gate."""

from __future__ import annotations

from harness.parity_report import render_markdown, summarize


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
