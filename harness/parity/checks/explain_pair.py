"""The parity job's explanation of a failing pair (``g4h parity --model M --against E``): once the pair's figures are
measured and one fails its gate, the engine is asked again for its answers on the (at most
:data:`harness.parity.explain_search.MAX_PROMPTS`) shortest failing prompts: logits and a trace where it gives them, greedy
streams otherwise (a server). :func:`harness.parity.explain.explain_text` re-runs the float64 reference under the
spec variants (:mod:`harness.engines.variants`) within the budget (``--explain-budget``), and the result goes into the
first failing figure's ``explanation`` (``results.json``; the report's first section quotes its line).

The explanation is judged as the pair is: the case's gate table (``runs.gates``, set by the job), the effect of the
engine's declared approximations on each figure, the pair's near-tie margin, the job's oracle (``--oracle fast``:
fast where the variant has a fast form), and, where the pair is judged by ``<pair>_q8.local_median`` (an engine that
rounds its activations, on a quantized file), that median of the reference re-seeded from the engine's trace under
each trial's variants. When only greedy streams fail, the engine is asked for its streams too (and,
where it gives logits, its logits along its own stream): a divergence in decoding is said so, not searched.

:func:`explain_failing_pair` is a hook of :func:`harness.parity.checks.pair.pair_checks` (``on_measured``): the parity
job's cases hand it over with the run's budget (:func:`harness.parity.cases.pairs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ...core.gates import DEFAULT_GATES
from ...core.workers import EngineCrashed, temp_folder
from ...engines.base import TOP_N
from ..compare import as_streams
from ..explain import GENERATION_METRICS, LocalJudge, explain_text
from ..explain_search import DEFAULT_BUDGET_S, MAX_PROMPTS, Observed, judge_figures
from ..result import Figure
from .pair import (
    GREEDY_NEW_TOKENS,
    engine_numerics,
    pair_near_tie,
)
from .pair_figures import _can, _logits_many, engine_logits
from .quantized import local_figure


def _gating_failure(f: Figure, gates=DEFAULT_GATES) -> bool:
    """Whether ``f`` fails its gate and counts (not made informational by the pair, as a quantized file's
    figures of an engine with ``quantized_activations`` are)."""
    return "informational_reason" not in f.detail and bool(judge_figures([f], gates))


def failing_prompts(figures: Sequence[Figure], prompts: Sequence[dict[str, Any]], gates=DEFAULT_GATES
                    ) -> list[dict[str, Any]]:
    """The prompts of the figures that fail their gate, shortest first, at most
    :data:`~harness.parity.explain_search.MAX_PROMPTS`: a greedy figure's streams that are faults; every prompt when only a
    figure over all of them fails and names none."""
    failing = [f for f in figures if _gating_failure(f, gates)]
    if not failing:
        return []
    ids = {str(f.prompt) for f in failing if f.prompt is not None}
    ids |= {str(r["request"]) for f in failing for r in f.detail.get("streams_detail", ()) if r.get("kind") == "fault"}
    chosen = [p for p in prompts if str(p["id"]) in ids] or list(prompts)
    return sorted(chosen, key=lambda p: len(p["prompt_ids"]))[:MAX_PROMPTS]


def generation_only(figures: Sequence[Figure], gates=DEFAULT_GATES) -> bool:
    """Whether only greedy-stream figures (:data:`~harness.parity.explain.GENERATION_METRICS`) fail."""
    failing = [f for f in figures if _gating_failure(f, gates)]
    return bool(failing) and all(f.gate.rsplit(".", 1)[-1] in GENERATION_METRICS for f in failing)


def effects(figures: Sequence[Figure]) -> dict[tuple[str, str | None], tuple[float, int]]:
    """``(metric, prompt id or None) -> (effect, power)`` of the pair's figures that carry an ``effect`` (how far the
    engine's declared approximations move the oracle's figure): the explanation is judged at the same limits."""
    return {(f.gate.rsplit(".", 1)[-1], None if f.prompt is None else str(f.prompt)):
            (float(f.detail["effect"]), int(f.detail.get("effect_power", 1)))
            for f in figures if f.detail.get("effect") is not None}


def observe(eng: Any, kind: str, prompts: Sequence[dict[str, Any]], new_tokens: int = GREEDY_NEW_TOKENS,
            top_n: int = TOP_N, streams: bool = False, context: int | None = None) -> list[Observed]:
    """The engine's answers on ``prompts``: logits and its trace (a file for ``cmd:``, the callback in-process) where
    it answers them, else greedy streams of ``new_tokens`` tokens. ``streams`` (only greedy streams failed): its
    streams too where it generates, and, where it gives logits, its logits of the prompt followed by its own stream
    (:attr:`~harness.parity.explain_search.Observed.forced`). ``context``: the model's context length; a prompt
    whose stream would not fit in it gets none, as in the pair
    (:func:`harness.parity.checks.pair_figures._measure_figures`: the engine would be asked past its context, and its
    refusal read as a failure)."""
    out = []
    batch = _logits_many(eng, kind, prompts) if _can(eng, "logits") else {}  # llama.cpp: one worker for all
    with temp_folder("g4h-explain-") as tmp:
        for p in prompts:
            ids = list(p["prompt_ids"])
            o = Observed(str(p["id"]), ids)
            if _can(eng, "logits"):  # asked as the pair asks (harness.parity.checks.pair_figures.engine_logits)
                z, o.trace = engine_logits(eng, kind, p, batch, Path(tmp))
                o.logits = np.asarray(z, dtype=np.float64)
                if o.trace is not None and o.trace.records and o.trace.tensors is None:
                    # a trace file's tensor dump into memory before the scratch folder goes
                    o.trace.tensor(o.trace.records[0]["point"], int(o.trace.records[0]["layer"]))
            fits = context is None or len(ids) + new_tokens <= context
            if _can(eng, "generate") and (streams or o.logits is None) and fits:
                g = eng.generate_full([ids], new_tokens, top_n=top_n)
                o.stream = as_streams([p], g)[str(p["id"])]
                if o.logits is not None and len(o.stream["tokens"]) > 1:
                    o.forced = np.asarray(eng.logits(ids + list(o.stream["tokens"][:-1])), dtype=np.float64)
            out.append(o)
    return out


def local_judge(runs: Any, approx: tuple[str, ...]) -> LocalJudge | None:
    """What :class:`~harness.parity.explain.TextSubject` judges by where the pair is judged by
    ``<pair>_q8.local_median``: the per-position errors of the engine's trace against the reference re-seeded from it
    under ``approx`` (:meth:`~harness.parity.checks.reference_runs.ReferenceRuns.local_errors`; None for an answer
    without a trace), pooled as the pair pools them (:func:`~harness.parity.checks.quantized.local_figure`). None when
    ``approx`` does not round activations (no such gate)."""
    if "quantized_activations" not in approx:
        return None

    def errors(o: Observed) -> dict | None:
        return None if o.trace is None else runs.local_errors(approx, {"prompt_ids": o.ids}, o.trace)
    return LocalJudge(errors, local_figure)


def explain_failing_pair(runs: Any, eng: Any, kind: str, pair: str, prompts: Sequence[dict[str, Any]],
                         figures: list[Figure], progress, case: str, budget_s: float = DEFAULT_BUDGET_S) -> None:
    """When one of ``figures`` fails: the explanation (module docstring) into the first failing figure's detail,
    within ``budget_s`` seconds (``--explain-budget``; 0: nothing is done).

    An engine that fails while asked again (it crashed, broke the protocol) leaves ``explanation`` saying so;
    the pair's own figures already say what went wrong.
    """
    budget = float(budget_s)
    gates = getattr(runs, "gates", DEFAULT_GATES)
    chosen = failing_prompts(figures, prompts, gates)
    if budget <= 0 or not chosen:
        return
    first = next(f for f in figures if _gating_failure(f, gates))
    progress(f"[{case}] {pair} failed: trying the spec variants on {len(chosen)} prompt(s) (budget {budget:g} s)")
    gen_only = generation_only(figures, gates)
    steps = [int(r["step"]) for f in figures for r in f.detail.get("streams_detail", ()) if r.get("step") is not None]
    new_tokens = max(GREEDY_NEW_TOKENS, max(steps, default=0) + 1)
    try:
        observed = observe(eng, kind, chosen, new_tokens=new_tokens, streams=gen_only,
                           context=runs.ref.cfg.context_length)
    except (EngineCrashed, InputError) as e:
        first.detail["explanation"] = {"status": "not_run", "line": f"not explained: the engine failed when asked "
                                       f"again ({str(e).splitlines()[0] if str(e) else type(e).__name__})"}
        return
    approx = getattr(runs, "effective", tuple)(engine_numerics(eng, kind).emulation())  # the declared approximations
    eff = effects(figures)
    near_tie = pair_near_tie(pair, eff)
    # judged, as the pair was, by the re-seeded median where the pair was
    local = local_judge(runs, approx) if any(f.gate == f"{pair}_q8.local_median" for f in figures) else None
    try:
        expl = explain_text(runs.ref, observed, pair, gates, numerics=lambda: runs.numerics(approx),
                            budget_s=budget, top_n=TOP_N, effects=eff, near_tie=near_tie,
                            oracle=None if runs.oracle is runs.ref else runs.oracle, local=local)
    except Exception as e:  # the explanation is a hint beside the pair's figures: it never takes them down
        first.detail["explanation"] = {"status": "not_run", "line": f"not explained: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''}"}
        return
    first.detail["explanation"] = expl.as_dict()
    progress(f"[{case}] {pair}: {expl.line()} ({expl.seconds:.1f} s)")

