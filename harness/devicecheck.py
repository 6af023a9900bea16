"""One-shot check of the fast path on an accelerator against the float64 reference.

``python -m harness.devicecheck --gguf A.gguf [B.gguf ...] --out results.json``

For each GGUF: the reference (float64, CPU) on the prompt set, then the fast
path on CUDA in float32 (weights dequantized on the device), bfloat16, and with
quantized matrices kept packed and dequantized on the fly; max |Δlogit|,
same-top-1 and the llama-perplexity KLD set for each; batched vs solo greedy on
the device. Needs only numpy, torch, gguf and safetensors (no transformers), so
it runs on a bare GPU image. Writes one JSON file atomically.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np


def check_file(path: str, prompts, device: str) -> dict:
    """All device figures for one GGUF (see module docstring)."""
    import torch

    from fast.model import FastModel
    from harness import metrics
    from harness.fastcheck import batched_vs_solo
    from reference import forward, load_model

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
        k = metrics.kld_stats(ours, base)
        name = f"{dtype}{'-quantized-on-the-fly' if keep else ''}"
        out["runs"][name] = {"max_abs_logit": metrics.max_abs_err(ours, base), "same_top1_pct": k.same_top_p_pct,
                             "mean_kld": k.mean_kld, "max_kld": k.maximum_kld, "load_s": round(load_s, 3),
                             "forward_s": round(time.perf_counter() - t0, 3),
                             "weight_bytes_on_device": fm.w.nbytes()}
        if dtype == "float32" and not keep:
            bs = batched_vs_solo(fm)
            out["runs"][name]["batched_vs_solo"] = {k2: bs[k2] for k2 in ("same_tokens", "max_abs_logit",
                                                                         "isolation_max_abs")}
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see module docstring); returns 0."""
    import torch

    from harness.parity import load_prompts

    ap = argparse.ArgumentParser(prog="python -m harness.devicecheck")
    ap.add_argument("--gguf", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8, help="first N prompts of the synthetic set")
    args = ap.parse_args(argv)
    prompts = load_prompts()[: args.prompts]
    res = {"torch": torch.__version__, "python": platform.python_version(),
           "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "files": []}
    for g in args.gguf:
        try:
            res["files"].append(check_file(g, prompts, args.device))
        except Exception as e:  # record and go on with the next file
            res["files"].append({"file": Path(g).name, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(res["files"][-1])[:400], file=sys.stderr, flush=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, sort_keys=True))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
