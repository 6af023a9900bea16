"""The pytest plugin (``harness/pytest_plugin/``, entry point ``pytest11``), as an engine author's CI runs it:
``python -m pytest`` in a folder of their own, the plugin loaded from the installed package.

The items (one per engine pair of the job, and the reference's own cached-vs-uncached check) are known before any
engine runs: ``--collect-only`` lists them and starts no engine (a ``cmd:`` engine that leaves a marker file when
started); ``-k``, node ids and ``--lf`` select them, and the job runs once, at the first selected item, for the
selected pairs only; under ``-n 2`` it runs once. One run passes against the fast engine (items, an ordinary test
beside them, the ``g4h_parity`` fixture, the JUnit XML pytest writes); one fails against a ``cmd:`` engine with noise
in one layer's FFN (its item names each failing gate, the measured value and the first divergence, in the terminal
and in the JUnit XML); an engine that dies is a failing item naming the request and the step (exit 1); bad input
stops before collection with exit 2 and one line; without ``--g4h-model`` the plugin changes nothing, in a user's
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


def pytest_run(folder: Path, *args: str, timeout: int = 600, cache: bool = False,
               xdist: bool = False) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in ``folder`` (no cache folder written unless ``cache``; pytest-xdist off unless
    ``xdist``), as a user's CI would run it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "G4H_TEST"))}
    plugins = ([] if cache else ["-p", "no:cacheprovider"]) + ([] if xdist else ["-p", "no:xdist"])
    return subprocess.run([sys.executable, "-m", "pytest", *plugins, *args],
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


def marked_engine(folder: Path, *args: str) -> str:
    """``cmd:`` the stub engine, after appending a line to ``folder/started`` (the proof that it was started)."""
    script = folder / "marked_engine.py"
    script.write_text(f"import os, sys\nwith open({str(folder / 'started')!r}, 'a') as f:\n    f.write('x\\n')\n"
                      f"os.execv(sys.executable, [sys.executable, {str(STUB)!r}, *sys.argv[1:]])\n")
    return "cmd:" + shlex.join([sys.executable, str(script), *args])


def all_results(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / "reports").glob("*-parity/results.json"))]


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
    assert n_checks >= 10 and "5 passed" in out, out[-3000:]  # 2 items (the pair, cached~uncached) + 3 own tests
    cases = junit(user_repo / "junit.xml")
    ours = [c for c in cases if c.get("classname", "") == "m.gguf"]
    assert sorted(c.get("name") for c in ours) == ["reference.cached~uncached", "reference~fast"]
    assert not any(c.find("failure") is not None for c in cases)
    p = props(next(c for c in ours if c.get("name") == "reference~fast"))
    pair_checks = [c for case in data["cases"] for c in case["checks"] if c.get("against") == "fast"]
    assert p["case"] == "m.gguf" and p["pair"] == "reference~fast" and p["failed"] == "0"
    assert int(p["checks"]) == len(pair_checks) > 0 and p["report"].endswith("report.md")
    assert {c.get("name") for c in cases} >= {"test_my_own", "test_fixture_runs_the_command_line_job"}
    assert sorted(x.name for x in user_repo.iterdir()) == ["junit.xml", "m.gguf", "prompts.jsonl", "reports",
                                                           "test_mine.py"]


def test_a_perturbed_engine_fails_its_item_with_gate_value_and_first_divergence(user_repo):
    proc = pytest_run(user_repo, "--g4h-model", "m.gguf", "--g4h-against", engine("--perturb-layer", "1"),
                      "--g4h-prompts", "prompts.jsonl", "--junitxml", "junit.xml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    data = results(user_repo)
    failing = [c for case in data["cases"] for c in case["checks"] if not c["pass"]]
    assert failing and all(c["against"].startswith("cmd:") for c in failing)
    cases = junit(user_repo / "junit.xml")
    failed = {c.get("name"): c.find("failure") for c in cases if c.find("failure") is not None}
    assert list(failed) == ["reference~cmd"] and "1 failed, 1 passed" in out, out[-3000:]
    text = failed["reference~cmd"].get("message") + failed["reference~cmd"].text
    assert f"{len(failing)} of " in text and "gating checks failed" in text
    for c in failing:  # every failing check named, with its figure and its gate
        where = f"{c['gate']} on prompt {c['prompt']}" if c["prompt"] else c["gate"]
        assert f"{where}\n  measured {c['measured']:.6g}, gate <= {c['limit']:g}" in text, where
    assert "reference~cmd.layer_rel_l2 on prompt p9" in text
    assert "first divergence: ffn_out@1" in text  # the perturbed layer's FFN, the first point it moves
    assert "first divergence: ffn_out@1" in out and "FAILED m.gguf::reference~cmd" in out
    assert "Traceback" not in out


def test_an_engine_that_dies_is_a_failing_item_naming_request_and_step_exit_1(user_repo):
    proc = pytest_run(user_repo, "--g4h-model", "m.gguf", "--g4h-against",
                      engine("--fault", "die", "--fault-op", "any", "--fault-after", "2"),
                      "--g4h-prompts", "prompts.jsonl", "-rA")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    runs = next(c for case in results(user_repo)["cases"] for c in case["checks"]
                if c["gate"] == "reference~cmd.runs")
    assert runs["engine_failure"] and not runs["pass"]
    assert "FAILED m.gguf::reference~cmd" in out and "Traceback" not in out
    assert f"first divergence: {runs['first_divergence']}" in out and "ENGINE FAILED at request" in out
    assert runs["first_divergence"].startswith("request ")  # a logits request: it has no step


@pytest.mark.parametrize("bad", [("--g4h-prompts", "missing.jsonl"), ("--g4h-against", "nosuch"),
                                 ("--g4h-model", "missing.gguf")])
def test_bad_input_stops_before_collection_with_exit_2_and_one_line(user_repo, bad):
    given = ["--g4h-model", "m.gguf", "--g4h-against", "fast", "--g4h-prompts", "prompts.jsonl"]
    given[given.index(bad[0]) + 1] = bad[1]
    proc = pytest_run(user_repo, *given, "--collect-only")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    lines = [ln for ln in out.splitlines() if "g4h: error:" in ln]
    assert len(lines) == 1 and bad[1] in lines[0] and "Traceback" not in out, out[-3000:]
    assert not (user_repo / "reports").exists()


def test_collect_only_lists_the_items_and_starts_no_engine(user_repo):
    eng = marked_engine(user_repo, "--perturb-layer", "1")
    proc = pytest_run(user_repo, "--g4h-model", "m.gguf", "--g4h-against", f"fast,{eng},{eng}", "--g4h-prompts",
                      "prompts.jsonl", "--collect-only", "-q")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert [ln for ln in proc.stdout.splitlines() if "::" in ln] == [
        "m.gguf::reference~fast", "m.gguf::reference~cmd", "m.gguf::reference~cmd#2",
        "m.gguf::reference.cached~uncached"]
    assert not (user_repo / "started").exists() and not (user_repo / "reports").exists()


def test_k_node_ids_and_lf_select_items_and_the_job_runs_only_for_them(user_repo):
    """``-k fast``: the cmd engine is never started; a node id: that pair only; ``--lf``: the failing pair only."""
    eng = marked_engine(user_repo, "--perturb-layer", "1")
    opts = ["--g4h-model", "m.gguf", "--g4h-against", f"fast,{eng}", "--g4h-prompts", "prompts.jsonl"]
    proc = pytest_run(user_repo, *opts, "-k", "fast")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed, 2 deselected" in out, out[-3000:]
    (first,) = all_results(user_repo)
    assert first["cases"][0]["info"]["against"] == ["fast"] and not (user_repo / "started").exists()
    proc = pytest_run(user_repo, *opts, "m.gguf::reference~cmd", cache=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed in" in out and (user_repo / "started").exists(), out[-3000:]
    assert all_results(user_repo)[-1]["cases"][0]["info"]["against"] == [eng]
    proc = pytest_run(user_repo, *opts, cache=True)  # the whole job: reference~cmd fails, the rest pass
    assert proc.returncode == 1 and "1 failed, 2 passed" in proc.stdout, proc.stdout[-3000:]
    proc = pytest_run(user_repo, *opts, "--lf", cache=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "rerun previous 1 failure" in out and "1 failed in" in out, out[-3000:]
    assert "FAILED m.gguf::reference~cmd" in out
    runs = all_results(user_repo)
    assert len(runs) == 4 and runs[-1]["cases"][0]["info"]["against"] == [eng]


def test_under_xdist_the_job_runs_once_on_one_worker(user_repo):
    (user_repo / "test_mine.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    proc = pytest_run(user_repo, "-n", "2", "-v", "--g4h-model", "m.gguf", "--g4h-against", "fast", "--g4h-prompts",
                      "prompts.jsonl", xdist=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "4 passed" in out, out[-3000:]
    assert len(all_results(user_repo)) == 1  # one run directory: the job ran once
    workers = {ln.split()[0] for ln in out.splitlines() if ln.startswith("[gw") and "PASSED m.gguf::" in ln}
    assert len(workers) == 1, out[-3000:]  # both items on one worker


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
