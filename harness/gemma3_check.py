"""Real-weights check: the reference runs the real Gemma 3 270M GGUF and says the right things.

:func:`run_gemma3_real` loads the cached GGUF (:func:`harness.realdata.gemma3_270m_gguf`),
tokenizes three prompts with :class:`reference.tokenizer.GGUFTokenizer`,
greedy-generates with the reference (KV cache) and checks that each
continuation starts with the expected text. When transformers can build
``Gemma3ForCausalLM`` from the same GGUF offline, it also compares the two on
the teacher-forced sequence ``prompt + generated[:-1]``: max |Δlogit|, top-1
agreement, and per-layer relative L2 of the hidden states (DESIGN.md gate
"reference f64 vs transformers fp32": max abs logit diff <= 1e-4, per-layer
relative L2 <= 1e-4).

How transformers is driven: ``from_pretrained(dir, gguf_file=...)`` refuses to
run without the ``accelerate`` package, which is not installed here. The check
therefore calls the same two transformers functions that ``from_pretrained``'s
legacy GGUF path uses: ``load_gguf_checkpoint(path)`` for the config (as
``AutoConfig.from_pretrained(dir, gguf_file=...)`` does) and
``load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)`` for the
dequantized float32 state dict. That path un-shifts the Gemma norms (its
``Gemma2TensorProcessor`` subtracts 1 from every ``*norm.weight``; the model
adds it back in ``Gemma3RMSNorm``). Attention is ``eager``.

Importing this module has no side effects; torch and transformers are imported
only when the comparison runs. The result is JSON-able.
"""

from __future__ import annotations

import time
from typing import Any, MutableMapping

import numpy as np

RESULT_VERSION = 1

# (name, prompt, expected start of the greedy continuation)
PROMPTS: tuple[tuple[str, str, str], ...] = (
    ("capital-question", "Question: What is the capital of France?\nAnswer:", " Paris"),
    ("counting", "One, two, three, four,", " five, six, seven, eight,"),
    ("capital-statement", "Paris is the capital of", " France"),
)

from harness.gates import DEFAULT_GATES

# The reference f64 vs transformers fp32 gates live in harness/gates.py.
GATE_MAX_ABS_LOGIT = DEFAULT_GATES["reference~transformers.max_abs_logit"].limit
GATE_LAYER_REL_L2 = DEFAULT_GATES["reference~transformers.layer_rel_l2"].limit

EXTRA_TOKENS = 2  # generated beyond the expected text's own token count


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b|| / ||a||`` (a = reference)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-300))


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _load_transformers(path: str) -> tuple[Any, dict[str, Any]]:
    """Gemma3ForCausalLM (fp32, eager) from the GGUF through transformers' own GGUF loader.

    Returns:
        ``(model, info)`` where info has timings and what the loader did.

    Raises:
        whatever transformers raises (the caller records it as one line).
    """
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, Gemma3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    t0 = time.perf_counter()
    cfg_dict = dict(load_gguf_checkpoint(path, return_tensors=False)["config"])
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    config._attn_implementation = "eager"
    t1 = time.perf_counter()
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    t2 = time.perf_counter()
    info = {
        "route": "transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint + Gemma3ForCausalLM (fp32, eager); "
                 "from_pretrained(gguf_file=...) needs the accelerate package",
        "config_s": round(t1 - t0, 3),
        "weights_s": round(t2 - t1, 3),
        "norm_unshift": "Gemma2TensorProcessor: *norm.weight - 1 (Gemma3RMSNorm multiplies by 1 + w)",
        "layer_types": list(config.layer_types),
        "rope_parameters": {k: dict(v) for k, v in (config.rope_parameters or {}).items()},
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
    }
    return model, info


def _transformers_forward(model, ids: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Logits [T, V] and hidden states (``inp_scaled``, ``l_out`` per layer, ``result_norm``) as float64."""
    import torch

    caps: dict[str, np.ndarray] = {}

    def grab(key):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            caps[key] = out.detach().to(torch.float64).numpy()[0]
        return hook

    inner = model.model
    hooks = [inner.embed_tokens.register_forward_hook(grab("inp_scaled")),
             inner.norm.register_forward_hook(grab("result_norm"))]
    hooks += [layer.register_forward_hook(grab(f"l_out.{i}")) for i, layer in enumerate(inner.layers)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], dtype=torch.long)).logits[0].to(torch.float64).numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, caps


def run_gemma3_real(out: MutableMapping[str, Any] | None = None, *, path: str | None = None,
                    compare_transformers: bool = True) -> MutableMapping[str, Any]:
    """Run the reference on the real Gemma 3 270M GGUF; optionally compare with transformers.

    Args:
        out: mapping to fill (and return); a new dict when None. Filled as the
            run goes, so a caller keeps the finished parts if a later step raises.
        path: GGUF to use instead of the cached package file.
        compare_transformers: also run transformers' GGUF path when it works.

    Returns:
        ``out`` with keys ``version``, ``model`` (path, config summary, tensor
        types), ``timings`` (seconds), ``prompts`` (per prompt: name, text, ids,
        generated_ids, continuation, expected, pass, generate_s, s_per_token,
        teacher_forced_match), ``pass`` (all prompts), and ``transformers``
        (``available``; when true, per prompt max_abs_logit_diff,
        top1_agreement, layer_rel_l2, ... and the gate verdict; else ``reason``).

    Raises:
        reference.errors.InputError: the GGUF package is missing or the file is bad.
    """
    from harness.realdata import gemma3_270m_gguf
    from reference.model import forward, greedy_generate
    from reference.tokenizer import tokenizer_from_gguf
    from reference.weights import load_model

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
    res["fast"] = _compare_fast(cfg, W, sequences, ref_runs, tok)

    if not compare_transformers:
        res["transformers"] = {"available": False, "reason": "not requested"}
        return res
    try:
        model, info = _load_transformers(gguf_path)
    except Exception as e:  # an unavailable oracle is a finding, not a crash
        res["transformers"] = {"available": False, "reason": _one_line(e)}
        return res
    cmp: dict[str, Any] = {"available": True, **info, "prompts": []}
    res["transformers"] = cmp
    for (name, _, _), seq, (ref_logits, ref_trace) in zip(PROMPTS, sequences, ref_runs):
        t = time.perf_counter()
        hf_logits, hf_trace = _transformers_forward(model, seq)
        dt = time.perf_counter() - t
        layer_rel = [_rel_l2(ref_trace[f"l_out.{i}"], hf_trace[f"l_out.{i}"]) for i in range(cfg.n_layer)]
        cmp["prompts"].append({
            "name": name, "n_tokens": len(seq), "forward_s": round(dt, 3),
            "max_abs_logit_diff": float(np.max(np.abs(ref_logits - hf_logits))),
            "top1_agreement": float(np.mean(np.argmax(ref_logits, -1) == np.argmax(hf_logits, -1))),
            "inp_scaled_rel_l2": _rel_l2(ref_trace["inp_scaled"], hf_trace["inp_scaled"]),
            "layer_rel_l2": layer_rel,
            "result_norm_rel_l2": _rel_l2(ref_trace["result_norm"], hf_trace["result_norm"]),
        })
    worst_logit = max(p["max_abs_logit_diff"] for p in cmp["prompts"])
    worst_layer = max(max(p["layer_rel_l2"]) for p in cmp["prompts"])
    cmp["max_abs_logit_diff"] = worst_logit
    cmp["max_layer_rel_l2"] = worst_layer
    cmp["min_top1_agreement"] = min(p["top1_agreement"] for p in cmp["prompts"])
    cmp["gate"] = {"max_abs_logit_diff": GATE_MAX_ABS_LOGIT, "layer_rel_l2": GATE_LAYER_REL_L2,
                   "pass": worst_logit <= GATE_MAX_ABS_LOGIT and worst_layer <= GATE_LAYER_REL_L2}
    return res


def _compare_fast(cfg, W, sequences, ref_runs, tok) -> dict[str, Any]:
    """fast fp32 (CPU; the real Q8_0/Q5_0/Q4_K/Q6_K tensors dequantized in torch) vs the reference
    on each prompt + generated sequence (max |Δlogit|, same top-1, per-position KLD counted on
    :func:`harness.metrics.kld_histogram`'s fixed log bins), and its own greedy continuation of the
    first prompt."""
    from fast.engine import generate
    from fast.model import FastModel
    from harness.metrics import kld_histogram, kld_per_position

    t = time.perf_counter()
    fm = FastModel(cfg, W, "cpu", "float32")
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - t, 3), "prompts": []}
    for (name, _, _), seq, (ref_logits, _) in zip(PROMPTS, sequences, ref_runs):
        f = fm.logits(seq).double().numpy()
        out["prompts"].append({"name": name, "n_tokens": len(seq),
                               "max_abs_logit_diff": float(np.max(np.abs(f - ref_logits))),
                               "top1_agreement": float(np.mean(np.argmax(f, -1) == np.argmax(ref_logits, -1))),
                               "kld_hist": kld_histogram(kld_per_position(f, ref_logits))})
    first_ids = tok.encode(PROMPTS[0][1])
    out["greedy_first_prompt"] = tok.decode(generate(fm, [first_ids], 3)[0].tokens)
    return out


if __name__ == "__main__":  # pragma: no cover - manual run: python -m harness.gemma3_check
    import json

    print(json.dumps(run_gemma3_real(), indent=1))
