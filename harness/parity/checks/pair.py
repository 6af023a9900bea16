"""The reference against one engine on a user's model (``g4h parity --model M --against NAME``).

Any engine can be the other side: ``fast``, ``transformers``, ``llamacpp``, ``cmd:...`` and every scheme of
:data:`harness.engines.ENGINE_SCHEMES`. The pair is named ``reference~<kind>`` (:func:`pair_name`; a 16-bit
engine gets ``reference~<kind>_bf16``) and its gates are ``<pair>.<metric>`` in :mod:`harness.core.gates`.
With ``--oracle fast`` the fast engine in fp32 stands in for the reference
(:data:`harness.core.engine_kinds.ORACLES`, for speed on a big model): the pairs are ``fast~<kind>``, judged by the
same bounds (:func:`harness.core.gates.oracle_pair_gates`).
What is measured depends on what the engine answers:

* ``<pair>.runs``: 1 when the engine loaded the model and answered as its protocol says; 0 with the reason when
  it could not run (not installed, cannot read this model form), with ``engine_failure`` when the engine failed
  (:class:`~harness.core.workers.EngineFailure`: it crashed, broke its protocol, answered a request wrongly or
  not at all, returned a stream shorter than asked or a token that is not the top-1 of its own log-probs; the
  figure names the request, the step and the engine's last error line; exit 1, "ENGINE FAILED"), or with
  ``bad_input`` when the engine cannot be used as given (a command that cannot be started, a server that is
  down, its memory plan refused, then with ``out_of_memory`` too: exit 2);
* logits, per prompt (:func:`harness.parity.compare.logit_figures`): ``.max_abs_logit`` (with the position
  and token of the worst difference), ``.mean_kld``, ``.same_top1_decisive`` (near-ties reported, not failed);
* trace points, per prompt, when the engine traces (a callback in-process, a trace file for ``cmd:``):
  ``.layer_rel_l2``, the worst point, and the first point beyond the gate (:func:`harness.traces.compare.compare`);
* greedy streams of :data:`GREEDY_NEW_TOKENS` tokens (:func:`harness.parity.compare.generation_figures`):
  ``.greedy`` by vLLM's rule, each divergence classified, and ``.max_abs_logprob`` on the agreed prefix.

An engine that declares known approximations (llama.cpp's fp16 GELU table, a 16-bit KV cache, flash attention:
:func:`engine_numerics`, from a ``cmd:`` engine's ``hello``, a server's dialect defaults or ``--declare``) is gated
against a reference that makes the same approximations (:func:`harness.engines.numerics.emulate`); the figures
against the exact reference are kept beside (``vs_exact_reference``).
The caller hands :func:`pair_checks` what runs beside the common figures: ``own_checks``, the checks an engine kind
adds on the same engine (a server's batch invariance, for instance: :data:`harness.parity.cases.OWN_CHECKS`), and
``on_measured``, hooks called once the figures are measured (the explanation of a failing pair).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ...core.engine_kinds import KIND, ORACLE
from ...core.gates import DEFAULT_GATES, effect_limit, pair_name
from ...core.kld import kld_stats
from ...core.memory import NotEnoughMemory
from ...core.workers import EngineFailure, EngineProtocolError, temp_folder
from ...engines import EngineUnavailable, engine_kind, make_engine
from ...engines.base import TOP_N
from ...engines.numerics import KIND_NUMERICS, engine_numerics
from ...engines.openai.http import SERVER_CONTEXT_HINT, ServerContextExceeded
from ...tokenizer.prompt_ids import model_tokenizer
from ...traces.compare import DivergenceRule, compare
from ...traces.format import Trace, TraceWriter, read_trace
from ...traces.store import default_store
from ..compare import (as_streams, generation_figures, layer_figure, logit_figures, near_tie_margin,
                       prompt_logit_figures)
from ..explain_decoding import decoding_by_logprobs
from ..result import Figure, fig, one_line
from ..skips import skipped
from .quantized import quantized_gates, stream_agreement, stream_kld
from .reference_runs import ReferenceRuns

GREEDY_NEW_TOKENS = 8
"""Tokens each greedy stream runs for the ``.greedy`` check (prompts with room for them in the context)."""

Progress = Callable[[str], None]

OwnChecks = Mapping[str, Callable[..., list[Figure]]]
"""Engine kind -> ``fn(engine, ref_runs, prompts, pair, progress, extra) -> figures``: more checks on the same
engine, run after the common ones (their gates must exist); ``extra`` is :func:`pair_checks`' ``extra``."""

OnMeasured = Callable[..., None]
"""Called once a pair's figures are measured, with the engine still open: ``fn(runs, eng, kind, pair, prompts,
figures, progress, case)`` may add detail to ``figures`` (:func:`.explain_pair.explain_failing_pair` names the spec
variant that explains a failing pair)."""




def opted_out(kind: str, skip: Sequence[str]) -> str | None:
    """The ``--skip`` name in ``skip`` that opts engine kind ``kind`` out (its row's
    :attr:`~harness.core.engine_kinds.EngineKind.skip`: ``llamacpp``), None when it runs."""
    row = KIND.get(kind)
    return row.skip if row is not None and row.skip and skipped(skip, row.skip) else None


def _runs(pair: str, ok: bool, **detail: Any) -> Figure:
    return fig(f"{pair}.runs", 1.0 if ok else 0.0, None, **detail)


def failure_place(request: Any, step: int | None) -> str | None:
    """``request R step S`` (either part when known), or None."""
    parts = ([f"request {request}"] if request is not None else []) + ([f"step {step}"] if step is not None else [])
    return " ".join(parts) or None


def engine_failed(pair: str, e: EngineFailure) -> Figure:
    """The failing ``<pair>.runs`` figure of an engine failure: its one line, the request, the step and the engine's
    own last error line where known (``first_divergence`` is ``request R step S``); a stream that is not greedy
    where that is a fault in decoding (the failure's ``decoding``, :func:`_not_greedy_failure`) also gives the pair
    its ``explanation``, in the form :mod:`.explain_pair` gives one."""
    where = failure_place(e.request, e.step)
    line = one_line(e)
    found = e.decoding
    said = {} if found is None else {"explanation": {
        "status": "decoding", "line": f"in decoding, not in the logits: {found['line']}", "decoding": found,
        "first_point": f"request {found['request']} step {found['step']}"}}
    return _runs(pair, False, got=line, engine_failure=True, request=e.request, step=e.step,
                 last_error=e.last_error, first_divergence=where,
                 why=f"ENGINE FAILED{' at ' + where if where else ''}: {line}", **said)


def pair_checks(runs: ReferenceRuns, name: str, path: str | Path, prompts: Sequence[dict[str, Any]],
                progress: Progress, case: str, opted_out: str | None = None, options: dict[str, Any] | None = None,
                extra: Any = None, number: int = 1, own_checks: OwnChecks | None = None,
                on_measured: Sequence[OnMeasured] = (), also: Callable[[Any], None] | None = None) -> list[Figure]:
    """The reference against engine ``name`` on the model at ``path`` (see the module docstring).

    Args:
        runs: the reference's shared outputs.
        name: the engine name (``fast``, ``llamacpp``, ``cmd:'./eng'`` ...).
        prompts: prompt records within the model's vocabulary.
        opted_out: the ``--skip`` name that opts this engine out, when the user gave it (informational).
        options: keywords for :func:`harness.engines.make_engine` (each engine takes its own).
        extra: options of the kind's ``own_checks`` (a server's :class:`.server_base.ServerOptions`); its
            ``max_new_tokens``, when it has one, sets the length of the greedy streams (default
            :data:`GREEDY_NEW_TOKENS`), and its ``top_n`` vLLM's N (log-probs per step; default
            :data:`harness.engines.base.TOP_N`).
            ``layers`` (``--layers N``): an engine that cannot cut a model fails its ``.runs``.
        number: this engine's place among the engines of its kind in the run: from 2 on, its pair and its own
            checks' gates carry the number (``reference~openai#2.greedy``, ``server#2.stop.eos``), judged by the
            unnumbered gates (:func:`harness.core.gates.gate_for`).
        own_checks: the checks an engine kind adds on the same engine (:data:`OwnChecks`; none by default).
        on_measured: hooks called once the common figures are measured (:data:`OnMeasured`; none by default).
        also: called with the engine, still open, once the pair's figures are measured (before ``own_checks``):
            ``g4h sweep`` takes the outputs its own figures need from the engine the pair measured
            (:func:`harness.sweep.tasks.engine_run`); its :class:`EngineFailure` or :class:`EngineUnavailable` is
            the pair's ``.runs`` figure, as the pair's own would be.

    Returns:
        Figures for the gates ``<oracle>~<kind>.*`` (``runs.name``: ``reference~<kind>``, or ``fast~<kind>``
        with ``--oracle fast``); never raises for a failing engine (that is a ``.runs`` figure of 0).
    """
    kind = engine_kind(name)
    figures = _pair_checks(runs, name, kind, path, prompts, progress, case, opted_out, options, extra,
                           own_checks or {}, on_measured, also)
    return figures if number == 1 else [_numbered(f, number) for f in figures]


def engine_pair(eng: Any, kind: str, oracle: str = ORACLE) -> str:
    """The name of the pair of the open engine ``eng`` (of kind ``kind``) with ``oracle``, as every comparison names
    it (:func:`pair_checks`, ``g4h explain``): :func:`harness.core.gates.pair_name` of the dtype the engine computes
    in (:func:`harness.engines.numerics.engine_numerics`: ``reference~fast_bf16`` for the fast engine in bf16)."""
    return pair_name(kind, engine_numerics(eng, kind).dtype, oracle)


def _too_long_for_server(e: InputError, prompts: Sequence[dict[str, Any]]) -> str:
    """The line of ``e``; for a request a server refused as longer than its context
    (:class:`harness.engines.openai.ServerContextExceeded`, a server that does not say its context up front), the
    prompt named by its file and line and its token count before the server's own message, and what to do."""
    if not isinstance(e, ServerContextExceeded):
        return str(e)
    sent = e.prompt_ids
    p = next((p for p in prompts if sent is not None and list(p["prompt_ids"]) == sent), None)
    if p is None and sent is not None:  # a request built from a prompt (a prefix of it): the longest such prompt
        p = max((p for p in prompts if list(p["prompt_ids"][:len(sent)]) == sent), default=None,
                key=lambda p: len(p["prompt_ids"]))
    what = "a request" if sent is None else f"a request of {len(sent)} prompt tokens"
    if p is not None:
        what = (f"{p['where'] + ': ' if p.get('where') else ''}prompt {p['id']!r} ({len(p['prompt_ids'])} tokens"
                f"{', its text tokenized' if 'text' in p else ''})")
    return f"{what} does not fit the server's context: the server refused it: {e}; {SERVER_CONTEXT_HINT}"


def _numbered(f: Figure, number: int) -> Figure:
    """``f`` under its gate's numbered name: ``#N`` after the pair (``reference~cmd#2.runs``) or after the first
    part of an engine's own check (``server#2.stop.eos``)."""
    head, _, rest = f.gate.partition(".")
    return Figure(f"{head}#{number}.{rest}", f.measured, f.prompt, dict(f.detail, engine_number=number))


def _pair_checks(runs: ReferenceRuns, name: str, kind: str, path: str | Path, prompts: Sequence[dict[str, Any]],
                 progress: Progress, case: str, opted_out: str | None, options: dict[str, Any] | None,
                 extra: Any, own_checks: OwnChecks, on_measured: Sequence[OnMeasured],
                 also: Callable[[Any], None] | None = None) -> list[Figure]:
    pair = pair_name(kind, oracle=runs.name)
    if opted_out:
        return [_runs(pair, False, got="opted out", informational_reason=f"opted out with --skip {opted_out}")]
    progress(f"[{case}] {runs.name} vs {name}")
    try:
        eng = make_engine(name, path, **{"local_tokenizer": model_tokenizer, **(options or {})})
    except EngineUnavailable as e:
        row = KIND.get(kind)
        hint = f"; or opt out: g4h parity --skip {row.skip}" if row is not None and row.skip else ""
        return [_runs(pair, False, got=f"not run: {e}{hint}")]
    except EngineFailure as e:  # it crashed loading the model, or broke its protocol at its handshake
        return [engine_failed(pair, e)]
    except InputError as e:  # it cannot be used as given: a command that cannot start, a server that is down
        return [_runs(pair, False, got=str(e), bad_input=True,
                      **({"out_of_memory": True} if isinstance(e, NotEnoughMemory) else {}))]
    pair = engine_pair(eng, kind, runs.name)
    out: list[Figure] = []  # the figures measured so far: kept when the engine fails later
    try:
        _measure(runs, eng, kind, pair, prompts, progress, case,
                 int(getattr(extra, "max_new_tokens", GREEDY_NEW_TOKENS)), int(getattr(extra, "top_n", TOP_N)), out)
        for hook in on_measured:
            hook(runs, eng, kind, pair, prompts, out, progress, case)
        if also is not None:
            also(eng)
        if kind in own_checks:
            out += own_checks[kind](eng, runs, prompts, pair, progress, extra)
    except EngineUnavailable as e:
        return [_runs(pair, False, got=f"not run: {e}")] + out
    except EngineFailure as e:
        return [engine_failed(pair, e)] + out
    except InputError as e:  # a server's context exceeded: the prompt named (:func:`_too_long_for_server`)
        return [_runs(pair, False, got=_too_long_for_server(e, prompts), bad_input=True)] + out
    finally:
        close = getattr(eng, "close", None)
        if close is not None:
            close()
    hello = KIND[kind].declares == "hello"  # what its hello said: the program and the ops it serves (cmd:)
    about = {"engine": eng.engine, "ops": list(eng.ops)} if hello else {"engine": getattr(eng, "name", kind)}
    numerics = engine_numerics(eng, kind)
    return [_runs(pair, True, approximations=list(numerics.approximations), numerics=numerics.as_dict(),
                  **about)] + out


def numerics_lines(checks: Sequence[dict[str, Any]]) -> list[str]:
    """Report lines: for every pair whose ``.runs`` check carries the engine's ``numerics``, what it declared, what
    the reference emulated, and each figure whose limit the declaration raised (the largest effect per gate)."""
    lines: list[str] = []
    for c in checks:
        n = c.get("numerics")
        if not c["gate"].endswith(".runs") or not isinstance(n, dict):
            continue
        pair = c["gate"][:-len(".runs")]
        said = ", ".join(n.get("approximations") or []) or "none"
        lines += [f"Numerics of `{pair}` ({n.get('source') or 'declared'}): {n.get('dtype')}, KV cache "
                  f"{n.get('kv_cache')}, approximations: {said}; the reference emulates: "
                  f"{', '.join(n.get('emulated') or []) or 'nothing'}. Each figure is gated at max(fp32 bound, 2 x "
                  "the effect of these approximations on the same figure here: the reference with them against "
                  "the reference without them).", ""]
        worst: dict[str, dict[str, Any]] = {}
        for k in checks:
            if k["gate"].startswith(pair + ".") and k.get("effect") is not None:
                if k["gate"] not in worst or k["effect"] > worst[k["gate"]]["effect"]:
                    worst[k["gate"]] = k
        if worst:
            lines += ["| gate | largest effect of the declared approximations | its limit | worst measured |",
                      "|---|---:|---:|---:|"]
            for g, k in worst.items():
                top = max((x["measured"] for x in checks if x["gate"] == g and x["measured"] == x["measured"]),
                          default=float("nan"))
                lines.append(f"| `{g}` | {k['effect']:.3g} | {k['limit']:.3g} | {top:.3g} |")
            lines.append("")
    return lines


def pair_near_tie(pair: str, effects: Mapping[tuple[str, str | None], tuple[float, int]]) -> float | None:
    """The near-tie margin an explanation of ``pair`` judges greedy streams with: :func:`near_tie_margin` of the
    pair's ``max_abs_logprob`` limit raised by the effect of the declared approximations on the log-probs
    (``effects``, :func:`declared_effects`); None when the pair has no such gate. The parity job's explanation
    (:mod:`.explain_pair`) and ``g4h explain`` (``harness/cli/explain.py``) both take it from here."""
    lp_gate = DEFAULT_GATES.get(f"{pair}.max_abs_logprob")
    if lp_gate is None:
        return None
    return near_tie_margin(effect_limit(lp_gate, effects.get(("max_abs_logprob", None), (0.0, 1))[0]))


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


def declared_effects(runs: ReferenceRuns, approx: tuple[str, ...], pair: str, prompts: Sequence[dict[str, Any]],
                     traced: Sequence[str] = (), streams: Sequence[dict[str, Any]] = (),
                     new_tokens: int = GREEDY_NEW_TOKENS, top_n: int = TOP_N
                     ) -> dict[tuple[str, str | None], tuple[float, int]]:
    """``(metric, prompt id or None) -> (effect, power)``: the effects of the emulations ``approx`` that the
    pair's figures carry (as :func:`.explain_pair.effects` reads them back), without measuring the engine: per prompt
    of ``prompts`` (the engine gives logits) on ``max_abs_logit`` and ``mean_kld`` (:func:`logit_effect`), per prompt
    id in ``traced`` (the engine gives a trace) on ``layer_rel_l2`` (:func:`trace_effect`), and over the greedy
    streams of ``new_tokens`` of ``streams`` (the prompts the engine generates on) on ``max_abs_logprob``
    (:meth:`ReferenceRuns.logprob_effect`). Empty without emulations. ``g4h explain`` judges at the pair's limits
    with them."""
    if not approx:
        return {}
    out: dict[tuple[str, str | None], tuple[float, int]] = {}
    layer_limit = DEFAULT_GATES[f"{pair}.layer_rel_l2"].limit if f"{pair}.layer_rel_l2" in DEFAULT_GATES else 1e-3
    for p in prompts:
        pid = str(p["id"])
        logit, kld = logit_effect(runs, approx, p)
        out[("max_abs_logit", pid)], out[("mean_kld", pid)] = (logit, 1), (kld, 2)
        if pid in set(map(str, traced)):
            out[("layer_rel_l2", pid)] = (trace_effect(runs.trace(approx, p), runs.trace((), p),
                                                       layer_limit), 1)
    if streams:
        out[("max_abs_logprob", None)] = (runs.logprob_effect(approx, streams, new_tokens, top_n)[0], 1)
    return out


def expected_sets(names: Sequence[str], skip: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """The emulation keys (:meth:`harness.engines.numerics.Numerics.emulation`) the pairs of ``names`` will ask the
    reference for, as far as the engines' kinds tell before they start (:data:`harness.engines.numerics.KIND_NUMERICS`;
    a ``cmd:`` engine declares its own at its handshake, a server its dialect's, and what no kind predicts is
    computed when asked); kinds in ``skip`` are left out."""
    kinds = [engine_kind(n) for n in names]
    return sorted({KIND_NUMERICS[k].emulation() if k in KIND_NUMERICS else () for k in kinds
                   if opted_out(k, skip) is None})


def _can(eng: Any, op: str) -> bool:
    """Whether the engine answers ``op`` (``logits``, ``generate``, ``trace``)."""
    ops = getattr(eng, "ops", None)
    if ops is not None:
        return op in ops
    return op == "trace" or hasattr(eng, "generate_full" if op == "generate" else op)


def _measure(runs: ReferenceRuns, eng: Any, kind: str, pair: str, prompts: Sequence[dict[str, Any]],
             progress: Progress, case: str, new_tokens: int = GREEDY_NEW_TOKENS, top_n: int = TOP_N,
             out: list[Figure] | None = None) -> list[Figure]:
    """The pair's figures, appended to ``out`` as they are measured (so that an engine failure keeps them)."""
    out = [] if out is None else out
    numerics = engine_numerics(eng, kind)
    approx = runs.effective(numerics.emulation())
    types = runs.unemulated_types() if "quantized_activations" in numerics.approximations else []
    gap = runs.emulation_gap(numerics, types) if types else None
    if gap is not None:
        approx = tuple(a for a in approx if a != "quantized_activations")
    try:
        _measure_figures(runs, eng, kind, pair, prompts, progress, case, approx, new_tokens, top_n, out,
                         yardstick=gap is not None)
    finally:
        if types:
            quantized_gates(runs, out, pair, kind, types, gap, prompts, approx)
    return out




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
    ``decoding`` (:func:`engine_failed` makes it the pair's explanation). A server that applies a repetition
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


def _measure_figures(runs: ReferenceRuns, eng: Any, kind: str, pair: str, prompts: Sequence[dict[str, Any]],
                     progress: Progress, case: str, approx: tuple[str, ...],
                     new_tokens: int = GREEDY_NEW_TOKENS, top_n: int = TOP_N,
                     out: list[Figure] | None = None, yardstick: bool = False) -> list[Figure]:
    """The figures of :func:`_measure`, appended to ``out``; ``yardstick``: the engine rounds its activations in a
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
