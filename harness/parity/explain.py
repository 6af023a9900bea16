"""Explaining a divergence: re-run the reference under the known spec variants and name the one that makes a failing
engine agree (``docs/design.md``, "Explaining a divergence"; the catalogue is :mod:`harness.engines.variants`).

A *subject* is what the engine under test answered, kept: logits, trace files or greedy streams of a few prompts
(:class:`TextSubject`; the multimodal merge and the MTP drafter have their own in :mod:`.explain_mm`). Its
``measure(variants)`` computes the reference under those variants on the same prompts and judges the engine's answers
with the failing pair's own gates: a :class:`Trial`. :func:`search` then tries

1. the variants that apply to the model (:meth:`~harness.engines.variants.Variant.why_not`), those whose first trace
   point is the engine's first diverging point (same point, nearest layer) first, then the rest: the scope. Each
   trial runs the shortest prompt first and stops at the first prompt the engine still fails, so a variant that
   does not explain costs one short forward (cheapest first);
2. when no single variant explains it, pairs: each of the :data:`PAIR_SEEDS` singles that got furthest (the first
   divergence moved latest, then the smallest residual) with every variant it can be combined with (another rule),
   those in scope of the point where the engine now first diverges first;

all within a time budget (``--explain-budget``, :data:`DEFAULT_BUDGET_S`; what the budget left untried is listed).
The answer (:class:`Explanation`) is "explained by V: max |Δlogit| A -> B (sources ...)", or "no known variant
explains it" with the best candidates and their figures.

An explanation is a claim, held to one: a variant explains only when the engine's figures under it pass the pair's own
gates (the case's table, the effect of the engine's declared approximations, the pair's near-tie margin) with the
job's oracle (``--oracle fast``: the fast twin under the variants that have a fast form, the reference under the
others), AND every figure measured without the variant is measured under it: a figure it cannot compute (NaN, "not
measured": greedy streams that part at step 0) is never a 0, and a trial that measures nothing explains nothing.
A divergence only in generation (the engine's own logits agree with the reference's at every step of its stream, its
greedy stream parts from the reference's) is not searched: it is said to be in decoding, with the request, the step
and what differs there (:meth:`TextSubject.decoding`). An engine that gives no logits (a server) is judged by the
top-N log-probs along its stream: those agreeing with the reference's up to the parting step and, there, on every
token no decoding rule touches, the oracle's token lowered, missing or passed over is decoding too. A stream that is
the oracle's token for token while its log-probs are not is decoding when, at every step, they are the oracle's up to
one shift of the normaliser on the untouched tokens and what moved it is in sight (tokens lowered) or is one token
whose probability, taken out, gives that shift at every step (a ban): :func:`decoding_by_shift`.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core.gates import DEFAULT_GATES, Gate, effect_limit, gate_for, with_effect
from ..engines.fast import FastEngine
from ..engines.variants import Variant, conflict, family, under
from ..traces.compare import DivergenceRule, compare
from ..traces.format import Trace, TraceWriter, canonical_key
from .compare import generation_figures, logit_figures
from .result import Figure

DEFAULT_BUDGET_S = 60.0
"""Seconds explaining one failing pair may take by default (``--explain-budget``; 0 turns explaining off)."""

BUDGET_ENV = "G4H_EXPLAIN_BUDGET"
"""Environment variable holding ``g4h parity --explain-budget`` for the parity job's worker processes."""

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

LOCAL_JUDGED = ("judged by local_median: the engine rounds its activations (quantized_activations) and an int8 "
                "rounding flip carries from layer to layer (harness/parity/checks/pair.py, local_figure)")
"""Why the plain logit and layer figures of a trial are informational where the pair is judged by local_median."""


@dataclass(frozen=True)
class LocalJudge:
    """How a pair judged by ``<pair>_q8.local_median`` judges a trial (given by the pair's checks, which this module
    does not import): ``errors`` maps an answer with a trace to its per-point errors against the reference re-seeded
    from it (:meth:`harness.parity.checks.pair.ReferenceRuns.local_errors`; None where it cannot be computed),
    ``pool`` maps ``(pair, per-prompt figures holding "_errors")`` to the pooled figure
    (:func:`harness.parity.checks.pair.local_figure`: the median per point, its limit, its first point beyond it)."""

    errors: Callable[["Observed"], dict | None]
    pool: Callable[[str, Sequence[Figure]], Figure]

GENERATION_PATH = "in its generation path"
"""How :meth:`TextSubject.decoding` starts ``what`` when the engine's generation computes other logits than its forward
(the explanation's ``kind`` is then ``generation``, its line "in generation, not in the logits: ...")."""

GENERATION_METRICS = ("greedy", "max_abs_logprob")
"""The metrics of greedy streams (:func:`harness.parity.compare.generation_figures`): a pair that fails only these
while its logits agree diverges in decoding (:meth:`TextSubject.decoding`)."""


def budget_seconds(value: float | None = None) -> float:
    """The explaining budget: ``value``, else :data:`BUDGET_ENV`, else :data:`DEFAULT_BUDGET_S`.

    Raises:
        InputError: a negative or non-numeric budget.
    """
    raw = value if value is not None else os.environ.get(BUDGET_ENV, DEFAULT_BUDGET_S)
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
    oracle: str = "reference"

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


# --------------------------------------------------------------------------- the text decoder


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
    """The gates (by name) that ``figures`` fail, judged as :meth:`harness.parity.result.CaseResult.apply` judges
    them (a figure with an ``effect`` at :func:`harness.core.gates.with_effect` of its gate); informational gates,
    informational figures, figures marked ``not_measured`` (never a pass there either: :class:`TextSubject` holds a
    variant to the figures measured without it) and figures without a gate do not count."""
    bad = []
    for f in figures:
        try:
            g = gate_for(gates, f.gate)
        except KeyError:
            continue
        if "informational_reason" in f.detail or f.detail.get("not_measured"):
            continue
        if f.detail.get("effect") is not None and not g.informational:
            g = with_effect(g, float(f.detail["effect"]), int(f.detail.get("effect_power", 1)))
        if not g.informational and not g.check(f.measured):
            bad.append(f.gate)
    return bad


def _metric(f: Figure) -> str:
    return f.gate.rsplit(".", 1)[-1]


class TextSubject:
    """The engine's answers on a few prompts of a text model, judged as the pair ``pair`` judges them.

    Args:
        ref: the reference engine of the model (:class:`harness.engines.reference.ReferenceEngine`).
        observed: the engine's answers, shortest prompt first (:class:`Observed`).
        pair: the gate prefix (``reference~cmd``, ``fast~cmd``, ``engine~oracle`` ...).
        gates: the gate table (the case's, or :data:`harness.core.gates.DEFAULT_GATES`).
        numerics: the context under which the reference makes the approximations the engine declared (a
            ``ReferenceRuns.numerics`` result maker), or None.
        top_n: vLLM's N for greedy streams.
        layer_tol: the trace divergence tolerance (default: the pair's ``layer_rel_l2`` limit).
        effects: ``(metric, prompt id or None) -> (effect, power)``: how far the engine's declared approximations
            move the oracle's figure (the pair's figures' ``effect``), so that a trial is judged at the pair's limits.
        near_tie: the pair's near-tie margin of greedy streams (default
            :data:`harness.core.gates.NEAR_TIE_MARGIN`).
        oracle: the job's oracle when it is not the reference (``--oracle fast``: the fast engine in fp32): the
            baseline runs on it, a trial under variants that all have a fast form on a fast engine built under them
            over the reference's weights, any other on the float64 reference (slower, the same rule).
        local: where the pair is judged by ``<pair>_q8.local_median`` (an engine that rounds its activations, on a
            quantized file): its :class:`LocalJudge` (the errors computed under the numerics and the trial's
            variants). A trial is then judged as the pair is: the median pooled over the prompts tried gates, its
            first point beyond the limit is the first divergence, and the plain logit and layer figures are
            informational (:data:`LOCAL_JUDGED`).
    """

    family = "text"

    def __init__(self, ref: Any, observed: Sequence[Observed], pair: str, gates: Mapping[str, Gate] = DEFAULT_GATES,
                 numerics: Callable[[], Any] | None = None, top_n: int = 5, layer_tol: float | None = None,
                 effects: Mapping[tuple[str, str | None], tuple[float, int]] | None = None,
                 near_tie: float | None = None, oracle: Any = None,
                 local: LocalJudge | None = None) -> None:
        self.ref, self.pair, self.gates, self.top_n = ref, pair, gates, top_n
        self.local = local
        self.observed = sorted(observed, key=lambda o: len(o.ids))
        self.numerics = numerics
        lim = gates.get(f"{pair}.layer_rel_l2")
        self.layer_tol = layer_tol if layer_tol is not None else (lim.limit if lim is not None else 1e-3)
        self.subject = ref.cfg
        self.effects = dict(effects or {})
        self.near_tie = near_tie
        self.oracle = oracle
        self.measured: dict[str, set[str]] | None = None  # prompt -> the metrics measured without variants
        self.measured_local = False  # the trial without variants measured local_median
        self.ref_streams: dict[str, dict[str, Any]] = {}  # prompt -> the oracle's stream without variants

    @contextlib.contextmanager
    def _engine(self, variants: Sequence[Variant]):
        """``(engine, name)`` computing the oracle side under ``variants`` (see the class docstring)."""
        with contextlib.ExitStack() as stack:
            if self.numerics is not None:
                stack.enter_context(self.numerics())
            if self.oracle is not None and not variants:
                yield self.oracle, "fast"
            elif self.oracle is not None and all(v.has_fast for v in variants) and \
                    (eng := self._fast_under(variants, stack)) is not None:
                try:
                    yield eng, "fast"
                finally:
                    eng.close()
            else:
                stack.enter_context(under(variants, fast=False))
                yield self.ref, "reference"

    def _fast_under(self, variants: Sequence[Variant], stack: contextlib.ExitStack) -> Any:
        """A fast engine under ``variants`` (entered on ``stack``): the oracle's own model when every patch acts at
        call time, a model built over the reference's weights when one changes the config (``FastModel.__init__``);
        None when that cannot be built (memory: the trial then runs on the reference)."""
        builds = any(p.name == "__init__" for v in variants for p in v.fast_patches)
        with contextlib.ExitStack() as local:
            local.enter_context(under(variants, fast=True))
            try:
                eng = FastEngine.from_model(self.ref.cfg, self.ref.weights, device=str(self.oracle.model.device),
                                            dtype="float32", weights=self.oracle.weights,
                                            share=None if builds else self.oracle)
            except InputError:
                return None  # the variants are undone as ``local`` closes
            stack.enter_context(local.pop_all())
            return eng

    def _effect(self, f: Figure, prompt_id: str) -> Figure:
        e = self.effects.get((_metric(f), prompt_id), self.effects.get((_metric(f), None)))
        if e is not None and f.detail.get("effect") is None:
            f.detail.update(effect=float(e[0]), effect_power=int(e[1]))
        return f

    def _one(self, eng: Any, o: Observed, t: Trial, local: list[Figure] | None = None) -> list[Figure]:
        figs: list[Figure] = []
        errors = self.local.errors(o) if self.local is not None and o.trace is not None and local is not None else None
        if errors:  # judged by the re-seeded median, pooled over the prompts by measure()
            local.append(Figure(f"{self.pair}_q8.local_median", float("nan"), o.prompt_id, {"_errors": errors}))
        if o.logits is not None or o.trace is not None:
            w = TraceWriter(t.oracle, o.ids, dtype="float64", keep_tensors=True) if o.trace is not None else None
            z = np.asarray(eng.logits(o.ids, trace=w), dtype=np.float64)
            if o.logits is not None:
                figs += logit_figures(o.logits, z, self.pair, o.prompt_id)
                beyond = np.nonzero(~(np.max(np.abs(o.logits - z), axis=1) <= self._limit("max_abs_logit")))[0]
                if beyond.size and t.first_divergence is None:
                    t.first_divergence = f"logits@position {int(beyond[0])}"
            if o.trace is not None:
                res = compare(o.trace, w.trace(), DivergenceRule(tol=self.layer_tol))
                errs = [r.err for r in res.rows if r.err == r.err]
                figs.append(Figure(f"{self.pair}.layer_rel_l2", max(errs) if errs else float("nan"), o.prompt_id))
                if res.first is not None and t.first_key is None and not errors:
                    t.first_divergence = res.first.where
                    t.first_key = canonical_key(res.first.point, res.first.layer)
            if errors:
                for f in figs:
                    f.detail["informational_reason"] = LOCAL_JUDGED
        if o.stream is not None:
            g = eng.generate_full([o.ids], len(o.stream["tokens"]), top_n=self.top_n)[0]
            base = {o.prompt_id: {"tokens": list(g.tokens), "top": [[i for i, _ in s] for s in g.top],
                                  "logprobs": [dict(s) for s in g.top]}}
            if not t.variants:
                self.ref_streams[o.prompt_id] = base[o.prompt_id]
            limit = self._logprob_limit(o.prompt_id)
            gen = generation_figures({o.prompt_id: o.stream}, base, self.pair, self.top_n, logprob_limit=limit,
                                     **({"near_tie": self.near_tie} if self.near_tie is not None else {}))
            figs += gen
            if t.first_divergence is None and gen and gen[0].detail.get("first_divergence"):
                t.first_divergence = f"greedy {gen[0].detail['first_divergence']}"  # no trace point: no scope
        return [self._effect(f, o.prompt_id) for f in figs]

    def _judge_local(self, t: Trial, local: list[Figure], under_variants: bool) -> None:
        """The trial's ``local_median`` (pooled over the prompts it tried) into ``t``: its value, its first point
        beyond the limit as the first divergence, a failure when beyond; under variants, a failure when the trial
        without them measured it and this one cannot (never a pass for what is not computed)."""
        if not local:
            if under_variants and self.measured_local:
                t.unmeasured.append("local_median not measured (the reference could not be re-seeded)")
                if "(figures not measured)" not in t.failing:
                    t.failing.append("(figures not measured)")
            return
        f = self.local.pool(self.pair, local)
        if not under_variants:
            self.measured_local = True
        t.figures["local_median"] = float(f.measured)
        where = f.detail.get("first_divergence")
        if where:
            point, layer = where.rsplit("@", 1)
            t.first_divergence, t.first_key = where, canonical_key(point, int(layer))
        t.failing += [g for g in judge_figures([f], self.gates) if g not in t.failing]

    def _logprob_limit(self, prompt_id: str) -> float | None:
        """The pair's ``max_abs_logprob`` limit on ``prompt_id``, with the effect of the declared approximations
        there (None when the pair has no such gate)."""
        lim = self.gates.get(f"{self.pair}.max_abs_logprob")
        e = self.effects.get(("max_abs_logprob", prompt_id), self.effects.get(("max_abs_logprob", None)))
        return None if lim is None else (lim.limit if e is None else effect_limit(lim, float(e[0]), int(e[1])))

    def _limit(self, metric: str) -> float:
        g = self.gates.get(f"{self.pair}.{metric}")
        return g.limit if g is not None else float("inf")

    def measure(self, variants: tuple[Variant, ...], full: bool = False) -> Trial:
        """The engine against the oracle under ``variants``, prompt by prompt, shortest first, stopping at the
        first prompt whose figures fail unless ``full`` (see the module docstring). The first trial without variants
        records which figures it measured on each prompt; a trial under variants that cannot measure one of them
        (NaN, ``not_measured``) fails, and so does one that measures none of :data:`METRICS` on a prompt (greedy
        streams that agree by vLLM's rule but part at step 0 compare no number: that reproduces nothing)."""
        t = Trial(tuple(v.name for v in variants))
        t0 = time.perf_counter()
        local: list[Figure] = []
        try:
            with self._engine(variants) as (eng, name):
                t.oracle = name
                for o in self.observed:
                    figs = self._one(eng, o, t, local)
                    t.prompts.append(o.prompt_id)
                    got: set[str] = set()
                    why_not: dict[str, str] = {}
                    for f in figs:
                        m, why = _metric(f), unmeasured(f)
                        if why is None:
                            got.add(m)
                            if m in METRICS:
                                t.figures[m] = max(t.figures.get(m, 0.0), float(f.measured))
                        else:
                            why_not[m] = why
                    t.failing += [g for g in judge_figures(figs, self.gates) if g not in t.failing]
                    if not variants:
                        self.measured = {**(self.measured or {}), o.prompt_id: got}
                    else:  # held to what was measured without the variants: never a 0 for what it cannot compute
                        lost = sorted((self.measured or {}).get(o.prompt_id, set()) - got)
                        t.unmeasured += [f"{m} not measured on {o.prompt_id}" + (f" ({why_not[m]})" if m in why_not
                                                                                  else "") for m in lost]
                        for bad, when in (("(figures not measured)", lost),
                                          ("(nothing comparable measured)", not got & set(METRICS))):
                            if when and bad not in t.failing:
                                t.failing.append(bad)
                    if t.failing and not full:
                        break
                if self.local is not None:
                    self._judge_local(t, local, bool(variants))
        except InputError as e:  # the variant cannot run on this model (one line)
            t.error = str(e).splitlines()[0]
            t.failing = ["(reference could not run)"]
        t.passed = not t.failing
        if t.passed:
            t.first_divergence, t.first_key = None, None
        t.seconds = time.perf_counter() - t0
        return t

    def decoding(self, base: Trial) -> dict[str, Any] | None:
        """Where the divergence is in generation, not in the logits, and what differs there; None otherwise.

        It is when ``base`` (the trial without variants) fails only greedy-stream gates
        (:data:`GENERATION_METRICS`) and, on the first prompt whose stream parts from the oracle's, the engine's own
        teacher-forced logits (:attr:`Observed.forced`) agree with the oracle's at every step of its stream (within
        the pair's ``max_abs_logit`` limit) and their top-1 at the parting step is the oracle's token, not the one
        the engine emitted. What differs is read from the log-probs the engine reported at that step (None when they
        differ from those logits on tokens no rule touches: its generation path computes other logits): its token not
        the top-1 of its own log-probs (sampling); the oracle's token missing from its top-N or at -inf (banned, or,
        when it already occurs in the context, a repeated token's logit lowered); present but lower than its logits
        give (a repeated token's logit lowered, when it occurs in the context: a repetition penalty; else a logit
        bias). Returns ``{"request", "step", "ours", "oracle", "what", "max_abs_logit", "kind", "line"}`` (``kind``:
        ``decoding``, or ``generation`` for a generation path that computes other logits). When no stream parts,
        the prompts whose log-probs fail are read by :meth:`_decoding_by_shift` (a rule that only moved the
        normaliser).
        """
        if base.passed or base.error is not None:
            return None
        if not base.failing or any(g.rsplit(".", 1)[-1] not in GENERATION_METRICS for g in base.failing):
            return None
        same = []  # the prompts whose streams do not part: a rule that only moves the log-probs (shift)
        for o in self.observed:
            ref = self.ref_streams.get(o.prompt_id)
            if o.stream is None or ref is None:
                continue
            ours, theirs = list(o.stream["tokens"]), list(ref["tokens"])
            i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if i is None:
                same.append(o)
                continue
            if o.forced is None:  # no logits (a server): what its own log-probs along its stream say, if anything
                return self._decoding_by_logprobs(o, ref, i, base)
            seq = list(o.ids) + ours[:-1]
            with self._engine(()) as (eng, _):
                z = np.asarray(eng.logits(seq), dtype=np.float64)
            zf = np.asarray(o.forced, dtype=np.float64)
            start = len(o.ids) - 1
            if zf.shape != z.shape:
                return None
            gap = float(np.max(np.abs(zf[start:] - z[start:])))
            if not gap <= self._limit("max_abs_logit"):
                return None
            row = zf[start + i]
            tok, want = ours[i], theirs[i]
            if int(np.argmax(row)) != want:
                return None
            what = self._what(o, i, tok, want, seq[:start + 1 + i], z[start + i])
            kind = "generation" if what.startswith(GENERATION_PATH) else "decoding"
            line = (f"request {o.prompt_id} step {i}: it gave {tok}, its own logits and the {base.oracle}'s give "
                    f"{want} (its logits agree with the {base.oracle}'s at every step of its stream, max |Δlogit| "
                    f"{gap:.3g}); {what}")
            return {"request": o.prompt_id, "step": i, "ours": tok, "oracle": want, "what": what,
                    "max_abs_logit": gap, "kind": kind, "line": line}
        for o in same:
            found = self._decoding_by_shift(o, base)
            if found is not None:
                return found
        return None

    def _decoding_by_shift(self, o: Observed, base: Trial) -> dict[str, Any] | None:
        """:meth:`decoding` for a stream that is the oracle's token for token while its log-probs are not: the
        oracle's logits teacher-forced along its stream (one forward), read by :func:`decoding_by_shift`; where the
        engine gives logits (:attr:`Observed.forced`), they must agree with the oracle's there too."""
        limit = self._logprob_limit(o.prompt_id)
        ours = [int(t) for t in o.stream["tokens"]]
        ours = ours[:ours.index(-1)] if -1 in ours else ours  # a token left unnamed ends what can be followed
        if limit is None or not ours:
            return None
        start = len(o.ids) - 1
        with self._engine(()) as (eng, _):
            z = np.asarray(eng.logits(list(o.ids) + ours[:-1]), dtype=np.float64)[start:]
        if o.forced is not None:
            zf = np.asarray(o.forced, dtype=np.float64)[start:start + len(z)]
            if zf.shape != z.shape or not float(np.max(np.abs(zf - z))) <= self._limit("max_abs_logit"):
                return None
        return decoding_by_shift(o.prompt_id, o.ids, o.stream, z, limit, base.oracle)

    def _decoding_by_logprobs(self, o: Observed, ref: dict[str, Any], i: int, base: Trial) -> dict[str, Any] | None:
        """:meth:`decoding` for an engine that gives no logits, only top-N log-probs along its stream (a server, a
        ``cmd:`` engine that only generates), its stream parting from the oracle's at step ``i``: the oracle's logits
        at its context there, whose top-1 must be the oracle's token, read by :func:`decoding_by_logprobs` (the
        oracle's log-probs at the steps before, where both streams are the same, for the earlier steps)."""
        limit = self._logprob_limit(o.prompt_id)
        lps = o.stream.get("logprobs") or []
        if limit is None or not (i < len(lps) and lps[i]):
            return None
        context = list(o.ids) + list(o.stream["tokens"][:i])
        with self._engine(()) as (eng, _):
            z = np.asarray(eng.logits(context), dtype=np.float64)[-1]
        if int(np.argmax(z)) != int(ref["tokens"][i]):
            return None
        return decoding_by_logprobs(o.prompt_id, o.ids, o.stream, i, z, limit, base.oracle, ref["logprobs"][:i])

    def _what(self, o: Observed, i: int, tok: int, want: int, context: Sequence[int], z: np.ndarray) -> str:
        """What differs in decoding at step ``i`` (see :meth:`decoding`): :func:`decoding_difference` of the
        log-probs the engine reported there, at the pair's ``max_abs_logprob`` limit; ``z``: the oracle's logits."""
        lps = o.stream.get("logprobs") or []
        own = lps[i] if i < len(lps) and lps[i] else {}
        return decoding_difference(own, tok, want, context, z, self._limit("max_abs_logprob"))


def _log_softmax(z: np.ndarray) -> np.ndarray:
    return z - z.max() - np.log(np.sum(np.exp(z - z.max())))


def _untouched_shift(own: Mapping[int, float], lz: np.ndarray, touched: set[int]) -> list[float]:
    """``own[k] - lz[k]`` over the listed ids no decoding rule touches (not in ``touched``) and not at -inf."""
    return [own[k] - lz[k] for k in own if k not in touched and own[k] > -np.inf]


def decoding_difference(own: Mapping[int, float], tok: int, want: int, context: Sequence[int], z: np.ndarray,
                        limit: float) -> str:
    """What differs in decoding at a step where an engine gave ``tok`` and the oracle's logits ``z`` (``[V]``, at the
    engine's context ``context``) give ``want``, read from the log-probs the engine reported there (``own``: id ->
    log-prob, its top-N; empty when it reported none). ``limit``: the pair's ``max_abs_logprob`` limit. One phrase:

    - its token is not the top-1 of its own log-probs, whose top-1 is ``want`` at the log-prob the logits give (up to
      the shift of the normaliser seen on the tokens no rule touches): its log-probs were taken before its decoding
      rules (llama-server's ``n_probs``, vLLM's default ``raw_logprobs``), and ``want`` was passed over after them: a
      repeated token's logit lowered when ``want`` occurs in the context (a repetition penalty), else a token banned
      or a logit bias; sampling looks the same from there, and is named beside them;
    - otherwise not the top-1 of its own log-probs: sampling;
    - the reported log-probs differ from the logits on the tokens no rule touches (outside the context and
      ``want``) by more than one shift of the normaliser: it starts with :data:`GENERATION_PATH` (its generation
      computes other logits than its forward: no decoding rule);
    - ``want`` missing from its top-N or at -inf: banned (or, when it occurs in the context, a repeated token's
      logit lowered); present but lower than the logits give: a repeated token's logit lowered (in the context: a
      repetition penalty), else a logit bias.
    """
    lz = _log_softmax(np.asarray(z, dtype=np.float64))
    repeated = want in context
    where = f"token {want} occurs in the context (position {list(context).index(want)})" if repeated else ""
    if not own:
        return (f"its log-probs at that step were not given; {where}: a repeated token's logit lowered (a "
                "repetition penalty)?" if repeated else
                "its log-probs at that step were not given: a token banned, a logit bias or sampling")
    touched = set(int(c) for c in context) | {want}
    shift = _untouched_shift(own, lz, touched)
    spread = max(shift) - min(shift) if len(shift) >= 2 else 0.0
    theirs = own.get(want)
    if tok not in own or own[tok] < max(own.values()):
        top = max(own, key=lambda k: own[k])
        level = float(np.median(shift)) if shift else 0.0
        if top == want and spread <= limit and abs(theirs - lz[want] - level) <= limit:
            taken = (f"token {want} is the top-1 of its own log-probs at {theirs:.4g}, as the logits give "
                     f"({lz[want]:.4g}): they were taken before its decoding rules; it gave {tok}")
            if repeated:
                return (f"a repeated token's logit lowered after its log-probs were taken: {taken}, and {where} (a "
                        "repetition penalty, or sampling)")
            return (f"token {want} passed over after its log-probs were taken: {taken}, and token {want} is not in "
                    "the context (a token banned, a logit bias, or sampling)")
        return f"sampling: its token {tok} is not the top-1 of its own log-probs (temperature 0 was asked)"
    if spread > limit:
        return (f"{GENERATION_PATH}: the log-probs it reported there differ from its own forward's on tokens no "
                f"decoding rule touches (spread {spread:.3g} over {len(shift)} tokens outside the context): its "
                "generation computes other logits than its forward (its KV cache, its decode path)")
    if theirs is None or not theirs > -np.inf:
        state = f"not among its top-{len(own)} log-probs" if theirs is None else "at log-prob -inf"
        if repeated and theirs is None:
            return (f"a repeated token's logit lowered: token {want} is {state} where the logits give it "
                    f"log-prob {lz[want]:.4g} (their top-1), and {where} (a repetition penalty)")
        return (f"a token banned: token {want} is {state} where the logits give it log-prob {lz[want]:.4g} (their "
                "top-1)")
    if repeated:
        return (f"a repeated token's logit lowered: token {want} at log-prob {theirs:.4g} where the logits give "
                f"log-prob {lz[want]:.4g}, and {where} (a repetition penalty)")
    return (f"token {want}'s log-prob lowered in decoding: {theirs:.4g} where the logits give log-prob "
            f"{lz[want]:.4g} (a logit bias)")


def decoding_by_logprobs(request: str, ids: Sequence[int], stream: Mapping[str, Any], i: int, z: np.ndarray,
                         limit: float, oracle: str = "reference",
                         before: Sequence[Mapping[int, float]] = ()) -> dict[str, Any] | None:
    """Whether an engine that gives no logits, only top-N log-probs along its greedy stream, diverges at step ``i``
    in decoding, and what differs there.

    Args:
        request: the prompt's id (named in the line).
        ids: the prompt's token ids.
        stream: the engine's greedy stream (``tokens``, ``logprobs``: per step ``{id: log-prob}``).
        i: the step where its token is not the oracle's greedy token there.
        z: the oracle's logits ``[V]`` at the engine's context of step ``i`` (``ids`` and its tokens before ``i``);
            their top-1 is the oracle's token.
        limit: the pair's ``max_abs_logprob`` limit (with the effect of the declared approximations).
        oracle: the oracle's name in the line (``reference``, ``fast``).
        before: the oracle's top-N log-probs at the steps before ``i`` at the same contexts (where the oracle's
            stream is the engine's), compared too.

    Returns:
        None unless, at step ``i``, its log-probs of at least two tokens no decoding rule touches (neither in the
        context nor the oracle's token) differ from the oracle's by one shift of the normaliser within ``limit``, and
        so at the steps ``before`` on the untouched tokens both list (a rule that lowers the context's tokens moves
        the normaliser at every step): the model computes the oracle's numbers there, and the oracle's token was
        lowered, banned or passed over after them (:func:`decoding_difference`). Else ``{"request", "step", "ours",
        "oracle", "what", "evidence": "log-probs", "spread_before", "spread", "kind": "decoding", "line"}``.
    """
    lps = stream.get("logprobs") or []
    own = lps[i] if i < len(lps) and lps[i] else {}
    if not own:
        return None
    ours = [int(t) for t in stream["tokens"]]
    want, tok = int(np.argmax(z)), ours[i]
    spreads = []  # each earlier step's spread of (its log-prob - the oracle's) over the untouched tokens both list
    for k, (a, b) in enumerate(zip(lps[:i], before)):
        seen = set(int(c) for c in ids) | set(ours[:k])
        d = [a[t] - b[t] for t in set(a or {}) & set(b or {}) if t not in seen and a[t] > -np.inf < b[t]]
        spreads += [max(d) - min(d)] if d else []
    if spreads and not max(spreads) <= limit:
        return None
    context = [int(c) for c in ids] + ours[:i]
    shift = _untouched_shift(own, _log_softmax(np.asarray(z, dtype=np.float64)), set(context) | {want})
    if len(shift) < 2 or not max(shift) - min(shift) <= limit:
        return None
    what = decoding_difference(own, tok, want, context, z, limit)
    if what.startswith(GENERATION_PATH):
        return None
    spread, worst = max(shift) - min(shift), max(spreads, default=0.0)
    line = (f"request {request} step {i}: it gave {tok}, the {oracle}'s greedy token there is {want} "
            f"(no logits were given: its own log-probs agree with the {oracle}'s on the {len(shift)} tokens "
            f"it lists that no decoding rule touches, up to one shift of the normaliser (spread {spread:.3g}), "
            f"and so at the {min(i, len(before))} steps before (spread at most {worst:.3g})); {what}")
    return {"request": request, "step": i, "ours": tok, "oracle": want, "what": what, "evidence": "log-probs",
            "spread_before": worst, "spread": spread, "kind": "decoding", "line": line}


def _lowered(own: Mapping[int, float], z: np.ndarray, context: set[int], limit: float
             ) -> tuple[float, float, int, list[int], list[int]] | None:
    """Whether the log-probs ``own`` (id -> log-prob, an engine's top-N at one step) are the oracle's logits ``z``
    after a decoding rule that only lowers logits: on the listed tokens outside ``context`` one shift ``s >= 0`` of
    the normaliser (spread within ``limit``, at least two tokens), no listed token above its log-prob plus ``s``, and
    the mass the visible lowered tokens lost (the context's tokens listed lower than that; the oracle's tokens that
    rank above a listed one and are missing or at -inf) no more than ``s`` accounts for (``1 - exp(-s)``, within
    ``limit`` in log space). Returns ``(s, spread, untouched tokens, lowered, missing)`` (the two lists may be
    empty: the step agrees up to the shift), or None."""
    lz = _log_softmax(np.asarray(z, dtype=np.float64))
    listed = {int(t): float(v) for t, v in own.items() if int(t) >= 0 and v > -np.inf}
    shift = [listed[t] - lz[t] for t in listed if t not in context]
    if len(shift) < 2 or not listed:
        return None
    s, spread = float(np.median(shift)), float(max(shift) - min(shift))
    if not (spread <= limit and s >= -limit) or any(listed[t] > lz[t] + s + limit for t in listed):
        return None
    floor = min(listed.values())
    lowered = sorted(t for t in listed if listed[t] < lz[t] + s - limit)
    ranked = np.argsort(-lz, kind="stable")[:len(own) + len(lowered)]
    missing = [int(t) for t in ranked if int(t) not in listed and lz[t] + s > floor + limit]
    lost = sum(np.exp(lz[t]) - np.exp(listed[t] - s) for t in lowered)
    lost += sum(max(0.0, np.exp(lz[t]) - np.exp(floor - s)) for t in missing)
    if not lost < 1 or not -np.log1p(-lost) <= max(s, 0.0) + limit:
        return None
    return s, spread, len(shift), lowered, missing


def decoding_by_shift(request: str, ids: Sequence[int], stream: Mapping[str, Any], z: np.ndarray, limit: float,
                      oracle: str = "reference") -> dict[str, Any] | None:
    """Whether an engine whose greedy stream is the oracle's token for token, and whose log-probs along it are not
    (``max_abs_logprob`` fails, the tokens agree), diverges in decoding: a rule that lowers some logits (a token
    banned, a repetition penalty, a logit bias) after its forward, before the log-probs it reports, moves the
    normaliser of every step where the lowered tokens had mass, without ever parting the streams.

    Args:
        request: the prompt's id (named in the line).
        ids: the prompt's token ids.
        stream: the engine's greedy stream (``tokens``, ``logprobs``: per step ``{id: log-prob}``).
        z: the oracle's logits ``[n, V]`` at each step's context (the prompt and the stream's tokens before it:
            teacher-forced along the engine's own stream, which is the oracle's).
        limit: the pair's ``max_abs_logprob`` limit (with the effect of the declared approximations).
        oracle: the oracle's name in the line.

    Returns:
        None unless every step with log-probs is, by :func:`_lowered`, the oracle's log-probs after a rule that only
        lowers (at each, the listed tokens outside the context agree with the oracle's up to one shift of the
        normaliser), at least one step differs beyond ``limit``, and what moved the normaliser is named: the lowered
        tokens in sight at a step that differs (the step that differs most among them is quoted), or, with none in
        sight, the one token not listed at any step whose oracle probability ``p``, taken out, gives each step's
        shift ``-log(1 - p)`` within the spread of the log-probs themselves (a ban; none or several: None). Else
        ``{"request", "step", "ours", "oracle" (its token there, both the same), "what", "evidence": "log-probs",
        "shift", "spread", "kind": "decoding", "line"}``.
    """
    lps = stream.get("logprobs") or []
    ours = [int(t) for t in stream["tokens"]]
    steps = []  # (step, max |Δlogprob|, what _lowered found, the oracle's log-probs) of each step with log-probs
    for k, own in enumerate(lps[:len(z)]):
        if not own:
            continue
        lz = _log_softmax(np.asarray(z[k], dtype=np.float64))
        dev = max((abs(v - lz[int(t)]) for t, v in own.items() if int(t) >= 0 and v > -np.inf), default=0.0)
        found = _lowered(own, z[k], set(int(c) for c in ids) | set(ours[:k]), limit)
        if found is None and dev > limit:
            return None  # a step no rule that only lowers logits gives
        steps.append((k, dev, found, lz))
    apart = [st for st in steps if st[1] > limit]
    if not apart or any(st[2] is None for st in apart):
        return None
    k, dev, (s, spread, n, lowered, missing), lz = max(apart, key=lambda st: st[1])
    ctx = [int(c) for c in ids] + ours[:k]
    top = len(lps[k])
    said = []
    seen = [st for st in apart if st[2][3] or st[2][4]]
    if seen:  # the lowered tokens are in sight at the step that differs most (else at another one)
        k, dev, (s, spread, n, lowered, missing), lz = max(seen, key=lambda st: st[1])
        ctx = [int(c) for c in ids] + ours[:k]
        top = len(lps[k])
        for t in missing:
            where = f", in the context (position {ctx.index(t)}): a repeated token's logit lowered" if t in ctx else ""
            said.append(f"token {t} missing from its top-{top} where the logits give it log-prob {lz[t]:.4g}{where}")
        for t in lowered:
            said.append(f"token {t} at log-prob {lps[k][t]:.4g} where the logits give {lz[t]:.4g} (+ the shift), in "
                        f"the context (position {ctx.index(t)}): a repeated token's logit lowered")
        touched = [*missing, *lowered]
        rule = ("a repetition penalty" if all(t in ctx for t in touched) else
                "a token banned or a logit bias" if not any(t in ctx for t in touched) else
                "a token banned or a logit bias, and a repetition penalty")
        what = f"{'; '.join(said)} ({rule})"
    else:  # only the normaliser moved: the one token whose probability, taken out, moves it so at every step
        noise = max(st[2][1] for st in steps if st[2] is not None) + 1e-12  # the log-probs' own spread
        fits = np.ones(len(lz), dtype=bool)
        for kk, _, f, lzk in steps:
            if f is None:
                continue
            p = np.exp(lzk)
            fits &= np.abs(-np.log1p(-np.minimum(p, 1 - 1e-16)) - f[0]) <= noise
            fits[[int(t) for t, v in lps[kk].items() if int(t) >= 0 and v > -np.inf]] = False  # listed: not banned
        if int(fits.sum()) != 1:
            return None
        t = int(np.argmax(fits))
        where = f"; it occurs in the context (position {ctx.index(t)})" if t in ctx else ""
        what = (f"a token banned: token {t}'s probability is taken out at every step (it is never among its top-{top}; "
                f"at step {k} the logits give it {np.exp(lz[t]):.4g}, and the normaliser moved by "
                f"{s:.4g} = -log(1 - {np.exp(lz[t]):.4g}), no other token fitting every step within the spread "
                f"{noise:.3g} of its log-probs){where}")
    line = (f"request {request} step {k}: its tokens are the {oracle}'s, its log-probs are not (max |Δlogprob| "
            f"{dev:.3g}); they agree with the {oracle}'s on the {n} tokens it lists that no decoding rule touches, up "
            f"to one shift of the normaliser ({s:.3g}, spread {spread:.3g}), at every step of its stream; {what}")
    tok = ours[k] if k < len(ours) else None
    return {"request": request, "step": k, "ours": tok, "oracle": tok, "what": what, "evidence": "log-probs",
            "shift": s, "spread": spread, "kind": "decoding", "line": line}


def explain_text(ref: Any, observed: Sequence[Observed], pair: str, gates: Mapping[str, Gate] = DEFAULT_GATES,
                 numerics: Callable[[], Any] | None = None, budget_s: float | None = None, top_n: int = 5,
                 layer_tol: float | None = None, variants: Sequence[Variant] | None = None,
                 effects: Mapping[tuple[str, str | None], tuple[float, int]] | None = None,
                 near_tie: float | None = None, oracle: Any = None,
                 local: LocalJudge | None = None) -> Explanation:
    """:func:`search` over the text variants (or ``variants``) for the engine's answers ``observed``
    (:class:`TextSubject` for the other arguments); a divergence only in generation is not searched: the
    explanation's status is ``decoding`` (:meth:`TextSubject.decoding`)."""
    subject = TextSubject(ref, observed, pair, gates, numerics, top_n, layer_tol, effects, near_tie, oracle, local)
    t0 = time.perf_counter()
    base = subject.measure((), full=True)
    budget = budget_seconds(budget_s)
    dec = subject.decoding(base)
    if dec is not None:
        out = Explanation("decoding", base, budget_s=budget, decoding=dec, first_point=f"request {dec['request']} "
                          f"step {dec['step']}")
        out.seconds = time.perf_counter() - t0
        return out
    return search(subject.measure, family("text") if variants is None else variants, subject.subject, budget,
                  baseline=base)
