"""A prompt longer than the SERVER's context is bad input, not an engine failure (field35, finding 1).

``g4h parity --model M --against openai:URL --prompts P`` where a prompt fits the model's context but not the
server's: exit 2, one line naming the prompt (file:line), its tokens, the server's context and what to do.

* llama-server says its context up front (``GET /props`` ``default_generation_settings.n_ctx``, per slot): the
  prompts are judged against it with the model's own refusal (harness/core/prompts.py ``refuse_unfit_prompts``)
  before any reference work (harness/parity/cases.py ``user_case``);
* a server that does not say (llama-cpp-python, a generic one) refuses the request with HTTP 400 in its own words
  (harness/engines/openai/http.py ``CONTEXT_EXCEEDED``): the pair's ``.runs`` figure is ``bad_input`` naming the
  prompt and quoting the server; any other HTTP 400 stays an engine failure (exit 1).

Real servers on the synthetic ``31b`` GGUF (context 4096; tests/servers.py), fake ones (http.server in a thread) on
tests/variant_lab.py's ``lab-dense`` (vocabulary 512, context 256).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from http_stub import JsonHandler, StubServer
from servers import _need_llama_cpp_python_server, _running, llama_cpp_python_process, llama_server_process
from variant_lab import build

from gemma4_harness.harness.cli import main
from gemma4_harness.harness.parity.checks.pair import GREEDY_NEW_TOKENS
from gemma4_harness.harness.tokenizer.prompt_ids import model_tokenizer

QUICK = ["--skip", "server-batch", "--skip", "server-stream", "--skip", "server-stop", "--skip", "server-template",
         "--explain-budget", "0"]
SERVER_CTX = 2048  # llama-server -c 2048 --kv-unified: one slot of 2048; llama-cpp-python's default --n_ctx


def _g4h(capsys, tmp_path: Path, *args: str) -> tuple[int, str]:
    """``g4h parity ARGS --quiet``: exit status and the last line said."""
    capsys.readouterr()
    out = tmp_path / f"runs{len(list(tmp_path.glob('runs*')))}"
    rc = main(["parity", *args, *QUICK, "--out", str(out), "--quiet"])
    said = capsys.readouterr()
    text = (said.out + said.err).strip()
    assert "Traceback" not in text, text
    return rc, text.splitlines()[-1] if text else ""


def _long_text(model: Path, n: int) -> str:
    """A text our tokenizer of ``model`` makes ``n`` tokens or a few more (BOS included)."""
    tok = model_tokenizer(model)
    words = n
    while len(tok.encode("ab " * words)) < n:
        words += 16
    while len(tok.encode("ab " * (words - 1))) >= n:
        words -= 1
    return "ab " * words


def _prompts(tmp_path: Path, *lines: dict) -> Path:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return f


# ----------------------------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def long_text(synth_gguf) -> str:
    return _long_text(synth_gguf, SERVER_CTX + 60)  # past the server's 2048, well inside the model's 4096


@pytest.fixture(scope="module")
def small_llama_server(synth_gguf, tmp_path_factory):
    with _running(lambda m, log: llama_server_process(m, log, ctx=SERVER_CTX, parallel=1), synth_gguf,
                  tmp_path_factory, "llama-server-c2048") as s:
        yield s


def test_llama_server_context_refuses_the_prompt_before_reference_work(small_llama_server, synth_gguf, long_text,
                                                                      tmp_path, capsys):
    f = _prompts(tmp_path, {"id": "short", "text": "hello world"}, {"id": "long", "text": long_text})
    rc, line = _g4h(capsys, tmp_path, "--model", str(synth_gguf), "--against", f"openai:{small_llama_server.url}/v1",
                    "--prompts", str(f))
    assert rc == 2, line
    assert f"{f}:2: prompt 'long' (its text tokenized):" in line, line
    assert f"do not fit the context of the server at {small_llama_server.url}/v1 (its /props n_ctx) ({SERVER_CTX} " \
           "tokens" in line, line
    assert "llama-server -c N" in line and "--n_ctx N" in line, line
    assert "ENGINE FAILED" not in line, line
    runs = list(tmp_path.glob("runs*/*/results.json"))
    checks = [c for r in runs for case in json.loads(r.read_text())["cases"] for c in case["checks"]]
    assert not checks, checks  # refused before any check: no reference forwards, no request


def test_a_prompt_that_fits_the_server_still_passes(small_llama_server, synth_gguf, tmp_path, capsys):
    f = _prompts(tmp_path, {"id": "a", "prompt_ids": [2, 5, 6, 7]}, {"id": "b", "prompt_ids": [2, 9, 10]})
    rc, line = _g4h(capsys, tmp_path, "--model", str(synth_gguf), "--against", f"openai:{small_llama_server.url}/v1",
                    "--prompts", str(f))
    assert rc == 0, line
    assert line.startswith("PASS"), line


def test_a_prompt_that_fills_the_server_context_exactly_passes(small_llama_server, synth_gguf, long_text, tmp_path,
                                                               capsys):
    """No false alarm at the edge: prompt and new tokens exactly the slot's context. llama-server generates until
    ``prompt.n_tokens() + 1 >= n_ctx`` (``server-context.cpp`` ``process_token``), that is every asked token here."""
    ids = model_tokenizer(synth_gguf).encode(long_text)[:SERVER_CTX - GREEDY_NEW_TOKENS]  # --max-new-tokens' default
    f = _prompts(tmp_path, {"id": "edge", "prompt_ids": ids})
    rc, line = _g4h(capsys, tmp_path, "--model", str(synth_gguf), "--against", f"openai:{small_llama_server.url}/v1",
                    "--prompts", str(f))
    assert rc == 0, line


def test_llama_cpp_python_context_400_is_bad_input_naming_the_prompt(synth_gguf, long_text, tmp_path_factory,
                                                                     tmp_path, capsys):
    """llama-cpp-python does not say its context: its HTTP 400 ("This model's maximum context length is 2048
    tokens, ...") after the reference ran becomes the pair's bad input, exit 2, the prompt named."""
    _need_llama_cpp_python_server()
    f = _prompts(tmp_path, {"id": "long", "text": long_text})
    with _running(llama_cpp_python_process, synth_gguf, tmp_path_factory, "lcp-default-ctx") as srv:
        rc, line = _g4h(capsys, tmp_path, "--model", str(synth_gguf), "--against", f"openai:{srv.url}/v1",
                        "--prompts", str(f))
    assert rc == 2, line
    assert line.startswith("BAD INPUT"), line
    assert f"{f}:1: prompt 'long' (" in line and "does not fit the server's context" in line, line
    assert f"maximum context length is {SERVER_CTX} tokens" in line, line
    assert "--n_ctx N" in line, line


# ----------------------------------------------------------------------------------------------- fake servers


class FakeServer(StubServer):
    """llama-server's discovery answers (``/props`` without ``n_ctx``: a server that does not say its context),
    then every completion refused with HTTP 400 and ``message``; ``url``: the engine name that reaches it."""

    def __init__(self, message: str, vllm_max_model_len: int | None = None) -> None:
        body = {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}
        vllm = vllm_max_model_len is not None  # vLLM instead: no /props, its /version, its model card
        card = {"id": "fake", "owned_by": "vllm", "max_model_len": vllm_max_model_len} if vllm else \
            {"id": "fake", "owned_by": "llamacpp"}
        models = {"object": "list", "data": [card]}

        class H(JsonHandler):
            def do_GET(self):
                if self.path == "/props":
                    return self._send(404, {"detail": "Not Found"}) if vllm else \
                        self._send(200, {"default_generation_settings": {}})
                if self.path == "/version" and vllm:
                    return self._send(200, {"version": "0.0.0"})
                return self._send(200, models)

            def do_POST(self):
                self._body()
                self._send(400, body)

        super().__init__(H)
        self.url = f"openai:{self.url}/v1"


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("lab"))["lab-dense"]


# llama-server's own wording (tools/server/server-context.cpp, ERROR_TYPE_EXCEED_CONTEXT_SIZE: HTTP 400)
LLAMA_SERVER_400 = "request (40 tokens) exceeds the available context size (32 tokens), try increasing it"


def test_a_context_400_from_a_server_that_does_not_say_is_bad_input(lab, tmp_path, capsys):
    f = _prompts(tmp_path, {"id": "p", "prompt_ids": [2] + list(range(10, 49))})
    with FakeServer(LLAMA_SERVER_400) as srv:
        rc, line = _g4h(capsys, tmp_path, "--model", str(lab), "--against", srv.url, "--prompts", str(f))
    assert rc == 2, line
    assert f"{f}:1: prompt 'p' (40 tokens) does not fit the server's context" in line, line
    assert LLAMA_SERVER_400 in line, line


def test_another_400_stays_an_engine_failure(lab, tmp_path, capsys):
    f = _prompts(tmp_path, {"id": "p", "prompt_ids": [2, 10, 11, 12]})
    with FakeServer("invalid 'n_probs': must be a number") as srv:
        rc, line = _g4h(capsys, tmp_path, "--model", str(lab), "--against", srv.url, "--prompts", str(f))
    assert rc == 1, line
    assert "ENGINE FAILED" in line and "HTTP 400: invalid 'n_probs'" in line, line


# vLLM's wording (OpenAI's), quoted by srvctx from vllm/entrypoints/openai/serving_engine.py's input validation
VLLM_400 = ("This model's maximum context length is 32 tokens. However, you requested 48 tokens (40 in the messages, "
            "8 in the completion). Please reduce the length of the messages or completion.")


def test_vllm_says_its_context_in_its_model_card_and_the_prompt_is_refused_up_front(lab, tmp_path, capsys):
    """vLLM lists ``max_model_len`` in ``/v1/models``: a prompt longer than it is refused before any reference work
    (no check run), naming the server's context and where it said it."""
    f = _prompts(tmp_path, {"id": "p", "prompt_ids": [2] + list(range(10, 49))})
    with FakeServer(VLLM_400, vllm_max_model_len=32) as srv:
        rc, line = _g4h(capsys, tmp_path, "--model", str(lab), "--against", srv.url, "--prompts", str(f))
    assert rc == 2, line
    assert f"{f}:1: prompt 'p'" in line and "(its /v1/models max_model_len) (32 tokens" in line, line
    checks = [c for r in tmp_path.glob("runs*/*/results.json") for case in json.loads(r.read_text())["cases"]
              for c in case["checks"]]
    assert not checks, checks
