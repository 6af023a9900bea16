"""Servers on quantized files are gated (issue 34): llama-server and llama-cpp-python's server, started with their
defaults (field_servers.py: nothing but the model, host and port), serving a correct GGUF or a faulty copy of it
(:mod:`quant_faults`: the first half of one matrix's rows x1.02, one block's scale x1.5, two rows swapped), judged
by ``g4h parity`` against the reference on the correct file. A server gives no logits: the pair's
``reference~openai_q8.agreeing_positions`` counts its greedy streams' log-probs (prompt positions where
llama-cpp-python reports them, then each step) that agree with the emulating reference within the fp32 bound,
against the count of the reference with its fp32 sums jittered (quantized.py ``stream_agreement``, ``NULL``);
llama-server reports
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


def _assert_judged(fault: str, status: int, agree: dict) -> None:
    """The gate judged (resolution: its null agrees on at least one position per stream) and said the verdict: the
    correct file exits 0 passing it, a faulty one 1 failing it."""
    assert not agree.get("informational"), agree
    assert agree["reference_agreeing"] >= len(agree["per_prompt"]), agree
    if fault == "correct":
        assert status == 0 and agree["pass"], agree
    else:
        assert status == 1 and not agree["pass"], agree


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
@pytest.mark.parametrize("fault", ["correct", "rows", "block", "swap"])
def test_server_on_q8_0_correct_passes_faults_fail(fault, kind, tmp_path):
    """e2b in Q8_0 (with its F16 fallbacks), both servers: the correct file exits 0, each fault (in an FFN down, an
    attention output, an FFN gate matrix) exits 1 on agreeing_positions. llama-cpp-python's server was a miss here:
    the input-jittered null agreed on 4 positions over 6 streams (its first prompt positions flip on exact int8 ties
    no server flips), the gate was reported for want of resolution and the faults passed; the null is now the
    emulating reference with its fp32 sums jittered (quantized.NULL)."""
    model = _gguf("e2b", "Q8_0")
    tensor = {"rows": "blk.1.ffn_down.weight", "block": "blk.3.attn_output.weight", "swap": "blk.2.ffn_gate.weight"}
    served = model if fault == "correct" else make_fault(fault, model, tmp_path / "fault.gguf", tensor[fault])[0]
    status, checks = _judge(kind, served, model, tmp_path)
    agree = checks[GATE]
    # prompt positions before the steps: llama-cpp-python's echo, llama-server's one-token request per prefix
    assert agree["positions"] > 6 * 8, agree
    _assert_judged(fault, status, agree)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["correct", "rows"])
def test_llama_cpp_python_on_q4_1(fault, tmp_path):
    """e2b quantized to Q4_1 by llama-quantize (Q8_1 activations, with their block sums), llama-cpp-python's server:
    the correct file exits 0, the first half of blk.1.ffn_down's rows x1.02 exits 1 on agreeing_positions (a miss
    before: the input-jittered null agreed on 4 positions over 6 streams, no resolution)."""
    from quant_matrix import model_file

    model = model_file("e2b-Q4_1", tmp_path)
    served = model if fault == "correct" else make_fault(fault, model, tmp_path / "fault.gguf",
                                                          "blk.1.ffn_down.weight")[0]
    status, checks = _judge("llama-cpp-python", served, model, tmp_path)
    _assert_judged(fault, status, checks[GATE])


MEDIAN = "reference~openai_q8.median_abs_logprob"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["correct", "rows"])
def test_llama_cpp_python_on_f16_judged_by_sizes(fault, tmp_path):
    """e2b in F16 (F16 activations: fp16 rounding flips dense from the first rows), llama-cpp-python's server: the
    streams' null agrees on fewer positions than one per stream, and on fewer windows [BOS, token] than the floor,
    so median_abs_logprob judges (quantized.SIZES_JUDGE, gates.Q8_MEDIAN_WHY): the correct file exits 0, the first
    half of blk.1.ffn_down's rows x1.02 exits 1 failing it. A miss before (measured: the null 2 positions over 6
    streams, no resolution, exit 0 on identical greedy streams)."""
    model = _gguf("e2b", "F16")
    served = model if fault == "correct" else make_fault(fault, model, tmp_path / "fault.gguf",
                                                          "blk.1.ffn_down.weight")[0]
    status, checks = _judge("llama-cpp-python", served, model, tmp_path)
    agree, med = checks[GATE], checks[MEDIAN]
    assert agree.get("informational") and agree["reference_agreeing"] < len(agree["per_prompt"]), agree
    assert not med.get("informational"), med
    if fault == "correct":
        assert status == 0 and med["pass"], med
    else:
        assert status == 1 and not med["pass"], med
