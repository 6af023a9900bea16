"""An engine that rounds its activations (``quantized_activations``) on a quantized file: the reference emulates the
rounding (harness/engines/llamacpp/numerics.py) and the pair is gated (harness/parity/checks/pair.py, the
``<pair>_q8`` gates of harness/core/gates.py); docs/quantized-activations.md.

The fast tests check the plumbing: the weights' GGML type reaches the product, F32 weights are not rounded, MoE
experts and the tied head are, the many-forwards path gives the one-by-one path's bits, and an engine whose rounding
cannot be emulated is judged on its KLD with the reason said. The slow ones run the real ``llamacpp`` engine on
synthetic GGUFs (Q8_0, and a Q4_K_M made by llama-quantize) and on faulty copies (the first half of one matrix's
rows scaled by 1.02, :mod:`quant_faults`): every correct file passes, every faulty one fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import reference.activation_quants as rq
import reference.model as rm
from harness.engines.numerics import KIND_NUMERICS, Numerics, emulate
from reference.weights import GGMLArray, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _case(name: str, qtype: str) -> Path:
    from harness.core.cases import resolve_spec
    from harness.synth import ensure_built

    return Path(ensure_built(resolve_spec(name)).gguf[qtype])


def _typed(a: np.ndarray, t: str) -> np.ndarray:
    v = np.asarray(a, dtype=np.float64).view(GGMLArray)
    v.ggml_type = t
    return v


def test_weights_carry_their_type_and_arithmetic_drops_it():
    cfg, W = load_model(_case("e2b", "Q8_0"))
    w = W["blk.0.attn_q.weight"]
    assert w.ggml_type == "Q8_0" and w.T.ggml_type == "Q8_0" and w[:3].ggml_type == "Q8_0"
    assert W["blk.0.proj.weight"].ggml_type == "F16"  # rows of 16: the converter's F16 fallback
    assert W["blk.0.attn_norm.weight"].ggml_type == "F32"
    assert type(w * 2.0) is np.ndarray and type(np.ones((1, w.shape[1])) @ w.T) is np.ndarray
    head = next(iter(W.row_blocks("token_embd.weight")))
    assert head.ggml_type == "Q8_0"
    _, W32 = load_model(_case("e2b", "F32"))
    assert W32["blk.0.attn_q.weight"].ggml_type == "F32"


def test_emulated_input_follows_the_weight_type():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256))
    with emulate(("quantized_activations",)):
        for t, fn in (("Q4_0", rq.q8_0), ("Q5_1", rq.q8_1), ("Q4_K", rq.q8_K), ("IQ4_XS", rq.q8_K),
                      ("F16", rq.f16), ("BF16", rq.bf16)):
            assert np.array_equal(rm.linear_input(x, _typed(np.ones((4, 256)), t)), fn(x)), t
        assert rm.linear_input(x, _typed(np.ones((4, 256)), "F32")) is x  # F32 weights: no rounding
        assert rm.linear_input(x, np.ones((4, 256))) is x  # no GGML type (safetensors, float64)
    assert rm.linear_input(x, _typed(np.ones((4, 256)), "Q8_0")) is x  # outside the emulation


def test_moe_experts_round_each_product():
    """An expert stack keeps its type per expert (a view), and both products of :func:`reference.model.expert_ffn`
    take a rounded input."""
    rng = np.random.default_rng(1)
    E, F, h = 3, 32, 64
    gu = _typed(rng.standard_normal((E, 2 * F, h)) * 0.1, "Q8_0")
    down = _typed(rng.standard_normal((E, h, F)) * 0.1, "Q4_K")  # rows of 32: q8_K cannot apply
    x = rng.standard_normal(h)
    with emulate(("quantized_activations",)):
        want_g = gu[1] @ rq.q8_0(x)
        with pytest.raises(ValueError, match="blocks of 256"):  # a K-quant row is whole blocks of 256 in a GGUF
            rm.expert_ffn(x, gu[1], down[1])
        down = _typed(np.asarray(down), "Q8_0")
        got = rm.expert_ffn(x, gu[1], down[1])
    g = rm.gelu_tanh(want_g[:F]) * want_g[F:]
    assert np.array_equal(got, np.asarray(down[1]) @ rq.q8_0(g))


def test_many_forwards_give_the_one_by_one_bits_under_the_emulation():
    """The parity job's prefetch (reference/batch.py: per-chain rounding and norms) against the lazy path, on a
    quantized file, with llama.cpp's numerics emulated and without."""
    from harness.core.cases import load_prompts
    from harness.engines.reference import ReferenceEngine
    from harness.parity.checks.pair import ReferenceRuns

    path = _case("e2b", "Q8_0")
    ref = ReferenceEngine(path)
    prompts = [p for p in load_prompts() if max(p["prompt_ids"]) < ref.cfg.vocab_size][:3]
    sets = [KIND_NUMERICS["llamacpp"].emulation(), ()]
    assert "quantized_activations" in sets[0]
    lazy, ahead = ReferenceRuns(ref), ReferenceRuns(ref)
    ahead.prefetch(sets, prompts, new_tokens=2, top_n=3)
    for approx in sets:
        for p in prompts:
            assert np.array_equal(lazy.logits(approx, p)[0], ahead.logits(approx, p)[0]), (approx, p["id"])
    assert not np.array_equal(lazy.logits(sets[0], prompts[-1])[0], lazy.logits((), prompts[-1])[0])


def test_what_cannot_be_emulated_is_said():
    from harness.engines.reference import ReferenceEngine
    from harness.parity.checks.pair import ReferenceRuns

    runs = ReferenceRuns(ReferenceEngine(_case("e2b", "Q8_0")))
    types = runs.unemulated_types()
    assert types == ["F16", "Q8_0"]
    assert runs.emulation_gap(KIND_NUMERICS["llamacpp"], types) is None
    unsaid = Numerics("float32", None, ("quantized_activations",))
    assert "vec_dot_types" in runs.emulation_gap(unsaid, types)
    assert unsaid.emulation() == ()
    assert "no dot-product type is known for XQ9" in runs.emulation_gap(KIND_NUMERICS["llamacpp"], ["XQ9"])
    assert "Q5_1: llama.cpp multiplies" in runs.emulation_gap(KIND_NUMERICS["llamacpp"], ["Q5_1", "Q8_0"])


# --------------------------------------------------------------------------- the real llama.cpp engine


def _need_llamacpp():
    import os

    if os.environ.get("G4H_SKIP_LLAMACPP", "") not in ("", "0"):
        pytest.skip("opted out with G4H_SKIP_LLAMACPP=1")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        pytest.fail(f"llama-cpp-python is not installed ({e}); nox -s tests installs it (G4H_SKIP_LLAMACPP=1 opts "
                    "out)", pytrace=False)


def _pairs(path: Path, faults: list[str], tmp_path: Path) -> dict[str, dict]:
    from quant_faults import scale_rows
    from quant_pairs import judge, prompts_for

    from harness.engines.reference import ReferenceEngine
    from harness.parity.checks.pair import ReferenceRuns

    _need_llamacpp()
    ref = ReferenceEngine(path)
    runs = ReferenceRuns(ref)
    prompts = prompts_for(path, ref.cfg)
    out = {"correct": judge(runs, path, prompts)}
    for i, t in enumerate(faults):
        out[t] = judge(runs, scale_rows(path, tmp_path / f"fault{i}.gguf", t), prompts)
    return out


@pytest.mark.slow
def test_llamacpp_q8_0_correct_passes_faults_fail(tmp_path):
    """e2b in Q8_0 (and its F16 fallbacks): the correct file passes; a 2 % scale of half the rows of an FFN down,
    an attention output or an FFN gate matrix fails, on agreeing_positions."""
    got = _pairs(_case("e2b", "Q8_0"), ["blk.3.ffn_down.weight", "blk.1.attn_output.weight",
                                        "blk.5.ffn_gate.weight"], tmp_path)
    assert got["correct"]["passed"], got["correct"]
    for t in ("blk.3.ffn_down.weight", "blk.1.attn_output.weight", "blk.5.ffn_gate.weight"):
        assert not got[t]["passed"], t
        assert got[t]["gates"]["reference~llamacpp_q8.agreeing_positions"]["fail"], t


@pytest.mark.slow
def test_llamacpp_q4_k_m_correct_passes_faults_fail(tmp_path):
    """31b quantized by llama-quantize to Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 matrices): the correct file passes; the
    fault in a Q4_K matrix and in a Q5_0 one fails."""
    from harness.engines.llamacpp.tools import quantize

    _need_llamacpp()
    path = quantize(_case("31b", "F32"), tmp_path / "31b-Q4_K_M.gguf", "Q4_K_M", threads=1)
    got = _pairs(path, ["blk.2.ffn_down.weight", "blk.5.attn_output.weight"], tmp_path)
    assert got["correct"]["passed"], got["correct"]
    assert not got["blk.2.ffn_down.weight"]["passed"] and not got["blk.5.attn_output.weight"]["passed"]
