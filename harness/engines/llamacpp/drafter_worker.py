"""The llama.cpp MTP-drafter worker: a ``gemma4-assistant`` GGUF drafting against its target, in its own process.

Started as ``python -m gemma4_harness.harness.engines.llamacpp.drafter_worker`` by
:func:`harness.engines.llamacpp.drafter._run`; one JSON request on stdin, ``<out_dir>/result.json`` when it exits
with status 0 (else one stderr line ``G4H-WORKER-ERROR[...]: ...``), as :mod:`.worker`.

How llama.cpp is driven (the ``is_mem_shared`` path of ``common/speculative.cpp``'s ``draft-mtp``):

* two contexts: the target's (F32 KV cache, flash attention off, the real sliding-window cache), and the
  drafter's with ``ctx_type = LLAMA_CONTEXT_TYPE_MTP`` and ``ctx_other`` = the target context (its memory is
  the target's KV cache);
* ``llama_set_embeddings_nextn`` on both, so that ``llama_get_embeddings_nextn_ith`` returns the target's
  ``h_nextn`` (its post-output-norm state) and the drafter's own next ``h``. llama-cpp-python 0.3.36 binds
  neither: they are declared ``LLAMA_API`` in ``src/llama-ext.h`` but exported with C++ linkage, so they are
  called here by their mangled names through ctypes (:data:`EXT_SYMBOLS`);
* a draft step is one ``llama_process`` of an extended batch holding the token, its position ``pos0`` and the
  ``h`` row set with ``llama_batch_ext_set_embd_token`` (``llama_batch_ext_set_embd_state`` is a stub that
  returns false in this llama.cpp: ``src/llama-batch.cpp``); every step of a round sits at ``pos0``;
* a verify step is an ordinary ``llama_decode`` of ``[last, d_1 .. d_n]`` on the target with logits for every
  row; the rejected tail is removed with ``llama_memory_seq_rm``.

Request::

    {"target": "t.gguf", "drafter": "d.gguf", "n_ctx": 256, "threads": 2, "out_dir": "...",
     "jobs": [{"op": "draft", "prompt": [...], "n_draft": 4},
              {"op": "speculative", "prompt": [...], "max_new_tokens": 12, "k": 4}]}

Result: ``draft`` -> ``{"token", "h" (file), "drafts", "logits" (file [n, V]), "h_next" (file [n, H_t])}``;
``speculative`` -> ``{"tokens", "plain", "drafted", "accepted", "rounds"}`` (``plain``: the same context's
plain greedy tokens, for the lossless comparison).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .worker import DecodeError, LoadError, _Log, default_threads, finish

EXT_SYMBOLS = {
    "llama_set_embeddings_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    "llama_get_embeddings_nextn_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
}
"""The staging API of ``src/llama-ext.h`` the drafter needs, by their (Itanium C++ ABI) exported names."""


class Drafting:
    """The target and drafter models and contexts of one request."""

    def __init__(self, req: dict[str, Any]) -> None:
        import llama_cpp  # optional heavy dependency, loaded only in this worker process

        L = self.L = llama_cpp
        self.log = _Log(L)
        self.req = req
        L.llama_backend_init()
        lib = L.llama_cpp._lib
        try:
            self.set_nextn = getattr(lib, EXT_SYMBOLS["llama_set_embeddings_nextn"])
            self.get_nextn_ith = getattr(lib, EXT_SYMBOLS["llama_get_embeddings_nextn_ith"])
        except AttributeError as e:
            raise LoadError(f"libllama does not export the nextn staging API ({e})") from None
        self.set_nextn.argtypes, self.set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        self.get_nextn_ith.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self.get_nextn_ith.restype = ctypes.POINTER(ctypes.c_float)
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.mt = self._load(req["target"], mp)
        self.md = self._load(req["drafter"], mp)
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.mt)))
        self.h_t = int(L.llama_model_n_embd(self.mt))
        self.ct = self.cd = None

    def _load(self, path: str, mp):
        m = self.L.llama_model_load_from_file(str(path).encode(), mp)
        if not m:
            raise LoadError(f"llama.cpp could not load {path}: {self.log.last_error or 'NULL model'}")
        return m

    def contexts(self) -> None:
        """Fresh target and drafter contexts (the drafter's memory is the target's)."""
        L = self.L
        for c in (self.cd, self.ct):
            if c is not None:
                L.llama_free(c)
        self.ct = self._context(None)
        self.set_nextn(self.ct, True, False)  # h_nextn of every row of a target batch
        self.cd = self._context(self.ct)
        self.set_nextn(self.cd, True, True)

    def _context(self, other):
        L, n_ctx = self.L, int(self.req.get("n_ctx", 256))
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = int(self.req.get("threads") or default_threads())
        cp.type_k = cp.type_v = L.GGML_TYPE_F32
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.swa_full = False
        cp.offload_kqv = cp.op_offload = False
        cp.no_perf = True
        if other is not None:
            cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
            cp.ctx_other = other
        ctx = L.llama_init_from_model(self.md if other is not None else self.mt, cp)
        if not ctx:
            raise LoadError(f"llama.cpp could not create a {'drafter' if other else 'target'} context: "
                            f"{self.log.last_error or 'NULL context'}")
        return ctx

    # ------------------------------------------------------------------ steps

    def target_decode(self, ids: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        """Decode ``ids`` at ``start..`` on the target; logits ``[T, V]`` and ``h_nextn`` ``[T, H_t]`` of every row."""
        L, T = self.L, len(ids)
        b = L.llama_batch_init(T, 0, 1)
        try:
            for i, t in enumerate(ids):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, start + i, 1, 1
                b.seq_id[i][0] = 0
            b.n_tokens = T
            rc = L.llama_decode(self.ct, b)
        finally:
            L.llama_batch_free(b)
        if rc != 0:
            raise DecodeError(f"llama_decode (target) returned {rc}: {self.log.last_error or 'no message'}")
        logits = np.stack([self._floats(L.llama_get_logits_ith(self.ct, i), self.n_vocab) for i in range(T)])
        hs = np.stack([self._floats(self.get_nextn_ith(self.ct, i), self.h_t) for i in range(T)])
        return logits, hs

    def draft_step(self, token: int, h: np.ndarray, pos0: int) -> tuple[np.ndarray, np.ndarray]:
        """One drafter step at ``pos0``: logits ``[V]`` and the next ``h`` ``[H_t]``."""
        L = self.L
        batch = L.llama_batch_ext_init(self.cd)
        try:
            buf = (ctypes.c_float * self.h_t)(*np.asarray(h, dtype=np.float32).tolist())
            idx = L.llama_batch_ext_add_token(batch, 0, int(token))
            pos = ctypes.c_int32(pos0)
            emb = L.llama_embd(ctypes.cast(buf, ctypes.POINTER(ctypes.c_float)), 1, self.h_t)
            if idx < 0 or not L.llama_batch_ext_set_embd_token(batch, idx, emb) \
                    or not L.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos)) \
                    or not L.llama_batch_ext_set_output_logits(batch, idx, True):
                raise DecodeError(f"could not build the drafter batch (token {token}, pos {pos0})")
            rc = L.llama_process(self.cd, L.LLAMA_PROCESS_TYPE_DECODE, batch)
            if rc != 0:
                raise DecodeError(f"llama_process (drafter) returned {rc}: {self.log.last_error or 'no message'}")
            return (self._floats(L.llama_get_logits_ith(self.cd, idx), self.n_vocab),
                    self._floats(self.get_nextn_ith(self.cd, idx), self.h_t))
        finally:
            L.llama_batch_ext_free(batch)

    @staticmethod
    def _floats(p, n: int) -> np.ndarray:
        if not p:
            raise DecodeError("llama.cpp returned no output row")
        out = np.ctypeslib.as_array(p, shape=(n,)).astype(np.float32, copy=True)
        if not np.isfinite(out).all():
            raise DecodeError("llama.cpp output holds NaN or Inf")
        return out

    # ------------------------------------------------------------------ jobs

    def job_draft(self, job: dict[str, Any], out_dir: Path, k: int) -> dict[str, Any]:
        """The first round after a prefill of ``prompt``: the target's token and ``h``, then ``n_draft`` drafts."""
        self.contexts()
        ids = [int(t) for t in job["prompt"]]
        logits, hs = self.target_decode(ids, 0)
        tok, h = int(np.argmax(logits[-1])), hs[-1]
        np.save(out_dir / f"h{k}.npy", h)
        drafts, lg, hn = [], [], []
        t, cur = tok, h
        for _ in range(int(job["n_draft"])):
            row, cur = self.draft_step(t, cur, len(ids))
            t = int(np.argmax(row))
            drafts.append(t)
            lg.append(row)
            hn.append(cur)
        np.save(out_dir / f"logits{k}.npy", np.stack(lg))
        np.save(out_dir / f"hnext{k}.npy", np.stack(hn))
        return {"op": "draft", "token": tok, "h": f"h{k}.npy", "drafts": drafts, "logits": f"logits{k}.npy",
                "h_next": f"hnext{k}.npy"}

    def job_speculative(self, job: dict[str, Any]) -> dict[str, Any]:
        """Speculative greedy decoding entirely in llama.cpp, and plain greedy in a fresh context to compare."""
        ids, n_new, kmax = [int(t) for t in job["prompt"]], int(job["max_new_tokens"]), int(job["k"])
        L = self.L
        self.contexts()
        logits, hs = self.target_decode(ids, 0)
        out, h, pos = [int(np.argmax(logits[-1]))], hs[-1], len(ids)
        drafted = accepted = 0
        rounds = []
        while len(out) < n_new:
            n = min(kmax, n_new - len(out) - 1)
            d, t, cur = [], out[-1], h
            for _ in range(n):
                row, cur = self.draft_step(t, cur, pos)
                t = int(np.argmax(row))
                d.append(t)
            logits, hs = self.target_decode([out[-1]] + d, pos)
            g = [int(np.argmax(r)) for r in logits]
            a = 0
            while a < len(d) and d[a] == g[a]:
                a += 1
            out += g[:a + 1]
            drafted, accepted = drafted + len(d), accepted + a
            rounds.append([len(d), a])
            L.llama_memory_seq_rm(L.llama_get_memory(self.ct), 0, pos + a + 1, -1)  # the rejected drafts
            h, pos = hs[a], pos + a + 1
        self.contexts()
        logits, _ = self.target_decode(ids, 0)
        plain = [int(np.argmax(logits[-1]))]
        while len(plain) < n_new:
            logits, _ = self.target_decode([plain[-1]], len(ids) + len(plain) - 1)
            plain.append(int(np.argmax(logits[-1])))
        return {"op": "speculative", "tokens": out[:n_new], "plain": plain, "drafted": drafted, "accepted": accepted,
                "rounds": rounds}


def main() -> int:
    """Read one request on stdin, run it, write ``result.json``; exit 0, or 3 with one ``G4H-WORKER-ERROR`` line."""
    req = json.loads(sys.stdin.read())
    out_dir = Path(req["out_dir"])
    try:
        run = Drafting(req)
        results = []
        for k, job in enumerate(req.get("jobs", [])):
            if job.get("op") == "draft":
                results.append(run.job_draft(job, out_dir, k))
            elif job.get("op") == "speculative":
                results.append(run.job_speculative(job))
            else:
                raise DecodeError(f"unknown job op {job.get('op')!r}")
    except (LoadError, DecodeError) as e:
        sys.stderr.write(f"\nG4H-WORKER-ERROR[{'load' if isinstance(e, LoadError) else 'decode'}]: {e}\n")
        sys.stderr.flush()
        return 3
    finish(out_dir, results)


if __name__ == "__main__":
    sys.exit(main())
