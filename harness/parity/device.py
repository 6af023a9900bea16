"""One-shot check of the fast path on an accelerator against the float64 reference.

``g4h device-check --gguf A.gguf [B.gguf ...] --out results.json``

For each GGUF: the reference (float64, CPU) on the prompt set, then the fast
path on CUDA in float32 (weights dequantized on the device), bfloat16, and with
quantized matrices kept packed and dequantized on the fly; max |Δlogit|,
same-top-1 and the llama-perplexity KLD set for each; batched vs solo greedy on
the device; the static-shape decoder (one CUDA graph a step) against the paged engine. Needs only numpy, torch, gguf and safetensors (no transformers), so
it runs on a bare GPU image. Writes one JSON file atomically.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gemma4_harness.fast.model import FastModel
from gemma4_harness.reference import forward, load_model

from ..core import kld, metrics
from ..core.io import write_text_atomic
from ..core.prompts import load_prompts
from .checks.fast import batched_vs_solo, static_vs_paged


def check_file(path: str, prompts, device: str) -> dict:
    """All device figures for one GGUF (see module docstring)."""
    cfg, w = load_model(path)
    ref = [forward(cfg, w, p["prompt_ids"]) for p in prompts]
    base = np.concatenate(ref)
    out = {"file": Path(path).name, "positions": int(base.shape[0]), "runs": {}}
    quantized = any(w.raw_dtype(n) not in ("F32", "F16", "BF16") for n in w)
    variants = [("float32", False), ("bfloat16", False)] + ([("float32", True)] if quantized else [])
    for dtype, keep in variants:
        t0 = time.perf_counter()
        fm = FastModel(cfg, w, device, dtype, keep_quantized=keep)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = np.concatenate([fm.logits(p["prompt_ids"]).double().cpu().numpy() for p in prompts])
        if fm.device.type == "cuda":
            torch.cuda.synchronize()
        k = kld.kld_stats(ours, base)
        name = f"{dtype}{'-quantized-on-the-fly' if keep else ''}"
        out["runs"][name] = {"max_abs_logit": metrics.max_abs_err(ours, base), "same_top1_pct": k.same_top_p_pct,
                             "mean_kld": k.mean_kld, "max_kld": k.maximum_kld, "load_s": round(load_s, 3),
                             "forward_s": round(time.perf_counter() - t0, 3),
                             "weight_bytes_on_device": fm.w.nbytes()}
        if dtype == "float32" and not keep:
            bs = batched_vs_solo(fm)
            out["runs"][name]["batched_vs_solo"] = {k2: bs[k2] for k2 in ("same_tokens", "max_abs_logit",
                                                                         "isolation_max_abs")}
            out["runs"][name]["static_vs_paged"] = static_vs_paged(fm, solo=bs["_solo"])  # CUDA graphs on a GPU
    return out


def device_check(ggufs: list[str], out: str, device: str = "cuda", n_prompts: int = 8) -> dict:
    """Run :func:`check_file` on each GGUF with the first ``n_prompts`` synthetic prompts; write ``out``
    (JSON, atomically) and return it. A file that fails is recorded with its error and the next one runs."""
    prompts = load_prompts(ids_only=True)[:n_prompts]
    res = {"torch": torch.__version__, "python": platform.python_version(),
           "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "files": []}
    for g in ggufs:
        try:
            res["files"].append(check_file(g, prompts, device))
        except Exception as e:  # record and go on with the next file
            res["files"].append({"file": Path(g).name, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(res["files"][-1])[:400], file=sys.stderr, flush=True)
    write_text_atomic(out, json.dumps(res, indent=1, sort_keys=True))
    return res
