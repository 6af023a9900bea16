"""The ``llamacpp`` engine: llama.cpp through llama-cpp-python, always in a worker subprocess.

llama.cpp is an oracle next to HF transformers (``docs/design.md``, "Engines"). It aborts the whole
process on some layouts (its KV-donor rule differs from transformers' on unusual layer layouts and
ends in a ``GGML_ASSERT``), so every llama.cpp call happens in ``python -m
gemma4_harness.harness.engines.llamacpp.worker`` (:mod:`.worker`): one process per call, fed one JSON request on
stdin, answering with ``result.json`` and ``.npy`` files in a temporary folder. A non-zero exit or a
signal becomes :class:`~harness.core.workers.EngineCrashed` whose one line is the worker's last
meaningful stderr line (for an abort, the ``GGML_ASSERT`` text), and the harness goes on with the
next case.

Context settings (the llama.cpp gate row of ``docs/design.md``): KV cache F32, flash attention off,
``swa_full`` false (the sliding layers keep the real, ring-sized cache), an output row for every
position. Two known, expected differences from the float64 reference:

* llama.cpp's CPU GELU reads an fp16 lookup table: ~1e-3 in activations, up to ~3e-2 in logits on
  the small synthetic models. The parity check therefore gates against the reference with the same
  table emulated (:func:`.numerics.llamacpp_numerics`) and reports the figures against the exact
  reference beside them;
* a gemma4 GGUF without a ``final_logit_softcapping`` key gets llama.cpp's default softcap of 30
  (``llama-hparams.h``), where the file (and the harness) says there is none: that shows as an
  engine disagreement on ``edge-no-softcap``.

Batches: :meth:`LlamaCppEngine.generate` with ``batched=True`` serves all prompts from one context,
one ``seq_id`` per prompt (prefill in one ``llama_decode``, then one decode per step with a token per
sequence). For ``g4h bench`` the worker times ``pp``/``tg`` itself (:meth:`LlamaCppEngine.bench_time`).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from gguf import LlamaFileType

from gemma4_harness.reference.errors import InputError, PromptError
from gemma4_harness.reference.gguf_check import check_gguf

from ...core.workers import EngineCrashed, crash_error, crash_line, remove_temp_dir, run_worker, temp_dir
from ..base import TOP_N, EngineUnavailable, Generated, TraceFn, bench_ids

INSTALL_MSG = ("llama.cpp engine not installed: pip install 'gemma4-harness[llamacpp]' "
               "(builds llama-cpp-python from source, ~5 min)")
#: The llama-cpp-python release whose bundled llama.cpp this module was written against.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

#: Trace points in the order an engine reports them (the reference's order).
_POINT_ORDER = ("attn_out", "ffn_mlp", "ffn_moe", "ffn_out", "per_layer_embd_out", "l_out")


def _import_llama_cpp():
    try:
        return importlib.import_module("llama_cpp")
    except Exception:  # ImportError, or OSError from a broken shared library
        raise EngineUnavailable(INSTALL_MSG) from None


BENCH_CHUNK = 512
"""Tokens per ``llama_decode`` when a bench job fills its context (``depth``) before the clock starts."""

DEADLINE_BASE_S = 600.0
"""Seconds every worker may take whatever its work (start, imports, a model's first load from a cold disk)."""
DEADLINE_READ_BYTES_S = 1e9
"""Bytes per second at which a worker's deadline assumes it reads the model's weights: one read of the whole file per
``llama_decode`` (a prefill ubatch or a decode step), the cost of a step on a big model. 1 GB/s is a twentieth of the
slowest memory bandwidth measured on the 2-core machine the harness is tested on (20..84 GB/s): a floor for weights
read from memory (the page cache), not an estimate. Weights read from disk on every step (a file that does not fit
in memory beside the job) come at the disk's speed, which may be slower: then the compute term, or
``--engine-timeout``, has to cover it."""
DEADLINE_FLOPS = 5e9
"""Floating-point operations per second at which a worker's deadline assumes it computes: 2 per parameter per token
processed. A floor: llama.cpp's CPU products run at tens of GFLOP/s per core."""


def work_deadline(jobs: Sequence[dict[str, Any]], file_bytes: int, n_params: int, n_ubatch: int | None = None
                  ) -> float:
    """Seconds one worker may run ``jobs`` on a model of ``file_bytes`` bytes and ``n_params`` parameters before it
    is taken for hung: :data:`DEADLINE_BASE_S`, plus one read of the file per ``llama_decode`` at
    :data:`DEADLINE_READ_BYTES_S` (its load, each prefill ubatch: one per prompt, or one per ``n_ubatch`` tokens of
    it when given; each decode step: every prompt's own when unbatched), plus 2 x ``n_params`` operations per token at
    :data:`DEADLINE_FLOPS`. It follows the work: the fixed 600 s it replaces was passed by a correct llama.cpp
    generating 8 tokens for 16 prompts on the 31B shape (17.3 GB, Q4_0), an ``ENGINE FAILED`` verdict with every
    measured figure within its gate. ``bench`` jobs are not counted (:class:`LlamaCppBench` sets its own).

    Raises:
        KeyError: a job without ``op``, or a ``logits`` job without ``ids`` / ``generate`` without ``prompts``.
    """
    def prefills(n: int) -> int:
        return -(-n // n_ubatch) if n_ubatch else 1

    reads, tokens = 1, 0
    for j in jobs:
        if j["op"] == "logits":
            reads, tokens = reads + prefills(len(j["ids"])), tokens + len(j["ids"])
        elif j["op"] == "generate":
            lens, new = [len(p) for p in j["prompts"]], int(j.get("max_new_tokens", 0))
            steps = new if j.get("batched") else new * len(lens)
            fill = prefills(sum(lens)) if j.get("batched") else sum(prefills(n) for n in lens)
            reads, tokens = reads + fill + steps, tokens + sum(lens) + new * len(lens)
    return DEADLINE_BASE_S + reads * file_bytes / DEADLINE_READ_BYTES_S + tokens * 2.0 * n_params / DEADLINE_FLOPS


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python 0.3.36) on CPU, F32 KV cache, flash attention off, in a subprocess.

    Args:
        path: a ``.gguf`` file.
        n_ctx: context length per sequence (a longer prompt is a :class:`PromptError`).
        threads: CPU threads for llama.cpp (default: :func:`.worker.default_threads`, `$OMP_NUM_THREADS` or every CPU).
        n_ubatch: physical batch size; default one ubatch for the whole prompt. A smaller value splits
            the prompt into several ``llama_decode`` ubatches (chunked prefill through the ring buffer).
        swa_full: give sliding-window layers a full-size cache (default False: the real ring buffer).
        batched: default for :meth:`generate`: all prompts in one context, one ``seq_id`` each.
        extra_bufts: let llama.cpp use its extra CPU weight buffers (AMX tiles, repacked quant layouts).
            Off by default: the plain CPU kernels are the oracle, and AMX code dies of SIGILL in VMs
            that do not grant the AMX tile state (seen here: a Firecracker guest whose CPU lists amx_int8).
        timeout: seconds one worker process may run (``--engine-timeout``); None: what its work allows
            (:func:`work_deadline`).
        fit_context: give each worker's context only the positions its work needs (rounded up to 256), not
            ``n_ctx`` (False: always ``n_ctx``; the same results, more memory).
        lib_dir: another build of llama.cpp's libraries for the worker to load (``LLAMA_CPP_LIB_PATH``: the native
            variant of :func:`.native.ensure_native_built`); None: the ones the installed package holds.

    Raises:
        EngineUnavailable: llama-cpp-python is not installed (:data:`INSTALL_MSG`), or ``path`` is not a file.
    """

    name = "llamacpp"

    def __init__(self, path: str | os.PathLike, n_ctx: int = 1024, threads: int | None = None,
                 n_ubatch: int | None = None, swa_full: bool = False, batched: bool = False,
                 extra_bufts: bool = False, timeout: float | None = None, fit_context: bool = True,
                 lib_dir: str | os.PathLike | None = None):
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
        self.timeout = None if timeout is None else float(timeout)
        self.fit_context = bool(fit_context)
        self._n_params: int | None = None
        self.lib_dir = None if lib_dir is None else str(lib_dir)
        self.last_run_s = 0.0

    # ------------------------------------------------------------------ worker

    def run_jobs(self, jobs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Path]:
        """Run ``jobs`` in one worker process. Returns (job results, folder of their files).

        The folder is a fresh temporary directory (:func:`harness.core.workers.temp_dir`: removed even when
        this process is killed); the caller reads the ``.npy`` files it names (see
        :mod:`harness.engines.llamacpp.worker`) and removes it (``_rmtree``).

        Raises:
            EngineCrashed: the worker exited non-zero, died of a signal, timed out, or could not load
                the model or run a batch.
            PromptError: the worker refused a prompt (token id out of range, empty).
        """
        need, seq = 1, 1  # tokens of the largest llama_decode; positions of the longest sequence
        for j in jobs:
            if j["op"] == "logits":
                need, seq = max(need, len(j["ids"])), max(seq, len(j["ids"]))
            elif j["op"] == "generate":
                lens = [len(p) for p in j["prompts"]]
                need = max(need, sum(lens) if j.get("batched") else max(lens, default=1), len(lens))
                seq = max(seq, max(lens, default=1) + int(j.get("max_new_tokens", 0)))
            elif j["op"] == "bench":
                need = max(need, j["batch"] * (j["n"] if j["test"] == "pp" else 1),
                           j["batch"] * min(j["depth"], BENCH_CHUNK))
        out_dir = temp_dir("g4h-llamacpp-")
        bench = any(j["op"] == "bench" for j in jobs)
        # The context the work needs, in llama.cpp's own steps of 256 cells (its KV cache pads to them), never more
        # than n_ctx: the F32 KV cache of 1,024 positions is 2 GB on the 31B shape, beside a file that must stay in
        # memory. The same bits: attention reads the cells in use, padded to 256, whatever the cache's size.
        n_ctx = self.n_ctx if bench or not self.fit_context else min(self.n_ctx, -(-seq // 256) * 256)
        req = {"model": str(self.path), "n_ctx": n_ctx, "threads": self.threads,
               "n_batch": need, "n_ubatch": min(self.n_ubatch, need) if self.n_ubatch else need,
               "swa_full": self.swa_full, "extra_bufts": self.extra_bufts, "out_dir": str(out_dir), "jobs": jobs,
               "lib_dir": self.lib_dir,
               # The eval callback (trace points) costs a Python call per graph node: off for timing-only runs.
               "eval_cb": not all(j["op"] == "bench" for j in jobs)}
        timeout = self.deadline(jobs)
        t0 = time.perf_counter()
        try:
            proc = run_worker("gemma4_harness.harness.engines.llamacpp.worker", input=json.dumps(req), timeout=timeout)
        except subprocess.TimeoutExpired:
            _rmtree(out_dir)
            why = ("--engine-timeout" if self.timeout is not None
                   else "the deadline its work allows; --engine-timeout sets another")
            raise EngineCrashed(f"engine crashed: llama.cpp worker ran past {timeout:.4g} s ({why}) "
                                f"on {self.path.name}") from None
        finally:
            self.last_run_s = time.perf_counter() - t0
        if proc.returncode != 0 or not (out_dir / "result.json").is_file():
            _rmtree(out_dir)
            if "G4H-WORKER-ERROR[prompt]" in proc.stderr:
                raise PromptError(f"{self.path.name}: llama.cpp: {crash_line(proc.stderr, proc.returncode)}")
            raise crash_error(proc.stderr, proc.returncode, self.path.name)
        res = json.loads((out_dir / "result.json").read_text())
        return res["jobs"], out_dir

    def deadline(self, jobs: Sequence[dict[str, Any]]) -> float:
        """Seconds a worker running ``jobs`` may take: ``timeout`` when given, else :func:`work_deadline` on this
        file (its size, and its parameter count from the GGUF header: :func:`header_facts`, read once a file).

        Raises:
            OSError: the file cannot be stat'ed (gone since the engine was made).
        """
        if self.timeout is not None:
            return self.timeout
        if self._n_params is None:
            try:
                self._n_params = header_facts(self.path)[2]
            except InputError:  # a file llama.cpp will refuse itself (its crash is the engine's failure, said)
                self._n_params = self.path.stat().st_size * 8  # at most 8 parameters a byte (1-bit types)
        return work_deadline(jobs, self.path.stat().st_size, self._n_params, self.n_ubatch)

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
                logits = np.load(out_dir / r["logits"], allow_pickle=False).astype(np.float64)
                points = [(p, int(layer), np.load(out_dir / f, allow_pickle=False)) for p, layer, f in r.get("trace", [])]
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
                      batched: bool | None = None, top_n: int = TOP_N) -> list[Generated]:
        """Greedy continuations with the top-``top_n`` ``(id, logprob)`` of every step
        (:class:`harness.engines.base.Generated`).

        ``batched`` (default: the engine's setting): one context, one ``seq_id`` per prompt, one
        ``llama_decode`` per step for all sequences; else each prompt alone in a cleared context.
        """
        batched = self.batched if batched is None else bool(batched)
        for p in prompts:
            self._check_len(len(p) + max(int(max_new_tokens) - 1, 0))
        if not prompts or max_new_tokens <= 0:
            return [Generated(top_n) for _ in prompts]
        job = {"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
               "max_new_tokens": int(max_new_tokens), "batched": batched, "top_n": int(top_n)}
        (r,), out_dir = self.run_jobs([job])
        _rmtree(out_dir)
        out = []
        for item in r["results"]:
            g = Generated(top_n)
            g.tokens = [int(t) for t in item["tokens"]]
            g.top = [[(int(i), float(lp)) for i, lp in step] for step in item["top"]]
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
    remove_temp_dir(p)


# --------------------------------------------------------------------------- bench


def gguf_facts(path: str | os.PathLike) -> tuple[str, dict[str, float]]:
    """A GGUF's weight type's short name, ``general.file_type`` (``Q4_K_M``, ``F32``...) or else the most common
    matrix type by elements, and tensor name -> stored bytes per element (block size included: Q8_0 is 34/32).
    The dict is this call's own.

    Raises:
        ModelFileError: the file fails :func:`reference.gguf_check.check_gguf`.
    """
    ftype, per_elem, _ = header_facts(path)
    return ftype, dict(per_elem)


def header_facts(path: str | os.PathLike) -> tuple[str, dict[str, float], int]:
    """:func:`gguf_facts` and the parameter count (the elements of every tensor) of a GGUF, from its header, parsed
    once per file as it is now (path, size, modification time): a parity job makes several engines of one file
    (the pair's, the drafter's, the tokenizer's), and a 262,144-token vocabulary's header takes a noticeable
    fraction of a second to parse. The dict is shared: do not change it.

    Raises:
        ModelFileError: the file fails :func:`reference.gguf_check.check_gguf` (not cached: asked again, read again).
        OSError: the file cannot be stat'ed.
    """
    p = Path(path).resolve()
    st = p.stat()
    return _header_facts(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _header_facts(path: str, size: int, mtime_ns: int) -> tuple[str, dict[str, float], int]:
    gf = check_gguf(path)
    per_elem = {t.name: t.n_bytes / float(np.prod(t.dims)) for t in gf.tensors.values()}
    n_params = sum(int(np.prod(t.dims)) for t in gf.tensors.values())
    ftype = gf.metadata.get("general.file_type")
    if isinstance(ftype, int):
        try:
            return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_"), per_elem, n_params
        except ValueError:
            pass
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        if t.name.endswith(".weight") and "norm" not in t.name:
            counts[t.type_name] = counts.get(t.type_name, 0) + int(np.prod(t.dims))
    return (max(counts, key=counts.get) if counts else "F32"), per_elem, n_params


class LlamaCppBench:
    """:class:`LlamaCppEngine` as a :class:`harness.engines.base.Benchable`: the worker times the ``pp``/``tg``
    runs itself (one ``llama_decode`` per step, ``seq_id`` per sequence, F32 KV cache, flash attention off),
    so process start and model load are never inside a figure.

    Args:
        path: the GGUF file.
        cfg: our config of the model (its vocabulary size picks the token ids every engine gets).
        threads: llama.cpp threads (default: torch's thread count, so every engine gets the same).
        lib_dir: the libraries of another build (the native variant); None: the installed package's (portable).
        engine: the name in the bench table (``llamacpp``, ``llamacpp-native``).

    Raises:
        EngineUnavailable: llama-cpp-python is not installed, or ``path`` is not a file.
    """

    engine = "llamacpp"
    max_batch = None
    kv_elem = 4.0

    def __init__(self, path: str | os.PathLike, cfg, threads: int | None = None,
                 lib_dir: str | os.PathLike | None = None, engine: str = "llamacpp"):
        self.path = Path(path)
        self.cfg = cfg
        self.threads = threads
        self.lib_dir = lib_dir
        self.engine = engine
        LlamaCppEngine(self.path)  # checks that llama-cpp-python imports and the file exists
        self.dtype, self._per_elem = gguf_facts(self.path)

    def elem_bytes(self, name: str) -> float:
        """Stored bytes per element of ``name`` (llama.cpp reads weights as stored)."""
        return self._per_elem.get(name, 4.0)

    def bench_time(self, test: str, n: int, depth: int, batch: int) -> float:
        """Seconds of one repetition, timed inside a fresh worker after one untimed repetition.

        Raises:
            EngineCrashed: the worker died.
        """
        job = {"test": test, "n": n, "depth": depth, "batch": batch, "reps": 1, "warmup": 1}
        return self.run([job], n_ctx=depth + n + 8)[0][0]

    def run(self, jobs: list[dict[str, Any]], n_ctx: int) -> list[list[float]]:
        """Run bench jobs ``{"test", "n", "depth", "batch", "reps", "warmup"}`` in one worker; seconds per rep.

        Raises:
            EngineCrashed: the worker died (the caller records it as the rows' error).
        """
        eng = LlamaCppEngine(self.path, n_ctx=n_ctx, threads=self.threads, timeout=6 * 3600.0, lib_dir=self.lib_dir)
        v = self.cfg.vocab_size
        full = []
        for j in jobs:  # the same token ids as the in-process engines get
            full.append(dict(op="bench", ctx_ids=bench_ids(v, j["depth"], 1) if j["depth"] else [],
                             pp_ids=[bench_ids(v, j["n"], 100 + i) for i in range(j["batch"])] if j["test"] == "pp" else [],
                             first=bench_ids(v, j["batch"], 7), **j))
        results, out_dir = eng.run_jobs(full)
        _rmtree(out_dir)
        return [r["seconds"] for r in results]

    def build_info(self) -> dict[str, str]:
        """Which llama.cpp build this is: its libraries' folder and llama.cpp's system info line (the CPU features
        it was compiled for: ``AVX512 = 1`` in the native variant), from a worker that loads the model.

        Raises:
            EngineCrashed: the worker died.
        """
        info = LlamaCppEngine(self.path, lib_dir=self.lib_dir).info()
        return {"libraries": str(self.lib_dir) if self.lib_dir else "the installed llama_cpp package",
                "system_info": info["system_info"]}

    def close(self) -> None:
        """Nothing held between runs (each runs in its own worker)."""
