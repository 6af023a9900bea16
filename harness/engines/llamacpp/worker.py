"""The llama.cpp worker: runs in its own process, does every llama.cpp call.

llama.cpp aborts the whole process on some model layouts (a ``GGML_ASSERT``
that calls ``abort()``), so :mod:`harness.engines.llamacpp` never loads it in the
harness process. It starts ``python -m gemma4_harness.harness.engines.llamacpp.worker``, writes one
request as JSON on its stdin and reads ``<out_dir>/result.json`` (plus the
``.npy`` files it names) once the worker has exited with status 0. Any other
exit status or a signal is a crash; the parent names it from the worker's
stderr.

Request (JSON object)::

    {"model": "/path/x.gguf", "n_ctx": 1024, "threads": 2, "n_ubatch": null,
     "swa_full": false, "n_seq_max": 1, "out_dir": "/tmp/...",
     "jobs": [{"op": "logits", "ids": [2, 17, ...], "trace": false},
              {"op": "generate", "prompts": [[2, 5], [2, 9, 9]], "max_new_tokens": 8, "batched": false},
              {"op": "tokenize", "text": "Hello", "add_special": true, "parse_special": true},
              {"op": "info"}]}

Result (``result.json``)::

    {"version": 1, "jobs": [
        {"op": "logits", "logits": "<file.npy>", "shape": [T, V],
         "trace": [["l_out", 3, "<file.npy>"], ...]},
        {"op": "generate", "results": [{"tokens": [...], "top": [[[id, logprob], ...top_n], ...]}, ...]},
        {"op": "tokenize", "ids": [...]},
        {"op": "info", "n_vocab": V, "n_layer": L, "n_ctx": ..., "system_info": "..."}]}

Context settings (``docs/design.md``, "Engines"): KV cache F32 (``type_k``
and ``type_v`` = ``GGML_TYPE_F32``), flash attention off, ``swa_full`` false
(the sliding-window layers keep the real ring-sized cache), an output row for
every position of a ``logits`` job.

Trace points come from the scheduler's eval callback (``cb_eval``): tensors
named ``<point>-<layer>`` (or ``<point>`` for whole-model points) are copied
out after they are computed. ggml's layout has ``ne[0]`` fastest, so a tensor of
``ne = [n, T]`` is the NumPy ``[T, n]`` array we use. Names are mapped onto the
harness vocabulary (see :data:`POINT_MAP`); a ubatch split concatenates along
the token axis.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULT_VERSION = 1

#: llama.cpp graph-callback name -> our trace point name. ``ffn_moe_combined`` is the sum of the dense MLP
#: and MoE branches before ``post_ffw_norm``: what the reference calls ``ffn_out`` on a MoE layer.
POINT_MAP = {
    "inp_scaled": "inp_scaled",
    "inp_per_layer": "inp_per_layer",
    "attn_out": "attn_out",
    "sa_out": "attn_out",  # the same residual sum in llama.cpp's gemma3 graph (the real Gemma 3 file)
    "ffn_out": "ffn_out",
    "ffn_moe_combined": "ffn_out",
    "ffn_mlp": "ffn_mlp",
    "ffn_moe": "ffn_moe",
    "per_layer_embd_out": "per_layer_embd_out",
    "l_out": "l_out",
    "result_norm": "result_norm",
    "result_output": "result_output",
}

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64


def default_threads() -> int:
    """CPU threads when a request names none: ``$OMP_NUM_THREADS`` when it is a positive integer (the share of
    the CPUs a parity worker or a pytest-xdist worker was given: the thread pools of torch and OpenBLAS take the
    same), else the CPUs this process may use. More threads than CPUs would make llama.cpp's spinning threads
    wait on each other."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class GGMLTensor(ctypes.Structure):
    """``struct ggml_tensor`` (ggml.h of the llama.cpp that llama-cpp-python 0.3.36 bundles)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_GGML_DTYPES = {0: np.float32, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16


def split_name(name: str) -> tuple[str, int] | None:
    """``"l_out-3"`` -> ``("l_out", 3)``; ``"result_norm"`` -> ``("result_norm", -1)``; unknown -> None."""
    if name in POINT_MAP:
        return POINT_MAP[name], -1
    base, sep, idx = name.rpartition("-")
    if sep and base in POINT_MAP and idx.isdigit():
        return POINT_MAP[base], int(idx)
    return None


def tensor_to_numpy(t: GGMLTensor, rank: int = 2) -> np.ndarray | None:
    """A copy of a host tensor's data as float32 NumPy, axes reversed (ggml ``ne[0]`` fastest -> last axis).

    The result has ``rank`` axes: ``ne = [n, T, 1, 1]`` with rank 2 gives ``[T, n]``; ``inp_per_layer``
    (``ne = [P, L, T]``) takes rank 3 and gives ``[T, L, P]``. Returns None for types other than F32/F16,
    a tensor without host data, or one with more non-trivial dimensions than ``rank``.
    """
    dt = _GGML_DTYPES.get(int(t.type))
    if dt is None or not t.data:
        return None
    ne = [int(x) for x in t.ne]
    nb = [int(x) for x in t.nb]
    if any(n != 1 for n in ne[rank:]):
        return None
    ne, nb = ne[:rank], nb[:rank]
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(dt).itemsize
    raw = ctypes.string_at(t.data, span)
    arr = np.ndarray(shape=tuple(reversed(ne)), dtype=dt, buffer=raw, strides=tuple(reversed(nb)))
    return np.array(arr, dtype=np.float32, copy=True)


class _Log:
    """llama.cpp log sink: WARN and ERROR lines go to stderr (the parent reads the last one on failure)."""

    def __init__(self, llama_cpp) -> None:
        self.last_level = 0
        self.last_error = ""
        self.errors: list[str] = []  # every ERROR message, in order
        self._buf = ""

        def cb(level, text, user_data):
            level = int(level)
            if level == 5:  # GGML_LOG_LEVEL_CONT: continues the previous message
                level = self.last_level
            self.last_level = level
            msg = (text or b"").decode("utf-8", "replace")
            if level >= 3:
                sys.stderr.write(msg)
                sys.stderr.flush()
                if level >= 4 and msg.strip():
                    self.last_error = msg.strip()
                    self.errors.append(self.last_error)

        self.cfunc = llama_cpp.llama_log_callback(cb)
        llama_cpp.llama_log_set(self.cfunc, ctypes.c_void_p())


class Runner:
    """One model and one context, built from a request; runs its jobs."""

    def __init__(self, req: dict[str, Any]) -> None:
        import llama_cpp  # optional heavy dependency, loaded only in this worker process

        self.L = llama_cpp
        self.log = _Log(llama_cpp)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = bool(req.get("extra_bufts", False))
        self.model = llama_cpp.llama_model_load_from_file(str(req["model"]).encode(), mp)
        if not self.model:
            why = self.log.last_error or "llama_model_load_from_file returned NULL"
            raise LoadError(f"llama.cpp could not load {req['model']}: {why}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.req = req
        self.tracing = False
        self.trace_parts: dict[tuple[str, int], list[np.ndarray]] = {}
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval_cb)
        self.ctx = None
        self.ctx_seqs = 0

    # ------------------------------------------------------------------ context

    def context(self, n_seq: int) -> Any:
        """A context for ``n_seq`` parallel sequences (rebuilt when that number changes)."""
        L, req = self.L, self.req
        if self.ctx is not None and self.ctx_seqs == n_seq:
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
            return self.ctx
        if self.ctx is not None:
            L.llama_free(self.ctx)
        cp = L.llama_context_default_params()
        n_ctx = int(req.get("n_ctx", 1024))
        cp.n_ctx = n_ctx * n_seq
        cp.n_batch = int(req.get("n_batch") or n_ctx)
        cp.n_ubatch = int(req.get("n_ubatch") or cp.n_batch)
        cp.n_seq_max = n_seq
        threads = int(req.get("threads") or default_threads())
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.type_k = L.GGML_TYPE_F32
        cp.type_v = L.GGML_TYPE_F32
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.swa_full = bool(req.get("swa_full", False))
        cp.offload_kqv = False
        cp.op_offload = False
        cp.no_perf = True
        if req.get("eval_cb", True):
            cp.cb_eval = self._cb
        cp.cb_eval_user_data = None
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise LoadError(f"llama.cpp could not create a context: {self.log.last_error or 'NULL context'}")
        self.ctx, self.ctx_seqs = ctx, n_seq
        return ctx

    def _eval_cb(self, t_ptr, ask, user_data) -> bool:
        if not self.tracing:
            return False
        t = GGMLTensor.from_address(t_ptr)
        key = split_name(t.name.decode("utf-8", "replace"))
        if key is None:
            return False
        if ask:
            return True
        arr = tensor_to_numpy(t, 3 if key[0] == "inp_per_layer" else 2)
        if arr is not None:
            self.trace_parts.setdefault(key, []).append(arr)
        return True

    # ------------------------------------------------------------------ decode

    def _decode(self, ctx, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, pos, seq, want_logits)`` entries."""
        L = self.L
        n = len(tokens)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, (tok, pos, seq, out) in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if out else 0
            batch.n_tokens = n
            rc = L.llama_decode(ctx, batch)
        finally:
            L.llama_batch_free(batch)
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc}: {self.log.last_error or 'no message'}")

    def _row(self, ctx, i: int) -> np.ndarray:
        p = self.L.llama_get_logits_ith(ctx, i)
        if not p:
            raise DecodeError(f"llama_get_logits_ith({i}) returned NULL")
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).astype(np.float32, copy=True)

    def job_bench(self, job: dict[str, Any]) -> dict[str, Any]:
        """Time ``pp`` or ``tg`` the way :mod:`harness.bench` times the other engines.

        Job: ``{"test": "pp"|"tg", "n", "depth", "batch", "reps", "warmup", "ctx_ids": [depth ids],
        "pp_ids": [[n ids] per sequence], "first": [one id per sequence], "chunk": 512}``. Each
        repetition clears the cache, fills ``depth`` tokens per sequence untimed (``chunk`` tokens per
        decode), then times one decode of all ``batch * n`` prompt tokens (pp), or ``n`` decode steps
        of ``batch`` tokens with a greedy argmax over each sequence's logits (tg).

        Returns:
            ``{"op": "bench", "seconds": [one per timed repetition]}``.
        """
        L = self.L
        test, n, depth, b = job["test"], int(job["n"]), int(job["depth"]), int(job["batch"])
        chunk = int(job.get("chunk", 512))
        ctx_ids = [int(t) for t in job.get("ctx_ids", [])]
        self._check_ids(ctx_ids + [int(t) for s in job.get("pp_ids", []) for t in s] + [int(t) for t in job["first"]])
        seconds = []
        for r in range(int(job["warmup"]) + int(job["reps"])):
            ctx = self.context(b)  # clears the cache
            for s0 in range(0, depth, chunk):
                part = ctx_ids[s0:s0 + chunk]
                self._decode(ctx, [(t, s0 + i, s, False) for s in range(b) for i, t in enumerate(part)])
            if test == "pp":
                toks = [(int(t), depth + i, s, i == n - 1) for s in range(b) for i, t in enumerate(job["pp_ids"][s])]
                t0 = time.perf_counter()
                self._decode(ctx, toks)
                dt = time.perf_counter() - t0
            else:
                cur = [int(t) for t in job["first"]]
                t0 = time.perf_counter()
                for k in range(n):
                    self._decode(ctx, [(cur[s], depth + k, s, True) for s in range(b)])
                    cur = [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, s), shape=(self.n_vocab,)).argmax())
                           for s in range(b)]
                dt = time.perf_counter() - t0
            if r >= int(job["warmup"]):
                seconds.append(dt)
        return {"op": "bench", "seconds": seconds}

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.n_vocab]
        if bad:
            raise PromptIssue(f"token id {bad[0]} is outside the vocabulary [0, {self.n_vocab})")

    # ------------------------------------------------------------------ jobs

    def job_logits(self, job: dict[str, Any], out_dir: Path, k: int) -> dict[str, Any]:
        ids = [int(t) for t in job["ids"]]
        self._check_ids(ids)
        ctx = self.context(1)
        self.trace_parts = {}
        self.tracing = bool(job.get("trace"))
        try:
            self._decode(ctx, [(t, p, 0, True) for p, t in enumerate(ids)])
        finally:
            self.tracing = False
        logits = np.stack([self._row(ctx, i) for i in range(len(ids))])
        f = out_dir / f"job{k}-logits.npy"
        np.save(f, logits)
        res: dict[str, Any] = {"op": "logits", "logits": f.name, "shape": list(logits.shape), "trace": []}
        for j, ((point, layer), parts) in enumerate(self.trace_parts.items()):
            arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)  # ubatches along T
            tf = out_dir / f"job{k}-trace{j}.npy"
            np.save(tf, arr)
            res["trace"].append([point, layer, tf.name])
        self.trace_parts = {}
        return res

    def job_generate(self, job: dict[str, Any]) -> dict[str, Any]:
        prompts = [[int(t) for t in p] for p in job["prompts"]]
        n_new = int(job["max_new_tokens"])
        for p in prompts:
            self._check_ids(p)
            if not p:
                raise PromptIssue("prompt is empty")
        top_n = int(job.get("top_n", 5))
        if job.get("batched") and len(prompts) > 1:
            results = self._generate_batched(prompts, n_new, top_n)
        else:
            results = [self._generate_batched([p], n_new, top_n)[0] for p in prompts]
        return {"op": "generate", "results": results}

    def _generate_batched(self, prompts: list[list[int]], n_new: int, top_n: int = 5) -> list[dict[str, Any]]:
        """Greedy: all prompts prefilled in one batch (seq_id = prompt index), then one batch per step."""
        ctx = self.context(len(prompts))
        entries = []
        last_index = []
        for s, p in enumerate(prompts):
            for pos, t in enumerate(p):
                entries.append((t, pos, s, pos == len(p) - 1))
            last_index.append(len(entries) - 1)
        self._decode(ctx, entries)
        out = [{"tokens": [], "top": []} for _ in prompts]
        rows = [self._row(ctx, i) for i in last_index]
        for step in range(n_new):
            nxt = []
            for s, z in enumerate(rows):
                tok, top = _greedy(z, top_n)
                out[s]["tokens"].append(tok)
                out[s]["top"].append(top)
                nxt.append((tok, len(prompts[s]) + step, s, True))
            if step == n_new - 1:
                break
            self._decode(ctx, nxt)
            rows = [self._row(ctx, i) for i in range(len(nxt))]
        return out

    def job_tokenize(self, job: dict[str, Any]) -> dict[str, Any]:
        L = self.L
        text = str(job["text"]).encode("utf-8")
        cap = len(text) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, text, len(text), buf, cap, bool(job.get("add_special", True)),
                             bool(job.get("parse_special", True)))
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, text, len(text), buf, cap, bool(job.get("add_special", True)),
                                 bool(job.get("parse_special", True)))
        return {"op": "tokenize", "ids": [int(buf[i]) for i in range(n)]}

    def job_info(self) -> dict[str, Any]:
        L = self.L
        return {"op": "info", "n_vocab": self.n_vocab, "n_layer": int(L.llama_model_n_layer(self.model)),
                "system_info": (L.llama_print_system_info() or b"").decode("utf-8", "replace").strip(),
                "llama_cpp_python": getattr(L, "__version__", "?")}


def _greedy(z: np.ndarray, top_n: int = 5) -> tuple[int, list[list[float]]]:
    """Greedy token (ties -> lowest id) and top-``top_n`` ``[id, logprob]`` of one logit row (float64 math)."""
    z = z.astype(np.float64)
    m = z.max()
    logp = z - (m + np.log(np.sum(np.exp(z - m))))
    top = np.argsort(-logp, kind="stable")[:top_n]
    return int(np.argmax(z)), [[int(i), float(logp[i])] for i in top]


class LoadError(Exception):
    """The model or context could not be created (llama.cpp said why)."""


class DecodeError(Exception):
    """``llama_decode`` failed (or the request was malformed)."""


class PromptIssue(Exception):
    """A prompt the model cannot take (empty, a token id out of range)."""


def main() -> int:
    """Read one request on stdin, run it, write ``result.json``; exit 0, or 3 with one line on stderr:
    ``G4H-WORKER-ERROR[<load|decode|prompt>]: <message>``."""
    req = json.loads(sys.stdin.read())
    out_dir = Path(req["out_dir"])
    if req.get("lib_dir"):  # another build of the libraries (the native variant of g4h bench), read at import
        os.environ["LLAMA_CPP_LIB_PATH"] = str(req["lib_dir"])
    try:
        runner = Runner(req)
        results = []
        for k, job in enumerate(req.get("jobs", [])):
            op = job.get("op")
            if op == "logits":
                results.append(runner.job_logits(job, out_dir, k))
            elif op == "generate":
                results.append(runner.job_generate(job))
            elif op == "tokenize":
                results.append(runner.job_tokenize(job))
            elif op == "bench":
                results.append(runner.job_bench(job))
            elif op == "info":
                results.append(runner.job_info())
            else:
                raise DecodeError(f"unknown job op {op!r}")
    except (LoadError, DecodeError, PromptIssue) as e:
        kind = {LoadError: "load", DecodeError: "decode", PromptIssue: "prompt"}[type(e)]
        sys.stderr.write(f"\nG4H-WORKER-ERROR[{kind}]: {e}\n")
        sys.stderr.flush()
        return 3
    finish(out_dir, results)


def finish(out_dir: Path, results: list) -> None:
    """Write ``result.json`` (atomically, :data:`RESULT_VERSION`) and end the process with exit 0, skipping
    llama.cpp's teardown: the result is written, and a destructor that asserts must not turn it into a crash.
    Shared by every worker of this package. Never returns."""
    tmp = out_dir / "result.json.tmp"
    tmp.write_text(json.dumps({"version": RESULT_VERSION, "jobs": results}))
    os.replace(tmp, out_dir / "result.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

