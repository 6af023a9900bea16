"""``openai:URL`` as an engine name, and ``g4h parity --against openai:URL``: the pair ``reference~openai``
(harness/parity/checks/pair.py) and the server checks (harness/parity/checks/server.py).

Against real servers: ``llama-server --parallel 4`` from the cached llama.cpp build (tests/servers.py), on the
synthetic ``31b`` GGUF (with and without the Gemma 4 chat template) and on ``e2b`` (whose continuations reach EOS).
The fault stub (tests/servers.py ``FaultStub``) appears only where a fault is injected: a server that is down,
slow, answers 500 or malformed JSON, or a proxy in front of the real llama-server that perturbs its log-probs,
swaps one token, or never stops at EOS.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from servers import FaultStub, free_port, running_llama_server

from gemma4_harness.harness.cli import main
from gemma4_harness.harness.core.cases import MODELS_DIR
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.engines import EngineUnavailable, check_engine_name, engine_class, engine_kind, make_engine
from gemma4_harness.harness.engines.openai import DOWN_HINT, OpenAIEngine, ServerError
from gemma4_harness.harness.parity.checks.server import ServerOptions
from gemma4_harness.harness.parity.checks.server_prompt import CHAT_CASES, template_figures
from gemma4_harness.harness.tokenizer.prompt_ids import model_tokenizer
from gemma4_harness.reference.errors import InputError, PromptError

#: The checks a broken-server run keeps (the others opted out, to keep those runs short).
ONLY_GREEDY = ["--skip", "server-batch", "--skip", "server-stream", "--skip", "server-stop", "--skip",
               "server-template"]


def parity(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    """``g4h parity ARGS --out tmp_path --quiet``: exit status, results.json, report.md."""
    out = tmp_path / f"runs{len(list(tmp_path.glob('runs*')))}"  # one folder per run: two runs in one second
    rc = main(["parity", *args, "--out", str(out), "--quiet"])  # would otherwise be NAME and NAME-2
    (run,) = out.glob("*-parity*")
    return rc, json.loads((run / "results.json").read_text()), (run / "report.md").read_text()


def checks(data: dict, case: int = 0) -> dict[str, dict]:
    return {c["gate"]: c for c in data["cases"][case]["checks"]}


def failing(data: dict) -> list[str]:
    return [c["gate"] for case in data["cases"] for c in case["checks"] if not c["pass"] and not c.get("informational")]


def two_prompts(tmp_path: Path) -> list[str]:
    """``--prompts`` with two short prompts: a fault run needs no more (it keeps the reference's own checks short)."""
    f = tmp_path / "two.jsonl"
    f.write_text('{"id": "a", "prompt_ids": [2, 5, 6, 7]}\n{"id": "b", "prompt_ids": [2, 9, 10]}\n')
    return ["--prompts", str(f)]


def prompt_id_of(ids: list[int]) -> str:
    return next(str(p["id"]) for p in load_prompts() if p["prompt_ids"] == ids)


# --------------------------------------------------------------------------- the engine name, the prompt file


def test_openai_is_an_engine_name():
    check_engine_name("openai:http://127.0.0.1:8080/v1")
    for bad in ("openai", "vllm:http://x", "openai: "):
        with pytest.raises(EngineUnavailable):
            check_engine_name(bad)
    assert engine_class("openai:http://127.0.0.1:1/v1") is OpenAIEngine
    assert engine_kind("openai:http://127.0.0.1:1/v1") == "openai"


def test_engine_name_with_a_server_down(synth_gguf):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError) as ei:
        make_engine(f"openai:{url}/v1", synth_gguf, server_timeout=5.0)
    assert str(ei.value) == f"{url}/props: server down (connection refused): {DOWN_HINT}"


def test_server_prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "Hello"}\n\n{"id": "b", "prompt_ids": [2, 5]}\n')
    assert load_prompts(f) == [{"id": 1, "text": "Hello", "note": "", "where": f"{f}:1"},
                               {"id": "b", "prompt_ids": [2, 5], "note": "", "where": f"{f}:3"}]
    for bad, why in (('{"text": ""}', "expected"), ('{"text": "a", "prompt_ids": [2]}', "one of them"),
                     ('{"prompt_ids": [2, true]}', "expected"), ("[1]", "expected"), ("{", "not valid JSON")):
        f.write_text(bad + "\n")
        with pytest.raises(PromptError, match=why) as ei:
            load_prompts(f)
        assert str(ei.value).startswith(f"{f}:1: ")
    with pytest.raises(InputError, match="--concurrency 0: expected >= 1"):
        ServerOptions(concurrency=0).check()


# --------------------------------------------------------------------------- a failing server: exit 2, the run goes on


def test_server_down_is_exit_2_and_the_run_goes_on(synth_gguf, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    other = tmp_path / "other.gguf"
    shutil.copy(synth_gguf, other)
    rc, data, report = parity(tmp_path, "--model", str(synth_gguf), "--model", str(other), "--against",
                              f"openai:{url}/v1", *two_prompts(tmp_path))
    assert rc == 2 and [c["case"] for c in data["cases"]] == [synth_gguf.name, "other.gguf"]
    for case in data["cases"]:  # both cases ran, the server pair of each failing in the one line naming the URL
        runs = checks(data, data["cases"].index(case))["reference~openai.runs"]
        assert runs["got"] == f"{url}/props: server down (connection refused): {DOWN_HINT}" and runs["bad_input"]
    assert f"{url}/props: server down" in report and "BAD INPUT" in data["verdict"]


@pytest.mark.slow
def test_server_in_a_comma_list_with_another_engine(synth_gguf, tmp_path):
    """``--against reference,openai:URL``: each engine is its own pair; the server being down fails only its pair
    (one line, exit 2), and the other pair still runs and passes."""
    url = f"http://127.0.0.1:{free_port()}"
    rc, data, _ = parity(tmp_path, "--model", str(synth_gguf), "--against", f"reference,openai:{url}/v1",
                         *two_prompts(tmp_path))
    got = checks(data)
    assert rc == 2 and data["cases"][0]["info"]["against"] == ["reference", f"openai:{url}/v1"]
    assert got["reference~openai.runs"]["got"] == f"{url}/props: server down (connection refused): {DOWN_HINT}"
    assert all(c["pass"] for g, c in got.items() if g.startswith("reference~reference."))
    assert "reference~reference.greedy" in got


@pytest.mark.parametrize("mode, expected", [
    ("500", "/completion: HTTP 500: boom: out of memory"),
    ("malformed", "/completion: answer is not JSON: "),
    ("slow", "/completion: no answer within 0.5 s (timeout)"),
])
def test_failing_server_is_an_engine_failure(synth_gguf, tmp_path, mode, expected):
    """A server that answered its discovery requests and then fails a completion is the engine under test failing:
    exit 1, "ENGINE FAILED", the request named (the first prompt, step 0), never bad input."""
    with FaultStub(mode, delay=3.0) as stub:
        rc, data, report = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{stub.url}/v1",
                                  "--server-timeout", "0.5", *two_prompts(tmp_path))
    runs = checks(data)["reference~openai.runs"]
    assert rc == 1 and runs["engine_failure"] and not runs.get("bad_input") and "\n" not in runs["got"]
    assert runs["got"].startswith(stub.url + expected) and runs["request"] == "a"
    assert data["verdict"].startswith(f"ENGINE FAILED: {synth_gguf.name}/reference~openai at request a")
    assert "ENGINE FAILED at request `a`" in report


# --------------------------------------------------------------------------- the engine on the command line


def test_logits_and_trace_refused_generate_works(llama_server, synth_gguf, tmp_path, capsys):
    engine = f"openai:{llama_server.url}/v1"
    ids = tmp_path / "ids.json"
    ids.write_text("[2, 5, 6, 7]")
    for cmd, what in (("logits", "the logits of every position"), ("trace", "trace points")):
        rc = main([cmd, "--model", str(synth_gguf), "--engine", engine, "--prompt-ids", str(ids),
                   "--out", str(tmp_path / f"{cmd}.out")])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err == (f"g4h: error: openai:{llama_server.url}/v1: a completion server returns no {what} "
                                   "(only the top-N log-probabilities of generated tokens); use g4h generate, or g4h "
                                   "parity --against")
    some = load_prompts()[:3]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": p["id"], "prompt_ids": p["prompt_ids"]}) for p in some))
    out = tmp_path / "gen.jsonl"
    assert main(["generate", "--model", str(synth_gguf), "--engine", engine, "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    # the answers the engine gives directly, in g4h generate's format (log-probs not compared bit for bit: requests
    # sharing batches move them by fp32 summation order)
    direct = OpenAIEngine(engine).generate_full([p["prompt_ids"] for p in some], 4)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == [p["id"] for p in some]
    assert [x["tokens"] for x in lines] == [g.tokens for g in direct]
    assert [[[c[0] for c in s] for s in x["top_logprobs"]] for x in lines] == [[[i for i, _ in s] for s in g.top]
                                                                       for g in direct]


# --------------------------------------------------------------------------- the chat template


def test_chat_template_against_real_servers(llama_server, llama_server_chat, synth_gguf):
    tok = model_tokenizer(synth_gguf)
    (good,) = template_figures(OpenAIEngine(llama_server_chat.url), tok)
    assert good.measured == 1.0 and good.detail["chats"] == 2 * len(CHAT_CASES)
    (bad,) = template_figures(OpenAIEngine(llama_server.url), tok)  # no template in the file: ChatML
    assert bad.measured == 0.0 and bad.detail["differing"] == 2 * len(CHAT_CASES)
    assert bad.detail["why"].startswith("chat 'one user turn' (thinking off) text at character 2: server "
                                        "'<|im_start|>user\\nHi<|im_end|>")  # "<|" is common to both


# --------------------------------------------------------------------------- g4h parity against llama-server


@pytest.mark.slow
def test_parity_against_llama_server_passes(llama_server_chat, synth_gguf, tmp_path):
    rc, data, report = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{llama_server_chat.url}/v1",
                              "--require", "server-template")  # the GGUF states no template: the server is given it
    assert rc == 0, failing(data)
    got = checks(data)
    assert {"reference~openai.runs", "reference~openai.greedy", "reference~openai.max_abs_logprob",
            "server.batched~alone.greedy", "server.batched~alone.max_abs_logprob",
            "server.stream~nostream.same_tokens", "server.stop.max_tokens", "server.stop.string",
            "server.stop.eos", "server.chat_template"} <= set(got)
    assert not any(g.startswith("reference~openai.") and g.split(".")[1] in ("max_abs_logit", "layer_rel_l2")
                   for g in got)  # a server gives no logits and no trace points
    assert got["reference~openai.runs"]["approximations"] == ["gelu_fp16_table", "quantized_activations",
                                                               "flash_attn_fp16"]  # llama-server's defaults
    assert got["server.chat_template"]["pass"] and not got["server.chat_template"].get("informational")
    assert "(llama-server, model " in got["reference~openai.runs"]["engine"] and "(llama-server, model " in report
    b = got["server.batched~alone.greedy"]
    assert b["requests"] == 16 and b["identical"] + b["by_top_n"] + b["near_ties"] == 16
    assert b["max_in_flight"] > 1  # the staggered requests did overlap
    assert len(got["server.stop.string"]["rows"]) >= 1 and got["server.stop.eos"]["requests"] >= 2
    assert "Batch invariance: 16 requests" in report


@pytest.mark.slow
def test_text_prompts_tokenizer_difference_is_a_tokenizer_failure(llama_server_chat, synth_gguf, tmp_path):
    """Our tokenizer and llama.cpp part on a text with a leading space when the vocabulary adds a space prefix
    (the synthetic SPM vocabulary does): ``server.tokenizer`` fails, naming the prompt and position, and the model
    figures, run on our ids, pass."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "plain", "text": "Hello world"}\n{"id": "lead", "text": " lead"}\n'
                 '{"id": "ids", "prompt_ids": [2, 5, 6, 7]}\n')
    rc, data, _ = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{llama_server_chat.url}/v1",
                         "--prompts", str(f), *ONLY_GREEDY)
    assert rc == 1 and failing(data) == ["server.tokenizer"]
    tk = checks(data)["server.tokenizer"]
    assert tk["measured"] == 0.5
    assert tk["why"] == "request lead position 4: server [230, 154, 133, 112, 105, 101], ours [112, 105, 101, 104]"
    assert checks(data)["reference~openai.greedy"]["streams"] == 3


@pytest.mark.slow
def test_perturbed_logprobs_fail(llama_server, synth_gguf, tmp_path):
    with FaultStub("perturb", upstream=llama_server.url) as stub:
        rc, data, report = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{stub.url}/v1",
                                  *ONLY_GREEDY)
    assert rc == 1 and failing(data) == ["reference~openai.max_abs_logprob"]
    lp = checks(data)["reference~openai.max_abs_logprob"]
    assert lp["measured"] > 0.09  # every log-prob moved by 0.1
    first = load_prompts()[0]["id"]  # the first request has steps with log-probs, so it diverges first
    assert lp["first_divergence"].startswith(f"request {first} step ")
    assert f"first diverging point: {lp['first_divergence']}" in report


@pytest.mark.slow
def test_swapped_token_fails_naming_request_step_and_tokens(llama_server, synth_gguf, tmp_path):
    with FaultStub("swap", upstream=llama_server.url) as stub:
        rc, data, _ = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{stub.url}/v1",
                             *ONLY_GREEDY)
        first = stub.altered[0]  # the alone requests go first, in prompt order
    assert rc == 1 and "reference~openai.greedy" in failing(data)
    g = checks(data)["reference~openai.greedy"]
    rid = prompt_id_of(first["prompt"])
    assert g["first_fault"] == f"request {rid} step 2: ours {first['now']}, oracle {first['was']}"
    row = next(r for r in g["streams_detail"] if r["request"] == rid)
    assert row["kind"] == "fault" and "not the top-1 of our own log-probs" in row["reason"]


@pytest.fixture(scope="module")
def e2b_server(tmp_path_factory):
    """llama-server on ``e2b``, whose greedy continuation of one built-in prompt reaches EOS."""
    from gemma4_harness.harness import synth

    gguf = synth.ensure_built(MODELS_DIR / "e2b.toml").gguf["F32"]
    with running_llama_server(gguf, tmp_path_factory, "llama-server-e2b") as s:
        yield s, gguf


@pytest.mark.slow
def test_eos_where_the_oracle_says(e2b_server, tmp_path):
    server, gguf = e2b_server
    only_stop = ["--skip", "server-batch", "--skip", "server-stream", "--skip", "server-template"]
    rc, data, _ = parity(tmp_path, "--model", str(gguf), "--against", f"openai:{server.url}/v1", *only_stop)
    eos = checks(data)["server.stop.eos"]
    assert rc == 0 and eos["pass"] and eos["eos_reached"] >= 1
    stopped = [r for r in eos["rows"] if r["eos_at"] is not None]
    with FaultStub("ignore-eos", upstream=server.url) as stub:
        rc, data, _ = parity(tmp_path, "--model", str(gguf), "--against", f"openai:{stub.url}/v1", *only_stop)
    eos = checks(data)["server.stop.eos"]
    assert rc == 1 and failing(data) == ["server.stop.eos"]
    assert eos["why"].startswith(f"request {stopped[0]['request']} step {stopped[0]['eos_at']}: oracle stops")


@pytest.mark.slow
def test_prompt_logprobs_from_llama_cpp_python(llama_cpp_python_server_gemma3, llama_server_chat, gemma3_gguf,
                                               synth_gguf, tmp_path):
    """llama-cpp-python reports prompt log-probs (``echo``): ``server.prompt_logprobs`` measures them against the
    reference at every position it reports (gated: the real Gemma 3 GGUF's Q4_K/Q5_0/Q6_K/Q8_0 products round their
    activations as llama.cpp does, which the reference emulates, docs/quantized-activations.md); llama-server offers
    none, which the figure says."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "capital", "text": "The capital of France is"}\n')
    _, data, _ = parity(tmp_path, "--model", str(gemma3_gguf), "--against",
                        f"openai:{llama_cpp_python_server_gemma3.url}/v1", "--prompts", str(f), "--max-new-tokens", "4",
                        "--skip", "server-batch", "--skip", "server-stop", "--skip", "server-template")
    got = checks(data)
    assert "(llama-cpp-python, model " in got["reference~openai.runs"]["engine"] and got["server.tokenizer"]["pass"]
    plp = got["server.prompt_logprobs"]
    assert plp["positions"] >= 4 and not plp.get("informational") and plp["pass"], plp
    assert 0.0 < plp["measured"] < 1.0, plp  # Q4_K rounding: visible, far below a wrong token's log-prob
    _, data, _ = parity(tmp_path, "--model", str(synth_gguf), "--against", f"openai:{llama_server_chat.url}/v1",
                        *two_prompts(tmp_path), "--max-new-tokens", "2", *ONLY_GREEDY)
    plp = checks(data)["server.prompt_logprobs"]
    assert plp["informational"] and plp["got"].startswith("not offered by llama-server: no prompt log-prob")
