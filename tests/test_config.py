"""Per-layer tables derived from GGUF metadata and HF config.json, and their errors."""

from __future__ import annotations

import numpy as np
import pytest

from gemma4_harness.reference.config import ConfigError, expected_tensors, kv_donors, proportional_freq_factors
from gemma4_harness.reference.config_gguf import config_from_gguf
from gemma4_harness.reference.config_hf import config_from_hf

S, F = True, False


def test_kv_donor_is_last_non_shared_layer_of_same_type():
    # layers: S S F S S F S F, last 3 shared -> 5 (F) -> 2, 6 (S) -> 4, 7 (F) -> 2
    types = [S, S, F, S, S, F, S, F]
    assert kv_donors(types, 3, "k") == [0, 1, 2, 3, 4, 2, 4, 2]
    assert kv_donors(types, 0, "k") == list(range(8))


def test_kv_donor_missing_type_names_key():
    with pytest.raises(ConfigError, match="shared_kv_layers.*layer 3 is full"):
        kv_donors([S, S, S, F], 1, "gemma4.attention.shared_kv_layers")


def test_proportional_factors_match_llama_cpp_convention():
    f = proportional_freq_factors(512, 0.25)
    assert f.dtype == np.float32 and f.shape == (256,)
    assert np.all(f[:64] == 1.0) and np.all(f[64:] == np.float32(1e30))


def _hf_base(**kw):
    c = {
        "model_type": "gemma4_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        "sliding_window": 8, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
    }
    c.update(kw)
    return c


def test_hf_global_fields_and_saved_per_layer_config_agree():
    a = config_from_hf(_hf_base(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True), "a")
    b = config_from_hf(_hf_base(attention_k_eq_v=True, per_layer_config={
        "2": {"head_dim": 32, "num_key_value_heads": 1}, "5": {"head_dim": 32, "num_key_value_heads": 1}}), "b")
    assert a.layers == b.layers
    full = a.layers[2]
    assert (full.head_dim, full.n_kv_head, full.has_v_proj, full.n_rot) == (32, 1, False, 32)
    assert np.array_equal(full.rope_freq_factors, proportional_freq_factors(32, 0.25))
    sl = a.layers[0]
    assert (sl.head_dim, sl.n_kv_head, sl.has_v_proj, sl.rope_freq_factors) == (16, 2, True, None)


@pytest.mark.parametrize("value", [5, "x", [1, 2], None])
def test_per_layer_config_entry_not_an_object_is_one_line(value):
    with pytest.raises(ConfigError) as e:
        config_from_hf(_hf_base(per_layer_config={"0": value}), "cfg.json")
    msg = str(e.value)
    assert "\n" not in msg and "cfg.json" in msg and "per_layer_config['0']" in msg


def test_hf_global_kv_heads_ignored_without_k_eq_v():
    # transformers applies num_global_key_value_heads only when attention_k_eq_v is set
    c = config_from_hf(_hf_base(global_head_dim=32, num_global_key_value_heads=1), "x")
    assert c.layers[2].n_kv_head == 2 and c.layers[2].has_v_proj


def test_hf_double_wide_mlp_on_shared_layers_only():
    c = config_from_hf(_hf_base(num_kv_shared_layers=2, use_double_wide_mlp=True, global_head_dim=32), "x")
    assert [l.n_ff for l in c.layers] == [128] * 4 + [256] * 2
    assert [l.kv_donor for l in c.layers] == [0, 1, 2, 3, 3, 2]


def test_hf_multimodal_text_config():
    c = config_from_hf({"model_type": "gemma4", "text_config": _hf_base(global_head_dim=32)}, "mm")
    assert c.n_layer == 6 and c.layers[5].head_dim == 32


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "llama", "model_type"),
    ("layer_types", ["sliding_attention"] * 5, "layer_types has 5"),
    ("num_kv_shared_layers", 6, "num_kv_shared_layers"),
    ("hidden_activation", "silu", "hidden_activation"),
    ("num_attention_heads", 3, "head_count 3 is not a multiple"),
])
def test_hf_bad_fields_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf(_hf_base(global_head_dim=32, **{field: value}), "cfg.json")


def _gguf_meta(**kw):
    m = {
        "general.architecture": "gemma4", "gemma4.block_count": 6, "gemma4.embedding_length": 64,
        "gemma4.feed_forward_length": 128, "gemma4.attention.head_count": 4, "gemma4.attention.head_count_kv": 2,
        "gemma4.attention.key_length": 32, "gemma4.attention.value_length": 32,
        "gemma4.attention.key_length_swa": 16, "gemma4.attention.value_length_swa": 16,
        "gemma4.attention.layer_norm_rms_epsilon": 1e-6, "gemma4.attention.sliding_window": 8,
        "gemma4.attention.sliding_window_pattern": [True, True, False, True, True, False],
        "gemma4.rope.freq_base": 1e6, "gemma4.rope.freq_base_swa": 1e4,
        "gemma4.rope.dimension_count": 32, "gemma4.rope.dimension_count_swa": 16,
    }
    m.update(kw)
    return m


def _tensors(meta):
    return {"token_embd.weight": (256, 64), **{f"blk.{i}.attn_v.weight": (1,) for i in range(6)}}


def test_gguf_config_matches_hf_config():
    meta = _gguf_meta(**{"gemma4.final_logit_softcapping": 30.0})
    g = config_from_gguf(meta, _tensors(meta), "g.gguf")
    h = config_from_hf(_hf_base(global_head_dim=32, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}), "h")
    for a, b in zip(g.layers, h.layers):
        assert (a.is_sliding, a.head_dim, a.n_kv_head, a.n_rot, a.rope_base, a.kv_donor) == \
               (b.is_sliding, b.head_dim, b.n_kv_head, b.n_rot, b.rope_base, b.kv_donor)
    assert g.rms_eps == h.rms_eps == float(np.float32(1e-6))
    assert g.final_logit_softcap == h.final_logit_softcap == 30.0


@pytest.mark.parametrize("change,match", [
    ({"general.architecture": "llama"}, "general.architecture"),
    ({"gemma4.attention.sliding_window_pattern": None}, "sliding_window_pattern"),
    ({"gemma4.attention.sliding_window_pattern": [True, False]}, "sliding_window_pattern: expected 6"),
    ({"gemma4.feed_forward_length": [128, 128]}, "feed_forward_length: per-layer array has 2"),
    ({"gemma4.attention.value_length": 16}, "value_length = 16 differs"),
    ({"gemma4.attention.layer_norm_rms_epsilon": -1.0}, "layer_norm_rms_epsilon"),
    ({"gemma4.attention.shared_kv_layers": 9}, "shared_kv_layers = 9"),
    ({"gemma4.rope.dimension_count": 48}, "rope dimension count 48"),
    ({"gemma4.block_count": None}, "missing key gemma4.block_count"),
])
def test_gguf_bad_metadata_names_the_key(change, match):
    meta = _gguf_meta(**{k: v for k, v in change.items()})
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        config_from_gguf(meta, _tensors(meta), "bad.gguf")


def test_gguf_gemma3_defaults():
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 12, "gemma3.embedding_length": 64,
            "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 16,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 8,
            "gemma3.rope.freq_base": 1e6}
    c = config_from_gguf(meta, _tensors(meta) | {f"blk.{i}.attn_v.weight": (1,) for i in range(12)}, "g3")
    assert [l.is_sliding for l in c.layers] == [True] * 5 + [False] + [True] * 5 + [False]
    assert {l.rope_base for l in c.layers if l.is_sliding} == {10000.0}
    assert {l.rope_base for l in c.layers if not l.is_sliding} == {1e6}
    assert c.attn_scale == 1 / 4 and not c.has_v_norm and not c.has_layer_scalar


def test_expected_tensors_shared_and_k_eq_v_layers_have_no_kv():
    c = config_from_hf(_hf_base(global_head_dim=32, attention_k_eq_v=True, num_kv_shared_layers=2), "x")
    t = expected_tensors(c)
    assert "blk.2.attn_v.weight" not in t and "blk.2.attn_k.weight" in t  # k_eq_v full layer
    assert "blk.4.attn_k.weight" not in t and "blk.5.attn_k.weight" not in t  # shared
    assert t["blk.2.attn_q.weight"] == (4 * 32, 64)
