"""Comparing outputs an engine already wrote (``g4h compare``): the shortest way in for an engine author.

Two kinds of file, compared against an oracle's:

* logits, ``.npy`` ``[T, V]`` (what ``g4h logits`` writes): max |Δlogit|, the llama-perplexity KLD set,
  same top-1 at every decisive position (near-ties, where the oracle's top-1 margin is below
  :data:`harness.core.gates.NEAR_TIE_MARGIN`, are reported, not failed);
* greedy continuations, ``.jsonl`` (what ``g4h generate`` writes: ``{"id", "tokens", "top_logprobs"}`` a line;
  ``top5``, the key's earlier name, is read too):
  vLLM's greedy rule per stream, each divergence classified as a near-tie or a real fault, and the
  largest |Δ log-prob| over the shared top-N tokens on the agreed prefix.

The oracle side is a second file, or computed on the spot by an engine (``--against reference --model M``).
Gates: ``oracle~engine.*`` for an fp32 engine, ``oracle~engine_bf16.*`` for a 16-bit one
(:mod:`harness.core.gates`). Checks measure; :func:`judge` applies the gates.

The metric functions here are the pair pipeline's, one set for every engine-vs-oracle comparison: ``g4h parity``'s
pairs (:func:`harness.parity.checks.pair.pair_checks`, which ``--model``, the built-in cases' engines, ``g4h sweep``
and the pytest plugin run), the trials of the spec-variant search (:class:`harness.parity.explain.TextSubject`:
``g4h explain`` and the parity job's explanation of a failing pair) and ``g4h compare``: per prompt
:func:`prompt_logit_figures` (over :func:`logit_figures`) and :func:`layer_figure`, over the greedy streams
:func:`generation_figures` (streams in the form :func:`as_streams` gives), with the near-tie margin of
:func:`near_tie_margin`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import open_regular, read_text

from ..core.gates import NEAR_TIE_MARGIN, resolve
from ..core.kld import kld_stats
from ..core.metrics import greedy_agreement, kld_histogram, kld_per_position, top1_margin
from ..traces.compare import DivergenceRule, compare
from ..traces.format import Trace
from .result import CaseResult, Figure, fig

PRECISIONS = {"fp32": "oracle~engine", "bf16": "oracle~engine_bf16"}
"""``--precision`` -> the gate pair that judges the engine."""


def load_logits(path: str | Path) -> np.ndarray:
    """A ``[T, V]`` logits file (``.npy``) as float64.

    Raises:
        InputError: unreadable, not a ``.npy`` array, not 2-D, or empty (the file is named).
    """
    try:
        with open_regular(path) as f:  # a regular file (never a FIFO or a device), as np.load may map it
            arr = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise InputError(f"{path}: not a readable .npy logits file ({str(e).splitlines()[0][:100]})") from None
    if arr.ndim != 2 or arr.size == 0:
        raise InputError(f"{path}: logits of shape {list(arr.shape)}, expected [tokens, vocab]")
    return np.asarray(arr, dtype=np.float64)


def load_generations(path: str | Path) -> dict[str, dict[str, Any]]:
    """A ``g4h generate`` output: ``{"id", "tokens", "top_logprobs"}`` per line (or ``top5``, its earlier name)
    -> ``{id: {"tokens", "top": [[ids]...],
    "logprobs": [{id: logprob}...]}}``.

    Raises:
        InputError: unreadable, not JSON lines of that shape, or a duplicate id (file and line named).
    """
    out: dict[str, dict[str, Any]] = {}
    lines = read_text(path).splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            toks = [int(t) for t in obj["tokens"]]
            key = "top_logprobs" if "top_logprobs" in obj else "top5"
            steps = [[(int(i), float(lp)) for i, lp in step] for step in obj[key]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise InputError(f"{path}:{n}: expected {{\"id\", \"tokens\": [int], "
                             f"\"top_logprobs\": [[[id, logprob], ...]]}}") from None
        if len(steps) != len(toks):
            raise InputError(f"{path}:{n}: {len(toks)} tokens but {len(steps)} top_logprobs steps")
        key = str(obj.get("id", n))
        if key in out:
            raise InputError(f"{path}:{n}: duplicate id {key!r}")
        out[key] = {"tokens": toks, "top": [[i for i, _ in s] for s in steps], "logprobs": [dict(s) for s in steps]}
    if not out:
        raise InputError(f"{path}: no generations")
    return out


def logit_figures(ours: np.ndarray, oracle: np.ndarray, pair: str, prompt: Any = None,
                  near_tie: float = NEAR_TIE_MARGIN) -> list[Figure]:
    """Figures of one logits comparison: ``<pair>.max_abs_logit``, ``.mean_kld`` (with its per-position histogram,
    ``kld_hist``, for the report's plot), ``.same_top1_decisive``
    (positions whose oracle top-1 margin is at least ``near_tie``: default
    :data:`~harness.core.gates.NEAR_TIE_MARGIN`, more for an engine whose declared approximations widen its bounds,
    :func:`near_tie_margin`).

    Raises:
        InputError: the shapes differ.
    """
    if ours.shape != oracle.shape:
        raise InputError(f"logits of shape {list(ours.shape)} against the oracle's {list(oracle.shape)}")
    d = np.abs(ours - oracle)
    st = kld_stats(ours, oracle)
    margin = top1_margin(oracle)
    a_ours, a_ref = np.argmax(ours, axis=1), np.argmax(oracle, axis=1)
    decisive = margin >= near_tie
    flips = [[int(i), int(a_ref[i]), int(a_ours[i]), float(margin[i])] for i in np.nonzero(a_ours != a_ref)[0]]
    same_decisive = float(np.mean(a_ours[decisive] == a_ref[decisive])) if decisive.any() else 1.0
    at = np.unravel_index(int(np.argmax(d)), d.shape)
    return [fig(f"{pair}.max_abs_logit", float(d.max()), prompt, positions=int(ours.shape[0]),
                max_abs_logit_at=[int(at[0]), int(at[1])]),
            fig(f"{pair}.mean_kld", float(st.mean_kld), prompt, positions=int(st.n), kld_p99=st.kld_p99_0,
                max_kld=st.maximum_kld, same_top1=float(st.same_top_p_pct) / 100.0,
                kld_hist=kld_histogram(kld_per_position(ours, oracle))),
            fig(f"{pair}.same_top1_decisive", same_decisive, prompt, near_ties=int((~decisive).sum()),
                top1_flips=flips[:20])]


def near_tie_margin(logprob_limit: float) -> float:
    """The top-1 margin below which two engines may order the best tokens differently: twice the bound on a
    log-prob difference (each side within it), at least :data:`harness.core.gates.NEAR_TIE_MARGIN`."""
    return max(NEAR_TIE_MARGIN, 2.0 * logprob_limit)


def prompt_logit_figures(ours: np.ndarray, base: np.ndarray, pair: str, prompt: Any, limit: float,
                         own_limit: float | None = None, oracle_name: str = "oracle") -> list[Figure]:
    """The logit figures of one prompt as every engine pair measures them: :func:`logit_figures` at the near-tie
    margin of ``limit`` (:func:`near_tie_margin`), with the worst position named (``why``), the first position whose
    max |Δlogit| is beyond ``limit`` (``first_divergence``: ``logits@position N``, None when none is), and
    ``agreeing_prefix`` (the leading positions within ``own_limit``, the gate's limit before the effect of declared
    approximations raised it; default ``limit``) of ``positions``.

    Args:
        ours, base: ``[T, V]`` logits of the engine and of the oracle (any float dtype; compared as given).
        pair: the gate prefix (``reference~cmd``); prompt: the prompt id.
        limit: the pair's ``max_abs_logit`` limit on this prompt (raised by the effect of the engine's declared
            approximations: :func:`harness.core.gates.effect_limit`); inf where the pair has no such gate (the
            near-tie margin is then :data:`~harness.core.gates.NEAR_TIE_MARGIN`).
        oracle_name: the oracle's name in ``why`` (``reference``, ``fast``).

    Raises:
        InputError: the shapes differ.
    """
    own = limit if own_limit is None else own_limit
    figs = logit_figures(ours, base, pair, prompt,  # no bound on the logits (no gate): the default margin
                         near_tie=near_tie_margin(limit) if np.isfinite(limit) else NEAR_TIE_MARGIN)
    pos, tok = figs[0].detail["max_abs_logit_at"]
    figs[0].detail["why"] = (f"worst at position {pos} (token {tok}): {ours[pos, tok]:.6g} vs {oracle_name} "
                             f"{base[pos, tok]:.6g}")
    per_position = np.max(np.abs(ours - base), axis=1)
    beyond = np.nonzero(~(per_position <= limit))[0]
    figs[0].detail["first_divergence"] = f"logits@position {int(beyond[0])}" if beyond.size else None
    apart = np.nonzero(~(per_position <= own))[0]
    figs[0].detail.update(agreeing_prefix=int(apart[0]) if apart.size else int(per_position.size),
                          positions=int(per_position.size))
    return figs


def layer_figure(ours: Trace, base: Trace, pair: str, prompt: Any, limit: float,
                 effect: float | None = None) -> Figure:
    """``<pair>.layer_rel_l2`` of one prompt as every engine pair measures it: the worst trace point (relative L2
    with tensors on both sides, else the checksum lower bound; a point whose error is NaN is the worst, so the
    figure is NaN and never a pass), the first point beyond ``limit`` (``first_divergence``: ``point@layer``), the
    bases, the points only the oracle traced (``missing``) and every point's error (``per_point``); NaN with ``got``
    when no point is in both traces.

    Args:
        ours, base: the engine's and the oracle's traces of the prompt.
        limit: the pair's ``layer_rel_l2`` limit (raised by ``effect`` already, when there is one).
        effect: how far the engine's declared approximations move the oracle's trace points (kept in the detail:
            :func:`harness.parity.result.CaseResult.apply` judges the figure at that raised limit).
    """
    res = compare(ours, base, DivergenceRule(tol=limit))
    if not res.rows:
        return fig(f"{pair}.layer_rel_l2", float("nan"), prompt, got="no trace point in common with the reference",
                   only_engine=res.only_a[:10])
    worst = max(res.rows, key=lambda r: r.err if r.err == r.err else float("inf"))
    first = res.first
    return fig(f"{pair}.layer_rel_l2", worst.err, prompt, worst_point=worst.where,
               first_divergence=None if first is None else first.where,
               basis=sorted({r.basis for r in res.rows}),
               **({"why": f"first divergence {first.where}: {first.why}"} if first else {}),
               **({"effect": effect} if effect is not None else {}),
               missing=res.only_b[:20], per_point=[[r.point, r.layer, r.err] for r in res.rows])


def as_streams(prompts: Sequence[dict[str, Any]], gens: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Generated objects (``tokens``, ``top``: :class:`harness.engines.base.Generated`) keyed by prompt id, in the
    form :func:`generation_figures` reads (``{"tokens", "top": [[ids]...], "logprobs": [{id: logprob}...]}``)."""
    return {str(p["id"]): {"tokens": list(g.tokens), "top": [[i for i, _ in s] for s in g.top],
                           "logprobs": [dict(s) for s in g.top]} for p, g in zip(prompts, gens)}


def generation_figures(ours: dict[str, dict[str, Any]], oracle: dict[str, dict[str, Any]], pair: str,
                       top_n: int = 5, logprob_limit: float | None = None,
                       near_tie: float = NEAR_TIE_MARGIN) -> list[Figure]:
    """Figures of greedy streams by vLLM's rule: ``<pair>.greedy`` (the fraction of streams that agree, each
    divergence classified) and ``<pair>.max_abs_logprob`` (shared top-N log-probs on the agreed prefix).

    A divergence passes when each token is in the other side's top-N (vLLM), or when the oracle's top-1/top-2
    log-prob margin at that step is below ``near_tie`` (a near-tie; default
    :data:`~harness.core.gates.NEAR_TIE_MARGIN`); else it is a real fault, named with the request, the step and
    both tokens. A divergence where our token is not the top-1 of our own log-probs is a fault whatever the rule
    says: a greedy engine never picks another token. Where our side has no log-probs at the divergent step (an engine
    that gives tokens only, a step a server left out), vLLM's rule cannot be applied (our top-N is unknown): the
    divergence passes only when our token is in the oracle's top-N there and its oracle log-prob is within
    ``near_tie`` of the oracle's top-1 (a near-tie), else it is a fault naming the step and both tokens. Two
    streams are compared over their common prefix (vLLM's ``zip``); an empty stream has none. The log-prob figure
    counts the ``steps`` it compared; with none (every stream parts at step 0, or no step has log-probs on both
    sides) it is marked ``not_measured`` with the reason (:meth:`CaseResult.apply`: never a pass). With
    ``logprob_limit`` (the log-prob gate's limit), the first place (request in order, step, token) beyond it is
    named as the log-prob figure's ``first_divergence``.

    Raises:
        InputError: the two sides hold different request ids.
    """
    if set(ours) != set(oracle):
        only = sorted(set(ours) ^ set(oracle))
        raise InputError(f"the two generation files hold different requests (e.g. {only[0]!r})")
    rows, worst_lp, worst_at, beyond, measured_steps = [], 0.0, None, None, 0
    for rid in oracle:  # in the order given (a file's order), so that "first" means first there
        a, b = ours[rid], oracle[rid]
        if not a["tokens"] or not b["tokens"]:
            rows.append({"request": rid, "kind": "identical", "reason": "an empty stream: no common prefix"})
            continue
        ga = greedy_agreement(a["tokens"], b["tokens"], a["top"], b["top"], n=top_n)
        stop = ga.first_mismatch if ga.first_mismatch is not None else ga.n_compared
        for step in range(stop):
            shared = set(a["logprobs"][step]) & set(b["logprobs"][step])
            measured_steps += bool(shared)
            for tok in sorted(shared):
                d = abs(a["logprobs"][step][tok] - b["logprobs"][step][tok])
                if beyond is None and logprob_limit is not None and d > logprob_limit:
                    beyond = (f"request {rid} step {step} token {tok}: ours {a['logprobs'][step][tok]:.6g}, "
                              f"oracle {b['logprobs'][step][tok]:.6g}")
                if d > worst_lp:
                    worst_lp = d
                    worst_at = (f"request {rid} step {step} token {tok}: ours {a['logprobs'][step][tok]:.6g}, "
                                f"oracle {b['logprobs'][step][tok]:.6g}")
        kind, reason = ("identical" if ga.first_mismatch is None else ("top-n" if ga.agree else "fault")), ga.reason
        i = ga.first_mismatch
        if i is not None and not a["logprobs"][i]:  # our tokens only here: the oracle's near-tie rule alone
            kind, reason = _token_only_verdict(a["tokens"][i], b["tokens"][i], b["logprobs"][i], i, top_n, near_tie)
        elif i is not None and not ga.agree:
            lp = sorted(b["logprobs"][i].values(), reverse=True)
            if len(lp) > 1 and lp[0] - lp[1] < near_tie:
                kind = "near-tie"
        if ga.first_mismatch is not None:
            own = a["logprobs"][ga.first_mismatch]
            mine = own.get(a["tokens"][ga.first_mismatch])
            if own and (mine is None or mine < max(own.values())):
                kind, reason = "fault", (f"step {ga.first_mismatch}: our token {a['tokens'][ga.first_mismatch]} is "
                                         f"not the top-1 of our own log-probs (not greedy)")
        row = {"request": rid, "kind": kind, "reason": reason}
        if ga.first_mismatch is not None:
            i = ga.first_mismatch
            row.update(step=i, ours=a["tokens"][i], oracle=b["tokens"][i])
        rows.append(row)
    ok = [r for r in rows if r["kind"] != "fault"]
    faults = [r for r in rows if r["kind"] == "fault"]
    first = faults[0] if faults else None
    where = (f"request {first['request']} step {first['step']}: ours {first['ours']}, oracle {first['oracle']}"
             if first else None)
    not_measured = None
    if not measured_steps:  # nothing to compare: the figure below is no measurement, and must not read as a pass
        if rows and all(r.get("step") == 0 for r in rows):
            not_measured = "the greedy streams part at step 0"
        elif all(not ours[r["request"]]["tokens"] or not oracle[r["request"]]["tokens"] for r in rows):
            not_measured = "no greedy stream has a token"
        else:
            not_measured = "no step of the agreed prefixes has log-probs on both sides"
    return [fig(f"{pair}.greedy", len(ok) / len(rows), None, streams=len(rows), top_n=top_n,
                identical=sum(r["kind"] == "identical" for r in rows),
                by_top_n=sum(r["kind"] == "top-n" for r in rows), near_ties=sum(r["kind"] == "near-tie" for r in rows),
                **({"first_fault": where, "first_divergence": where, "why": f"{where} ({first['reason']})"}
                   if first else {}),
                streams_detail=rows[:50]),
            fig(f"{pair}.max_abs_logprob", worst_lp, None, top_n=top_n, steps=measured_steps,
                **(({"worst_at": worst_at, "why": f"largest at {worst_at}"} if worst_at else {})
                   | ({"first_divergence": beyond, "why": f"first beyond {logprob_limit:g} at {beyond}"}
                      if beyond else {})
                   | ({"not_measured": not_measured} if not_measured else {})))]


def _token_only_verdict(ours: int, theirs: int, oracle_lp: dict[int, float], step: int, top_n: int,
                        near_tie: float) -> tuple[str, str]:
    """A divergent step where our side has no log-probs: ``near-tie`` when our token is in the oracle's top-``top_n``
    with a log-prob within ``near_tie`` of the oracle's top-1, else ``fault``; with the reason."""
    best = max(oracle_lp.values()) if oracle_lp else float("nan")
    ranked = sorted(oracle_lp, key=lambda t: -oracle_lp[t])[:top_n]
    if ours in ranked and best - oracle_lp[ours] < near_tie:
        return "near-tie", (f"first mismatch at step {step} ({ours} vs {theirs}), our log-probs unknown: our token is "
                            f"the oracle's rank {ranked.index(ours) + 1}, {best - oracle_lp[ours]:.3g} below its top-1 "
                            f"(a near-tie: < {near_tie:g})")
    where = (f"the oracle's rank {ranked.index(ours) + 1}, {best - oracle_lp[ours]:.3g} below its top-1 (not a "
             f"near-tie: >= {near_tie:g})" if ours in ranked else f"not in the oracle's top-{top_n}")
    return "fault", f"first mismatch at step {step} ({ours} vs {theirs}), our log-probs unknown: our token is {where}"


def judge(figures: Sequence[Figure], case: str, model: str) -> CaseResult:
    """Apply the gates to ``figures`` (the one place gating happens here)."""
    res = CaseResult(case=case, kind="compare", model=model)
    res.apply(figures, resolve(None, case))
    return res
