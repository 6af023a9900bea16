"""No false alarm on a correct server: llama-server and llama-cpp-python's server, started with their default
numerics as users start them (an f16 KV cache; llama-server's flash attention on), against the reference on six odd
synthetic shapes (tests/shapes: hidden sizes 48..136, 2..7 heads of 8..68, vocabularies 300..1000, MoE, PLE, KV
sharing, windows 4..16), each exit 0; a check llama-cpp-python does not offer (the chat template) is "not offered",
and fails only with ``--require``.

Each run keeps the checks that judge numbers (greedy streams and their log-probs, prompt log-probs) and opts out of
batch invariance, streaming and stop (tests/test_server_parity.py runs those), on three prompts of 4..48 tokens, 6
tokens each. The full runs (every check, the built-in prompt set, the built-in GGUF cases too) and their table are
``python tests/field_servers.py`` (figures in docs/server-dialects.md, "Default settings").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from field_servers import TEXTS
from servers import THREADS, ServerProcess, _need_llama_cpp_python_server, _unavailable, child_env

from gemma4_harness.harness.parity import run as run_parity
from gemma4_harness.harness.parity.checks.server import ServerOptions

SHAPES = sorted((Path(__file__).resolve().parent / "shapes").glob("*.toml"))
OPTIONS = dict(skip=("server-batch", "server-stream", "server-stop"), max_new_tokens=6)
ID_PROMPTS = [[2, 40, 7, 99, 5], [2] + list(range(100, 116)), [2] + [5 + (7 * i) % 250 for i in range(47)]]
"""Three prompts of 5, 17 and 48 ids (below, around and past windows of 4..16), ids below 260: every vocabulary."""


def _server(kind: str, gguf: Path, log: Path) -> ServerProcess:
    """A server of ``kind`` on ``gguf`` with its default numerics, :data:`THREADS` threads."""
    if kind == "llama-server":
        from gemma4_harness.harness.engines.llamacpp.build import ensure_built
        from gemma4_harness.harness.engines.llamacpp.pins import BuildError

        try:
            server = ensure_built().server
        except BuildError as e:
            _unavailable(f"llama-server: {e}")
        return ServerProcess(kind, [str(server), "-m", str(gguf), "--threads", str(THREADS)],
                             lambda h, p: ["--host", h, "--port", str(p)], "/health", log, env=child_env())
    _need_llama_cpp_python_server()
    return ServerProcess(kind, [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads",
                                str(THREADS), "--n_threads_batch", str(THREADS)],
                         lambda h, p: ["--host", h, "--port", str(p)], "/v1/models", log, env=child_env())


def _prompts(kind: str, tmp_path: Path) -> Path:
    """Id prompts for llama-server; for llama-cpp-python, which takes text only, three texts (byte tokens)."""
    rows = ([{"id": f"ids{len(p)}", "prompt_ids": p} for p in ID_PROMPTS] if kind == "llama-server" else
            [{"id": f"text{i}", "text": TEXTS[i]} for i in (0, 1, 3)])
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
@pytest.mark.parametrize("spec", SHAPES, ids=[s.stem for s in SHAPES])
def test_default_server_on_an_odd_shape_passes(spec, kind, tmp_path):
    from gemma4_harness.harness import synth

    gguf = synth.ensure_built(spec).gguf["F32"]
    prompts = _prompts(kind, tmp_path)
    with _server(kind, gguf, tmp_path / "server.log") as srv:
        data, status = run_parity(models=[str(gguf)], against=[f"openai:{srv.url}/v1"], out=str(tmp_path),
                                  prompts=prompts, quiet=True, server=ServerOptions(**OPTIONS))
        checks = {c["gate"]: c for c in data["cases"][0]["checks"]}
        assert status == 0, data["verdict"]
        runs = checks["reference~openai.runs"]
        assert runs["numerics"]["kv_cache"] == "float16" and runs["numerics"]["source"].startswith(kind)
        lp = checks["reference~openai.max_abs_logprob"]
        assert checks["reference~openai.greedy"]["pass"] and lp["effect"] > 0 and lp["limit"] >= 2 * lp["effect"]
        if kind == "llama-cpp-python":
            tpl, plp = checks["server.chat_template"], checks["server.prompt_logprobs"]
            assert tpl["informational"] and tpl["got"].startswith("not offered by llama-cpp-python")
            assert plp["pass"] and not plp.get("informational") and plp["positions"] > 10
            if spec == SHAPES[0]:  # --require makes the check it does not offer fail
                data, status = run_parity(models=[str(gguf)], against=[f"openai:{srv.url}/v1"], out=str(tmp_path),
                                          prompts=prompts, quiet=True,
                                          server=ServerOptions(**OPTIONS, require=("server-template",)))
                failing = [c for c in data["cases"][0]["checks"] if not c["pass"] and not c.get("informational")]
                assert status == 1 and [c["gate"] for c in failing] == ["server.chat_template"]
                assert failing[0]["got"].endswith("(required with --require server-template)")
        else:
            assert checks["server.prompt_logprobs"]["got"].startswith("not offered by llama-server")
