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
This module opens the engine, names the pair, works out what the engine's declarations ask of the oracle and turns a
failure into the pair's ``.runs`` figure; :mod:`.pair_figures` measures the figures themselves, prompt by prompt.
The caller hands :func:`pair_checks` what runs beside the common figures: ``own_checks``, the checks an engine kind
adds on the same engine (a server's batch invariance, for instance: :data:`harness.parity.cases.OWN_CHECKS`), and
``on_measured``, hooks called once the figures are measured (the explanation of a failing pair).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence


from gemma4_harness.reference.errors import InputError

from ...core.engine_kinds import KIND, ORACLE
from ...core.gates import DEFAULT_GATES, effect_limit, pair_name
from ...core.memory import NotEnoughMemory
from ...core.workers import EngineFailure
from ...engines import EngineUnavailable, engine_kind, make_engine
from ...engines.base import TOP_N
from ...engines.numerics import KIND_NUMERICS, engine_numerics
from ...engines.openai.http import SERVER_CONTEXT_HINT, ServerContextExceeded
from ...tokenizer.prompt_ids import model_tokenizer
from ..compare import near_tie_margin
from ..result import Figure, fig, one_line
from ..skips import skipped
from .pair_figures import Progress, _measure_figures, logit_effect, trace_effect
from .quantized import quantized_gates
from .reference_runs import ReferenceRuns

GREEDY_NEW_TOKENS = 8
"""Tokens each greedy stream runs for the ``.greedy`` check (prompts with room for them in the context)."""

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
    where that is a fault in decoding (the failure's ``decoding``, :func:`.pair_figures._not_greedy_failure`) also
    gives the pair its ``explanation``, in the form :mod:`.explain_pair` gives one."""
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


