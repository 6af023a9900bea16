"""``g4h diff A B``: compare two traces and name the first (point, layer) that diverges."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from gemma4_harness.reference.errors import InputError

from ..core.gates import DIFF_TOL, Gate
from ..core.engine_kinds import ORACLE
from ..core.io import write_json_atomic
from ..engines.reference import ReferenceEngine
from ..parity.explain import explain_text
from ..parity.explain_search import Observed, budget_seconds
from ..traces.compare import DivergenceRule, compare, render_diff
from ..traces.format import read_trace
from ._args import InFile, Number, OutFile, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h diff``."""
    p.add_argument("a", type=InFile(streams=True), help="trace under test (.jsonl)")
    p.add_argument("b", type=InFile(streams=True), help="baseline trace (.jsonl); relative errors divide by its norms")
    p.add_argument("--tol", type=Number(0), default=DIFF_TOL,
                   help=f"relative error bound: rel L2 with tensor dumps, else the checksum lower bound "
                        f"(default {DIFF_TOL:g})")
    p.add_argument("--min-cosine", type=Number(-1, 1), default=None,
                   help="also require this cosine (tensor dumps only)")
    p.add_argument("--skip", action="append", default=None, metavar="POINT",
                   help="leave this point out (repeatable), e.g. result_output when one side kept only the last row")
    p.add_argument("--json", default=None, type=OutFile(), help="also write the comparison as JSON here")
    p.add_argument("--model", default=None,
                   help="the model A was traced on (.gguf, HF folder or a built-in case): on a divergence, name the "
                        "spec variant under which the reference traces as A does (docs/spec-variants.md)")
    p.add_argument("--explain-budget", type=Number(0.0), default=None, metavar="SECONDS",
                   help="with --model: seconds spent on that search (default 60, 0: off)")


def explain_trace(a, model: str, tol: float, budget: float | None):
    """The spec variant under which the reference traces A's prompt as A does (:mod:`harness.parity.explain`), or
    None when the budget is 0."""
    budget_s = budget_seconds(budget)
    if budget_s <= 0:
        return None
    ref = ReferenceEngine(resolve_model(model, ORACLE))
    gates = {"diff.layer_rel_l2": Gate("diff.layer_rel_l2", tol, "le", "g4h diff --tol")}
    return explain_text(ref, [Observed(a.label, a.prompt_ids, trace=a)], "diff", gates, budget_s=budget_s,
                        layer_tol=tol)


def diff_command(path_a: str, path_b: str, tol: float = DIFF_TOL, skip: Sequence[str] = (),
                 min_cosine: float | None = None, json_out: str | None = None, stream=None,
                 model: str | None = None, explain_budget: float | None = None) -> int:
    """``g4h diff A B``: print the comparison (:func:`render_diff`); return 0 (no divergence) or 1. With ``model``,
    a divergence is explained (:func:`explain_trace`).

    Raises:
        InputError: unreadable/invalid trace, different prompts, bad ``--tol`` (exit 2 in the CLI).
    """
    if not (tol >= 0):
        raise InputError(f"--tol {tol}: expected a non-negative number")
    a, b = read_trace(path_a), read_trace(path_b)
    res = compare(a, b, DivergenceRule(tol=tol, min_cosine=min_cosine), skip=skip)
    print(render_diff(res, a, b), end="", file=stream or sys.stdout)
    expl = explain_trace(a, model, tol, explain_budget) if res.first is not None and model else None
    if expl is not None:
        print(f"{a.label} against the reference: {expl.line()}", file=stream or sys.stdout)
    if json_out:
        try:
            extra = {"explanation": expl.as_dict()} if expl is not None else {}
            write_json_atomic(json_out, {"a": str(a.path), "b": str(b.path), **res.as_dict(), **extra})
        except OSError as e:
            raise InputError(f"{json_out}: cannot write ({e.strerror or e})") from None
    return 1 if res.first is not None else 0


def run(args: argparse.Namespace) -> int:
    """Exit 0 when nothing diverges, 1 when a point does (2 on bad input, from the caller)."""
    return diff_command(args.a, args.b, tol=args.tol, skip=args.skip or (), min_cosine=args.min_cosine,
                        json_out=args.json, model=args.model, explain_budget=args.explain_budget)
