"""Judging an engine that rounds its activations (``quantized_activations``) on a quantized or 16-bit file.

llama.cpp's CPU backend rounds each matrix product's input to the weight type's dot-product type
(docs/quantized-activations.md). Where the reference emulates that rounding, what is left is fp32 accumulation and
sporadic int8 rounding flips, so the worst-value figures are reported and the pair is gated instead by
``<pair>_q8.local_median`` (each layer against the reference re-seeded from the engine's own stream:
:func:`.reference_runs.local_errors`, :func:`local_figure`, :func:`flips_explained`) where the engine gives its tensors,
else by ``<pair>_q8.agreeing_positions`` (the leading run of positions within the fp32 bound against the null's,
the emulating reference with its fp32 sums jittered, :data:`NULL`; for an engine with log-probs only,
:func:`stream_agreement`). Where it cannot emulate it
(:data:`QUANTIZED_ACTIVATIONS`), the figures are informational and the mean KLD is gated against the 8-bit yardstick
(:data:`YARDSTICK`). :func:`quantized_gates` applies all of this to a pair's figures (:mod:`.pair` calls it); the gates
and their reasons are in ``harness/core/gates.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ...core.gates import DEFAULT_GATES, EFFECT_FACTOR, Q8_AGREEING, Q8_LOCAL_ALPHA, effect_limit
from ...core.kld import kld_stats
from ...core.metrics import binned_kld, log_softmax
from ...core.workers import EngineFailure
from ...engines.base import TOP_N
from ..result import Figure, fig
from .reference_runs import ReferenceRuns

QUANTIZED_ACTIVATIONS = (
    "{engine} rounds the activations of matrix products with {types} weights to their dot-product type "
    "(quantized_activations), which the reference cannot emulate here: {why}. Reported, not gated; the pair's mean "
    "KLD is gated instead (on its greedy streams' top-N log-probs for an engine without logits), at 2 x the KLD an "
    "8-bit rounding of every such product's input causes on this model (the yardstick, {pair}_q8x.mean_kld)")
"""The reason a pair's figures (all but its mean KLD) are informational when the engine declares
``quantized_activations``, the file holds quantized or 16-bit matrices, and the rounding cannot be emulated
(:meth:`ReferenceRuns.emulation_gap`)."""

YARDSTICK = ("quantized_activations_q8",)
"""The emulation key of the yardstick: every quantized product's input rounded to 8 bits
(:func:`harness.engines.llamacpp.numerics.coarse_q8_numerics`)."""

Q8_REPORTED = ("max_abs_logit", "mean_kld", "max_abs_logprob", "layer_rel_l2")
"""The figures of an emulated pair that are reported, not gated (:data:`Q8_REPORTED_WHY`)."""

Q8_REPORTED_WHY = (
    "reported, not gated: with the quantized activations emulated, what is left is fp32 accumulation (~1e-6) and, "
    "sporadically, an int8 rounding that the engine's fp32 activation takes the other way (an activation within fp32 "
    "noise of a rounding midpoint); one such flip moves everything after it by as much as the rounding itself does "
    "(measured: e2b Q8_0 max |dlogit| 0.35, Gemma 3 270M Q4_K_M 8.4), so the worst figure says nothing about a fault. "
    "Gated instead: local_median where the engine gives its tensors (each layer re-seeded from the engine's stream), "
    "else agreeing_positions (a fault moves every position; a flip only those after it)")

Q8_METRICS = ("max_abs_logit", "mean_kld", "same_top1_decisive", "greedy", "max_abs_logprob", "layer_rel_l2")
"""The metrics judged by ``<pair>_q8.*`` when the engine's quantized activations are emulated on a quantized file."""


def quantized_gates(runs: ReferenceRuns, figures: list[Figure], pair: str, kind: str, types: Sequence[str],
                    gap: str | None, prompts: Sequence[dict[str, Any]], approx: tuple[str, ...] = ()) -> None:
    """Judge the figures of an engine that rounds its activations (``quantized_activations``) on a file with
    quantized or 16-bit matrices (``types``).

    Emulated with the engine's tensors (its traces: the ``<pair>_q8.local_median`` figures of each prompt, with
    ``_errors``): they are pooled into the one gate of the pair (:func:`local_figure`: each layer judged on its own
    against the reference re-seeded from the engine's stream), and ``agreeing_positions`` is reported
    (:data:`LOCAL_JUDGES`; its jittered count is not computed).

    Emulated (``gap`` None): each figure is judged by ``<pair>_q8.<metric>`` (``harness/core/gates.py``), not by the
    effect of the emulations (kept in the detail as ``effect_not_applied``: the rounding moves the figures by far
    more than a fault does). What the emulation leaves is fp32 accumulation and sporadic int8 rounding flips; the
    worst-value figures are reported, and ``<pair>_q8.agreeing_positions`` is gated: the positions in each prompt's
    leading run within the fp32 bound, over those of the emulating reference against itself with every product's
    fp32 output moved in its last bits (:data:`NULL`, ``jitter_sums``: what the flips alone do on this model and
    prompt; not the input jitter, which flips exact ties no correct engine flips and, on a PLE Q4_0 file, agreed on
    no position at all). When that reference agrees on fewer positions than one per prompt (flips too dense: no
    resolution), the figure is reported and ``<pair>_q8.median_abs_logit`` judges (the median, over every position
    of every prompt pooled, of the engine's max |dlogit| over the vocabulary against the emulating reference, at
    max(fp32 bound, 2 x the same median of the null): ``Q8_MEDIAN_LOGIT_WHY`` in harness/core/gates.py, the rule of
    ``median_abs_logprob`` below); it is reported wherever the count judges. The positions' differences come from
    the ``max_abs_logit`` figures' ``_per_position`` (``pair_figures._logit_figures``), removed from their detail
    here; where they are missing (figures not measured there), the mean KLD is gated against the yardstick as
    below. An engine
    without logits (a server) is counted on its greedy streams' log-probs instead (:func:`stream_agreement`, in the
    ``max_abs_logprob`` figure's detail), against the same null: the same gate, the same ratio. Where that null
    agrees on fewer positions than one per stream, the windows judge (:func:`window_agreement`, :data:`WINDOWS_WHY`:
    the same count on ``[BOS, token]`` prompts asked one by one) when their null agrees on at least
    :func:`window_floor`;
    else ``<pair>_q8.median_abs_logprob`` does (the median of the per-position differences at max(fp32 bound,
    2 x the null's), ``Q8_MEDIAN_WHY`` in harness/core/gates.py: flips dense enough that the differences are their
    noise, F16/BF16). The median is reported wherever a count judges.

    Not emulated (``gap`` says why): every figure is informational with the reason
    (:data:`QUANTIZED_ACTIVATIONS`), except the mean KLD, judged by ``<pair>_q8x.mean_kld`` at 2 x the KLD the
    yardstick rounding (:data:`YARDSTICK`) causes on the same prompt, so a fault larger than an 8-bit rounding
    still fails. An engine without logits (a server) has no full KLD: its greedy streams' KLD on the top-N bins
    (:func:`stream_kld`, in the ``max_abs_logprob`` figure's detail) is that figure, pooled over the streams, against
    the yardstick's on the same bins."""
    head = pair + "."
    by_id = {str(p["id"]): p for p in prompts}
    dense = None
    seeded = [f for f in figures if f.gate == f"{pair}_q8.local_median" and "_errors" in f.detail]
    if seeded:  # the engine's tensor traces, each layer judged on its own: the gate of the emulated pair
        figures[:] = [f for f in figures if not any(f is g for g in seeded)]
        figures.append(local_figure(pair, seeded))
    # each prompt's per-position max |dlogit| (pair_figures._logit_figures), for median_abs_logit; never reported
    per_position = {id(f): f.detail.pop("_per_position") for f in figures if "_per_position" in f.detail}
    if gap is None:
        logit = [f for f in figures if f.gate == head + "max_abs_logit" and "agreeing_prefix" in f.detail]
        streams = [f for f in figures if f.gate == head + "max_abs_logprob" and "agreeing_prefix" in f.detail]
        detail: dict[str, Any] | None = None
        logit_sizes: dict[str, Any] | None = None  # median_abs_logit's figures (MEDIAN_LOGIT_WHY)
        if logit:
            own = DEFAULT_GATES[head + "max_abs_logit"].limit
            agree, total = sum(f.detail["agreeing_prefix"] for f in logit), sum(f.detail["positions"] for f in logit)
            itself = 0  # the emulating reference against itself with its fp32 sums jittered (NULL)
            diffs: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])  # per prompt: the engine's, the null's
            per_prompt_sizes: dict[str, list[float]] = {}
            for f in (() if seeded else logit):  # reported beside local_median: not worth a forward per prompt
                p = by_id[str(f.prompt)]
                base = runs.logits(approx, p)[0]
                moved = np.max(np.abs(runs.raw_logits((*approx, NULL), p["prompt_ids"]) - base), axis=1)
                apart = np.nonzero(~(moved <= own))[0]
                itself += int(apart[0]) if apart.size else int(moved.size)
                theirs = per_position.get(id(f))
                if theirs is not None and len(theirs) == len(moved):
                    theirs = np.nan_to_num(np.asarray(theirs, dtype=np.float64), nan=np.inf)  # NaN: no agreement
                    diffs[0].append(theirs)
                    diffs[1].append(moved)
                    per_prompt_sizes[str(f.prompt)] = [float(np.median(theirs)), float(np.median(moved)),
                                                       int(moved.size)]
            if diffs[0] and len(diffs[0]) == len(logit):  # every prompt's positions, pooled (as the streams')
                e, j = np.concatenate(diffs[0]), np.concatenate(diffs[1])
                logit_sizes = {"median": float(np.median(e)), "null": float(np.median(j)), "positions": int(e.size),
                               "per_prompt": per_prompt_sizes}
            detail = dict(positions=total, agreeing=agree, reference_agreeing=itself, on="logits",
                          per_prompt={str(f.prompt): [f.detail["agreeing_prefix"], f.detail["positions"]]
                                      for f in logit})
            instead = "the mean KLD is gated against the 8-bit yardstick instead"
            # a count of leading runs under one position per prompt has no resolution (as for streams below):
            # measured, e2b F16 through the llamacpp engine, the input-jittered reference 2 over 6 prompts and the
            # correct engine 0 (a false alarm); with NULL, 0 over 8 (tests/quant_logits_only.py e2b-f16); the sizes
            # judge there (median_abs_logit, MEDIAN_LOGIT_WHY in harness/core/gates.py)
            floor = len(logit)
        elif streams:  # an engine without logits: its greedy streams' log-probs (stream_agreement)
            f = streams[0]
            own = DEFAULT_GATES[head + "max_abs_logprob"].limit
            agree, itself = f.detail["agreeing_prefix"], f.detail["reference_agreeing"]
            detail = dict(positions=f.detail["positions"], agreeing=agree, reference_agreeing=itself,
                          on=("log-probs along the greedy streams (prompt positions where offered or probed by "
                              "prefix, then each step)"),
                          per_prompt=f.detail["per_prompt"])
            instead = "the greedy streams gate alone"
            # a count of leading runs under one position per stream has no resolution: measured, the e2b F16 file
            # on llama-server, the jittered reference 2 over 6 streams and the correct server 0 (a false alarm)
            floor = len(f.detail["per_prompt"])
        if detail is not None and seeded:  # reported: the per-layer figure judges
            detail["reference_agreeing"] = None
            figures.append(fig(f"{pair}_q8.agreeing_positions", float("nan"), None, **detail,
                               informational_reason=LOCAL_JUDGES))
        elif detail is not None:
            sizes = streams[0].detail if streams and not logit else None  # a server's: windows, medians
            win = (sizes or {}).get("windows")
            if sizes is not None:  # the sizes of the differences: gated where neither count has resolution
                med, null_med = sizes.get("median_abs_logprob"), sizes.get("reference_median_abs_logprob")
                judged_by_count = itself >= floor or (win is not None and win["reference_agreeing"] >= win["floor"])
                if med is not None and null_med is not None:
                    extra = {} if not judged_by_count else {"informational_reason": MEDIAN_REPORTED}
                    figures.append(fig(f"{pair}_q8.median_abs_logprob", med, None, effect=null_med, null=null_med,
                                       positions=detail["positions"], **extra))
            if logit_sizes is not None:  # the sizes of the differences on logits: gated where the count has none
                extra = {} if itself < floor else {"informational_reason": MEDIAN_LOGIT_REPORTED}
                figures.append(fig(f"{pair}_q8.median_abs_logit", logit_sizes["median"], None,
                                   effect=logit_sizes["null"], null=logit_sizes["null"],
                                   positions=logit_sizes["positions"], per_prompt=logit_sizes["per_prompt"],
                                   on="logits: per position, the max |dlogit| over the vocabulary", **extra))
            if itself < floor and win is not None and win["reference_agreeing"] >= win["floor"]:
                # the streams' leading runs have no resolution, the windows have (WINDOWS_WHY): they judge
                figures.append(fig(f"{pair}_q8.agreeing_positions", win["agreeing"] / win["reference_agreeing"], None,
                                   **{**detail, "positions": win["positions"], "agreeing": win["agreeing"],
                                      "reference_agreeing": win["reference_agreeing"],
                                      "on": "windows [BOS, token], one position each (WINDOWS_WHY)",
                                      "streams": [agree, itself, detail["positions"]], "windows": win}))
            elif itself < floor and sizes is not None and med is not None and med == med and null_med == null_med:
                # neither the streams nor the windows: flips too dense to count; median_abs_logprob judges
                figures.append(fig(f"{pair}_q8.agreeing_positions", float("nan"), None, **detail,
                                   **({"windows": win} if win else {}), informational_reason=SIZES_JUDGE))
            elif itself < floor and logit_sizes is not None and logit_sizes["null"] == logit_sizes["null"]:
                # logits whose leading runs have no resolution: flips too dense to count; median_abs_logit judges
                figures.append(fig(f"{pair}_q8.agreeing_positions", float("nan"), None, **detail,
                                   informational_reason=SIZES_JUDGE_LOGITS))
            elif itself < floor:
                over = "prompts" if logit else "streams"
                dense = (f"{'no position' if itself == 0 else f'{itself} position(s) over {floor} {over}'} of the "
                         f"emulating reference agree(s) with itself within {own:g} once its fp32 sums move in their "
                         "last bits: int8 rounding flips are too dense on this model to judge by positions; "
                         f"{instead}")
                figures.append(fig(f"{pair}_q8.agreeing_positions", float("nan"), None, **detail,
                                   informational_reason=dense, no_resolution=instead))
            else:
                figures.append(fig(f"{pair}_q8.agreeing_positions", agree / itself, None, **detail))
    yardstick: list[Figure] = []  # the streams' yardstick figure of an engine without logits, added after the loop
    for f in figures:
        if not f.gate.startswith(head) or f.gate[len(head):] not in Q8_METRICS:
            continue
        metric = f.gate[len(head):]
        if gap is None and dense is not None and metric == "mean_kld" and str(f.prompt) in by_id:
            p = by_id[str(f.prompt)]
            yard = float(kld_stats(runs.logits((), p)[0], runs.logits(YARDSTICK, p)[0]).mean_kld)
            f.gate = f"{pair}_q8x.mean_kld"
            f.detail.pop("effect", None)
            f.detail.update(effect=yard, effect_power=1, yardstick=yard, quantized_activations=f"emulated; {dense}")
            continue
        if gap is None:
            f.gate = f"{pair}_q8.{metric}"
            if "effect" in f.detail:
                f.detail["effect_not_applied"] = f.detail.pop("effect")
                f.detail.pop("effect_power", None)
            f.detail["quantized_activations"] = f"emulated ({'/'.join(types)})"
            if metric in Q8_REPORTED:
                f.detail["informational_reason"] = Q8_REPORTED_WHY
            continue
        why = QUANTIZED_ACTIVATIONS.format(engine=kind, types="/".join(types), why=gap, pair=pair)
        kld = f.detail.get("stream_kld") if metric == "max_abs_logprob" else None
        if kld is not None:  # an engine without logits: its streams' KLD on the top-N bins (stream_kld) judges
            yardstick.append(fig(f"{pair}_q8x.mean_kld", kld["mean_kld"], None, effect=kld["yardstick"],
                                 effect_power=1, yardstick=kld["yardstick"], positions=kld["positions"],
                                 per_prompt=kld["per_prompt"], on=STREAM_KLD_ON,
                                 quantized_activations=f"not emulated: {gap}",
                                 **({} if kld["positions"] else {"not_measured": NO_STREAM_ROWS})))
        p = by_id.get(str(f.prompt))
        if metric == "mean_kld" and p is not None:
            exact = runs.logits((), p)[0]
            yard = float(kld_stats(exact, runs.logits(YARDSTICK, p)[0]).mean_kld)
            f.gate = f"{pair}_q8x.mean_kld"
            f.detail.update(effect=yard + float(f.detail.get("effect") or 0.0), effect_power=1, yardstick=yard,
                            quantized_activations=f"not emulated: {gap}")
        else:
            f.detail["informational_reason"] = why
    figures += yardstick


STREAM_KLD_ON = ("log-probs along the greedy streams (stream_rows' positions): the KLD coarsened to the ids the "
                 "engine named plus one bin for the rest, a lower bound of the full KLD (binned_kld), against the "
                 "yardstick's on the same bins")
"""What ``<pair>_q8x.mean_kld`` is measured on for an engine that gives log-probs, not logits."""

NO_STREAM_ROWS = ("no position with log-probs to compare: every greedy stream ended before its first token (an "
                  "end-of-sequence at once) and no prompt log-probs were offered")
"""Why the streams' ``<pair>_q8x.mean_kld`` was not measured (reported as such, never a pass, not a failure)."""


MEDIAN_REPORTED = ("reported, not gated: agreeing_positions judges (its null has resolution, on the streams or on "
                   "the windows)")
"""Why ``median_abs_logprob`` is reported where the counts judge (:data:`harness.core.gates.Q8_MEDIAN_WHY`)."""

SIZES_JUDGE = ("reported, not gated: the null agrees on fewer positions than one per stream and on fewer windows than "
               "the floor (rounding flips too dense to count agreeing positions); median_abs_logprob judges")
"""Why ``agreeing_positions`` is reported where ``median_abs_logprob`` judges."""

MEDIAN_LOGIT_REPORTED = ("reported, not gated: agreeing_positions judges (its null agrees on at least one position "
                         "per prompt)")
"""Why ``median_abs_logit`` is reported where the count judges (:data:`harness.core.gates.Q8_MEDIAN_LOGIT_WHY`)."""

SIZES_JUDGE_LOGITS = ("reported, not gated: the null agrees on fewer positions than one per prompt (rounding flips too "
                      "dense to count agreeing positions); median_abs_logit judges")
"""Why ``agreeing_positions`` on logits is reported where ``median_abs_logit`` judges."""

LOCAL_JUDGES = ("reported, not gated: the engine gave its tensors, and local_median judges each layer on its own "
                "(re-seeded from the engine's stream, so that an int8 rounding flip cannot carry into the layers after "
                "it)")
"""Why ``agreeing_positions`` is reported where ``local_median`` gates the pair."""


def poisson_cdf(k: int, lam: float) -> float:
    """P(X <= k) for X Poisson of mean ``lam`` (0 for k < 0)."""
    if k < 0:
        return 0.0
    if lam <= 0:
        return 1.0
    return min(1.0, sum(math.exp(-lam + i * math.log(lam) - math.lgamma(i + 1)) for i in range(k + 1)))


@functools.lru_cache(maxsize=None)
def flips_explained(n_null: int, alpha: float = Q8_LOCAL_ALPHA) -> int:
    """The most positions of a trace point that int8 rounding flips explain in the engine's errors, given that the
    null (the jittered re-seeded reference) has ``n_null`` beyond the same limit: the upper bound ``u`` of a Poisson
    rate that gives at most ``n_null`` with probability ``alpha``, then the least ``m`` that a Poisson count of mean
    ``EFFECT_FACTOR * u`` exceeds with probability at most ``alpha`` (Q8_LOCAL_WHY in harness/core/gates.py).
    0 -> 36, 1 -> 44, 5 -> 64 at alpha 1e-4."""
    lo, hi = 0.0, n_null + 10.0 * math.sqrt(n_null + 1) + 50.0
    for _ in range(100):  # bisection: the cdf falls as the rate grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if poisson_cdf(n_null, mid) > alpha else (lo, mid)
    lam = EFFECT_FACTOR * hi
    m, cdf = 0, math.exp(-lam)
    while 1.0 - cdf > alpha:  # the cdf summed term by term
        m += 1
        cdf += math.exp(-lam + m * math.log(lam) - math.lgamma(m + 1))
    return m


def local_figure(pair: str, per_prompt: Sequence[Figure]) -> Figure:
    """``<pair>_q8.local_median``: for each trace point (point, layer), the per-position relative L2 of the engine
    against the emulating reference re-seeded from the engine's own stream (:meth:`ReferenceRuns.reseeded`,
    :func:`.reference_runs.local_errors`, in each figure of ``per_prompt`` as ``_errors``), over every position of every
    prompt, taken at the rank flips allow. The limit is ``max(floor, 2 x effect)``, the effect the worst point's median
    of the null (the jittered re-seeded reference against the re-seeded one: what the emulation leaves). Per point, the
    null's positions beyond that limit give ``m`` (:func:`flips_explained`: the most that int8 rounding flips explain),
    and the point's figure is its (m+1)-th largest error, at most the median's rank: beyond the limit exactly when more
    than ``m`` positions are. A fault in a matrix moves every position that uses it by a like relative amount: most
    positions, or for one MoE expert the minority routed to it; a flip moves one position (and, through its keys and
    values, the later ones by less), and flips are rare. The figure is the worst point's; names the first point in trace
    order beyond the limit (``first_divergence``, ``point@layer``)."""
    pooled: dict[tuple[str, int], tuple[list, list]] = {}
    for f in per_prompt:
        for k, (e, j) in f.detail["_errors"].items():
            pooled.setdefault(k, ([], []))
            pooled[k][0].append(e)
            pooled[k][1].append(j)
    pooled_e = {k: (np.concatenate(e), np.concatenate(j)) for k, (e, j) in pooled.items()}
    null = max(float(np.median(j)) for _, j in pooled_e.values())
    limit = effect_limit(DEFAULT_GATES[f"{pair}_q8.local_median"], null)
    rows = []  # (key, figure, null median, positions, beyond, null beyond, flips explained)
    for k, (e, j) in pooled_e.items():
        beyond, null_beyond = int(np.sum(~(e <= limit))), int(np.sum(~(j <= limit)))
        m = min(flips_explained(null_beyond), (e.size - 1) // 2)
        value = float(-np.sort(-np.nan_to_num(e, nan=np.inf))[m])  # the (m+1)-th largest
        rows.append((k, value, float(np.median(j)), int(e.size), beyond, null_beyond, m))
    worst = max(rows, key=lambda r: r[1] if r[1] == r[1] else float("inf"))
    first = next((r for r in rows if not r[1] <= limit), None)
    where = None if first is None else f"{first[0][0]}@{first[0][1]}"
    said = {} if first is None else {"why": (
        f"first diverging layer {first[0][1]} ({where}): {first[4]} of {first[3]} positions beyond {limit:.3g}, "
        f"where rounding flips explain at most {first[6]} (the emulation itself leaves {first[5]} beyond it, a "
        f"median of {first[2]:.3g}); the relative L2 of rank {first[6] + 1} from the top is {first[1]:.3g}")}
    return fig(f"{pair}_q8.local_median", worst[1], None, worst_point=f"{worst[0][0]}@{worst[0][1]}",
               first_divergence=where, first_layer=None if first is None else first[0][1], effect=null,
               null=null, prompts=len(per_prompt), points=len(rows), **said,
               per_point=[[k[0], k[1], v] for k, v, *_ in rows],  # [point, layer, rel_l2] as every figure's
               null_per_point=[[k[0], k[1], j] for k, _, j, *_ in rows],
               # [point, layer, positions beyond the limit, the null's, flips explained] where any moved
               moved_per_point=[[k[0], k[1], b, nb, m] for k, _, _, _, b, nb, m in rows if b or nb])


NULL = "jitter_sums"
"""The null of ``agreeing_positions``, on logits (:func:`quantized_gates`) and on streams (:func:`stream_agreement`,
:func:`window_agreement`): the emulating reference with every product's *output* moved in its last
fp32 bits (:func:`harness.engines.llamacpp.numerics.jitter_sums_numerics`: fp32 sums in another order, what an engine
that rounds exactly as the emulation does still computes differently). Not the input jitter (``jitter``): that one
also moves the inputs a server computes bit for bit as the reference does (the first layer's norm of a quantized
embedding row, whose exact .5 ties are common), so it flips int8 roundings no correct engine flips, at the first
prompt positions. Measured, six text prompts, 8 new tokens, the input jitter agreeing with itself on 4 positions over
6 streams where llama-cpp-python's correct server agreed on 12 (e2b Q4_1) and 69 (IQ4_NL): a null noisier than the
engine it judges, under the floor of one position per stream, and every fault passed (docs/quantized-activations.md).
On logits likewise (issue 34; tests/quant_logits_only.py, the 8 synthetic prompts, 217 positions): on the PLE Q4_0 file
of tests/test_local_gate.py the input jitter agreed with itself on no position (the pair fell back to the 8-bit
yardstick, which passed rows x1.02 and one block x1.5), the sums jitter on 52, the correct engines on 39 and 51, each
fault on 0. The same null as ``local_median``'s (:meth:`.reference_runs.ReferenceRuns.reseeded`)."""


def _agreeing_run(diffs: Sequence[float | None], bound: float) -> tuple[int, int]:
    """``(leading run, positions)`` of per-position differences: the positions before the first one above ``bound``,
    and the positions counted; None (a position one side left without log-probs) is neither."""
    run, seen, apart = 0, 0, False
    for d in diffs:
        if d is None:
            continue
        seen += 1
        apart = apart or not d <= bound
        run += not apart
    return run, seen


@dataclass
class StreamRows:
    """The positions of an engine's greedy streams where its log-probs can be set beside the oracle's
    (:func:`stream_rows`), one entry per stream that has tokens, in prompt order.

    Attributes:
        rids: the prompts' ids.
        prompts: each prompt's token ids.
        forced: the engine's tokens to teacher-force after each prompt (up to the last one it named).
        compared: per stream, ``(row, {token id: log-prob})``: the row of the oracle's logits of the prompt and
            ``forced`` (a prefill, then a decode step per token: :meth:`ReferenceRuns.decoded_logits`) that the
            engine's log-probs stand beside, and the ids the engine gave there (ids < 0 left out).
    """

    rids: list[str]
    prompts: list[list[int]]
    forced: list[list[int]]
    compared: list[list[tuple[int, dict[int, float]]]]


def stream_rows(eng: Any, prompts: Sequence[dict[str, Any]], streams: dict[str, dict[str, Any]],
                top_n: int = TOP_N) -> StreamRows:
    """The positions of :class:`StreamRows` for an engine that gives log-probs, not logits: the prompt's where the
    engine reports prompt log-probs (``offers_prompt_logprobs``,
    :meth:`harness.engines.openai.OpenAIEngine.prompt_logprobs`: the prompt token and the top-``top_n``) or gives
    them for one token after each prefix (``probes_prompt_logprobs``, llama-server: the top-``top_n``), then every
    generated step of ``streams`` (as :func:`harness.parity.compare.as_streams` gives them) up to the first step
    whose token the engine left unnamed (-1: its log-probs still count, the context after it is unknown).

    Raises:
        EngineFailure: the engine failed a prompt log-probs request (its ``index`` in ``prompts``).
    """
    ids = {str(p["id"]): [int(t) for t in p["prompt_ids"]] for p in prompts}
    rids = [rid for rid in ids if streams.get(rid, {}).get("tokens")]
    prompt_lp: dict[str, list] = {}
    ask = (eng.prompt_logprobs if getattr(eng, "offers_prompt_logprobs", False)
           else eng.prefix_logprobs if getattr(eng, "probes_prompt_logprobs", False) else None)
    if ask is not None:
        for k, rid in ((k, rid) for k, rid in enumerate(ids) if rid in rids):
            try:
                prompt_lp[rid] = ask(ids[rid], top_n)
            except EngineFailure as e:
                raise e.at(index=k)
    rows = StreamRows([], [], [], [])
    for rid in rids:
        toks = list(streams[rid]["tokens"])
        last = toks.index(-1) if -1 in toks else len(toks) - 1
        compared: list[tuple[int, dict[int, float]]] = []
        for i, entry in enumerate(prompt_lp.get(rid, [])):
            if entry is not None and 0 < i < len(ids[rid]):
                given = {} if entry[0] is None else {ids[rid][i]: float(entry[0])}
                compared.append((i - 1, {**dict(entry[1]), **given}))
        start = len(ids[rid]) - 1
        compared += [(start + s, {int(k): float(v) for k, v in d.items() if int(k) >= 0})
                     for s, d in enumerate(streams[rid]["logprobs"][:last + 1])]
        rows.rids.append(rid)
        rows.prompts.append(ids[rid])
        rows.forced.append(toks[:last])
        rows.compared.append(compared)
    return rows


def stream_agreement(runs: ReferenceRuns, eng: Any, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]],
                     streams: dict[str, dict[str, Any]], bound: float, top_n: int = TOP_N) -> dict[str, Any]:
    """For an engine that gives log-probs, not logits (a server, a ``cmd:`` engine without ``logits``) and rounds its
    activations (``quantized_activations`` in ``approx``, emulated): per greedy stream, the leading run of positions
    whose returned log-probs agree with the emulating oracle's for the same ids within ``bound`` (the fp32 bound of
    ``max_abs_logprob``), and the same run for the emulating oracle against itself with its fp32 sums jittered
    (``(*approx, NULL)``, :data:`NULL`, :func:`harness.engines.llamacpp.numerics.jitter_sums_numerics`) on the same
    tokens, positions and ids. The positions are :func:`stream_rows`' (the prompt's where the engine reports or is
    probed for them: without them its streams start where an int8 flip has had a whole prompt to spread, and the
    jittered reference agreed on none of them on e2b Q8_0; then every generated step); the oracle runs
    teacher-forced on the prompt and the
    engine's own tokens, a prefill of the prompt then a decode step per token as the engine ran them
    (:meth:`ReferenceRuns.decoded_logits`), so a stream that parts from the oracle's or stops at EOS is still
    compared where it went. Only ids the engine returned are compared (the oracle has every id); ``top_n``: the
    log-probs asked per prompt position.

    Returns:
        ``agreeing_prefix``, ``positions`` and ``reference_agreeing`` summed over the streams, ``per_prompt``
        ``{id: [agreeing, positions, reference_agreeing]}``, ``agreement_on`` (``log-probs``: what
        :func:`quantized_gates` reads), ``median_abs_logprob`` and ``reference_median_abs_logprob``: the median over
        every compared position of every stream of the engine's difference (the largest over the ids compared there)
        and of the null's (:data:`MEDIAN_WHY`; NaN where no position was compared).

    Raises:
        EngineFailure: the engine failed a prompt log-probs request (its ``index`` in ``prompts``).
    """
    rows = stream_rows(eng, prompts, streams, top_n)
    emulated = runs.decoded_logits(approx, rows.prompts, rows.forced)
    jittered = runs.decoded_logits((*approx, NULL), rows.prompts, rows.forced)
    out = {"agreeing_prefix": 0, "positions": 0, "reference_agreeing": 0, "per_prompt": {},
           "agreement_on": "log-probs"}
    sizes: tuple[list[float], list[float]] = ([], [])  # every compared position's difference: the engine's, the null's
    for rid, compared, z, zj in zip(rows.rids, rows.compared, emulated, jittered):
        lp, jit = log_softmax(z), log_softmax(zj)
        theirs = [max((abs(v - lp[row, k]) for k, v in d.items()), default=None) for row, d in compared]
        itself = [max((abs(jit[row, k] - lp[row, k]) for k in d), default=None) for row, d in compared]
        agree, seen = _agreeing_run(theirs, bound)
        own, _ = _agreeing_run(itself, bound)
        out["per_prompt"][rid] = [agree, seen, own]
        out["agreeing_prefix"] += agree
        out["positions"] += seen
        out["reference_agreeing"] += own
        for d, e in zip(theirs, itself):
            if d is not None and e is not None:
                sizes[0].append(float(d))
                sizes[1].append(float(e))
    # the sizes of the differences, for where the leading runs have no resolution (MEDIAN)
    # (a NaN log-prob counts as an infinite difference)
    out["median_abs_logprob"], out["reference_median_abs_logprob"] = (
        float(np.median(np.nan_to_num(v, nan=np.inf))) if v else float("nan") for v in sizes)
    if out["reference_agreeing"] < len(rows.rids):  # the leading runs have no resolution: ask the windows (WINDOWS_WHY)
        out["windows"] = window_agreement(runs, eng, approx, rows.prompts, bound, top_n)
    return out


def stream_kld(runs: ReferenceRuns, eng: Any, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]],
               streams: dict[str, dict[str, Any]], top_n: int = TOP_N) -> dict[str, Any]:
    """For an engine that gives log-probs, not logits, and rounds its activations in a way the oracle cannot emulate
    (:meth:`ReferenceRuns.emulation_gap`; ``approx`` holds the rest of its declared numerics): at each position of
    :func:`stream_rows`, the KLD of the oracle's distribution to the engine's, coarsened to the ids the engine named
    plus one bin for the rest (:func:`harness.core.metrics.binned_kld`: a lower bound of the full KLD), and the same
    for the yardstick (the oracle with every quantized product's input rounded to 8 bits, ``(*approx, *YARDSTICK)``,
    :func:`harness.engines.llamacpp.numerics.coarse_q8_numerics`) on the same bins; the oracle teacher-forced on the
    engine's tokens as in :func:`stream_agreement`. What ``<pair>_q8x.mean_kld`` judges for such an engine, as it
    judges the full KLD of one that gives logits (:func:`quantized_gates`).

    Returns:
        ``stream_kld``: ``{"mean_kld", "yardstick", "positions", "per_prompt": {id: [mean_kld, yardstick,
        positions]}}``, the means over every compared position (NaN where none was; a NaN log-prob of the engine's
        makes its mean NaN).

    Raises:
        EngineFailure: the engine failed a prompt log-probs request (its ``index`` in ``prompts``).
    """
    rows = stream_rows(eng, prompts, streams, top_n)
    exact = runs.decoded_logits(approx, rows.prompts, rows.forced)
    yard = runs.decoded_logits((*approx, *YARDSTICK), rows.prompts, rows.forced)
    theirs: list[float] = []
    ruler: list[float] = []
    per_prompt = {}
    for rid, compared, z, zy in zip(rows.rids, rows.compared, exact, yard):
        lp, ly = log_softmax(z), log_softmax(zy)
        mine, yours = [], []
        for row, d in compared:
            if d:
                named = list(d)
                mine.append(binned_kld(np.array([d[k] for k in named]), lp[row, named]))
                yours.append(binned_kld(ly[row, named], lp[row, named]))
        per_prompt[rid] = [float(np.mean(mine)) if mine else float("nan"),
                           float(np.mean(yours)) if yours else float("nan"), len(mine)]
        theirs += mine
        ruler += yours
    mean = (lambda v: float(np.mean(v)) if v else float("nan"))
    return {"stream_kld": {"mean_kld": mean(theirs), "yardstick": mean(ruler), "positions": len(theirs),
                           "per_prompt": per_prompt}}


WINDOWS = 64
"""The most windows :func:`window_agreement` asks (the first distinct ones in prompt order): a bound on the cost of
a long prompt set (one request and two short reference forwards each)."""

WINDOWS_WHY = (
    "windows: where the leading runs of the streams have no resolution (the null agrees on fewer positions than one "
    "per stream: int8 rounding flips so frequent that most streams part at their first rows), each distinct prompt "
    "token after the first (BOS) is asked again as a prompt of its own, [BOS, token], for one greedy token with its "
    "top-N log-probs: the shortest context, whose only compared row is the one after it. Each is a request of its "
    "own, a prefill from BOS, so a flip in one cannot carry into another (in a stream it carries, through the keys "
    "and values, into every later row), and two rows hold the fewest int8 roundings a flip can hit. Counted as the "
    "streams are (agreeing within the fp32 bound, the engine and the null), one position per window; judged where "
    "the null agrees on at least WINDOW_FLOOR of them")


def window_floor(ratio: float | None = None, alpha: float = Q8_LOCAL_ALPHA) -> int:
    """The least count of the null's agreeing windows with which :func:`window_agreement` judges: the least ``n``
    such that a Poisson count of mean ``n`` (a correct engine's count under the null's law: independent windows,
    each agreeing with a small probability) falls under ``ratio * n`` (the limit of ``agreeing_positions``,
    :data:`harness.core.gates.Q8_AGREEING`) with probability at most ``alpha`` (the rate of false alarms that
    ``local_median`` allows, :data:`harness.core.gates.Q8_LOCAL_ALPHA`). 14 at 0.2 and 1e-4."""
    ratio = Q8_AGREEING if ratio is None else ratio
    n = 1
    while poisson_cdf(math.ceil(ratio * n) - 1, n) > alpha:
        n += 1
    return n


def window_agreement(runs: ReferenceRuns, eng: Any, approx: tuple[str, ...], prompts: Sequence[Sequence[int]],
                     bound: float, top_n: int = TOP_N) -> dict[str, Any]:
    """The windows of :data:`WINDOWS_WHY`: for each distinct token after the first of ``prompts`` (ids; at most
    :data:`WINDOWS`), the prompt ``[prompt[0], token]`` asked of ``eng`` for one greedy token with its top-``top_n``
    log-probs; whether they agree with the emulating reference's (a prefill of the two tokens,
    :meth:`ReferenceRuns.decoded_logits` under ``approx``) within ``bound`` on the ids the engine named, and whether
    the null's do (``(*approx, NULL)``). A window the engine cannot be asked (llama-cpp-python: ids that do not
    survive its text round trip, an :class:`InputError`) is left out and counted in ``skipped``.

    Returns:
        ``positions`` (windows compared), ``agreeing``, ``reference_agreeing``, ``skipped``, ``floor``
        (:func:`window_floor`), ``median_abs_logprob`` and ``reference_median_abs_logprob`` over the windows.

    Raises:
        EngineFailure: the engine failed a window's request (its ``index`` among the windows).
    """
    wins: list[list[int]] = []
    for ids in prompts:
        for t in ids[1:]:
            w = [int(ids[0]), int(t)]
            if w not in wins and len(wins) < WINDOWS:
                wins.append(w)
    asked, tops, skipped = [], [], 0
    for k, w in enumerate(wins):
        try:
            g = eng.generate_full([w], 1, top_n=top_n)[0]
        except InputError:
            skipped += 1
            continue
        except EngineFailure as e:
            raise e.at(index=k)
        if g.top and g.top[0]:
            asked.append(w)
            tops.append({int(i): float(v) for i, v in g.top[0] if int(i) >= 0})
    # the reference's rows of a window do not depend on the engine: kept on ``runs`` for the next engine judged
    # against it (the null's one-by-one forwards cost minutes on a real model)
    kept = runs.__dict__.setdefault("_window_rows", {})
    todo = [w for w in asked if (approx, tuple(w)) not in kept]
    if todo:
        for w, z, zj in zip(todo, runs.decoded_logits(approx, todo, [[] for _ in todo]),
                            runs.decoded_logits((*approx, NULL), todo, [[] for _ in todo])):
            kept[(approx, tuple(w))] = (z[-1], zj[-1])
    emulated = [kept[(approx, tuple(w))][0][None] for w in asked]
    jittered = [kept[(approx, tuple(w))][1][None] for w in asked]
    theirs, itself = [], []
    for top, z, zj in zip(tops, emulated, jittered):
        lp, jit = log_softmax(z[-1:])[0], log_softmax(zj[-1:])[0]
        theirs.append(max((abs(v - lp[i]) for i, v in top.items()), default=float("nan")))
        itself.append(max((abs(jit[i] - lp[i]) for i in top), default=float("nan")))
    e, j = np.nan_to_num(np.array(theirs, dtype=float), nan=np.inf), np.array(itself, dtype=float)
    return {"positions": len(asked), "agreeing": int(np.sum(e <= bound)), "reference_agreeing": int(np.sum(j <= bound)),
            "skipped": skipped, "floor": window_floor(),
            "median_abs_logprob": float(np.median(e)) if e.size else float("nan"),
            "reference_median_abs_logprob": float(np.median(j)) if j.size else float("nan")}
