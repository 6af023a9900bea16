"""Checks of the float64 reference: against the oracle, against itself, and of the loaders."""

from __future__ import annotations

from typing import Any, Sequence

import gguf
import numpy as np

from ...engines.reference import ReferenceEngine
from ...traces import TraceRecorder, layer_errors
from ..result import Figure, fig
from .oracle_pass import cached_prefill


def _first_divergence(rows: list[dict[str, Any]], limit: float) -> dict[str, Any] | None:
    for r in rows:
        if not r["rel_l2"] <= limit:
            return r
    return None


def compare_pair(ours, oracle, prompts: Sequence[dict[str, Any]], pair: str, layer_limit: float | None) -> list[Figure]:
    """Logits and per-layer traces of ``ours`` vs ``oracle`` on every prompt.

    Figures: ``<pair>.max_abs_logit`` per prompt (with same-top-1 and the oracle's largest logit), and,
    where both engines trace, ``<pair>.layer_rel_l2`` (the worst trace point, the first above
    ``layer_limit``, and every point's relative L2 for the report's plot).
    """
    out = []
    for p in prompts:
        tr_a, tr_b = TraceRecorder(), TraceRecorder()
        a = ours.logits(p["prompt_ids"], trace=tr_a)
        b = oracle.logits(p["prompt_ids"], trace=tr_b)
        diff = float(np.max(np.abs(a - b)))
        at = np.unravel_index(int(np.argmax(np.abs(a - b))), a.shape)
        top1 = float(np.mean(np.argmax(a, -1) == np.argmax(b, -1)))
        out.append(fig(f"{pair}.max_abs_logit", diff, p["id"], tokens=len(p["prompt_ids"]), same_top1=top1,
                       max_abs_logit_oracle=float(np.max(np.abs(b))), max_abs_logit_at=[int(at[0]), int(at[1])]))
        rows = layer_errors(tr_a, tr_b)
        if rows and layer_limit is not None:
            worst = max(rows, key=lambda r: r["rel_l2"])
            first = _first_divergence(rows, layer_limit)
            out.append(fig(f"{pair}.layer_rel_l2", worst["rel_l2"], p["id"],
                           worst_point=f"{worst['point']}@{worst['layer']}",
                           first_divergence=None if first is None else f"{first['point']}@{first['layer']}",
                           per_point=[[r["point"], r["layer"], r["rel_l2"]] for r in rows]))
    return out


def cached_vs_uncached(ref: ReferenceEngine, prompt: dict[str, Any], full: np.ndarray | None = None,
                       cached: tuple[int, np.ndarray] | None = None) -> list[Figure]:
    """``reference.cached~uncached.max_abs_logit``: a prefill of half the prompt then one-token decode steps,
    against one forward (``full``, computed when not given; ``cached``: ``(prefill, logits)`` of the steps computed
    already, :meth:`harness.parity.checks.reference_runs.ReferenceRuns.cached_logits`). Nothing for a one-token
    prompt."""
    ids = prompt["prompt_ids"]
    if len(ids) < 2:
        return []
    full = ref.logits(ids) if full is None else full
    prefill, cached = cached or (cached_prefill(len(ids)), None)
    cached = ref.logits_cached(ids, prefill=prefill) if cached is None else cached
    return [fig("reference.cached~uncached.max_abs_logit", float(np.max(np.abs(cached - full))), prompt["id"],
                prefill=prefill)]


def self_consistency(ref_gguf: ReferenceEngine, ref_hf: ReferenceEngine,
                     prompts: Sequence[dict[str, Any]]) -> list[Figure]:
    """The reference against itself, per prompt: ``reference.gguf_f32~safetensors.max_abs_logit`` (the same
    float32 weights through the GGUF and the safetensors loader; must be 0), then
    :func:`cached_vs_uncached`."""
    out = []
    for p in prompts:
        full = ref_hf.logits(p["prompt_ids"])
        out.append(fig("reference.gguf_f32~safetensors.max_abs_logit",
                       float(np.max(np.abs(ref_gguf.logits(p["prompt_ids"]) - full))), p["id"]))
        out += cached_vs_uncached(ref_hf, p, full)
    return out


def quantized_loaders(f32: ReferenceEngine, quantized: dict[str, str], long_prompt: Sequence[int],
                      info: dict[str, Any], logits_out: dict[str, np.ndarray] | None = None) -> list[Figure]:
    """Every quantized GGUF loads each tensor exactly as ``gguf.quants.dequantize(quantize(w))`` of the F32 one.

    Figures: ``reference.gguf_quant~gguf_quants.max_abs_weight`` per file type (must be 0). The logit
    drift of each file type on ``long_prompt`` goes to ``info["quant_logit_drift"]`` (a fact, not gated); the
    reference's logits of each file type on it to ``logits_out[qtype]`` when given (float64 ``[T, V]``).
    """
    out = []
    base_logits = f32.logits(long_prompt)
    for qname, qpath in sorted(quantized.items()):
        q = ReferenceEngine(qpath)
        worst = 0.0
        for name in q.weights:
            stored = q.weights.raw_dtype(name)  # rows that do not fill a block fall back to another type
            w32 = np.asarray(f32.weights.raw(name), dtype=np.float32)
            qtype = gguf.GGMLQuantizationType[stored]
            want = w32 if stored == "F32" else gguf.quants.dequantize(gguf.quants.quantize(w32, qtype), qtype)
            worst = max(worst, float(np.max(np.abs(q.weights[name] - np.asarray(want, dtype=np.float64)))))
        out.append(fig("reference.gguf_quant~gguf_quants.max_abs_weight", worst, None, qtype=qname))
        q_logits = q.logits(long_prompt)
        if logits_out is not None:
            logits_out[qname] = q_logits
        info.setdefault("quant_logit_drift", {})[qname] = float(np.max(np.abs(q_logits - base_logits)))
    return out
