"""The float64 reference on the built-in synthetic cases: against transformers, across loaders,
cached against uncached, and the trace points."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import MODELS_DIR, builtin_specs
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.engines.transformers import TransformersEngine
from gemma4_harness.harness.traces import TraceRecorder, layer_errors
from gemma4_harness.reference import KVCache, forward, load_model

SPECS = [p.stem for p in builtin_specs()]
PROMPTS = load_prompts()
LONGEST = max(PROMPTS, key=lambda p: len(p["prompt_ids"]))["prompt_ids"]


@pytest.fixture(scope="module", params=SPECS)
def built(request):
    return synth.ensure_built(MODELS_DIR / f"{request.param}.toml")


@pytest.fixture(scope="module")
def engines(built):
    return ReferenceEngine(built.hf_dir), TransformersEngine(built.hf_dir)


def test_prompt_set_covers_the_window():
    window = {synth.load_spec(p).config["sliding_window"] for p in builtin_specs()}
    assert len(window) == 1
    w = window.pop()
    lengths = {len(p["prompt_ids"]) for p in PROMPTS}
    assert {w - 1, w, w + 1} <= lengths and max(lengths) > 3 * w


def test_reference_matches_transformers(engines):
    ref, hf = engines
    g_logit = DEFAULT_GATES["reference~transformers.max_abs_logit"]
    g_layer = DEFAULT_GATES["reference~transformers.layer_rel_l2"]
    for p in PROMPTS:
        ta, tb = TraceRecorder(), TraceRecorder()
        a = ref.logits(p["prompt_ids"], trace=ta)
        b = hf.logits(p["prompt_ids"], trace=tb)
        diff = np.max(np.abs(a - b))
        assert g_logit.check(diff), f"prompt {p['id']}: max |dlogit| {diff:.3g} > {g_logit.limit}"
        rows = layer_errors(ta, tb)
        assert len(rows) == len(ta.points) == len(tb.points), "both engines report the same trace points"
        worst = max(rows, key=lambda r: r["rel_l2"])
        assert g_layer.check(worst["rel_l2"]), f"prompt {p['id']}: {worst}"


def test_gguf_f32_and_safetensors_give_bit_identical_logits(built):
    a = ReferenceEngine(built.hf_dir)
    b = ReferenceEngine(built.gguf["F32"])
    assert a.cfg.layers == b.cfg.layers
    for p in PROMPTS:
        assert np.array_equal(a.logits(p["prompt_ids"]), b.logits(p["prompt_ids"])), p["id"]


@pytest.mark.parametrize("prefill", [1, 7, 16, 40])
def test_cached_prefill_plus_decode_equals_full_forward(built, prefill):
    ref = ReferenceEngine(built.gguf["F32"])
    full = ref.logits(LONGEST)
    cached = ref.logits_cached(LONGEST, prefill)
    gate = DEFAULT_GATES["reference.cached~uncached.max_abs_logit"]
    assert gate.check(np.max(np.abs(cached - full)))


def test_chunked_prefill_equals_full_forward(built):
    cfg, w = load_model(built.gguf["F32"])
    full = forward(cfg, w, LONGEST)
    cache = KVCache(cfg)
    chunks, i = [], 0
    for size in (cfg.sliding_window + 3, cfg.sliding_window, cfg.sliding_window - 5, 1000):
        chunks.append(forward(cfg, w, LONGEST[i:i + size], cache))
        i += size
    assert np.max(np.abs(np.concatenate(chunks) - full)) <= DEFAULT_GATES[
        "reference.cached~uncached.max_abs_logit"].limit


def test_quantized_ggufs_dequantize_like_gguf_quants(built):
    import gguf

    f32 = load_model(built.gguf["F32"])[1]
    for qname in ("F16", "BF16", "Q8_0", "Q4_0"):
        cfg, w = load_model(built.gguf[qname])
        n_quant = 0
        for name in w:
            src = np.asarray(f32.raw(name), dtype=np.float32)
            stored = w.raw_dtype(name)  # rows that do not fill a block fall back to another type
            if stored == "F32":
                want = src
            else:
                n_quant += stored == qname
                qtype = gguf.GGMLQuantizationType[stored]
                want = gguf.quants.dequantize(gguf.quants.quantize(src, qtype), qtype)
            assert np.array_equal(w[name], np.asarray(want, dtype=np.float64)), (qname, name)
        assert n_quant > 0, f"{qname}: no tensor was stored quantized"
        assert np.all(np.isfinite(forward(cfg, w, LONGEST[:8])))


def test_trace_points_follow_llama_cpp_names(built):
    cfg, w = load_model(built.gguf["F32"])
    rec = TraceRecorder()
    forward(cfg, w, LONGEST[:5], trace=rec)
    keys = list(rec.points)
    assert keys[0] == ("inp_scaled", -1) and keys[-2:] == [("result_norm", -1), ("result_output", -1)]
    for i, layer in enumerate(cfg.layers):
        pts = [p for p, l in keys if l == i]
        want = ["attn_out"] + (["ffn_mlp", "ffn_moe"] if layer.has_moe else []) + ["ffn_out"]
        want += ["per_layer_embd_out"] if cfg.ple_dim else []
        assert pts == want + ["l_out"]
    if cfg.ple_dim:
        assert rec.points[("inp_per_layer", -1)].shape == (5, cfg.n_layer, cfg.ple_dim)


def test_multimodal_checkpoint_loads_its_text_part(tmp_path):
    from safetensors.numpy import load_file, save_file

    built = synth.ensure_built(MODELS_DIR / "e2b.toml")
    text = json.loads((built.hf_dir / "config.json").read_text())
    mm = tmp_path / "mm"
    mm.mkdir()
    tensors = {}
    for f in built.hf_dir.glob("*.safetensors"):
        for k, v in load_file(str(f)).items():
            tensors[k.replace("model.", "model.language_model.", 1)] = v
    tensors["model.vision_tower.patch_embedder.input_proj.weight"] = np.ones((4, 4), np.float32)
    save_file(tensors, str(mm / "model.safetensors"))
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text,
                                                "architectures": ["Gemma4ForConditionalGeneration"]}))
    ids = LONGEST[:20]
    want = ReferenceEngine(built.hf_dir).logits(ids)
    assert np.array_equal(ReferenceEngine(mm).logits(ids), want)
    hf = TransformersEngine(mm).logits(ids)
    assert np.max(np.abs(hf - want)) <= DEFAULT_GATES["reference~transformers.max_abs_logit"].limit


def test_hf_folder_with_a_missing_weight_is_bad_input(tmp_path):
    from safetensors.numpy import load_file, save_file

    from gemma4_harness.reference.errors import ModelFileError

    built = synth.ensure_built(MODELS_DIR / "e2b.toml")
    d = tmp_path / "m"
    shutil.copytree(built.hf_dir, d)
    f = next(d.glob("*.safetensors"))
    t = load_file(str(f))
    del t["model.layers.1.self_attn.k_norm.weight"]
    save_file(t, str(f))
    with pytest.raises(ModelFileError, match="blk.1.attn_k_norm.weight"):
        load_model(d)
