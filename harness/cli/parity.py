"""``g4h parity``: compare engines on the case library and apply the gates (:mod:`harness.parity`)."""

from __future__ import annotations

import argparse
import os

from gemma4_harness.reference.errors import InputError

from ..core.cases import PROMPTS
from ..core.engine_kinds import default_against
from ..core.io import write_text_atomic
from ..core.text import for_terminal
from ..engines import split_engines
from ..engines.base import TOP_N
from ..engines.numerics import parse_declare
from ..core.engine_kinds import ORACLE, ORACLES
from ..parity.checks.pair import GREEDY_NEW_TOKENS
from ..parity.checks.server import ServerOptions
from ..parity.drift import drift_rows, only_summary
from ..parity.explain_search import budget_seconds
from ..parity.explain_report import explanation_lines
from ..parity.job import QUICK_LEAVES_OUT, QUICK_NEW_TOKENS, QUICK_PROMPTS, QUICK_SERVER_REQUESTS
from ..parity.job import run as run_parity
from ..parity.report import junit_xml, short_table
from ..parity.skips import SKIPPABLE
from ..parity.skips import help_text as skip_help
from ._args import (
    Count,
    InFile,
    ModelArg,
    Number,
    OutDir,
    OutFile,
    add_compute_arg,
    add_engine_timeout_arg,
    add_scale_args,
    add_server_args,
    check_out_dir,
    check_out_file,
    engine_options,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h parity``."""
    p.add_argument("--model", action="append", default=None, type=ModelArg(),
                      help="a user model (.gguf or HF folder); repeatable. Default: the built-in cases")
    p.add_argument("--against", action="append", default=None, metavar="ENGINE[,ENGINE...]",
                      help="engines the reference is compared with on --model (repeatable, or a comma list): reference, "
                        "fast, transformers, llamacpp, cmd:'COMMAND ...' (docs/engine-protocol.md), openai:URL (a "
                        "server: docs/server-dialects.md). Default: every engine that can read the model (a GGUF: "
                        f"{', '.join(default_against('gguf'))}; an HF folder: {', '.join(default_against('hf'))})")
    p.add_argument("--oracle", choices=ORACLES, default=ORACLE,
                      help="with --model: the oracle side of every pair: reference (float64, the default) or fast (the "
                        "torch engine in fp32, on CUDA when present: much faster on a big model; pairs fast~ENGINE, "
                        "the same bounds; the reference's cached-vs-uncached check is left out)")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                      help="with --model and the reference as the oracle: run the reference's passes (prompt "
                        "forwards, greedy streams, cached-vs-uncached chains) on this Ray cluster, one group of "
                        "prompts per node, each node reading the model from the same path (default: RAY_ADDRESS when "
                        "set; docs/cluster.md). The figures are those of a run on this machine. Not with --jobs > 1")
    p.add_argument("--top-n", type=Count(1), default=TOP_N, metavar="N",
                      help=f"with --model: vLLM's N: log-probs asked per step of every greedy stream; a divergent "
                        f"token passes when each side's token is in the other's top-N (default {TOP_N})")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl", type=InFile(streams=True),
                      help='with --model: the prompt set, {"prompt_ids": [...]} or {"text": "..."} per line, optional '
                        '"id" (default: cases/prompts/synthetic.jsonl, restricted to the model\'s vocabulary)')
    p.add_argument("--max-new-tokens", type=Count(1), default=None,
                      help=f"with --model: tokens of each greedy stream (default {GREEDY_NEW_TOKENS}; "
                        f"{QUICK_NEW_TOKENS} with --quick)")
    p.add_argument("--quick", action="store_true",
                      help=f"for iterating on an engine: the {QUICK_PROMPTS} shortest prompts, greedy streams of "
                        f"{QUICK_NEW_TOKENS} tokens, a server's batch check with {QUICK_SERVER_REQUESTS} requests; "
                        f"the built-in library without {', '.join(QUICK_LEAVES_OUT)}. The verdict says quick; no "
                        "baseline")
    s = p.add_argument_group("server checks (--against openai:URL)")
    add_server_args(s)
    s.add_argument("--batch-requests", type=Count(1, 1 << 16), default=None,
                      help=f"batch invariance: this many requests with staggered starts (default 16; "
                        f"{QUICK_SERVER_REQUESTS} with --quick)")
    s.add_argument("--concurrency", type=Count(1, 1 << 12), default=None,
                      help=f"batch invariance: at most this many in flight (default 8; {QUICK_SERVER_REQUESTS} with "
                        f"--quick)")
    s.add_argument("--require", action="append", default=[], metavar="CHECK",
                      help="fail when the server does not offer this check (repeatable): server-template (llama-cpp-python"
                        " has no chat-template endpoint), server-prompt-logprobs (llama-server has no prompt "
                        "log-probs). Without it such a check is reported as \"not offered by <dialect>\" and does not "
                        "fail the run")
    p.add_argument("--out", default=None, type=OutDir(), help="parent folder of the run directory (default reports/)")
    p.add_argument("--case", action="append", default=None, help="only this built-in case (repeatable)")
    p.add_argument("--no-real", action="store_true", help="skip the real Gemma 3 270M GGUF and the tokenizer checks")
    p.add_argument("--skip", action="append", default=[], metavar="CHECK", choices=list(SKIPPABLE),
                      help=skip_help())
    p.add_argument("--slow", action="store_true",
                      help="also run the slow checks (transformers' own GGUF tokenizer conversion, about a minute per "
                        "file)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--jobs", type=Count(1, 1 << 12), default=None, metavar="N",
                      help="run N cases at once. Built-in cases: each in a process of its own on one CPU thread, so "
                        "the figures are the same whatever N (default: one per CPU, at most one per 7 GB of "
                        "memory). --model: N > 1 runs each model in a process of its own with its share of the "
                        "CPUs (default 1: here, on every thread). The results come in the same order")
    p.add_argument("--weights", choices=("packed", "dequantized"), default=None,
                      help="the fast engine's GGUF weights: kept packed (the packed kernels on the CPU) or dequantized "
                        "at load (default: packed for a quantized GGUF; built-in cases also check fast packed on "
                        "every quantized file unless dequantized)")
    add_compute_arg(p)
    p.add_argument("--baseline", default=None, type=InFile(streams=True),
                      help="earlier results.json (or --write-baseline file): exit 1 on a regression against it")
    p.add_argument("--write-baseline", default=None, type=OutFile(),
                      help="also write this run as a baseline to this file")
    p.add_argument("--junit-xml", default=None, metavar="FILE", type=OutFile(),
                      help="also write the results as JUnit XML (one test case per check), for a CI system")
    p.add_argument("--explain-budget", type=Number(0.0), default=None, metavar="SECONDS",
                      help="with --model: seconds spent naming the spec variant that explains each failing pair "
                        "(docs/spec-variants.md; default 60, 0: off)")
    p.add_argument("--oracle-drift", default=None, type=InFile(), metavar="PINNED_RESULTS",
                      help="results.json of a run with another oracle version (the pinned transformers): report every "
                        "figure that moved between it and this run, with its first diverging point (nox -s "
                        "oracle-latest); the exit status stays the gates'")
    p.add_argument("--regression-factor", type=Number(1, 1e12), default=10.0,
                      help="a figure this many times worse than the baseline is a regression (default 10)")
    add_scale_args(p)
    add_engine_timeout_arg(p)


def _print_baseline(data: dict, written: str | None) -> None:
    """Terminal lines for ``--baseline`` (regressions, one per line) and ``--write-baseline``."""
    b = data.get("baseline")
    if b:
        regs = b["regressions"]
        print(f"\nbaseline {b['file']}: {b['compared']} checks compared, {len(regs)} regression(s)")
        for r in regs:
            extra = f" ({r['ratio']:.3g}x worse)" if "ratio" in r else ""
            print(f"  REGRESSION {r['case']} {r['gate']} {r.get('prompt') or ''}: {r['rule']}{extra}: "
                  f"baseline {r.get('baseline')} -> now {r.get('now')}")
    if written:
        print(f"baseline written: {written}")


def _print_drift(data: dict) -> None:
    """Terminal lines for ``--oracle-drift``: the versions and one line per moved figure."""
    d = data.get("oracle_drift")
    if not d:
        return
    print(f"\noracle drift, transformers {d['pinned']} -> {d['newest']}: {d['compared']} figures compared, "
          f"{len(d['moved'])} moved")
    for r in drift_rows(d):
        print(f"  {r['case']} {r['gate']} {r['prompt']}: {r['pinned']} -> {r['newest']} ({r['change']}, "
              f"{r['verdict']}); first diverging point {r['first diverging point']}"
              + ("" if r["oracle"] == "yes" else "  [not an oracle pair]"))
    for side in ("newest", "pinned"):
        for line in only_summary(d[f"only_{side}"], side):
            print(f"  only with the {side} oracle: {line}")
    ways = sorted({(c["pinned"], c["newest"]) for c in d.get("assistant_construction", [])})
    for before, after in ways:
        print(f"  the MTP assistant: {before} -> {after} construction")


def execute(args: argparse.Namespace) -> tuple[dict, int]:
    """Run the job as ``g4h parity ARGS`` asks (the report written, ``--junit-xml`` too), print nothing; return
    ``(results, exit status)``. The pytest plugin (:mod:`harness.pytest_plugin`) runs the job through here.

    Raises:
        InputError: bad input found before any case ran (one line).
    """
    check_out_dir(args.out)
    if args.layers is not None and not args.model:
        raise InputError("--layers N goes with --model (the built-in cases are small already)")
    if args.junit_xml:
        check_out_file(args.junit_xml)
    against = [n for text in args.against for n in split_engines(text)] if args.against else None
    parse_declare(args.declare or ())  # a bad --declare is one line before any work
    quick = bool(args.quick)
    data, status = _run(args, against, quick)
    if args.junit_xml:
        write_text_atomic(args.junit_xml, junit_xml(data))
    return data, status


def _run(args: argparse.Namespace, against: list[str] | None, quick: bool) -> tuple[dict, int]:
    def pick(given, full, fast):
        return given if given is not None else (fast if quick else full)

    # the sweep's rule (g4h sweep): --address, else RAY_ADDRESS; Ray's variable is read only where a cluster can serve
    address = args.address or (os.environ.get("RAY_ADDRESS") if args.model and args.oracle == ORACLE else None)
    return run_parity(models=args.model, against=against, out=args.out, real=not args.no_real, address=address or None,
                      case_filter=args.case, quiet=args.quiet, baseline=args.baseline,
                      write_baseline=args.write_baseline, regression_factor=args.regression_factor,
                      skip=tuple(args.skip), slow=args.slow, prompts=args.prompts or PROMPTS,
                      engine_options=engine_options(args), weights=args.weights, oracle=args.oracle,
                      jobs=args.jobs, quick=quick, oracle_drift=args.oracle_drift,
                      explain_budget=budget_seconds(args.explain_budget),
                      server=ServerOptions(
                          max_new_tokens=pick(args.max_new_tokens, GREEDY_NEW_TOKENS, QUICK_NEW_TOKENS),
                          top_n=args.top_n,
                          batch_requests=pick(args.batch_requests, 16, QUICK_SERVER_REQUESTS),
                          concurrency=pick(args.concurrency, 8, QUICK_SERVER_REQUESTS),
                          require=tuple(args.require)))


def run(args: argparse.Namespace) -> int:
    """Run the job, print the verdict table; return the exit status."""
    data, status = execute(args)
    print(short_table(data))
    for line in explanation_lines(data):  # why a failing pair diverges: the report's first section, here too
        print(for_terminal(line.replace("**", "")))
    _print_baseline(data, args.write_baseline)
    _print_drift(data)
    print(f"\nreport: {for_terminal(data['run_dir'])}/report.md")
    print(f"{for_terminal(data['verdict'], newlines=False)} (exit {status})")
    return status
