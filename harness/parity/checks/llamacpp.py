"""llama.cpp against the float64 reference: on every built synthetic case, and on the real Gemma 3 270M GGUF.

The gated figures compare with the reference under :func:`harness.engines.llamacpp.numerics.llamacpp_numerics`
(its GELUs through llama.cpp's fp16 table); the same figures against the exact reference are kept
beside them (``vs_exact_gelu``), so that known approximation neither masks nor mimics a real fault.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from gemma4_harness.reference.tokenizer import tokenizer_from_gguf

from ...core.gates import NEAR_TIE_MARGIN
from ...core.kld import kld_stats
from ...core.metrics import kld_histogram, kld_per_position, rel_l2, top1_margin
from ...core.realdata import gemma3_270m_gguf
from ...core.workers import EngineCrashed
from ...engines.llamacpp import LlamaCppEngine
from ...engines.llamacpp.numerics import llamacpp_numerics
from ...engines.reference import ReferenceEngine
from ..result import Figure, fig
from .gemma3_real import PROMPTS

GATE_PAIR = "llamacpp~reference"


def _prompt_ids(prompts: Iterable[Any]) -> list[tuple[str, list[int]]]:
    out = []
    for k, p in enumerate(prompts):
        if isinstance(p, dict):
            out.append((str(p.get("id", k)), [int(t) for t in p["prompt_ids"]]))
        else:
            out.append((f"p{k}", [int(t) for t in p]))
    return out


def compare_traces(ours: list[tuple[str, int, np.ndarray]], ref: dict[tuple[str, int], np.ndarray],
                   limit: float = 1e-2) -> dict[str, Any]:
    """Relative L2 of each llama.cpp trace point against the reference's; the first point above ``limit``.

    Returns:
        ``{"per_point": [[point, layer, rel_l2], ...], "first_divergence": {point, layer, rel_l2} | None,
        "missing": [...points the reference has and llama.cpp did not report...]}``.
    """
    rows, first = [], None
    seen = set()
    for p, layer, arr in ours:
        if (p, layer) not in ref:
            continue
        seen.add((p, layer))
        e = rel_l2(arr, ref[(p, layer)]) if np.shape(arr) == np.shape(ref[(p, layer)]) else float("nan")
        rows.append([p, layer, e])
        if first is None and not e <= limit:
            first = {"point": p, "layer": layer, "rel_l2": e}
    missing = [f"{p}@{layer}" for (p, layer) in ref if (p, layer) not in seen]
    return {"per_point": rows, "first_divergence": first, "missing": missing}


def check_synthetic(built_case, prompts: Iterable[Any], *, threads: int | None = None,
                    n_ubatch: int | None = None, trace: bool = True) -> list[dict[str, Any]]:
    """llama.cpp on a built case's F32 GGUF vs the float64 reference, over every prompt position.

    The gated figures compare with the reference under :func:`llamacpp_numerics` (its GELUs through
    llama.cpp's fp16 table); the same figures against the exact reference are kept as
    ``exact_reference`` in the summary row and reported beside them.

    Args:
        built_case: a :class:`harness.synth.BuiltCase` (``ensure_built``).
        prompts: prompt records (``{"id", "prompt_ids"}``, e.g. :func:`harness.core.prompts.load_prompts`) or id lists.
        threads: llama.cpp CPU threads.
        n_ubatch: llama.cpp physical batch (default: the whole prompt in one ubatch).
        trace: also compare the trace points on the longest prompt and name the first that diverges.

    Returns:
        One row per prompt: ``case``, ``prompt``, ``n_tokens``, ``max_abs_logit``, ``mean_kld``,
        ``same_top1`` (fraction), ``max_abs_logit_at`` ([position, token id]), ``max_abs_ref_logit``;
        then a summary row with ``prompt`` = ``"all"`` holding the same figures over all positions
        pooled, ``kld_per_position`` (one float per position, for the report's histogram),
        ``exact_reference`` (max_abs_logit, mean_kld, same_top1, same_top1_decisive, top1_flips against
        the exact reference), ``trace`` (see :func:`compare_traces`) and ``seconds``. No gate is applied
        here (:func:`llamacpp_checks` turns the summary into figures).
        When llama.cpp crashes the list is one row: ``case``, ``prompt`` = ``"all"``, ``error``
        (``engine crashed: ...``), ``error_kind`` = ``"engine"``.

    Raises:
        EngineUnavailable: llama-cpp-python is not installed.
    """
    case = built_case.spec.name
    gguf_path = built_case.gguf["F32"]
    items = _prompt_ids(prompts)
    t0 = time.perf_counter()
    eng = LlamaCppEngine(gguf_path, n_ctx=max(len(ids) for _, ids in items) + 16, threads=threads,
                         n_ubatch=n_ubatch)
    ref = ReferenceEngine(gguf_path)
    longest = max(range(len(items)), key=lambda k: len(items[k][1]))
    try:
        runs = eng.logits_many([ids for _, ids in items])
        traced = eng.logits_many([items[longest][1]], trace=True)[0][1] if trace else None
    except EngineCrashed as e:
        return [{"case": case, "prompt": "all", "error": str(e), "error_kind": "engine",
                 "seconds": round(time.perf_counter() - t0, 3)}]
    rows: list[dict[str, Any]] = []
    all_ours, all_ref, all_exact = [], [], []
    for (pid, ids), (ours, _) in zip(items, runs):
        exact = ref.logits(ids)
        with llamacpp_numerics():
            base = ref.logits(ids)
        rows.append(_compare_row(case, pid, ours, base, kld_stats))
        all_ours.append(ours)
        all_ref.append(base)
        all_exact.append(exact)
    ours_all, ref_all = np.concatenate(all_ours), np.concatenate(all_ref)
    summary = _compare_row(case, "all", ours_all, ref_all, kld_stats)
    summary["kld_per_position"] = [float(v) for v in kld_per_position(ours_all, ref_all)]
    vs_exact = _compare_row(case, "all", ours_all, np.concatenate(all_exact), kld_stats)
    summary["exact_reference"] = {k: vs_exact[k] for k in ("max_abs_logit", "mean_kld", "same_top1",
                                                          "same_top1_decisive", "top1_flips")}
    if traced is not None:
        ref_trace: dict[tuple[str, int], np.ndarray] = {}
        with llamacpp_numerics():
            ref.logits(items[longest][1], trace=lambda p, layer, a: ref_trace.__setitem__((p, layer), np.array(a)))
        summary["trace"] = {"prompt": items[longest][0], **compare_traces(traced, ref_trace)}
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    rows.append(summary)
    return rows


def _compare_row(case: str, pid: str, ours: np.ndarray, base: np.ndarray, kld_stats) -> dict[str, Any]:
    """Figures of one comparison. ``near_ties``: positions whose reference top-1 margin is below
    :data:`NEAR_TIE_MARGIN`; ``top1_flips``: positions whose argmax differs, each as
    ``[position, ref_top1, ours_top1, ref_margin]``; ``same_top1_decisive``: same-top-1 over the
    positions that are not near-ties (informational; the gate uses ``same_top1``)."""
    d = np.abs(ours - base)
    at = np.unravel_index(int(np.argmax(d)), d.shape)
    st = kld_stats(ours, base)
    margin = top1_margin(base)
    a_ours, a_ref = np.argmax(ours, axis=1), np.argmax(base, axis=1)
    flips = np.nonzero(a_ours != a_ref)[0]
    decisive = margin >= NEAR_TIE_MARGIN
    return {"case": case, "prompt": pid, "n_tokens": int(ours.shape[0]), "max_abs_logit": float(d.max()),
            "max_abs_logit_at": [int(at[0]), int(at[1])], "mean_kld": float(st.mean_kld),
            "maximum_kld": float(st.maximum_kld), "same_top1": float(st.same_top_p_pct) / 100.0,
            "max_abs_ref_logit": float(np.abs(base).max()),
            "near_ties": int((~decisive).sum()),
            "top1_flips": [[int(i), int(a_ref[i]), int(a_ours[i]), float(margin[i])] for i in flips],
            "same_top1_decisive": float(np.mean(a_ours[decisive] == a_ref[decisive])) if decisive.any() else 1.0}


def check_gemma3_real(path: str | os.PathLike | None = None, *, threads: int | None = None,
                      texts: Sequence[str] | None = None, f32_control: bool = False) -> dict[str, Any]:
    """llama.cpp vs the float64 reference on the real Gemma 3 270M GGUF (Q8_0/Q5_0/Q4_K/Q6_K tensors).

    Tokenizes each text with :func:`reference.tokenizer.tokenizer_from_gguf` (and, as a side check,
    with llama.cpp's own tokenizer), runs both engines over every position, and pools all
    positions into one ``llama-perplexity --kl-divergence`` statistic set (next-token ids given,
    so PPL and Δp figures are filled). Also greedy-generates each :data:`harness.parity.checks.gemma3_real.PROMPTS`
    prompt with llama.cpp and checks the expected continuation.

    On a quantized file llama.cpp's CPU matmuls quantize the *activations* too (to Q8_K / Q8_0 for the
    integer dot products), which the reference (exactly dequantized weights, float64 activations) does
    not; that, not a formula fault, is most of the difference. ``f32_control=True`` separates the two:
    it writes an F32 copy of the file (every tensor dequantized with ``gguf.quants``, the same values the
    reference uses; ~1.1 GB, cached beside the original) and repeats the comparison on it as
    ``f32_control``, where only fp32 rounding and the fp16 GELU table remain.

    Returns:
        ``model``, ``n_positions``, ``kld`` (:class:`harness.core.kld.KLDStats` as a dict), ``max_abs_logit``,
        ``per_text`` (n_tokens, max_abs_logit, mean_kld, same_top1, tokenizer_match), ``continuations``
        (per prompt: expected, llama.cpp text, pass), ``seconds``; or ``error`` when llama.cpp crashes;
        with ``f32_control``, also ``f32_control`` (the same keys, on the F32 copy).

    Raises:
        EngineUnavailable: llama-cpp-python is not installed.
        InputError: the GGUF package is missing or the file is bad.
    """
    t0 = time.perf_counter()
    gguf_path = Path(path) if path is not None else gemma3_270m_gguf()
    tok = tokenizer_from_gguf(gguf_path)
    if texts is None:
        texts = [text + expected for _, text, expected in PROMPTS] + list(GEMMA3_EXTRA_TEXTS)
    seqs = [tok.encode(t) for t in texts]
    eng = LlamaCppEngine(gguf_path, n_ctx=max(len(s) for s in seqs) + 32, threads=threads)
    res: dict[str, Any] = {"model": str(gguf_path), "texts": list(texts)}
    try:
        runs = eng.logits_many(seqs)
        prompt_ids = [tok.encode(text) for _, text, _ in PROMPTS]
        n_new = [len(tok.encode(exp, add_bos=False)) + 2 for _, _, exp in PROMPTS]
        gens = eng.generate_full(prompt_ids, max(n_new))
        llama_tok = eng.tokenize_many(texts)
    except EngineCrashed as e:
        res.update(error=str(e), error_kind="engine", seconds=round(time.perf_counter() - t0, 3))
        return res
    t_ref = time.perf_counter()
    ref = ReferenceEngine(gguf_path)
    per_text, ours_all, ref_all, next_all = [], [], [], []
    for text, ids, (ours, _), lt in zip(texts, seqs, runs, llama_tok):
        base = ref.logits(ids)
        st = kld_stats(ours, base)
        per_text.append({"text": text, "n_tokens": len(ids), "max_abs_logit": float(np.max(np.abs(ours - base))),
                         "mean_kld": float(st.mean_kld), "same_top1": float(st.same_top_p_pct) / 100.0,
                         "tokenizer_match": lt == list(ids)})
        # Rows 0..T-2 are scored against the next token (llama-perplexity's convention).
        ours_all.append(ours[:-1])
        ref_all.append(base[:-1])
        next_all.append(np.asarray(ids[1:], dtype=np.int64))
    ref_s = time.perf_counter() - t_ref
    ours_cat, ref_cat = np.concatenate(ours_all), np.concatenate(ref_all)
    stats = kld_stats(ours_cat, ref_cat, tokens=np.concatenate(next_all))
    conts = []
    for (name, text, expected), g in zip(PROMPTS, gens):
        k = len(tok.encode(expected, add_bos=False)) + 2
        cont = tok.decode(g.tokens[:k])
        conts.append({"name": name, "expected": expected, "llamacpp": cont, "pass": cont.startswith(expected)})
    res.update({
        "n_positions": int(ours_cat.shape[0]),
        "kld": stats.as_dict(),
        "max_abs_logit": float(np.max(np.abs(ours_cat - ref_cat))),
        "per_text": per_text,
        "continuations": conts,
        "reference_s": round(ref_s, 3),
        "seconds": round(time.perf_counter() - t0, 3),
    })
    if f32_control:
        del ref
        f32 = gguf_path.with_name(gguf_path.stem + ".F32-control.gguf")
        f32_copy(gguf_path, f32)
        res["f32_control"] = check_gemma3_real(f32, threads=threads, texts=texts)
    return res


def f32_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write ``dst``: ``src`` with every tensor dequantized to F32 (``gguf.quants.dequantize``), same metadata.

    Reused when ``dst`` exists and is newer than ``src``; written under a temporary name and moved into
    place, so an interrupted write never leaves a partial file under ``dst``.
    """
    src, dst = Path(src), Path(dst)
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    r = GGUFReader(src)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), str(r.fields["general.architecture"].contents()))
    try:
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            vt = GGUFValueType(f.types[0])
            w.add_key_value(name, f.contents(), vt, sub_type=GGUFValueType(f.types[-1])
                            if vt == GGUFValueType.ARRAY else None)
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w.add_tensor(t.name, a.reshape(tuple(int(x) for x in reversed(t.shape))))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


#: Extra real-text passages for the Gemma 3 KLD statistics (more positions than the three short prompts).
GEMMA3_EXTRA_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. Meanwhile, in the kitchen, the kettle began to whistle, "
    "and the cat, startled, knocked a cup of tea off the table.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature, which is why cooking pasta in the mountains takes longer.",
)


def llamacpp_checks(built, prompts: Iterable[Any], progress, name: str) -> list[Figure]:
    """llama.cpp (F32 KV, flash attention off, real sliding-window ring) vs the reference on a built case.

    Figures: ``llamacpp~reference.runs`` (1 when llama.cpp ran, 0 with its crash line), then
    ``.max_abs_logit`` (with the first diverging trace point), ``.mean_kld`` (with the per-position KLD
    histogram) and ``.same_top1`` (with near-ties and flips), each with its exact-GELU figure beside.

    Raises:
        EngineUnavailable: llama-cpp-python is not installed.
    """
    progress(f"[{name}] llama.cpp vs reference")
    rows = check_synthetic(built, prompts)
    summary = rows[-1]
    if "error" in summary:
        return [fig("llamacpp~reference.runs", 0.0, None, got=summary["error"])]
    out = [fig("llamacpp~reference.runs", 1.0)]
    trace = summary.get("trace") or {}
    fd = trace.get("first_divergence") if isinstance(trace, dict) else None
    first = f"{fd['point']}@{fd['layer']}" if fd else None
    per_point = trace.get("per_point") if isinstance(trace, dict) else None
    exact = summary.get("exact_reference") or {}
    per_prompt = [r for r in rows[:-1] if r.get("max_abs_logit_at")]
    w = max(per_prompt, key=lambda r: r["max_abs_logit"], default=None)
    worst_at = (f"request {w['prompt']} position {w['max_abs_logit_at'][0]} token {w['max_abs_logit_at'][1]}"
                if w is not None else None)
    out.append(fig("llamacpp~reference.max_abs_logit", summary["max_abs_logit"], None,
                   positions=summary["n_tokens"], first_divergence=first, vs_exact_gelu=exact.get("max_abs_logit"),
                   **({"worst_at": worst_at} if worst_at else {}),
                   **({"per_point": per_point, "traced_prompt": trace.get("prompt")} if per_point else {})))
    kld_pos = summary.get("kld_per_position")
    out.append(fig("llamacpp~reference.mean_kld", summary["mean_kld"], None, positions=summary["n_tokens"],
                   vs_exact_gelu=exact.get("mean_kld"),
                   **({"kld_hist": kld_histogram(kld_pos)} if kld_pos is not None else {})))
    out.append(fig("llamacpp~reference.same_top1", summary["same_top1"], None, positions=summary["n_tokens"],
                   near_ties=summary.get("near_ties"), top1_flips=summary.get("top1_flips"),
                   vs_exact_gelu=exact.get("same_top1"), top1_flips_vs_exact_gelu=exact.get("top1_flips")))
    return out
