"""The ``llamacpp`` engine: llama.cpp through llama-cpp-python, always in a worker subprocess.

llama.cpp is an oracle next to HF transformers (DESIGN.md, "Engines"). It aborts
the whole process on some layouts (its KV-donor rule differs from transformers'
on unusual layer layouts and ends in a ``GGML_ASSERT``), so every llama.cpp call
happens in ``python -m harness.llamacpp_worker`` (:mod:`harness.llamacpp_worker`):
one process per call, fed one JSON request on stdin, answering with
``result.json`` and ``.npy`` files in a temporary folder. A non-zero exit or a
signal becomes :class:`EngineCrashed` whose one line is the worker's last
meaningful stderr line (for an abort, the ``GGML_ASSERT`` text), and the harness
goes on with the next case.

Context settings (the DESIGN.md llama.cpp gate row): KV cache F32, flash
attention off, ``swa_full`` false (the sliding layers keep the real, ring-sized
cache), an output row for every position. Two known, expected differences from
the float64 reference:

* llama.cpp's CPU GELU reads an fp16 lookup table: ~1e-3 in activations, up to
  ~3e-2 in logits on the small synthetic models. :func:`check_synthetic` therefore
  gates against the reference with the same table emulated (:func:`llamacpp_numerics`)
  and reports the figures against the exact reference beside them;
* a gemma4 GGUF without a ``final_logit_softcapping`` key gets llama.cpp's
  default softcap of 30 (``llama-hparams.h``), where the file (and the harness)
  says there is none: that shows as an engine disagreement on ``edge-no-softcap``.

Public API: :class:`LlamaCppEngine` (the engine protocol of
:mod:`harness.engines`), :class:`EngineCrashed`, :func:`check_synthetic`
(llama.cpp vs reference on a built synthetic case, with the gates) and
:func:`check_gemma3_real` (llama.cpp vs reference on the real Gemma 3 270M GGUF,
the full ``llama-perplexity --kl-divergence`` statistic set); for other workers (the tokenizer's,
:mod:`harness.llamacpp_tokworker`), :func:`worker_env` and :func:`crash_error`.

Batches: :meth:`LlamaCppEngine.generate` with ``batched=True`` serves all
prompts from one context, one ``seq_id`` per prompt (prefill in one
``llama_decode``, then one decode per step with a token per sequence).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from harness.engines import EngineUnavailable, Generated, TraceFn
from reference.errors import PromptError
from reference.model import gelu_tanh as _exact_gelu  # bound at import: llamacpp_numerics swaps the module's name

INSTALL_MSG = ("llama.cpp engine not installed: pip install 'gemma4-harness[llamacpp]' "
               "(builds llama-cpp-python from source, ~5 min)")
#: The llama-cpp-python release whose bundled llama.cpp this module was written against.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Trace points in the order an engine reports them (the reference's order).
_POINT_ORDER = ("attn_out", "ffn_mlp", "ffn_moe", "ffn_out", "per_layer_embd_out", "l_out")


class EngineCrashed(RuntimeError):
    """The engine's process died (abort, signal, non-zero exit) or could not load the model.

    ``str(err)`` is one line, ``engine crashed: <what the engine last said>``.
    """


def llama_cpp_available() -> bool:
    """True when ``llama_cpp`` imports here."""
    try:
        _import_llama_cpp()
    except EngineUnavailable:
        return False
    return True


def _import_llama_cpp():
    try:
        return importlib.import_module("llama_cpp")
    except Exception:  # ImportError, or OSError from a broken shared library
        raise EngineUnavailable(INSTALL_MSG) from None


_SRC_PATH = re.compile(r"(?:[A-Za-z]:)?[^\s:()]*[/\\]([^/\\\s:()]+\.(?:c|cc|cpp|h|hpp|cu)):")


def _crash_line(stderr: str, rc: int) -> str:
    """The one line that says why the worker died (source paths shortened to the file name)."""
    return _SRC_PATH.sub(r"\1:", _pick_line(stderr, rc))


_REASON_KEYS = ("GGML_ASSERT", "GGML_ABORT", "error", "Error", "failed", "terminate")


def _is_reason(stderr: str) -> bool:
    """stderr holds a line that says why (a worker error, an assert, an error message)."""
    return "G4H-WORKER-ERROR" in stderr or any(k in stderr for k in _REASON_KEYS)


def _pick_line(stderr: str, rc: int) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "G4H-WORKER-ERROR" in ln:
            return ln.split("]: ", 1)[-1] if "]: " in ln else ln
    for key in _REASON_KEYS:
        for ln in reversed(lines):
            if key in ln:
                return ln
    if lines:
        return lines[-1]
    return f"exit status {rc}"


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def worker_env() -> dict[str, str]:
    """The environment of a llama.cpp worker process: this one's, plus the repo root first on ``PYTHONPATH``
    (so ``python -m harness.<worker>`` imports this checkout) and ``GGML_NO_BACKTRACE=1`` (an abort prints
    its assert line and never attaches a debugger)."""
    env = dict(os.environ)
    env["GGML_NO_BACKTRACE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def crash_error(stderr: str, rc: int, model_name: str) -> EngineCrashed:
    """The :class:`EngineCrashed` for a worker that died with exit status ``rc`` (negative: a signal).

    Args:
        stderr: everything the worker wrote on stderr.
        rc: its exit status (``Popen.returncode``).
        model_name: the GGUF's file name, named when stderr does not say why.

    Returns:
        ``EngineCrashed("engine crashed: <line>")``, one line: the worker's ``G4H-WORKER-ERROR`` message,
        else its last line that names a reason (``GGML_ASSERT``, ``error``, ``terminate``, ...; source paths
        shortened to the file name) with the exit status, else ``llama.cpp worker died (<status>) on
        <model_name>`` and its last stderr line, if any.
    """
    line = _crash_line(stderr, rc)
    if not _is_reason(stderr):
        line = f"llama.cpp worker died ({_describe_rc(rc)}) on {model_name}" + (
            f"; its last message: {line}" if stderr.strip() else "")
        return EngineCrashed(f"engine crashed: {line}")
    return EngineCrashed(f"engine crashed: {line} ({_describe_rc(rc)})")


BENCH_CHUNK = 512
"""Tokens per ``llama_decode`` when a bench job fills its context (``depth``) before the clock starts."""


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python 0.3.36) on CPU, F32 KV cache, flash attention off, in a subprocess.

    Args:
        path: a ``.gguf`` file.
        n_ctx: context length per sequence (a longer prompt is a :class:`PromptError`).
        threads: CPU threads for llama.cpp (default: all cores).
        n_ubatch: physical batch size; default one ubatch for the whole prompt. A smaller value splits
            the prompt into several ``llama_decode`` ubatches (chunked prefill through the ring buffer).
        swa_full: give sliding-window layers a full-size cache (default False: the real ring buffer).
        batched: default for :meth:`generate`: all prompts in one context, one ``seq_id`` each.
        extra_bufts: let llama.cpp use its extra CPU weight buffers (AMX tiles, repacked quant layouts).
            Off by default: the plain CPU kernels are the oracle, and AMX code dies of SIGILL in VMs
            that do not grant the AMX tile state (seen here: a Firecracker guest whose CPU lists amx_int8).
        timeout: seconds one worker process may run.

    Raises:
        EngineUnavailable: llama-cpp-python is not installed (:data:`INSTALL_MSG`), or ``path`` is not a file.
    """

    name = "llamacpp"

    def __init__(self, path: str | os.PathLike, n_ctx: int = 1024, threads: int | None = None,
                 n_ubatch: int | None = None, swa_full: bool = False, batched: bool = False,
                 extra_bufts: bool = False, timeout: float = 600.0):
        _import_llama_cpp()
        self.path = Path(path)
        if not self.path.is_file():
            raise EngineUnavailable(f"{self.path}: the llamacpp engine needs a GGUF file")
        self.n_ctx = int(n_ctx)
        self.threads = threads
        self.n_ubatch = n_ubatch
        self.swa_full = bool(swa_full)
        self.batched = bool(batched)
        self.extra_bufts = bool(extra_bufts)
        self.timeout = float(timeout)
        self.last_run_s = 0.0

    # ------------------------------------------------------------------ worker

    def run_jobs(self, jobs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Path]:
        """Run ``jobs`` in one worker process. Returns (job results, folder of their files).

        The folder is a fresh temporary directory; the caller reads the ``.npy`` files it names
        (see :mod:`harness.llamacpp_worker`) and removes it.

        Raises:
            EngineCrashed: the worker exited non-zero, died of a signal, timed out, or could not load
                the model or run a batch.
            PromptError: the worker refused a prompt (token id out of range, empty).
        """
        need = 1
        for j in jobs:
            if j["op"] == "logits":
                need = max(need, len(j["ids"]))
            elif j["op"] == "generate":
                lens = [len(p) for p in j["prompts"]]
                need = max(need, sum(lens) if j.get("batched") else max(lens, default=1), len(lens))
            elif j["op"] == "bench":
                need = max(need, j["batch"] * (j["n"] if j["test"] == "pp" else 1),
                           j["batch"] * min(j["depth"], BENCH_CHUNK))
        out_dir = Path(tempfile.mkdtemp(prefix="g4h-llamacpp-"))
        req = {"model": str(self.path), "n_ctx": self.n_ctx, "threads": self.threads,
               "n_batch": need, "n_ubatch": min(self.n_ubatch, need) if self.n_ubatch else need,
               "swa_full": self.swa_full, "extra_bufts": self.extra_bufts, "out_dir": str(out_dir), "jobs": jobs,
               # The eval callback (trace points) costs a Python call per graph node: off for timing-only runs.
               "eval_cb": not all(j["op"] == "bench" for j in jobs)}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "harness.llamacpp_worker"], input=json.dumps(req),
                                  capture_output=True, text=True, env=worker_env(), timeout=self.timeout,
                                  cwd=str(REPO_ROOT))
        except subprocess.TimeoutExpired:
            _rmtree(out_dir)
            raise EngineCrashed(f"engine crashed: llama.cpp worker ran past {self.timeout:.0f} s "
                                f"on {self.path.name}") from None
        finally:
            self.last_run_s = time.perf_counter() - t0
        if proc.returncode != 0 or not (out_dir / "result.json").is_file():
            _rmtree(out_dir)
            if "G4H-WORKER-ERROR[prompt]" in proc.stderr:
                raise PromptError(f"{self.path.name}: llama.cpp: {_crash_line(proc.stderr, proc.returncode)}")
            raise crash_error(proc.stderr, proc.returncode, self.path.name)
        res = json.loads((out_dir / "result.json").read_text())
        return res["jobs"], out_dir

    def _check_len(self, n: int) -> None:
        if n == 0:
            raise PromptError("prompt is empty")
        if n > self.n_ctx:
            raise PromptError(f"prompt of {n} tokens is longer than the llama.cpp context ({self.n_ctx})")

    # ------------------------------------------------------------------ engine protocol

    def logits_many(self, seqs: Sequence[Sequence[int]], trace: bool = False
                    ) -> list[tuple[np.ndarray, list[tuple[str, int, np.ndarray]]]]:
        """float64 ``[T, V]`` logits of every position of each sequence (each from position 0), in one worker.

        Args:
            seqs: token id sequences.
            trace: also return each sequence's trace points ``(point, layer, float32 array [T, ...])``,
                in the reference's order.
        """
        for s in seqs:
            self._check_len(len(s))
        jobs = [{"op": "logits", "ids": [int(t) for t in s], "trace": bool(trace)} for s in seqs]
        results, out_dir = self.run_jobs(jobs)
        try:
            out = []
            for r in results:
                logits = np.load(out_dir / r["logits"]).astype(np.float64)
                points = [(p, int(layer), np.load(out_dir / f)) for p, layer, f in r.get("trace", [])]
                out.append((logits, _order_trace(points)))
            return out
        finally:
            _rmtree(out_dir)

    def logits(self, ids: Sequence[int], trace: TraceFn | None = None) -> np.ndarray:
        """float32 logits as float64 ``[T, V]`` for every position of ``ids`` (positions from 0).

        ``trace``, when given, receives llama.cpp's graph-callback tensors mapped onto our points:
        ``inp_scaled``, ``inp_per_layer`` ``[T, L, P]``, per layer ``attn_out``, ``ffn_mlp``/``ffn_moe``
        (MoE), ``ffn_out``, ``per_layer_embd_out``, ``l_out``; then ``result_norm``, ``result_output``.
        """
        (logits, points), = self.logits_many([ids], trace=trace is not None)
        if trace is not None:
            for p, layer, arr in points:
                trace(p, layer, arr)
        return logits

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      batched: bool | None = None) -> list[Generated]:
        """Greedy continuations with the top-5 ``(id, logprob)`` of every step (:class:`harness.engines.Generated`).

        ``batched`` (default: the engine's setting): one context, one ``seq_id`` per prompt, one
        ``llama_decode`` per step for all sequences; else each prompt alone in a cleared context.
        """
        batched = self.batched if batched is None else bool(batched)
        for p in prompts:
            self._check_len(len(p) + max(int(max_new_tokens) - 1, 0))
        if not prompts or max_new_tokens <= 0:
            return [Generated() for _ in prompts]
        job = {"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
               "max_new_tokens": int(max_new_tokens), "batched": batched}
        (r,), out_dir = self.run_jobs([job])
        _rmtree(out_dir)
        out = []
        for item in r["results"]:
            g = Generated()
            g.tokens = [int(t) for t in item["tokens"]]
            g.top5 = [[(int(i), float(lp)) for i, lp in step] for step in item["top5"]]
            out.append(g)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 batched: bool | None = None) -> list[list[int]]:
        """Greedy continuation of each prompt, ``max_new_tokens`` ids each."""
        return [g.tokens for g in self.generate_full(prompts, max_new_tokens, batched)]

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama.cpp's tokenization of ``text`` (BOS added when ``add_special`` and the model wants it)."""
        return self.tokenize_many([text], add_special, parse_special)[0]

    def tokenize_many(self, texts: Sequence[str], add_special: bool = True,
                      parse_special: bool = True) -> list[list[int]]:
        """:meth:`tokenize` for several texts in one worker."""
        results, out_dir = self.run_jobs([{"op": "tokenize", "text": t, "add_special": add_special,
                                           "parse_special": parse_special} for t in texts])
        _rmtree(out_dir)
        return [[int(t) for t in r["ids"]] for r in results]

    def info(self) -> dict[str, Any]:
        """``n_vocab``, ``n_layer`` and llama.cpp's system info line, from a worker that loads the model."""
        (r,), out_dir = self.run_jobs([{"op": "info"}])
        _rmtree(out_dir)
        return r


def _order_trace(points: list[tuple[str, int, np.ndarray]]) -> list[tuple[str, int, np.ndarray]]:
    def key(item):
        p, layer, _ = item
        if layer < 0:
            head = {"inp_scaled": 0, "inp_per_layer": 1}
            return (0, 0, head.get(p, 2)) if p in head else (2, 0, 0 if p == "result_norm" else 1)
        return (1, layer, _POINT_ORDER.index(p) if p in _POINT_ORDER else len(_POINT_ORDER))
    return sorted(points, key=key)


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- parity checks

GATE_PAIR = "llamacpp~reference"


def _prompt_ids(prompts: Iterable[Any]) -> list[tuple[str, list[int]]]:
    out = []
    for k, p in enumerate(prompts):
        if isinstance(p, dict):
            out.append((str(p.get("id", k)), [int(t) for t in p["prompt_ids"]]))
        else:
            out.append((f"p{k}", [int(t) for t in p]))
    return out


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("nan")
    den = float(np.linalg.norm(b))
    num = float(np.linalg.norm(a - b))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def compare_traces(ours: list[tuple[str, int, np.ndarray]], ref: dict[tuple[str, int], np.ndarray],
                   limit: float = 1e-2) -> dict[str, Any]:
    """Relative L2 of each llama.cpp trace point against the reference's; the first point above ``limit``.

    Returns:
        ``{"per_point": [[point, layer, rel_l2], ...], "first_divergence": {point, layer, rel_l2} | None,
        "missing": [...points the reference has and llama.cpp did not report...]}``.
    """
    rows, first = [], None
    seen = set()
    for p, layer, arr in ours:
        if (p, layer) not in ref:
            continue
        seen.add((p, layer))
        e = _rel_l2(arr, ref[(p, layer)])
        rows.append([p, layer, e])
        if first is None and not e <= limit:
            first = {"point": p, "layer": layer, "rel_l2": e}
    missing = [f"{p}@{layer}" for (p, layer) in ref if (p, layer) not in seen]
    return {"per_point": rows, "first_divergence": first, "missing": missing}


def _gate_rows(measured: dict[str, float], overrides: Any, where: str) -> dict[str, dict[str, Any]]:
    from harness.gates import resolve

    gates = resolve(overrides, where)
    out = {}
    for metric, value in measured.items():
        g = gates[f"{GATE_PAIR}.{metric}"]
        out[g.name] = {"measured": value, "limit": g.limit, "op": g.op, "pass": g.check(value),
                       "informational": g.informational, "reason": g.reason}
    return out


def gelu_fp16_table(x: np.ndarray) -> np.ndarray:
    """GELU (tanh form) the way llama.cpp's CPU backend computes it: through an fp16 lookup table.

    ggml's CPU ``gelu`` / ``geglu`` (with ``GGML_GELU_FP16``, the default) return 0 for
    ``x <= -10`` and ``x`` for ``x >= 10``; otherwise they round ``x`` to fp16 and read a
    65536-entry table holding ``fp16(gelu(fp16 value))``. Here: the same rounding, with the
    float64 :func:`reference.model.gelu_tanh` in between.

    Args:
        x: float64 array, any shape.

    Returns:
        float64 array of the same shape (values exactly representable in fp16 inside ``(-10, 10)``).
    """
    x = np.asarray(x, dtype=np.float64)
    table = _exact_gelu(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, table))


@contextlib.contextmanager
def llamacpp_numerics() -> Iterator[None]:
    """While inside, the reference computes its GELUs with :func:`gelu_fp16_table`.

    llama.cpp's fp16 GELU table is a deliberate, documented approximation, and on the small
    synthetic cases it moves logits by up to ~3e-2 and can flip a near-tied top-1 (measured: e2b
    max |Δlogit| 0.0267 -> 0.0162, 26b-a4b top-1 99.5 % -> 100 %, KLD 10-60x lower on every case once
    emulated). Comparing against a reference with the same table removes that known difference,
    so what is left, and gated, is fp32 rounding plus any real formula or layout fault. The
    reference module looks ``gelu_tanh`` up at call time; this swaps that one name and restores it
    on exit (not thread-safe: the harness runs its checks one at a time).
    """
    import reference.model as rm

    original = rm.gelu_tanh
    rm.gelu_tanh = gelu_fp16_table
    try:
        yield
    finally:
        rm.gelu_tanh = original


def check_synthetic(built_case, prompts: Iterable[Any], *, threads: int | None = None,
                    n_ubatch: int | None = None, trace: bool = True) -> list[dict[str, Any]]:
    """llama.cpp on a built case's F32 GGUF vs the float64 reference, over every prompt position.

    The gated figures compare with the reference under :func:`llamacpp_numerics` (its GELUs through
    llama.cpp's fp16 table); the same figures against the exact reference are kept as
    ``exact_reference`` in the summary row and reported beside them.

    Args:
        built_case: a :class:`harness.synth.BuiltCase` (``ensure_built``).
        prompts: prompt records (``{"id", "prompt_ids"}``, e.g. :func:`harness.synth.load_prompts`) or id lists.
        threads: llama.cpp CPU threads.
        n_ubatch: llama.cpp physical batch (default: the whole prompt in one ubatch).
        trace: also compare the trace points on the longest prompt and name the first that diverges.

    Returns:
        One row per prompt: ``case``, ``prompt``, ``n_tokens``, ``max_abs_logit``, ``mean_kld``,
        ``same_top1`` (fraction), ``max_abs_logit_at`` ([position, token id]), ``max_abs_ref_logit``;
        then a summary row with ``prompt`` = ``"all"`` holding the same figures over all positions
        pooled, ``kld_per_position`` (one float per position, for the report's histogram),
        ``exact_reference`` (max_abs_logit, mean_kld, same_top1, same_top1_decisive, top1_flips against
        the exact reference),
        ``gates`` (name -> measured, limit, pass, reason; the case's ``[gates]`` overrides
        applied), ``pass``, ``trace`` (see :func:`compare_traces`) and ``seconds``.
        When llama.cpp crashes the list is one row: ``case``, ``prompt`` = ``"all"``, ``error``
        (``engine crashed: ...``), ``error_kind`` = ``"engine"``, ``pass`` = False.

    Raises:
        EngineUnavailable: llama-cpp-python is not installed.
    """
    from harness.engines import ReferenceEngine
    from harness.metrics import kld_per_position, kld_stats

    case = built_case.spec.name
    gguf_path = built_case.gguf["F32"]
    items = _prompt_ids(prompts)
    t0 = time.perf_counter()
    eng = LlamaCppEngine(gguf_path, n_ctx=max(len(ids) for _, ids in items) + 16, threads=threads,
                         n_ubatch=n_ubatch)
    ref = ReferenceEngine(gguf_path)
    longest = max(range(len(items)), key=lambda k: len(items[k][1]))
    try:
        runs = eng.logits_many([ids for _, ids in items])
        traced = eng.logits_many([items[longest][1]], trace=True)[0][1] if trace else None
    except EngineCrashed as e:
        return [{"case": case, "prompt": "all", "error": str(e), "error_kind": "engine", "pass": False,
                 "seconds": round(time.perf_counter() - t0, 3)}]
    rows: list[dict[str, Any]] = []
    all_ours, all_ref, all_exact = [], [], []
    for (pid, ids), (ours, _) in zip(items, runs):
        exact = ref.logits(ids)
        with llamacpp_numerics():
            base = ref.logits(ids)
        rows.append(_compare_row(case, pid, ours, base, kld_stats))
        all_ours.append(ours)
        all_ref.append(base)
        all_exact.append(exact)
    ours_all, ref_all = np.concatenate(all_ours), np.concatenate(all_ref)
    summary = _compare_row(case, "all", ours_all, ref_all, kld_stats)
    summary["kld_per_position"] = [float(v) for v in kld_per_position(ours_all, ref_all)]
    vs_exact = _compare_row(case, "all", ours_all, np.concatenate(all_exact), kld_stats)
    summary["exact_reference"] = {k: vs_exact[k] for k in ("max_abs_logit", "mean_kld", "same_top1",
                                                          "same_top1_decisive", "top1_flips")}
    measured = {"mean_kld": summary["mean_kld"], "same_top1": summary["same_top1"],
                "max_abs_logit": summary["max_abs_logit"]}
    summary["gates"] = _gate_rows(measured, built_case.spec.gates, str(built_case.spec.path))
    summary["pass"] = all(g["pass"] or g["informational"] for g in summary["gates"].values())
    if traced is not None:
        ref_trace: dict[tuple[str, int], np.ndarray] = {}
        with llamacpp_numerics():
            ref.logits(items[longest][1], trace=lambda p, layer, a: ref_trace.__setitem__((p, layer), np.array(a)))
        summary["trace"] = {"prompt": items[longest][0], **compare_traces(traced, ref_trace)}
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    rows.append(summary)
    return rows


#: A reference top-1 margin below this is a near-tie: two engines inside the max-|Δlogit| gate (2e-2) may
#: legitimately order the two best tokens differently there.
NEAR_TIE_MARGIN = 2 * 2e-2


def _compare_row(case: str, pid: str, ours: np.ndarray, base: np.ndarray, kld_stats) -> dict[str, Any]:
    """Figures of one comparison. ``near_ties``: positions whose reference top-1 margin is below
    :data:`NEAR_TIE_MARGIN`; ``top1_flips``: positions whose argmax differs, each as
    ``[position, ref_top1, ours_top1, ref_margin]``; ``same_top1_decisive``: same-top-1 over the
    positions that are not near-ties (informational; the gate uses ``same_top1``)."""
    d = np.abs(ours - base)
    at = np.unravel_index(int(np.argmax(d)), d.shape)
    st = kld_stats(ours, base)
    top2 = np.sort(base, axis=1)[:, -2:] if base.shape[1] > 1 else np.concatenate([base, base], axis=1)
    margin = top2[:, 1] - top2[:, 0]
    a_ours, a_ref = np.argmax(ours, axis=1), np.argmax(base, axis=1)
    flips = np.nonzero(a_ours != a_ref)[0]
    decisive = margin >= NEAR_TIE_MARGIN
    return {"case": case, "prompt": pid, "n_tokens": int(ours.shape[0]), "max_abs_logit": float(d.max()),
            "max_abs_logit_at": [int(at[0]), int(at[1])], "mean_kld": float(st.mean_kld),
            "maximum_kld": float(st.maximum_kld), "same_top1": float(st.same_top_p_pct) / 100.0,
            "max_abs_ref_logit": float(np.abs(base).max()),
            "near_ties": int((~decisive).sum()),
            "top1_flips": [[int(i), int(a_ref[i]), int(a_ours[i]), float(margin[i])] for i in flips],
            "same_top1_decisive": float(np.mean(a_ours[decisive] == a_ref[decisive])) if decisive.any() else 1.0}


def check_gemma3_real(path: str | os.PathLike | None = None, *, threads: int | None = None,
                      texts: Sequence[str] | None = None, f32_control: bool = False) -> dict[str, Any]:
    """llama.cpp vs the float64 reference on the real Gemma 3 270M GGUF (Q8_0/Q5_0/Q4_K/Q6_K tensors).

    Tokenizes each text with :func:`reference.tokenizer.tokenizer_from_gguf` (and, as a side check,
    with llama.cpp's own tokenizer), runs both engines over every position, and pools all
    positions into one ``llama-perplexity --kl-divergence`` statistic set (next-token ids given,
    so PPL and Δp figures are filled). Also greedy-generates each :data:`harness.gemma3_check.PROMPTS`
    prompt with llama.cpp and checks the expected continuation.

    On a quantized file llama.cpp's CPU matmuls quantize the *activations* too (to Q8_K / Q8_0 for the
    integer dot products), which the reference (exactly dequantized weights, float64 activations) does
    not; that, not a formula fault, is most of the difference. ``f32_control=True`` separates the two:
    it writes an F32 copy of the file (every tensor dequantized with ``gguf.quants``, the same values the
    reference uses; ~1.1 GB, cached beside the original) and repeats the comparison on it as
    ``f32_control``, where only fp32 rounding and the fp16 GELU table remain.

    Returns:
        ``model``, ``n_positions``, ``kld`` (:class:`harness.metrics.KLDStats` as a dict), ``max_abs_logit``,
        ``per_text`` (n_tokens, max_abs_logit, mean_kld, same_top1, tokenizer_match), ``continuations``
        (per prompt: expected, llama.cpp text, pass), ``seconds``; or ``error`` when llama.cpp crashes;
        with ``f32_control``, also ``f32_control`` (the same keys, on the F32 copy).

    Raises:
        EngineUnavailable: llama-cpp-python is not installed.
        InputError: the GGUF package is missing or the file is bad.
    """
    from harness.engines import ReferenceEngine
    from harness.gemma3_check import PROMPTS
    from harness.metrics import kld_stats
    from harness.realdata import gemma3_270m_gguf
    from reference.tokenizer import tokenizer_from_gguf

    t0 = time.perf_counter()
    gguf_path = Path(path) if path is not None else gemma3_270m_gguf()
    tok = tokenizer_from_gguf(gguf_path)
    if texts is None:
        texts = [text + expected for _, text, expected in PROMPTS] + list(GEMMA3_EXTRA_TEXTS)
    seqs = [tok.encode(t) for t in texts]
    eng = LlamaCppEngine(gguf_path, n_ctx=max(len(s) for s in seqs) + 32, threads=threads)
    res: dict[str, Any] = {"model": str(gguf_path), "texts": list(texts)}
    try:
        runs = eng.logits_many(seqs)
        prompt_ids = [tok.encode(text) for _, text, _ in PROMPTS]
        n_new = [len(tok.encode(exp, add_bos=False)) + 2 for _, _, exp in PROMPTS]
        gens = eng.generate_full(prompt_ids, max(n_new))
        llama_tok = eng.tokenize_many(texts)
    except EngineCrashed as e:
        res.update(error=str(e), error_kind="engine", seconds=round(time.perf_counter() - t0, 3))
        return res
    t_ref = time.perf_counter()
    ref = ReferenceEngine(gguf_path)
    per_text, ours_all, ref_all, next_all = [], [], [], []
    for text, ids, (ours, _), lt in zip(texts, seqs, runs, llama_tok):
        base = ref.logits(ids)
        st = kld_stats(ours, base)
        per_text.append({"text": text, "n_tokens": len(ids), "max_abs_logit": float(np.max(np.abs(ours - base))),
                         "mean_kld": float(st.mean_kld), "same_top1": float(st.same_top_p_pct) / 100.0,
                         "tokenizer_match": lt == list(ids)})
        # Rows 0..T-2 are scored against the next token (llama-perplexity's convention).
        ours_all.append(ours[:-1])
        ref_all.append(base[:-1])
        next_all.append(np.asarray(ids[1:], dtype=np.int64))
    ref_s = time.perf_counter() - t_ref
    ours_cat, ref_cat = np.concatenate(ours_all), np.concatenate(ref_all)
    stats = kld_stats(ours_cat, ref_cat, tokens=np.concatenate(next_all))
    conts = []
    for (name, text, expected), g in zip(PROMPTS, gens):
        k = len(tok.encode(expected, add_bos=False)) + 2
        cont = tok.decode(g.tokens[:k])
        conts.append({"name": name, "expected": expected, "llamacpp": cont, "pass": cont.startswith(expected)})
    res.update({
        "n_positions": int(ours_cat.shape[0]),
        "kld": stats.as_dict(),
        "max_abs_logit": float(np.max(np.abs(ours_cat - ref_cat))),
        "per_text": per_text,
        "continuations": conts,
        "reference_s": round(ref_s, 3),
        "seconds": round(time.perf_counter() - t0, 3),
    })
    if f32_control:
        del ref
        f32 = gguf_path.with_name(gguf_path.stem + ".F32-control.gguf")
        f32_copy(gguf_path, f32)
        res["f32_control"] = check_gemma3_real(f32, threads=threads, texts=texts)
    return res


def f32_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write ``dst``: ``src`` with every tensor dequantized to F32 (``gguf.quants.dequantize``), same metadata.

    Reused when ``dst`` exists and is newer than ``src``; written under a temporary name and moved into
    place, so an interrupted write never leaves a partial file under ``dst``.
    """
    import gguf
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    src, dst = Path(src), Path(dst)
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    r = GGUFReader(src)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), str(r.fields["general.architecture"].contents()))
    try:
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            vt = GGUFValueType(f.types[0])
            w.add_key_value(name, f.contents(), vt, sub_type=GGUFValueType(f.types[-1])
                            if vt == GGUFValueType.ARRAY else None)
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w.add_tensor(t.name, a.reshape(tuple(int(x) for x in reversed(t.shape))))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


#: Extra real-text passages for the Gemma 3 KLD statistics (more positions than the three short prompts).
GEMMA3_EXTRA_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. Meanwhile, in the kitchen, the kettle began to whistle, "
    "and the cat, startled, knocked a cup of tea off the table.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature, which is why cooking pasta in the mountains takes longer.",
)
