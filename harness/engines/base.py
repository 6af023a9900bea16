"""The engine protocol: what the harness needs from anything that runs Gemma 4.

An engine is built from a model (a ``.gguf`` file, an HF folder, or an already loaded config and
weights) and can

* ``logits(ids, trace=None)`` -> float ``[T, V]`` logits of every position of one sequence;
* ``generate(prompts, max_new_tokens)`` -> greedy continuations, and ``generate_full`` -> the same
  with the top-5 log-probabilities of every step (:class:`Generated`);
* report trace points (llama.cpp graph-callback names, :data:`harness.traces.KNOWN_POINTS`) through
  the ``trace`` callback ``(point, layer, array [T, ...])``.

For ``g4h bench`` an engine also times itself (:class:`Benchable`): ``bench_time("pp"|"tg", n, depth,
batch)`` runs one repetition of llama-bench's ``ppN`` / ``tgN`` after ``depth`` cached tokens and
returns the seconds of the timed part only; ``elem_bytes(name)`` says how many bytes per element of
weight ``name`` it reads. Every engine gets the same token ids (:func:`bench_ids`).

Errors: :class:`EngineUnavailable` (the engine cannot run here, or cannot read this model form; one
line says why and how to install it) and :class:`harness.core.workers.EngineCrashed` (its worker
process died).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.model import TraceFn

from ..core.workers import EngineCrashed

__all__ = ["Benchable", "Engine", "EngineCrashed", "EngineUnavailable", "Generated", "TraceFn", "bench_ids",
           "DTYPE_BYTES"]

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of a dense weight in each compute dtype."""


TOP_N = 5
"""Log-probs kept per step of a greedy stream unless asked otherwise (``--top-n``): vLLM's greedy-agreement rule
compares each side's token with the other's top-N, and its own tests use 5."""


class Generated:
    """One greedy continuation: ``tokens`` and, per step, the top-``top_n`` ``(id, logprob)`` pairs (``top``).

    Args:
        top_n: how many ``(id, logprob)`` pairs each step keeps, best first (default :data:`TOP_N`).
    """

    def __init__(self, top_n: int = TOP_N) -> None:
        self.top_n = int(top_n)
        self.tokens: list[int] = []
        self.top: list[list[tuple[int, float]]] = []

    def add(self, logits: np.ndarray) -> None:
        """Take the greedy token from one step's logits ``[V]`` (ties -> lowest id)."""
        z = np.asarray(logits, dtype=np.float64)
        logp = z - (z.max() + np.log(np.sum(np.exp(z - z.max()))))
        top = np.argsort(-logp, kind="stable")[:self.top_n]
        self.tokens.append(int(np.argmax(z)))
        self.top.append([(int(i), float(logp[i])) for i in top])


class EngineUnavailable(InputError):
    """The engine cannot run here or cannot read this kind of model file (one line says why)."""


class Engine(Protocol):
    """What the harness needs from an engine."""

    name: str

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """Logits ``[T, V]`` for every position of ``ids`` (one sequence, positions from 0)."""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt, ``max_new_tokens`` ids each."""

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      top_n: int = TOP_N) -> list[Generated]:
        """Greedy continuations with the top-``top_n`` log-probabilities of every step."""


class Benchable(Protocol):
    """An engine that ``g4h bench`` can time.

    Attributes:
        engine: engine name in the bench table (``fast``, ``transformers`` ...).
        dtype: what it computes in (``float32``, ``bfloat16``, ``Q4_K_M`` for llama.cpp's stored types).
        max_batch: the largest batch it runs (None: any).
        kv_elem: bytes per KV-cache element.
    """

    engine: str
    dtype: str
    max_batch: int | None
    kv_elem: float

    def elem_bytes(self, name: str) -> float:
        """Bytes per element of weight ``name`` as the engine reads it (Q8_0: 34/32)."""

    def bench_time(self, test: str, n: int, depth: int, batch: int) -> float:
        """Seconds of one ``pp`` (one forward of ``batch`` x ``n`` new tokens) or ``tg`` (``n`` greedy decode
        steps of ``batch`` sequences) repetition after ``depth`` cached tokens; the context fill is not timed."""

    def close(self) -> None:
        """Free what the engine holds."""


def bench_ids(vocab: int, count: int, seed: int) -> list[int]:
    """``count`` token ids in ``[4, min(vocab, 32000))`` from a fixed seed (no BOS/EOS/pad specials)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(4, max(5, min(vocab, 32000)), size=count)]
