"""``g4h explain --model M --engine E``: compare an engine with the reference and, where it diverges, name the spec
variant (``docs/spec-variants.md``) that makes the reference agree with it (:mod:`harness.parity.explain`).

The engine's logits (and trace) where it gives them, and its greedy streams where it generates (with its logits along
its own stream), are judged and explained as the parity job's explanation judges a failing pair
(:func:`harness.parity.explain.explain_text`, one path): a divergence only in decoding (the logits agree, the streams
part) is said to be in decoding, with the request and the step, and exits 1. A server's stream whose token is not
the top-1 of its own log-probs is judged as ``g4h parity`` judges it
(:func:`harness.parity.checks.pair_figures.not_greedy`: not greedy, an engine failure, exit 1), said above its
explanation. An engine that declares approximations (a
``cmd:`` engine's hello, llama-server's f16 KV cache, the ``llamacpp`` engine's GELU table) is judged at the pair's
limits: the reference makes them, and each figure's limit is raised by their effect on this model and prompt as the
pair raises it (:func:`harness.parity.checks.pair.declared_effects`, the near-tie margin by
:func:`harness.parity.checks.pair.pair_near_tie`), so a correct engine that ``g4h parity`` passes is not a
divergence here. ``--tol`` replaces those limits on the figures it names.

::

    g4h explain --model m.gguf --engine "cmd:./my-engine" [--prompts P.jsonl | --prompt-ids P.json]
                [--explain-budget S] [--variants a,b,...] [--tol X] [--json OUT]

Exit 0 when the engine agrees with the reference on every prompt (nothing to explain), 1 when it diverges (explained
or not: the engine still computes something else than the reference), 2 on bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core.cases import PROMPTS
from ..core.engine_kinds import TWIN
from ..core.gates import DEFAULT_GATES
from ..core.io import write_json_atomic
from ..core.prompts import load_prompts, read_prompt_ids, refuse_unfit_prompts
from ..engines import engine_kind, make_engine
from ..engines.mm import ReferenceMM
from ..engines.numerics import emulate
from ..engines.reference import ReferenceEngine
from ..engines.variants import family, parse_spec
from ..parity.checks.explain_pair import local_judge, observe
from ..engines.base import TOP_N
from ..parity.checks.pair import (GREEDY_NEW_TOKENS, declared_effects, engine_numerics, engine_pair, pair_name,
                                  pair_near_tie)
from ..parity.checks.pair_figures import not_greedy, not_greedy_line
from ..parity.checks.reference_runs import ReferenceRuns
from ..parity.explain import TextSubject, explain_text
from ..parity.explain_search import LABELS, MAX_PROMPTS, Explanation, Observed, budget_seconds
from ..parity.explain_mm import MMReference, explain_mm
from ..tokenizer.prompt_ids import with_prompt_ids
from ..traces.format import TraceWriter
from ._args import InFile, Number, OutFile, add_model_args, check_out_file, engine_options, resolve_model
from ._mm import add_mm_args, mm_requested, open_mm_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h explain``."""
    add_model_args(p, default_engine=TWIN)
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl", type=InFile(streams=True),
                   help='prompts, {"prompt_ids": [...]} or {"text": "..."} a line (default: '
                        "cases/prompts/synthetic.jsonl within the model's vocabulary)")
    p.add_argument("--prompt-ids", default=None, metavar="FILE.json", type=InFile(streams=True),
                   help="one prompt: a JSON list of token ids")
    p.add_argument("--explain-budget", type=Number(0.0), default=None, metavar="SECONDS",
                   help="seconds the search may take after the baseline (default 60)")
    p.add_argument("--variants", default=None, metavar="NAME[,NAME...]",
                   help="try only these variants (default: every text variant of docs/spec-variants.md)")
    p.add_argument("--tol", type=Number(0.0), default=None, metavar="X",
                   help="judge with this max |Δlogit| and per-point relative L2 instead of the pair's gates (to "
                        "explain a difference inside them, or to accept one)")
    p.add_argument("--json", default=None, type=OutFile(), help="also write the explanation as JSON here")
    add_mm_args(p)


def _prompts(args: argparse.Namespace, path: Path, vocab: int, context: int) -> list[dict]:
    if args.prompt_ids and args.prompts:
        raise InputError("g4h explain: give --prompts or --prompt-ids, not both")
    if args.prompt_ids:
        return [{"id": Path(args.prompt_ids).stem, "prompt_ids": read_prompt_ids(args.prompt_ids)}]
    if args.prompts:  # the user's: every one used, or refused naming it (never dropped)
        prompts = with_prompt_ids(load_prompts(args.prompts), path)
        refuse_unfit_prompts(prompts, vocab, context, 0, str(path), args.prompts)
        return prompts
    usable = [p for p in load_prompts(PROMPTS, ids_only=True)  # the built-in set, cut to the model
              if max(p["prompt_ids"]) < vocab]
    if not usable:
        raise InputError(f"{PROMPTS}: no prompt within the model's vocabulary of {vocab}")
    return usable


TOL_METRICS = ("max_abs_logit", "layer_rel_l2", "max_abs_logprob")
"""The figures whose limit ``--tol`` replaces (the effect of declared approximations no longer raises it)."""


def _gates(pair: str, tol: float | None) -> dict:
    gates = dict(DEFAULT_GATES)
    if tol is None:
        return gates
    why = f"--tol {tol:g} (g4h explain)"
    for metric in TOL_METRICS:
        name = f"{pair}.{metric}"
        if name in gates:
            gates[name] = dataclasses.replace(gates[name], limit=tol, reason=why, informational=False)
    return gates


def run(args: argparse.Namespace) -> int:
    """Explain; print the answer; exit 0 (nothing to explain) or 1 (the engine diverges)."""
    if args.json:
        check_out_file(args.json)
    if args.tol is not None and not args.tol > 0:
        raise InputError(f"--tol {args.tol}: expected a positive number")
    budget = budget_seconds(args.explain_budget)
    if mm_requested(args):
        return _run_mm(args, budget)
    candidates = parse_spec(args.variants, "--variants") if args.variants else family("text")
    path = resolve_model(args.model, args.engine)
    ref = ReferenceEngine(path, cache_gb=args.ref_cache_gb, layers=args.layers)
    prompts = _prompts(args, Path(path), ref.cfg.vocab_size, ref.cfg.context_length)
    kind = engine_kind(args.engine)
    t0 = time.perf_counter()
    # a server's token that is not its own top-1 is judged here, as the parity job judges it (not a raised failure
    # before anything is explained): its explanation says what differs in decoding
    eng = make_engine(args.engine, path, **{**engine_options(args), "check_greedy": False})
    try:
        pair = engine_pair(eng, kind)  # the pair g4h parity names (reference~fast_bf16 for fast in bf16)
        if f"{pair}.max_abs_logit" not in DEFAULT_GATES:
            pair = "oracle~engine"
        # streams too: a fault only in decoding is seen
        observed = observe(eng, kind, prompts, streams=True, context=ref.cfg.context_length)
    finally:
        close = getattr(eng, "close", None)
        if close is not None:
            close()
    t_engine = time.perf_counter() - t0
    runs = ReferenceRuns(ref)
    approx = runs.effective(engine_numerics(eng, kind).emulation())  # what the engine declares, the reference makes

    def numerics() -> contextlib.AbstractContextManager:
        return emulate(approx)

    gates = _gates(pair, args.tol)
    t1 = time.perf_counter()
    effects, near_tie = _effects(runs, approx, pair, prompts, observed, args.tol)
    # an engine rounding its activations on a quantized file: judged as parity judges it, by the re-seeded median
    local = local_judge(runs, approx) if f"{pair}_q8.local_median" in DEFAULT_GATES else None
    per_prompt = {o.prompt_id: TextSubject(ref, [o], pair, gates, numerics, top_n=TOP_N, effects=effects,
                                           near_tie=near_tie, local=local).measure((), full=True)
                  for o in observed}
    failing = sorted((o for o in observed if not per_prompt[o.prompt_id].passed), key=lambda o: len(o.ids))
    t_base = time.perf_counter() - t1
    bad = not_greedy({o.prompt_id: o.stream for o in observed if o.stream is not None})
    if bad is not None:  # not greedy as asked: its prompt is explained first (what differs in decoding there)
        failing.sort(key=lambda o: o.prompt_id != bad[0])
    if failing:  # the parity job's explanation of a failing pair, on the same shortest failing prompts
        expl = explain_text(ref, failing[:MAX_PROMPTS], pair, gates, numerics, budget, top_n=TOP_N,
                            variants=candidates, effects=effects, near_tie=near_tie, local=local)
    else:
        expl = Explanation("nothing_to_explain", next(iter(per_prompt.values())), budget_s=budget)
    greedy_fault = None if bad is None else f"request {bad[0]} step {bad[1]}: {not_greedy_line(bad)}"
    _print(expl, args, pair, len(prompts), len(failing), t_engine, t_base, greedy_fault)
    if args.json:
        write_json_atomic(args.json, {"kind": "explain", "model": str(path), "engine": args.engine, "pair": pair,
                                      "prompts": len(prompts), "failing_prompts": [o.prompt_id for o in failing],
                                      "seconds": {"engine": t_engine, "baseline": t_base, "explain": expl.seconds},
                                      **expl.as_dict(), **({"not_greedy": greedy_fault} if greedy_fault else {})})
    return 0 if expl.status == "nothing_to_explain" and bad is None else 1


def _effects(runs: ReferenceRuns, approx: tuple[str, ...], pair: str, prompts: list[dict], observed: list[Observed],
             tol: float | None) -> tuple[dict, float | None]:
    """The effects of the declared approximations ``approx`` on the figures this engine gives (logits, a trace,
    greedy streams: what ``observed`` holds) and the pair's near-tie margin, as ``g4h parity`` measures them
    (:func:`harness.parity.checks.pair.declared_effects`, :func:`harness.parity.checks.pair.pair_near_tie`); with
    ``--tol``, none on the figures it sets (:data:`TOL_METRICS`): the user's limit is the limit."""
    by_id = {o.prompt_id: o for o in observed}
    context = runs.ref.cfg.context_length
    streams = [p for p in prompts if by_id[str(p["id"])].stream is not None
               and len(p["prompt_ids"]) + GREEDY_NEW_TOKENS <= context]
    if approx:  # the reference's forwards with and without them, in as few passes over the weights as it can
        runs.prefetch([approx], prompts, GREEDY_NEW_TOKENS, TOP_N, greedy=bool(streams))
    effects = declared_effects(runs, approx, pair, [p for p in prompts if by_id[str(p["id"])].logits is not None],
                               traced=[o.prompt_id for o in observed if o.trace is not None], streams=streams)
    near_tie = pair_near_tie(pair, effects)
    if tol is not None:
        effects = {k: v for k, v in effects.items() if k[0] not in TOL_METRICS}
    return effects, near_tie


def _run_mm(args: argparse.Namespace, budget: float) -> int:
    """With ``--image`` / ``--audio``: the engine's logits and trace on the expanded prompt against the reference
    decoder with the reference's soft tokens (:func:`harness.parity.explain_mm.explain_mm`)."""
    if not args.prompt_ids:
        raise InputError("g4h explain: --image / --audio need --prompt-ids (the prompt with one placeholder each)")
    mm, prompt, engine = open_mm_prompt(args, read_prompt_ids(args.prompt_ids))
    t0 = time.perf_counter()
    w = TraceWriter(args.engine, prompt.ids, keep_tensors=True)
    observed = [Observed(Path(args.prompt_ids).stem, list(prompt.ids),
                         np.asarray(engine.logits(prompt, trace=w), dtype=np.float64), w.trace())]
    t_engine = time.perf_counter() - t0
    t1 = time.perf_counter()
    ref = MMReference.from_prompts(mm, [prompt], [ReferenceMM(mm).soft_tokens(prompt)])
    t_base = time.perf_counter() - t1
    pair = pair_name(engine_kind(args.engine))
    pair = pair if f"{pair}.max_abs_logit" in DEFAULT_GATES else "oracle~engine"
    variants = parse_spec(args.variants, "--variants") if args.variants else None
    expl = explain_mm(ref, observed, pair, _gates(pair, args.tol), budget, variants)
    _print(expl, args, pair, 1, int(expl.status != "nothing_to_explain"), t_engine, t_base)
    if args.json:
        write_json_atomic(args.json, {"kind": "explain", "model": str(args.model), "engine": args.engine,
                                      "pair": pair, **expl.as_dict()})
    return 0 if expl.status == "nothing_to_explain" else 1


def _print(expl, args, pair: str, n_prompts: int, n_failing: int, t_engine: float, t_base: float,
           not_greedy: str | None = None) -> None:
    out = sys.stdout
    print(f"g4h explain: {args.engine} on {args.model} ({pair}): {n_failing} of {n_prompts} prompts diverge", file=out)
    if not_greedy:
        print(f"  engine failed: {not_greedy}", file=out)
    if expl.status != "nothing_to_explain":
        print(f"  first diverging point: {expl.first_point or 'none traced'}", file=out)
        shown = [*expl.explained_by, *[t for t in expl.candidates if not t.passed]][:8]
        for t in shown:
            h = t.headline()
            fig = f"{LABELS[h[0]]} {h[1]:.3g}" if h else ""
            print(f"  {'EXPLAINS' if t.passed else 'no      '} {' + '.join(t.variants):45s} {fig:28s} "
                  f"first divergence {t.first_divergence or 'none'}" + (f" ({t.error})" if t.error else ""), file=out)
        if expl.not_applicable:
            print(f"  not applicable to this model: {', '.join(sorted(expl.not_applicable))}", file=out)
    print(f"  time: engine {t_engine:.2f} s, the reference on every prompt {t_base:.2f} s, explaining "
          f"{expl.seconds:.2f} s ({expl.singles} variants, {expl.pairs} pairs tried)", file=out)
    print(expl.line(), file=out)
