"""Explaining a divergence on multimodal prompts and of an MTP drafter (:mod:`harness.parity.explain` for the text
decoder; the catalogue is :mod:`harness.engines.variants`).

* Multimodal: the soft tokens (the encoders' output) are computed once and held fixed (:class:`MMReference`): the
  multimodal variants are about what happens to them in the decoder (the merge, the PLE row of placeholders, the
  image mask), so every trial is one decoder forward. The candidates are the multimodal variants, then the text
  decoder's (a text fault shows on a multimodal prompt too).
* Drafter: one draft round per prompt (:func:`reference.drafter.after_prefill`, :func:`reference.drafter.draft`);
  the engine's step logits are compared while its drafted tokens agree with the reference's, by the gate of
  llama.cpp's drafter against the reference (``drafter.reference~llamacpp.max_abs``, for any fp32 drafter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

import gemma4_harness.reference.drafter as rd
import gemma4_harness.reference.model as rm
from gemma4_harness.reference.errors import InputError

from ..core.gates import DEFAULT_GATES, Gate
from ..engines.variants import Variant, family, under
from .explain import TextSubject
from .explain_search import DEFAULT_BUDGET_S, Explanation, Observed, Trial, budget_seconds, search

DRAFTER_GATE = "drafter.reference~llamacpp.max_abs"
"""The gate a drafter engine's step logits are judged by (an fp32 drafter against the float64 reference)."""


class MMReference:
    """The reference decoder on multimodal prompts with fixed soft tokens: ``logits(ids, trace)`` looks the prompt's
    :class:`reference.multimodal.Injection` up by its ids (what :class:`~harness.parity.explain.TextSubject` calls).

    Args:
        cfg, W: the model's text config and weights.
        injections: prompt ids (a tuple) -> the prompt's soft tokens and token types.
    """

    def __init__(self, cfg: Any, W: Any, injections: Mapping[tuple[int, ...], Any]) -> None:
        self.cfg, self.W, self.injections = cfg, W, dict(injections)

    def logits(self, ids: Sequence[int], trace: Any = None) -> np.ndarray:
        """float64 ``[T, V]``: :func:`reference.model.forward` with the prompt's soft tokens."""
        return rm.forward(self.cfg, self.W, list(ids), trace=trace, mm=self.injections[tuple(ids)])

    @classmethod
    def from_prompts(cls, mm: Any, prompts: Sequence[Any], embeds: Sequence[Sequence[np.ndarray]]) -> "MMReference":
        """From a :class:`reference.mm_model.MultimodalModel`, its prepared prompts and each prompt's soft tokens
        (:meth:`harness.engines.mm.ReferenceMM.soft_tokens`)."""
        inj = {tuple(p.ids): p.injection(np.concatenate([np.asarray(e) for e in rows], axis=0))
               for p, rows in zip(prompts, embeds)}
        return cls(mm.cfg, mm.W, inj)


def explain_mm(ref: MMReference, observed: Sequence[Observed], pair: str = "reference~fast",
               gates: Mapping[str, Gate] = DEFAULT_GATES, budget_s: float | None = None,
               variants: Sequence[Variant] | None = None) -> Explanation:
    """:func:`~harness.parity.explain_search.search` for an engine's logits (and trace) on multimodal prompts, over the
    multimodal variants then the text decoder's (or ``variants``)."""
    subject = TextSubject(ref, observed, pair, gates)
    cands = (*family("multimodal"), *family("text")) if variants is None else tuple(variants)
    return search(subject.measure, cands, ref.cfg, budget_seconds(budget_s))


@dataclass
class DraftObserved:
    """What a drafter engine answered on one prompt: the logits ``[V]`` of each step of one draft round and the
    tokens it drafted."""

    prompt_id: str
    ids: list[int]
    logits: list[np.ndarray]
    tokens: list[int]


class DrafterSubject:
    """A drafter engine's draft rounds, judged by :data:`DRAFTER_GATE` (or ``limit``).

    Args:
        d, DW: the drafter (bound to the target: :func:`reference.drafter.bind`) and its weights.
        target, TW: the target's config and weights.
        observed: the engine's rounds, shortest prompt first.
    """

    family = "drafter"

    def __init__(self, d: Any, DW: Any, target: Any, TW: Any, observed: Sequence[DraftObserved],
                 limit: float | None = None) -> None:
        self.d, self.DW, self.target, self.TW = d, DW, target, TW
        self.observed = sorted(observed, key=lambda o: len(o.ids))
        self.limit = DEFAULT_GATES[DRAFTER_GATE].limit if limit is None else limit
        self.subject = d

    def measure(self, variants: tuple[Variant, ...], full: bool = False) -> Trial:
        """The engine's step logits against the reference drafter's under ``variants``, while the drafted tokens
        agree (the first step always)."""
        t = Trial(tuple(v.name for v in variants))
        t0 = time.perf_counter()
        try:
            with under(variants, fast=False):
                for o in self.observed:
                    cache, tok, h = rd.after_prefill(self.target, self.TW, o.ids)
                    toks, logits, _ = rd.draft(self.d, self.DW, self.target, self.TW, cache, tok, h, len(o.logits))
                    worst, step = 0.0, 0
                    for step, (a, b) in enumerate(zip(o.logits, logits)):
                        worst = max(worst, float(np.max(np.abs(np.asarray(a, dtype=np.float64) - b))))
                        if step >= len(o.tokens) or o.tokens[step] != toks[step]:
                            break
                    t.prompts.append(o.prompt_id)
                    t.figures["max_abs_logit"] = max(t.figures.get("max_abs_logit", 0.0), worst)
                    if not worst <= self.limit:
                        t.failing = [DRAFTER_GATE]
                        if t.first_divergence is None:
                            t.first_divergence = f"logits@draft step {step} of prompt {o.prompt_id}"
                        if not full:
                            break
        except (InputError, ValueError) as e:
            t.error, t.failing = str(e).splitlines()[0], ["(reference could not run)"]
        t.passed = not t.failing
        t.seconds = time.perf_counter() - t0
        return t


def explain_drafter(d: Any, DW: Any, target: Any, TW: Any, observed: Sequence[DraftObserved],
                    budget_s: float | None = None, limit: float | None = None,
                    variants: Sequence[Variant] | None = None) -> Explanation:
    """:func:`~harness.parity.explain_search.search` over the drafter variants (or ``variants``) for a drafter engine's
    rounds."""
    subject = DrafterSubject(d, DW, target, TW, observed, limit)
    return search(subject.measure, family("drafter") if variants is None else variants, d,
                  budget_seconds(budget_s) if budget_s is not None else DEFAULT_BUDGET_S)
