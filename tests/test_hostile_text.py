"""Issue 37, item 3: text from an engine is escaped for where it goes. An engine whose error line carries XML (a
CDATA end, tags), Markdown (pipes, backticks, HTML, links), terminal escape and control sequences and lone
surrogates (tests/hostile_engine.py): no traceback, exit 1, the JUnit XML parses with a strict parser, the
Markdown report renders the text as text, results.json is UTF-8 JSON, and the terminal gets no escape sequence."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import xml.parsers.expat
from pathlib import Path

import pytest

from gemma4_harness.harness.core.text import for_json, for_markdown, for_markdown_code, for_terminal, for_xml, visible

ENGINE = Path(__file__).resolve().parent / "hostile_engine.py"
sys.path.insert(0, str(ENGINE.parent))
from hostile_engine import NASTY

#: What must never reach a terminal or a file raw: C0/C1 controls but \n and \t, lone surrogates, bidi overrides.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069\ufffe\uffff]")


def _strict_xml(text: str) -> None:
    """Parse with expat, which refuses what XML 1.0 cannot hold (no recovery)."""
    p = xml.parsers.expat.ParserCreate()
    p.Parse(text.encode("utf-8"), True)


def test_each_destination_function():
    for f in (for_terminal, for_xml, visible):
        out = f(NASTY)
        assert not RAW.search(out) and "\\x1b[31m" in out and "\\ud800" in out
        out.encode("utf-8")
    md = for_markdown(NASTY)
    assert not RAW.search(md) and "\n" not in md
    assert "<script" not in md and "&lt;script" in md and "\\|" in md and "\\`" in md and "[l\\](" in md
    assert for_markdown("limit <= 0.5 & a_b") == "limit <= 0.5 & a_b"  # the harness's own text is unchanged
    assert for_markdown_code("len1-bos") == "`len1-bos`" and for_markdown_code("a`b") == "a\\`b"
    el = ET.Element("a", b=for_xml(NASTY))
    el.text = for_xml(NASTY)
    _strict_xml(ET.tostring(el, encoding="unicode"))
    with pytest.raises(ValueError):  # without it: what the issue saw (no JUnit at all)
        el.text = NASTY
        _strict_xml(ET.tostring(el, encoding="unicode"))
    j = for_json({"k\ud800": [NASTY, 1.5, None]})
    json.dumps(j, ensure_ascii=False).encode("utf-8")
    assert for_json({"a": ["plain"]}) == {"a": ["plain"]}


def test_an_engine_with_hostile_error_text(tiny_gguf, tmp_path):
    junit = tmp_path / "junit.xml"
    out = tmp_path / "runs"
    spec = f"cmd:{sys.executable} {ENGINE}"
    p = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "parity", "--model", str(tiny_gguf), "--against", spec,
                        "--out", str(out), "--junit", str(junit)], capture_output=True, timeout=300, check=False,
                       cwd=str(ENGINE.parents[1]))
    stdout, stderr = p.stdout.decode("utf-8"), p.stderr.decode("utf-8")  # strict: the terminal gets UTF-8
    assert p.returncode == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert not RAW.search(stdout) and not RAW.search(stderr), "a control sequence reached the terminal"
    verdict = stdout.strip().splitlines()[-1]
    assert verdict.startswith("ENGINE FAILED: ") and "\\x1b[31mRED" in verdict and "\\ud800" in verdict, verdict
    text = junit.read_text(encoding="utf-8")
    _strict_xml(text)
    assert "\\x1b[31mRED" in text and "&lt;/failure&gt;]]&gt;" in text
    (run,) = out.glob("*-parity*")
    results = json.loads((run / "results.json").read_bytes().decode("utf-8"))
    assert "\\ud800" in json.dumps(results, ensure_ascii=False)
    report = (run / "report.md").read_text(encoding="utf-8")
    assert not RAW.search(report)
    assert "<script>" not in report and "</failure>" not in report
    assert not re.search(r"(?<!\\)\]\(javascript", report)  # no link: the brackets are escaped
    assert "&lt;script>alert(1)&lt;/script>" in report and "\\`code\\`" in report
    head = report.splitlines()[2]
    assert head.startswith("**ENGINE FAILED") and head.count("**") == 2, head  # no emphasis opened by the engine


@pytest.mark.parametrize("text", ["`a|b`", "x\ud800y", "\x1b]8;;http://x\x07link\x1b]8;;\x07", "]]>", "\x00"])
def test_markdown_table_cell_keeps_the_table(text):
    from gemma4_harness.harness.parity.report import _table
    table = _table([{"a": text, "b": "z"}], ["a", "b"])
    lines = table.strip().splitlines()
    assert len(lines) == 3 and not RAW.search(table)
    assert len(re.findall(r"(?<!\\)\|", lines[2])) == 3, lines[2]  # the row still has its two cells
