"""The multimodal side of the harness: the cases (``cases/models/multimodal/``), loading both file forms, the CLI
with ``--image`` / ``--audio`` / ``--mmproj``, the parity case, llama.cpp's mtmd, and the multimodal mutants.

The encoders' and the merge's own tests are ``test_vision_reference.py``, ``test_audio_reference.py`` and
``test_multimodal.py``; here the built cases are used (``mm-llamacpp`` keeps llama.cpp's hard-coded values,
``mm-varied`` departs from them).
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from clitools import run_cli

from gemma4_harness.fast.model import FastModel
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.mm_prompts import MM_MODELS_DIR, load_mm_prompts, make_clip, make_image, write_png, write_wav
from gemma4_harness.harness.engines.llamacpp.mtmd import mtmd_soft_tokens, processed_rgb
from gemma4_harness.harness.engines.llamacpp.numerics import llamacpp_mm_numerics
from gemma4_harness.harness.engines.mm import ReferenceMM
from gemma4_harness.harness.parity.cases import multimodal_case
from gemma4_harness.harness.parity.checks.multimodal import prepared
from gemma4_harness.harness.selftest import mutants as M
from gemma4_harness.harness.selftest import run_selftest
from gemma4_harness.harness.synth.mm_case import builtin_mm_specs, ensure_mm_built, load_mm_spec
from gemma4_harness.harness.synth.spec import SpecError
from gemma4_harness.harness.traces.format import canonical_key
from gemma4_harness.reference import audio_features as AF
from gemma4_harness.reference.errors import ConfigError, InputError, PromptError
from gemma4_harness.reference.gguf_check import check_gguf
from gemma4_harness.reference.mm_model import MediaItem, expand, load_multimodal, token_ids_from_vocab
from gemma4_harness.reference.multimodal import MultimodalTokenIds

G = DEFAULT_GATES
TOK = MultimodalTokenIds(image_token_id=500, audio_token_id=501, video_token_id=502, boi_token_id=503,
                         eoi_token_id=504, boa_token_id=505, eoa_token_index=506)


# --------------------------------------------------------------------------- no model needed


def test_placeholders_expand_in_order_and_miscounts_are_one_line():
    items = [MediaItem("image", "a", 3), MediaItem("audio", "b", 2), MediaItem("image", "c", 1)]
    ids, types = expand([2, 500, 9, 501, 500], items, TOK)
    assert ids == [2, 503, 500, 500, 500, 504, 9, 505, 501, 501, 506, 503, 500, 504]
    assert types == [0, 0, 1, 1, 1, 0, 0, 0, 3, 3, 0, 0, 1, 0]
    for bad, what in (([2, 500], "1 image placeholder(s) (id 500) but 2 images"),
                      ([2, 500, 500, 501, 501], "2 audio placeholder(s) (id 501) but 1 audio clips"),
                      ([2, 503, 500, 500, 501], "begin/end token 503")):
        with pytest.raises(PromptError) as e:
            expand(bad, items, TOK)
        assert what in str(e.value) and "\n" not in str(e.value)


def test_token_ids_come_from_the_vocabulary_strings():
    vocab = [f"t{i}" for i in range(600)]
    for i, s in zip(range(500, 507), ["<|image|>", "<|audio|>", "<|video|>", "<|image>", "<image|>", "<|audio>",
                                      "<audio|>"]):
        vocab[i] = s
    assert token_ids_from_vocab(vocab, 600, "x.gguf") == TOK
    with pytest.raises(ConfigError) as e:  # no strings and a vocabulary too small for transformers' defaults
        token_ids_from_vocab([f"t{i}" for i in range(600)], 600, "x.gguf")
    assert "x.gguf" in str(e.value) and "<|image|>" in str(e.value)


def test_encoder_points_sort_before_the_decoder_in_report_order():
    keys = [("l_out", 0), ("inp_scaled", -1), ("a0.attn_out", 0), ("v0.pooled", -1), ("result_output", -1)]
    assert sorted(keys, key=lambda k: canonical_key(*k))[:2] == [("a0.attn_out", 0), ("v0.pooled", -1)]
    assert canonical_key("value.x", 0) != canonical_key("v0.x", 0)  # only v<i>. / a<j>. are encoder points


def test_spec_errors_are_one_line(tmp_path):
    good = (MM_MODELS_DIR / "mm-llamacpp.toml").read_text()
    cases = {"vision.patch_sz": good.replace("patch_size = 4", "patch_sz = 4"),
             "tokens.image_token_id": good + "\n[tokens]\nimage_token_id = 9999\n",
             "processor": good.replace("max_soft_tokens = 70", "max_soft_tokens = 100")}
    for key, text in cases.items():
        f = tmp_path / "bad.toml"
        f.write_text(text)
        with pytest.raises(SpecError) as e:
            load_mm_spec(f)
        assert key in str(e.value) and str(f) in str(e.value) and "\n" not in str(e.value)


def test_prompt_set_and_media_files(tmp_path):
    prompts = load_mm_prompts()
    assert {"image", "two-images", "audio", "image-audio", "long-audio"} <= {p["id"] for p in prompts}
    x = make_clip(0.25, 3)
    from gemma4_harness.reference.audio_features import read_wav

    back, rate = read_wav(write_wav(tmp_path / "a.wav", x))
    assert rate == 16000 and np.abs(back - x).max() <= 0.5 / 32768 + 1e-12
    img = make_image(30, 20, 1)
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(write_png(tmp_path / "a.png", img))), img)
    (tmp_path / "p.jsonl").write_text('{"id": "x", "prompt_ids": [2, "<|image|>"]}\n')
    with pytest.raises(Exception) as e:
        load_mm_prompts(tmp_path / "p.jsonl")
    assert "1 <|image|>" in str(e.value) and "0 images" in str(e.value)
    # the prompt files' one line reader (harness/core/prompts.py jsonl_objects): a U+2028 inside a note is no line end
    (tmp_path / "p.jsonl").write_text('{"id": "x", "prompt_ids": [2, 5], "note": "a\u2028b"}\n', encoding="utf-8")
    assert [(p["id"], p["note"]) for p in load_mm_prompts(tmp_path / "p.jsonl")] == [("x", "a\u2028b")]
    (tmp_path / "p.jsonl").write_text('{"id": "x", "prompt_ids": [2, 5]}\n[1]\n')
    with pytest.raises(InputError, match=rf"^{tmp_path / 'p.jsonl'}:2: expected {{\"id\""):
        load_mm_prompts(tmp_path / "p.jsonl")


def test_each_multimodal_mutant_changes_one_thing():
    """Ten mutants; a FastModel subclass overrides one method (BidirectionalFullLayers also stashes the step's
    bookkeeping in decoder_layer, as LayerScalarBranch does); a module patch replaces one existing function."""
    assert len(M.MM_MUTANTS) == 10 and len({m.name for m in M.MM_MUTANTS}) == 10
    for m in M.MM_MUTANTS:
        assert sum(x is not None for x in (m.model, m.patch, m.weights)) == 1, m.name
        if m.model is not None:
            own = {n for n, v in vars(m.model).items() if inspect.isfunction(v)}
            allowed = {"attend", "decoder_layer"} if m.model is M.BidirectionalFullLayers else {next(iter(own))}
            assert own == allowed and own <= set(dir(FastModel)), m.name
        if m.patch is not None:
            module, name, fn = m.patch
            assert callable(getattr(module, name)) and fn is not getattr(module, name), m.name


# --------------------------------------------------------------------------- the built cases


@pytest.fixture(scope="module")
def case():
    return ensure_mm_built(MM_MODELS_DIR / "mm-llamacpp.toml")


@pytest.mark.slow
def test_specs_build_and_the_two_forms_load_identically(case):
    """Both specs build; the HF folder and the text GGUF + mmproj give the same ids, arrays and (with the same
    processor budget) bit-identical soft tokens and logits; the mmproj carries llama.cpp's keys."""
    assert {s.stem for s in builtin_mm_specs()} == {"mm-llamacpp", "mm-varied"}
    hf, gg = load_multimodal(case.hf_dir), load_multimodal(case.gguf, case.mmproj)
    assert hf.tok == gg.tok == TOK and hf.cfg.use_bidirectional_attention == gg.cfg.use_bidirectional_attention
    for (_, a), (_, b) in ((hf.vision, gg.vision), (hf.audio, gg.audio)):
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    p = next(p for p in load_mm_prompts() if p["id"] == "image-audio")
    pa, pb = prepared(hf, p), prepared(gg, p, max_soft_tokens=hf.image_proc.max_soft_tokens)
    assert pa.ids == pb.ids
    assert np.array_equal(ReferenceMM(hf).logits(pa), ReferenceMM(gg).logits(pb))
    meta = check_gguf(case.mmproj).metadata
    assert (meta["clip.vision.projector_type"], meta["clip.audio.projector_type"]) == ("gemma4v", "gemma4a")
    assert "clip.projector_type" not in meta and "clip.use_gelu" not in meta
    assert check_gguf(case.mmproj_gelu).metadata["clip.use_gelu"] is True
    # the parameters that initialise to values hiding faults are randomised
    V, A = hf.vision[1], hf.audio[1]
    assert np.std(V["v.position_embd.weight"]) > 0.1 and np.std(V["v.blk.0.ln1.weight"]) > 0.1
    assert np.isfinite(V["v.blk.0.attn_q.input_max"]).all() and np.isfinite(A["a.blk.0.attn_q.input_max"]).all()
    assert np.std(A["a.blk.0.per_dim_scale.weight"]) > 0.1


@pytest.mark.slow
def test_cli_logits_trace_generate_with_image_and_audio(case, tmp_path):
    write_png(tmp_path / "i.png", make_image(72, 120, 1))
    write_wav(tmp_path / "a.wav", make_clip(1.0, 4))
    (tmp_path / "p.json").write_text("[2, 10, 500, 11, 501, 12]")
    media = ["--image", str(tmp_path / "i.png"), "--audio", str(tmp_path / "a.wav"), "--prompt-ids",
             str(tmp_path / "p.json")]
    out = {}
    for eng in ("reference", "transformers"):
        model = ["--model", "mm-llamacpp", "--engine", eng, *media]
        proc = run_cli("logits", *model, "--out", str(tmp_path / f"{eng}.npy"))
        assert proc.returncode == 0, proc.stderr
        out[eng] = np.load(tmp_path / f"{eng}.npy")
        proc = run_cli("trace", *model, "--out", str(tmp_path / f"{eng}.jsonl"))
        assert proc.returncode == 0, proc.stderr
    assert out["reference"].shape == (4 + 60 + 2 + 25 + 2, 512)  # one image (60) and one second (25), expanded
    assert np.abs(out["reference"] - out["transformers"]).max() <= G["reference~transformers.mm_max_abs_logit"].limit
    head = json.loads((tmp_path / "reference.jsonl").read_text().splitlines()[0])
    assert head["n_tokens"] == 93 and [it["soft_tokens"] for it in head["mm_items"]] == [60, 25]
    points = [json.loads(ln)["point"] for ln in (tmp_path / "reference.jsonl").read_text().splitlines()[1:]]
    assert points[0] == "v0.inp_raw_scaled" and "a0.attn_out" in points and points[-1] == "result_output"
    proc = run_cli("diff", str(tmp_path / "transformers.jsonl"), str(tmp_path / "reference.jsonl"))
    assert proc.returncode == 0 and "encoders" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("generate", "--model", "mm-llamacpp", "--engine", "fast", *media, "--max-new-tokens", "3",
                   "--out", str(tmp_path / "g.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads((tmp_path / "g.jsonl").read_text())["tokens"]) == 3


@pytest.mark.slow
def test_cli_multimodal_bad_input_is_one_line(case, tmp_path, capsys):
    """In process (``harness.cli.main``, the entry point ``g4h`` runs): exit 2 and one ``g4h: error:`` line."""
    from gemma4_harness.harness.cli import main

    write_png(tmp_path / "i.png", make_image(72, 120, 1))
    write_wav(tmp_path / "a44.wav", make_clip(0.5, 4, rate=44100), rate=44100)
    (tmp_path / "bad.png").write_text("not an image")
    (tmp_path / "p.json").write_text("[2, 10, 500, 11, 501, 12]")
    other = ensure_mm_built(MM_MODELS_DIR / "mm-varied.toml")
    base = ["logits", "--engine", "reference", "--prompt-ids", str(tmp_path / "p.json"),
            "--out", str(tmp_path / "x.npy")]
    img, aud = ["--image", str(tmp_path / "i.png")], ["--audio", str(tmp_path / "a44.wav")]
    for args, names in (
            (["--model", "mm-llamacpp", *img], ("1 audio placeholder(s)",)),
            (["--model", "mm-llamacpp", "--image", str(tmp_path / "bad.png"), *aud], ("bad.png",)),
            (["--model", "mm-llamacpp", *img, *aud], ("a44.wav", "44100")),
            (["--model", "mm-llamacpp", *img, *aud, "--resample", "--image-tokens", "100"], ("--image-tokens",)),
            (["--model", str(case.gguf), "--mmproj", str(other.mmproj), *img, *aud], ("does not match",)),
            (["--model", str(case.gguf), "--mmproj", str(case.gguf), *img, *aud], ("'clip'",)),
            (["--model", str(case.gguf), *img, *aud], ("--mmproj",)),
            (["--model", str(case.hf_dir), "--mmproj", str(case.mmproj), *img, *aud], ("--mmproj",)),
            (["--model", "mm-llamacpp", "--engine", "llamacpp", *img, *aud], ("--engine llamacpp",)),
            (["--model", "e2b", *img, *aud], ("text-only case",))):
        assert main(base + args) == 2, args
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("g4h: error: ") and any(n in err[0] for n in names), (args, err)
    assert main(base + ["--model", "mm-llamacpp", *img, *aud, "--resample"]) == 0
    assert np.load(tmp_path / "x.npy").shape[0] == 4 + 60 + 2 + 13 + 2  # 0.5 s of audio: 13 soft tokens


@pytest.mark.slow
def test_float64_oracle_agrees_to_1e_10(case):
    """transformers in float64 (its float32 casts routed to float64) and the reference agree far below the fp32
    oracle's rounding: the formulas are the same, not merely close."""
    import importlib

    from gemma4_harness.harness.parity.checks.multimodal import exact_softplus_audio

    mt = importlib.import_module("gemma4_harness.harness.engines.mm_transformers")
    hf = load_multimodal(case.hf_dir)
    pr = prepared(hf, next(p for p in load_mm_prompts() if p["id"] == "image-audio"))
    ours = ReferenceMM(exact_softplus_audio(hf, case.hf_dir)).logits(pr)
    theirs64 = mt.TransformersMM(case.hf_dir, "float64").logits(pr)
    theirs32 = mt.TransformersMM(case.hf_dir, "float32").logits(pr)
    d64, d32 = np.abs(ours - theirs64).max(), np.abs(ours - theirs32).max()
    print(f"max |dlogit|: float64 oracle {d64:.3g}, fp32 oracle {d32:.3g}")
    assert G["reference~transformers_f64.mm_max_abs_logit"].check(d64)
    assert d32 > 1e3 * d64  # the fp32 oracle could not have shown this


@pytest.mark.slow
def test_llamacpp_mtmd_matches_and_an_abort_is_one_line(case):
    """llama.cpp's projected image soft tokens against the reference with its numerics emulated; the converter's
    mmproj (gelu_quick) falls below the gate; an encoder llama.cpp cannot run (mm-varied's audio chunking) aborts in
    the worker and comes back as one line."""
    hf = load_multimodal(case.hf_dir)
    pr = prepared(hf, next(p for p in load_mm_prompts() if p["id"] == "image"))
    rgb = processed_rgb(pr.items[0].image, hf.vision[0].patch_size)
    with llamacpp_mm_numerics():
        ref = ReferenceMM(hf).soft_tokens(pr)[0]
    from gemma4_harness.harness.core.metrics import cosine

    good = mtmd_soft_tokens(case.gguf, case.mmproj_gelu, [("image", rgb)])
    quick = mtmd_soft_tokens(case.gguf, case.mmproj, [("image", rgb)])
    assert good["non_causal"] is True
    assert G["reference~llamacpp.mm_vision_cosine"].check(cosine(good["embeds"][0], ref))
    assert not G["reference~llamacpp.mm_vision_cosine"].check(cosine(quick["embeds"][0], ref))
    other = ensure_mm_built(MM_MODELS_DIR / "mm-varied.toml")
    from gemma4_harness.harness.core.workers import EngineCrashed

    with pytest.raises(EngineCrashed) as e:
        mtmd_soft_tokens(other.gguf, other.mmproj, [("audio", make_clip(1.0, 1))])
    assert str(e.value).startswith("engine crashed:") and "GGML_ASSERT" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_multimodal_parity_case_passes_every_gate(record_property):
    res = multimodal_case(MM_MODELS_DIR / "mm-llamacpp.toml", lambda m: None)
    failed = [(c["gate"], c["prompt"], c["measured"]) for c in res.checks
              if not c["pass"] and not c.get("informational")]
    gates = {c["gate"] for c in res.checks}
    for g in ("reference~hf_processor.max_abs_pixel", "reference~hf_processor.max_abs_mel",
              "reference~transformers.mm_encoder_layer_rel_l2", "reference~transformers_f64.mm_max_abs_logit",
              "reference.mmproj~hf.max_abs_logit", "fast.chunked~oneshot.max_abs_logit",
              "fast.batched~solo.same_tokens",
              "mm.bidirectional.sliding_layer_change", "reference~llamacpp.mm_vision_cosine",
              "reference~llamacpp.mm_audio_cosine"):
        assert g in gates, g
    n_pre = sum(c["gate"].startswith("reference~hf_processor") and str(c["prompt"]).startswith("pre/")
                for c in res.checks)
    assert n_pre >= 10  # at least 5 images and 5 clips besides the prompts' own
    assert not failed, failed
    assert res.passed


@pytest.mark.slow
def test_every_multimodal_mutant_is_caught_at_its_first_point(tmp_path):
    data, status = run_selftest(["mm-llamacpp"], out=str(tmp_path), quiet=True)
    rows = {m["name"]: m for m in data["mutants"]}
    assert set(rows) == {m.name for m in M.MM_MUTANTS}
    bad = [(n, r["first"], r["expected"]) for n, m in rows.items() for r in m["runs"] if not r["ok"]]
    assert not bad, bad
    assert all(m["runs"] for m in rows.values())
    assert rows["mm_rope_xy_swapped"]["first"] == "v0.Qcur_pos@0" and rows["mm_power_spectrum"]["first"] == \
        "a0.inp_raw@-1"
    assert all(c["pass"] for c in data["controls"]) and status == 0
    report = (tmp_path / next(p.name for p in tmp_path.iterdir()) / "report.md").read_text()
    assert "mm_clip_bounds_ignored" in report


def test_power_spectrum_mutant_would_change_the_mel():
    x = make_clip(0.3, 9)
    a = AF.extract_features(x)[0]
    saved = AF.magnitude_spectrum
    AF.magnitude_spectrum = M.power_spectrum
    try:
        b = AF.extract_features(x)[0]
    finally:
        AF.magnitude_spectrum = saved
    assert np.abs(a - b).max() > 1.0
