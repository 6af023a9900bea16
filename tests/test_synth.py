"""Tests for harness.synth: specs, deterministic weights, HF and GGUF writers, cache."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import PROMPTS, builtin_specs
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.reference.names import gguf_to_hf, hf_to_gguf

BUILTIN = {p.stem: p for p in builtin_specs()}
REQUIRED = ("e2b", "e4b", "31b", "26b-a4b")

MINIMAL_SPEC = '''\
description = "test spec"
seed = 7

[config]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 1
head_dim = 32
global_head_dim = 64
layer_types = ["sliding_attention", "full_attention"]
sliding_window = 16
hidden_size_per_layer_input = 0
tie_word_embeddings = true
final_logit_softcapping = 30.0

[config.rope_parameters.sliding_attention]
rope_type = "default"
rope_theta = 10000.0

[config.rope_parameters.full_attention]
rope_type = "proportional"
partial_rotary_factor = 0.25
rope_theta = 1000000.0

[init]
'''


def _write(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _quiet_transformers():
    from transformers.utils import logging as tl

    tl.set_verbosity_error()
    tl.disable_progress_bar()


_quiet_transformers()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every builtin spec built once into a temporary cache."""
    root = tmp_path_factory.mktemp("synth-cache")
    return {name: synth.ensure_built(p, cache_dir=root) for name, p in BUILTIN.items()}


# --------------------------------------------------------------------------- specs


def test_builtin_specs_present_and_valid():
    for name in REQUIRED:
        assert name in BUILTIN, f"cases/models/{name}.toml missing"
    for name, p in BUILTIN.items():
        spec = synth.load_spec(p)
        assert spec.name == name
        assert spec.description and "\n" not in spec.description
        c = spec.config
        assert c["vocab_size"] == 512 and c["sliding_window"] == 16
        # small enough for CI (the widest built-in case, e4b-wide, is 512), rows fill Q4_0/Q8_0 blocks
        assert 64 <= c["hidden_size"] <= 512 and c["hidden_size"] % 32 == 0
        assert c["head_dim"] % 32 == 0 and c["global_head_dim"] % 32 == 0
        assert c["layer_types"][-1] == "full_attention"


def test_required_specs_exercise_their_features():
    specs = {n: synth.load_spec(BUILTIN[n]) for n in REQUIRED}
    s = {n: spec.config for n, spec in specs.items()}
    layers = {n: synth.text_config(spec).layers for n, spec in specs.items()}
    for n in REQUIRED:
        assert s[n]["final_logit_softcapping"] == 30.0
    shared = [L for L in layers["e2b"] if not L.has_kv]
    assert {L.type_name for L in shared} == {"sliding_attention", "full_attention"}
    assert s["e2b"]["hidden_size_per_layer_input"] == 16 and s["e2b"]["use_double_wide_mlp"]
    assert s["e2b"]["tie_word_embeddings"] and s["e2b"]["num_key_value_heads"] == 1
    assert s["e4b"]["tie_word_embeddings"] is True and s["e4b"]["num_key_value_heads"] == 2  # as released E4B
    assert any(not L.has_kv for L in layers["e4b"])
    p31 = layers["31b"]
    assert s["31b"]["hidden_size_per_layer_input"] == 0 and all(L.has_kv for L in p31)
    assert [L.n_kv_head for L in p31 if not L.is_sliding] == [1, 1]
    assert {L.n_kv_head for L in p31 if L.is_sliding} == {2}
    assert not any(L.has_v_proj for L in p31 if not L.is_sliding)
    moe = s["26b-a4b"]
    assert moe["enable_moe_block"] and (moe["num_experts"], moe["top_k_experts"], moe["moe_intermediate_size"]) == (8, 2, 32)


def test_config_keys_are_real_gemma4_fields():
    fields = {f.name for f in dataclasses.fields(transformers.Gemma4TextConfig)}
    extra = synth.CONFIG_KEYS - {"global_head_dim", "num_global_key_value_heads"}
    assert extra <= fields, sorted(extra - fields)


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda t: t.replace("hidden_size = 64\n", ""), "config.hidden_size"),
        (lambda t: t.replace("seed = 7\n", ""), "seed"),
        (lambda t: t.replace('description = "test spec"\n', ""), "description"),
        (lambda t: t.replace("[init]\n", ""), "init"),
        (lambda t: t.replace("hidden_size = 64\n", "hidden_size = 64\nhiden_size = 3\n"), "config.hiden_size"),
        (lambda t: t + "embed_sdt = 0.1\n", "init.embed_sdt"),
        (lambda t: t + "embed_std = \"big\"\n", "init.embed_std"),
        (lambda t: t.replace('["sliding_attention", "full_attention"]', '["full_attention", "sliding_attention"]'),
         "config.layer_types"),
        (lambda t: t.replace('["sliding_attention", "full_attention"]', '["sliding_attention"]'), "config.layer_types"),
        (lambda t: t.replace("tie_word_embeddings = true\n", "tie_word_embeddings = true\nnum_kv_shared_layers = 1\n"),
         "config.num_kv_shared_layers"),
        (lambda t: t.replace("hidden_size_per_layer_input = 0", "hidden_size_per_layer_input = 16"),
         "config.vocab_size_per_layer_input"),
        (lambda t: t.replace("num_key_value_heads = 1", "num_key_value_heads = 3"), "config.num_key_value_heads"),
        (lambda t: t.replace("tie_word_embeddings = true\n", "tie_word_embeddings = true\nenable_moe_block = true\n"),
         "config.num_experts"),
        (lambda t: t.replace("hidden_size = 64", "hidden_size = \"64\""), "config.hidden_size"),
        (lambda t: t.replace("seed = 7", "seed = [7"), "not valid TOML"),
    ],
)
def test_spec_errors_name_file_and_key(tmp_path, edit, key):
    p = _write(tmp_path, edit(MINIMAL_SPEC))
    with pytest.raises(synth.SpecError) as ei:
        synth.load_spec(p)
    msg = str(ei.value)
    assert "\n" not in msg
    assert str(p) in msg and key in msg, msg
    assert isinstance(ei.value, ValueError)


def test_missing_spec_file(tmp_path):
    with pytest.raises(synth.SpecError, match="cannot read"):
        synth.load_spec(tmp_path / "nope.toml")


def test_minimal_spec_loads_with_defaults(tmp_path):
    spec = synth.load_spec(_write(tmp_path, MINIMAL_SPEC, "tiny.toml"))
    assert spec.name == "tiny" and spec.seed == 7
    assert spec.init["output_std"] == spec.init["embed_std"]
    assert set(spec.init) == set(synth.INIT_DEFAULTS)
    import hashlib

    assert spec.sha256 == hashlib.sha256(MINIMAL_SPEC.encode()).hexdigest()


# --------------------------------------------------------------------------- weights


def test_weights_are_deterministic_and_seeded(tmp_path):
    spec = synth.load_spec(BUILTIN["e2b"])
    a = synth.make_weights(spec)
    b = synth.make_weights(synth.load_spec(BUILTIN["e2b"]))
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == np.float32 and a[k].flags.c_contiguous
        assert a[k].tobytes() == b[k].tobytes(), k
    c = synth.make_weights(dataclasses.replace(spec, seed=spec.seed + 1))
    assert not np.array_equal(a["token_embd.weight"], c["token_embd.weight"])
    assert not np.array_equal(a["blk.0.attn_norm.weight"], c["blk.0.attn_norm.weight"])
    # distinct tensors of the same shape are not copies of each other
    assert not np.array_equal(a["blk.0.ffn_gate.weight"], a["blk.0.ffn_up.weight"])
    assert not np.array_equal(a["blk.0.attn_norm.weight"], a["blk.0.ffn_norm.weight"])


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_key_set_and_shapes_match_transformers(name):
    spec = synth.load_spec(BUILTIN[name])
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**spec.config))
    sd = model.state_dict()
    model_keys = set(sd)
    if spec.config["tie_word_embeddings"]:
        model_keys.discard("lm_head.weight")
    w = synth.make_weights(spec)
    assert {gguf_to_hf(k) for k in w} == model_keys
    for k, arr in w.items():
        assert hf_to_gguf(gguf_to_hf(k)) == k
        assert tuple(sd[gguf_to_hf(k)].shape) == arr.shape, k
        assert np.isfinite(arr).all(), k


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_ones_initialised_tensors_are_randomised(name):
    spec = synth.load_spec(BUILTIN[name])
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**spec.config))
    ones = [k for k, v in model.state_dict().items() if v.numel() and bool((v == 1).all())]
    assert any(k.endswith("layer_scalar") for k in ones)
    assert any(k.endswith("input_layernorm.weight") for k in ones)
    if spec.config.get("enable_moe_block"):
        assert any(k.endswith("router.scale") for k in ones)
        assert any(k.endswith("router.per_expert_scale") for k in ones)
    w = synth.make_weights(spec)
    for k in ones:
        arr = w[hf_to_gguf(k)]
        # weights are bf16-representable (real checkpoints ship in bf16), so an element can land
        # on 1.0 exactly now and then; what must not happen is a constant or all-ones tensor
        assert not np.all(arr == 1.0), k
        assert np.mean(arr == 1.0) < 0.05, k
        if arr.size > 1:
            assert arr.std() > 0.05, k
    scalars = np.array([w[f"blk.{i}.layer_output_scale.weight"][0] for i in range(spec.config["num_hidden_layers"])])
    assert len(set(scalars.tolist())) > len(scalars) // 2  # per-layer values (bf16 grid: a repeat can happen)
    assert ((scalars >= 0.5) & (scalars <= 1.5)).all()


def test_rope_freqs_encode_proportional_rope():
    spec = synth.load_spec(BUILTIN["31b"])
    f = synth.rope_freqs(spec.config)
    assert f.dtype == np.float32 and f.shape == (32,)
    assert (f[:8] == 1.0).all() and (f[8:] == np.float32(1e30)).all()
    # same rotated set as transformers' proportional inv_freq (non-zero entries)
    cfg = transformers.Gemma4TextConfig(**spec.config)
    rot = transformers.Gemma4ForCausalLM(cfg).model.rotary_emb
    inv = rot.full_attention_inv_freq
    assert int((inv != 0).sum()) == int((f == 1.0).sum())


# --------------------------------------------------------------------------- built files


def test_hf_checkpoint_round_trips(built):
    from safetensors import safe_open

    for name, case in built.items():
        w = synth.make_weights(case.spec)
        with safe_open(str(case.hf_dir / "model.safetensors"), framework="np") as f:
            keys = set(f.keys())
            assert {hf_to_gguf(k) for k in keys} == set(w), name
            for k in keys:
                assert f.get_tensor(k).tobytes() == w[hf_to_gguf(k)].tobytes(), (name, k)
        tied = case.spec.config["tie_word_embeddings"]
        assert ("lm_head.weight" in keys) == (not tied), name
        cfg = json.loads((case.hf_dir / "config.json").read_text())
        assert cfg["model_type"] == "gemma4_text"
        assert cfg["global_head_dim"] == case.spec.config["global_head_dim"]
        assert cfg["hidden_size_per_layer_input"] == case.spec.config["hidden_size_per_layer_input"]
        full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
        # transformers zero-pads the layer keys ("05", "11") so they sort
        assert sorted(int(k) for k in cfg["per_layer_config"]) == full
        for k, v in cfg["per_layer_config"].items():
            assert v["head_dim"] == case.spec.config["global_head_dim"]


def test_hf_reload_config_and_no_ple_when_zero(built):
    case = built["31b"]
    model = transformers.Gemma4ForCausalLM.from_pretrained(case.hf_dir, dtype=torch.float32)
    assert not hasattr(model.model, "embed_tokens_per_layer")
    attn_full = model.model.layers[5].self_attn
    attn_sliding = model.model.layers[0].self_attn
    assert attn_full.head_dim == 64 and attn_full.v_proj is None and attn_full.k_proj.out_features == 64
    assert attn_sliding.head_dim == 32 and attn_sliding.k_proj.out_features == 64
    e2b = transformers.Gemma4ForCausalLM.from_pretrained(built["e2b"].hf_dir, dtype=torch.float32)
    assert e2b.model.embed_tokens_per_layer.weight.shape == (512, 160)
    assert e2b.model.layers[9].mlp.intermediate_size == 256 and e2b.model.layers[4].mlp.intermediate_size == 128
    assert not hasattr(e2b.model.layers[9].self_attn, "k_proj")


def _read_gguf(path):
    r = gguf.GGUFReader(str(path))
    return r, {t.name: t for t in r.tensors}


def test_gguf_f32_is_bit_exact_and_complete(built):
    for name, case in built.items():
        w = synth.make_weights(case.spec)
        _, ts = _read_gguf(case.gguf["F32"])
        want = set(w) | {"rope_freqs.weight"}
        assert set(ts) == want, name
        tied = case.spec.config["tie_word_embeddings"]
        assert ("output.weight" in ts) == (not tied)
        for k, arr in w.items():
            t = ts[k]
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert [int(x) for x in t.shape] == list(arr.shape[::-1]), k  # GGUF ne is reversed
            back = np.asarray(t.data).reshape(arr.shape)
            assert back.tobytes() == arr.tobytes(), (name, k)
        rf = np.asarray(ts["rope_freqs.weight"].data)
        assert rf.tobytes() == synth.rope_freqs(case.spec.config).tobytes()


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_gguf_quantized_reads_back_exactly(built, qtype):
    qt = gguf.GGMLQuantizationType[qtype]
    for name in ("e2b", "26b-a4b"):
        case = built[name]
        w = synth.make_weights(case.spec)
        _, ts = _read_gguf(case.gguf[qtype])
        n_quant = 0
        for k, arr in w.items():
            t = ts[k]
            if arr.ndim == 1:
                assert t.tensor_type == gguf.GGMLQuantizationType.F32, k
                assert np.asarray(t.data).tobytes() == arr.tobytes()
                continue
            if qtype.startswith("Q") and arr.shape[-1] % 32:
                assert t.tensor_type == gguf.GGMLQuantizationType.F16, k  # PLE proj rows of 16
                continue
            assert t.tensor_type == qt, k
            n_quant += 1
            back = gguf.quants.dequantize(t.data, t.tensor_type)
            assert back.shape == arr.shape, k
            ref = gguf.quants.dequantize(gguf.quants.quantize(arr, qt), qt)
            assert np.array_equal(back, ref), (name, k)
            if qtype == "BF16":
                # synthetic weights are bf16-representable (as real checkpoints are): held exactly
                assert np.array_equal(back, arr), k
                continue
            if qtype == "F16":
                # bf16 values fit f16's mantissa; only those below f16's normal range (2^-14) round
                normal = np.abs(arr) >= 2.0**-14
                assert np.array_equal(back[normal], arr[normal]), k
                assert np.abs(back - arr).max() <= 2.0**-24, k
                continue
            # a quantized type is a real (lossy) encoding of the weights, not a copy
            assert not np.array_equal(back, arr)
            rel = np.abs(back - arr).max() / np.abs(arr).max()
            assert rel < {"Q8_0": 1e-2, "Q4_0": 0.15}[qtype], (k, rel)
        assert n_quant > 10
        if name == "26b-a4b":
            t = ts["blk.0.ffn_gate_up_exps.weight"]
            assert [int(x) for x in t.shape] == [64, 64, 8]


def _fields(path):
    r = gguf.GGUFReader(str(path))
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        out[k] = ([t.name for t in f.types], f.contents())
    return out


def test_gguf_metadata_e2b(built):
    f = _fields(built["e2b"].gguf["Q8_0"])
    assert f["general.architecture"] == (["STRING"], "gemma4")
    assert f["general.file_type"] == (["UINT32"], 7)
    assert f["gemma4.block_count"] == (["UINT32"], 10)
    assert f["gemma4.embedding_length"] == (["UINT32"], 64)
    assert f["gemma4.feed_forward_length"] == (["ARRAY", "UINT32"], [128] * 5 + [256] * 5)
    assert f["gemma4.attention.head_count"] == (["UINT32"], 4)
    assert f["gemma4.attention.head_count_kv"] == (["UINT32"], 1)
    assert f["gemma4.attention.key_length"] == (["UINT32"], 64)
    assert f["gemma4.attention.value_length"] == (["UINT32"], 64)
    assert f["gemma4.attention.key_length_swa"] == (["UINT32"], 32)
    assert f["gemma4.attention.value_length_swa"] == (["UINT32"], 32)
    assert f["gemma4.attention.sliding_window"] == (["UINT32"], 16)
    pattern = [True] * 4 + [False] + [True] * 4 + [False]
    assert f["gemma4.attention.sliding_window_pattern"] == (["ARRAY", "BOOL"], pattern)
    assert f["gemma4.attention.shared_kv_layers"] == (["UINT32"], 5)
    assert f["gemma4.embedding_length_per_layer_input"] == (["UINT32"], 16)
    assert f["gemma4.rope.freq_base"] == (["FLOAT32"], 1e6)
    assert f["gemma4.rope.freq_base_swa"] == (["FLOAT32"], 1e4)
    assert f["gemma4.rope.dimension_count"] == (["UINT32"], 64)
    assert f["gemma4.rope.dimension_count_swa"] == (["UINT32"], 32)
    assert f["gemma4.final_logit_softcapping"] == (["FLOAT32"], 30.0)
    t, eps = f["gemma4.attention.layer_norm_rms_epsilon"]
    assert t == ["FLOAT32"] and eps == pytest.approx(1e-6)
    assert "gemma4.expert_count" not in f
    # vocabulary
    assert f["tokenizer.ggml.model"] == (["STRING"], "llama")
    t, toks = f["tokenizer.ggml.tokens"]
    assert t == ["ARRAY", "STRING"] and len(toks) == 512
    assert toks[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"] and toks[4] == "<0x00>" and toks[259] == "<0xFF>"
    t, types = f["tokenizer.ggml.token_type"]
    assert t == ["ARRAY", "INT32"] and types[:4] == [3, 3, 3, 2] and set(types[4:260]) == {6} and set(types[260:]) == {1}
    assert f["tokenizer.ggml.scores"][0] == ["ARRAY", "FLOAT32"] and len(f["tokenizer.ggml.scores"][1]) == 512
    assert f["tokenizer.ggml.bos_token_id"] == (["UINT32"], 2)
    assert f["tokenizer.ggml.eos_token_id"] == (["UINT32"], 1)
    assert f["tokenizer.ggml.add_bos_token"] == (["BOOL"], True)


def test_gguf_metadata_moe_and_keqv(built):
    f = _fields(built["26b-a4b"].gguf["F32"])
    assert f["general.file_type"] == (["UINT32"], 0)
    assert f["gemma4.feed_forward_length"] == (["UINT32"], 128)
    assert f["gemma4.attention.head_count_kv"] == (["ARRAY", "UINT32"], [2, 2, 2, 2, 2, 1])
    assert f["gemma4.attention.shared_kv_layers"] == (["UINT32"], 0)
    assert f["gemma4.embedding_length_per_layer_input"] == (["UINT32"], 0)
    assert f["gemma4.expert_count"] == (["UINT32"], 8)
    assert f["gemma4.expert_used_count"] == (["UINT32"], 2)
    assert f["gemma4.expert_feed_forward_length"] == (["UINT32"], 32)
    f31 = _fields(built["31b"].gguf["F32"])
    assert f31["gemma4.attention.head_count_kv"] == (["ARRAY", "UINT32"], [2] * 5 + [1] + [2] * 5 + [1])
    e4b = _fields(built["e4b"].gguf["F32"])
    assert e4b["gemma4.attention.head_count_kv"] == (["UINT32"], 2)
    if "edge-no-softcap" in built:
        assert "gemma4.final_logit_softcapping" not in _fields(built["edge-no-softcap"].gguf["F32"])


def test_the_builtin_plan_still_tests_untied_heads():
    """e4b ties its head as released E4B does; untied heads stay in the built-in parity plan (every case of
    ``cases/models/`` runs in ``g4h parity``): e4b-wide (PLE, KV sharing, hidden 512) and edge-no-softcap, whose
    checkpoints carry ``lm_head.weight`` / ``output.weight``."""
    from gemma4_harness.harness.core.cases import builtin_specs

    untied = {p.stem for p in builtin_specs() if not synth.load_spec(p).config["tie_word_embeddings"]}
    assert {"e4b-wide", "edge-no-softcap"} <= untied and "e4b" not in untied
    spec = synth.load_spec(BUILTIN["e4b-wide"])
    names = set(synth.make_weights(spec))
    assert "output.weight" in names
    assert "output.weight" not in set(synth.make_weights(synth.load_spec(BUILTIN["e4b"])))


# --------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_logits_reach_realistic_magnitudes(built, name):
    prompts = [r["prompt_ids"] for r in load_prompts()]
    s = synth.logit_stats(built[name].hf_dir, prompts)
    assert s["finite"] == 1.0
    assert 10.0 <= s["max_abs_logit"] <= 30.0, s
    assert s["median_margin"] > 0.05, s


# --------------------------------------------------------------------------- cache


def test_cache_hit_and_key(tmp_path, monkeypatch):
    spec_path = _write(tmp_path, MINIMAL_SPEC, "tiny.toml")
    root = tmp_path / "cache"
    a = synth.ensure_built(spec_path, cache_dir=root)
    assert a.root.parent == root and a.root.name.startswith("tiny-")
    assert (a.root / "manifest.json").is_file() and a.hf_dir.is_dir()
    assert set(a.gguf) == set(synth.QTYPES) and all(p.is_file() for p in a.gguf.values())
    m0 = (a.root / "manifest.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    b = synth.ensure_built(spec_path, cache_dir=root)
    assert time.perf_counter() - t0 < 0.5
    assert b.root == a.root and (b.root / "manifest.json").stat().st_mtime_ns == m0
    assert [p.name for p in root.iterdir()] == [a.root.name]  # no temp dirs left
    # editing the spec makes a new case
    spec_path.write_text(MINIMAL_SPEC.replace("seed = 7", "seed = 8"))
    c = synth.ensure_built(spec_path, cache_dir=root)
    assert c.root != a.root
    # G4H_CACHE is honoured when no cache_dir is given
    monkeypatch.setenv("G4H_CACHE", str(tmp_path / "env"))
    d = synth.ensure_built(spec_path)
    assert d.root.parent == tmp_path / "env" / "synth"


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    spec_path = _write(tmp_path, MINIMAL_SPEC, "tiny.toml")
    root = tmp_path / "cache"

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(synth.cache, "write_gguf", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        synth.ensure_built(spec_path, cache_dir=root)
    assert list(root.iterdir()) == []


def test_incomplete_final_dir_is_replaced(tmp_path):
    spec_path = _write(tmp_path, MINIMAL_SPEC, "tiny.toml")
    root = tmp_path / "cache"
    first = synth.ensure_built(spec_path, cache_dir=root)
    (first.root / "manifest.json").rename(first.root / "manifest.moved")
    again = synth.ensure_built(spec_path, cache_dir=root)
    assert again.root == first.root and (again.root / "manifest.json").is_file()
    assert not (again.root / "manifest.moved").exists()
    assert sorted(p.name for p in root.iterdir()) == [first.root.name]


def test_lost_race_uses_winner(tmp_path, monkeypatch):
    spec_path = _write(tmp_path, MINIMAL_SPEC, "tiny.toml")
    root = tmp_path / "cache"
    spec = synth.load_spec(spec_path)
    final = root / synth.case_key(spec)
    real_build = synth.build_case

    def build_while_another_process_wins(spec, out_dir):
        real_build(spec, final)  # the other process finishes first ...
        (final / "winner").write_text("1")
        return real_build(spec, out_dir)  # ... while we are still building

    monkeypatch.setattr(synth.cache, "build_case", build_while_another_process_wins)
    case = synth.ensure_built(spec_path, cache_dir=root)
    assert case.root == final and (final / "winner").is_file()
    assert sorted(p.name for p in root.iterdir()) == [final.name]  # our copy was discarded


# --------------------------------------------------------------------------- prompts


def test_prompt_file_matches_generator():
    recs = load_prompts(ids_only=True)
    assert [r["where"] for r in recs] == [f"{PROMPTS}:{n}" for n in range(1, len(recs) + 1)]
    assert [{k: v for k, v in r.items() if k != "where"} for r in recs] == synth.make_prompts()
    lengths = [len(r["prompt_ids"]) for r in recs]
    assert lengths == [1, 5, 15, 16, 17, 32, 48, 83]
    for r in recs:
        ids = r["prompt_ids"]
        assert ids[0] == 2
        assert all(4 <= t < 256 for t in ids[1:])
        assert r["note"]
    assert len({r["id"] for r in recs}) == len(recs)


def test_cli_builds_and_prints(tmp_path, capsys):
    from gemma4_harness.harness.cli import main

    spec_path = _write(tmp_path, MINIMAL_SPEC, "tiny.toml")
    rc = main(["synth", "--cache", str(tmp_path / "c"), str(spec_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "tiny:" in out and "Q4_0:" in out
    bad = _write(tmp_path, MINIMAL_SPEC.replace("seed = 7\n", ""), "bad.toml")
    rc = main(["synth", "--cache", str(tmp_path / "c"), str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.toml: seed: missing" in err
