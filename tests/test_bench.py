"""Throughput benchmarks (``pytest --bench``): figures go to a report, never into asserts."""

from __future__ import annotations

import json
import os

import pytest

from harness import synth
from harness.bench import fast_decode, reference_decode, transformers_decode
from harness.report import markdown_table, new_run_dir, write_json_atomic, write_text_atomic

BENCH_SPEC = synth.REPO_ROOT / "cases" / "bench" / "e4b-1024.toml"


@pytest.mark.bench
def test_decode_throughput_cpu_fp32():
    """Decode tokens/s on the CPU, fp32, one run: reference f64, transformers eager, fast solo and batched 8."""
    built = synth.ensure_built(BENCH_SPEC)
    prompt = [2] + [4 + (i * 37) % 200 for i in range(63)]
    reps = int(os.environ.get("G4H_BENCH_REPS", "5"))
    rows = [
        reference_decode(built.gguf["F32"], prompt, n=8, reps=max(2, reps // 2), warmup=1),
        transformers_decode(built.hf_dir, prompt, n=32, reps=reps, warmup=1),
        fast_decode(built.gguf["F32"], prompt, n=32, batch=1, reps=reps, warmup=1),
        fast_decode(built.gguf["F32"], prompt, n=32, batch=8, reps=reps, warmup=1),
    ]
    ref, hf, solo, b8 = (r.mean for r in rows)
    ratios = {"fast/reference": solo / ref, "fast/transformers": solo / hf, "fast batched 8 / fast solo": b8 / solo}
    run = new_run_dir("bench")
    data = {"version": 1, "kind": "bench", "model": str(BENCH_SPEC), "prompt_tokens": len(prompt),
            "measurements": [r.as_dict() for r in rows], "ratios": ratios}
    write_json_atomic(run / "results.json", data)
    table = markdown_table([{"engine": r.engine, "batch": r.batch, "tg tokens": r.tokens,
                             "tok/s": f"{r.mean:.2f} ± {r.std:.2f}"} for r in rows],
                           ["engine", "batch", "tg tokens", "tok/s"])
    text = (f"# Decode benchmark (CPU, fp32)\n\nmodel: `{BENCH_SPEC.name}`, prompt {len(prompt)} tokens\n\n{table}\n\n"
            + "\n".join(f"- {k}: {v:.2f}x" for k, v in ratios.items()) + "\n")
    write_text_atomic(run / "report.md", text)
    print("\n" + text + f"\nreport: {run}/report.md")
    assert all(r.tok_per_s for r in rows)
