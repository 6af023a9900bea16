"""Checks of the fast path that only a built-in case makes, shared by ``g4h parity`` and the tests (fast in fp32
and bf16 against the reference is the pair pipeline of ``--model``: ``reference~fast``, ``reference~fast_bf16``,
:mod:`.pair`, run by :func:`harness.parity.cases.synthetic_case`).

* :func:`batched_vs_solo`: 8 requests of mixed lengths (some longer than three
  windows), staggered arrivals, one retiring mid-batch, served by one continuous
  batch and one at a time; plus neighbour isolation (same shapes, other
  neighbours' contents -> a request's logits bit-identical).
* :func:`chunked_vs_oneshot`: prefill in chunks smaller than, equal to and larger
  than the window, and token-by-token decode, against one forward.
* :func:`static_vs_paged`: the static-shape decoder (:mod:`fast.static_decode`, the CUDA-graph path)
  against the paged engine, all requests of :func:`batch_scenario` decoding together.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from gemma4_harness.fast.engine import Engine, Request
from gemma4_harness.fast.model import FastModel, SeqStep
from gemma4_harness.fast.quants import QuantizedTensor
from gemma4_harness.fast.static_decode import StaticDecoder
from gemma4_harness.reference.weights import load_model

from ...core import metrics
from ...traces import ConcatRecorder, TraceRecorder, layer_errors
from ..result import Figure, fig


def batch_scenario(window: int, vocab: int, seed: int = 0) -> list[Request]:
    """8 requests: lengths around and beyond the window (> 3 windows for two), arrivals at steps
    0..9, one with 3 new tokens that retires while others still run."""
    rng = np.random.default_rng(seed)
    lengths = [5, window + 1, 3 * window + 12, window, 3, 4 * window + 6, 2 * window + 1, 1]
    arrivals = [0, 0, 1, 2, 2, 5, 6, 9]
    new = [12, 12, 12, 3, 12, 12, 12, 12]
    hi = min(vocab, 256)
    return [Request(str(i), [2] + rng.integers(4, hi, n - 1).tolist(), new[i], arrival=arrivals[i])
            for i, n in enumerate(lengths)]


def batched_vs_solo(fm: FastModel, prefill_chunk: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Serve :func:`batch_scenario` batched (8 slots) and solo; compare. Returns a JSON-able dict."""
    cfg = fm.cfg
    window = cfg.sliding_window or 16
    reqs = batch_scenario(window, cfg.vocab_size, seed)
    chunk = prefill_chunk or (window + 8)
    bat_eng = Engine(fm, max_batch=8, prefill_chunk=chunk, keep_logits=True)
    bat = bat_eng.run(reqs)
    solo = Engine(fm, max_batch=1, prefill_chunk=10**6, keep_logits=True).run(reqs)
    same = all(bat[r.id].tokens == solo[r.id].tokens for r in reqs)
    diff = max(float(np.max(np.abs(np.array(bat[r.id].logits) - np.array(solo[r.id].logits)))) for r in reqs)
    # neighbour isolation: request 2 keeps its prompt; every other prompt changes, shapes and arrivals stay
    rng = np.random.default_rng(seed + 1)
    target = "2"
    reqs2 = [r if r.id == target else Request(r.id, [2] + rng.integers(4, min(cfg.vocab_size, 256),
                                                                       len(r.prompt) - 1).tolist(),
                                              r.max_new_tokens, r.arrival) for r in reqs]
    bat2 = Engine(fm, max_batch=8, prefill_chunk=chunk, keep_logits=True).run(reqs2)
    a, b = np.array(bat[target].logits), np.array(bat2[target].logits)
    iso = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
    retired_mid = [r.id for r in reqs if max(bat[r.id].steps) < max(max(x.steps) for x in bat.values())]
    return {"same_tokens": 1.0 if same else 0.0, "max_abs_logit": diff, "isolation_max_abs": iso,
            "max_batch_seen": max(bat_eng.batch_sizes), "retired_mid_batch": retired_mid,
            "requests": [{"id": r.id, "prompt_len": len(r.prompt), "arrival": r.arrival,
                          "new": r.max_new_tokens} for r in reqs],
            "_solo": solo}  # the solo results, for static_vs_paged (not a figure)


def static_vs_paged(fm: FastModel, seed: int = 0, solo: dict | None = None) -> dict[str, Any]:
    """The requests of :func:`batch_scenario` (arrivals ignored) decoded together by
    :class:`fast.static_decode.StaticDecoder` (one row each; CUDA graphs when ``fm`` is on CUDA) against the
    paged engine serving them one at a time: same greedy tokens, max |Δlogit| over every step of every request.

    ``solo``: the paged engine's results for the same ``seed`` when already at hand (:func:`batched_vs_solo`'s
    ``_solo``), else computed here.

    Returns: ``{"same_tokens": 1.0 | 0.0, "max_abs_logit": float, "rows": int, "steps": int, "graphs": bool}``.
    """
    cfg = fm.cfg
    reqs = batch_scenario(cfg.sliding_window or 16, cfg.vocab_size, seed)
    if solo is None:
        solo = Engine(fm, max_batch=1, prefill_chunk=10**6, keep_logits=True).run(reqs)
    steps = max(r.max_new_tokens for r in reqs)
    dec = StaticDecoder(fm, len(reqs), max(len(r.prompt) for r in reqs) + steps)
    logits = dec.prefill([r.prompt for r in reqs])
    toks, rows = [], []
    for i in range(steps):
        rows.append(logits.float().cpu().numpy().copy())
        toks.append(logits.argmax(-1))
        if i + 1 < steps:
            logits = dec.decode(toks[-1])
    got = torch.stack(toks, 1).cpu().tolist()
    same = all(got[i][:r.max_new_tokens] == solo[r.id].tokens for i, r in enumerate(reqs))
    diff = max(float(np.max(np.abs(rows[k][i] - solo[r.id].logits[k])))
               for i, r in enumerate(reqs) for k in range(r.max_new_tokens))
    return {"same_tokens": 1.0 if same else 0.0, "max_abs_logit": diff, "rows": len(reqs), "steps": steps,
            "graphs": dec.graphs}


def _chunked_traced(fm: FastModel, ids: Sequence[int], chunk: int) -> tuple[np.ndarray, TraceRecorder]:
    """Logits of a prefill in chunks of ``chunk`` and its trace (every chunk's step traced, joined)."""
    cache = fm.new_cache(1, len(ids))
    slot = cache.alloc()
    rec = ConcatRecorder()
    parts = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            part = torch.tensor(list(ids[start:start + chunk]))
            parts.append(fm.step(cache, [SeqStep(slot, part, start)], all_logits=True, trace=rec))
    return torch.cat(parts).cpu().numpy(), rec.recorder()


def chunked_vs_oneshot(fm: FastModel, ids: Sequence[int],
                       per_point: dict[str, list[list[Any]]] | None = None) -> dict[str, float]:
    """Max |Δlogit| of chunked prefills (window-5, window, window+3) and of a half prefill followed by
    token-by-token decode, against the one-shot forward.

    Args:
        fm: the fast model.
        ids: the prompt.
        per_point: when given, filled with ``variant -> [[point, layer, rel_l2], ...]`` for the chunked
            prefills: each trace point of the chunked run (chunks joined) against the one-shot run's.
    """
    cfg = fm.cfg
    w = cfg.sliding_window or 16
    full = fm.logits(ids).cpu().numpy()
    one_trace = None
    if per_point is not None:
        one_trace = TraceRecorder()
        fm.logits(ids, trace=one_trace)
    out = {}
    for name, c in (("chunk<window", max(1, w - 5)), ("chunk=window", w), ("chunk>window", w + 3)):
        if one_trace is None:
            chunked = fm.logits(ids, chunk=c).cpu().numpy()
        else:
            chunked, rec = _chunked_traced(fm, ids, c)
            per_point[name] = [[r["point"], r["layer"], r["rel_l2"]] for r in layer_errors(rec, one_trace)]
        out[name] = float(np.max(np.abs(chunked - full)))
    cache = fm.new_cache(1, len(ids))
    slot = cache.alloc()
    half = max(1, len(ids) // 2)
    with torch.inference_mode():
        parts = [fm.step(cache, [SeqStep(slot, torch.tensor(ids[:half]), 0)], all_logits=True)]
        for i in range(half, len(ids)):
            parts.append(fm.step(cache, [SeqStep(slot, torch.tensor([ids[i]]), i)], all_logits=True))
    out["prefix+decode"] = float(np.max(np.abs(torch.cat(parts).cpu().numpy() - full)))
    return out


def fast_checks(cfg, W, prompts: Sequence[dict[str, Any]], progress, name: str) -> list[Figure]:
    """fast fp32 batched vs solo, static vs paged, chunked vs one-shot (CPU).

    Figures: ``fast.batched~solo.*`` and ``fast.neighbour_isolation.max_abs_logit``; ``fast.static~paged.*``;
    ``fast.chunked~oneshot.max_abs_logit`` per variant on the longest prompt.
    """
    out = []
    fm32 = FastModel(cfg, W, "cpu", "float32")
    progress(f"[{name}] fast batched vs solo, chunked vs one-shot")
    bs = batched_vs_solo(fm32)
    out.append(fig("fast.batched~solo.same_tokens", bs["same_tokens"]))
    out.append(fig("fast.batched~solo.max_abs_logit", bs["max_abs_logit"], None,
                   retired_mid_batch=bs["retired_mid_batch"], max_batch=bs["max_batch_seen"]))
    out.append(fig("fast.neighbour_isolation.max_abs_logit", bs["isolation_max_abs"]))
    sp = static_vs_paged(fm32, solo=bs["_solo"])
    out.append(fig("fast.static~paged.same_tokens", sp["same_tokens"], None, rows=sp["rows"], steps=sp["steps"]))
    out.append(fig("fast.static~paged.max_abs_logit", sp["max_abs_logit"], None, rows=sp["rows"], steps=sp["steps"]))
    longest = max(prompts, key=lambda p: len(p["prompt_ids"]))
    chunk_points: dict[str, list[list[Any]]] = {}
    for variant, v in chunked_vs_oneshot(fm32, longest["prompt_ids"], per_point=chunk_points).items():
        out.append(fig("fast.chunked~oneshot.max_abs_logit", v, longest["id"], variant=variant,
                       **({"per_point": chunk_points[variant]} if variant in chunk_points else {})))
    return out


def fast_packed_checks(quantized: dict[str, str], prompt: dict[str, Any],
                       ref_logits: dict[str, np.ndarray]) -> list[Figure]:
    """fast fp32 on the CPU with its weights packed (views of each quantized GGUF, read by the packed kernels of
    :mod:`fast.quant_kernels`) against the reference on the same file, on ``prompt``.

    Args:
        quantized: file type -> GGUF path (the case's quantized files).
        prompt: one prompt record (the case's longest).
        ref_logits: file type -> the reference's float64 logits ``[T, V]`` of ``prompt`` on that file
            (from :func:`harness.parity.checks.reference.quantized_loaders`).

    Figures: ``reference~fast.max_abs_logit`` per file type that has packed matrices (F16/BF16 files have
    none: their matrices are dequantized at load), item ``<prompt>@<type>-packed``, gated by the same
    reference~fast gate as the F32 file's pair (the weights are the same exact values on both sides).
    """
    out = []
    for qname, path in sorted(quantized.items()):
        if qname not in ref_logits:
            continue
        cfg, W = load_model(path)
        fm = FastModel(cfg, W, "cpu", "float32", keep_quantized=True)
        packed = sorted({t.qtype.name for t in fm.w.t.values() if isinstance(t, QuantizedTensor)})
        if not packed:
            continue
        got = fm.logits(prompt["prompt_ids"]).double().numpy()
        ref = ref_logits[qname]
        out.append(fig("reference~fast.max_abs_logit", metrics.max_abs_err(got, ref), f"{prompt['id']}@{qname}-packed",
                       tokens=len(prompt["prompt_ids"]), weights="packed", qtype=qname, packed_types=packed,
                       same_top1=metrics.top1_agreement(got, ref)))
    return out
