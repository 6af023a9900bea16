"""The ``reference`` engine: the float64 NumPy specification (:mod:`reference.model`)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from gemma4_harness.fast import quant_kernels
from gemma4_harness.reference import model as ref_model
from gemma4_harness.reference.batch import Chain, forward_chains
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.model import check_generation
from gemma4_harness.reference.weights import DEFAULT_CACHE_BYTES, load_model

from ..core import memory
from .base import TOP_N, Generated, TraceFn, bench_ids


def cache_bytes(cache_gb: float | None) -> int:
    """``--ref-cache-gb`` in bytes (None: :data:`reference.weights.DEFAULT_CACHE_BYTES`).

    Raises:
        InputError: negative or not a number.
    """
    if cache_gb is None:
        return DEFAULT_CACHE_BYTES
    if isinstance(cache_gb, bool) or not isinstance(cache_gb, (int, float)) or not 0 <= cache_gb < float("inf"):
        raise InputError(f"--ref-cache-gb {cache_gb!r}: expected a finite number of GB >= 0")
    return int(cache_gb * memory.GB)


def packed_rows(part: np.ndarray, qtype: str, row_len: int) -> np.ndarray | None:
    """The reference's GGUF dequantizer (:data:`reference.weights.Dequantizer`): rows of a quantized matrix through
    the packed C kernels of :func:`fast.quant_kernels.dequantize_rows`, which give ``gguf.quants``' values bit for
    bit (``tests/test_quant_kernels.py``, ``tests/test_oracle_pass.py``) several times faster and on every thread;
    None (``gguf.quants``) for a type they do not decode or where they are not built. The float64 reference reads
    each matrix on every pass over the model, so this is most of a pass's time on a quantized file."""
    if qtype not in quant_kernels.TYPES or part.shape[0] == 0:
        return None
    with warnings.catch_warnings():  # a read-only map makes a read-only tensor, which the kernel only reads
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(part)
    got = quant_kernels.dequantize_rows(raw, qtype, row_len, 0, part.shape[0])
    return None if got is None else got.numpy()


class ReferenceEngine:
    """The float64 NumPy reference (:mod:`reference.model`), one sequence at a time.

    The weights stream (:class:`reference.weights.Weights`): a tensor is dequantized when a layer
    reads it and released after, and at most ``cache_gb`` of them stay cached between forwards. Each
    forward is planned first (:func:`harness.core.memory.require`); a plan that does not fit, or an
    allocation that fails anyway, stops with one line (:class:`harness.core.memory.NotEnoughMemory`).

    Args:
        path: ``.gguf`` file or HF folder.
        cache_gb: ``--ref-cache-gb``: GB of float64 weights kept between forwards (default 2).
        layers: ``--layers N``: only the first N layers (:func:`reference.config.cut_layers`).

    Raises:
        InputError: from the loader (bad file, key or tensor); a bad ``cache_gb`` or ``layers``.
        NotEnoughMemory: the model cannot run in the memory available (one line).
    """

    name = "reference"
    engine = "reference"
    dtype = "float64"
    max_batch = 1
    kv_elem = 8.0
    memory_plan: memory.MemoryPlan | None = None

    @memory.guarded
    def __init__(self, path: str | Path, cache_gb: float | None = None, layers: int | None = None):
        self.cfg, self.weights = load_model(path, layers=layers, cache_bytes=cache_bytes(cache_gb),
                                            dequantizer=packed_rows)
        self._plan(1, 0)

    @classmethod
    def from_model(cls, cfg, weights) -> "ReferenceEngine":
        """An engine over an already loaded ``(cfg, weights)`` (:func:`reference.weights.load_model`)."""
        eng = cls.__new__(cls)
        eng.cfg, eng.weights = cfg, weights
        return eng

    def _plan(self, tokens: int, new_tokens: int, layer_held: bool = False) -> None:
        """Plan a forward of ``tokens`` plus ``new_tokens`` decode steps (``layer_held``: a layer-outer pass that
        holds a whole layer's weights); stop with one line when it cannot fit."""
        info = memory.ModelInfo.from_loaded(self.weights.source, self.cfg, self.weights)
        self.memory_plan = memory.require("reference", info, tokens=tokens, new_tokens=new_tokens,
                                          cache_bytes=self.weights.cache_bytes, layer_held=layer_held,
                                          forwards=2 if layer_held else None,  # passes repeat: the cache fills
                                          held=getattr(self.weights, "cached_bytes", 0))  # cached: allocated

    @memory.guarded
    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """float64 ``[T, V]``; see :func:`reference.model.forward`."""
        self._plan(len(ids), 0)
        return ref_model.forward(self.cfg, self.weights, ids, trace=trace)

    @memory.guarded
    def logits_chains(self, chains: Sequence[Chain],
                      on_layer: Callable[[int, int], None] | None = None) -> list[list[np.ndarray | None]]:
        """Many forwards, each weight read once for all (:func:`reference.batch.forward_chains`): per chain, per
        call, float64 ``[T, V]`` logits (None where the chain did not want them), bit for bit what
        :meth:`logits` and the cached forwards give call by call. ``on_layer(i, n)``: called after each of the
        ``n`` layers (a progress display).

        Planned as one forward of all the calls' tokens holding a whole layer's weights.
        """
        tokens = sum(len(ids) for c in chains for ids in c.calls)
        self._plan(max(tokens, 1), 0, layer_held=True)
        return forward_chains(self.cfg, self.weights, chains, on_layer)

    @memory.guarded
    def logits_cached(self, ids: Sequence[int], prefill: int) -> np.ndarray:
        """Logits from a prefill of ``ids[:prefill]`` then one-token decode steps. float64 ``[T, V]``."""
        cache = ref_model.KVCache(self.cfg)
        parts = [ref_model.forward(self.cfg, self.weights, ids[:prefill], cache)]
        for tok in ids[prefill:]:
            parts.append(ref_model.forward(self.cfg, self.weights, [tok], cache))
        return np.concatenate(parts, axis=0)

    @memory.guarded
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy, one prompt at a time, with the KV cache.

        Raises:
            PromptError: see :func:`reference.model.check_generation` (checked before any prompt runs).
        """
        check_generation(self.cfg, prompts, max_new_tokens)
        self._plan(max((len(p) for p in prompts), default=1), max_new_tokens)
        return [ref_model.greedy_generate(self.cfg, self.weights, p, max_new_tokens) for p in prompts]

    @memory.guarded
    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      top_n: int = TOP_N) -> list[Generated]:
        """Greedy with the top-``top_n`` log-probabilities of every step.

        Raises:
            PromptError: see :func:`reference.model.check_generation` (checked before any prompt runs).
        """
        check_generation(self.cfg, prompts, max_new_tokens)
        self._plan(max((len(p) for p in prompts), default=1), max_new_tokens)
        out = []
        for p in prompts:
            cache = ref_model.KVCache(self.cfg)
            logits = ref_model.forward(self.cfg, self.weights, p, cache)[-1]
            g = Generated(top_n)
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
        """Fill the weight cache up to its budget (for a benchmark: loading is not decoding)."""
        self.weights.fill_cache()

    def close(self) -> None:
        """Drop the weights."""
        self.weights = None
