"""Servers on quantized files are gated (issue 34): llama-server and llama-cpp-python's server, started with their
defaults (field_servers.py: nothing but the model, host and port), serving a correct GGUF or a faulty copy of it
(:mod:`quant_faults`: the first half of one matrix's rows x1.02, one block's scale x1.5, two rows swapped), judged
by ``g4h parity`` against the reference on the correct file. A server gives no logits: the pair's
``reference~openai_q8.agreeing_positions`` counts its greedy streams' log-probs (prompt positions where
llama-cpp-python reports them, then each step) that agree with the emulating reference within the fp32 bound,
against the jittered reference's count (harness/parity/checks/quantized.py ``stream_agreement``); llama-server reports
none for the prompt, so each prompt position is asked as one token after its prefix (without them its streams start
where the jittered reference agreed on nothing: the gate was NaN, informational, and every fault passed). Every correct server
exits 0, every faulty one 1, failing there. The wider matrix (more types, the ``llamacpp`` engine, Gemma 3 270M) is
``python tests/quant_matrix.py`` (docs/quantized-activations.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from field_servers import TEXTS, server
from quant_faults import make_fault
from servers import _need_llama_cpp_python_server, _unavailable

from gemma4_harness.harness.parity import run as run_parity
from gemma4_harness.harness.parity.checks.server import ServerOptions

OPTIONS = dict(skip=("server-batch", "server-stream", "server-stop"), max_new_tokens=8)
GATE = "reference~openai_q8.agreeing_positions"


def _gguf(case: str, qtype: str) -> Path:
    from gemma4_harness.harness.core.cases import resolve_spec
    from gemma4_harness.harness.synth import ensure_built

    return Path(ensure_built(resolve_spec(case)).gguf[qtype])


def _judge(kind: str, served: Path, model: Path, tmp_path: Path) -> tuple[int, dict[str, dict]]:
    """``g4h parity --model MODEL --against openai:URL`` with a server of ``kind`` on ``served``, the texts of
    field_servers.py as prompts (llama-cpp-python takes text only): the exit status and the checks by gate."""
    if kind == "llama-server":
        from gemma4_harness.harness.engines.llamacpp.build import ensure_built
        from gemma4_harness.harness.engines.llamacpp.pins import BuildError

        try:
            ensure_built()
        except BuildError as e:
            _unavailable(f"llama-server: {e}")
    else:
        _need_llama_cpp_python_server()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"text{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    with server(kind, served, tmp_path / f"{served.stem}-{kind}.log") as srv:
        data, status = run_parity(models=[str(model)], against=[f"openai:{srv.url}/v1"], out=str(tmp_path / "out"),
                                  prompts=prompts, quiet=True, server=ServerOptions(**OPTIONS))
    return status, {c["gate"]: c for c in data["cases"][0]["checks"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
@pytest.mark.parametrize("fault", ["correct", "rows", "block", "swap"])
def test_server_on_q8_0_correct_passes_faults_fail(fault, kind, tmp_path):
    """e2b in Q8_0 (with its F16 fallbacks): the correct file exits 0; where agreeing_positions has resolution (the
    jittered reference agrees on at least one position per stream: llama-server, 6 of 6) each fault in an FFN down
    matrix exits 1 there; where it has none (llama-cpp-python's server: 4 of 6, its streams start later), the gate is
    reported with that reason and the fault is not claimed as caught (a known miss, docs/quantized-activations.md)."""
    model = _gguf("e2b", "Q8_0")
    served = model if fault == "correct" else make_fault(fault, model, tmp_path / "fault.gguf",
                                                          "blk.1.ffn_down.weight")[0]
    status, checks = _judge(kind, served, model, tmp_path)
    agree = checks[GATE]
    # prompt positions before the steps: llama-cpp-python's echo, llama-server's one-token request per prefix
    assert agree["positions"] > 6 * 8, agree
    if agree.get("informational"):
        assert kind != "llama-server" and "too dense" in agree["reason"], agree
        assert agree["reference_agreeing"] < len(agree["per_prompt"]), agree
        if fault == "correct":
            assert status == 0, agree
        return
    assert agree["reference_agreeing"] >= len(agree["per_prompt"]), agree
    if fault == "correct":
        assert status == 0 and agree["pass"], agree
    else:
        assert status == 1 and not agree["pass"], agree
