"""The ``reference`` engine: the float64 NumPy specification (:mod:`reference.model`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np

from reference import model as ref_model
from reference.model import check_generation
from reference.weights import load_model

from .base import Generated, TraceFn, bench_ids


class ReferenceEngine:
    """The float64 NumPy reference (:mod:`reference.model`), one sequence at a time.

    Args:
        path: ``.gguf`` file or HF folder.

    Raises:
        InputError: from the loader (bad file, key or tensor).
    """

    name = "reference"
    engine = "reference"
    dtype = "float64"
    max_batch = 1
    kv_elem = 8.0

    def __init__(self, path: str | Path):
        self.cfg, self.weights = load_model(path)

    @classmethod
    def from_model(cls, cfg, weights) -> "ReferenceEngine":
        """An engine over an already loaded ``(cfg, weights)`` (:func:`reference.weights.load_model`)."""
        eng = cls.__new__(cls)
        eng.cfg, eng.weights = cfg, weights
        return eng

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """float64 ``[T, V]``; see :func:`reference.model.forward`."""
        return ref_model.forward(self.cfg, self.weights, ids, trace=trace)

    def logits_cached(self, ids: Sequence[int], prefill: int) -> np.ndarray:
        """Logits from a prefill of ``ids[:prefill]`` then one-token decode steps. float64 ``[T, V]``."""
        cache = ref_model.KVCache(self.cfg)
        parts = [ref_model.forward(self.cfg, self.weights, ids[:prefill], cache)]
        for tok in ids[prefill:]:
            parts.append(ref_model.forward(self.cfg, self.weights, [tok], cache))
        return np.concatenate(parts, axis=0)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy, one prompt at a time, with the KV cache.

        Raises:
            PromptError: see :func:`reference.model.check_generation` (checked before any prompt runs).
        """
        check_generation(self.cfg, prompts, max_new_tokens)
        return [ref_model.greedy_generate(self.cfg, self.weights, p, max_new_tokens) for p in prompts]

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generated]:
        """Greedy with the top-5 log-probabilities of every step.

        Raises:
            PromptError: see :func:`reference.model.check_generation` (checked before any prompt runs).
        """
        check_generation(self.cfg, prompts, max_new_tokens)
        out = []
        for p in prompts:
            cache = ref_model.KVCache(self.cfg)
            logits = ref_model.forward(self.cfg, self.weights, p, cache)[-1]
            g = Generated()
            for _ in range(max_new_tokens):
                g.add(logits)
                logits = ref_model.forward(self.cfg, self.weights, [g.tokens[-1]], cache)[-1]
            out.append(g)
        return out

    # ------------------------------------------------------------------ bench (harness.engines.base.Benchable)

    def elem_bytes(self, name: str) -> float:
        """float64: 8 bytes per element of every weight."""
        return 8.0

    def _context(self, depth: int) -> ref_model.KVCache:
        cache = ref_model.KVCache(self.cfg)
        if depth:
            ref_model.forward(self.cfg, self.weights, bench_ids(self.cfg.vocab_size, depth, 1), cache)
        return cache

    def bench_time(self, test: str, n: int, depth: int, batch: int) -> float:
        """One ``pp``/``tg`` repetition (batch 1 only; see :class:`harness.engines.base.Benchable`)."""
        cache = self._context(depth)
        if test == "pp":
            ids = bench_ids(self.cfg.vocab_size, n, 100)
            t = time.perf_counter()
            ref_model.forward(self.cfg, self.weights, ids, cache)
            return time.perf_counter() - t
        tok = bench_ids(self.cfg.vocab_size, 1, 7)
        t = time.perf_counter()
        for _ in range(n):
            logits = ref_model.forward(self.cfg, self.weights, tok, cache)
            tok = [int(np.argmax(logits[-1]))]
        return time.perf_counter() - t

    def warm(self) -> None:
        """Dequantize every weight up front (for a benchmark: loading is not decoding)."""
        for name in self.weights:
            self.weights[name]

    def close(self) -> None:
        """Drop the weights."""
        self.weights = None
