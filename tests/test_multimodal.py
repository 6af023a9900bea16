"""The multimodal merge into the text decoder: reference against transformers 5.23 (fp32, eager), the fast
twin against the reference, batching, chunked prefill, and the facts that public bugs broke.

The model (:func:`harness.synth.mm_model.build_tiny_mm_hf`): text decoder of 6 layers (full, sliding,
sliding, full, sliding-shared, full-shared), sliding window 8, PLE, softcap, ``use_bidirectional_attention
= "vision"``; vision and audio towers with bug-revealing weights. A 50 x 80 image is 60 soft tokens
(7.5 windows), one second of audio 25.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.gemma4.modeling_gemma4 import create_masks_for_vision_model, get_block_sequence_ids_for_mask

from gemma4_harness.fast import audio as FA
from gemma4_harness.fast import vision as FV
from gemma4_harness.fast.engine import Engine, Request
from gemma4_harness.fast.mm_weights import EncoderWeights
from gemma4_harness.fast.model import FastModel, SeqStep
from gemma4_harness.fast.multimodal import chunk_end
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.kld import kld_stats
from gemma4_harness.harness.core.metrics import rel_l2
from gemma4_harness.harness.synth.mm_audio import TINY_IDS
from gemma4_harness.harness.synth.mm_model import build_tiny_mm_hf
from gemma4_harness.reference import audio_features as AF
from gemma4_harness.reference import load_model
from gemma4_harness.reference import model as RM
from gemma4_harness.reference.audio import encode_audio
from gemma4_harness.reference.audio_weights import load_audio_hf
from gemma4_harness.reference.config_hf import config_from_hf
from gemma4_harness.reference.errors import ConfigError, PromptError
from gemma4_harness.reference.image_processing import ImageProcessorConfig, preprocess_image
from gemma4_harness.reference.mm_weights import load_vision
from gemma4_harness.reference.multimodal import Injection, MultimodalTokenIds, block_ids, layout_prompt, make_injection
from gemma4_harness.reference.vision import encode_image

G = DEFAULT_GATES
TOK = MultimodalTokenIds(**TINY_IDS)


# --------------------------------------------------------------------------- the model and its inputs


@dataclass
class Tiny:
    cfg: Any
    W: Any
    vcfg: Any
    VW: Any
    acfg: Any
    AW: Any
    hf: Any
    images: list  # ImageInput
    clips: list  # (features, mask)
    img: list  # reference soft tokens per image
    aud: list  # reference soft tokens per clip


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    d = build_tiny_mm_hf(tmp_path_factory.mktemp("tiny_mm") / "hf", seed=0)
    cfg, W = load_model(d)
    vcfg, VW = load_vision(d)
    acfg, AW = load_audio_hf(d)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(d, attn_implementation="eager").eval()
    pcfg = ImageProcessorConfig.from_folder(d)
    images = [preprocess_image(_image(50, 80, 0), pcfg), preprocess_image(_image(120, 40, 1), pcfg)]
    rng = np.random.default_rng(2)
    clips = [AF.extract_features(0.1 * rng.standard_normal(n)) for n in (16000, 8000)]
    img = [encode_image(vcfg, VW, i.pixel_values, i.position_ids) for i in images]
    aud = [encode_audio(acfg, AW, f, m) for f, m in clips]
    return Tiny(cfg, W, vcfg, VW, acfg, AW, hf, images, clips, img, aud)


def prompt(t: Tiny, parts) -> tuple[list[int], Injection]:
    """Ids and injection of a prompt whose parts are token ids, ``("image", i)`` and ``("audio", i)``."""
    rows, layout = [], []
    for p in parts:
        if isinstance(p, tuple):
            e = (t.img if p[0] == "image" else t.aud)[p[1]]
            rows.append(e)
            layout.append((p[0], e.shape[0]))
        else:
            layout.append(p)
    ids, types = layout_prompt(layout, TOK)
    return ids, make_injection(ids, np.concatenate(rows) if rows else np.zeros((0, t.cfg.hidden_size)), TOK, types)


MM = [2, 10, 11, ("image", 0), 12, 13, ("audio", 0), 14, 15]  # 96 tokens
IMG2 = [2, 20, 21, 22, 23, 24, 25, ("image", 1), 26]
AUD = [2, 30, ("audio", 1), 31, 32]
TEXT = [2] + list(range(40, 80))  # 41 tokens, > 3 windows


def ref_run(t: Tiny, ids, inj, cache=None) -> tuple[np.ndarray, dict]:
    rec: dict = {}
    logits = RM.forward(t.cfg, t.W, ids, cache, trace=lambda p, il, a: rec.__setitem__((p, il), a), mm=inj)
    return logits, rec


def hf_run(t: Tiny, ids, types=None, images=(), clip=None, image_embeds=None) -> tuple[np.ndarray, dict]:
    """transformers' logits and its values at ``inp_scaled``, ``inp_per_layer`` and every ``l_out``."""
    lm, rec = t.hf.model.language_model, {}
    ple: dict[int, np.ndarray] = {}

    def pre_lm(mod, args, kwargs):
        rec[("inp_scaled", -1)] = kwargs["inputs_embeds"][0].double().numpy()

    def pre_layer(mod, args, kwargs, i):
        p = args[1] if len(args) > 1 else kwargs.get("per_layer_input")
        ple[i] = p[0].double().numpy()

    hooks = [lm.register_forward_pre_hook(pre_lm, with_kwargs=True)]
    for i, layer in enumerate(lm.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, k, i=i: pre_layer(m, a, k, i), with_kwargs=True))
        hooks.append(layer.register_forward_hook(
            lambda m, a, out, i=i: rec.__setitem__(("l_out", i), (out[0] if isinstance(out, tuple) else out)[0]
                                                   .double().numpy())))
    kw: dict[str, Any] = {}
    if image_embeds is not None:
        feats = torch.tensor(np.asarray(image_embeds), dtype=torch.float32)
        kw["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=(feats,))}
    elif images:
        kw["pixel_values"] = torch.tensor(np.stack([i.pixel_values for i in images]), dtype=torch.float32)
        kw["image_position_ids"] = torch.tensor(np.stack([i.position_ids for i in images]))
    if clip is not None:
        kw["input_features"] = torch.tensor(clip[0][None], dtype=torch.float32)
        kw["input_features_mask"] = torch.tensor(clip[1][None])
    if types is not None:
        kw["mm_token_type_ids"] = torch.tensor([list(types)])
    try:
        with torch.no_grad():
            out = t.hf(input_ids=torch.tensor([ids]), use_cache=False, **kw)
    finally:
        for h in hooks:
            h.remove()
    rec[("inp_per_layer", -1)] = np.stack([ple[i] for i in sorted(ple)], axis=1)
    return out.logits[0].double().numpy(), rec


def worst_rel_l2(ours: dict, theirs: dict) -> tuple[float, Any]:
    return max((rel_l2(ours[k], theirs[k]), k) for k in theirs)


# --------------------------------------------------------------------------- config


def test_config_accepts_vision_and_refuses_all(tiny):
    assert tiny.cfg.use_bidirectional_attention == "vision"
    base = {"model_type": "gemma4_text", "num_hidden_layers": 2, "hidden_size": 16, "vocab_size": 32,
            "num_attention_heads": 2, "intermediate_size": 32, "head_dim": 8, "global_head_dim": 8}
    assert config_from_hf(base, "c.json").use_bidirectional_attention is None
    with pytest.raises(ConfigError) as e:
        config_from_hf({**base, "use_bidirectional_attention": "all"}, "c.json")
    assert "\n" not in str(e.value) and "use_bidirectional_attention" in str(e.value) and "c.json" in str(e.value)


# --------------------------------------------------------------------------- reference vs transformers


def test_reference_matches_transformers_with_image_and_audio(tiny, record_property):
    """End to end (our encoders, our merge, our decoder) against transformers' own, and the merge alone
    (transformers' soft tokens injected into our decoder)."""
    ids, inj = prompt(tiny, MM)
    ours, rec = ref_run(tiny, ids, inj)
    hf, hrec = hf_run(tiny, ids, inj.token_types, images=[tiny.images[0]], clip=tiny.clips[0])
    worst, where = worst_rel_l2(rec, hrec)
    e2e = float(np.abs(ours - hf).max())
    with torch.no_grad():
        hv = tiny.hf.model.get_image_features(torch.tensor(tiny.images[0].pixel_values[None], dtype=torch.float32),
                                              torch.tensor(tiny.images[0].position_ids[None]), return_dict=True)
        ha = tiny.hf.model.get_audio_features(torch.tensor(tiny.clips[0][0][None], dtype=torch.float32),
                                              torch.tensor(tiny.clips[0][1][None]), return_dict=True)
    hf_rows = np.concatenate([torch.cat(hv.pooler_output).double().numpy(),
                              ha.pooler_output[ha.attention_mask].double().numpy()])
    soft = float(np.abs(np.asarray(inj.embeds) - hf_rows).max())
    merge_only = float(np.abs(RM.forward(tiny.cfg, tiny.W, ids, mm=dataclasses.replace(inj, embeds=hf_rows)) - hf).max())
    record_property("e2e_max_abs_logit", e2e)
    record_property("soft_token_max_abs", soft)
    record_property("merge_max_abs_logit", merge_only)
    record_property("worst_layer_rel_l2", worst)
    print(f"end to end max|dlogit| {e2e:.3g} (informational), soft tokens {soft:.3g}, merge only {merge_only:.3g}, "
          f"worst rel L2 {worst:.3g} at {where}")
    assert G["reference~transformers.mm_max_abs_logit"].informational
    assert len(hrec) == 2 + tiny.cfg.n_layer
    assert G["reference~transformers.layer_rel_l2"].check(worst), where
    assert G["reference~transformers.mm_soft_token_max_abs"].check(soft)
    assert G["reference~transformers.mm_merged_max_abs_logit"].check(merge_only)
    # the bidirectional mask matters here: without mm_token_type_ids the logits move far beyond the gate
    assert np.abs(hf - hf_run(tiny, ids, None, images=[tiny.images[0]], clip=tiny.clips[0])[0]).max() > 1e-1


def test_types_absent_means_causal_and_transformers_agrees(tiny):
    ids, inj = prompt(tiny, [2, 10, ("image", 0), 11, 12])
    causal = RM.forward(tiny.cfg, tiny.W, ids, mm=inj.without_types())
    bidir = RM.forward(tiny.cfg, tiny.W, ids, mm=inj)
    hf_causal, _ = hf_run(tiny, ids, None, image_embeds=inj.embeds)
    hf_bidir, _ = hf_run(tiny, ids, inj.token_types, image_embeds=inj.embeds)
    assert G["reference~transformers.max_abs_logit"].check(np.abs(causal - hf_causal).max())
    assert G["reference~transformers.max_abs_logit"].check(np.abs(bidir - hf_bidir).max())
    assert np.abs(causal - bidir).max() > 1e-1
    # a model without use_bidirectional_attention ignores the types
    plain = dataclasses.replace(tiny.cfg, use_bidirectional_attention=None)
    assert np.array_equal(RM.forward(plain, tiny.W, ids, mm=inj), causal)


def test_injected_rows_are_not_scaled(tiny):
    """inp_scaled: placeholder rows are the soft tokens as they are, text rows E[id] * sqrt(h); transformers
    agrees; scaling the soft tokens by sqrt(h) (a plausible port bug) moves the logits far past the gate."""
    ids, inj = prompt(tiny, [2, 10, ("image", 0), 11, ("audio", 0), 12])
    logits, rec = ref_run(tiny, ids, inj)
    x, ph = rec[("inp_scaled", -1)], inj.placeholder
    assert np.array_equal(x[ph], np.asarray(inj.embeds))
    text = np.asarray(ids)[~ph]
    assert np.array_equal(x[~ph], tiny.W["token_embd.weight"][text] * np.sqrt(tiny.cfg.hidden_size))
    _, hrec = hf_run(tiny, ids, inj.token_types, images=[tiny.images[0]], clip=tiny.clips[0])
    assert rel_l2(x, hrec[("inp_scaled", -1)]) <= G["reference~transformers.layer_rel_l2"].limit
    scaled = dataclasses.replace(inj, embeds=np.asarray(inj.embeds) * np.sqrt(tiny.cfg.hidden_size))
    fault = np.abs(RM.forward(tiny.cfg, tiny.W, ids, mm=scaled) - logits).max()
    assert fault > 100 * G["reference~transformers.mm_merged_max_abs_logit"].limit


def test_ple_token_part_reads_the_pad_row(tiny):
    """At placeholders the PLE token part is E_ple[pad] * sqrt(P) and the context part sees the soft token;
    transformers agrees; looking up the placeholder id instead (Crane PR #23) is far off."""
    ids, inj = prompt(tiny, [2, 10, ("image", 0), 11, ("audio", 0), 12])
    _, rec = ref_run(tiny, ids, inj)
    cfg, W, ph = tiny.cfg, tiny.W, inj.placeholder
    ple, x = rec[("inp_per_layer", -1)], rec[("inp_scaled", -1)]
    pad_ids = np.where(ph, cfg.pad_token_id, ids)
    assert np.array_equal(ple, RM.per_layer_inputs(cfg, W, pad_ids, x))
    token_part = ple * np.sqrt(2.0) - RM.ple_context(cfg, W, x)
    pad_row = W["per_layer_token_embd.weight"][cfg.pad_token_id].reshape(cfg.n_layer, cfg.ple_dim) * np.sqrt(cfg.ple_dim)
    assert np.abs(token_part[ph] - pad_row[None]).max() <= 1e-12
    _, hrec = hf_run(tiny, ids, inj.token_types, images=[tiny.images[0]], clip=tiny.clips[0])
    assert rel_l2(ple[ph], hrec[("inp_per_layer", -1)][ph]) <= G["reference~transformers.layer_rel_l2"].limit
    wrong = RM.per_layer_inputs(cfg, W, np.asarray(ids), x)  # the placeholder ids' own rows
    assert rel_l2(wrong[ph], hrec[("inp_per_layer", -1)][ph]) > 1e-1


# --------------------------------------------------------------------------- the mask


@pytest.mark.parametrize("layout", [
    [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 3, 3, 3, 0, 1, 1, 2, 2, 0],  # image, audio, image touching a video
    [0] + [1] * 30 + [0, 1, 1, 0],  # an image of 30 tokens, window 8
    [1, 1, 0, 0, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0],  # image first, audio longer than the window
])
def test_mask_equals_transformers(layout):
    """Our mask (sliding with blocks, full causal) is transformers' ``create_masks_for_vision_model``."""
    types = np.asarray(layout)
    T, W = len(types), 8
    hcfg = transformers.Gemma4TextConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=8, global_head_dim=8, sliding_window=W,
                                         layer_types=["sliding_attention", "full_attention"],
                                         use_bidirectional_attention="vision", hidden_size_per_layer_input=0)
    hcfg._attn_implementation = "eager"
    masks = create_masks_for_vision_model(hcfg, torch.zeros(1, T, 16), None, None, torch.arange(T)[None],
                                          get_block_sequence_ids_for_mask(torch.tensor([layout]), "cpu"))
    pos, b = np.arange(T), block_ids(types)
    assert np.array_equal(RM.attention_mask(pos, pos, W, b, b), (masks["sliding_attention"][0, 0] == 0).numpy())
    assert np.array_equal(RM.attention_mask(pos, pos, None), (masks["full_attention"][0, 0] == 0).numpy())


def _changed(a: dict, b: dict, layer: int, pos: int) -> float:
    """Relative change of ``l_out`` of ``layer`` at position ``pos``."""
    x, y = a[("l_out", layer)][pos], b[("l_out", layer)][pos]
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def test_perturbing_the_last_image_token_reaches_the_first_on_sliding_layers_only(tiny, record_property):
    """vLLM #40106 (mask ignored) and PR #47217 (mask dropped for images longer than the window): with the
    image 7.5 windows long, a new last soft token reaches the first one on the first sliding layer (1),
    not on the full layer 0 before it; text before the image never changes; transformers agrees; without
    the types nothing reaches it; audio soft tokens are causal (not a block)."""
    ids, inj = prompt(tiny, [2, 10, ("image", 0), 11, ("audio", 0), 12])
    ph = np.flatnonzero(inj.placeholder)
    first_img, last_img, first_aud = ph[0], ph[59], ph[60]
    assert last_img - first_img > 7 * tiny.cfg.sliding_window
    assert [L.is_sliding for L in tiny.cfg.layers[:2]] == [False, True]
    e = np.array(inj.embeds)
    e[59] = np.random.default_rng(5).standard_normal(e.shape[1])  # only the last image soft token changes
    a, b = ref_run(tiny, ids, inj)[1], ref_run(tiny, ids, dataclasses.replace(inj, embeds=e))[1]
    full, sliding = _changed(a, b, 0, first_img), _changed(a, b, 1, first_img)
    record_property("first_image_token_change_full_layer0", full)
    record_property("first_image_token_change_sliding_layer1", sliding)
    print(f"first image token, relative change of l_out: full layer 0 {full:.3g}, sliding layer 1 {sliding:.3g}")
    assert G["mm.bidirectional.full_layer_change"].check(full)
    assert G["mm.bidirectional.sliding_layer_change"].check(sliding)
    for il in range(tiny.cfg.n_layer):
        assert all(_changed(a, b, il, p) == 0.0 for p in range(first_img)), il  # text and boi before the image
    ha = hf_run(tiny, ids, inj.token_types, image_embeds=inj.embeds[:60], clip=tiny.clips[0])[1]
    hb = hf_run(tiny, ids, inj.token_types, image_embeds=e[:60], clip=tiny.clips[0])[1]
    assert G["mm.bidirectional.full_layer_change"].check(_changed(ha, hb, 0, first_img))
    assert G["mm.bidirectional.sliding_layer_change"].check(_changed(ha, hb, 1, first_img))
    nt = inj.without_types()
    c1, c2 = ref_run(tiny, ids, nt)[1], ref_run(tiny, ids, dataclasses.replace(nt, embeds=e))[1]
    assert all(_changed(c1, c2, il, first_img) == 0.0 for il in range(tiny.cfg.n_layer))
    e_aud = np.array(inj.embeds)
    e_aud[-1] = np.random.default_rng(6).standard_normal(e.shape[1])  # only the last audio soft token changes
    d = ref_run(tiny, ids, dataclasses.replace(inj, embeds=e_aud))[1]
    assert all(_changed(a, d, il, first_aud) == 0.0 for il in range(tiny.cfg.n_layer))


# --------------------------------------------------------------------------- chunking and errors (reference)


def test_reference_prefill_in_calls_and_split_block_refused(tiny):
    ids, inj = prompt(tiny, MM)
    one = RM.forward(tiny.cfg, tiny.W, ids, mm=inj)
    start = int(np.flatnonzero(inj.placeholder)[0])
    cuts = [0, start - 1, start + 60 + 2, len(ids)]  # before the image, after it (and its eoi), the end
    cache = RM.KVCache(tiny.cfg)
    parts = [RM.forward(tiny.cfg, tiny.W, ids[lo:hi], cache, mm=inj.part(lo, hi)) for lo, hi in itertools.pairwise(cuts)]
    assert G["reference.cached~uncached.max_abs_logit"].check(np.abs(np.concatenate(parts) - one).max())
    cache = RM.KVCache(tiny.cfg)
    RM.forward(tiny.cfg, tiny.W, ids[:start + 10], cache, mm=inj.part(0, start + 10))
    with pytest.raises(PromptError) as e:
        RM.forward(tiny.cfg, tiny.W, ids[start + 10:], cache, mm=inj.part(start + 10, len(ids)))
    assert "\n" not in str(e.value) and "image block" in str(e.value)


def test_placeholder_count_and_type_errors_are_one_line(tiny):
    ids, inj = prompt(tiny, [2, 10, ("image", 0), 11])
    n = int(inj.placeholder.sum())
    fm = FastModel(tiny.cfg, tiny.W, "cpu", "float32")
    short = dataclasses.replace(inj, embeds=np.asarray(inj.embeds)[:-1])
    for run in (lambda: RM.forward(tiny.cfg, tiny.W, ids, mm=short), lambda: fm.logits(ids, mm=short)):
        with pytest.raises(PromptError) as e:
            run()
        assert "\n" not in str(e.value) and f"{n} placeholder" in str(e.value) and f"{n - 1} soft-token" in str(e.value)
    types = np.array(inj.token_types)
    types[0] = 1
    with pytest.raises(PromptError, match=r"mm_token_type_ids\[0\] = 1"):
        RM.forward(tiny.cfg, tiny.W, ids, mm=dataclasses.replace(inj, token_types=types))
    with pytest.raises(PromptError, match="hidden size"):
        RM.forward(tiny.cfg, tiny.W, ids, mm=dataclasses.replace(inj, embeds=np.zeros((n, 3))))


def test_an_injection_without_placeholders_changes_nothing(tiny):
    """Text-only prompts keep their logits bit for bit when passed through the multimodal path."""
    empty = Injection(np.zeros((0, tiny.cfg.hidden_size)), np.zeros(len(TEXT), bool), np.zeros(len(TEXT), int))
    assert np.array_equal(RM.forward(tiny.cfg, tiny.W, TEXT, mm=empty), RM.forward(tiny.cfg, tiny.W, TEXT))
    fm = FastModel(tiny.cfg, tiny.W, "cpu", "float32")
    assert torch.equal(fm.logits(TEXT, mm=empty), fm.logits(TEXT))


# --------------------------------------------------------------------------- the fast twin


@pytest.fixture(scope="module")
def fast32(tiny) -> FastModel:
    return FastModel(tiny.cfg, tiny.W, "cpu", "float32")


def test_fast_encoders_match_the_reference(tiny, record_property):
    dev = torch.device("cpu")
    vw, aw = EncoderWeights(tiny.VW, dev, torch.float32), EncoderWeights(tiny.AW, dev, torch.float32)
    for i, im in enumerate(tiny.images):
        ours, theirs = {}, {}
        fv = FV.encode_image(tiny.vcfg, vw, im.pixel_values, im.position_ids,
                             trace=lambda p, il, a, d=ours: d.__setitem__((p, il), a))
        encode_image(tiny.vcfg, tiny.VW, im.pixel_values, im.position_ids,
                     trace=lambda p, il, a, d=theirs: d.__setitem__((p, il), a))
        assert set(ours) == set(theirs)
        worst = max(rel_l2(ours[k], theirs[k]) for k in theirs)
        assert G["reference~fast.layer_rel_l2"].check(worst)
        record_property(f"image{i}_max_abs", float(np.abs(fv.double().numpy() - tiny.img[i]).max()))
    for i, (f, m) in enumerate(tiny.clips):
        ours, theirs = {}, {}
        fa = FA.encode_audio(tiny.acfg, aw, f, m, trace=lambda p, il, a, d=ours: d.__setitem__((p, il), a))
        encode_audio(tiny.acfg, tiny.AW, f, m, trace=lambda p, il, a, d=theirs: d.__setitem__((p, il), a))
        assert set(ours) == set(theirs)
        assert G["reference~fast.layer_rel_l2"].check(max(rel_l2(ours[k], theirs[k]) for k in theirs))
        record_property(f"clip{i}_max_abs", float(np.abs(fa.double().numpy() - tiny.aud[i]).max()))


@pytest.mark.parametrize("parts", [MM, IMG2, AUD], ids=["image+audio", "image", "audio"])
def test_fast_fp32_matches_reference(tiny, fast32, parts):
    ids, inj = prompt(tiny, parts)
    ref, rrec = ref_run(tiny, ids, inj)
    frec: dict = {}
    fast = fast32.logits(ids, trace=lambda p, il, a: frec.__setitem__((p, il), a), mm=inj).double().numpy()
    assert G["reference~fast.max_abs_logit"].check(np.abs(fast - ref).max())
    assert set(frec) == set(rrec)
    assert G["reference~fast.layer_rel_l2"].check(max(rel_l2(frec[k], rrec[k]) for k in rrec))


@pytest.mark.slow
def test_fast_bf16_runs_and_is_reported(tiny, record_property):
    """bf16 weights in the decoder and both encoders: finite, and its KLD against the reference reported
    (this narrow model's bf16 figures are informational, as for the text cases: cases/models/e2b.toml)."""
    dev = torch.device("cpu")
    fm = FastModel(tiny.cfg, tiny.W, "cpu", "bfloat16")
    vw, aw = EncoderWeights(tiny.VW, dev, torch.bfloat16), EncoderWeights(tiny.AW, dev, torch.bfloat16)
    im, (f, m) = tiny.images[0], tiny.clips[0]
    rows = torch.cat([FV.encode_image(tiny.vcfg, vw, im.pixel_values, im.position_ids),
                      FA.encode_audio(tiny.acfg, aw, f, m)])
    ids, inj = prompt(tiny, MM)
    fast = fm.logits(ids, mm=dataclasses.replace(inj, embeds=rows)).double().numpy()
    ref = RM.forward(tiny.cfg, tiny.W, ids, mm=inj)
    assert np.isfinite(fast).all() and rows.dtype == torch.float32
    k = kld_stats(fast, ref)
    record_property("bf16_mean_kld", k.mean_kld)
    record_property("bf16_same_top1_pct", k.same_top_p_pct)
    print(f"bf16 (encoders and decoder) vs reference: mean KLD {k.mean_kld:.3g}, same top-1 {k.same_top_p_pct:.1f} %")
    assert 0 < k.mean_kld < float("inf")


@pytest.mark.parametrize("chunk", [5, 8, 16, 40])
def test_chunked_prefill_with_a_boundary_inside_the_image_equals_one_shot(tiny, fast32, chunk):
    ids, inj = prompt(tiny, MM)
    ph = np.flatnonzero(inj.placeholder)
    img_lo, img_hi = ph[0], ph[59] + 1
    nominal = range(chunk, len(ids), chunk)
    assert any(img_lo < c < img_hi for c in nominal)  # the nominal chunking cuts the image
    ends, start = [], 0
    while start < len(ids):
        start = chunk_end(fast32.cfg, inj, start, chunk, len(ids))
        ends.append(start)
    assert not any(img_lo < c < img_hi for c in ends)  # the engine's does not
    one = fast32.logits(ids, mm=inj)
    chunked = fast32.logits(ids, chunk=chunk, mm=inj)
    assert G["fast.chunked~oneshot.max_abs_logit"].check((chunked - one).abs().max().item())


def test_a_naive_split_inside_the_image_would_be_caught(tiny, fast32):
    """Stepping the cache with a boundary inside the image (what chunk_end prevents) changes the logits far
    beyond the chunked gate: the chunked test above has teeth."""
    ids, inj = prompt(tiny, MM)
    cut = int(np.flatnonzero(inj.placeholder)[0]) + 10
    cache = fast32.new_cache(1, len(ids))
    slot = cache.alloc()
    with torch.inference_mode():
        parts = [fast32.step(cache, [SeqStep(slot, torch.tensor(ids[lo:hi]), lo, inj.part(lo, hi))], all_logits=True)
                 for lo, hi in ((0, cut), (cut, len(ids)))]
    assert (torch.cat(parts) - fast32.logits(ids, mm=inj)).abs().max().item() > 1e-1


@pytest.mark.slow
def test_batched_mixed_prompts_equal_solo(tiny, fast32, record_property):
    """Image, audio and image+audio prompts among text-only ones, staggered arrivals, 3 slots (requests
    retire mid-batch and others take their slot), prefill chunks of 16 that would cut the images."""
    reqs = []
    for i, (parts, arrival) in enumerate([(MM, 0), (TEXT, 0), (IMG2, 1), (AUD, 2), (TEXT[:9], 3),
                                          ([2, 90, ("image", 0), 91, ("audio", 1), 92], 4)]):
        ids, inj = prompt(tiny, parts)
        reqs.append(Request(str(i), ids, 4 + i % 3, arrival=arrival, mm=None if not inj.placeholder.any() else inj))
    eng = Engine(fast32, max_batch=3, prefill_chunk=16, keep_logits=True)
    bat = eng.run(reqs)
    solo = Engine(fast32, max_batch=1, prefill_chunk=10**6, keep_logits=True).run(reqs)
    same = all(bat[r.id].tokens == solo[r.id].tokens for r in reqs)
    diff = max(float(np.abs(np.array(bat[r.id].logits) - np.array(solo[r.id].logits)).max()) for r in reqs)
    record_property("batched_vs_solo_max_abs_logit", diff)
    assert max(eng.batch_sizes) == 3
    assert G["fast.batched~solo.same_tokens"].check(1.0 if same else 0.0)
    assert G["fast.batched~solo.max_abs_logit"].check(diff)
    # the first generated token's logits are the reference's last row
    for r in reqs:
        ref = RM.forward(tiny.cfg, tiny.W, r.prompt, mm=r.mm)[-1]
        assert G["reference~fast.max_abs_logit"].check(np.abs(bat[r.id].logits[0] - ref).max()), r.id
