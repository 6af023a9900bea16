"""An engine that rounds its activations (``quantized_activations``) on a quantized file: the reference emulates the
rounding (harness/engines/llamacpp/numerics.py) and the pair is gated (harness/parity/checks/quantized.py, the
``<pair>_q8`` gates of harness/core/gates.py); docs/quantized-activations.md.

The fast tests check the plumbing: the weights' GGML type reaches the product, F32 weights are not rounded, MoE
experts and the tied head are, the many-forwards path gives the one-by-one path's bits, and an engine whose rounding
cannot be emulated is judged on its KLD with the reason said; an engine with logits and no tensors (the example
``cmd:`` engine, llama-cpp-python) on a PLE Q4_0 file is judged by ``agreeing_positions`` against the sums-jittered
null (``quantized.NULL``), which has resolution there. The slow ones run the real ``llamacpp`` engine on
synthetic GGUFs (Q8_0, and a Q4_K_M made by llama-quantize) and on faulty copies (the first half of one matrix's
rows scaled by 1.02, :mod:`quant_faults`): every correct file passes, every faulty one fails (tests/test_local_gate.py:
the same on small shapes, naming the layer).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemma4_harness.reference.activation_quants as rq
import gemma4_harness.reference.model as rm
from gemma4_harness.harness.engines.numerics import KIND_NUMERICS, Numerics, emulate
from gemma4_harness.reference.weights import GGMLArray, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggml_lib import need_llamacpp  # noqa: E402


def _case(name: str, qtype: str) -> Path:
    from gemma4_harness.harness.core.cases import resolve_spec
    from gemma4_harness.harness.synth import ensure_built

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
        want_g = rm.expert_product(rq.q8_0(x)[None], np.asarray(gu[1]))[0]  # the expert's own product kernel
        with pytest.raises(ValueError, match="blocks of 256"):  # a K-quant row is whole blocks of 256 in a GGUF
            rm.expert_ffn(x, gu[1], down[1])
        down = _typed(np.asarray(down), "Q8_0")
        got = rm.expert_ffn(x, gu[1], down[1])
    g = rm.gelu_tanh(want_g[:F]) * want_g[F:]
    assert np.array_equal(got, rm.expert_product(rq.q8_0(g)[None], np.asarray(down[1]))[0])


def test_many_forwards_give_the_one_by_one_bits_under_the_emulation():
    """The parity job's prefetch (reference/batch.py: per-chain rounding and norms) against the lazy path, on a
    quantized file, with llama.cpp's numerics emulated and without."""
    from gemma4_harness.harness.core.prompts import load_prompts
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

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
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    runs = ReferenceRuns(ReferenceEngine(_case("e2b", "Q8_0")))
    types = runs.unemulated_types()
    assert types == ["F16", "Q8_0"]
    assert runs.emulation_gap(KIND_NUMERICS["llamacpp"], types) is None
    unsaid = Numerics("float32", None, ("quantized_activations",))
    assert "vec_dot_types" in runs.emulation_gap(unsaid, types)
    assert unsaid.emulation() == ()
    assert "no dot-product type is known for XQ9" in runs.emulation_gap(KIND_NUMERICS["llamacpp"], ["XQ9"])
    assert runs.emulation_gap(KIND_NUMERICS["llamacpp"], ["Q5_1", "Q4_1", "Q8_0"]) is None  # the block sums too


@pytest.fixture(scope="module")
def q4_1_moe(tmp_path_factory) -> Path:
    """odd-h48-v777-moe widened to whole blocks of 32 (hidden 64, experts of 32), its matrices in Q4_1
    (:func:`quant_faults.requantize`): dense matrices, expert stacks and the tied head carry block minima."""
    import re

    from quant_faults import requantize

    from gemma4_harness.harness.synth import ensure_built

    tmp = tmp_path_factory.mktemp("q4_1")
    text = (Path(__file__).parent / "shapes" / "odd-h48-v777-moe.toml").read_text()
    for key, value in {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32}.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
        assert n == 1, key
    spec = tmp / "q4_1-moe.toml"
    spec.write_text(text)
    return requantize(Path(ensure_built(spec).gguf["F32"]), tmp / "q4_1-moe.gguf", "Q4_1")


def test_q4_1_weights_carry_their_block_minima(q4_1_moe):
    """A Q4_1 matrix read from a GGUF carries each block's stored minimum (whole tensor, a row block of the head, an
    expert of a stack), kept by whole-row selections and dropped by other views."""
    _, W = load_model(q4_1_moe)
    name = "blk.0.attn_q.weight"
    w = W[name]
    assert w.ggml_type == "Q4_1" and w.block_min.shape == (w.shape[0], w.shape[1] // 32)
    assert np.array_equal(w.block_min, rq.block_minima(W.stored(name), "Q4_1"))
    # each block's dequantized values are d * q + m with q >= 0: none lies below its block's m (d >= 0 here)
    assert np.all(np.asarray(w).reshape(w.shape[0], -1, 32).min(axis=-1) >= w.block_min)
    assert np.array_equal(w[2:5].block_min, w.block_min[2:5]) and np.array_equal(w[3].block_min, w.block_min[3])
    assert w.T.block_min is None and w[:, :32].block_min is None and w[..., :32].block_min is None
    head = next(iter(W.row_blocks("token_embd.weight")))
    assert np.array_equal(head.block_min, rq.block_minima(W.stored("token_embd.weight")[:head.shape[0]], "Q4_1"))
    stack = "blk.0.ffn_gate_up_exps.weight"
    assert W.raw_dtype(stack) == "Q4_1"
    e3 = W.experts(stack, np.array([3, 1]))[3]
    assert np.array_equal(e3.block_min, rq.block_minima(W.stored(stack)[3], "Q4_1"))
    assert np.array_equal(W[stack][3].block_min, e3.block_min)  # the cached stack's view: the same minima


def test_q4_1_products_add_the_block_sums(q4_1_moe):
    """Under the emulation a Q4_1 product is the rounded row's product plus the Q8_1 block sums' correction
    (:func:`reference.activation_quants.q8_1_sum_correction`), in a dense product and in an expert's; outside the
    emulation, nothing is added; a Q4_1 weight without minima is refused, not silently computed without them."""
    _, W = load_model(q4_1_moe)
    w = W["blk.0.attn_q.weight"]
    x = np.random.default_rng(0).uniform(0.5, 1.5, (3, w.shape[1]))
    with emulate(("quantized_activations",)):
        got = rm.linear(x, w)
        with pytest.raises(ValueError, match="minima"):
            rm.linear(x, _typed(np.ones((4, w.shape[1])), "Q4_1"))
        gu = W["blk.0.ffn_gate_up_exps.weight"][1]
        down = W["blk.0.ffn_down_exps.weight"][1]
        expert = rm.expert_ffn(x[0], gu, down)
    plain = rq.q8_1(x) @ np.asarray(w).T
    assert np.array_equal(got, plain + rq.q8_1_sum_correction(x, w.block_min))
    assert not np.array_equal(got, plain)
    g = rm.expert_product(rq.q8_1(x[:1]), np.asarray(gu))[0] + rq.q8_1_sum_correction(x[0], gu.block_min)
    h = rm.gelu_tanh(g[:down.shape[1]]) * g[down.shape[1]:]
    assert np.array_equal(expert, rm.expert_product(rq.q8_1(h)[None], np.asarray(down))[0]
                          + rq.q8_1_sum_correction(h, down.block_min))
    assert np.array_equal(rm.linear(x, w), x @ np.asarray(w).T)  # outside: the exact product


def test_many_forwards_give_the_one_by_one_bits_on_q4_1(q4_1_moe):
    """The parity job's prefetch (reference/batch.py, which adds the block sums after its stacked products) gives
    the lazy path's logits bit for bit on a Q4_1 file with experts, under llama.cpp's numerics."""
    from gemma4_harness.harness.core.prompts import load_prompts
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    ref = ReferenceEngine(q4_1_moe)
    prompts = [p for p in load_prompts() if max(p["prompt_ids"]) < ref.cfg.vocab_size][:3]
    approx = KIND_NUMERICS["llamacpp"].emulation()
    lazy, ahead = ReferenceRuns(ref), ReferenceRuns(ref)
    assert lazy.emulation_gap(KIND_NUMERICS["llamacpp"], lazy.unemulated_types()) is None
    ahead.prefetch([approx], prompts, new_tokens=2, top_n=3)
    for p in prompts:
        assert np.array_equal(lazy.logits(approx, p)[0], ahead.logits(approx, p)[0]), p["id"]


class StreamsOnly:
    """An engine that gives greedy streams with top-N log-probs and no logits (as a server does), declaring llama.cpp's
    quantized activations: the reference on ``path`` under that emulation, its inputs jittered with a seed of its own
    (an engine whose fp32 values differ from the emulating reference's in their last bits, as llama.cpp's do)."""

    ops = ("generate",)
    numerics = KIND_NUMERICS["llamacpp"]
    engine = "streams-only"

    def __init__(self, path: Path) -> None:
        from gemma4_harness.harness.engines.reference import ReferenceEngine

        self.ref = ReferenceEngine(path)

    def generate_full(self, prompts, max_new_tokens, top_n=5):
        from gemma4_harness.harness.engines.llamacpp.numerics import jitter_numerics

        with emulate(self.numerics.emulation()), jitter_numerics(seed=7):
            return self.ref.generate_full(prompts, max_new_tokens, top_n=top_n)


@pytest.mark.parametrize("fault", ["correct", "rows", "block", "swap"])
def test_log_probs_only_engine_is_gated_on_its_streams(fault, tmp_path):
    """An engine without logits (:class:`StreamsOnly`, judged as a ``cmd:`` engine is) on e2b Q8_0: its greedy streams'
    log-probs give ``agreeing_positions`` (harness/parity/checks/quantized.py ``stream_agreement``); the correct file
    passes, each fault of :mod:`quant_faults` in an FFN down matrix fails there, with the same positions counted on
    the jittered reference."""
    from quant_faults import make_fault
    from quant_pairs import prompts_for

    from gemma4_harness.harness.core.gates import DEFAULT_GATES
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.pair import _measure
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
    from gemma4_harness.harness.parity.result import CaseResult

    path = _case("e2b", "Q8_0")
    runs = ReferenceRuns(ReferenceEngine(path))
    prompts = prompts_for(path, runs.ref.cfg)[:4]
    served = path if fault == "correct" else make_fault(fault, path, tmp_path / "f.gguf", "blk.3.ffn_down.weight")[0]
    figs = _measure(runs, StreamsOnly(served), "cmd", "reference~cmd", prompts, lambda m: None, "q", 4)
    agree = next(f for f in figs if f.gate == "reference~cmd_q8.agreeing_positions")
    res = CaseResult(case="q", kind="user", model=str(path))
    res.apply(figs, DEFAULT_GATES)
    d = agree.detail
    assert d["reference_agreeing"] > 0 and d["positions"] == 4 * 4, d  # 4 prompts x 4 steps, none without log-probs
    if fault == "correct":
        assert res.passed and agree.measured >= 0.2, d
    else:
        assert not res.passed and agree.measured < 0.2, d
        assert not next(c for c in res.checks if c["gate"] == agree.gate)["pass"]


@pytest.fixture(scope="module")
def ple_q4_0(tmp_path_factory):
    """The h128-ple-q4_0 file of tests/test_local_gate.py (PLE, a KV-shared tail, Q4_0), its reference runs and the
    synthetic prompts within its vocabulary."""
    from quant_pairs import prompts_for
    from test_local_gate import _built

    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    tmp = tmp_path_factory.mktemp("ple-q4_0")
    _, path = _built("h128-ple-q4_0", tmp)
    runs = ReferenceRuns(ReferenceEngine(path))
    return tmp, path, runs, prompts_for(path, runs.ref.cfg)


@pytest.mark.parametrize("fault", ["correct", "rows"])
def test_logits_only_engine_is_judged_by_its_leading_runs_on_a_ple_q4_0_file(fault, ple_q4_0):
    """An engine that gives logits and no tensors (examples/llamacpp_engine.py: llama-cpp-python behind the
    subprocess protocol, declaring gelu_fp16_table and quantized_activations, with ``--declare
    vec_dot_types=llama.cpp``) on the PLE Q4_0 shape: ``agreeing_positions`` judges it, its null the emulating
    reference with its fp32 sums jittered (quantized.NULL), which agrees on at least one position per prompt there.
    The input jitter agreed on none (it flips the exact .5 ties of the first layer's PLE input): the pair fell back to
    the 8-bit yardstick, which passed this fault. The correct file passes; the first half of blk.1.ffn_down's rows
    x1.02 fails on ``agreeing_positions``, with no leading position agreeing."""
    from quant_faults import make_fault
    from quant_logits_only import engine

    from gemma4_harness.harness.core.gates import DEFAULT_GATES
    from gemma4_harness.harness.parity.checks.pair import _measure
    from gemma4_harness.harness.parity.result import CaseResult

    need_llamacpp()
    tmp, path, runs, prompts = ple_q4_0
    served = path if fault == "correct" else make_fault("rows", path, tmp / "rows.gguf", "blk.1.ffn_down.weight")[0]
    eng, kind = engine("cmd", served)
    try:
        figs = _measure(runs, eng, kind, "reference~cmd", prompts, lambda m: None, "q", 2)
    finally:
        eng.close()
    res = CaseResult(case="q", kind="user", model=str(served))
    res.apply(figs, DEFAULT_GATES)
    (agree,) = [c for c in res.checks if c["gate"] == "reference~cmd_q8.agreeing_positions"]
    assert not agree.get("informational") and agree["reference_agreeing"] >= len(prompts), agree
    assert not [c for c in res.checks if c["gate"].endswith("_q8x.mean_kld")]  # no fallback to the yardstick
    if fault == "correct":
        assert res.passed and agree["pass"] and agree["measured"] >= 0.2, agree
    else:
        assert not res.passed and not agree["pass"] and agree["agreeing"] == 0, agree


@pytest.fixture(scope="module")
def e2b_f16(tmp_path_factory):
    """The e2b case's F16 file, its reference runs and the first 4 synthetic prompts within its vocabulary."""
    from quant_pairs import prompts_for

    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    path = _case("e2b", "F16")
    runs = ReferenceRuns(ReferenceEngine(path))
    return tmp_path_factory.mktemp("e2b-f16"), path, runs, prompts_for(path, runs.ref.cfg)[:4]


@pytest.mark.parametrize("fault", ["correct", "rows"])
def test_logits_only_engine_is_judged_by_its_median_where_the_count_has_no_resolution(fault, e2b_f16):
    """An engine that gives logits and no tensors (examples/llamacpp_engine.py behind the subprocess protocol, with
    ``--declare vec_dot_types=llama.cpp``) on the e2b F16 file: the sums-jittered null (quantized.NULL) agrees on
    fewer positions than one per prompt (F16's rounding flips are dense), so ``agreeing_positions`` is reported with
    its reason and ``median_abs_logit`` judges (gates.Q8_MEDIAN_LOGIT_WHY), not the 8-bit yardstick, which passed
    this fault (docs/quantized-activations.md, "Engines with logits and no tensors"). The correct file passes; the
    first half of blk.1.ffn_down's rows x1.02 fails on ``median_abs_logit``."""
    from quant_faults import make_fault
    from quant_logits_only import engine

    from gemma4_harness.harness.core.gates import DEFAULT_GATES
    from gemma4_harness.harness.parity.checks.pair import _measure
    from gemma4_harness.harness.parity.result import CaseResult

    need_llamacpp()
    tmp, path, runs, prompts = e2b_f16
    served = path if fault == "correct" else make_fault("rows", path, tmp / "rows.gguf", "blk.1.ffn_down.weight")[0]
    eng, kind = engine("cmd", served)
    try:
        figs = _measure(runs, eng, kind, "reference~cmd", prompts, lambda m: None, "q", 2)
    finally:
        eng.close()
    assert not any("_per_position" in f.detail for f in figs)  # pooled, not reported per prompt
    res = CaseResult(case="q", kind="user", model=str(served))
    res.apply(figs, DEFAULT_GATES)
    failing = sorted({c["gate"] for c in res.checks if not c["pass"] and not c.get("informational")})
    assert failing == ([] if fault == "correct" else ["reference~cmd_q8.median_abs_logit"]), failing
    (agree,) = [c for c in res.checks if c["gate"] == "reference~cmd_q8.agreeing_positions"]
    assert agree.get("informational") and agree["reference_agreeing"] < len(prompts), agree
    (med,) = [c for c in res.checks if c["gate"] == "reference~cmd_q8.median_abs_logit"]
    assert not med.get("informational") and med["positions"] == sum(len(p["prompt_ids"]) for p in prompts), med
    assert med["limit"] == max(1e-3, 2 * med["null"]), med
    assert not [c for c in res.checks if c["gate"].endswith("_q8x.mean_kld")]  # no fallback to the yardstick


def test_faults_change_what_they_say(tmp_path):
    """:mod:`quant_faults` on a Q8_0 matrix: the block fault changes one block's fp16 scale by x1.5 and no other byte;
    the swap exchanges two rows' bytes; the row fault scales the first half of the rows' scales."""
    import gguf
    from quant_faults import BLOCK_FACTOR, make_fault

    path = _case("e2b", "Q8_0")
    name = "blk.3.ffn_down.weight"

    def raw(p):
        return next(t for t in gguf.GGUFReader(p).tensors if t.name == name).data.copy()

    before = raw(path)
    after = raw(make_fault("block", path, tmp_path / "b.gguf", name)[0])
    rows, cols = np.nonzero(before != after)
    assert len(set(rows)) == 1 and cols.max() - cols.min() <= 1  # two bytes: one fp16 d
    r, c = rows[0], cols.min()
    d0, d1 = (a[r, c:c + 2].copy().view(np.float16)[0] for a in (before, after))
    assert float(d1) == float(np.float16(float(d0) * BLOCK_FACTOR)) and c % 34 == 0
    after = raw(make_fault("swap", path, tmp_path / "s.gguf", name)[0])
    j = before.shape[0] // 2
    assert np.array_equal(after[0], before[j]) and np.array_equal(after[j], before[0])
    assert np.array_equal(np.delete(after, [0, j], axis=0), np.delete(before, [0, j], axis=0))
    after = raw(make_fault("rows", path, tmp_path / "r.gguf", name)[0])
    changed = np.nonzero((before != after).any(axis=1))[0]
    assert changed.max() < before.shape[0] // 2 and changed.size > before.shape[0] // 4


# --------------------------------------------------------------------------- the real llama.cpp engine


def _pairs(path: Path, faults: list[str], tmp_path: Path) -> dict[str, dict]:
    from quant_faults import scale_rows
    from quant_pairs import judge, prompts_for

    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    need_llamacpp()
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
    an attention output or an FFN gate matrix fails, on local_median (the engine's traces: each layer judged on its
    own), naming the faulty matrix's layer."""
    got = _pairs(_case("e2b", "Q8_0"), ["blk.3.ffn_down.weight", "blk.1.attn_output.weight",
                                        "blk.5.ffn_gate.weight"], tmp_path)
    assert got["correct"]["passed"], got["correct"]
    for t in ("blk.3.ffn_down.weight", "blk.1.attn_output.weight", "blk.5.ffn_gate.weight"):
        assert not got[t]["passed"], t
        local = got[t]["gates"]["reference~llamacpp_q8.local_median"]
        assert local["fail"] and local["detail"]["first_layer"] == int(t.split(".")[1]), (t, local)


@pytest.mark.slow
def test_llamacpp_q4_k_m_correct_passes_faults_fail(tmp_path):
    """31b quantized by llama-quantize to Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 matrices): the correct file passes; the
    fault in a Q4_K matrix and in a Q5_0 one fails."""
    from gemma4_harness.harness.engines.llamacpp.tools import quantize

    need_llamacpp()
    path = quantize(_case("31b", "F32"), tmp_path / "31b-Q4_K_M.gguf", "Q4_K_M", threads=1)
    got = _pairs(path, ["blk.2.ffn_down.weight", "blk.5.attn_output.weight"], tmp_path)
    assert got["correct"]["passed"], got["correct"]
    assert not got["blk.2.ffn_down.weight"]["passed"] and not got["blk.5.attn_output.weight"]["passed"]


def test_window_floor_follows_the_poisson_law():
    """The windows judge from the null's count at which a correct engine's count (Poisson of the same mean) falls
    under 0.2 x it with probability at most 1e-4 (quantized.window_floor): 14; one fewer is not enough."""
    import math

    from gemma4_harness.harness.parity.checks.quantized import poisson_cdf, window_floor

    n = window_floor()
    assert n == 14
    assert poisson_cdf(math.ceil(0.2 * n) - 1, n) <= 1e-4 < poisson_cdf(math.ceil(0.2 * (n - 1)) - 1, n - 1)
