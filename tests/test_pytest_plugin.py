"""The pytest plugin (``harness/pytest_plugin.py``, entry point ``pytest11``), as an engine author's CI runs it:
``python -m pytest`` in a folder of their own, the plugin loaded from the installed package.

One run passes against the fast engine (items, an ordinary test beside them, the ``g4h_parity`` fixture, the
JUnit XML pytest writes); one fails against a ``cmd:`` engine with noise in one layer's FFN (each failing item
names its gate, the measured value and the first divergence, in the terminal and in the JUnit XML); bad input
stops at collection with exit 2 and one line; without ``--g4h-model`` the plugin changes nothing, in a user's
suite and in this repository's own (the same items collected with and without it, and nothing heavy imported).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STUB = REPO / "tests" / "cmd_stub.py"


def pytest_run(folder: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in ``folder`` (no cache folder written), as a user's CI would run it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "G4H_TEST"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture()
def user_repo(tmp_path, tiny_gguf) -> Path:
    """An engine author's folder: the tiny gemma4 GGUF and a prompt set for its 32-token vocabulary."""
    repo = tmp_path / "engine"
    repo.mkdir()
    (repo / "m.gguf").write_bytes(tiny_gguf.read_bytes())
    (repo / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"p{n}", "prompt_ids": [2] + [(7 * k + n) % 31 + 1 for k in range(n)]}) + "\n"
        for n in (4, 9)))
    return repo


def engine(*args: str) -> str:
    return "cmd:" + shlex.join([sys.executable, str(STUB), *args])


def junit(path: Path) -> list[ET.Element]:
    return list(ET.parse(path).getroot().iter("testcase"))


def props(case: ET.Element) -> dict[str, str]:
    return {p.get("name"): p.get("value") for p in case.iter("property")}


def results(folder: Path) -> dict:
    (run,) = (folder / "reports").glob("*-parity/results.json")
    return json.loads(run.read_text())


def test_items_pass_against_fast_beside_the_users_own_tests_and_the_fixture(user_repo):
    (user_repo / "test_mine.py").write_text(f'''
import pytest

def test_my_own():
    assert 1 + 1 == 2

def test_fixture_runs_the_command_line_job(g4h_parity):
    run = g4h_parity()
    run.assert_passed()
    assert run.check("reference~fast.runs").passed

def test_fixture_runs_another_engine(g4h_parity):
    run = g4h_parity(model="m.gguf", against={engine("--perturb-layer", "1")!r}, prompts="prompts.jsonl")
    assert not run.passed and run.status == 1
    with pytest.raises(AssertionError, match="first divergence: ffn_out@1"):
        run.assert_passed()
''')
    proc = pytest_run(user_repo, "--g4h-model", "m.gguf", "--g4h-against", "fast", "--g4h-prompts", "prompts.jsonl",
                      "--junitxml", "junit.xml", "-rA")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    data = next(json.loads(p.read_text()) for p in sorted((user_repo / "reports").glob("*-parity/results.json"))
                if "reference~fast.runs" in p.read_text())
    n_checks = sum(len(c["checks"]) for c in data["cases"])
    assert n_checks >= 10 and f"{n_checks + 3} passed" in out, out[-3000:]
    cases = junit(user_repo / "junit.xml")
    ours = [c for c in cases if c.get("classname", "").startswith("g4h")]
    assert len(ours) == n_checks and not any(c.find("failure") is not None for c in cases)
    logit = next(c for c in ours if c.get("name") == "reference~fast.max_abs_logit[p9]")
    p = props(logit)
    assert p["gate"] == "reference~fast.max_abs_logit" and p["op"] == "le" and float(p["limit"]) == 1e-3
    assert float(p["measured"]) <= 1e-3 and p["report"].endswith("report.md")
    assert {c.get("name") for c in cases} >= {"test_my_own", "test_fixture_runs_the_command_line_job"}
    assert sorted(x.name for x in user_repo.iterdir()) == ["junit.xml", "m.gguf", "prompts.jsonl", "reports",
                                                           "test_mine.py"]


def test_a_perturbed_engine_fails_each_check_with_gate_value_and_first_divergence(user_repo):
    proc = pytest_run(user_repo, "--g4h-model", "m.gguf", "--g4h-against", engine("--perturb-layer", "1"),
                      "--g4h-prompts", "prompts.jsonl", "--junitxml", "junit.xml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    data = results(user_repo)
    failing = [c for case in data["cases"] for c in case["checks"] if not c["pass"]]
    cases = junit(user_repo / "junit.xml")
    failed = {c.get("name"): c.find("failure") for c in cases if c.find("failure") is not None}
    assert len(failed) == len(failing) > 0
    assert f"{len(failing)} failed" in out
    layer = failed["reference~cmd.layer_rel_l2[p9]"].get("message")
    check = next(c for c in failing if c["gate"] == "reference~cmd.layer_rel_l2" and c["prompt"] == "p9")
    assert "reference~cmd.layer_rel_l2 on prompt p9" in layer and f"gate <= {check['limit']:g}" in layer
    assert "first divergence: ffn_out@1" in layer  # the perturbed layer's FFN, the first point it moves
    assert "first divergence: ffn_out@1" in out and "FAIL:" in out
    logits = failed["reference~cmd.max_abs_logit[p9]"].get("message")
    check = next(c for c in failing if c["gate"] == "reference~cmd.max_abs_logit" and c["prompt"] == "p9")
    assert f"measured {check['measured']:.6g}, gate <= {check['limit']:g}" in logits
    runs = next(c for c in cases if c.get("name") == "reference~cmd.runs")
    assert runs.find("failure") is None


def test_bad_input_stops_at_collection_with_exit_2_and_one_line(user_repo):
    proc = pytest_run(user_repo, "--g4h-model", "m.gguf", "--g4h-against", "fast", "--g4h-prompts", "missing.jsonl")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "ERROR collecting g4h" in out and "missing.jsonl" in out and "Traceback" not in out
    assert not (user_repo / "reports").exists()


def test_without_g4h_model_nothing_changes(tmp_path):
    """No item, no report, no heavy import; this repository's own collection is the same with the plugin off."""
    (tmp_path / "test_x.py").write_text("import sys\n\ndef test_a():\n    assert 'torch' not in sys.modules\n")
    proc = pytest_run(tmp_path, "-q")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["test_x.py"]
    helped = pytest_run(tmp_path, "--help")
    assert "--g4h-model" in helped.stdout and "--g4h-against" in helped.stdout
    on = pytest_run(REPO, "--collect-only", "-q", "tests/test_layers.py")
    off = pytest_run(REPO, "--collect-only", "-q", "-p", "no:g4h", "tests/test_layers.py")
    assert on.returncode == off.returncode == 0, on.stdout[-2000:] + off.stdout[-2000:]
    items = [ln for ln in on.stdout.splitlines() if "::" in ln]
    assert items and items == [ln for ln in off.stdout.splitlines() if "::" in ln]
