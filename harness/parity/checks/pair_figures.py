"""The figures of one open engine against the oracle, prompt by prompt: the measuring half of the pair pipeline.

:mod:`.pair` opens the engine, names the pair and turns a failure into its ``.runs`` figure; this module measures
what the engine answers (:func:`_measure_figures`, which :func:`.pair._measure` calls with the emulations the
engine's declared numerics ask of the oracle):

* logits per prompt (:func:`engine_logits`, several in one call where the engine has ``logits_many``:
  :func:`_logits_many`) -> :func:`_logit_figures`, with the effect of the emulations (:func:`logit_effect`) raising
  the gates and the figures against the exact oracle beside (``vs_exact_reference``);
* trace points per prompt, in-process or read from a ``cmd:`` engine's trace file (:func:`_read_engine_trace`) ->
  :func:`_layer_figure` (the effect on the points: :func:`trace_effect`), and under ``quantized_activations`` each
  prompt's ``<pair>_q8.local_median`` (:func:`_local_figures`);
* greedy streams -> :func:`harness.parity.compare.generation_figures`; a token that is not the top-1 of the
  engine's own log-probs (:func:`not_greedy`) is an engine failure (:func:`_not_greedy_failure`), said with what
  differs in decoding there.

An engine failure raised here names its request and step (:func:`_naming`). The metric functions are
:mod:`harness.parity.compare`'s, the one set every engine-vs-oracle comparison measures with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ...core.engine_kinds import ORACLE
from ...core.gates import DEFAULT_GATES, effect_limit
from ...core.kld import kld_stats
from ...core.workers import EngineFailure, EngineProtocolError, temp_folder
from ...traces.compare import DivergenceRule, compare
from ...traces.format import Trace, TraceWriter, read_trace
from ...traces.store import default_store
from ..compare import as_streams, generation_figures, layer_figure, logit_figures, near_tie_margin, prompt_logit_figures
from ..explain_decoding import decoding_by_logprobs
from ..result import Figure, fig, one_line
from .quantized import stream_agreement, stream_kld
from .reference_runs import ReferenceRuns

Progress = Callable[[str], None]


def _can(eng: Any, op: str) -> bool:
    """Whether the engine answers ``op`` (``logits``, ``generate``, ``trace``)."""
    ops = getattr(eng, "ops", None)
    if ops is not None:
        return op in ops
    return op == "trace" or hasattr(eng, "generate_full" if op == "generate" else op)


def logit_effect(runs: ReferenceRuns, approx: tuple[str, ...], p: dict[str, Any]) -> tuple[float, float]:
    """How far the emulations ``approx`` move the oracle's logits of prompt ``p``: ``(max |Δlogit|, mean KLD)`` of
    the oracle with them against the oracle without them; ``(0, 0)`` without emulations. The effect that raises the
    pair's ``max_abs_logit`` and ``mean_kld`` gates (:func:`harness.core.gates.effect_limit`)."""
    if not approx:
        return 0.0, 0.0
    base, exact = runs.logits(approx, p)[0], runs.logits((), p)[0]
    return float(np.max(np.abs(base - exact))), float(kld_stats(exact, base).mean_kld)


def trace_effect(base: Trace, exact: Trace, tol: float) -> float:
    """How far the emulations move the oracle's trace points: the worst relative L2 (or checksum bound) of the
    oracle's trace with them (``base``) against without them (``exact``); ``tol``: the comparison's tolerance (the
    pair's ``layer_rel_l2`` limit). The effect that raises that gate."""
    moved = compare(base, exact, DivergenceRule(tol=tol)).rows
    return max((r.err for r in moved if r.err == r.err), default=0.0)


def _measure_figures(runs: ReferenceRuns, eng: Any, kind: str, pair: str, prompts: Sequence[dict[str, Any]],
                     progress: Progress, case: str, approx: tuple[str, ...], new_tokens: int, top_n: int,
                     out: list[Figure] | None = None, yardstick: bool = False) -> list[Figure]:
    """The figures of :func:`.pair._measure`: ``new_tokens`` per greedy stream (0: none), vLLM's ``top_n``,
    appended to ``out``; ``yardstick``: the engine rounds its activations in a
    way the oracle cannot emulate, so an engine without logits is measured against the 8-bit yardstick on its
    streams too (:func:`.quantized.stream_kld`)."""
    out = [] if out is None else out
    # what this pair asks of the reference that the job's prefetch could not foresee (a server's or a cmd: engine's
    # declared emulations), in one set of passes over the weights rather than a forward per prompt and step
    runs.prefetch([approx], prompts, new_tokens, top_n, progress=lambda m: progress(f"[{case}] {m}"),
                  greedy=_can(eng, "generate") and new_tokens > 0)
    layer_limit = DEFAULT_GATES[f"{pair}.layer_rel_l2"].limit
    logit_limit = DEFAULT_GATES[f"{pair}.max_abs_logit"].limit
    try:
        batch = _logits_many(eng, kind, prompts) if _can(eng, "logits") else {}
    except EngineFailure as e:
        raise _naming(e, prompts)
    with temp_folder("g4h-pair-") as tmp:
        local: list[tuple[int, dict[str, Any], Trace]] = []  # (where its figure goes in out, prompt, engine trace)

        def told(m: str) -> None:
            progress(f"[{case}] {m}")
        try:
            for p in prompts if _can(eng, "logits") else ():
                base, base_trace = runs.logits(approx, p)
                try:
                    ours, ours_trace = engine_logits(eng, kind, p, batch, Path(tmp))
                except EngineFailure as e:
                    raise _naming(e, [p])
                out += _logit_figures(runs, ours, base, approx, pair, p, logit_limit)
                if ours_trace is not None:
                    exact_trace = runs.trace((), p) if approx else None
                    out.append(_layer_figure(ours_trace, base_trace, pair, p, layer_limit, exact_trace))
                    if "quantized_activations" in approx:
                        local.append((len(out), p, ours_trace))
        except EngineFailure:  # an engine that fails at a later prompt keeps the earlier prompts' figures
            try:
                _local_figures(runs, approx, pair, local, out, told)
            except Exception as e:  # noqa: BLE001 - the engine's failure is the pair's finding, not this one
                told(f"local_median of the prompts before the failure not computed: {type(e).__name__}: {e}")
            raise
        _local_figures(runs, approx, pair, local, out, told)
        if _can(eng, "generate") and new_tokens > 0:  # 0: no streams (g4h sweep --max-new-tokens 0)
            context = runs.ref.cfg.context_length
            gen_prompts = [p for p in prompts if len(p["prompt_ids"]) + new_tokens <= context]
            if gen_prompts:
                progress(f"[{case}] {runs.name} vs {kind}: greedy streams of {new_tokens} tokens, top-{top_n}")
                base_g = runs.generations(approx, gen_prompts, new_tokens, top_n)
                effect, effect_at = runs.logprob_effect(approx, gen_prompts, new_tokens, top_n)
                lp_limit = effect_limit(DEFAULT_GATES[f"{pair}.max_abs_logprob"], effect)
                hints = getattr(eng, "hints", None)
                if isinstance(hints, dict):  # a server that names some tokens by text only (llama-cpp-python)
                    hints.update({tuple(int(t) for t in p["prompt_ids"]): (list(base_g[str(p["id"])]["tokens"]),
                                                                           list(base_g[str(p["id"])]["logprobs"]))
                                  for p in gen_prompts})
                try:
                    ours_g = as_streams(gen_prompts, eng.generate_full([p["prompt_ids"] for p in gen_prompts],
                                                                       new_tokens, top_n=top_n))
                except EngineFailure as e:
                    raise _naming(e, gen_prompts, base_g, runs.name)
                figs = generation_figures(ours_g, base_g, pair, top_n, logprob_limit=lp_limit,
                                          near_tie=near_tie_margin(lp_limit))
                if approx:
                    figs[1].detail.update(effect=effect, effect_at=effect_at, emulated=list(approx))
                if getattr(eng, "no_logprobs", None):  # a server that gives tokens only: said, not failed
                    figs[1].detail["not_measured"] = eng.no_logprobs
                elif "quantized_activations" in approx and not _can(eng, "logits"):  # its log-probs stand for logits
                    try:
                        figs[1].detail.update(stream_agreement(
                            runs, eng, approx, gen_prompts, ours_g, DEFAULT_GATES[f"{pair}.max_abs_logprob"].limit,
                            top_n))
                    except EngineFailure as e:
                        raise _naming(e, gen_prompts)
                elif yardstick and not _can(eng, "logits"):  # not emulable: its KLD on the top-N bins judges
                    try:
                        figs[1].detail.update(stream_kld(runs, eng, approx, gen_prompts, ours_g, top_n))
                    except EngineFailure as e:
                        raise _naming(e, gen_prompts)
                out += figs
                bad = not_greedy(ours_g)
                if bad is not None:  # a greedy engine never picks a token below its own top-1: it samples, or lies
                    raise _not_greedy_failure(runs, eng, kind, approx, gen_prompts, ours_g, base_g, bad, lp_limit)
    return out


def _logit_figures(runs: ReferenceRuns, ours: np.ndarray, base: np.ndarray, approx: tuple[str, ...], pair: str,
                   p: dict[str, Any], limit: float) -> list[Figure]:
    """:func:`harness.parity.compare.prompt_logit_figures` of one prompt (the worst position named, the first
    position whose max |Δlogit| is above the gate's limit: ``logits@position N``) and, under emulations, the
    *effect*: how far they move the oracle's logits and KLD (the oracle with them against the oracle without them),
    which raises the gates (:func:`harness.core.gates.effect_limit`), and the same figures against the exact oracle
    beside (``vs_exact_reference``). ``limit``: the max |Δlogit| gate's base limit. Where ``approx`` emulates
    ``quantized_activations``, the ``max_abs_logit`` figure also carries ``_per_position`` (``[T]`` float64, the
    max |Δlogit| over the vocabulary at each position, against ``base``), which
    :func:`.quantized.quantized_gates` pools into ``median_abs_logit`` and removes from the detail."""
    effect = e_kld = 0.0
    exact = None
    own = limit  # the gate's limit before any effect raises it
    if approx:  # the oracle (reference or fast) without the emulation
        exact, _ = runs.logits((), p)
        effect, e_kld = logit_effect(runs, approx, p)
        limit = max(limit, effect_limit(DEFAULT_GATES[f"{pair}.max_abs_logit"], effect))
    figs = prompt_logit_figures(ours, base, pair, p["id"], limit, own, runs.name)
    if "quantized_activations" in approx:  # for median_abs_logit (.quantized.quantized_gates pools and drops it)
        figs[0].detail["_per_position"] = np.max(np.abs(ours - base), axis=1)
    if exact is not None:
        figs[0].detail.update(effect=effect, emulated=list(approx))
        figs[1].detail.update(effect=e_kld, effect_power=2, emulated=list(approx))
        for f, e in zip(figs, logit_figures(ours, exact, pair, p["id"])):
            f.detail["vs_exact_reference"] = e.measured
    return figs


def _layer_figure(ours: Trace, base: Trace, pair: str, p: dict[str, Any], limit: float,
                  exact: Trace | None = None) -> Figure:
    """:func:`harness.parity.compare.layer_figure` of one prompt. With ``exact`` (the oracle's trace without the
    emulations that ``base`` makes), the effect of the emulations on the trace points raises the limit
    (:func:`harness.core.gates.effect_limit`)."""
    effect = None
    if exact is not None:
        effect = trace_effect(base, exact, limit)
        limit = max(limit, effect_limit(DEFAULT_GATES[f"{pair}.layer_rel_l2"], effect))
    return layer_figure(ours, base, pair, p["id"], limit, effect)


def _local_figures(runs: ReferenceRuns, approx: tuple[str, ...], pair: str,
                   local: Sequence[tuple[int, dict[str, Any], Trace]], out: list[Figure], progress: Progress) -> None:
    """The ``<pair>_q8.local_median`` figure of each prompt of ``local`` (``(index, prompt, engine trace)``), inserted
    into ``out`` at its index (after the prompt's layer figure, where one by one it went): the errors of each
    prompt's trace against the reference re-seeded from it, every prompt's re-seeded forwards in one pass over the
    weights (:meth:`ReferenceRuns.local_errors_many`); pooled over the prompts by :func:`.quantized.quantized_gates`.
    A prompt whose trace cannot re-seed the reference gets none."""
    if not local:
        return
    errors = runs.local_errors_many(approx, [p for _, p, _ in local], [t for _, _, t in local], progress)
    for (at, p, _), e in sorted(zip(local, errors), key=lambda x: -x[0][0]):  # from the end: earlier indices hold
        if e:
            out.insert(at, fig(f"{pair}_q8.local_median", float("nan"), p["id"], _errors=e))


def _logits_many(eng: Any, kind: str, prompts: Sequence[dict[str, Any]]) -> dict[str, tuple[np.ndarray, Trace]]:
    """Logits and traces of every prompt in one call, for an engine that has ``logits_many`` (llama.cpp: one
    worker process instead of one per prompt); empty for the others."""
    many = getattr(eng, "logits_many", None)
    if many is None or not prompts:
        return {}
    out = {}
    for p, (z, points) in zip(prompts, many([p["prompt_ids"] for p in prompts], trace=True)):
        w = TraceWriter(kind, p["prompt_ids"], keep_tensors=True)
        for point, layer, arr in points:
            w(point, layer, arr)
        z32 = z.astype(np.float32)  # llama.cpp's logits are float32: kept so (exact), widened when used
        out[str(p["id"])] = (default_store().keep(z32) if np.array_equal(z32, z) else z, w.trace())
    return out


def engine_logits(eng: Any, kind: str, p: dict[str, Any], batch: dict[str, tuple[np.ndarray, Trace]], tmp: Path
                  ) -> tuple[np.ndarray, Trace | None]:
    """The engine's logits ``[T, V]`` of prompt ``p`` and its trace (None where it traces nothing), asked as every
    comparison asks (the pair's figures, :func:`.explain_pair.observe`): taken out of ``batch`` (:func:`_logits_many`,
    float64) where it holds the prompt, else one request with the trace callback in-process, or, for an engine that
    writes trace files (``cmd:``), the logits and then its trace file under ``tmp`` (:func:`_read_engine_trace`).

    Raises:
        EngineFailure: the engine failed the request (crashed, broke the protocol, a bad trace file).
    """
    pid = str(p["id"])
    if pid in batch:
        z, tr = batch.pop(pid)
        return np.asarray(z, dtype=np.float64), tr
    file_trace = hasattr(eng, "trace_file")
    tr = None
    if _can(eng, "trace") and not file_trace:
        w = TraceWriter(kind, p["prompt_ids"], keep_tensors=True)
        z = eng.logits(p["prompt_ids"], trace=w)
        tr = w.trace()
    else:
        z = eng.logits(p["prompt_ids"])
    if file_trace and _can(eng, "trace"):
        tr = _read_engine_trace(eng, p, tmp)
    return z, tr


def _read_engine_trace(eng: Any, p: dict[str, Any], tmp: Path) -> Trace:
    """A ``cmd:`` engine's trace of one prompt, read and checked; a file that is not a trace of this prompt is
    the engine's fault (:class:`EngineProtocolError` naming the engine, the request and the file)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(p["id"]))
    path = eng.trace_file(p["prompt_ids"], tmp / f"{safe}.jsonl", dump_dir=tmp / "tensors")
    try:
        tr = read_trace(path)
    except InputError as e:
        raise EngineProtocolError(f"{eng.name} trace of prompt {p['id']}: {e}").at(request=p["id"]) from None
    if tr.prompt_ids != list(p["prompt_ids"]):
        raise EngineProtocolError(f"{eng.name} trace of prompt {p['id']}: {path} traces another prompt "
                                  f"({len(tr.prompt_ids)} ids, expected {len(p['prompt_ids'])})").at(request=p["id"])
    return tr


def _naming(e: EngineFailure, prompts: Sequence[dict[str, Any]], oracle: dict[str, dict] | None = None,
            oracle_name: str = ORACLE) -> EngineFailure:
    """``e`` with its request named: the prompt at its ``index`` in ``prompts`` (the one prompt when there is one).
    With the ``oracle``'s streams and the tokens the engine returned (``partial``), the step is where they part
    (a dropped token shows there, not at the end of a short stream), said in the line."""
    if e.index is not None and 0 <= e.index < len(prompts):
        e.at(request=prompts[e.index]["id"])
    elif len(prompts) == 1:
        e.at(request=prompts[0]["id"])
    if oracle is not None and e.partial is not None and e.request is not None and str(e.request) in oracle:
        want = oracle[str(e.request)]["tokens"]
        got = list(e.partial)
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is not None:
            note = f"; its tokens part from the {oracle_name}'s at step {i}: {got[i]}, {oracle_name} {want[i]}"
        else:
            i = min(len(got), len(want))
            note = f"; its tokens agree with the {oracle_name}'s up to step {i}, then end"
        named = type(e)(f"{one_line(e)}{note}")
        named.__dict__.update(e.__dict__)
        named.step = i
        return named
    return e


def not_greedy(streams: dict[str, dict[str, Any]]) -> tuple[str, int, int, int, float] | None:
    """The first (request, step) whose token is not the top-1 of the engine's own log-probs there (a tie with it is
    greedy): ``(request, step, token, top-1 id, top-1 log-prob)``; None when every step is greedy (steps without
    log-probs are not judged)."""
    for rid, g in streams.items():
        for i, (tok, own) in enumerate(zip(g["tokens"], g["logprobs"])):
            if not own:
                continue
            best = max(own, key=lambda t: own[t])
            mine = own.get(tok)
            if mine is None or mine < own[best]:
                return rid, i, int(tok), int(best), float(own[best])
    return None


def not_greedy_line(bad: tuple[str, int, int, int, float]) -> str:
    """What a stream that is not greedy (``bad``, from :func:`not_greedy`) did, in the words of its engine failure
    (``g4h parity``) and of ``g4h explain``: ``token T is not the top-1 of its own log-probs (B at LP): ...``."""
    _, _, tok, best, lp = bad
    return (f"token {tok} is not the top-1 of its own log-probs ({best} at {lp:.6g}): not greedy decoding "
            "(temperature 0), which was asked")


def _not_greedy_failure(runs: ReferenceRuns, eng: Any, kind: str, approx: tuple[str, ...],
                        prompts: Sequence[dict[str, Any]], ours: dict[str, dict[str, Any]],
                        oracle: dict[str, dict[str, Any]], bad: tuple[str, int, int, int, float], limit: float
                        ) -> EngineProtocolError:
    """The engine failure of a stream whose token is not the top-1 of the engine's own log-probs (``bad``, from
    :func:`not_greedy`): it did not decode greedily as asked (exit 1), said with what differs in decoding there, as
    the explanation says it (:func:`harness.parity.explain_decoding.decoding_by_logprobs`, on the oracle's logits at its
    context and its log-probs at the steps before where the streams are the same; ``limit``: the pair's
    ``max_abs_logprob`` limit): when its log-probs are the oracle's, the failure carries that finding as
    ``decoding`` (:func:`.pair.engine_failed` makes it the pair's explanation). A server that applies a repetition
    penalty, a ban or a logit bias after taking its log-probs (llama-server's ``n_probs``, vLLM's default
    ``raw_logprobs``) lands here."""
    rid, i, tok, best, lp = bad
    p = next(p for p in prompts if str(p["id"]) == rid)
    stream, theirs = ours[rid], oracle[rid]
    context = [int(t) for t in p["prompt_ids"]] + [int(t) for t in stream["tokens"][:i]]
    z = runs.raw_logits(approx, context)[-1]
    same = next((k for k, (a, b) in enumerate(zip(stream["tokens"], theirs["tokens"])) if a != b), i)
    found = decoding_by_logprobs(rid, p["prompt_ids"], stream, i, z, limit, runs.name,
                                 theirs["logprobs"][:min(i, same)])
    line = f"{getattr(eng, 'name', kind)}: {not_greedy_line(bad)}"
    e = EngineProtocolError(line if found is None else f"{line}; in decoding, not in the logits: {found['what']}")
    e.decoding = found
    return e.at(request=rid, step=i)
