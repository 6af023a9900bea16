"""The float64 vision reference against transformers 5.23 (fp32, eager): preprocessing, every encoder
trace point, the projected embeddings, both weight formats, seeded faults and bad input."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest

from gemma4_harness.harness.core.gates import DEFAULT_GATES as G
from gemma4_harness.reference import vision
from gemma4_harness.reference.errors import ConfigError, InputError, ModelFileError, PromptError
from gemma4_harness.reference.image_processing import (
    ImageProcessorConfig,
    check_budget,
    load_image,
    preprocess_image,
    preprocess_video,
)
from gemma4_harness.reference.mm_weights import (
    check_matches_text,
    hf_to_canonical,
    load_mmproj,
    load_vision,
)
from gemma4_harness.reference.multimodal import (
    MultimodalTokenIds,
    expand_image_placeholders,
    video_frame_block,
)
from gemma4_harness.reference.vision import VisionConfig, encode_image

# --------------------------------------------------------------------------- tolerances
# Bounds used here: the gates and bounds of harness/core/gates.py, which give the reasons.

# Issue gate. float64 reference vs fp32 eager on the projected soft tokens (magnitudes ~3-4):
# fp32 rounding through 2 layers, the pooler sum and the projection gives 3e-6..1.2e-5; a formula
# fault (see the seeded faults below) moves them by > 1.
PROJECTED_MAX_ABS = G["reference~transformers.mm_soft_token_max_abs"].limit
# Issue gate. ||ref - hf|| / ||hf|| at every encoder trace point; fp32 rounding gives ~1e-7..5e-6.
TRACE_REL_L2 = G["reference~transformers.mm_encoder_layer_rel_l2"].limit
# Our float64 pixels, rounded once to float32, equal transformers' float32 pixels bit for bit:
# both take uint8 * (1/255) in float64 of the same PIL-resized uint8 image; transformers then
# casts to float32. So |ours - hf| <= half a float32 ulp at 1.0 = 2^-25.
PIXEL_MAX_ABS = G["reference~hf_processor.max_abs_pixel"].limit
# A seeded fault must push the worst trace point at least 100x past TRACE_REL_L2.
FAULT_MIN_REL_L2 = 100 * TRACE_REL_L2
# Each ClippableLinear bound of the clipped tiny model must clamp at least this fraction of its
# entries on a test image (calibrated at the 10th / 90th percentiles, so ~10% per side).
CLIP_MIN_FRACTION = 0.01

BUDGET = 70
P, K = 4, 3


# --------------------------------------------------------------------------- images


def _images():
    """Named test images: different sizes, aspect ratios and PIL modes (seeded)."""
    from PIL import Image

    rng = np.random.default_rng(1234)

    def rgb(h, w):
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), (xx + yy) % 256], -1)
        return np.clip(smooth + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)

    rgba = np.concatenate([rgb(20, 300), rng.integers(0, 256, (20, 300, 1), dtype=np.uint8)], -1)
    return {
        "noise_50x80": Image.fromarray(rgb(50, 80)),  # upscaled to 72x120
        "aligned_96x96": Image.fromarray(rgb(96, 96)),  # already p*k aligned at the budget: not resampled
        "tall_200x30": Image.fromarray(rgb(200, 30)),
        "wide_rgba_20x300": Image.fromarray(rgba, "RGBA"),  # alpha composited onto white
        "strip_gray_5x400": Image.fromarray(rgb(5, 400)[..., 0], "L"),  # one side rounds to 0
        "small_palette_10x14": Image.fromarray(rgb(10, 14)).convert("P"),
        "photo_480x640": Image.fromarray(rgb(480, 640)),  # downscaled
    }


IMAGES = _images()


def _hf_processor(budget=BUDGET, patch_size=P):
    from transformers import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=patch_size, pooling_kernel_size=K, max_soft_tokens=budget)


def _hf_preprocess(image, budget=BUDGET, patch_size=P):
    out = _hf_processor(budget, patch_size)(images=[image], return_tensors="np")
    return out["pixel_values"][0], out["image_position_ids"][0], int(out["num_soft_tokens_per_image"][0])


@pytest.mark.parametrize("budget,patch_size", [(70, 4), (140, 4), (280, 16)])
def test_preprocessing_equals_transformers(budget, patch_size):
    cfg = ImageProcessorConfig(patch_size=patch_size, pooling_kernel_size=K, max_soft_tokens=budget)
    for name, image in IMAGES.items():
        ours = preprocess_image(image, cfg)
        pv, pos, n_soft = _hf_preprocess(image, budget, patch_size)
        assert ours.num_soft_tokens == n_soft, name
        assert ours.position_ids.dtype == np.int64 and np.array_equal(ours.position_ids, pos), name
        assert pv.dtype == np.float32 and np.array_equal(ours.pixel_values.astype(np.float32), pv), name
        assert np.max(np.abs(ours.pixel_values - pv)) <= PIXEL_MAX_ABS, name


def test_aligned_image_is_not_resampled():
    ours = preprocess_image(IMAGES["aligned_96x96"], ImageProcessorConfig(patch_size=P, max_soft_tokens=BUDGET))
    assert ours.size == (96, 96)
    expected = np.asarray(IMAGES["aligned_96x96"])[:P, :P].reshape(-1) / 255.0  # first patch, HWC order
    assert np.array_equal(ours.pixel_values[0], expected)
    assert ours.position_ids[1].tolist() == [1, 0] and ours.position_ids[96 // P].tolist() == [0, 1]


def test_processor_settings_come_from_the_folder(tmp_path):
    _hf_processor(140).save_pretrained(tmp_path)  # preprocessor_config.json
    cfg = ImageProcessorConfig.from_folder(tmp_path)
    assert (cfg.patch_size, cfg.pooling_kernel_size, cfg.max_soft_tokens) == (P, K, 140)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 280}}))
    assert ImageProcessorConfig.from_folder(tmp_path).max_soft_tokens == 280  # transformers' priority
    assert ImageProcessorConfig.from_folder(tmp_path / "missing") == ImageProcessorConfig()


def test_video_frames_carry_timestamps():
    frames = [IMAGES["noise_50x80"], IMAGES["tall_200x30"], IMAGES["aligned_96x96"]]
    cfg = ImageProcessorConfig(patch_size=P)
    out = preprocess_video(frames, [0.0, 1.5, 61.9], cfg)
    assert [f.timestamp for f in out] == ["00:00", "00:01", "01:01"]
    assert out[2].text_prefix == "01:01 "
    for f, image in zip(out, frames):
        _, pos, n_soft = _hf_preprocess(image, 70)
        assert f.image.num_soft_tokens == n_soft and np.array_equal(f.image.position_ids, pos)
    ids, types = video_frame_block([7, 8], 3, MultimodalTokenIds(video_token_id=502, boi_token_id=503,
                                                                 eoi_token_id=504, image_token_id=500))
    assert ids == [7, 8, 503, 502, 502, 502, 504] and types == [0, 0, 0, 2, 2, 2, 0]


def test_image_placeholder_expansion():
    tok = MultimodalTokenIds.from_hf({"image_token_id": 500, "boi_token_id": 503, "eoi_token_id": 504})
    ids, types = expand_image_placeholders([2, 10, 500, 11, 500], [3, 1], tok)
    assert ids == [2, 10, 503, 500, 500, 500, 504, 11, 503, 500, 504]
    # transformers' rule (ProcessorMixin.create_mm_token_type_ids): 1 exactly where the image token is
    assert types == [int(t == 500) for t in ids]
    assert MultimodalTokenIds() == MultimodalTokenIds(258880, 255999, 258882, 258884)
    with pytest.raises(PromptError):
        expand_image_placeholders([2, 500], [3, 4], tok)


# --------------------------------------------------------------------------- models


@pytest.fixture(scope="module", params=["plain", "clipped"])
def tiny(request, tmp_path_factory):
    """(hf folder, HF model, our config, our weights) of a tiny random checkpoint."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    from gemma4_harness.harness.synth.mm_vision import build_tiny_hf

    d = build_tiny_hf(tmp_path_factory.mktemp(request.param), clipped=request.param == "clipped", seed=7)
    model = Gemma4ForConditionalGeneration.from_pretrained(d, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    cfg, W = load_vision(d)
    return d, model, cfg, W


def _hf_trace(model, pixel_values, position_ids, monkeypatch):
    """Run transformers' vision tower + embed_vision; return {(point, layer): float64 array} with
    llama.cpp's names (per-patch points: valid rows only)."""
    import torch
    from transformers.models.gemma4 import modeling_gemma4 as mg

    pv, pos = torch.from_numpy(pixel_values[None].astype(np.float32)), torch.from_numpy(position_ids[None])
    valid = ~(pos[0] == -1).all(-1)
    rec: dict[tuple[str, int], np.ndarray] = {}

    def put(point, il, t, rows=True):
        t = t.detach()
        rec[(point, il)] = (t[0][valid] if rows else t).double().numpy()

    real_attn = mg.eager_attention_forward

    def attn(module, q, k, v, *a, **kw):  # q: [1, nH, N, D] after norm + RoPE; v after v_norm
        il = module.layer_idx
        put("Qcur_pos", il, q.transpose(1, 2))
        put("Kcur_pos", il, k.transpose(1, 2))
        put("Vcur_normed", il, v.transpose(1, 2))
        return real_attn(module, q, k, v, *a, **kw)

    monkeypatch.setattr(mg, "eager_attention_forward", attn)
    vt = model.model.vision_tower
    hooks = [
        vt.patch_embedder.input_proj.register_forward_pre_hook(lambda m, a: put("inp_raw_scaled", -1, a[0])),
        vt.patch_embedder.input_proj.register_forward_hook(lambda m, a, o: put("inp", -1, o)),
        vt.patch_embedder.register_forward_hook(lambda m, a, o: put("pos_embd", -1, o)),
        vt.pooler.register_forward_hook(lambda m, a, o: put("pooled", -1, o[0][o[1]], rows=False)),
    ]
    for il, layer in enumerate(vt.encoder.layers):
        def post(point, il=il):
            return lambda m, a, o: put(point, il, o)

        def pre(point, il=il):
            return lambda m, a: put(point, il, a[0])

        hooks += [
            layer.input_layernorm.register_forward_hook(post("layer_inp_normed")),
            layer.self_attn.o_proj.register_forward_pre_hook(pre("kqv_out")),
            layer.self_attn.o_proj.register_forward_hook(post("attn_out")),
            layer.post_attention_layernorm.register_forward_hook(post("attn_post_normed")),
            layer.pre_feedforward_layernorm.register_forward_pre_hook(pre("ffn_inp")),
            layer.pre_feedforward_layernorm.register_forward_hook(post("ffn_inp_normed")),
            layer.mlp.register_forward_hook(post("ffn_out")),
            layer.post_feedforward_layernorm.register_forward_hook(post("ffn_post_normed")),
            layer.register_forward_hook(post("layer_out")),
        ]
    try:
        with torch.no_grad():
            h = vt(pixel_values=pv, pixel_position_ids=pos).last_hidden_state
            if vt.config.standardize:
                put("std_scaled", -1, h, rows=False)
            put("projected", -1, model.model.embed_vision(inputs_embeds=h), rows=False)
    finally:
        for hk in hooks:
            hk.remove()
        monkeypatch.setattr(mg, "eager_attention_forward", real_attn)
    return rec


def _our_trace(cfg, W, pixel_values, position_ids):
    rec: dict[tuple[str, int], np.ndarray] = {}
    out = encode_image(cfg, W, pixel_values, position_ids,
                       trace=lambda point, il, a: rec.__setitem__((point, il), np.array(a)))
    assert np.array_equal(out, rec[("projected", -1)])
    return rec


def _rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _compare(ours, hf):
    """(worst rel L2 over the trace points and its point, max |d projected|)."""
    assert set(ours) == set(hf), f"trace points differ: {sorted(set(ours) ^ set(hf))}"
    errs = {key: _rel_l2(ours[key], hf[key]) for key in hf if ours[key].shape == hf[key].shape}
    assert len(errs) == len(hf), [k for k in hf if ours[k].shape != hf[k].shape]
    worst = max(errs, key=errs.get)
    return errs[worst], worst, float(np.max(np.abs(ours[("projected", -1)] - hf[("projected", -1)])))


@pytest.mark.slow
def test_encoder_matches_transformers(tiny, monkeypatch):
    d, model, cfg, W = tiny
    proc = ImageProcessorConfig.from_folder(d)
    for name, image in IMAGES.items():
        ours_in = preprocess_image(image, proc)
        pv, pos, n_soft = _hf_preprocess(image, BUDGET)  # the oracle runs on its own preprocessing
        hf = _hf_trace(model, pv, pos, monkeypatch)
        ours = _our_trace(cfg, W, ours_in.pixel_values, ours_in.position_ids)
        worst, where, proj = _compare(ours, hf)
        assert ours[("projected", -1)].shape == (n_soft, 64), name
        assert worst <= TRACE_REL_L2, f"{name}: rel L2 {worst:.3g} at {where}"
        assert proj <= PROJECTED_MAX_ABS, f"{name}: max |d projected| {proj:.3g}"


@pytest.mark.slow
def test_hf_batch_matches_our_single_images(tiny):
    """transformers pads a batch to its budget and strips padding after pooling; one image at a time is the same."""
    import torch

    d, model, cfg, W = tiny
    names = ["noise_50x80", "strip_gray_5x400"]
    out = _hf_processor()(images=[IMAGES[n] for n in names], return_tensors="pt")
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=out["pixel_values"],
                                               image_position_ids=out["image_position_ids"]).pooler_output
    for name, f in zip(names, feats):
        x = preprocess_image(IMAGES[name], ImageProcessorConfig.from_folder(d))
        ours = encode_image(cfg, W, x.pixel_values, x.position_ids)
        assert np.max(np.abs(ours - f.numpy())) <= PROJECTED_MAX_ABS
        n = x.num_soft_tokens * K * K  # the same image without its padding rows: only rounding order changes
        assert np.max(np.abs(encode_image(cfg, W, x.pixel_values[:n], x.position_ids[:n]) - ours)) <= 1e-12


def _faults(cfg):
    """Seeded faults, each a (name, attribute of reference.vision, replacement)."""
    rope, cells, pool = vision.rope_2d, vision.pool_cells, vision.pool

    def column_major(positions, k):
        pos = np.maximum(positions, 0)
        return pos[:, 1] // k + ((int(pos[:, 1].max()) + 1) // k) * (pos[:, 0] // k)

    faults = [
        ("rope x/y swapped", "rope_2d", lambda x, positions, theta: rope(x, positions[:, ::-1], theta)),
        ("column-major pooling", "pool_cells", column_major),
        ("sqrt(H) missing", "pool", lambda h, pos, pad, k: pool(h, pos, pad, k) / np.sqrt(h.shape[1])),
    ]
    if cfg.use_clipped_linears:
        faults.append(("clip bounds ignored", "clip_bounds", lambda cfg, W, name: None))
    del cells
    return faults


@pytest.mark.slow
def test_seeded_faults_are_caught(tiny, monkeypatch):
    d, model, cfg, W = tiny
    image = IMAGES["noise_50x80"]  # 18 x 30 patches: not square, so x/y and row/column order matter
    x = preprocess_image(image, ImageProcessorConfig.from_folder(d))
    pv, pos, _ = _hf_preprocess(image)
    hf = _hf_trace(model, pv, pos, monkeypatch)
    worst, _, proj = _compare(_our_trace(cfg, W, x.pixel_values, x.position_ids), hf)
    assert worst <= TRACE_REL_L2 and proj <= PROJECTED_MAX_ABS
    for name, attr, fake in _faults(cfg):
        with monkeypatch.context() as mp:
            mp.setattr(vision, attr, fake)
            worst, where, proj = _compare(_our_trace(cfg, W, x.pixel_values, x.position_ids), hf)
        assert worst >= FAULT_MIN_REL_L2, f"{name}: worst rel L2 only {worst:.3g} ({where})"
        assert proj > PROJECTED_MAX_ABS, f"{name}: projected output unchanged ({proj:.3g})"


@pytest.mark.slow
@pytest.mark.parametrize("tiny", ["clipped"], indirect=True)
def test_clip_bounds_bite(tiny, monkeypatch):
    d, _, cfg, W = tiny
    assert cfg.use_clipped_linears
    real, seen = vision.clipped_linear, []

    def spy(x, w, bounds):
        in_lo, in_hi, out_lo, out_hi = bounds
        y = real(x, w, (in_lo, in_hi, -np.inf, np.inf))
        seen.append((np.mean((x < in_lo) | (x > in_hi)), np.mean((y < out_lo) | (y > out_hi))))
        return real(x, w, bounds)

    monkeypatch.setattr(vision, "clipped_linear", spy)
    x = preprocess_image(IMAGES["photo_480x640"], ImageProcessorConfig.from_folder(d))
    encode_image(cfg, W, x.pixel_values[: x.num_soft_tokens * K * K], x.position_ids[: x.num_soft_tokens * K * K])
    assert len(seen) == 7 * cfg.num_hidden_layers
    assert min(min(f) for f in seen) >= CLIP_MIN_FRACTION, seen


@pytest.mark.slow
def test_hf_folder_and_mmproj_load_identical_arrays(tiny, tmp_path):
    from safetensors import safe_open

    from gemma4_harness.harness.synth.mm_vision import write_mmproj

    d, _, cfg, W = tiny
    mm_cfg, mm_W = load_mmproj(write_mmproj(d, tmp_path / "mmproj.gguf"))
    assert dataclasses.replace(mm_cfg, source="") == dataclasses.replace(cfg, source="")
    assert sorted(mm_W) == sorted(W)
    for name in W:
        assert mm_W.raw_dtype(name) == "F32" and np.array_equal(mm_W[name], W[name]), name
    with safe_open(str(d / "model.safetensors"), "np") as f:
        vision_keys = [k for k in f.keys() if hf_to_canonical(k) is not None]
    assert len(vision_keys) == len(W)  # every HF vision tensor has its one canonical name
    x = preprocess_image(IMAGES["tall_200x30"], ImageProcessorConfig.from_folder(d))
    assert np.array_equal(encode_image(cfg, W, x.pixel_values, x.position_ids),
                          encode_image(mm_cfg, mm_W, x.pixel_values, x.position_ids))


# --------------------------------------------------------------------------- bad input


def _one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(err.value)
    assert msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_unreadable_image_files(tmp_path):
    from PIL import Image

    with pytest.raises(InputError) as e:
        load_image(tmp_path / "nope.png")
    _one_line(e, "nope.png")
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(InputError) as e:
        preprocess_image(tmp_path / "text.png")
    _one_line(e, "text.png")
    buf = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8) + 7).save(buf, "PNG")
    (tmp_path / "cut.png").write_bytes(buf.getvalue()[:60])
    with pytest.raises(InputError) as e:
        preprocess_image(tmp_path / "cut.png")
    _one_line(e, "cut.png")


def test_budget_outside_the_allowed_set(tmp_path):
    with pytest.raises(ConfigError) as e:
        check_budget(100)
    _one_line(e, "100", "70, 140, 280, 560, 1120")
    with pytest.raises(ConfigError):
        preprocess_image(IMAGES["noise_50x80"], max_soft_tokens=64)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 300}))
    with pytest.raises(ConfigError) as e:
        ImageProcessorConfig.from_folder(tmp_path)
    _one_line(e, "preprocessor_config.json", "300")


def test_image_outside_the_model_or_budget():
    cfg = VisionConfig.from_hf({"model_type": "gemma4", "text_config": {"hidden_size": 64},
                                "vision_config": {"patch_size": P, "position_embedding_size": 64}})
    x = preprocess_image(IMAGES["strip_gray_5x400"], ImageProcessorConfig(patch_size=P, max_soft_tokens=70))
    with pytest.raises(InputError) as e:  # 210 patches wide, the position tables have 64 rows
        encode_image(cfg, {}, x.pixel_values, x.position_ids)
    _one_line(e, "position")
    no_resize = ImageProcessorConfig(patch_size=P, max_soft_tokens=70, do_resize=False)
    with pytest.raises(InputError) as e:  # 480x640 at its own size is 19200 patches > 630
        preprocess_image(IMAGES["photo_480x640"], no_resize)
    _one_line(e, "480x640", "70")


@pytest.mark.parametrize("change,field", [
    ({"head_dim": 10}, "head_dim"), ({"rope_parameters": {"rope_type": "default"}}, "rope_type"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"), ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"patch_size": 0}, "patch_size"), ({"rms_norm_eps": 2.0}, "rms_norm_eps"),
])
def test_bad_vision_config(change, field):
    raw = {"model_type": "gemma4", "text_config": {"hidden_size": 64},
           "vision_config": {"num_attention_heads": 2, "num_key_value_heads": 2, **change}}
    with pytest.raises(ConfigError) as e:
        VisionConfig.from_hf(raw, "cfg.json")
    _one_line(e, "cfg.json", field)


def test_mmproj_that_is_not_gemma4v(tmp_path, tiny_gguf):
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_vision_projector_type(gguf.VisionProjectorType.GEMMA3)
    w.add_tensor("mm.input_projection.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError) as e:
        load_vision(path)
    _one_line(e, "other.gguf", "gemma4v")
    with pytest.raises(ConfigError) as e:  # a text model given as the mmproj
        load_vision(tiny_gguf)
    _one_line(e, "tiny.gguf", "clip")


@pytest.mark.slow
def test_mmproj_must_match_the_text_model(tiny, tmp_path):
    from gemma4_harness.harness.synth.mm_vision import write_mmproj
    from gemma4_harness.reference.weights import load_hf

    d, _, _, _ = tiny
    text_cfg, _ = load_hf(d)
    mm_cfg, _ = load_mmproj(write_mmproj(d, tmp_path / "mmproj.gguf"))
    check_matches_text(mm_cfg, text_cfg)
    other = dataclasses.replace(text_cfg, hidden_size=48, source="other-text.gguf")
    with pytest.raises(ModelFileError) as e:
        check_matches_text(mm_cfg, other)
    _one_line(e, "mmproj.gguf", "other-text.gguf", "64", "48")
