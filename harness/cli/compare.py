"""``g4h compare``: compare logits (``.npy``) or greedy continuations (``.jsonl``) an engine already wrote.

::

    g4h compare OURS.npy ORACLE.npy [--precision fp32|bf16]
    g4h compare OURS.jsonl ORACLE.jsonl [--top-n 5]
    g4h compare OURS.npy --against reference --model M --prompt-ids P.json
    g4h compare OURS.jsonl --against reference --model M --prompts P.jsonl

Exit 0 when every gate passes, 1 when one fails, 2 on bad input (:mod:`harness.parity.compare`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core.finite import describe, first_nonfinite
from ..core.engine_kinds import ORACLE
from ..core.io import write_json_atomic
from ..core.prompts import load_prompts, read_prompt_ids
from ..core.workers import EngineOutputError
from ..engines import make_engine
from ..engines.reference import ReferenceEngine
from ..parity.compare import PRECISIONS, generation_figures, judge, load_generations, load_logits, logit_figures
from ..parity.explain import explain_text
from ..parity.explain_search import MAX_PROMPTS, Observed, budget_seconds
from ..parity.report import short_table
from ._args import Count, InFile, Number, OutFile, add_model_args, engine_options, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h compare``."""
    p.add_argument("ours", type=InFile(), help="the engine's output: logits .npy [T, V], or generate .jsonl")
    p.add_argument("oracle", nargs="?", default=None, type=InFile(),
                   help="the oracle's output of the same kind (or use --against)")
    p.add_argument("--against", default=None, help="compute the oracle side with this engine (needs --model)")
    add_model_args(p, model_required=False)
    p.add_argument("--prompt-ids", default=None, type=InFile(streams=True),
                   help="with --against and logits: the prompt's JSON list of ids")
    p.add_argument("--prompts", default=None, type=InFile(streams=True),
                   help="with --against and generations: the prompt set (JSONL)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                   help="which gates judge the engine: fp32 (oracle~engine) or bf16 (oracle~engine_bf16)")
    p.add_argument("--top-n", type=Count(1), default=5, help="vLLM's rule: each side's token in the other's top-N")
    p.add_argument("--json", default=None, type=OutFile(), help="also write the result as JSON here")
    p.add_argument("--explain-budget", type=Number(0.0), default=None, metavar="SECONDS",
                   help="on a failure, with --model and --prompt-ids (logits) or --prompts (generations): seconds "
                        "spent naming the spec variant that explains it (docs/spec-variants.md; default 60, 0: off)")


def _oracle_side(args: argparse.Namespace, kind: str, n_new: int | None):
    if args.oracle is not None:
        return load_logits(args.oracle) if kind == "logits" else load_generations(args.oracle)
    if not args.against or not args.model:
        raise InputError("g4h compare: give the oracle's file, or --against ENGINE with --model")
    engine = make_engine(args.against, resolve_model(args.model, args.against), **engine_options(args))
    if kind == "logits":
        if not args.prompt_ids:
            raise InputError("g4h compare: --against on logits needs --prompt-ids")
        return engine.logits(read_prompt_ids(args.prompt_ids))
    if not args.prompts:
        raise InputError("g4h compare: --against on generations needs --prompts")
    prompts = load_prompts(args.prompts, ids_only=True)
    gens = engine.generate_full([p["prompt_ids"] for p in prompts], n_new)
    return {str(p["id"]): {"tokens": g.tokens, "top": [[i for i, _ in s] for s in g.top],
                           "logprobs": [dict(s) for s in g.top]} for p, g in zip(prompts, gens)}


def _finite(z: np.ndarray, what: str, fault: type[Exception]) -> np.ndarray:
    """``z`` when every logit is finite; else ``fault`` naming the first NaN or Inf (the engine's output: exit 1,
    :class:`EngineOutputError`; the oracle's file: bad input)."""
    at = first_nonfinite(z)
    if at is not None:
        raise fault(f"{what}: logits are not finite: {describe(z, at)}")
    return z


def _finite_streams(streams: dict, what: str, fault: type[Exception]) -> dict:
    """Greedy streams (:func:`load_generations`) when no top log-prob is NaN or +Inf (-Inf is a probability of 0);
    else ``fault`` naming the first."""
    for pid, s in streams.items():
        for step, lps in enumerate(s["logprobs"]):
            bad = [lp for lp in lps.values() if np.isnan(lp) or lp == np.inf]  # -inf: a probability of 0
            if bad:
                raise fault(f"{what}: prompt {pid}, step {step}: top log-prob {bad[0]} is not finite")
    return streams


def run(args: argparse.Namespace) -> int:
    """Compare and print the verdict; exit 0 / 1 (2 on bad input, from the caller)."""
    if args.top_n < 1:
        raise InputError(f"--top-n {args.top_n}: expected >= 1")
    kind = "logits" if Path(args.ours).suffix == ".npy" else "generations"
    pair = PRECISIONS[args.precision]
    oracle = str(args.oracle or f"the {args.against} engine")
    if kind == "logits":
        ours = _finite(load_logits(args.ours), args.ours, EngineOutputError)
        figures = logit_figures(ours, _finite(_oracle_side(args, kind, None), oracle, InputError), pair)
    else:
        ours = _finite_streams(load_generations(args.ours), args.ours, EngineOutputError)
        n_new = max(len(v["tokens"]) for v in ours.values())
        base = _finite_streams(_oracle_side(args, kind, n_new), oracle, InputError)
        figures = generation_figures(ours, base, pair, args.top_n)
    res = judge(figures, Path(args.ours).name, str(args.oracle or f"{args.against}:{args.model}"))
    status = 0 if res.passed else 1
    data = {"kind": "compare", "status": status, "cases": [res.__dict__]}
    expl = _explain(args, kind, pair, ours) if status else None
    if expl is not None:
        data["explanation"] = expl.as_dict()
    print(short_table(data))
    if args.json:
        write_json_atomic(args.json, data)
    if status and expl is not None:  # the explanation, then the verdict as the last line
        print(f"against the reference: {expl.line()}", file=sys.stdout)
    elif status:
        need = "--prompt-ids" if kind == "logits" else "--prompts"
        print(f"(give --model and {need} to name the spec variant that explains it; or g4h explain)", file=sys.stdout)
    fault = next((c.get("first_fault") for c in res.checks if c.get("first_fault")), None)
    print(("PASS: every gate passed" if status == 0 else "FAIL: " + ", ".join(
        c["gate"] for c in res.checks if not c["pass"] and not c.get("informational"))
        + (f"; first fault: {fault}" if fault else "")) + f" ({kind}, {args.precision})", file=sys.stdout)
    return status


def _explain(args: argparse.Namespace, kind: str, pair: str, ours):
    """The explanation of a failing comparison (:mod:`harness.parity.explain`), against the reference of
    ``--model`` on ``--prompt-ids`` / ``--prompts``; None when those are not given or the budget is 0."""
    budget = budget_seconds(args.explain_budget)
    if not args.model or budget <= 0 or not (args.prompt_ids if kind == "logits" else args.prompts):
        return None
    ref = ReferenceEngine(resolve_model(args.model, ORACLE), cache_gb=args.ref_cache_gb, layers=args.layers)
    if kind == "logits":
        ids = read_prompt_ids(args.prompt_ids)
        observed = [Observed(Path(args.prompt_ids).stem, list(ids), logits=ours)]
    else:
        prompts = {str(p["id"]): list(p["prompt_ids"]) for p in load_prompts(args.prompts, ids_only=True)}
        observed = sorted((Observed(rid, prompts[rid], stream=s) for rid, s in ours.items() if rid in prompts),
                          key=lambda o: len(o.ids))[:MAX_PROMPTS]
    return explain_text(ref, observed, pair, budget_s=budget, top_n=args.top_n)
