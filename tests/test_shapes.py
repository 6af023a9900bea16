"""Shape-only models (fast/shapes.py): real Gemma 4 dimensions, random weights made on the device.

Only small truncations run on the CPU here; the full-size models are for ``g4h bench`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from gemma4_harness.fast import shapes
from gemma4_harness.fast.model import FastModel, FastWeights, SeqStep
from gemma4_harness.reference.config import expected_tensors
from gemma4_harness.reference.errors import InputError

NAMES = ["e2b", "e4b", "26b-a4b", "31b"]

# Published sizes (Gemma 4 model card, as quoted by github.com/Avarok-Cybersecurity/atlas pull 406 and
# others): E2B 2.3B effective / 5.1B with embeddings, E4B 4.5B effective / 8B with embeddings, 26B-A4B
# 25.2B total / 3.8B active, 31B 30.7B. The E2B/E4B totals include the vision (~0.15B) and audio (~0.3B)
# encoders, which a text-only shape does not have, so their text totals sit ~0.45B lower. "effective"
# here is the total without the PLE lookup table. Ranges: the published figure +- rounding, or for the
# E-model totals [published - encoders - 0.25B, published].
EXPECTED_PARAMS = {
    "e2b": {"total": (4.4e9, 5.1e9), "effective": (2.1e9, 2.5e9)},
    "e4b": {"total": (7.2e9, 8.0e9), "effective": (4.2e9, 4.8e9)},
    "26b-a4b": {"total": (24.7e9, 25.7e9), "active": (3.6e9, 4.0e9)},
    "31b": {"total": (30.2e9, 31.2e9), "active": (30.2e9, 31.2e9)},
}

# Real dimensions, spot-checked against the derived per-layer table (sources: cases/shapes/*.toml).
REAL = {
    # name: hidden, layers, (sliding head_dim, KV heads), (full head_dim, KV heads), FFN widths, n_kv_shared, PLE
    "e2b": (1536, 35, (256, 1), (512, 1), {6144, 12288}, 20, 256),
    "e4b": (2560, 42, (256, 2), (512, 2), {10240}, 18, 256),
    "26b-a4b": (2816, 30, (256, 8), (512, 2), {2112}, 0, 0),
    "31b": (5376, 60, (256, 16), (512, 4), {21504}, 0, 0),
}

# Small enough for the CPU: real-width layers, few of them, a 512-token vocabulary; the 26B-A4B
# keeps 4 of its 128 experts (top 2) and the 31B one full layer with a narrow MLP.
SMALL = {
    "e2b": dict(layers=6),  # 6 layers: the last is KV-shared with the double-wide MLP
    "e4b": dict(layers=1),
    "26b-a4b": dict(layers=2, overrides={"num_experts": 4, "top_k_experts": 2}),
    "31b": dict(layers=1, overrides={"intermediate_size": 512}),
}


def small(name: str):
    return shapes.load_shape(name, vocab_size=512, **SMALL[name])


def test_shipped_names():
    assert shapes.shape_names() == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_shape_has_real_dims_and_param_count(name):
    cfg = shapes.load_shape(name)
    hidden, n_layer, swa, full, widths, n_shared, ple = REAL[name]
    assert (cfg.hidden_size, cfg.n_layer, cfg.vocab_size) == (hidden, n_layer, 262144)
    assert {(l.head_dim, l.n_kv_head) for l in cfg.layers if l.is_sliding} == {swa}
    assert {(l.head_dim, l.n_kv_head) for l in cfg.layers if not l.is_sliding} == {full}
    assert {l.n_ff for l in cfg.layers} == widths
    assert (cfg.n_kv_shared, cfg.ple_dim) == (n_shared, ple)
    assert (cfg.final_logit_softcap, cfg.tie_word_embeddings, cfg.sliding_window) == (30.0, True, 512 if ple else 1024)
    assert not cfg.layers[-1].is_sliding
    counts = shapes.param_counts(cfg)
    print(f"{name}: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in counts.items()))
    for key, (lo, hi) in EXPECTED_PARAMS[name].items():
        assert lo <= counts[key] <= hi, (name, key, counts[key])


def test_moe_and_k_eq_v_facts():
    moe = shapes.load_shape("26b-a4b")
    assert (moe.n_expert, moe.n_expert_used, moe.n_ff_exp) == (128, 8, 704)
    assert all(l.has_moe for l in moe.layers)
    for name in ("26b-a4b", "31b"):
        cfg = shapes.load_shape(name)
        assert all(l.has_v_proj == l.is_sliding for l in cfg.layers)  # k_eq_v full layers have no V projection
    e2b = shapes.load_shape("e2b")
    assert [l.kv_donor for l in e2b.layers[15:20]] == [13, 13, 13, 13, 14]
    assert all(l.n_ff == 12288 for l in e2b.layers[15:]) and all(l.n_ff == 6144 for l in e2b.layers[:15])


@pytest.mark.parametrize("name", NAMES)
def test_random_weights_cover_expected_tensors_at_full_size(name):
    cfg = shapes.load_shape(name)
    w = shapes.RandomWeights(cfg)
    exp = expected_tensors(cfg)
    assert list(w) == list(exp) and len(w) == len(exp)
    assert all(w.shape(k) == s for k, s in exp.items())


@pytest.mark.parametrize("name", NAMES)
def test_random_weights_make_every_tensor(name):
    cfg = small(name)
    fw = FastWeights(cfg, shapes.RandomWeights(cfg, seed=3), torch.device("cpu"), torch.bfloat16)
    exp = expected_tensors(cfg)
    assert set(fw.t) == set(exp)
    for k, shape in exp.items():
        t = fw[k]
        assert tuple(t.shape) == shape, k
        keep32 = len(shape) == 1 or any(s in k for s in FastWeights.FLOAT32_ALWAYS)
        assert t.dtype == (torch.float32 if keep32 else torch.bfloat16), k
        assert torch.isfinite(t).all(), k


def test_random_weights_deterministic_and_scaled(monkeypatch):
    cfg = small("e2b")
    w = shapes.RandomWeights(cfg, seed=7)
    name = "blk.0.ffn_down.weight"  # [1536, 6144]
    a = w.torch_tensor(name, "cpu", torch.float32)
    assert torch.equal(a, shapes.RandomWeights(cfg, seed=7).torch_tensor(name, "cpu", torch.float32))
    assert not torch.equal(a, shapes.RandomWeights(cfg, seed=8).torch_tensor(name, "cpu", torch.float32))
    assert not torch.equal(a, w.torch_tensor("blk.1.ffn_down.weight", "cpu", torch.float32))
    assert torch.equal(w.torch_tensor(name, "cpu", torch.bfloat16), a.to(torch.bfloat16))
    assert abs(a.std().item() * 6144**0.5 - 1) < 0.01 and abs(a.mean().item()) < 1e-3
    emb = w.torch_tensor("token_embd.weight", "cpu", torch.float32)
    assert abs(emb.std().item() * 1536**0.5 - 1) < 0.02
    qn = w.torch_tensor("blk.0.attn_q_norm.weight", "cpu", torch.float32)
    assert 0.75 * 256**-0.25 <= qn.min() and qn.max() <= 1.25 * 256**-0.25
    norm = w.torch_tensor("blk.0.attn_norm.weight", "cpu", torch.float32)
    assert 0.5 <= norm.min() and norm.max() <= 1.5 and norm.std() > 0.2
    # Big tensors are drawn block by block: blocks continue the stream, they do not repeat.
    monkeypatch.setattr(shapes, "BLOCK_ELEMENTS", 6144 * 100)
    b = w.torch_tensor(name, "cpu", torch.float32)
    assert torch.equal(b, w.torch_tensor(name, "cpu", torch.float32))
    assert not torch.equal(b[:100], b[100:200])


def test_truncate_layers_keeps_kv_sharing_valid():
    e2b = shapes.load_shape("e2b")
    t = shapes.truncate_layers(e2b, 10)  # real share 20/35 -> 6 of 10, reduced to 5 so the full layer 9 has a donor
    assert (t.n_layer, t.n_kv_shared) == (10, 5)
    assert [l.kv_donor for l in t.layers] == [0, 1, 2, 3, 4, 3, 3, 3, 3, 4]
    assert [l.n_ff for l in t.layers] == [6144] * 5 + [12288] * 5
    assert [l.has_kv for l in t.layers] == [True] * 5 + [False] * 5
    two = shapes.truncate_layers(e2b, 2)
    assert (two.n_kv_shared, [l.is_sliding for l in two.layers]) == (0, [True, False])
    assert expected_tensors(two)["per_layer_token_embd.weight"] == (262144, 2 * 256)
    e4b = shapes.truncate_layers(shapes.load_shape("e4b"), 12)
    assert e4b.n_kv_shared == 5 and [l.kv_donor for l in e4b.layers][6:] == [6, 6, 6, 6, 6, 5]
    assert shapes.truncate_layers(e2b, 35) is e2b
    for bad in (0, 36, "2"):
        with pytest.raises(InputError, match="layers"):
            shapes.truncate_layers(e2b, bad)


@pytest.mark.parametrize("name", ["e2b", "26b-a4b"])
def test_fast_model_decode_step_on_cpu(name):
    cfg = small(name)
    fm = FastModel(cfg, shapes.RandomWeights(cfg, seed=1), "cpu", "float32")
    cache = fm.new_cache(1, 16)
    slot = cache.alloc()
    with torch.inference_mode():
        fm.step(cache, [SeqStep(slot, torch.tensor([2, 17, 301]), 0)])  # prefill
        logits = fm.step(cache, [SeqStep(slot, torch.tensor([42]), 3)])  # one decode step
    assert logits.shape == (1, 512)
    assert torch.isfinite(logits).all()
    assert logits.abs().max() <= 30.0 and logits.std() > 0.1  # softcapped, not degenerate


def test_bad_input(tmp_path):
    with pytest.raises(InputError, match="unknown.*e2b"):
        shapes.load_shape("e3b")
    with pytest.raises(InputError, match="not found"):
        shapes.load_shape(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("description = 1\n")
    with pytest.raises(InputError, match=r"bad\.toml: description: expected a string"):
        shapes.load_shape(bad)
    bad.write_text("description = 'x'\nsource = 'y'\n[config]\nhidden_size = 8\n")
    with pytest.raises(InputError, match=r"bad\.toml: missing field num_hidden_layers"):
        shapes.load_shape(bad)
    bad.write_text("not toml [")
    with pytest.raises(InputError, match=r"bad\.toml: not valid TOML"):
        shapes.load_shape(bad)
    with pytest.raises(InputError, match=r"e2b\.toml: override 'hidden_sizes'"):
        shapes.load_shape("e2b", overrides={"hidden_sizes": 8})
    with pytest.raises(InputError, match="vocab_size override"):
        shapes.load_shape("e2b", vocab_size=0)
    with pytest.raises(InputError, match="seed"):
        shapes.RandomWeights(small("e4b"), seed=-1)
