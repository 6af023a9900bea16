"""The search of an explanation and its records (:mod:`.explain` says what explaining is): the trial of the engine
against the reference under some variants (:class:`Trial`), the search over the catalogue's variants, singles then
pairs, within a budget (:func:`search`), what it found (:class:`Explanation`), and how a subject's figures are
judged (:func:`judge_figures`). A subject (:class:`.explain.TextSubject`, :mod:`.explain_mm`'s) supplies
``measure``; nothing here runs a model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core.gates import Gate
from ..core.engine_kinds import ORACLE
from ..engines.variants import Variant, conflict
from ..traces.format import Trace
from .result import Figure, judged


DEFAULT_BUDGET_S = 60.0
"""Seconds explaining one failing pair may take by default (``--explain-budget``; 0 turns explaining off)."""

PAIR_SEEDS = 4
"""Singles carried into the pair search (the ones that got furthest)."""

REFINE_RATIO = 1e-4
"""A single variant that explains a divergence but leaves a residual above this fraction of the unexplained one
(far above rounding: the engine is one variant off, then within the gates but still off) is tried in pairs, and a
pair that cuts the residual tenfold is the answer (llama.cpp's fp16 GELU table beside a formula fault, say)."""

MAX_PROMPTS = 3
"""Failing prompts an explanation must hold on (the shortest ones: cheapest first)."""

METRICS = ("local_median", "max_abs_logit", "max_abs_logprob", "layer_rel_l2")
"""The headline figure of a trial, the first the subject measures: the re-seeded per-layer median where the pair is
judged by it (an engine rounding its activations on a quantized file: ``<pair>_q8.local_median``), else max |Δlogit|,
else max |Δ log-prob| (greedy streams), else the worst relative L2 over the trace points."""

LABELS = {"local_median": "median rel. L2 re-seeded", "max_abs_logit": "max |Δlogit|",
          "max_abs_logprob": "max |Δlogprob|", "layer_rel_l2": "worst rel. L2"}


def budget_seconds(value: float | None = None) -> float:
    """The explaining budget: ``value`` (``--explain-budget``), else :data:`DEFAULT_BUDGET_S`.

    Raises:
        InputError: a negative or non-numeric budget.
    """
    raw = value if value is not None else DEFAULT_BUDGET_S
    try:
        out = float(raw)
    except (TypeError, ValueError):
        raise InputError(f"--explain-budget {raw!r}: expected a number of seconds >= 0") from None
    if not out >= 0:
        raise InputError(f"--explain-budget {raw!r}: expected a number of seconds >= 0")
    return out


@dataclass
class Trial:
    """The engine judged against the reference under ``variants`` (names; empty: the reference as it is).

    Attributes:
        passed: every gating figure passed on every prompt tried.
        figures: the headline figure (:data:`METRICS`) -> its largest value over the prompts tried.
        first_divergence: the engine's first diverging trace point against this reference (``attn_out@3``), or
            ``logits@position N`` without a trace, or None where nothing diverges.
        first_key: :func:`harness.traces.format.canonical_key` of the first diverging point (ordering), or None.
        failing: the gates that failed.
        prompts: the prompts evaluated (a failing trial stops at the first prompt that fails).
        seconds: what the trial took.
        error: why the reference could not run under these variants (one line), or None.
        unmeasured: ``metric on prompt`` (with why) for each figure measured without the variants that could not be
            measured under them (it fails the trial: a figure it cannot compute is not a zero).
        oracle: what computed the oracle side (``reference``, or ``fast`` under ``--oracle fast``).
    """

    variants: tuple[str, ...]
    passed: bool = False
    figures: dict[str, float] = field(default_factory=dict)
    first_divergence: str | None = None
    first_key: tuple[int, int, int] | None = None
    failing: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    unmeasured: list[str] = field(default_factory=list)
    oracle: str = ORACLE

    def headline(self) -> tuple[str, float] | None:
        """``(metric, value)`` of the first of :data:`METRICS` measured."""
        m = next((m for m in METRICS if m in self.figures), None)
        return None if m is None else (m, self.figures[m])

    def as_dict(self) -> dict[str, Any]:
        return {"variants": list(self.variants), "passed": self.passed, "figures": self.figures,
                "first_divergence": self.first_divergence, "failing": self.failing, "prompts": self.prompts,
                "seconds": round(self.seconds, 4), "oracle": self.oracle,
                **({"error": self.error} if self.error else {}),
                **({"unmeasured": self.unmeasured} if self.unmeasured else {})}


@dataclass
class Explanation:
    """What :func:`search` found (``status``: ``explained``, ``unexplained``, ``nothing_to_explain``, ``decoding``
    (the divergence is in generation, not in the logits: :attr:`decoding` says where and what), or ``not_run`` when
    the comparison without variants could not be made)."""

    status: str
    baseline: Trial
    explained_by: list[Trial] = field(default_factory=list)
    candidates: list[Trial] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # variant -> its first source (the rule's own)
    first_point: str | None = None
    singles: int = 0
    pairs: int = 0
    not_applicable: dict[str, str] = field(default_factory=dict)
    not_tried: list[str] = field(default_factory=list)
    seconds: float = 0.0
    budget_s: float = DEFAULT_BUDGET_S
    decoding: dict[str, Any] | None = None

    def _fig(self, t: Trial) -> str:
        h = t.headline()
        if h is None:
            why = f"; {t.unmeasured[0]}" if t.unmeasured else ""
            return f"first divergence {self.baseline.first_divergence} -> {t.first_divergence or 'none'}{why}"
        if h[0] not in self.baseline.figures:  # never a figure against another metric's, nor a 0 for none
            return f"{LABELS[h[0]]} not measured ({self.baseline.first_divergence or 'no figure'}) -> {h[1]:.3g}"
        return f"{LABELS[h[0]]} {self.baseline.figures[h[0]]:.3g} -> {h[1]:.3g}"

    def line(self) -> str:
        """The one line a user acts on."""
        if self.status == "decoding" and self.decoding is not None:
            return f"in {self.decoding.get('kind', 'decoding')}, not in the logits: {self.decoding['line']}"
        if self.status == "nothing_to_explain":
            return "nothing to explain: the engine agrees with the reference on these prompts"
        if self.status == "not_run":
            return f"not explained: the comparison itself failed ({self.baseline.error})"
        if self.status == "explained":
            best = self.explained_by[0]
            name = " + ".join(best.variants)
            srcs = "; ".join(f"{v}: {self.sources[v]}" if len(best.variants) > 1 else self.sources[v]
                             for v in best.variants if v in self.sources)
            more = [" + ".join(t.variants) for t in self.explained_by[1:]]
            also = f"; also consistent: {', '.join(more)}" if more else ""
            return f"explained by {name}: {self._fig(best)} ({srcs}; docs/spec-variants.md){also}"
        closest = ", ".join(f"{' + '.join(t.variants)} ({self._fig(t)})" for t in self.candidates[:3])
        left = f"; {len(self.not_tried)} not tried within the {self.budget_s:g} s budget" if self.not_tried else ""
        return ("no known variant explains it" + (f"; closest: {closest}" if closest else "")
                + f" ({self.singles} variants, {self.pairs} pairs tried{left})")

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "line": self.line(), "baseline": self.baseline.as_dict(),
                "explained_by": [t.as_dict() for t in self.explained_by],
                "candidates": [t.as_dict() for t in self.candidates[:5]], "first_point": self.first_point,
                "singles_tried": self.singles, "pairs_tried": self.pairs, "not_applicable": self.not_applicable,
                "not_tried": self.not_tried, "seconds": round(self.seconds, 3), "budget_s": self.budget_s,
                **({"decoding": self.decoding} if self.decoding is not None else {})}


# --------------------------------------------------------------------------- the search


def _order(candidates: Sequence[tuple[Variant, tuple[str, int]]], first: tuple[str, int] | None
           ) -> list[tuple[Variant, bool]]:
    """Candidates in trial order with whether each is in scope: same point as ``first`` (nearest layer first,
    a variant predicted after the divergence last among them), then the rest in catalogue order."""
    if first is None:
        return [(v, True) for v, _ in candidates]
    scoped = [(v, w) for v, w in candidates if w[0] == first[0]]
    scoped.sort(key=lambda vw: (vw[1][1] > first[1], abs(vw[1][1] - first[1])))
    names = {v.name for v, _ in scoped}
    return [(v, True) for v, _ in scoped] + [(v, False) for v, _ in candidates if v.name not in names]


def _progress(t: Trial) -> tuple:
    """Sort key: the trials that got furthest first (more prompts passed, shortest first; then on the prompt that
    failed, no trace point diverging or the latest first divergence), then the smallest headline residual; trials
    whose reference could not run last."""
    h = t.headline()
    passed = len(t.prompts) - (1 if t.failing else 0)
    depth = (1,) if t.first_key is None else (0, *t.first_key)
    return (t.error is not None, -passed, tuple(-x for x in depth), h[1] if h else float("inf"))


def search(measure: Callable[[tuple[Variant, ...]], Trial], variants: Iterable[Variant], subject: Any,
           budget_s: float = DEFAULT_BUDGET_S, baseline: Trial | None = None) -> Explanation:
    """Find the variant (or pair of variants) under which the reference agrees with the engine (module docstring).

    Args:
        measure: the subject's ``measure``: ``(variants, full=False) -> Trial`` (``full``: every prompt, not only up
            to the first that fails; asked for the baseline).
        variants: the candidates (a family of the catalogue); those that cannot change anything on ``subject``
            (its config) are left out and listed.
        subject: what :meth:`Variant.first_point` is asked about (a model config, a drafter config).
        budget_s: seconds allowed, the baseline's included (the baseline always runs; what the budget leaves untried
            is listed in :attr:`Explanation.not_tried`).
        baseline: the trial without variants, when already measured.
    """
    t0 = time.perf_counter()
    base = baseline or measure((), full=True)
    out = Explanation("nothing_to_explain", base, budget_s=budget_s)
    if base.error is not None:
        out.status = "not_run"
    if base.passed or base.error is not None:
        out.seconds = time.perf_counter() - t0
        return out
    applicable = []
    for v in variants:
        why = v.why_not(subject)
        if why is None:
            applicable.append((v, v.where(subject)))
        else:
            out.not_applicable[v.name] = why
    first = _parse_point(base.first_divergence)
    out.first_point = base.first_divergence
    ordered = _order(applicable, first)
    singles: dict[str, Trial] = {}

    def over() -> bool:
        return time.perf_counter() - t0 > budget_s

    for v, _ in ordered:
        if over():
            out.not_tried.append(v.name)
            continue
        singles[v.name] = measure((v,))
        out.singles += 1
    out.explained_by = [t for t in singles.values() if t.passed]
    by_name = {v.name: v for v, _ in applicable}
    if out.explained_by:
        refined = _refine(measure, out, by_name, over)
        if refined is not None:
            out.explained_by.insert(0, refined)
    if not out.explained_by:
        seeds = sorted((t for t in singles.values() if t.error is None), key=_progress)[:PAIR_SEEDS]
        tried: set[frozenset[str]] = set()
        pairs: list[Trial] = []
        for s in seeds:
            a = by_name[s.variants[0]]
            partners = _order([(v, w) for v, w in applicable if not conflict(a, v)], _parse_point(s.first_divergence))
            for b, _ in partners:
                key = frozenset((a.name, b.name))
                if key in tried:
                    continue
                if over():
                    out.not_tried.append(f"{a.name} + {b.name}")
                    continue
                tried.add(key)
                t = measure((a, b))
                out.pairs += 1
                pairs.append(t)
                if t.passed:
                    break
            if any(t.passed for t in pairs):
                break
        out.explained_by = [t for t in pairs if t.passed]
        out.candidates = sorted([*singles.values(), *pairs], key=_progress)
    else:
        out.candidates = sorted(singles.values(), key=_progress)
    out.status = "explained" if out.explained_by else "unexplained"
    names = {n for t in [*out.explained_by, *out.candidates[:3]] for n in t.variants}
    out.sources = {v.name: v.sources[0].short() for v, _ in applicable if v.name in names}
    out.seconds = time.perf_counter() - t0
    return out


def _refine(measure, out: Explanation, by_name: dict[str, Variant], over: Callable[[], bool]) -> Trial | None:
    """The pair of the best explaining single and another variant that cuts its residual tenfold, when the single
    leaves more than :data:`REFINE_RATIO` of the unexplained residual (see there); None otherwise."""
    best = min(out.explained_by, key=lambda t: t.headline()[1] if t.headline() else float("inf"))
    h = best.headline()
    if h is None or h[0] not in out.baseline.figures or not h[1] > REFINE_RATIO * out.baseline.figures[h[0]]:
        return None
    a = by_name[best.variants[0]]
    for v in by_name.values():
        if conflict(a, v):
            continue
        if over():
            out.not_tried.append(f"{a.name} + {v.name}")
            continue
        t = measure((a, v))
        out.pairs += 1
        ht = t.headline()
        if t.passed and ht is not None and ht[1] <= h[1] / 10:
            return t
    return None


def _parse_point(where: str | None) -> tuple[str, int] | None:
    """``attn_out@3`` -> ``("attn_out", 3)``; ``result_output`` -> ``("result_output", -1)``; a logits position, a
    greedy stream's place or None -> None (no scope)."""
    if not where or where.startswith(("logits", "greedy")):
        return None
    point, _, layer = where.partition("@")
    try:
        return point, int(layer) if layer else -1
    except ValueError:
        return None


# --------------------------------------------------------------------------- what a subject judges


@dataclass
class Observed:
    """What the engine answered on one prompt: logits ``[T, V]``, a trace, and/or a greedy stream (``tokens``,
    ``top``, ``logprobs`` as :func:`harness.parity.compare.load_generations` gives it), any of them None; ``forced``:
    its logits ``[T + n - 1, V]`` of the prompt followed by its own stream but the last token (teacher-forced: what
    its forward gives at every step of the stream, asked when only the streams fail), or None."""

    prompt_id: str
    ids: list[int]
    logits: np.ndarray | None = None
    trace: Trace | None = None
    stream: dict[str, Any] | None = None
    forced: np.ndarray | None = None


def unmeasured(f: Figure) -> str | None:
    """Why ``f`` measured nothing (its ``not_measured`` reason, or "NaN"), or None when it holds a figure."""
    if f.detail.get("not_measured"):
        return str(f.detail["not_measured"])
    return "NaN" if not f.measured == f.measured else None


def judge_figures(figures: Sequence[Figure], gates: Mapping[str, Gate]) -> list[str]:
    """The gates (by name) that ``figures`` fail, judged by :func:`harness.parity.result.judged`, the rule of
    :meth:`~harness.parity.result.CaseResult.apply`; informational gates, informational figures, figures marked
    ``not_measured`` (never a pass there either: :class:`TextSubject` holds a variant to the figures measured without
    it) and figures without a gate do not count."""
    bad = []
    for f in figures:
        try:
            g, measured, _ = judged(f, gates)
        except KeyError:
            continue
        if not g.informational and not g.check(measured):
            bad.append(f.gate)
    return bad
