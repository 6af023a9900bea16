"""Checks of an MTP drafter's forward: the reference against transformers, the loaders, the fast twin.

Every comparison runs a draft round as speculative decoding does after a prefill: the target reads a prompt
(shorter and longer than the sliding window), picks its next token, and the drafter drafts ``N_DRAFT`` tokens
from it at that position. Figures (none gated here; :mod:`harness.parity.result` gates them):

* ``drafter.reference~transformers.runs``: transformers constructs and runs its ``Gemma4AssistantForCausalLM``
  (patched only where it cannot by itself: :mod:`harness.core.hf_assistant`; the row's ``construction`` says
  which); when it cannot, this row fails with the reason and the two figures below are not measured, while the
  other drafter figures still are;
* ``drafter.reference~transformers.max_abs``: the reference drafter against transformers'
  ``Gemma4AssistantForCausalLM`` (fp32) fed the same token, ``h_prev`` and store-layer K/V: max |Δ| over the
  logits and ``h_next`` of every step;
* ``drafter.store_kv.reference~transformers.max_abs``: the K/V transformers' target hands its drafter
  (``shared_kv_states``) against the K/V of the target layers the reference binds the drafter to, and its
  ``h_prev`` against the reference's ``result_norm``: the two agree on which layers a drafter reads;
* ``drafter.gguf_f32~safetensors.max_abs``: the ``gemma4-assistant`` GGUF against the HF folder (the full head
  on both sides: a GGUF has no centroid head, as in llama.cpp);
* ``drafter.reference~fast.max_abs``: the fast drafter over the fast target's cache against the reference
  drafter over the reference target's cache (the reference's draft tokens fed to both);
* with llama.cpp (:func:`llamacpp_drafter_checks`): ``drafter.llamacpp.runs``, ``drafter.reference~llamacpp.
  same_drafts`` and ``.max_abs`` (llama.cpp's ``gemma4-assistant`` drafter against the reference's GGUF drafter,
  with llama.cpp's fp16 GELU table emulated), and ``speculative.llamacpp.lossless`` (speculative greedy decoding
  inside llama.cpp against its own plain greedy decoding).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from gemma4_harness.fast.drafter import FastDrafter
from gemma4_harness.fast.model import FastModel, SeqStep
from gemma4_harness.reference import drafter as ref_drafter
from gemma4_harness.reference.drafter_weights import load_drafter
from gemma4_harness.reference.weights import load_model

from ...core.workers import EngineCrashed
from ...engines.assistant import FULL, SLIDING, HFAssistantOracle
from ...engines.llamacpp.drafter import llamacpp_drafts, llamacpp_speculative
from ...engines.llamacpp.numerics import llamacpp_numerics
from ..result import Figure, fig
from .oracle import oracle_rows, transformers_version

N_DRAFT = 4
"""Draft steps per compared round."""

NO_STORE_IN_HF = ("this transformers marks no 'store' layer in a target without KV-shared layers (5.23's "
                  "Gemma4TextConfig.kv_sharing_modes is all None when num_kv_shared_layers = 0; 5.24 marks the last "
                  "layer of each type 'store'), so its target returns no shared_kv_states and its own assisted "
                  "generation raises KeyError; the drafter itself is still compared on the reference's K/V")
"""Why the store-layer comparison cannot run against transformers for a target without KV sharing (26B-A4B- and
31B-like) where transformers hands a drafter no K/V: a limit of transformers 5.23, found here, lifted in 5.24."""


def store_kv(d: ref_drafter.DrafterConfig, cache, position: int,
             window: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The keys a drafter at ``position`` sees, by layer type: the bound store layers' K/V before ``position``,
    the last ``window - 1`` of them on sliding layers. ``{type: (K, V)}``, each ``[S, Hkv, D]``."""
    out = {}
    for L in d.text.layers:
        k, v = cache.k[L.kv_donor][:position], cache.v[L.kv_donor][:position]
        lo = max(0, position - window + 1) if L.is_sliding else 0
        out[SLIDING if L.is_sliding else FULL] = (k[lo:], v[lo:])
    return out


def _max_abs(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.max(np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64))))
               for x, y in zip(a, b))


def reference_vs_transformers(d, DW, tcfg, TW, oracle: HFAssistantOracle,
                              prompts: Sequence[dict[str, Any]]) -> list[Figure]:
    """Per prompt: the drafter alone (same inputs) and what transformers' target hands it (see module docstring)."""
    out = []
    for p in prompts:
        ids = p["prompt_ids"]
        cache, tok, h = ref_drafter.after_prefill(tcfg, TW, ids)
        toks, logits, hs = ref_drafter.draft(d, DW, tcfg, TW, cache, tok, h, N_DRAFT)
        htoks, hlogits, hhs = oracle.drafts(tok, h, len(ids), store_kv(d, cache, len(ids), tcfg.sliding_window),
                                            N_DRAFT)
        err = max(_max_abs(logits, hlogits), _max_abs(hs, hhs))
        out.append(fig("drafter.reference~transformers.max_abs", err, p["id"], tokens=len(ids),
                       same_drafts=toks == htoks, logits_max_abs=_max_abs(logits, hlogits),
                       h_next_max_abs=_max_abs(hs, hhs)))
        htok, hh, kv = oracle.after_prefill(ids)
        if not kv:  # once per case: the same for every prompt
            if not any(f.gate == "drafter.store_kv.reference~transformers.max_abs" for f in out):
                out.append(fig("drafter.store_kv.reference~transformers.max_abs", float("nan"), None,
                               got="not run: transformers hands no shared_kv_states",
                               informational_reason=NO_STORE_IN_HF))
            continue
        errs = [float(np.max(np.abs(hh - h)))]
        for L in d.text.layers:
            k, v = kv[SLIDING if L.is_sliding else FULL]
            errs += [float(np.max(np.abs(k - cache.k[L.kv_donor]))), float(np.max(np.abs(v - cache.v[L.kv_donor])))]
        out.append(fig("drafter.store_kv.reference~transformers.max_abs", max(errs), p["id"], same_token=htok == tok,
                       store_layers=sorted({L.kv_donor for L in d.text.layers})))
    return out


def gguf_vs_hf(d_hf, DW_hf, d_gguf, DW_gguf, tcfg, TW, prompts: Sequence[dict[str, Any]]) -> tuple[list[Figure], dict]:
    """The GGUF drafter against the HF drafter with the full head on both sides (bit-identical float32 weights).

    Returns the figures and, for a centroid-head drafter, how many draft tokens the full head changes (a
    llama.cpp-style drafter proposes other tokens than transformers' there; acceptance only).
    """
    plain = dataclasses.replace(d_hf, use_ordered_embeddings=False, num_centroids=0, centroid_top_k=0)
    out, changed, total = [], 0, 0
    for p in prompts:
        cache, tok, h = ref_drafter.after_prefill(tcfg, TW, p["prompt_ids"])
        a = ref_drafter.draft(plain, DW_hf, tcfg, TW, cache, tok, h, N_DRAFT)
        b = ref_drafter.draft(d_gguf, DW_gguf, tcfg, TW, cache, tok, h, N_DRAFT)
        out.append(fig("drafter.gguf_f32~safetensors.max_abs", max(_max_abs(a[1], b[1]), _max_abs(a[2], b[2])),
                       p["id"]))
        if d_hf.use_ordered_embeddings:
            c = ref_drafter.draft(d_hf, DW_hf, tcfg, TW, cache, tok, h, N_DRAFT)
            changed += sum(x != y for x, y in zip(a[0], c[0]))
            total += N_DRAFT
    return out, {"centroid_vs_full_head_drafts_changed": f"{changed} of {total}"} if total else {}


def fast_state(fm: FastModel, ids: Sequence[int], extra: int) -> tuple[Any, int, int, torch.Tensor]:
    """The fast target after reading ``ids``: ``(cache, slot, greedy next token, result_norm [1, H_t])``."""
    cache = fm.new_cache(1, len(ids) + extra + 1, ring_extra=extra)
    slot = cache.alloc()
    with torch.inference_mode():
        logits, h = fm.step(cache, [SeqStep(slot, torch.tensor(list(ids)), 0)], return_hidden=True)
    return cache, slot, int(torch.argmax(logits[-1])), h[-1:]


def reference_vs_fast(d, DW, tcfg, TW, fm: FastModel, prompts: Sequence[dict[str, Any]]) -> list[Figure]:
    """The fast drafter against the reference drafter, per prompt (module docstring)."""
    fd = FastDrafter(d, DW, fm)
    out = []
    for p in prompts:
        ids = p["prompt_ids"]
        cache, tok, h = ref_drafter.after_prefill(tcfg, TW, ids)
        toks, logits, hs = ref_drafter.draft(d, DW, tcfg, TW, cache, tok, h, N_DRAFT)
        fcache, slot, ftok, fh = fast_state(fm, ids, N_DRAFT)
        flog, fhs = [], []
        inputs = [tok] + toks[:-1]
        with torch.inference_mode():
            views = fd.views(fcache, [slot], [len(ids)])
            for t in inputs:
                lg, fh = fd.drafter_forward(fcache, [slot], torch.tensor([t]), fh, [len(ids)], views)
                flog.append(lg[0].double().cpu().numpy())
                fhs.append(fh[0].double().cpu().numpy())
        err = max(_max_abs(logits, flog), _max_abs(hs, fhs))
        out.append(fig("drafter.reference~fast.max_abs", err, p["id"], same_first_token=ftok == tok,
                       same_drafts=[int(np.argmax(x)) for x in flog] == toks))
    return out


def oracle_checks(built, d, DW, tcfg, TW, prompts: Sequence[dict[str, Any]]) -> list[Figure]:
    """``drafter.reference~transformers.runs`` and, when transformers can run the assistant, the figures of
    :func:`reference_vs_transformers`. A problem of the oracle (it cannot construct the assistant, or fails on
    the way) is that row's failure with its one line: it never stops the other drafter checks."""
    built_oracle: list[HFAssistantOracle] = []

    def measure() -> list[Figure]:
        built_oracle.append(HFAssistantOracle(built.target.hf_dir, built.hf_dir))
        return reference_vs_transformers(d, DW, tcfg, TW, built_oracle[0], prompts)

    out = oracle_rows("drafter.reference~transformers.runs", measure)
    if built_oracle:
        out[0].detail["construction"] = built_oracle[0].construction
    return out


def drafter_not_built(dspec_name: str, error: Exception) -> list[Figure]:
    """The row of a drafter that could not be written because transformers cannot construct the assistant
    (:class:`harness.core.hf_assistant.AssistantUnavailable`): the drafter checks do not run, and say why."""
    return [fig("drafter.reference~transformers.runs", 0.0, None, transformers=transformers_version(),
                got=f"not run: the drafter {dspec_name} could not be written: {error}")]


def drafter_checks(built, prompts: Sequence[dict[str, Any]], info: dict[str, Any], progress, name: str) -> list[Figure]:
    """Every drafter-forward figure of one built drafter (:class:`harness.synth.drafter.BuiltDrafter`)."""
    tcfg, TW = load_model(built.target.gguf["F32"])
    d_hf, DW_hf = load_drafter(built.hf_dir)
    d_gguf, DW_gguf = load_drafter(built.gguf["F32"])
    d_hf, d_gguf = ref_drafter.bind(d_hf, tcfg), ref_drafter.bind(d_gguf, tcfg)
    info["drafter"] = d_hf.summary()
    progress(f"[{name}] drafter: reference vs transformers, GGUF vs safetensors, fast vs reference")
    out = oracle_checks(built, d_hf, DW_hf, tcfg, TW, prompts)
    figs, facts = gguf_vs_hf(d_hf, DW_hf, d_gguf, DW_gguf, tcfg, TW, prompts)
    info["drafter"].update(facts)
    out += figs
    out += reference_vs_fast(d_hf, DW_hf, tcfg, TW, FastModel(tcfg, TW, "cpu", "float32"), prompts)
    return out


def llamacpp_drafter_checks(built, prompts: Sequence[dict[str, Any]], progress, name: str) -> list[Figure]:
    """llama.cpp's drafter against the reference, and llama.cpp's own speculative decoding (module docstring).

    A worker that dies (llama.cpp aborts on some layouts) gives ``drafter.llamacpp.runs`` = 0 with its line.
    """
    tcfg, TW = load_model(built.target.gguf["F32"])
    d, DW = load_drafter(built.gguf["F32"])
    d = ref_drafter.bind(d, tcfg)
    ids = [p["prompt_ids"] for p in prompts]
    progress(f"[{name}] llama.cpp drafter (gemma4-assistant GGUF, ctx_other) vs reference; speculative in llama.cpp")
    try:
        rounds = llamacpp_drafts(built.target.gguf["F32"], built.gguf["F32"], ids, N_DRAFT)
        spec = llamacpp_speculative(built.target.gguf["F32"], built.gguf["F32"], ids, 12, N_DRAFT)
    except EngineCrashed as e:
        return [fig("drafter.llamacpp.runs", 0.0, None, got=str(e))]
    out = [fig("drafter.llamacpp.runs", 1.0)]
    for p, r in zip(prompts, rounds):
        with llamacpp_numerics():
            cache, tok, h = ref_drafter.after_prefill(tcfg, TW, p["prompt_ids"])
            toks, logits, hs = ref_drafter.draft(d, DW, tcfg, TW, cache, tok, h, N_DRAFT)
        same = [a == b for a, b in zip(toks, r["drafts"])]
        out.append(fig("drafter.reference~llamacpp.same_drafts", float(np.mean(same)) if r["token"] == tok else 0.0,
                       p["id"], drafts=r["drafts"], reference=toks, same_first_token=r["token"] == tok))
        out.append(fig("drafter.reference~llamacpp.max_abs", max(_max_abs(r["logits"], logits),
                                                                 _max_abs(r["h_next"], hs)), p["id"],
                       h_prev_max_abs=float(np.max(np.abs(r["h"] - h)))))
    bad = [p["id"] for p, s in zip(prompts, spec) if s["tokens"] != s["plain"]]
    out.append(fig("speculative.llamacpp.lossless", 0.0 if bad else 1.0, None, streams=len(spec), mismatched=bad,
                   drafted=sum(s["drafted"] for s in spec), accepted=sum(s["accepted"] for s in spec)))
    return out
