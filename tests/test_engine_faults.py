"""Fault attribution (issue 23): an engine that is wrong is exit 1, headed "ENGINE FAILED", naming the request, the
step and the engine's own last error line; input that cannot be used is exit 2 ("BAD INPUT"); a gate that measured
nothing says so; every documented prompt-file form gets its report when the run fails.

The faulty engines wrap real ones: ``cmd:`` engines are tests/cmd_stub.py (the float64 reference behind the
subprocess protocol, one ``--fault`` per fault), servers are the fault-injecting proxy of tests/servers.py
(``FaultStub``, one mode per fault) in front of a real ``llama-server`` from the cached llama.cpp build.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from servers import FaultStub, free_port

from gemma4_harness.harness.cli import main
from gemma4_harness.harness.core.gates import resolve
from gemma4_harness.harness.parity.compare import generation_figures
from gemma4_harness.harness.parity.report import render_markdown, summarize
from gemma4_harness.harness.parity.result import CaseResult
from gemma4_harness.reference.errors import InputError

STUB = Path(__file__).resolve().parent / "cmd_stub.py"


def stub(*args: str) -> str:
    return "cmd:" + shlex.join([sys.executable, str(STUB), *args])


def parity(tmp_path: Path, capsys, *args: str) -> tuple[int, str, dict, str]:
    """``g4h parity ARGS --out <fresh folder> --quiet``: exit status, the verdict line it printed, results.json,
    report.md."""
    out = tmp_path / f"runs{len(list(tmp_path.glob('runs*')))}"
    capsys.readouterr()
    rc = main(["parity", *args, "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out.strip().splitlines()
    (run,) = out.glob("*-parity*")
    return rc, printed[-1], json.loads((run / "results.json").read_text()), (run / "report.md").read_text()


def first_divergence(report: str) -> list[str]:
    """The lines of the report's "First divergence" section."""
    part = report.split("## First divergence\n", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in part.splitlines() if ln.strip()]


def assert_engine_failure(rc: int, printed: str, report: str, case: str, pair: str, request: str,
                          step: int | None) -> str:
    """Exit 1, the verdict and the report headed ENGINE FAILED at the request (and step), no "prompt None" and no
    invented "first diverging point: logits". Returns the first-divergence line."""
    where = f"request {request}" + (f" step {step}" if step is not None else "")
    assert rc == 1, printed
    assert printed.startswith(f"ENGINE FAILED: {case}/{pair} at {where}: ") and printed.endswith("(exit 1)"), printed
    assert report.startswith(f"# Parity report\n\n**ENGINE FAILED: {case}/{pair} at {where}: "), report[:400]
    lines = first_divergence(report)
    head = f"- **{case}** `{pair}`: ENGINE FAILED at request `{request}`" + (f", step {step}: " if step is not None
                                                                            else ": ")
    assert lines and lines[0].startswith(head), lines
    assert "prompt `None`" not in report and "prompt None" not in report
    assert "first diverging point: logits" not in "\n".join(lines)
    return lines[0]


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    """Three prompts for the tiny model (vocabulary 32, context 64)."""
    rows = [{"id": "t3", "prompt_ids": [2, 7, 9]}, {"id": "t5", "prompt_ids": [2, 11, 4, 30, 5]},
            {"id": "t9", "prompt_ids": [2, 3, 17, 8, 21, 6, 12, 29, 10]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- cmd: engines


def test_cmd_engine_that_samples(tiny_gguf, prompts_file, tmp_path, capsys):
    """It decodes by sampling (its tokens drawn from its own distribution, its reported top log-probs honest): its
    first token that is not its own top-1 is named, judged by the pair as a server's stream is (not greedy, and what
    differs in decoding where its log-probs are the reference's)."""
    rc, printed, data, report = parity(tmp_path, capsys, "--model", str(tiny_gguf), "--against",
                                       stub("--fault", "sample", "--fault-op", "generate"),
                                       "--prompts", str(prompts_file))
    runs = next(c for c in data["cases"][0]["checks"] if c["gate"] == "reference~cmd.runs")
    line = assert_engine_failure(rc, printed, report, "tiny.gguf", "reference~cmd", runs["request"], runs["step"])
    assert runs["request"] in ("t3", "t5", "t9") and isinstance(runs["step"], int)
    assert "is not the top-1 of its own log-probs" in line and "not greedy decoding (temperature 0)" in line


def test_cmd_engine_that_crashes_after_n_requests(tiny_gguf, prompts_file, tmp_path, capsys):
    """It answers ``hello`` and two requests (the logits and the trace of t3), then dies on the logits of t5: the
    request, and its own last stderr line."""
    rc, printed, data, report = parity(tmp_path, capsys, "--model", str(tiny_gguf), "--against",
                                       stub("--fault", "die", "--fault-op", "any", "--fault-after", "2"),
                                       "--prompts", str(prompts_file))
    line = assert_engine_failure(rc, printed, report, "tiny.gguf", "reference~cmd", "t5", None)
    assert "logits (request 3): the engine exited (exit status 3) before answering" in line
    assert "stub: fatal: simulated crash in logits" in line
    runs = next(c for c in data["cases"][0]["checks"] if c["gate"] == "reference~cmd.runs")
    assert runs["last_error"] == "stub: fatal: simulated crash in logits"
    # what it measured before it died is kept: t3's logits
    assert [c["prompt"] for c in data["cases"][0]["checks"] if c["gate"] == "reference~cmd.max_abs_logit"] == ["t3"]


def test_cmd_engine_that_drops_a_token(tiny_gguf, prompts_file, tmp_path, capsys):
    """It leaves the token at step 2 out of each stream: a protocol break (one token short), named at the step where
    its stream parts from the reference's."""
    rc, printed, data, report = parity(tmp_path, capsys, "--model", str(tiny_gguf), "--against",
                                       stub("--fault", "drop", "--fault-op", "generate"),
                                       "--prompts", str(prompts_file))
    runs = next(c for c in data["cases"][0]["checks"] if c["gate"] == "reference~cmd.runs")
    line = assert_engine_failure(rc, printed, report, "tiny.gguf", "reference~cmd", "t3", runs["step"])
    assert "results[0]: 7 tokens and 7 top_logprobs steps, expected 8 of each" in line
    assert re.search(r"its tokens (part from the reference's at step \d|agree with the reference's up to step 7)",
                     line), line
    assert 2 <= runs["step"] <= 7


def test_cmd_engine_that_cannot_start_is_bad_input(tiny_gguf, prompts_file, tmp_path, capsys):
    rc, printed, data, _ = parity(tmp_path, capsys, "--model", str(tiny_gguf), "--against", "cmd:./no-such-engine",
                                  "--prompts", str(prompts_file))
    assert rc == 2 and printed.startswith("BAD INPUT: tiny.gguf/reference~cmd: cmd:./no-such-engine: cannot start")


# --------------------------------------------------------------------------- servers: a proxy in front of llama-server

#: The server checks a fault run needs none of (the faults show in the pair's greedy streams).
ONLY_PAIR = ["--skip", "server-batch", "--skip", "server-stream", "--skip", "server-stop", "--skip", "server-template"]


def two_prompts(tmp_path: Path) -> list[str]:
    f = tmp_path / "two.jsonl"
    f.write_text('{"id": "a", "prompt_ids": [2, 5, 6, 7]}\n{"id": "b", "prompt_ids": [2, 9, 10]}\n')
    return ["--prompts", str(f)]


@pytest.mark.parametrize("mode, request_, step, says", [
    ("sample", None, None, "is not the top-1 of its own log-probs"),
    ("crash", None, 0, "the server stopped answering"),
    ("drop", None, None, "tokens where 8 were asked (finish_reason 'length', not a stop)"),
])
def test_server_faults_are_engine_failures(llama_server, synth_gguf, tmp_path, capsys, mode, request_, step, says):
    """A server that samples (temperature 1 sent on), one that dies after serving one completion, one that drops the
    token at step 2 of every answer: exit 1, ENGINE FAILED at the request and step."""
    with FaultStub(mode, upstream=llama_server.url, after=1) as proxy:
        rc, printed, data, report = parity(tmp_path, capsys, "--model", str(synth_gguf), "--against",
                                           f"openai:{proxy.url}/v1", *two_prompts(tmp_path), *ONLY_PAIR)
    assert proxy.altered, "the proxy injected nothing"
    runs = next(c for c in data["cases"][0]["checks"] if c["gate"] == "reference~openai.runs")
    request_ = request_ or runs["request"]
    step = runs["step"] if step is None else step
    assert request_ in ("a", "b") and isinstance(step, int)
    line = assert_engine_failure(rc, printed, report, synth_gguf.name, "reference~openai", request_, step)
    assert says in line
    if mode == "drop":
        assert step >= 2


def test_sampling_server_fails_g4h_generate(llama_server, synth_gguf, tmp_path, capsys):
    """Outside parity too: ``g4h generate`` against a server that samples is an engine failure, one line, exit 1."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [2, 5, 6, 7]}\n')
    with FaultStub("sample", upstream=llama_server.url) as proxy:
        capsys.readouterr()
        rc = main(["generate", "--model", str(synth_gguf), "--engine", f"openai:{proxy.url}/v1", "--prompts",
                   str(prompts), "--max-new-tokens", "8", "--out", str(tmp_path / "g.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("g4h: engine failed: ") and "step" in err[0], err


def test_dead_url_is_bad_input(tiny_gguf, prompts_file, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc, printed, data, report = parity(tmp_path, capsys, "--model", str(tiny_gguf), "--against",
                                       f"openai:{url}/v1", "--prompts", str(prompts_file))
    assert rc == 2 and printed.startswith(f"BAD INPUT: tiny.gguf/reference~openai: {url}/props: server down "
                                          "(connection refused)"), printed
    assert "ENGINE FAILED" not in report


# --------------------------------------------------------------------------- every prompt-file form, failing


#: Every prompt-file form README.md and docs document for ``g4h parity --model M --prompts FILE``
#: (harness/core/prompts.py load_prompts), as lines of a JSONL file.
PROMPT_FORMS = {
    "text-no-id": ['{"text": "Hello world"}', '{"text": "The cat sat"}'],
    "text-string-id": ['{"id": "greeting", "text": "Hello world"}'],
    "ids-no-id": ['{"prompt_ids": [2, 5, 6, 7]}', '{"prompt_ids": [2, 9, 10]}'],
    "ids-int-id": ['{"id": 7, "prompt_ids": [2, 5, 6, 7]}', '{"id": 0, "prompt_ids": [2, 9, 10]}'],
    "ids-string-id-note": ['{"id": "with note", "prompt_ids": [2, 5, 6, 7], "note": "cases/prompts form"}'],
    "mixed-blank-lines": ['{"text": "Hello world"}', "", '{"id": "b\\nc", "prompt_ids": [2, 9, 10]}',
                          '{"id": 3, "text": "The cat"}'],
}


def _forms_file(tmp_path: Path, name: str) -> Path:
    f = tmp_path / f"{name}.jsonl"
    f.write_text("\n".join(PROMPT_FORMS[name]) + "\n")
    return f


@pytest.mark.parametrize("form", sorted(PROMPT_FORMS))
def test_every_prompt_file_form_gets_a_report_when_the_run_fails(synth_gguf, tmp_path, capsys, form):
    """Each form through a run whose every figure fails (an engine with noise on layer 1) and, for the first form
    whose ids are all line numbers, through a run whose engine crashes after two requests: a report, no crash,
    every request named."""
    f = _forms_file(tmp_path, form)
    rc, printed, data, report = parity(tmp_path, capsys, "--model", str(synth_gguf), "--against",
                                       stub("--perturb-layer", "1"), "--prompts", str(f))
    assert rc == 1 and printed.startswith("FAIL: "), printed
    ids = {str(c["prompt"]) for c in data["cases"][0]["checks"] if c["gate"] == "reference~cmd.max_abs_logit"}
    assert len(ids) == sum(1 for ln in PROMPT_FORMS[form] if ln.strip())
    for pid in ids:
        assert pid.replace("\n", "\\n") in report
    if form == "text-no-id":  # the reported crash: ids are ints, and a row errs
        rc, printed, data, report = parity(tmp_path, capsys, "--model", str(synth_gguf), "--against",
                                           stub("--fault", "die", "--fault-op", "any", "--fault-after", "2"),
                                           "--prompts", str(f))
        assert_engine_failure(rc, printed, report, synth_gguf.name, "reference~cmd", "2", None)


def test_report_writer_takes_every_id_type(tmp_path):
    """The report of a failing and an erring check whose ids are ints (0 included), strings with newlines and
    line numbers renders (the crash of issue 23: ``int.replace``)."""
    checks = []
    for pid in (1, 0, "a\nb", "x"):
        checks.append({"gate": "reference~cmd.max_abs_logit", "prompt": pid, "measured": 1.0, "limit": 0.02,
                       "op": "le", "pass": False, "max_abs_logit_at": [3, 17]})
    checks.append({"gate": "reference~cmd.runs", "prompt": None, "measured": 0.0, "limit": 1.0, "op": "ge",
                   "pass": False, "engine_failure": True, "request": 0, "step": 2, "got": "boom",
                   "first_divergence": "request 0 step 2", "last_error": "fatal: boom"})
    data = {"created_utc": "now", "status": 1, "verdict": "ENGINE FAILED: m/reference~cmd at request 0 step 2: boom",
            "cases": [{"case": "m", "kind": "user", "model": "m", "error": None, "checks": checks}]}
    text = render_markdown(data)
    assert "- **m** `reference~cmd`: ENGINE FAILED at request `0`, step 2: boom; the engine's last error line: " \
           "`fatal: boom`" in text
    assert "a\\nb" in text
    rows = {(r["gate"], r["result"]): r for r in summarize(data)}
    assert rows[("reference~cmd.max_abs_logit", "FAIL")]["note"].startswith("0/4 within; worst at request 1 "
                                                                            "position 3 token 17")
    assert rows[("reference~cmd.runs", "ENGINE FAILED")]["worst"] == ""


# --------------------------------------------------------------------------- a gate that measured nothing


def test_a_gate_that_measured_nothing_is_not_a_pass():
    """Streams that part at step 0 leave the log-prob gate nothing to compare: NOT MEASURED (NaN, not gating), never
    ``0 <= 0.02 PASS``; the greedy figure still judges the parting."""
    top = [[(1, -0.5), (2, -0.6)], [(3, -0.1)]]
    ours = {"r": {"tokens": [2, 3], "top": [[2, 1], [3]], "logprobs": [{2: -0.5, 1: -0.6}, {3: -0.1}]}}
    oracle = {"r": {"tokens": [1, 3], "top": [[i for i, _ in s] for s in top], "logprobs": [dict(s) for s in top]}}
    figs = generation_figures(ours, oracle, "reference~cmd", 5, logprob_limit=0.02)
    assert figs[1].detail["not_measured"] == "the greedy streams part at step 0" and figs[1].detail["steps"] == 0
    res = CaseResult("m", "user", "m")
    res.apply(figs, resolve(None, "m"))
    lp = res.checks[1]
    assert np.isnan(lp["measured"]) and not lp["pass"] and lp["informational"]
    assert lp["reason"] == "not measured: the greedy streams part at step 0"
    data = {"created_utc": "now", "status": 0,
            "cases": [{"case": "m", "kind": "user", "model": "m", "error": None, "checks": res.checks}]}
    row = next(r for r in summarize(data) if r["gate"] == "reference~cmd.max_abs_logprob")
    assert row["result"] == "NOT MEASURED" and row["worst"] == "" and "step 0" in row["note"]
    assert "PASS" not in [r["result"] for r in summarize(data) if r["gate"] == "reference~cmd.max_abs_logprob"]
    # one step compared: measured as before
    ours["r"]["tokens"], ours["r"]["logprobs"] = [1, 3], [{1: -0.5, 2: -0.6}, {3: -0.1}]
    figs = generation_figures(ours, oracle, "reference~cmd", 5, logprob_limit=0.02)
    assert "not_measured" not in figs[1].detail and figs[1].detail["steps"] == 2


def test_a_token_the_server_cannot_name_is_an_engine_failure():
    """llama-cpp-python names tokens by their text; a byte token's text is ``''`` (what a sampling server landed on
    in the field). The client cannot say which token that was: an engine failure naming the step, not bad input."""
    from gemma4_harness.harness.engines.openai import LlamaCppPython, OpenAIEngine, ServerFailure

    lcp = LlamaCppPython(object.__new__(OpenAIEngine))  # the two tokenizer calls answered as llama-cpp-python does
    lcp.tokenize = lambda text, add_special=True: {"The": [651], "": []}.get(text, [651, 7])
    lcp.detokenize = lambda ids: {651: "The"}.get(ids[0], "?")
    with pytest.raises(ServerFailure, match=r"names step 1's token only by the text '', which is no single token") \
            as ei:
        lcp.ids("http://x/v1/completions", ["The", ""])
    assert ei.value.step == 1 and not isinstance(ei.value, InputError)


def test_requests_in_flight_wait_for_the_whole_table_of_token_texts(monkeypatch):
    """llama-cpp-python's text -> id table read from the model file (for texts its tokenizer does not produce alone) is
    built once, for every request in flight: one that asks while another builds it gets the whole table, not an
    empty one that names a token of the model "no single token" (an engine failure on a correct server)."""
    import concurrent.futures as cf
    import threading
    import time
    from types import SimpleNamespace

    from gemma4_harness.harness.engines.openai import LlamaCppPython, OpenAIEngine
    from gemma4_harness.harness.engines.openai import llama_cpp_python
    from gemma4_harness.reference.tokenizer import CONTROL, NORMAL

    reading = threading.Event()

    def slow_vocabulary(path):  # a GGUF's vocabulary takes a while to read
        reading.set()
        time.sleep(0.5)
        return SimpleNamespace(tokens=["<pad>", "\u2581t495"], types=[CONTROL, NORMAL])

    monkeypatch.setattr(llama_cpp_python, "tokenizer_from_gguf", slow_vocabulary)
    eng = object.__new__(OpenAIEngine)
    eng.path = "model.gguf"
    lcp = LlamaCppPython(eng)  # its tokenizer spells " t495" with two tokens; its detokenizer names token 1 so
    lcp.tokenize = lambda text, add_special=True: [7, 8]
    lcp.detokenize = lambda ids: {1: " t495"}.get(ids[0], "?")
    with cf.ThreadPoolExecutor(2) as ex:
        first = ex.submit(lcp.id_of, " t495")
        assert reading.wait(10)
        second = ex.submit(lcp.id_of, " t495")
        assert (first.result(), second.result()) == (1, 1)


def test_text_prompts_without_ids_against_a_failing_server(llama_server, synth_gguf, tmp_path, capsys):
    """The setup of issue 23's crash: ``--against openai:URL --prompts P`` whose lines are ``{"text"}`` without
    ``"id"``, and a server that fails: a report naming the request by its line number, no crash."""
    f = _forms_file(tmp_path, "text-no-id")
    with FaultStub("drop", upstream=llama_server.url, step=0) as proxy:
        rc, printed, data, report = parity(tmp_path, capsys, "--model", str(synth_gguf), "--against",
                                           f"openai:{proxy.url}/v1", "--prompts", str(f), *ONLY_PAIR)
    runs = next(c for c in data["cases"][0]["checks"] if c["gate"] == "reference~openai.runs")
    assert runs["request"] == 1
    assert_engine_failure(rc, printed, report, synth_gguf.name, "reference~openai", "1", runs["step"])


@pytest.mark.parametrize("line, why", [
    ('{"id": null, "text": "a"}', '"id": expected a non-empty string or an integer, got null'),
    ('{"id": 1.5, "prompt_ids": [2]}', '"id": expected a non-empty string or an integer, got 1.5'),
    ('{"id": ["a"], "prompt_ids": [2]}', '"id": expected a non-empty string or an integer, got ["a"]'),
    ('{"id": true, "prompt_ids": [2]}', '"id": expected a non-empty string or an integer, got true'),
])
def test_a_prompt_id_of_another_type_is_bad_input(tmp_path, line, why):
    """Ids name requests in reports and key results: a string or an integer, one line naming the file and line
    otherwise (an unhashable id used to crash the reader); ``1`` and ``"1"`` are one id."""
    from gemma4_harness.harness.core.prompts import load_prompts
    from gemma4_harness.reference.errors import PromptError

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_ids": [2, 5]}\n' + line + "\n")
    for ids_only in (False, True):
        if ids_only and '"text"' in line:
            continue
        with pytest.raises(PromptError) as ei:
            load_prompts(f, ids_only=ids_only)
        assert str(ei.value) == f"{f}:2: {why}"
    f.write_text('{"prompt_ids": [2, 5]}\n{"id": "1", "prompt_ids": [2, 6]}\n')  # line 1's id is 1
    with pytest.raises(PromptError, match=r":2: duplicate id '1'"):
        load_prompts(f)
