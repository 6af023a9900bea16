"""Real weights: the reference runs the real Gemma 3 270M GGUF and says the right things.

:func:`run_gemma3_real` loads the cached GGUF (:func:`harness.core.realdata.gemma3_270m_gguf`),
tokenizes three prompts with :class:`reference.tokenizer.GGUFTokenizer`, greedy-generates with the
reference (KV cache) and records whether each continuation starts with the expected text. It then
runs the fast path on the same sequences, and, when transformers can build ``Gemma3ForCausalLM``
from the same GGUF offline (:func:`harness.engines.transformers.load_gemma3_gguf`), compares the
reference with it on the teacher-forced sequence ``prompt + generated[:-1]``: max |Δlogit|, top-1
agreement, and the relative L2 of the hidden states (``inp_scaled``, ``l_out`` per layer,
``result_norm``; transformers is the oracle, so its norm is the denominator).

No gate is applied here: :func:`gemma3_figures` turns the measurements into figures for the parity
job. The result is JSON-able.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

import numpy as np

from gemma4_harness.fast.engine import generate
from gemma4_harness.fast.model import FastModel
from gemma4_harness.reference.model import forward, greedy_generate
from gemma4_harness.reference.tokenizer import tokenizer_from_gguf
from gemma4_harness.reference.weights import load_model

from ...core.engine_kinds import TWIN
from ...core.metrics import kld_histogram, kld_per_position, rel_l2
from ...core.realdata import gemma3_270m_gguf
from ...engines.transformers import TransformersEngine
from ...traces import TraceRecorder
from ..result import Figure, fig, one_line

FAST, HF = TWIN, TransformersEngine.engine
"""The sections of :func:`run_gemma3_real`'s result for the engines it runs beside the reference (``fast``,
``transformers``: :data:`ENGINE_SECTIONS`)."""

ENGINE_SECTIONS = (FAST, HF)
"""The result's per-engine sections (their prompts' figures: left out of the case's ``info``)."""

RESULT_VERSION = 1

# (name, prompt, expected start of the greedy continuation)
PROMPTS: tuple[tuple[str, str, str], ...] = (
    ("capital-question", "Question: What is the capital of France?\nAnswer:", " Paris"),
    ("counting", "One, two, three, four,", " five, six, seven, eight,"),
    ("capital-statement", "Paris is the capital of", " France"),
)

EXTRA_TOKENS = 2  # generated beyond the expected text's own token count


def run_gemma3_real(out: MutableMapping[str, Any] | None = None, *, path: str | None = None,
                    compare_transformers: bool = True, packed: bool = True) -> MutableMapping[str, Any]:
    """Run the reference on the real Gemma 3 270M GGUF; optionally compare with transformers.

    Args:
        out: mapping to fill (and return); a new dict when None. Filled as the
            run goes, so a caller keeps the finished parts if a later step raises.
        path: GGUF to use instead of the cached package file.
        compare_transformers: also run transformers' GGUF path when it works.
        packed: fast keeps the quantized tensors packed (the packed CPU kernels, views of the mapped file);
            False: dequantized at load.

    Returns:
        ``out`` with keys ``version``, ``model`` (path, config summary, tensor
        types), ``timings`` (seconds), ``prompts`` (per prompt: name, text, ids,
        generated_ids, continuation, expected, pass, generate_s, s_per_token,
        teacher_forced_match), ``pass`` (all prompts), and ``transformers``
        (``available``; when true, per prompt max_abs_logit_diff,
        top1_agreement, layer_rel_l2 ...; else ``reason``).

    Raises:
        reference.errors.InputError: the GGUF package is missing or the file is bad.
    """
    res: MutableMapping[str, Any] = {} if out is None else out
    res["version"] = RESULT_VERSION
    timings: dict[str, float] = {}
    res["timings"] = timings

    t = time.perf_counter()
    gguf_path = str(path) if path is not None else str(gemma3_270m_gguf())
    timings["cache_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    tok = tokenizer_from_gguf(gguf_path)
    timings["tokenizer_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    cfg, W = load_model(gguf_path)
    # The greedy runs read every tensor once per step; the model dequantized is 2.15 GB in float64, just over the
    # default budget, which left the 262k-row head (1.34 GB) re-read from the file at every step. The budget is
    # the model's size here (a 270M model), so after the first two steps no step dequantizes anything.
    W.cache_bytes = max(W.cache_bytes, sum(8 * int(np.prod(W.shape(n))) for n in W))
    timings["load_s"] = round(time.perf_counter() - t, 3)
    types: dict[str, int] = {}
    for name in W:
        types[W.raw_dtype(name)] = types.get(W.raw_dtype(name), 0) + 1
    res["model"] = {"path": gguf_path, "config": cfg.summary(), "tensor_types": types}

    stop = () if cfg.eos_token_id is None else (int(cfg.eos_token_id),)
    prompts: list[dict[str, Any]] = []
    res["prompts"] = prompts
    sequences: list[list[int]] = []
    ref_runs: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []
    for name, text, expected in PROMPTS:
        ids = tok.encode(text)
        n_new = len(tok.encode(expected, add_bos=False)) + EXTRA_TOKENS
        t = time.perf_counter()
        gen = greedy_generate(cfg, W, ids, n_new, stop=stop)
        dt = time.perf_counter() - t
        cont = tok.decode(gen)
        # Uncached forward over prompt + generated[:-1]: its argmaxes must reproduce the cached greedy run.
        seq = ids + gen[:-1]
        trace: dict[str, np.ndarray] = {}

        def keep(point, layer, arr, trace=trace):
            if point in ("inp_scaled", "result_norm"):
                trace[point] = arr.copy()
            elif point == "l_out":
                trace[f"l_out.{layer}"] = arr.copy()

        t2 = time.perf_counter()
        logits = forward(cfg, W, seq, trace=keep)
        dt_full = time.perf_counter() - t2
        forced = [int(x) for x in np.argmax(logits[len(ids) - 1:], axis=-1)]
        prompts.append({
            "name": name, "text": text, "ids": [int(i) for i in ids], "generated_ids": [int(g) for g in gen],
            "continuation": cont, "expected": expected, "pass": cont.startswith(expected),
            "generate_s": round(dt, 3), "s_per_token": round(dt / max(len(gen), 1), 4),
            "uncached_forward_s": round(dt_full, 3), "teacher_forced_match": forced == gen,
        })
        sequences.append(seq)
        ref_runs.append((logits, trace))
    res["pass"] = all(p["pass"] for p in prompts)
    res[FAST] = _compare_fast(cfg, W, sequences, ref_runs, tok, packed)

    if not compare_transformers:
        res[HF] = {"available": False, "reason": "not requested"}
        return res
    try:
        t = time.perf_counter()
        oracle = TransformersEngine(gguf_path, cfg)
        info = {"route": "transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint + Gemma3ForCausalLM "
                         "(fp32, eager); from_pretrained(gguf_file=...) needs the accelerate package",
                "load_s": round(time.perf_counter() - t, 3)}
    except Exception as e:  # an unavailable oracle is a finding, not a crash
        res[HF] = {"available": False, "reason": one_line(e)[:300]}
        return res
    cmp: dict[str, Any] = {"available": True, **info, "prompts": []}
    res[HF] = cmp
    for (name, _, _), seq, (ref_logits, ref_trace) in zip(PROMPTS, sequences, ref_runs):
        t = time.perf_counter()
        rec = TraceRecorder()
        hf_logits = oracle.logits(seq, trace=rec)
        hf_trace = {(f"l_out.{layer}" if point == "l_out" else point): arr for (point, layer), arr in rec.points.items()}
        dt = time.perf_counter() - t
        layer_rel = [rel_l2(ref_trace[f"l_out.{i}"], hf_trace[f"l_out.{i}"]) for i in range(cfg.n_layer)]
        cmp["prompts"].append({
            "name": name, "n_tokens": len(seq), "forward_s": round(dt, 3),
            "max_abs_logit_diff": float(np.max(np.abs(ref_logits - hf_logits))),
            "top1_agreement": float(np.mean(np.argmax(ref_logits, -1) == np.argmax(hf_logits, -1))),
            "inp_scaled_rel_l2": rel_l2(ref_trace["inp_scaled"], hf_trace["inp_scaled"]),
            "layer_rel_l2": layer_rel,
            "result_norm_rel_l2": rel_l2(ref_trace["result_norm"], hf_trace["result_norm"]),
        })
    cmp["max_abs_logit_diff"] = max(p["max_abs_logit_diff"] for p in cmp["prompts"])
    cmp["max_layer_rel_l2"] = max(max(p["layer_rel_l2"]) for p in cmp["prompts"])
    cmp["min_top1_agreement"] = min(p["top1_agreement"] for p in cmp["prompts"])
    return res


def _compare_fast(cfg, W, sequences, ref_runs, tok, packed: bool = True) -> dict[str, Any]:
    """fast fp32 (CPU; the real Q8_0/Q5_0/Q4_K/Q6_K tensors kept packed and read by the packed kernels, or
    dequantized at load when not ``packed``) vs the reference
    on each prompt + generated sequence (max |Δlogit|, same top-1, per-position KLD counted on
    :func:`harness.core.metrics.kld_histogram`'s fixed log bins), and its own greedy continuation of the
    first prompt."""
    t = time.perf_counter()
    fm = FastModel(cfg, W, "cpu", "float32", keep_quantized=packed)
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - t, 3),
                           "weights": "packed" if packed else "dequantized", "prompts": []}
    for (name, _, _), seq, (ref_logits, _) in zip(PROMPTS, sequences, ref_runs):
        f = fm.logits(seq).double().numpy()
        out["prompts"].append({"name": name, "n_tokens": len(seq),
                               "max_abs_logit_diff": float(np.max(np.abs(f - ref_logits))),
                               "top1_agreement": float(np.mean(np.argmax(f, -1) == np.argmax(ref_logits, -1))),
                               "kld_hist": kld_histogram(kld_per_position(f, ref_logits))})
    first_ids = tok.encode(PROMPTS[0][1])
    out["greedy_first_prompt"] = tok.decode(generate(fm, [first_ids], 3)[0].tokens)
    return out


def gemma3_figures(out: MutableMapping[str, Any], info: dict[str, Any]) -> list[Figure]:
    """The measurements of :func:`run_gemma3_real` as figures for the parity job.

    Figures: ``gemma3_real.continuation`` per prompt; ``reference~fast.max_abs_logit`` per prompt (with its
    KLD histogram); with transformers available, ``reference~transformers.max_abs_logit`` and
    ``.layer_rel_l2`` (worst ``l_out``) per prompt, and ``reference~transformers.runs`` (0 when transformers'
    GGUF path failed, which fails the case).
    """
    figs = []
    for item in out.get("prompts", []):
        figs.append(fig("gemma3_real.continuation", 1.0 if item.get("pass") else 0.0, item.get("name"),
                        expected=item.get("expected"), got=item.get("continuation")))
    for item in out.get(FAST, {}).get("prompts", []):
        figs.append(fig("reference~fast.max_abs_logit", item["max_abs_logit_diff"], item["name"],
                        tokens=item["n_tokens"], same_top1=item["top1_agreement"],
                        **({"kld_hist": item["kld_hist"]} if "kld_hist" in item else {})))
    hf = out.get(HF, {})
    for item in hf.get("prompts", []):
        figs.append(fig("reference~transformers.max_abs_logit", item["max_abs_logit_diff"], item["name"],
                        tokens=item["n_tokens"], same_top1=item["top1_agreement"]))
        rows = item["layer_rel_l2"]
        worst = max(range(len(rows)), key=lambda i: rows[i])
        figs.append(fig("reference~transformers.layer_rel_l2", rows[worst], item["name"],
                        worst_point=f"l_out@{worst}", per_point=[["l_out", i, v] for i, v in enumerate(rows)]))
    if hf and not hf.get("available", False):
        # an oracle that cannot run fails the case: it is never a quiet note under a pass
        figs.append(fig("reference~transformers.runs", 0.0, "gemma3-270m",
                        got=f"not run: transformers' GGUF path: {hf.get('reason', 'unavailable')}"))
    elif hf:
        figs.append(fig("reference~transformers.runs", 1.0, "gemma3-270m"))
    return figs
