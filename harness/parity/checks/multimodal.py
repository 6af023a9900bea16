"""Checks of the multimodal path: images and audio through the encoders, the merge and the decoder.

Every engine gets the same prepared prompt (:func:`reference.mm_model.prepare_prompt`: our preprocessing, the
placeholders expanded), so each stage is measured on its own; the preprocessing is compared with transformers'
processors separately. Figures (gates in :mod:`harness.core.gates`):

* :func:`preprocessing_figures`: our pixels and positions against ``Gemma4ImageProcessorPil``, our log-mel
  features against ``Gemma4AudioFeatureExtractor``, on the case's media and on :data:`PREPROCESS_IMAGES` /
  :data:`PREPROCESS_CLIPS` (sizes and aspect ratios; clips shorter than 1 s, about 1 s, 7 s, 30 s and over 30 s);
* :func:`oracle_figures`: reference (float64) against transformers fp32 eager at each stage: every encoder trace
  point, the projected soft tokens, every decoder trace point, the merge alone (transformers' own soft tokens
  injected into our decoder) and the end-to-end logits; and against transformers in float64
  (:func:`harness.engines.mm_transformers.float64_everywhere`), where the formulas must agree to ~1e-12;
* :func:`mmproj_figures`: the same weights through the text GGUF + mmproj and through the HF folder;
* :func:`fast_figures`: the fast path (fp32) against the reference, chunked prefill with a boundary inside an
  image against one shot, and a continuous batch of multimodal prompts among text-only ones against solo runs;
* :func:`mask_figures`: only the last image soft token changes; how much the first image token's output moves on
  the first full and the first sliding layer (vLLM #40106 / PR #47217);
* :func:`llamacpp_figures`: llama.cpp's mtmd soft tokens against the reference, in a worker subprocess.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from safetensors import safe_open

from gemma4_harness.fast.engine import Engine, Request
from gemma4_harness.reference import audio_features as AF
from gemma4_harness.reference.audio_weights import gguf_to_hf_audio
from gemma4_harness.reference.image_processing import preprocess_image
from gemma4_harness.reference.mm_model import MultimodalModel, MultimodalPrompt, prepare_prompt
from gemma4_harness.reference.multimodal import MM_TYPE_IMAGE

from ...core import metrics
from ...core.gates import DEFAULT_GATES
from ...core.mm_prompts import make_clip, make_image, prompt_media, resolve_ids
from ...engines.llamacpp.mtmd import mtmd_soft_tokens, processed_rgb
from ...engines.llamacpp.numerics import llamacpp_mm_numerics
from ...engines.mm import ReferenceMM
from ...engines.mm_fast import FastMM
from ...traces import TraceRecorder, layer_errors
from ..result import Figure, fig

Progress = Callable[[str], None]

#: Images of the preprocessing check (height, width, seed): landscape, portrait, square, extreme aspect ratios
#: (one side rounds to a single cell), tiny, large.
PREPROCESS_IMAGES = ((50, 80, 11), (120, 40, 12), (72, 120, 13), (64, 64, 14), (20, 300, 15), (300, 18, 16),
                     (9, 9, 17), (480, 640, 18))

#: Clips of the preprocessing check (samples at 16 kHz, seed): shorter than 1 s, about 1 s (one masked tail frame),
#: about 7 s, just under 30 s, over 30 s (truncated, as transformers does).
PREPROCESS_CLIPS = ((8123, 21), (16160, 22), (112_345, 23), (479_900, 24), (520_000, 25))


def prepared(mm: MultimodalModel, prompt: dict[str, Any], max_soft_tokens: int | None = None) -> MultimodalPrompt:
    """A prompt of the set (:mod:`harness.core.mm_prompts`) prepared for ``mm``."""
    images, clips = prompt_media(prompt)
    return prepare_prompt(mm, resolve_ids(prompt["prompt_ids"], mm.tok), images, clips,
                          max_soft_tokens=max_soft_tokens)


def usable(mm: MultimodalModel, prompts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompts whose media the model has towers for."""
    return [p for p in prompts if (mm.vision or not p["images"]) and (mm.audio or not p["audio"])]


# --------------------------------------------------------------------------- preprocessing


def _hf_processors(hf_dir: Path):
    import transformers  # optional heavy dependency: the oracle's processors

    raw = json.loads((hf_dir / "processor_config.json").read_text())
    ip = fe = None
    if "image_processor" in raw:
        d = {k: v for k, v in raw["image_processor"].items() if k not in ("image_processor_type", "processor_class")}
        ip = transformers.Gemma4ImageProcessorPil(**d)
    if "feature_extractor" in raw:
        d = {k: v for k, v in raw["feature_extractor"].items() if k not in ("feature_extractor_type",
                                                                               "processor_class")}
        fe = transformers.Gemma4AudioFeatureExtractor(**d)
    return ip, fe


def pixel_error(ours, hf_pixels: np.ndarray, hf_positions: np.ndarray, hf_n: int) -> tuple[float, str]:
    """max |Δ| of our pixels (rounded once to float32) against transformers', or inf when the patch count, the
    positions or the soft-token count differ (the reason is returned)."""
    if ours.pixel_values.shape != hf_pixels.shape:
        return float("inf"), f"pixel_values {list(ours.pixel_values.shape)} vs {list(hf_pixels.shape)}"
    if not np.array_equal(ours.position_ids, hf_positions):
        return float("inf"), "positions differ"
    if ours.num_soft_tokens != hf_n:
        return float("inf"), f"{ours.num_soft_tokens} vs {hf_n} soft tokens"
    return float(np.abs(ours.pixel_values.astype(np.float32).astype(np.float64) - hf_pixels).max()), ""


def preprocessing_figures(mm: MultimodalModel, hf_dir: Path, prompts: Sequence[dict[str, Any]]) -> list[Figure]:
    """``reference~hf_processor.max_abs_pixel`` per image, ``reference~hf_processor.max_abs_mel`` per clip (prompt
    ``<prompt id>/<item>`` or ``pre/<h>x<w>`` / ``pre/<seconds>s`` for the extra set)."""
    ip, fe = _hf_processors(hf_dir)
    out: list[Figure] = []
    images = [(f"pre/{h}x{w}", make_image(h, w, s)) for h, w, s in PREPROCESS_IMAGES] if ip else []
    clips = [(f"pre/{n / 16000:.2f}s", make_clip(n / 16000, s)) for n, s in PREPROCESS_CLIPS] if fe else []
    for p in prompts:
        imgs, auds = prompt_media(p)
        images += [(f"{p['id']}/image{i}", im) for i, im in enumerate(imgs)] if ip else []
        clips += [(f"{p['id']}/audio{i}", a) for i, a in enumerate(auds)] if fe else []
    for label, rgb in images:
        ours = preprocess_image(rgb, mm.image_proc)
        hf = ip(images=[rgb], return_tensors="np")
        err, why = pixel_error(ours, np.asarray(hf["pixel_values"][0], dtype=np.float64),
                               np.asarray(hf["image_position_ids"][0]), int(hf["num_soft_tokens_per_image"][0]))
        out.append(fig("reference~hf_processor.max_abs_pixel", err, label, size=list(rgb.shape[:2]),
                       **({"got": why} if why else {})))
    for label, x in clips:
        x = x.astype(np.float32)  # what transformers' extractor takes; ours reads the same values in float64
        feats, mask = AF.extract_features(x, mm.mel)
        hf = fe([x], return_tensors="np")
        hf_f, hf_m = np.asarray(hf["input_features"][0], dtype=np.float64), np.asarray(hf["input_features_mask"][0])
        if hf_f.shape != feats.shape or not np.array_equal(hf_m, mask):
            out.append(fig("reference~hf_processor.max_abs_mel", float("inf"), label,
                           got=f"features {list(feats.shape)} vs {list(hf_f.shape)} or the frame masks differ"))
        else:
            out.append(fig("reference~hf_processor.max_abs_mel", float(np.abs(feats - hf_f).max()), label,
                           frames=int(mask.sum())))
    return out


# --------------------------------------------------------------------------- reference vs transformers


def _split_points(rec: TraceRecorder) -> tuple[TraceRecorder, TraceRecorder]:
    enc, dec = TraceRecorder(), TraceRecorder()
    for k, v in rec.points.items():
        (enc if k[0][:1] in "va" and "." in k[0] else dec).points[k] = v
    return enc, dec


def exact_softplus_audio(mm: MultimodalModel, hf_dir: Path) -> MultimodalModel:
    """``mm`` with each audio ``per_dim_scale`` holding ``softplus`` in float64 of the HF parameter.

    The reference reads it rounded to float32, as an F32 mmproj stores it (llama.cpp's converter writes the
    softplus); transformers in float64 computes it in float64. That rounding (relative 6e-8) is the one place the
    two float64 computations differ by design, so the float64 oracle is compared with this model.
    """
    if mm.audio is None:
        return mm
    acfg, AW = mm.audio
    w = {k: AW[k] for k in AW}
    with safe_open(str(hf_dir / "model.safetensors"), framework="numpy") as f:
        for k in w:
            if k.endswith("per_dim_scale.weight"):
                w[k] = np.logaddexp(0.0, f.get_tensor(gguf_to_hf_audio(k)).astype(np.float64))
    return dataclasses.replace(mm, audio=(acfg, w))


def oracle_figures(mm: MultimodalModel, hf_dir: Path, prompts: Sequence[dict[str, Any]],
                   progress: Progress, name: str) -> list[Figure]:
    """Reference against transformers fp32 (every stage) and float64 (soft tokens, every trace point, logits)."""
    mt = importlib.import_module("gemma4_harness.harness.engines.mm_transformers")
    out: list[Figure] = []
    ref = ReferenceMM(mm)
    hf32 = mt.TransformersMM(hf_dir, "float32")
    ref64 = ReferenceMM(exact_softplus_audio(mm, hf_dir))
    hf64 = mt.TransformersMM(hf_dir, "float64")
    for p in prompts:
        progress(f"[{name}] reference vs transformers (fp32, float64): {p['id']}")
        pr = prepared(mm, p)
        ta, tb = TraceRecorder(), TraceRecorder()
        ours = ref.logits(pr, trace=ta)
        theirs = hf32.logits(pr, trace=tb)
        soft_ours, soft_hf = ref.soft_tokens(pr), hf32.soft_tokens(pr)
        enc_a, dec_a = _split_points(ta)
        enc_b, dec_b = _split_points(tb)
        soft = max((metrics.max_abs_err(a, b) for a, b in zip(soft_ours, soft_hf)), default=0.0)
        out.append(fig("reference~transformers.mm_soft_token_max_abs", soft, p["id"], items=len(pr.items)))
        rows = layer_errors(enc_a, enc_b)
        if pr.items:
            if len(rows) != len(enc_b.points):
                out.append(fig("reference~transformers.mm_encoder_layer_rel_l2", float("inf"), p["id"],
                               got=f"{len(enc_b.points) - len(rows)} encoder trace points missing or mis-shaped"))
            else:
                w = max(rows, key=lambda r: r["rel_l2"])
                out.append(fig("reference~transformers.mm_encoder_layer_rel_l2", w["rel_l2"], p["id"],
                               worst_point=f"{w['point']}@{w['layer']}", n_points=len(rows),
                               encoder_points=[[r["point"], r["layer"], r["rel_l2"]] for r in rows]))
        rows = layer_errors(dec_a, dec_b)
        w = max(rows, key=lambda r: r["rel_l2"])
        out.append(fig("reference~transformers.layer_rel_l2", w["rel_l2"], p["id"],
                       worst_point=f"{w['point']}@{w['layer']}",
                       per_point=[[r["point"], r["layer"], r["rel_l2"]] for r in rows]))
        merged = ref.logits(pr, embeds=np.concatenate(soft_hf) if soft_hf else None)
        out.append(fig("reference~transformers.mm_merged_max_abs_logit", metrics.max_abs_err(merged, theirs), p["id"],
                       tokens=len(pr.ids)))
        out.append(fig("reference~transformers.mm_max_abs_logit", metrics.max_abs_err(ours, theirs), p["id"],
                       tokens=len(pr.ids), same_top1=metrics.top1_agreement(ours, theirs)))
        t64a, t64b = TraceRecorder(), TraceRecorder()
        o64, h64 = ref64.logits(pr, trace=t64a), hf64.logits(pr, trace=t64b)
        rows = layer_errors(t64a, t64b)
        w = max(rows, key=lambda r: r["rel_l2"])
        s64 = max((metrics.max_abs_err(a, b) for a, b in zip(ref64.soft_tokens(pr), hf64.soft_tokens(pr))),
                  default=0.0)
        out.append(fig("reference~transformers_f64.mm_soft_token_max_abs", s64, p["id"]))
        out.append(fig("reference~transformers_f64.layer_rel_l2", w["rel_l2"], p["id"],
                       worst_point=f"{w['point']}@{w['layer']}", n_points=len(rows)))
        out.append(fig("reference~transformers_f64.mm_max_abs_logit", metrics.max_abs_err(o64, h64), p["id"],
                       tokens=len(pr.ids)))
    return out


# --------------------------------------------------------------------------- the two file forms


def mmproj_figures(hf_mm: MultimodalModel, gguf_mm: MultimodalModel, prompts: Sequence[dict[str, Any]]) -> list[Figure]:
    """The reference on the text GGUF + mmproj against the reference on the HF folder, same processor budget:
    ``reference.mmproj~hf.max_abs_soft_token`` and ``reference.mmproj~hf.max_abs_logit`` (both must be 0: the same
    float32 weights through two loaders)."""
    out = []
    a, b = ReferenceMM(hf_mm), ReferenceMM(gguf_mm)
    budget = hf_mm.image_proc.max_soft_tokens
    for p in prompts:
        pa, pb = prepared(hf_mm, p), prepared(gguf_mm, p, max_soft_tokens=budget)
        sa, sb = a.soft_tokens(pa), b.soft_tokens(pb)
        soft = max((metrics.max_abs_err(x, y) if x.shape == y.shape else float("inf") for x, y in zip(sa, sb)),
                   default=0.0)
        out.append(fig("reference.mmproj~hf.max_abs_soft_token", soft, p["id"]))
        la = a.logits(pa, embeds=np.concatenate(sa) if sa else None)
        lb = b.logits(pb, embeds=np.concatenate(sb) if sb and soft != float("inf") else None)
        out.append(fig("reference.mmproj~hf.max_abs_logit", metrics.max_abs_err(lb, la), p["id"],
                       bidirectional_gguf=gguf_mm.cfg.use_bidirectional_attention,
                       bidirectional_hf=hf_mm.cfg.use_bidirectional_attention))
    return out


# --------------------------------------------------------------------------- fast


def _image_span(pr: MultimodalPrompt) -> tuple[int, int] | None:
    """``[lo, hi)`` of the first image's soft tokens, or None."""
    idx = np.flatnonzero(pr.token_types == MM_TYPE_IMAGE)
    if idx.size == 0:
        return None
    lo = hi = int(idx[0])
    while hi < len(pr.ids) and pr.token_types[hi] == MM_TYPE_IMAGE:
        hi += 1
    return lo, hi


def fast_figures(mm: MultimodalModel, prompts: Sequence[dict[str, Any]], text_prompts: Sequence[dict[str, Any]],
                 progress: Progress, name: str) -> list[Figure]:
    """Fast fp32 against the reference (logits; relative L2 at every trace point, the encoders' included, named as
    the pair pipeline names them: ``reference~fast.max_abs_logit``, ``.layer_rel_l2`` with ``first_divergence``
    beyond the default gate; a point the fast side lacks fails the figure (inf)); chunked
    prefill with a nominal boundary inside the first image against one shot; one continuous batch of every
    multimodal prompt among ``text_prompts`` (3 slots, staggered arrivals, prefill chunks of 16) against solo runs."""
    out: list[Figure] = []
    layer_limit = DEFAULT_GATES["reference~fast.layer_rel_l2"].limit
    ref, fast = ReferenceMM(mm), FastMM(mm, "cpu", "float32")
    reqs, solo_ref = [], {}
    for p in prompts:
        progress(f"[{name}] fast vs reference: {p['id']}")
        pr = prepared(mm, p)
        ta, tb = TraceRecorder(), TraceRecorder()
        r, f = ref.logits(pr, trace=ta), fast.logits(pr, trace=tb)
        rows = layer_errors(tb, ta)
        worst = max(rows, key=lambda e: e["rel_l2"] if e["rel_l2"] == e["rel_l2"] else float("inf"))
        first = next((e for e in rows if not e["rel_l2"] <= layer_limit), None)
        out.append(fig("reference~fast.max_abs_logit", metrics.max_abs_err(f, r), p["id"], tokens=len(pr.ids),
                       same_top1=metrics.top1_agreement(f, r)))
        out.append(fig("reference~fast.layer_rel_l2", worst["rel_l2"] if len(rows) == len(ta.points) else float("inf"),
                       p["id"], worst_point=f"{worst['point']}@{worst['layer']}", n_points=len(rows),
                       first_divergence=None if first is None else f"{first['point']}@{first['layer']}",
                       per_point=[[e["point"], e["layer"], e["rel_l2"]] for e in rows]))
        span = _image_span(pr)
        if span is not None and mm.cfg.use_bidirectional_attention == "vision" and pr.use_types:
            chunk = max(2, (span[1] - span[0]) // 3)
            chunked = fast.logits(pr, chunk=chunk)
            out.append(fig("fast.chunked~oneshot.max_abs_logit", metrics.max_abs_err(chunked, f), p["id"],
                           variant=f"chunk {chunk} (image at {span[0]}..{span[1]})"))
        inj = fast.injection(pr)
        reqs.append(Request(p["id"], pr.ids, 3 + len(reqs) % 3, arrival=len(reqs), mm=inj))
        solo_ref[p["id"]] = r
    for i, p in enumerate(text_prompts):
        reqs.insert(2 * i + 1, Request(f"text/{p['id']}", p["prompt_ids"], 4, arrival=i))
    progress(f"[{name}] fast: {len(reqs)} requests in one continuous batch vs solo")
    bat = Engine(fast.model, max_batch=3, prefill_chunk=16, keep_logits=True).run(reqs)
    solo = Engine(fast.model, max_batch=1, prefill_chunk=10**6, keep_logits=True).run(reqs)
    same = all(bat[r.id].tokens == solo[r.id].tokens for r in reqs)
    diff = max(float(np.abs(np.array(bat[r.id].logits) - np.array(solo[r.id].logits)).max()) for r in reqs)
    out.append(fig("fast.batched~solo.same_tokens", 1.0 if same else 0.0, None, requests=len(reqs)))
    out.append(fig("fast.batched~solo.max_abs_logit", diff, None, requests=len(reqs)))
    first = max(metrics.max_abs_err(bat[k].logits[0], solo_ref[k][-1]) for k in solo_ref)
    out.append(fig("reference~fast.max_abs_logit", first, "batched/first-token", variant="batched first token"))
    return out


# --------------------------------------------------------------------------- the vision mask


def mask_figures(mm: MultimodalModel, prompts: Sequence[dict[str, Any]], engines: dict[str, Any]) -> list[Figure]:
    """Change only the last soft token of the first image; the relative change of ``l_out`` at the first image token
    on the first full layer and the first sliding layer, on each engine (``prompt`` = ``<engine>/<prompt id>``).

    With ``use_bidirectional_attention = "vision"`` the sliding layer must see it (``mm.bidirectional.*``); a full
    layer placed before every sliding layer must not. A causal model must not see it on any layer before the
    image's end (``mm.causal.first_image_token_change``)."""
    out: list[Figure] = []
    cfg = mm.cfg
    kinds = [L.is_sliding for L in cfg.layers]
    if True not in kinds:
        return out
    first_sliding = kinds.index(True)
    first_full = kinds.index(False) if False in kinds else None
    for p in prompts:
        pr = prepared(mm, p)
        span = _image_span(pr)
        if span is None:
            continue
        lo, hi = span
        e0 = np.concatenate(ReferenceMM(mm).soft_tokens(pr))
        pos_img = np.flatnonzero(pr.placeholder)
        last = int(np.flatnonzero(pos_img == hi - 1)[0])
        e1 = e0.copy()
        e1[last] = np.random.default_rng(5).standard_normal(e0.shape[1]) * np.abs(e0).mean() * 2
        for ename, eng in engines.items():
            ta, tb = TraceRecorder(), TraceRecorder()
            eng.logits(pr, trace=ta, embeds=e0)
            eng.logits(pr, trace=tb, embeds=e1)

            def change(layer: int) -> float:
                a, b = ta.points[("l_out", layer)][lo], tb.points[("l_out", layer)][lo]
                return float(np.linalg.norm(a - b) / np.linalg.norm(a))

            label = f"{ename}/{p['id']}"
            if cfg.use_bidirectional_attention == "vision" and pr.use_types:
                out.append(fig("mm.bidirectional.sliding_layer_change", change(first_sliding), label,
                               variant=f"layer {first_sliding} (sliding), image {hi - lo} tokens, window "
                                       f"{cfg.sliding_window}"))
                if first_full is not None and first_full < first_sliding:
                    out.append(fig("mm.bidirectional.full_layer_change", change(first_full), label,
                                   variant=f"layer {first_full} (full)"))
            else:
                out.append(fig("mm.causal.first_image_token_change",
                               max(change(il) for il in range(cfg.n_layer)), label, variant="every layer"))
    return out


# --------------------------------------------------------------------------- llama.cpp


def llamacpp_figures(mm: MultimodalModel, built, prompts: Sequence[dict[str, Any]], progress: Progress,
                     name: str) -> tuple[list[Figure], dict[str, Any]]:
    """llama.cpp's mtmd soft tokens against the reference, one worker per kind (an abort on one does not lose the
    other).

    Gated on the mmproj with ``clip.use_gelu = true`` against the reference with llama.cpp's numerics emulated
    (:func:`harness.engines.llamacpp.numerics.llamacpp_mm_numerics`): ``reference~llamacpp.mm_vision_cosine`` /
    ``mm_audio_cosine`` (per item), ``mm_soft_token_max_abs`` (informational), ``mm_vision_runs`` /
    ``mm_audio_runs`` (an abort inside llama.cpp is a failing figure with its one line). Reported beside
    (informational): the mmproj as llama.cpp's converter writes it (no ``clip.use_gelu``: llama.cpp's vision MLP
    runs ``gelu_quick``) and the exact reference, with the first vision trace point that differs.

    Returns:
        ``(figures, info)``; info holds the per-point vision comparison.
    """
    out: list[Figure] = []
    info: dict[str, Any] = {}
    ref = ReferenceMM(mm)
    preps = [(p, prepared(mm, p)) for p in prompts]
    for kind in ("image", "audio"):
        entries = [(p["id"], i, it) for p, pr in preps for i, it in enumerate(pr.items) if it.kind == kind]
        if not entries:
            continue
        media = [(kind, processed_rgb(it.image, mm.vision[0].patch_size) if kind == "image" else it.samples)
                 for _, _, it in entries]
        variants = [("gelu", built.mmproj_gelu), ("converter", built.mmproj)] if kind == "image" else \
            [("gelu", built.mmproj)]
        runs = f"reference~llamacpp.mm_{'vision' if kind == 'image' else 'audio'}_runs"
        for variant, mmproj in variants:
            progress(f"[{name}] llama.cpp mtmd ({kind}, {variant} mmproj) on {len(entries)} items")
            try:
                res = mtmd_soft_tokens(built.gguf, mmproj, media, threads=None,
                                       image_min_tokens=1, image_max_tokens=4096)
            except Exception as e:  # an abort inside llama.cpp: that engine failing this case
                line = str(e).splitlines()[0] if str(e) else type(e).__name__
                out.append(fig(runs, 0.0, f"mtmd/{kind}", got=line, variant=f"{variant} mmproj",
                               **({} if variant == "gelu" else {"informational_reason": "the converter's mmproj"})))
                break
            out.append(fig(runs, 1.0, f"mtmd/{kind}", variant=f"{variant} mmproj",
                           **({} if variant == "gelu" else {"informational_reason": "the converter's mmproj"})))
            for (pid, i, it), got, trace in zip(entries, res["embeds"], res["traces"]):
                label = f"{pid}/{kind}{i}"
                gate = f"reference~llamacpp.mm_{'vision' if kind == 'image' else 'audio'}_cosine"
                emu_tr = TraceRecorder()
                exact = ref.soft_tokens(_one(it))[0]
                with llamacpp_mm_numerics():
                    emu = ref.soft_tokens(_one(it), trace=emu_tr)[0]
                if got.shape != exact.shape:
                    out.append(fig(gate, 0.0, label, got=f"llama.cpp gave {got.shape[0]} soft tokens, the reference "
                                   f"{exact.shape[0]}"))
                    continue
                extra = {} if variant == "gelu" else {
                    "informational_reason": "the mmproj as llama.cpp's converter writes it (no clip.use_gelu: the "
                                            "vision MLP runs gelu_quick, the model gelu_tanh)"}
                out.append(fig(gate, metrics.cosine(got, emu), label, variant=f"{variant} mmproj, numerics emulated",
                               **extra))
                out.append(fig("reference~llamacpp.mm_soft_token_max_abs", metrics.max_abs_err(got, emu), label,
                               variant=f"{variant} mmproj, numerics emulated",
                               **({} if variant == "gelu" else extra)))
                out.append(fig("reference~llamacpp.mm_soft_token_max_abs", metrics.max_abs_err(got, exact), label,
                               variant=f"{variant} mmproj, exact reference",
                               informational_reason="the exact reference, beside the emulated one"))
                if trace:  # llama.cpp's vision points against the emulated reference's: where a difference starts
                    rows = []
                    for (point, layer), a in emu_tr.points.items():
                        b = trace.get((point.split(".", 1)[1], layer))
                        if b is not None and b.size == a.size:
                            rows.append((point.split(".", 1)[1], layer, metrics.rel_l2(b.reshape(a.shape), a)))
                    first = next((f"{p_}@{layer}" for p_, layer, v in rows if v > 1e-4), None)
                    info.setdefault("llamacpp_vision_points", {})[f"{label} ({variant} mmproj)"] = {
                        "first_above_1e-4": first, "per_point": [list(r) for r in rows]}
    return out, info


def _one(item) -> MultimodalPrompt:
    """A prompt holding only ``item`` (for encoding one item alone)."""
    return MultimodalPrompt([0] * item.n_soft, np.ones(item.n_soft, dtype=np.int64), np.ones(item.n_soft, bool),
                            (item,))
