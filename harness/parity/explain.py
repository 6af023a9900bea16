"""Explaining a divergence: re-run the reference under the known spec variants and name the one that makes a failing
engine agree (``docs/design.md``, "Explaining a divergence"; the catalogue is :mod:`harness.engines.variants`).

A *subject* is what the engine under test answered, kept: logits, trace files or greedy streams of a few prompts
(:class:`TextSubject`; the multimodal merge and the MTP drafter have their own in :mod:`.explain_mm`). Its
``measure(variants)`` computes the reference under those variants on the same prompts and judges the engine's answers
with the failing pair's own gates: a :class:`~.explain_search.Trial`. :func:`.explain_search.search` then tries

1. the variants that apply to the model (:meth:`~harness.engines.variants.Variant.why_not`), those whose first trace
   point is the engine's first diverging point (same point, nearest layer) first, then the rest: the scope. Each
   trial runs the shortest prompt first and stops at the first prompt the engine still fails, so a variant that
   does not explain costs one short forward (cheapest first);
2. when no single variant explains it, pairs: each of the :data:`~.explain_search.PAIR_SEEDS` singles that got furthest (the first
   divergence moved latest, then the smallest residual) with every variant it can be combined with (another rule),
   those in scope of the point where the engine now first diverges first;

all within a time budget (``--explain-budget``, :data:`~.explain_search.DEFAULT_BUDGET_S`; what the budget left untried is listed).
The answer (:class:`~.explain_search.Explanation`) is "explained by V: max |Δlogit| A -> B (sources ...)", or "no known variant
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
whose probability, taken out, gives that shift at every step (a ban): :func:`.explain_decoding.decoding_by_shift`.

Here: the text subject and :func:`explain_text`; the search and its records are :mod:`.explain_search`, the reading
of log-probs for a divergence in decoding :mod:`.explain_decoding` (neither runs a model).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core.gates import DEFAULT_GATES, Gate, effect_limit
from ..core.engine_kinds import ORACLE, TWIN
from ..engines.fast import FastEngine
from ..engines.variants import Variant, family, under
from ..traces.format import TraceWriter, canonical_key
from .compare import as_streams, generation_figures, layer_figure, prompt_logit_figures
from .explain_decoding import GENERATION_PATH, decoding_by_logprobs, decoding_by_shift, decoding_difference
from .explain_search import Explanation, METRICS, Observed, Trial, budget_seconds, judge_figures, search, unmeasured
from .result import Figure


LOCAL_JUDGED = ("judged by local_median: the engine rounds its activations (quantized_activations) and an int8 "
                "rounding flip carries from layer to layer (harness/parity/checks/quantized.py, local_figure)")
"""Why the plain logit and layer figures of a trial are informational where the pair is judged by local_median."""


@dataclass(frozen=True)
class LocalJudge:
    """How a pair judged by ``<pair>_q8.local_median`` judges a trial (given by the pair's checks, which this module
    does not import): ``errors`` maps an answer with a trace to its per-point errors against the reference re-seeded
    from it (:meth:`harness.parity.checks.reference_runs.ReferenceRuns.local_errors`; None where it cannot be computed),
    ``pool`` maps ``(pair, per-prompt figures holding "_errors")`` to the pooled figure
    (:func:`harness.parity.checks.quantized.local_figure`: the median per point, its limit, its first point beyond
    it)."""

    errors: Callable[["Observed"], dict | None]
    pool: Callable[[str, Sequence[Figure]], Figure]


GENERATION_METRICS = ("greedy", "max_abs_logprob")
"""The metrics of greedy streams (:func:`harness.parity.compare.generation_figures`): a pair that fails only these
while its logits agree diverges in decoding (:meth:`TextSubject.decoding`)."""


# --------------------------------------------------------------------------- the text subject


def _metric(f: Figure) -> str:
    return f.gate.rsplit(".", 1)[-1]


class TextSubject:
    """The engine's answers on a few prompts of a text model, judged as the pair ``pair`` judges them: measured by the
    pair's own metric functions (:func:`.compare.prompt_logit_figures`, :func:`.compare.layer_figure`,
    :func:`.compare.generation_figures`, the ones :func:`harness.parity.checks.pair.pair_checks` measures with), each
    at the pair's limit raised by the effect of the engine's declared approximations there (``effects``).

    Args:
        ref: the reference engine of the model (:class:`harness.engines.reference.ReferenceEngine`).
        observed: the engine's answers, shortest prompt first (:class:`Observed`).
        pair: the gate prefix (``reference~cmd``, ``fast~cmd``, ``oracle~engine`` ...).
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
                yield self.oracle, TWIN
            elif self.oracle is not None and all(v.has_fast for v in variants) and \
                    (eng := self._fast_under(variants, stack)) is not None:
                try:
                    yield eng, TWIN
                finally:
                    eng.close()
            else:
                stack.enter_context(under(variants, fast=False))
                yield self.ref, ORACLE

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
            if o.logits is not None:  # the pair's own figures (harness.parity.compare), at the pair's limits
                logit = prompt_logit_figures(o.logits, z, self.pair, o.prompt_id,
                                             self._raised("max_abs_logit", o.prompt_id),
                                             self._limit("max_abs_logit"), t.oracle)
                figs += logit
                if logit[0].detail["first_divergence"] and t.first_divergence is None:
                    t.first_divergence = logit[0].detail["first_divergence"]
            if o.trace is not None:
                effect = self.effects.get(("layer_rel_l2", o.prompt_id))
                layer = layer_figure(o.trace, w.trace(), self.pair, o.prompt_id,
                                     self._raised("layer_rel_l2", o.prompt_id, self.layer_tol),
                                     None if effect is None else float(effect[0]))
                figs.append(layer)
                where = layer.detail.get("first_divergence")
                if where and t.first_key is None and not errors:
                    point, at = where.rsplit("@", 1)
                    t.first_divergence, t.first_key = where, canonical_key(point, int(at))
            if errors:
                for f in figs:
                    f.detail["informational_reason"] = LOCAL_JUDGED
        if o.stream is not None:
            base = as_streams([{"id": o.prompt_id}],
                              eng.generate_full([o.ids], len(o.stream["tokens"]), top_n=self.top_n))
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

    def _raised(self, metric: str, prompt_id: str, base: float | None = None) -> float:
        """The limit the pair measures ``metric`` on ``prompt_id`` at (:func:`harness.parity.checks.pair.pair_checks`
        hands the same to :func:`.compare.prompt_logit_figures` and :func:`.compare.layer_figure`): ``base`` (default
        the gate's limit; inf without a gate) raised by the effect of the engine's declared approximations there
        (:func:`harness.core.gates.effect_limit`)."""
        limit = self._limit(metric) if base is None else base
        g = self.gates.get(f"{self.pair}.{metric}")
        e = self.effects.get((metric, prompt_id), self.effects.get((metric, None)))
        return limit if g is None or e is None else max(limit, effect_limit(g, float(e[0]), int(e[1])))

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
        oracle's logits teacher-forced along its stream (one forward), read by :func:`.explain_decoding.decoding_by_shift`; where the
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


def explain_text(ref: Any, observed: Sequence[Observed], pair: str, gates: Mapping[str, Gate] = DEFAULT_GATES,
                 numerics: Callable[[], Any] | None = None, budget_s: float | None = None, top_n: int = 5,
                 layer_tol: float | None = None, variants: Sequence[Variant] | None = None,
                 effects: Mapping[tuple[str, str | None], tuple[float, int]] | None = None,
                 near_tie: float | None = None, oracle: Any = None,
                 local: LocalJudge | None = None) -> Explanation:
    """:func:`.explain_search.search` over the text variants (or ``variants``) for the engine's answers ``observed``
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
