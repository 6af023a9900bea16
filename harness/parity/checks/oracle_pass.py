"""What the pairs of a user's model ask the float64 reference for, computed in as few passes over the weights as
the checks allow (:func:`reference_pass`).

On a real-size quantized model each reference forward is mostly the read of the weights (dequantized to
float64), and the checks ask for many: every prompt's logits and trace under each set of approximations the
engines declare (exact, llama.cpp's fp16 GELU table), the greedy streams of every prompt, and the cached-vs-
uncached check (half the prompt, then the rest one token at a time). Run one after another (as
:class:`.reference_runs.ReferenceRuns` would), that is one forward per prompt per set, one per greedy step per prompt,
and one per token of every second half. Here:

* pass 1 (:func:`reference.batch.forward_chains`): every prompt under every set, and every cached-vs-uncached
  chain (its one-token steps are teacher-forced: the prompt's own tokens, so layer ``i`` of every step runs
  before layer ``i + 1`` of any), each weight read once;
* passes 2 .. N: one greedy step of every stream at a time (the next token is the last step's argmax, so a step
  needs the whole model), the streams' prefills being pass 1's forwards of the same prompts under the same set
  (the same call: :class:`reference.model.KVCache` kept). The forward after the last token, whose logits no step
  reads, is not run.

Every figure is what the one-by-one path gives, bit for bit (:mod:`reference.batch`; ``tests/test_batch.py`` and
``tests/test_oracle_pass.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from gemma4_harness.reference.batch import Chain

from ...core.progress import counter
from ...core.engine_kinds import ORACLE
from ...engines.base import Generated
from ...traces.format import Trace, TraceWriter


@dataclass
class PassResult:
    """What :func:`reference_pass` computed.

    Attributes:
        logits: ``(approx, prompt id)`` -> (float64 ``[T, V]`` logits, trace with tensors).
        generations: ``approx`` -> one :class:`harness.engines.base.Generated` per generation prompt, in order.
        cached: prompt id -> ``(prefill, float64 [T, V])``: the prompt's first ``prefill`` tokens in one call, then
            one token per call (the cached-vs-uncached check).
        passes: forward passes over the weights that ran.
    """

    logits: dict[tuple[tuple[str, ...], str], tuple[np.ndarray, Trace]] = field(default_factory=dict)
    generations: dict[tuple[str, ...], list[Generated]] = field(default_factory=dict)
    cached: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    passes: int = 0


def cached_prefill(n: int) -> int:
    """Tokens the cached-vs-uncached check prefills in one call (half, at least one), the rest one at a time."""
    return max(1, n // 2)


def _by_layer(ref: Any, chains: Sequence[Chain], label: str) -> list[list[np.ndarray | None]]:
    """``ref.logits_chains(chains)``, its layers counted on the progress display (:func:`harness.core.progress.counter`:
    a float64 pass on a big model takes minutes)."""
    n = len(getattr(getattr(ref, "cfg", None), "layers", ()) or ())
    with counter(label, n) as layers:
        return ref.logits_chains(chains, on_layer=lambda i, total: layers.step())


def reference_pass(ref: Any, sets: Sequence[tuple[str, ...]], prompts: Sequence[dict[str, Any]],
                   gen_sets: Sequence[tuple[str, ...]], gen_prompts: Sequence[dict[str, Any]], new_tokens: int,
                   top_n: int, cached: bool, numerics: Callable[[tuple[str, ...]], ContextManager],
                   progress: Callable[[str], None] = lambda m: None) -> PassResult:
    """The reference's outputs for every check, in ``max(1, new_tokens)`` passes over the weights (module docstring).

    Args:
        ref: the :class:`harness.engines.reference.ReferenceEngine` (its :meth:`logits_chains`).
        sets: approximation sets whose logits and traces the checks read (``()``: exact).
        prompts: prompt records (``id``, ``prompt_ids``).
        gen_sets: sets whose greedy streams the checks read (each must be in ``sets``).
        gen_prompts: the prompts that have greedy streams (a subset of ``prompts``, in the pairs' order).
        new_tokens, top_n: the streams' length and log-probs kept per step.
        cached: also the cached-vs-uncached logits (exact) of every prompt of two tokens or more.
        numerics: ``approx`` -> the context manager under which the reference makes those approximations.

    Returns:
        :class:`PassResult`.

    Raises:
        ValueError: a generation set not among ``sets``.
    """
    if set(gen_sets) - set(sets):
        raise ValueError(f"greedy streams asked for approximation sets without logits: {set(gen_sets) - set(sets)}")
    out = PassResult()
    full: list[tuple[tuple[str, ...], dict[str, Any], Chain, TraceWriter]] = []
    chains: list[Chain] = []
    for approx in sets:
        for p in prompts:
            w = TraceWriter(ORACLE, p["prompt_ids"], dtype="float64", keep_tensors=True)
            c = Chain([p["prompt_ids"]], traces=[w], numerics=lambda a=approx: numerics(a))
            full.append((approx, p, c, w))
            chains.append(c)
    steps: list[tuple[dict[str, Any], int, Chain]] = []
    if cached:
        for p in prompts:
            ids = list(p["prompt_ids"])
            if len(ids) < 2:
                continue
            k = cached_prefill(len(ids))
            c = Chain([ids[:k]] + [[t] for t in ids[k:]], numerics=lambda: numerics(()))
            steps.append((p, k, c))
            chains.append(c)
    progress(f"reference: pass 1: {len(full)} prompt forwards ({len(sets)} approximation set(s)) and "
             f"{sum(len(c.calls) for _, _, c in steps)} cached-vs-uncached calls, each weight read once")
    got = _by_layer(ref, chains, "reference pass 1: layer")
    out.passes = 1
    for (approx, p, _, w), z in zip(full, got):
        out.logits[(approx, str(p["id"]))] = (z[0], w.trace())
    for (p, k, _), z in zip(steps, got[len(full):]):
        out.cached[str(p["id"])] = (k, np.concatenate(z, axis=0))
    done = {(approx, str(p["id"])): (c, z[0][-1]) for (approx, p, c, _), z in zip(full, got)}
    streams = [(approx, *done[(approx, str(p["id"]))]) for approx in gen_sets for p in gen_prompts]
    gens = [Generated(top_n) for _ in streams]
    last = [z for _, _, z in streams]
    if streams and new_tokens > 1:
        progress(f"reference: greedy steps 2 to {new_tokens} of {len(streams)} stream(s), one pass each")
    with counter("reference greedy steps", max(new_tokens - 1, 0) if streams else 0) as steps_done:
        for step in range(new_tokens):
            for g, z in zip(gens, last):
                g.add(z)
            if step == new_tokens - 1 or not streams:
                break  # the logits after the last token are read by no step
            calls = [Chain([[g.tokens[-1]]], cache=c.cache, numerics=c.numerics)
                     for g, (_, c, _) in zip(gens, streams)]
            last = [z[0][-1] for z in _by_layer(ref, calls, "layer")]
            out.passes += 1
            steps_done.step()
    for approx in gen_sets:
        out.generations[approx] = [g for g, (a, _, _) in zip(gens, streams) if a == approx]
    return out

