"""The float64 audio reference (front end, encoder, embed_audio, loaders) against transformers 5.23 fp32 eager.

A tiny random ``Gemma4ForConditionalGeneration`` (``harness.synth.mm_audio``:
hidden 32, 2 layers, 2 heads, channels [128, 8], output_proj_dims 24, clipped
linears, llama.cpp's chunk 12 / context_left 13 / kernel 5) is saved with
``save_pretrained`` and read by our loader; every trace point is compared with
the matching HF module output.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from gemma4_harness.harness.core import gates
from gemma4_harness.harness.core.gates import DEFAULT_GATES as G
from gemma4_harness.harness.synth.mm_audio import TINY_IDS, make_tiny_audio_hf, write_audio_mmproj
from gemma4_harness.reference import audio as A
from gemma4_harness.reference import audio_features as AF
from gemma4_harness.reference.audio_weights import (
    CLIP_BOUNDS,
    gguf_to_hf_audio,
    hf_to_gguf_audio,
    load_audio_encoder,
    load_audio_hf,
    load_audio_mmproj,
)
from gemma4_harness.reference.errors import ConfigError, InputError, ModelFileError, PromptError

# --------------------------------------------------------------------------- tolerances
# The gates and bounds of harness/core/gates.py, which give the reasons.

#: Mel features vs ``Gemma4AudioFeatureExtractor``, max |diff|. HF frames,
#: windows and FFTs in float32; after ``log(x + 1e-3)`` that rounding gives 1e-6 (1 s) to 5e-6
#: (30 s) on these noise clips. It sits at HF's own float32 noise: a 30 s noise + tone clip measured
#: 1.6e-5, and a pure tone 3e-4 (near-empty mel bins; see test_pure_tone_gap_is_hf_float32).
MEL_MAX_ABS = G["reference~hf_processor.max_abs_mel"].limit
#: Our pipeline run in HF's float32 steps vs HF, max |diff|: the formula is HF's to float32 rounding
#: of the log (values of order 10, ulp ~1e-6).
MEL_F32_EMULATION_MAX_ABS = gates.MEL_F32_EMULATION_MAX_ABS
#: Projected audio embeddings (``embed_audio`` output) vs HF fp32 eager, max |diff|;
#: measured <= 1.9e-5 (1 s, 7 s, 30 s clips; attention logits up to ~50, in the softcap region).
EMBED_MAX_ABS = G["reference~transformers.mm_soft_token_max_abs"].limit
#: Relative L2 at every encoder trace point vs HF fp32 eager; measured <= 2.5e-6.
TRACE_REL_L2 = G["reference~transformers.mm_encoder_layer_rel_l2"].limit
#: Full-attention-with-mask vs blocked (chunked) attention, both float64: the same sums in another order.
FORMS_MAX_ABS = gates.BLOCKED_ATTENTION_MAX_ABS
#: Band-limited resampling (44.1 -> 16 kHz) of a 1 kHz sine of amplitude 0.5, away from the clip
#: edges: the Kaiser(beta 5) filter's pass-band ripple; measured 5.7e-4.
RESAMPLE_MAX_ABS = gates.RESAMPLE_MAX_ABS

SR = 16000


# --------------------------------------------------------------------------- helpers


def noise_clip(n: int, seed: int = 0) -> np.ndarray:
    """Broadband test clip: Gaussian noise, std 0.1 (a noisy recording at -20 dBFS), float32."""
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def hf_features(x: np.ndarray, **settings):
    fe = transformers.Gemma4AudioFeatureExtractor(**settings)
    out = fe([x], return_tensors="np")  # HF needs a list: a bare 1-D array raises
    return out["input_features"][0].astype(np.float64), out["input_features_mask"][0]


def rel_l2(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, our config, our weights, HF model) of the tiny checkpoint."""
    d = make_tiny_audio_hf(tmp_path_factory.mktemp("tiny_audio") / "hf", seed=0)
    cfg, W = load_audio_hf(d)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(d, attn_implementation="eager").eval()
    return d, cfg, W, model


def hf_trace(model, feats: np.ndarray, mask: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """HF's values at our trace points (forward hooks), its embed_audio output and output mask."""
    got: dict[str, np.ndarray] = {}
    tower = model.model.audio_tower

    def hook(name, pre=False, channels_last=False):
        def f(mod, inp, out=None):
            t = inp[0] if pre else (out[0] if isinstance(out, tuple) else out)
            a = t.detach().double().numpy()[0]
            got[name] = np.moveaxis(a, 0, -1) if channels_last else a
        return f

    hs = [tower.subsample_conv_projection.layer0.register_forward_hook(hook("sscp_conv_0", channels_last=True)),
          tower.subsample_conv_projection.layer1.register_forward_hook(hook("sscp_conv_1", channels_last=True)),
          tower.subsample_conv_projection.register_forward_hook(hook("inp_proj")),
          tower.rel_pos_enc.register_forward_hook(  # [1, F, H]
              lambda m, i, o: got.__setitem__("pos_emb", o.double().numpy().reshape(-1, o.shape[-1]))),
          tower.output_proj.register_forward_hook(hook("output_proj"))]
    for il, layer in enumerate(tower.layers):
        hs += [layer.feed_forward1.register_forward_hook(hook(f"ffn_1_out.{il}")),
               layer.lconv1d.register_forward_pre_hook(hook(f"attn_out.{il}", pre=True)),
               layer.lconv1d.register_forward_hook(hook(f"conv_out.{il}")),
               layer.feed_forward2.register_forward_hook(hook(f"ffn_2_out.{il}")),
               layer.register_forward_hook(hook(f"layer_out.{il}"))]
    try:
        with torch.no_grad():
            out = model.model.get_audio_features(torch.tensor(feats[None], dtype=torch.float32),
                                                 torch.tensor(mask[None]))
    finally:
        for h in hs:
            h.remove()
    emb = out.pooler_output[0].double().numpy()
    got["projected"] = emb
    return got, emb, out.attention_mask[0].numpy()


def our_trace(cfg, W, feats, mask):
    got: dict[str, np.ndarray] = {}

    def trace(point, layer, arr):
        got[point if layer < 0 else f"{point}.{layer}"] = arr

    return got, A.encode_audio(cfg, W, feats, mask, trace=trace)


# --------------------------------------------------------------------------- mel front end

MEL_CLIPS = {  # name -> samples: shorter than 1 s, about 1 s (one masked tail frame), ~7 s, ~30 s, > 30 s
    "0.5s": 8123, "1s": 16160, "7s": 112_345, "30s": 479_900, "32.5s": 520_000}


@pytest.mark.parametrize("name", list(MEL_CLIPS))
def test_mel_matches_hf(name):
    x = noise_clip(MEL_CLIPS[name], seed=0)
    ref, ref_mask = hf_features(x)
    ours, mask = AF.extract_features(x)
    assert ours.shape == ref.shape and mask.dtype == bool
    assert np.array_equal(mask, ref_mask)
    assert np.abs(ours - ref).max() <= MEL_MAX_ABS
    if MEL_CLIPS[name] > 480_000:  # HF truncates at 30 s
        assert np.array_equal(ours, AF.extract_features(x[:480_000])[0])


def test_mel_filter_bank_and_window_equal_transformers():
    import warnings

    from transformers.audio_utils import mel_filter_bank, window_function

    with warnings.catch_warnings():  # "At least one mel filter has all zero values": expected at 128 x 257
        warnings.simplefilter("ignore")
        ref = mel_filter_bank(num_frequency_bins=257, num_mel_filters=128, min_frequency=0.0, max_frequency=8000.0,
                              sampling_rate=SR, norm=None, mel_scale="htk")
    assert np.abs(AF.mel_filter_bank(AF.MelConfig()) - ref).max() <= 1e-15
    assert np.abs(AF.hann_window(320) - window_function(320)).max() <= 1e-15


def _hf_f32_emulation(x32: np.ndarray, cfg: AF.MelConfig) -> np.ndarray:
    """Our steps with HF's float32 arithmetic (waveform, frames, window, FFT); mel and log in float64."""
    x32 = (x32 * np.float32(cfg.input_scale_factor)).astype(np.float32)
    xp, n_real = AF.pad_or_truncate(x32.astype(np.float64), cfg)
    frames = AF.preemphasize(AF.semicausal_frames(xp, cfg).astype(np.float32), cfg)
    spec = np.abs(np.fft.rfft(frames * AF.hann_window(cfg.frame_length).astype(np.float32), n=cfg.fft_length))
    feats = AF.log_mel(spec.astype(np.float64), cfg)
    return feats * AF.frame_mask(n_real, feats.shape[0], cfg)[:, None]


def test_pure_tone_gap_is_hf_float32():
    t = np.arange(SR) / SR
    x = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1234 * t)).astype(np.float32)
    ref, _ = hf_features(x)
    assert np.abs(AF.extract_features(x)[0] - ref).max() > MEL_MAX_ABS  # near-empty bins: float32 leakage
    assert np.abs(_hf_f32_emulation(x, AF.MelConfig()) - ref).max() <= MEL_F32_EMULATION_MAX_ABS


@pytest.mark.parametrize("settings", [
    dict(preemphasis=0.97, preemphasis_htk_flavor=True, fft_overdrive=True, input_scale_factor=2.0,
         mel_floor=1e-2, min_frequency=50.0, max_frequency=7600.0,
         per_bin_mean=list(np.linspace(-1, 1, 128)), per_bin_stddev=list(np.linspace(0.5, 2, 128))),
    dict(preemphasis=0.9, preemphasis_htk_flavor=False),
    dict(feature_size=64, sampling_rate=8000, frame_length_ms=25.0, hop_length_ms=12.5, max_frequency=4000.0),
])
def test_mel_settings_from_processor_config_match_hf(tmp_path, settings):
    import json

    d = {"feature_extractor_type": "Gemma4AudioFeatureExtractor", **settings}
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": d}))
    cfg = AF.mel_config_from_folder(tmp_path)
    assert cfg.source.endswith("(feature_extractor)")
    x = noise_clip(16160, seed=5)
    ref, ref_mask = hf_features(x, **settings)
    assert np.array_equal(AF.extract_features(x, cfg)[1], ref_mask)
    assert np.abs(_hf_f32_emulation(x, cfg) - ref).max() <= MEL_F32_EMULATION_MAX_ABS


def test_mel_config_sources_and_errors(tmp_path):
    import json

    assert AF.mel_config_from_folder(tmp_path) == AF.MelConfig()
    fe = transformers.Gemma4AudioFeatureExtractor(preemphasis=0.5)
    fe.save_pretrained(tmp_path)  # preprocessor_config.json
    assert AF.mel_config_from_folder(tmp_path).preemphasis == 0.5
    bad = json.loads((tmp_path / "preprocessor_config.json").read_text())
    bad["frame_length"] = 400
    with pytest.raises(ConfigError, match="frame_length = 400"):
        AF.MelConfig.from_dict(bad, "p.json")
    with pytest.raises(ConfigError, match="feature_size"):
        AF.MelConfig.from_dict({"feature_size": 0}, "p.json")


def test_power_spectrum_would_be_caught(monkeypatch):
    x = noise_clip(16160)
    ref, _ = hf_features(x)
    monkeypatch.setattr(AF, "magnitude_spectrum", lambda frames, cfg: np.abs(
        np.fft.rfft(frames * AF.hann_window(cfg.frame_length), n=cfg.fft_length)) ** 2)
    assert np.abs(AF.extract_features(x)[0] - ref).max() > MEL_MAX_ABS


def test_25_soft_tokens_per_second():
    for sec in range(1, 31):
        assert AF.soft_token_count(sec * SR) == 25 * sec
    assert AF.soft_token_count(45 * SR) == 750  # HF truncation


def test_llamacpp_splits_long_audio_into_30s_chunks():
    x = noise_clip(70 * SR, seed=2).astype(np.float64)
    chunks = AF.split_llamacpp(x)
    assert [c.shape[0] for c in chunks] == [30 * SR, 30 * SR, 10 * SR]
    assert np.array_equal(np.concatenate(chunks), x)
    for c in chunks:  # llama.cpp frame count (mtmd-audio.cpp): (n + 160 - 321) // 160 + 1; encoder: ceil twice
        frames = (c.shape[0] + 160 - 321) // 160 + 1
        _, mask = AF.extract_features(c, truncate=False)
        assert mask.sum() == frames
        assert math.ceil(math.ceil(frames / 2) / 2) == (int(mask.sum()) + 3) // 4


# --------------------------------------------------------------------------- WAV input


def _write_wav(path: Path, data: bytes, tag: int, channels: int, rate: int, bits: int) -> None:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def test_read_wav_pcm16_stereo_float_and_24bit(tmp_path):
    pcm = np.array([[0, 32767], [-32768, 16384], [100, -100]], dtype="<i2")
    with wave.open(str(tmp_path / "s16.wav"), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(pcm.tobytes())
    x, rate = AF.read_wav(tmp_path / "s16.wav")
    assert rate == SR and np.array_equal(x, pcm.astype(np.float64).mean(axis=1) / 32768.0)
    f = np.array([0.25, -0.5, 1.0], dtype="<f4")
    _write_wav(tmp_path / "f32.wav", f.tobytes(), 3, 1, SR, 32)
    assert np.array_equal(AF.read_wav(tmp_path / "f32.wav")[0], f.astype(np.float64))
    v = np.array([-(1 << 23), 1, (1 << 23) - 1])
    b = b"".join(int(i & 0xFFFFFF).to_bytes(3, "little") for i in v)
    _write_wav(tmp_path / "s24.wav", b, 1, 1, SR, 24)
    assert np.array_equal(AF.read_wav(tmp_path / "s24.wav")[0], v / 2.0**23)


def test_bad_audio_files_give_one_line(tmp_path):
    for path, msg in [(tmp_path / "missing.wav", "cannot read audio file"),
                      (tmp_path / "junk.wav", "not a WAV file")]:
        if path.name == "junk.wav":
            path.write_bytes(b"ID3\x04 not audio at all")
        with pytest.raises(InputError, match=msg) as e:
            AF.load_audio(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    _write_wav(tmp_path / "alaw.wav", b"\0" * 8, 6, 1, SR, 8)
    with pytest.raises(InputError, match="unsupported WAV encoding"):
        AF.read_wav(tmp_path / "alaw.wav")


def test_wrong_sample_rate_refused_unless_resampling_asked(tmp_path):
    rate = 44100
    t = np.arange(rate) / rate
    _write_wav(tmp_path / "a.wav", (0.5 * np.sin(2 * np.pi * 1000 * t)).astype("<f4").tobytes(), 3, 1, rate, 32)
    with pytest.raises(InputError, match="sample rate 44100 Hz, expected 16000 Hz") as e:
        AF.load_audio(tmp_path / "a.wav")
    assert "\n" not in str(e.value)
    y = AF.load_audio(tmp_path / "a.wav", resample_to_rate=True)
    assert y.shape == (SR,)
    inner = slice(400, SR - 400)
    expect = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(SR) / SR)
    assert np.abs(y[inner] - expect[inner]).max() <= RESAMPLE_MAX_ABS


# --------------------------------------------------------------------------- encoder vs HF


@pytest.mark.parametrize("n", [16160, pytest.param(112_345, id="7s")])
def test_encoder_matches_hf_at_every_trace_point(tiny, n):
    _, cfg, W, model = tiny
    feats, mask = AF.extract_features(noise_clip(n, seed=n))
    ref, emb, out_mask = hf_trace(model, feats, mask)
    ours, y = our_trace(cfg, W, feats, mask)
    assert set(ref) <= set(ours)
    for point, arr in ref.items():
        assert ours[point].shape == arr.shape, point
        assert rel_l2(ours[point], arr) <= TRACE_REL_L2, point
    assert y.shape == (int(out_mask.sum()), cfg.text_hidden_size)
    assert np.abs(y - emb[out_mask]).max() <= EMBED_MAX_ABS


@pytest.mark.slow
def test_encoder_matches_hf_on_30s(tiny):
    _, cfg, W, model = tiny
    feats, mask = AF.extract_features(noise_clip(479_900, seed=3))
    ref, emb, out_mask = hf_trace(model, feats, mask)
    ours, y = our_trace(cfg, W, feats, mask)
    assert max(rel_l2(ours[p], a) for p, a in ref.items()) <= TRACE_REL_L2
    assert y.shape[0] == 750 and np.abs(y - emb[out_mask]).max() <= EMBED_MAX_ABS


def test_encoder_without_clipped_linears_matches_hf(tmp_path):
    d = make_tiny_audio_hf(tmp_path / "hf", seed=2, audio={"use_clipped_linears": False})
    cfg, W = load_audio_hf(d)
    assert not cfg.use_clipped_linears and not any(k.rsplit(".", 1)[-1] in CLIP_BOUNDS for k in W)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(d, attn_implementation="eager").eval()
    feats, mask = AF.extract_features(noise_clip(16160, seed=7))
    _, emb, out_mask = hf_trace(model, feats, mask)
    assert np.abs(A.encode_audio(cfg, W, feats, mask) - emb[out_mask]).max() <= EMBED_MAX_ABS


def test_soft_token_rows_per_second(tiny):
    _, cfg, W, model = tiny
    for sec in (1, 2):
        feats, mask = AF.extract_features(noise_clip(sec * SR))
        _, _, out_mask = hf_trace(model, feats, mask)
        assert A.encode_audio(cfg, W, feats, mask).shape[0] == int(out_mask.sum()) == 25 * sec


def _embed_error(tiny, W=None) -> float:
    _, cfg, W0, model = tiny
    feats, mask = AF.extract_features(noise_clip(16160))
    _, emb, out_mask = hf_trace(model, feats, mask)
    return float(np.abs(A.encode_audio(cfg, W if W is not None else W0, feats, mask) - emb[out_mask]).max())


def test_dropped_softcap_would_be_caught(tiny, monkeypatch):
    monkeypatch.setattr(A, "softcap", lambda x, cap: x)
    assert _embed_error(tiny) > EMBED_MAX_ABS


def test_missing_softplus_would_be_caught(tiny):
    from safetensors.numpy import load_file

    d, cfg, W, _ = tiny
    raw = load_file(str(d / "model.safetensors"))
    bad = dict(W.items())
    for il in range(cfg.num_hidden_layers):
        bad[f"a.blk.{il}.per_dim_scale.weight"] = raw[f"model.audio_tower.layers.{il}.self_attn.per_dim_scale"]
    assert _embed_error(tiny, bad) > EMBED_MAX_ABS


def test_ignored_clip_bounds_would_be_caught(tiny):
    _, _, W, _ = tiny
    assert _embed_error(tiny, {k: v for k, v in W.items() if k.rsplit(".", 1)[-1] not in CLIP_BOUNDS}) \
        > EMBED_MAX_ABS


# --------------------------------------------------------------------------- attention: full form == blocked form


def blocked_attention(cfg, W, il, x, valid, pos):
    """HF / llama.cpp's chunked form: query blocks of C, key windows of C + P + R, rel-shift by pad-and-reshape."""
    b = f"a.blk.{il}."
    T, nh, D = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    C, P, R = cfg.attention_chunk_size, cfg.max_past, cfg.attention_context_right
    S, nb = C + P + R, -(-T // C)
    q = A.clippable_linear(x, W, b + "attn_q").reshape(T, nh, D) * (D**-0.5 / math.log(2)) \
        * W[b + "per_dim_scale.weight"]
    k = A.clippable_linear(x, W, b + "attn_k").reshape(T, nh, D) * (math.log(1 + math.e) / math.log(2))
    v = A.clippable_linear(x, W, b + "attn_v").reshape(T, nh, D)
    rel_k = A.linear(pos, W[b + "attn_k_rel.weight"]).reshape(-1, nh, D)
    F = rel_k.shape[0]
    qb = np.pad(q, ((0, nb * C - T), (0, 0), (0, 0))).reshape(nb, C, nh, D)
    kp = np.pad(k, ((P, R + C - 1), (0, 0), (0, 0)))
    vp = np.pad(v, ((P, R + C - 1), (0, 0), (0, 0)))
    kb = np.stack([kp[i * C:i * C + S] for i in range(nb)])  # [nb, S, nh, D]
    vb = np.stack([vp[i * C:i * C + S] for i in range(nb)])
    ac = np.einsum("bchd,bshd->bhcs", qb, kb)
    bd = np.einsum("bchd,fhd->bhcf", qb, rel_k)  # [nb, nh, C, F]
    bd = np.pad(bd, ((0, 0), (0, 0), (0, 0), (0, S + 1 - F))).reshape(nb, nh, C * (S + 1))
    bd = bd[..., :C * S].reshape(nb, nh, C, S)  # Transformer-XL rel-shift
    logits = A.softcap(ac + bd, cfg.attention_logit_cap)
    qpos = np.arange(nb)[:, None, None] * C + np.arange(C)[None, :, None]  # [nb, C, 1]
    kpos = np.arange(nb)[:, None, None] * C - P + np.arange(S)[None, None, :]  # [nb, 1, S]
    d = qpos - kpos
    kval = np.concatenate([np.zeros(P, bool), valid, np.zeros(R + C - 1 + nb * C, bool)])
    ok = (((d >= 0) & (d < P)) | ((d < 0) & (-d < R))) & kval[kpos + P]
    logits = np.where(ok[:, None], logits, cfg.attention_invalid_logits_value)
    out = np.einsum("bhcs,bshd->bchd", A.softmax(logits), vb).reshape(nb * C, nh * D)[:T]
    return A.clippable_linear(out, W, b + "attn_out")


@pytest.mark.parametrize("chunk,left,right", [(12, 13, 0), (5, 8, 0), (4, 3, 2), (6, 2, 3)])
@pytest.mark.parametrize("T", [1, 11, 12, 13, 40])
@pytest.mark.parametrize("holes", [False, True])
def test_full_form_equals_blocked_form(chunk, left, right, T, holes):
    cfg = A.AudioConfig(hidden_size=16, num_attention_heads=2, subsampling_conv_channels=(128, 4),
                        attention_chunk_size=chunk, attention_context_left=left, attention_context_right=right,
                        output_proj_dims=8, text_hidden_size=8).validate()
    rng = np.random.default_rng(T * 100 + chunk)
    W = {f"a.blk.0.{n}.weight": rng.normal(0, 1.5 / 4, (16, 16)) for n in ("attn_q", "attn_k", "attn_v",
                                                                           "attn_out", "attn_k_rel")}
    W["a.blk.0.per_dim_scale.weight"] = np.logaddexp(0, rng.normal(1, 1, 8))
    W["a.blk.0.attn_q.output_min"], W["a.blk.0.attn_q.output_max"] = np.array([-3.0]), np.array([3.0])
    x = rng.normal(0, 1, (T, 16))
    valid = rng.random(T) > 0.3 if holes else np.arange(T) < max(1, T - 3)
    valid[0] = True
    pos = A.rel_pos_table(cfg)
    full = A.audio_attention(cfg, W, 0, x, valid, pos)
    blocked = blocked_attention(cfg, W, 0, x, valid, pos)
    seen = A.attention_mask(cfg, valid).any(axis=1)  # rows with no visible key differ by design (docstring)
    assert np.abs(full[seen] - blocked[seen]).max() <= FORMS_MAX_ABS


# --------------------------------------------------------------------------- loading: HF, mmproj GGUF, names


def test_hf_and_mmproj_load_identical_arrays(tiny, tmp_path):
    d, cfg, W, _ = tiny
    path = write_audio_mmproj(tmp_path / "mmproj.gguf", cfg, W)
    cfg2, W2 = load_audio_mmproj(path, text_hidden_size=cfg.text_hidden_size)
    same = ("audio_token_id", "boa_token_id", "eoa_token_index", "source")  # not in an mmproj
    assert dataclasses.replace(cfg2, **{k: getattr(cfg, k) for k in same}) == cfg
    assert set(W2) == set(W)
    for name in W:
        assert W2[name].dtype == W[name].dtype == np.float64
        assert np.array_equal(W2[name], W[name]), name
    assert W2.metadata["clip.audio.projector_type"] == "gemma4a"
    assert load_audio_encoder(path)[0] == cfg2 and load_audio_encoder(d)[0] == cfg


def test_mmproj_of_another_text_model_is_refused(tiny, tmp_path):
    _, cfg, W, _ = tiny
    path = write_audio_mmproj(tmp_path / "mmproj.gguf", cfg, W)
    with pytest.raises(ConfigError, match="outputs width 64 but text.gguf has hidden size 128") as e:
        load_audio_mmproj(path, text_hidden_size=128, text_source="text.gguf")
    assert "\n" not in str(e.value)


def test_mmproj_missing_tensor_is_named(tiny, tmp_path):
    import gguf
    from gguf import GGUFValueType as VT

    from gemma4_harness.harness.synth.mm_audio import audio_mmproj_metadata

    _, cfg, W, _ = tiny
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "clip")
    for key, (val, vtype) in audio_mmproj_metadata(cfg).items():
        w.add_key_value(key, val, VT[vtype])
    for name in W:
        if name != "a.blk.1.conv_pw2.weight":
            w.add_tensor(name, np.asarray(W[name], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"missing tensor a\.blk\.1\.conv_pw2\.weight \(expected shape \[32, 32\]\)"):
        load_audio_mmproj(tmp_path / "bad.gguf")


def test_name_table_matches_gguf_tensor_map(tiny):
    """Our table = llama.cpp's converter renames (conversion/gemma.py) + gguf-py's MMPROJ tensor map."""
    import gguf
    from safetensors import safe_open

    d, *_ = tiny
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 128)
    with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
        names = [k for k in f.keys() if "audio" in k]
    assert names
    for hf in names:
        n = hf.replace("model.audio_tower.", "conformer.").replace(".linear.", ".")
        if n.endswith("per_dim_scale"):
            n += ".weight"
        expect = tmap.get_name(n, try_suffixes=(".weight", ".bias") + tuple("." + b for b in CLIP_BOUNDS))
        assert hf_to_gguf_audio(hf) == expect, hf
        assert gguf_to_hf_audio(expect) == hf
    assert hf_to_gguf_audio("model.language_model.layers.0.mlp.up_proj.weight") is None
    with pytest.raises(ModelFileError, match="unknown audio tensor"):
        hf_to_gguf_audio("model.audio_tower.layers.0.mystery.weight")


def test_hf_config_errors_are_one_line(tiny, tmp_path):
    import json
    import shutil

    d, *_ = tiny
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["audio_config"]["subsampling_conv_channels"] = [64, 8]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"subsampling_conv_channels\[0\] = 64 must equal the 128 mel bins"):
        load_audio_hf(bad)
    del raw["audio_config"]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="no audio_config"):
        load_audio_hf(bad)


def test_inf_clip_bounds_load_but_nan_is_refused(tmp_path):
    d = make_tiny_audio_hf(tmp_path / "hf", seed=1)
    from safetensors.numpy import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd["model.audio_tower.layers.0.self_attn.q_proj.input_max"] = np.array(np.inf, np.float32)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    _, W = load_audio_hf(d)
    assert W["a.blk.0.attn_q.input_max"][0] == np.inf
    sd["model.audio_tower.layers.0.self_attn.q_proj.input_max"] = np.array(np.nan, np.float32)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match="attn_q.input_max contains NaN"):
        load_audio_hf(d)[1]["a.blk.0.attn_q.input_max"]


# --------------------------------------------------------------------------- prompt expansion


def test_audio_placeholder_expansion():
    cfg = A.AudioConfig(**TINY_IDS_AUDIO)
    ids, types = A.expand_audio_placeholder(cfg, 3)
    assert ids == [505, 501, 501, 501, 506] and types == [0, 3, 3, 3, 0]
    ids, types = A.expand_audio_prompt(cfg, [2, 10, 501, 11, 501], [1, 2])
    assert ids == [2, 10, 505, 501, 506, 11, 505, 501, 501, 506]
    assert types == [0, 0, 0, 3, 0, 0, 0, 3, 3, 0]
    with pytest.raises(PromptError, match="2 audio placeholders"):
        A.expand_audio_prompt(cfg, [501, 501], [4])
    d = A.AudioConfig()
    assert (d.audio_token_id, d.boa_token_id, d.eoa_token_index) == (258881, 256000, 258883)


TINY_IDS_AUDIO = {k: v for k, v in TINY_IDS.items() if k in ("audio_token_id", "boa_token_id", "eoa_token_index")}
