"""The static-shape decoder (fast/static_decode.py, the CUDA-graph path) against the paged engine, on the CPU.

On the CPU the decoder runs the very step a CUDA graph records, eagerly; the graph itself is checked by the one
``cuda`` test at the end (deselected here, run on a GPU machine) and by ``g4h device-check``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4_harness.fast import shapes
from gemma4_harness.fast.model import FastModel, moe_experts
from gemma4_harness.fast.model import moe_experts_static as static_moe
from gemma4_harness.fast.static_decode import StaticDecoder, kv_bytes
from gemma4_harness.harness import synth
from gemma4_harness.harness.bench import BenchOptions, bench
from gemma4_harness.harness.bench.run import BenchPlan
from gemma4_harness.harness.core.cases import MODELS_DIR
from gemma4_harness.harness.core.gates import resolve
from gemma4_harness.harness.parity.checks.fast import static_vs_paged
from gemma4_harness.reference import load_model
from gemma4_harness.reference.errors import InputError


def _model(name: str, dtype: str = "float32") -> tuple[object, FastModel]:
    spec = synth.load_spec(MODELS_DIR / f"{name}.toml")
    cfg, w = load_model(synth.ensure_built(spec.path).gguf["F32"])
    return spec, FastModel(cfg, w, "cpu", dtype)


@pytest.mark.parametrize("name", ["e2b", "26b-a4b", "edge-keqv-shared-donor"])
def test_static_decoder_gives_the_paged_engines_tokens_and_logits(name):
    """8 requests (two longer than three windows) decoded together: the paged engine's greedy tokens, logits
    within the static~paged gate. e2b: KV-shared tail and PLE; 26b-a4b: MoE (decode gathers, prefill runs
    every expert); edge-keqv: k_eq_v layers and a shared donor."""
    spec, fm = _model(name)
    gates = resolve(spec.gates, spec.name)
    r = static_vs_paged(fm)
    assert r["rows"] == 8 and r["steps"] == 12 and r["graphs"] is False
    assert gates["fast.static~paged.same_tokens"].check(r["same_tokens"])
    assert gates["fast.static~paged.max_abs_logit"].check(r["max_abs_logit"]), r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["31b", "e4b", "e4b-wide", "edge-no-softcap"])
def test_static_decoder_on_the_other_cases(name):
    spec, fm = _model(name)
    gates = resolve(spec.gates, spec.name)
    r = static_vs_paged(fm)
    assert gates["fast.static~paged.same_tokens"].check(r["same_tokens"])
    assert gates["fast.static~paged.max_abs_logit"].check(r["max_abs_logit"]), r


def test_a_fault_in_the_static_cache_is_caught():
    """The check can fail: a decoder whose cache drops the last written position (a stale slot) gives other
    logits, beyond the gate."""
    spec, fm = _model("e2b")
    gates = resolve(spec.gates, spec.name)
    orig = StaticDecoder._attention_block

    def broken(self, layer, x, st):
        out = orig(self, layer, x, st)
        if layer.has_kv and st.q_pos.shape[1] == 1:  # decode: forget the key just written
            self.cache.k[layer.index][st.rows].zero_()
        return out

    StaticDecoder._attention_block = broken
    try:
        r = static_vs_paged(fm)
    finally:
        StaticDecoder._attention_block = orig
    assert not gates["fast.static~paged.max_abs_logit"].check(r["max_abs_logit"])


@pytest.mark.parametrize("n", [1, 2, 7])
def test_moe_static_equals_the_expert_loop(n):
    """Both regimes of moe_experts_static (gather below 2NK < E, every expert above) against moe_experts."""
    g = torch.Generator().manual_seed(n)
    E, K, h, F = 8, 2, 32, 24
    x = torch.randn(n, h, generator=g)
    wgu, wd = torch.randn(E, 2 * F, h, generator=g) / h**0.5, torch.randn(E, h, F, generator=g) / F**0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    wgt = torch.rand(n, K, generator=g)
    gate = resolve({}, "moe")["fast.static~paged.max_abs_logit"]
    assert gate.check(float((static_moe(x, wgu, wd, idx, wgt) - moe_experts(x, wgu, wd, idx, wgt)).abs().max()))
    assert (2 * n * K < E) == (n == 1)  # n = 1 gathers, n = 2 and 7 run every expert


def test_bad_input_is_one_clear_error():
    _, fm = _model("e2b")
    with pytest.raises(InputError, match="CUDA graphs need a CUDA device"):
        StaticDecoder(fm, 1, 8, graphs=True)
    with pytest.raises(InputError, match="max_len 0"):
        StaticDecoder(fm, 1, 0)
    dec = StaticDecoder(fm, 2, 8)
    with pytest.raises(InputError, match="1 prompts for batch 2"):
        dec.prefill([[5, 6]])
    with pytest.raises(InputError, match="prompt 1 has 9 tokens"):
        dec.prefill([[5], list(range(4, 13))])
    with pytest.raises(InputError, match="token id outside"):
        dec.prefill([[5], [fm.cfg.vocab_size]])
    dec.prefill([[5] * 7, [6]])
    dec.decode(torch.tensor([5, 6]))
    with pytest.raises(InputError, match="reached max_len 8"):
        dec.decode(torch.tensor([5, 6]))
    with pytest.raises(InputError, match="decode takes"):
        dec.decode(torch.tensor([5]))


def test_cache_size_is_what_kv_bytes_says():
    _, fm = _model("e2b")
    dec = StaticDecoder(fm, 3, 50)
    assert dec.cache.nbytes() == kv_bytes(fm.cfg, 3, 50)
    assert sorted(dec.cache.k) == [L.index for L in fm.cfg.layers if L.has_kv]


@pytest.mark.parametrize("qtype", shapes.PACKED_TYPES)
def test_random_packed_blocks_decode_to_the_asked_spread(qtype):
    """A shape-only model drawn packed (g4h bench --quant): finite values, mean ~0 and std within 5 % of the
    matrix's init std (sampling error of 1e6 values is far below that; a wrong scale formula misses by > 50 %)."""
    cfg = shapes.load_shape("e2b", layers=1, vocab_size=512)
    W = shapes.RandomWeights(cfg, qtype=qtype)
    name = "blk.0.ffn_up.weight"
    assert W.is_packed(name) and W.raw_dtype(name) == qtype and not W.is_packed("blk.0.attn_norm.weight")
    v = W.torch_packed(name, "cpu").dequantize().double()
    std = W.init(name)[2]
    assert torch.isfinite(v).all()
    assert abs(float(v.mean())) < 0.05 * std
    assert abs(float(v.std()) / std - 1) < 0.05


def test_shape_only_packed_model_decodes_the_same_both_ways():
    cfg = shapes.load_shape("e2b", layers=2, vocab_size=1024)
    fm = FastModel(cfg, shapes.RandomWeights(cfg, qtype="Q8_0"), "cpu", "float32", keep_quantized=True)
    assert type(fm.w["blk.0.attn_q.weight"]).__name__ == "QuantizedTensor"
    ref = fm.logits([5, 6, 7, 8])[-1]
    got = StaticDecoder(fm, 1, 8).prefill([[5, 6, 7, 8]])[0]
    gate = resolve({}, "shape")["fast.static~paged.max_abs_logit"]
    assert gate.check(float((got - ref).abs().max()))


@pytest.mark.slow
def test_bench_times_fast_graph_beside_fast(tmp_path):
    """g4h bench with engines fast and fast-graph: tg rows for both, the same-run ratio fast-graph/fast and the
    batching gain of each (figures only, no timing asserted)."""
    plan = BenchPlan(engines=["fast", "fast-graph"], batches=[1, 2], pp=4, tg=3, reps=1, warmup=1)
    data, status, run_dir = bench(BenchOptions(model=str(MODELS_DIR / "e2b.toml"), engines=["fast", "fast-graph"],
                                               plan=plan, out=str(tmp_path)), lambda m: None)
    rows = {(r["engine"], r["test"], r["batch"]) for r in data["rows"] if r["reps_tok_s"]}
    assert {("fast-graph", "tg", 1), ("fast-graph", "tg", 2), ("fast", "pp", 1)} <= rows
    assert not any(r["engine"] == "fast-graph" and r["test"] == "pp" for r in data["rows"])
    assert {"tg3 b1 fast-graph-float32/fast-float32", "tg3 b2/b1 fast-graph-float32"} <= set(data["ratios"])
    assert all(np.isfinite(v) and v > 0 for v in data["ratios"].values())


def test_fast_and_fast_graph_share_one_built_model():
    """The bench's fast and fast-graph of one dtype hold one built model (one copy of a 31B model on the device,
    and both read the same bytes); another dtype gets its own."""
    from gemma4_harness.harness.bench.models import ModelSource, make_bench_engines

    src = ModelSource(None, "e2b", "cpu", 1, 0, None, 512)
    fast = make_bench_engines("fast", src, ["float32", "bfloat16"], "cpu", None)
    graph = make_bench_engines("fast-graph", src, ["float32"], "cpu", None, built=fast)
    assert graph[0].model is fast[0].model and fast[1].model is not fast[0].model
    assert graph[0].engine == "fast-graph" and graph[0].memory_plan.breakdown == fast[0].memory_plan.breakdown


def test_quant_needs_a_shape(tmp_path):
    with pytest.raises(InputError, match="--quant .* needs --shape"):
        bench(BenchOptions(model=str(MODELS_DIR / "e2b.toml"), quant="Q8_0", engines=["fast"],
                           plan=BenchPlan(engines=["fast"], pp=0, tg=2, reps=1), out=str(tmp_path)), lambda m: None)


@pytest.mark.cuda
def test_cuda_graph_replay_equals_the_eager_static_step():
    """On a GPU: the graph's tokens and logits equal the same decoder run eagerly (the same kernels, the same
    buffers), and the paged engine's within the gate."""
    spec, fm = _model("e2b")
    fm = FastModel(fm.cfg, load_model(synth.ensure_built(spec.path).gguf["F32"])[1], "cuda", "float32")
    prompts = [[2] + list(range(10, 40)), [2, 7, 9]]
    eager, graph = StaticDecoder(fm, 2, 64, graphs=False), StaticDecoder(fm, 2, 64, graphs=True)
    le, lg = eager.prefill(prompts), graph.prefill(prompts)
    for _ in range(8):
        assert torch.equal(le, lg)
        tok = le.argmax(-1)
        le, lg = eager.decode(tok).clone(), graph.decode(tok).clone()
    r = static_vs_paged(fm)
    gates = resolve(spec.gates, spec.name)
    assert r["graphs"] and gates["fast.static~paged.same_tokens"].check(r["same_tokens"])
    assert gates["fast.static~paged.max_abs_logit"].check(r["max_abs_logit"])
