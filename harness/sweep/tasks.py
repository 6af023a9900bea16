"""What one sweep task computes, wherever it runs: plain functions of a file, an engine and a prompt set.

:mod:`.run` wraps them in Ray tasks; they know nothing of Ray and run as well in the test process.

* :func:`base_run`: the float64 reference on a group's base file: every prompt's logits ``[T, V]`` (float64),
  the residual stream after every layer (``l_out``) on the *trace prompt*, and the greedy streams with their
  top-N log-probs. Its result is the base every other task is measured against (llama-perplexity's
  ``--kl-divergence-base`` file; here it travels through Ray's object store).
* :func:`engine_run`: one engine on one file. First the pair of ``g4h parity --model FILE --against ENGINE``
  (:func:`pair_figures`: the float64 reference on the same file against the engine through parity's one pair
  pipeline, :func:`harness.parity.checks.pair.pair_checks`: the same pair name ``reference~<kind>``, metric names,
  declared-numerics emulation and gates); then, on the same engine still open, the sweep's own figures against the
  group's base (:func:`measure`): llama-perplexity's KLD statistics over every scored position
  (:func:`harness.core.kld.kld_stats`), greedy agreement by vLLM's rule (:func:`harness.core.metrics.greedy_agreement`)
  with the first step that differs, and the relative L2 of every layer's ``l_out`` against the base's on the trace
  prompt with the first layer beyond :data:`harness.core.gates.SWEEP_DIVERGENCE_REL_L2`: the damage of the file's
  quantization, which parity (the reference on the file itself) does not measure. It returns the row and the engine's
  logits (the cross-engine agreement of one file compares them).

Positions scored: in each prompt of ``T`` tokens, positions ``0 .. T-2`` (each has a next token, so perplexity and
Δp are defined, as in llama-perplexity); a one-token prompt counts only in the greedy figures.

A failure of the engine is a row, never an exception; its status is read from the pair's ``.runs`` figure
(:func:`pair_status`, parity's words: ``not_run``, ``crashed`` for an engine failure, ``bad_input``, ``oom`` for a
memory plan that refused); the reference failing on the file, an allocation failure and non-finite logits are said
here (``bad_input``, ``oom``, ``crashed``), anything else is ``error`` with the exception named.
"""

from __future__ import annotations

import os
import platform
import resource
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core.gates import SWEEP_DIVERGENCE_REL_L2, resolve
from ..core.engine_kinds import ORACLE, TWIN
from ..core.kld import kld_stats
from ..core.memory import NotEnoughMemory, is_out_of_memory
from ..core.metrics import greedy_agreement, rel_l2
from ..core.workers import EngineFailure
from ..engines import engine_kind, make_engine
from ..engines.checked import CheckedEngine
from ..engines.numerics import KIND_NUMERICS, effective, emulate, engine_numerics, key_name
from ..engines.reference import ReferenceEngine
from ..parity.cases import OWN_CHECKS
from ..parity.checks.pair import expected_sets, pair_checks
from ..parity.checks.reference_runs import ReferenceRuns
from ..parity.checks.server import ServerOptions, spec_gates
from ..parity.result import CaseResult

#: The trace point whose per-layer error locates the first divergence: the residual stream after each layer.
TRACE_POINT = "l_out"

#: KLD statistics kept in a row (the rest of llama-perplexity's set is in ``results.json`` under ``kld``).
ROW_KLD = ("mean_kld", "mean_kld_unc", "kld_p99_0", "kld_p99_9", "maximum_kld", "median_kld", "same_top_p_pct",
           "same_top_p_pct_unc", "rms_dp_pct", "mean_ppl_ratio", "mean_ln_ppl_ratio")


NOT_EMULATED_IN_SWEEP = ("quantized_activations",)
"""Declared approximations the sweep's base does not make (the cross-engine comparison judges a file with quantized or
16-bit matrices on the 8-bit yardstick instead, ``harness/sweep/judge.py``); each row's ``g4h parity`` pair
(:func:`pair_figures`) emulates them, on the row's own file, as parity does."""


def sweep_emulation(emulation: Sequence[str], types: Sequence[str] | dict[str, int]) -> tuple[str, ...]:
    """The emulation key the sweep's base makes for an engine whose declared numerics call for ``emulation``
    (:meth:`harness.engines.numerics.Numerics.emulation`, as ``g4h parity`` makes it) on a file whose matrices are
    stored as ``types``: the same key as parity's (:func:`harness.engines.numerics.effective`), less
    :data:`NOT_EMULATED_IN_SWEEP`."""
    return tuple(a for a in effective(emulation, types) if a not in NOT_EMULATED_IN_SWEEP)


def predicted_emulations(engines: Sequence[str], types: Sequence[str] | dict[str, int]) -> list[tuple[str, ...]]:
    """The emulation keys (:func:`sweep_emulation`) the base must be computed under for the engines named, as far as
    their kinds tell before they start (:data:`harness.engines.numerics.KIND_NUMERICS`: llama.cpp's fp16 GELU table);
    a ``cmd:`` engine declares its numerics at its handshake, and a key no kind predicts is not in the base (the
    figures that need it say so). Empty keys (the exact base) are left out; sorted."""
    keys = {sweep_emulation(KIND_NUMERICS[k].emulation(), types) for k in map(engine_kind, engines)
            if k in KIND_NUMERICS}
    return sorted(k for k in keys if k)


def set_threads(n: int) -> None:
    """Make every library of this process use ``n`` threads: OpenMP and llama.cpp's workers read
    ``OMP_NUM_THREADS``; torch, when imported, is told directly."""
    os.environ["OMP_NUM_THREADS"] = str(int(n))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(n))


def where() -> dict[str, Any]:
    """The node and process this runs on: Ray's node id (when inside Ray), the host name and the process id."""
    node = None
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        node = ray.get_runtime_context().get_node_id()
    return {"node": node, "host": socket.gethostname(), "pid": os.getpid(), "python": platform.python_version()}


def _peak_rss_gb() -> float:
    """Peak resident memory of this process and of its largest finished child (llama.cpp's worker), in GB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return round(max(own, kids) * scale / 1e9, 3)


def scored(prompts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompts with at least two tokens (they have a scored position)."""
    return [p for p in prompts if len(p["prompt_ids"]) >= 2]


def trace_prompt(prompts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The prompt whose layers are compared: the longest (the first of the longest)."""
    return max(prompts, key=lambda p: len(p["prompt_ids"]))


# --------------------------------------------------------------------------- capture


def _capture(eng: Any, kind: str, prompts: Sequence[dict[str, Any]], traced: dict[str, Any], new_tokens: int,
             top_n: int) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray] | None, dict[str, dict[str, Any]]]:
    """Logits of every prompt, ``l_out`` per layer of ``traced`` (None when the engine reports no trace points) and
    the greedy streams (empty when the engine does not generate or ``new_tokens`` is 0)."""
    ops = getattr(eng, "ops", None)
    can = (lambda op: op in ops) if ops is not None else (lambda op: True)
    logits: dict[str, np.ndarray] = {}
    layers: dict[int, np.ndarray] | None = None
    if can("logits"):
        many = getattr(eng, "logits_many", None)
        others = [p for p in prompts if p is not traced]
        if many is not None:  # llama.cpp: one worker process per call
            for p, (z, _) in zip(others, many([p["prompt_ids"] for p in others]) if others else []):
                logits[str(p["id"])] = z
            (z, points), = many([traced["prompt_ids"]], trace=True)
            logits[str(traced["id"])] = z
            layers = {layer: np.asarray(a, dtype=np.float32) for pt, layer, a in points if pt == TRACE_POINT} or None
        else:
            for p in others:
                logits[str(p["id"])] = eng.logits(p["prompt_ids"])
            got: dict[int, np.ndarray] = {}
            if can("trace") and not hasattr(eng, "trace_file"):
                def keep(point: str, layer: int, arr: Any) -> None:
                    if point == TRACE_POINT:
                        got[int(layer)] = np.array(arr, dtype=np.float32)
                logits[str(traced["id"])] = eng.logits(traced["prompt_ids"], trace=keep)
            else:
                logits[str(traced["id"])] = eng.logits(traced["prompt_ids"])
            layers = got or None
        logits = {k: np.asarray(v, dtype=np.float64) for k, v in logits.items()}
    greedy: dict[str, dict[str, Any]] = {}
    if new_tokens > 0 and can("generate") and hasattr(eng, "generate_full"):
        gens = eng.generate_full([p["prompt_ids"] for p in prompts], new_tokens, top_n=top_n)
        greedy = {str(p["id"]): {"tokens": list(map(int, g.tokens)), "top": [[int(i) for i, _ in s] for s in g.top]}
                  for p, g in zip(prompts, gens)}
    return logits, layers, greedy


def base_run(path: str, prompts: Sequence[dict[str, Any]], new_tokens: int, top_n: int, threads: int,
             engine: str = ORACLE, options: dict[str, Any] | None = None,
             emulations: Sequence[Sequence[str]] = ()) -> dict[str, Any]:
    """The float64 reference (or ``engine``) on the base file: the base of every measurement of its group.

    Args:
        path: the group's base file.
        prompts: ``{"id", "prompt_ids"}`` records, within the model's vocabulary.
        new_tokens: tokens of each greedy stream (0: none).
        top_n: log-probs kept per greedy step (vLLM's N).
        threads: CPU threads (the CPUs the task declared).
        engine, options: the oracle engine (default the float64 reference) and its options.
        emulations: emulation keys (:func:`predicted_emulations`): the logits of every scored prompt are computed
            again under each (:func:`harness.engines.numerics.emulate`, as ``g4h parity``'s reference makes them),
            to judge an engine that declares those approximations against what it should compute.

    Returns:
        ``{"file", "engine", "logits": {prompt id: float64 [T, V]}, "trace_prompt": id, "layers": {layer: float32
        [T, hidden]}, "greedy": {id: {"tokens", "top"}}, "emulated": {key name: {prompt id: float64 [T, V]}},
        "effects": {"A|B": {"mean_kld", "max_abs_logit"}}, "seconds", "peak_rss_gb", "where"}``; ``effects`` holds,
        for every ordered pair of the computed keys (``exact`` for none: :func:`harness.engines.numerics.key_name`),
        the figures of the base under ``B`` against the base under ``A`` (:func:`emulation_effects`).

    Raises:
        InputError, EngineFailure: the reference cannot run on the base (the whole group then fails, with this reason).
    """
    set_threads(threads)
    t0 = time.perf_counter()
    eng = make_engine(engine, path, **(options or {}))
    try:
        traced = trace_prompt(prompts)
        logits, layers, greedy = _capture(eng, engine_kind(engine), prompts, traced, new_tokens, top_n)
        emulated: dict[str, dict[str, np.ndarray]] = {}
        for key in emulations:
            with emulate(tuple(key)):
                emulated[key_name(key)] = {str(p["id"]): np.asarray(eng.logits(p["prompt_ids"]), dtype=np.float64)
                                           for p in scored(prompts)}
    finally:
        close = getattr(eng, "close", None)
        if close is not None:
            close()
    return {"file": path, "engine": engine, "logits": logits, "trace_prompt": str(traced["id"]), "layers": layers or {},
            "greedy": greedy, "emulated": emulated, "effects": emulation_effects(logits, emulated, prompts),
            "seconds": round(time.perf_counter() - t0, 3), "peak_rss_gb": _peak_rss_gb(), "where": where()}


def emulation_effects(exact: dict[str, np.ndarray], emulated: dict[str, dict[str, np.ndarray]],
                      prompts: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """How far the emulations move the base: for every ordered pair ``A|B`` of ``exact`` and the keys of
    ``emulated`` (``A != B``), llama-perplexity's mean KLD of the base under ``B`` against the base under ``A`` and
    the max |Δlogit| over the scored positions. ``exact|K`` (and ``K|exact``) is the *effect* of the emulations of
    ``K`` that ``g4h parity`` raises its limits by (:func:`harness.core.gates.effect_limit`); ``K|L`` the effect
    between two engines that declare different ones (:func:`harness.sweep.judge.agreement`)."""
    sets = {"exact": exact, **emulated}
    if len(sets) < 2 or not scored(prompts):
        return {}
    stacked = {k: _stack(v, prompts) for k, v in sets.items()}
    out = {}
    for a, (za, toks) in stacked.items():
        for b, (zb, _) in stacked.items():
            if a != b:
                out[f"{a}|{b}"] = {"mean_kld": float(kld_stats(zb, za, toks).mean_kld),
                                   "max_abs_logit": float(np.max(np.abs(zb - za)))}
    return out


# --------------------------------------------------------------------------- measurement


def _stack(logits: dict[str, np.ndarray], prompts: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """The scored rows of every prompt stacked ``[N, V]`` and their next tokens ``[N]``."""
    rows, toks = [], []
    for p in scored(prompts):
        z = logits[str(p["id"])]
        rows.append(z[:-1])
        toks.append(np.asarray(p["prompt_ids"][1:], dtype=np.int64))
    return np.concatenate(rows), np.concatenate(toks)


def layer_errors(ours: dict[int, np.ndarray] | None, base: dict[int, np.ndarray]) -> list[float | None] | None:
    """Relative L2 (:func:`harness.core.metrics.rel_l2`) of each layer's ``l_out`` against the base's, by layer
    index (None where a side lacks the layer); None when the engine reports no layers."""
    if not ours or not base:
        return None
    n = max(max(ours), max(base)) + 1
    out: list[float | None] = []
    for i in range(n):
        a, b = ours.get(i), base.get(i)
        out.append(None if a is None or b is None or a.shape != b.shape else float(rel_l2(a, b)))
    return out


def first_divergence(errors: list[float | None] | None, limit: float = SWEEP_DIVERGENCE_REL_L2) -> int | None:
    """The first layer whose relative L2 exceeds ``limit`` (a non-finite error counts as beyond), or None."""
    for i, e in enumerate(errors or []):
        if e is not None and not (e <= limit):
            return i
    return None


def greedy_figures(ours: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]], top_n: int) -> dict[str, Any]:
    """Greedy streams against the base's: identical streams, streams agreeing by vLLM's rule, the earliest step that
    differs (and its prompt), the mean step of the first difference (a stream that never differs counts as its
    length)."""
    ids = [k for k in base if k in ours and ours[k]["tokens"] and base[k]["tokens"]]
    if not ids:
        return {"greedy_streams": 0}
    same = agree = 0
    first: tuple[int, str] | None = None
    steps = []
    for k in ids:
        g = greedy_agreement(ours[k]["tokens"], base[k]["tokens"], ours[k]["top"], base[k]["top"], n=top_n)
        agree += g.agree
        if g.first_mismatch is None:
            same += 1
            steps.append(g.n_compared)
        else:
            steps.append(g.first_mismatch)
            if first is None or g.first_mismatch < first[0]:
                first = (g.first_mismatch, k)
    return {"greedy_streams": len(ids), "greedy_identical_pct": 100.0 * same / len(ids),
            "greedy_agree_pct": 100.0 * agree / len(ids),
            "greedy_first_diff_step": None if first is None else first[0],
            "greedy_first_diff_prompt": None if first is None else first[1],
            "greedy_mean_first_diff_step": float(np.mean(steps))}


def measure(logits: dict[str, np.ndarray], layers: dict[int, np.ndarray] | None, greedy: dict[str, dict[str, Any]],
            base: dict[str, Any], prompts: Sequence[dict[str, Any]], top_n: int, on_base: bool = False
            ) -> dict[str, Any]:
    """The figures of one engine's outputs against the base (see the module docstring); ``on_base``: the engine ran
    the base file itself, so its figures against the base under each emulation (``vs_emulated``, by key name) are
    kept too, for :func:`harness.sweep.judge.base_verdict`."""
    out: dict[str, Any] = {}
    if logits and scored(prompts):
        ours, toks = _stack(logits, prompts)
        ref, _ = _stack(base["logits"], prompts)
        if ours.shape != ref.shape:
            raise InputError(f"logits of shape {list(ours.shape)} against the base's {list(ref.shape)} (another "
                             "vocabulary?)")
        if not np.all(np.isfinite(ours)):
            bad = np.argwhere(~np.isfinite(ours))[0]
            out["nonfinite"] = f"non-finite logit at scored row {int(bad[0])}, token {int(bad[1])}"
        else:
            stats = kld_stats(ours, ref, toks).as_dict()
            out["kld"] = stats
            out.update({k: stats[k] for k in ROW_KLD})
            out["max_abs_logit"] = float(np.max(np.abs(ours - ref)))
            if on_base:  # the same weights as the base: against the base under each emulation it was computed with
                out["vs_emulated"] = {}
                for name, z in (base.get("emulated") or {}).items():
                    emu, _ = _stack(z, prompts)
                    out["vs_emulated"][name] = {"mean_kld": float(kld_stats(ours, emu, toks).mean_kld),
                                                "max_abs_logit": float(np.max(np.abs(ours - emu)))}
    errs = layer_errors(layers, base.get("layers") or {})
    out["layer_rel_l2"] = errs
    out["first_divergence_layer"] = first_divergence(errs)
    out["worst_layer_rel_l2"] = max((e for e in errs or [] if e is not None), default=None)
    if greedy and base.get("greedy"):
        out.update(greedy_figures(greedy, base["greedy"], top_n))
    return out


def pair_figures(path: str, engine: str, prompts: Sequence[dict[str, Any]], new_tokens: int, top_n: int,
                 options: dict[str, Any] | None = None, also: Callable[[Any], None] | None = None
                 ) -> list[dict[str, Any]]:
    """``g4h parity --model path --against engine`` on ``prompts``: the float64 reference on ``path`` itself against
    the engine, through the one pair pipeline (:func:`harness.parity.checks.pair.pair_checks`, as
    :func:`harness.parity.cases.pairs` calls it), judged by the file's gates (its case's ``[gates]`` when it is a
    built synthetic case's GGUF, :func:`harness.parity.checks.server.spec_gates`) as a parity run judges them
    (:meth:`harness.parity.result.CaseResult.apply`): the same pair name and direction (``reference~<kind>``), metric
    names, declared-numerics emulation (llama.cpp's GELU table, its 8-bit activations on a quantized file) and limits.

    Args:
        path: the file.
        engine, options: the engine and its options (:func:`harness.engines.make_engine`).
        prompts: ``{"id", "prompt_ids"}`` records within the model's vocabulary.
        new_tokens, top_n: the greedy streams' length and vLLM's N (parity's ``--max-new-tokens``, ``--top-n``);
            ``new_tokens`` 0 (``g4h sweep --max-new-tokens 0``): no streams, so no ``.greedy`` figures.
        also: called with the engine, still open, once the pair is measured (``pair_checks``' ``also``).

    Returns:
        The checks as a parity ``results.json`` holds them (``gate``, ``measured``, ``limit``, ``pass`` ...), the
        pair's ``.runs`` first.

    Raises:
        InputError: the reference cannot read ``path`` (:class:`harness.core.memory.NotEnoughMemory`: its plan does
            not fit).
    """
    runs = ReferenceRuns(CheckedEngine(ReferenceEngine(path), ORACLE))
    gates = resolve(spec_gates(path), str(path))
    runs.gates = gates  # as cases.user_case: the explanation of a failing pair is judged by the same gates
    server = ServerOptions(max_new_tokens=new_tokens, top_n=top_n)
    runs.prefetch(expected_sets([engine]), prompts, new_tokens, top_n, greedy=new_tokens > 0)
    res = CaseResult(case=os.path.basename(path), kind="user", model=str(path))
    res.apply(pair_checks(runs, engine, path, prompts, lambda m: None, res.case, options=options, extra=server,
                          own_checks=OWN_CHECKS, also=also), gates)
    return res.checks


def pair_status(checks: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """The row's ``(status, reason)`` read from the pair's ``.runs`` check (:func:`pair_figures`), one vocabulary
    with ``g4h parity``: ``ok`` (it ran: 1); ``oom`` (its memory plan refused, ``out_of_memory``); ``crashed``
    (``engine_failure``: it crashed, broke its protocol, answered wrongly; parity's "ENGINE FAILED", exit 1);
    ``bad_input`` (``bad_input``: it cannot be used as given, parity's exit 2); ``not_run`` (any other 0: not
    installed, cannot read this file form). The statuses a sweep adds (:data:`harness.sweep.judge.STATUSES`:
    ``timeout``, ``no_base``, ``oom`` of Ray's memory monitor, a dead Ray worker) are of tasks, which a parity run
    does not have."""
    runs = next((c for c in checks if c["gate"].endswith(".runs")), None)
    if runs is None:
        return "error", "the pair gave no .runs figure"
    if runs["measured"] == 1.0:
        return "ok", None
    why = str(runs.get("why") or runs.get("got") or "did not run")
    if runs.get("out_of_memory"):
        return "oom", why
    if runs.get("engine_failure"):
        return "crashed", why
    if runs.get("bad_input"):
        return "bad_input", why
    return "not_run", why


def engine_run(path: str, engine: str, prompts: Sequence[dict[str, Any]], base: dict[str, Any], new_tokens: int,
               top_n: int, threads: int, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict]:
    """One engine on one file: the pair of ``g4h parity`` on that file (:func:`pair_figures`: ``checks``, ``pair``,
    the row's status by :func:`pair_status`), and on the same engine, still open, the sweep's own figures against
    the group's base (:func:`measure`: the damage of the file's quantization, llama-perplexity's statistics).

    Returns:
        ``(row, logits)``: the row (``status``, ``reason``, ``pair``, ``checks``, the figures, ``seconds``,
        ``peak_rss_gb``, ``where``) and the engine's logits by prompt id as float32 (empty when it did not run), for
        the cross-engine agreement.
    """
    set_threads(threads)
    t0 = time.perf_counter()
    row: dict[str, Any] = {"status": "ok", "reason": None}
    logits: dict[str, np.ndarray] = {}
    captured: dict[str, Any] = {}
    kind = engine_kind(engine)

    def capture(eng: Any) -> None:  # on the engine the pair measured: what the sweep's own figures need
        dtype = getattr(eng, "dtype", None)  # what it computes in, as it says (fast --dtype, a cmd: engine's hello)
        numerics = engine_numerics(eng, kind)  # what g4h parity reads: hello, kind, dtype
        row.update(dtype=dtype if isinstance(dtype, str) else None,
                   approximations=list(getattr(eng, "approximations", None) or numerics.approximations),
                   numerics=numerics.as_dict(), emulation=list(numerics.emulation()))
        traced = next(p for p in prompts if str(p["id"]) == base["trace_prompt"])
        captured["out"] = _capture(eng, kind, prompts, traced, new_tokens, top_n)

    try:
        checks = pair_figures(path, engine, prompts, new_tokens, top_n, options, also=capture)
        row.update(pair=checks[0]["gate"].rpartition(".")[0], checks=checks)
        status, reason = pair_status(checks)
        row.update(status=status, reason=reason)
        if status == "ok" and "out" in captured:
            logits, layers, greedy = captured["out"]
            try:
                row.update(measure(logits, layers, greedy, base, prompts, top_n,
                                   on_base=os.path.realpath(path) == os.path.realpath(base["file"])))
            except InputError as e:  # its logits do not fit the base's (another vocabulary): it broke its protocol
                row.update(status="crashed", reason=_line(e))
            if "nonfinite" in row:
                row.update(status="crashed", reason=f"engine output: {row.pop('nonfinite')}")
    except NotEnoughMemory as e:  # the reference's memory plan on this file
        row.update(status="oom", reason=_line(e))
    except InputError as e:  # the reference cannot read the file (g4h inspect let it through)
        row.update(status="bad_input", reason=f"the reference on {os.path.basename(path)}: {_line(e)}")
    except Exception as e:  # an allocation failure is a row; anything else is a row naming the exception
        if is_out_of_memory(e):
            row.update(status="oom", reason=f"out of memory: {_line(e)}")
        else:
            tb = traceback.extract_tb(e.__traceback__)
            at = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
            row.update(status="error", reason=f"{type(e).__name__}: {_line(e)}{at}")
    row.update(seconds=round(time.perf_counter() - t0, 3), peak_rss_gb=_peak_rss_gb(), where=where())
    # float32 for the cross-engine comparison: half the bytes through the store; its rounding moves a KLD by ~1e-14
    return row, ({k: v.astype(np.float32) for k, v in logits.items()} if row["status"] == "ok" else {})


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --------------------------------------------------------------------------- 8-bit activation sensitivity

#: Block lengths of llama.cpp's 8-bit activation formats (``ggml-common.h``: ``QK_K`` for ``block_q8_K``, the
#: activations of K-quant and i-quant dot products; ``QK8_0`` for ``block_q8_0``, those of the legacy types).
Q8_K_BLOCK, Q8_0_BLOCK = 256, 32


def round_activations_q8(x: Any) -> Any:
    """``x`` (a float32 torch tensor ``[..., K]``) rounded as llama.cpp rounds a matrix product's activations to 8 bits.

    Source: ggml ``ggml-quants.c``, ``quantize_row_q8_K_ref`` (blocks of 256 along ``K``: the element of largest
    magnitude ``m`` maps to -127, ``iscale = -127 / m``, ``q = min(127, round(iscale * x))``, the value ``q / iscale``)
    and ``quantize_row_q8_0_ref`` (blocks of 32: ``d = max|x| / 127``, ``q = round(x / d)``, the value ``q`` times ``d``
    rounded to fp16, as stored). Rows whose
    length is a multiple of 256 take the first (the coarser: its scale spans 8x more values), other multiples of 32
    the second, the rest are left as they are. Rounding is half to even (ggml's ``nearest_int``).
    """
    torch = sys.modules["torch"]  # x is a torch tensor: torch is loaded (by the fast engine)
    K = x.shape[-1]
    if K % Q8_K_BLOCK and K % Q8_0_BLOCK:
        return x
    block = Q8_K_BLOCK if K % Q8_K_BLOCK == 0 else Q8_0_BLOCK
    b = x.reshape(*x.shape[:-1], K // block, block)
    if block == Q8_K_BLOCK:
        idx = b.abs().argmax(dim=-1, keepdim=True)
        m = torch.gather(b, -1, idx)
        iscale = torch.where(m != 0, -127.0 / m, torch.zeros_like(m))
        q = torch.clamp(torch.round(iscale * b), max=127.0)
        y = torch.where(m != 0, q * torch.where(iscale != 0, 1.0 / iscale, iscale), torch.zeros_like(b))
    else:
        d = b.abs().amax(dim=-1, keepdim=True) / 127.0
        q = torch.round(torch.where(d != 0, b / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(b)))
        y = q * d.to(torch.float16).to(torch.float32)
    return y.reshape(x.shape).to(x.dtype)


def sensitivity_run(path: str, prompts: Sequence[dict[str, Any]], base: dict[str, Any], threads: int
                    ) -> dict[str, Any]:
    """How much llama.cpp's kind of 8-bit activation rounding moves this model: the fast engine in fp32 on the base
    file with the input of every matrix product rounded by :func:`round_activations_q8`, against the base.

    It is the yardstick of the cross-engine gate (``sweep~engines_q8.mean_kld_ratio`` in
    :mod:`harness.core.gates`): an engine that rounds its activations to 8 bits (llama.cpp, ``quantized_activations``)
    and one that does not (fast) differ on any file by about this much, whatever the file's own damage.

    Returns:
        ``{"status", "reason", "mean_kld", "kld": {...}, "same_top_p_pct", "seconds", "where"}``.
    """
    set_threads(threads)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"status": "ok", "reason": None}
    try:
        eng = make_engine(TWIN, path, dtype="float32", weights="dequantized")
        fm = sys.modules["gemma4_harness.fast.model"]  # the module whose products the engine runs (loaded by it)
        plain = fm.linear
        fm.linear = lambda x, w: plain(round_activations_q8(x), w)
        try:
            logits = {str(p["id"]): np.asarray(eng.logits(p["prompt_ids"]), dtype=np.float64) for p in scored(prompts)}
        finally:
            fm.linear = plain
        ours, toks = _stack(logits, prompts)
        ref, _ = _stack(base["logits"], prompts)
        stats = kld_stats(ours, ref, toks).as_dict()
        out.update(kld=stats, mean_kld=stats["mean_kld"], same_top_p_pct=stats["same_top_p_pct"])
    except (InputError, EngineFailure) as e:
        out.update(status="not_run", reason=_line(e))
    except Exception as e:  # the yardstick is missing: the gates that need it become informational
        out.update(status="error", reason=f"{type(e).__name__}: {_line(e)}")
    out.update(seconds=round(time.perf_counter() - t0, 3), where=where())
    return out
