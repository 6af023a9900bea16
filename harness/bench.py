"""Decode throughput, measured the way llama-bench does (``tg`` after a prompt), in one run.

Every figure compared with another comes from the same process and the same
run, after a warm-up, as mean ± std over repetitions. Prefill is excluded from a
decode figure. ``fast`` batched throughput counts the tokens of all sequences.

This is the issue-3 subset (reference, transformers eager, fast solo and
batched); ``g4h bench`` with pp/tg/depth sweeps and roofline shares builds on it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np


@dataclass
class Measurement:
    """tokens/s of repeated runs of one (engine, batch) configuration."""

    engine: str
    batch: int
    tokens: int  # generated per sequence per repetition
    tok_per_s: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.tok_per_s)

    @property
    def std(self) -> float:
        return statistics.stdev(self.tok_per_s) if len(self.tok_per_s) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "batch": self.batch, "tokens": self.tokens, "mean_tok_s": self.mean,
                "std_tok_s": self.std, "reps": self.tok_per_s}


def _repeat(fn: Callable[[], float], reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(reps)]


def reference_decode(path: str | Path, prompt: list[int], n: int, reps: int = 3, warmup: int = 1) -> Measurement:
    """Reference float64: prefill with the cache, then time ``n`` one-token forwards."""
    from reference import KVCache, forward, load_model

    cfg, w = load_model(path)
    for name in w:  # dequantize up front: loading is not decoding
        w[name]

    def run() -> float:
        cache = KVCache(cfg)
        logits = forward(cfg, w, prompt, cache)
        t = time.perf_counter()
        for _ in range(n):
            logits = forward(cfg, w, [int(np.argmax(logits[-1]))], cache)
        return n / (time.perf_counter() - t)

    return Measurement("reference-f64", 1, n, _repeat(run, reps, warmup))


def transformers_decode(hf_dir: str | Path, prompt: list[int], n: int, reps: int = 3,
                        warmup: int = 1) -> Measurement:
    """transformers fp32 eager with its own cache: prefill, then time ``n`` one-token forwards."""
    import torch

    from .engines import TransformersEngine

    model = TransformersEngine(hf_dir).model

    def run() -> float:
        with torch.no_grad():
            o = model(torch.tensor([prompt]), use_cache=True)
            t = time.perf_counter()
            for _ in range(n):
                tok = o.logits[0, -1].argmax().view(1, 1)
                o = model(tok, past_key_values=o.past_key_values, use_cache=True)
            return n / (time.perf_counter() - t)

    return Measurement("transformers-fp32-eager", 1, n, _repeat(run, reps, warmup))


def fast_decode(path: str | Path, prompt: list[int], n: int, batch: int = 1, dtype: str = "float32",
                device: str = "cpu", reps: int = 3, warmup: int = 1) -> Measurement:
    """fast: ``batch`` copies of the prompt (different last token) prefilled, then ``n`` batched decode steps timed;
    tokens/s counts every sequence's tokens."""
    import torch

    from fast.model import FastModel, SeqStep
    from reference import load_model

    cfg, w = load_model(path)
    fm = FastModel(cfg, w, device, dtype)
    sync = torch.cuda.synchronize if fm.device.type == "cuda" else (lambda: None)

    def run() -> float:
        cache = fm.new_cache(batch, len(prompt) + n + 1)
        slots = [cache.alloc() for _ in range(batch)]
        with torch.inference_mode():
            seqs = [SeqStep(s, torch.tensor(prompt[:-1] + [4 + i % 200]), 0) for i, s in enumerate(slots)]
            logits = fm.step(cache, seqs)
            sync()
            t = time.perf_counter()
            for k in range(n):
                toks = logits.argmax(-1).cpu()
                logits = fm.step(cache, [SeqStep(s, toks[i:i + 1], len(prompt) + k) for i, s in enumerate(slots)])
            sync()
            return batch * n / (time.perf_counter() - t)

    return Measurement(f"fast-{fm.device.type}-{dtype}", batch, n, _repeat(run, reps, warmup))
