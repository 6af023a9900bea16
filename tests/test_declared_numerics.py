"""Gates that follow what an engine declares (harness/engines/numerics.py, harness/core/gates.py ``EFFECT_FACTOR``):
an fp32 engine that declares no approximation is held to the fp32 bounds (a 1e-2 error fails), one that declares
approximations to max(fp32 bound, 2 x their effect on the model); engines that give tokens only; ``--declare``.

Engines: the protocol stub (tests/cmd_stub.py: the float64 reference behind ``cmd:``, declaring what it is told) on
the tiny 2-layer GGUF, and a llama-server-dialect server computing exactly (tests/refserver.py) on an odd shape.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from refserver import ReferenceServer

from gemma4_harness.harness.cli import main as g4h
from gemma4_harness.harness.engines import make_engine
from gemma4_harness.harness.engines.cmd import CmdError
from gemma4_harness.harness.engines.numerics import DIALECT_NUMERICS, Numerics, declare, parse_declare
from gemma4_harness.harness.parity import run as run_parity
from gemma4_harness.harness.parity.checks.server import ServerOptions
from gemma4_harness.harness.parity.compare import generation_figures
from gemma4_harness.reference.errors import InputError

STUB = Path(__file__).resolve().parent / "cmd_stub.py"
SHAPES = Path(__file__).resolve().parent / "shapes"
ONLY_PAIR = ServerOptions(skip=("server-batch", "server-stream", "server-stop", "server-template"), max_new_tokens=6)


def stub(*args: str) -> str:
    return "cmd:" + shlex.join([sys.executable, str(STUB), *args])


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    """Prompts for the tiny model (vocabulary 32, context 64, window 4)."""
    rng = np.random.default_rng(5)
    rows = [{"id": f"t{n}", "prompt_ids": [2] + rng.integers(3, 32, n - 1).tolist()} for n in (2, 6, 11)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def checks(data: dict, prefix: str) -> list[dict]:
    return [c for case in data["cases"] for c in case["checks"] if c["gate"].startswith(prefix)]


def failing(data: dict) -> set[str]:
    return {c["gate"] for case in data["cases"] for c in case["checks"] if not c["pass"] and not c.get("informational")}


# --------------------------------------------------------------------------- the declaration


def test_dialect_defaults_and_declare():
    ls, lcp = DIALECT_NUMERICS["llama-server"], DIALECT_NUMERICS["llama-cpp-python"]
    assert ls.emulation() == ("gelu_fp16_table", "quantized_activations", "flash_attn_fp16")
    assert lcp.emulation() == ("gelu_fp16_table", "quantized_activations", "kv_cache=float16", "attn_fp16_operands")
    assert DIALECT_NUMERICS["vllm"].sixteen_bit and DIALECT_NUMERICS["vllm"].emulation() == ()
    f32 = declare(ls, parse_declare(["kv_cache=f32", "approximations=gelu_fp16_table,quantized_activations"]))
    assert f32.kv == "float32" and f32.emulation() == ("gelu_fp16_table", "quantized_activations")
    unsaid = declare(f32, parse_declare(["vec_dot_types=none"]))  # quantized activations of unknown types
    assert unsaid.emulation() == ("gelu_fp16_table",) and unsaid.vec_dot_types is None
    assert f32.source.startswith("--declare kv_cache=float32, approximations=gelu_fp16_table,quantized_activations")
    exact = declare(ls, parse_declare(["approximations=none", "kv_cache=float32"]))
    assert exact.emulation() == () and exact.approximations == ()
    assert Numerics("float32", "bfloat16").emulation() == ("kv_cache=bfloat16",)
    for bad, says in (("kv_cache=fp8", "expected one of"), ("approximations=gelu", "unknown 'gelu'"),
                      ("dtype", "expected KEY=VALUE"), ("cache=f16", "unknown key"),
                      ("vec_dot_types=cuda", "expected one of")):
        with pytest.raises(InputError, match=says):
            parse_declare([bad])


def test_bad_declare_is_one_line_exit_2(tiny_gguf, capsys):
    rc = g4h(["parity", "--model", str(tiny_gguf), "--against", "openai:http://127.0.0.1:9/v1", "--declare",
              "kv_cache=fp8", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["g4h: error: --declare kv_cache=fp8: expected one of float64, float32, float16, "
                               "bfloat16"]


def test_hello_declares_kv_cache(tiny_gguf):
    with make_engine(stub("--kv-cache", "float16", "--approx", "gelu_fp16_table"), tiny_gguf) as eng:
        assert eng.numerics.kv == "float16" and eng.numerics.emulation() == ("gelu_fp16_table", "kv_cache=float16")
    with pytest.raises(CmdError, match=r"hello: kv_cache: expected one of float64, float32, float16, bfloat16, "
                                       r"got 'fp8'"):
        make_engine(stub("--kv-cache", "fp8"), tiny_gguf)


# --------------------------------------------------------------------------- fp32 bounds, effect-derived bounds


def test_fp32_engine_declaring_nothing_is_held_to_fp32_bounds(tiny_gguf, prompts_file, tmp_path):
    """An fp32 engine that declares no approximation: its pair is gated at the fp32 bounds (1e-3 on logits and
    log-probs, the reference~fast bound), and the same engine off by 1e-2 fails them, naming where."""
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub()], out=str(tmp_path), prompts=prompts_file,
                              quiet=True, server=ONLY_PAIR)
    assert status == 0, data["verdict"]
    (runs,) = checks(data, "reference~cmd.runs")
    assert runs["numerics"] == {"dtype": "float32", "kv_cache": "float32", "approximations": [], "emulated": [],
                                "source": "declared in hello"}
    for gate in ("reference~cmd.max_abs_logit", "reference~cmd.max_abs_logprob"):
        got = checks(data, gate)
        assert got and all(c["limit"] == 1e-3 and c["measured"] < 1e-5 and "effect" not in c for c in got), got
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub("--perturb", "0.01")], out=str(tmp_path),
                              prompts=prompts_file, quiet=True, server=ONLY_PAIR)
    assert status == 1 and {"reference~cmd.max_abs_logit", "reference~cmd.max_abs_logprob"} <= failing(data)
    lp = checks(data, "reference~cmd.max_abs_logprob")[0]
    assert lp["limit"] == 1e-3 and abs(lp["measured"] - 0.01) < 1e-4
    assert lp["first_divergence"].startswith("request t2 step 0 token ")


def test_declared_approximations_raise_the_bounds_by_their_effect(tiny_gguf, prompts_file, tmp_path):
    """An engine declaring llama.cpp's GELU table and an f16 KV cache: the reference makes both, each figure carries
    their effect and is gated at max(fp32 bound, 2 x effect). The stub computes exactly, so it stands exactly one
    effect from the emulating reference (and passes); the same engine off by 0.5 fails."""
    name = stub("--approx", "gelu_fp16_table", "--kv-cache", "float16")
    data, status = run_parity(models=[str(tiny_gguf)], against=[name], out=str(tmp_path), prompts=prompts_file,
                              quiet=True, server=ONLY_PAIR)
    assert status == 0, data["verdict"]
    (runs,) = checks(data, "reference~cmd.runs")
    assert runs["numerics"]["emulated"] == ["gelu_fp16_table", "kv_cache=float16"]
    logit = checks(data, "reference~cmd.max_abs_logit")
    assert all(c["effect"] > 1e-4 and c["limit"] == max(1e-3, 2 * c["effect"]) for c in logit), logit
    assert all(abs(c["measured"] - c["effect"]) < 1e-5 for c in logit)  # exact vs emulated: one effect
    kld = checks(data, "reference~cmd.mean_kld")
    assert all(c["effect_power"] == 2 and c["limit"] == max(1e-5, 4 * c["effect"]) for c in kld)
    lp = checks(data, "reference~cmd.max_abs_logprob")[0]
    assert lp["effect"] > 0 and lp["limit"] == max(1e-3, 2 * lp["effect"]) and lp["measured"] <= lp["effect"] + 1e-6
    report = (Path(data["run_dir"]) / "report.md").read_text()
    assert "Numerics of `reference~cmd` (declared in hello): float32, KV cache float16, approximations: " \
           "gelu_fp16_table; the reference emulates: gelu_fp16_table, kv_cache=float16." in report
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub("--approx", "gelu_fp16_table", "--kv-cache",
                                                                     "float16", "--perturb", "0.5")],
                              out=str(tmp_path), prompts=prompts_file, quiet=True, server=ONLY_PAIR)
    assert status == 1 and {"reference~cmd.max_abs_logit", "reference~cmd.max_abs_logprob"} <= failing(data)


@pytest.mark.parametrize("perturb, status", [(0.0, 0), (0.01, 1)], ids=["exact", "off-by-1e-2"])
def test_fp32_server_declared_exact(tmp_path, perturb, status):
    """A server of llama-server's dialect that computes exactly, declared so (``--declare approximations=none
    --declare kv_cache=f32``): held to the fp32 bounds; its log-probs 1e-2 off fail ``max_abs_logprob`` (limit
    1e-3), naming the request and step."""
    from gemma4_harness.harness import synth

    gguf = synth.ensure_built(SHAPES / "odd-h56-v333-mha7.toml").gguf["F32"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [2, 40, 7, 99, 5]}\n{"id": "b", "prompt_ids": [2, 300, 17]}\n')
    with ReferenceServer(gguf, perturb=perturb) as srv:
        data, rc = run_parity(models=[str(gguf)], against=[f"openai:{srv.url}/v1"], out=str(tmp_path),
                              prompts=prompts, quiet=True, server=ONLY_PAIR,
                              engine_options={"declare": ["approximations=none", "kv_cache=f32"]})
    lp = checks(data, "reference~openai.max_abs_logprob")[0]
    assert rc == status, data["verdict"]
    assert lp["limit"] == 1e-3 and "effect" not in lp
    (runs,) = checks(data, "reference~openai.runs")
    assert runs["numerics"]["source"].startswith("--declare approximations=none, kv_cache=float32 over llama-server")
    if status:
        assert failing(data) == {"reference~openai.max_abs_logprob"} and lp["measured"] > 9e-3
        assert lp["first_divergence"].startswith("request a step 0 token ")


# --------------------------------------------------------------------------- engines that give tokens only


def test_token_only_rule():
    """Where our side has no log-probs, a divergent step passes only as a near-tie of the oracle's."""
    oracle = {"r": {"tokens": [5, 1], "top": [[5, 7, 9], [1]], "logprobs": [{5: -0.10, 7: -0.12, 9: -3.0}, {1: -0.1}]}}
    for ours, kind, says in ((7, "near-tie", "rank 2, 0.02 below its top-1 (a near-tie"),
                             (9, "fault", "rank 3, 2.9 below its top-1 (not a near-tie"),
                             (11, "fault", "not in the oracle's top-5")):
        mine = {"r": {"tokens": [ours, 1], "top": [[], []], "logprobs": [{}, {}]}}
        g, lp = generation_figures(mine, oracle, "reference~cmd")
        (row,) = g.detail["streams_detail"]
        assert row["kind"] == kind and says in row["reason"] and "our log-probs unknown" in row["reason"]
        assert (g.measured == 1.0) == (kind == "near-tie")
        assert lp.detail["not_measured"]
    assert generation_figures(oracle, oracle, "x")[0].measured == 1.0


def test_token_only_engine_right_and_wrong(tiny_gguf, prompts_file, tmp_path):
    """``generate`` results without ``top_logprobs``: a right engine passes (its log-prob figure is not measured,
    never a pass); one whose tokens are the runner-ups fails, naming the request, step 0 and both tokens."""
    data, status = run_parity(models=[str(tiny_gguf)], against=[stub("--token-only")], out=str(tmp_path),
                              prompts=prompts_file, quiet=True, server=ONLY_PAIR)
    assert status == 0, data["verdict"]
    (greedy,) = checks(data, "reference~cmd.greedy")
    assert greedy["pass"] and greedy["identical"] == greedy["streams"] == 3
    (lp,) = checks(data, "reference~cmd.max_abs_logprob")
    assert lp["informational"] and lp["reason"].startswith("not measured")
    data, status = run_parity(models=[str(tiny_gguf)],
                              against=[stub("--token-only", "--fault", "not-greedy", "--fault-op", "generate")],
                              out=str(tmp_path), prompts=prompts_file, quiet=True, server=ONLY_PAIR)
    (greedy,) = checks(data, "reference~cmd.greedy")
    assert status == 1 and not greedy["pass"]
    faults = [r for r in greedy["streams_detail"] if r["kind"] == "fault"]
    assert faults and all(r["step"] == 0 and "our log-probs unknown" in r["reason"] for r in faults)
    first = faults[0]
    assert greedy["first_fault"] == f"request {first['request']} step 0: ours {first['ours']}, oracle {first['oracle']}"


def test_token_only_server(tmp_path):
    """A server that reports no log-probs: the greedy check compares ids; the log-prob figure is not measured."""
    from gemma4_harness.harness import synth

    gguf = synth.ensure_built(SHAPES / "odd-h56-v333-mha7.toml").gguf["F32"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [2, 40, 7, 99, 5]}\n')
    with ReferenceServer(gguf, token_only=True) as srv:
        data, rc = run_parity(models=[str(gguf)], against=[f"openai:{srv.url}/v1"], out=str(tmp_path),
                              prompts=prompts, quiet=True, server=ONLY_PAIR,
                              engine_options={"declare": ["approximations=none", "kv_cache=f32"]})
    assert rc == 0, data["verdict"]
    (lp,) = checks(data, "reference~openai.max_abs_logprob")
    assert lp["informational"] and lp["reason"].startswith("not measured")
    assert checks(data, "reference~openai.greedy")[0]["identical"] == 1


def test_require_names_a_check_a_dialect_may_not_offer():
    ServerOptions(require=("server-template", "server-prompt-logprobs")).check()
    with pytest.raises(InputError, match="--require 'server-batch': expected one of server-template, "
                                         "server-prompt-logprobs"):
        ServerOptions(require=("server-batch",)).check()
