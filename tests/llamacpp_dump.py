"""Dump llama.cpp's own intermediate tensors for the numerics tests (run as a subprocess: llama.cpp may abort).

    python tests/llamacpp_dump.py MODEL.gguf OUT.npz --ids 2,5,9 [--kv f16|f32] [--flash] [--names a-0,b-0]
    python tests/llamacpp_dump.py --gelu-table OUT.npz

The first form evaluates the ids in one batch (every row's logits kept) with the KV cache type and flash attention
as given, through llama-cpp-python's low-level API, and writes every graph tensor named in ``--names`` (ggml's
callback names, ``kqv_out-0``) as a float64 array with ggml's axes reversed, plus ``logits``. The second writes
ggml's ``ggml_table_gelu_f16`` (read from ``libggml-cpu.so`` after ``ggml_cpu_init``) as float64 under ``table``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, wherever the test runs from
from gemma4_harness.harness.engines.llamacpp.worker import GGMLTensor  # noqa: E402


def gelu_table(out: str) -> None:
    import llama_cpp  # the library that ships the ggml the harness builds

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()
    raw = (ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16")
    np.savez(out, table=np.ctypeslib.as_array(raw).view(np.float16).astype(np.float64))


def dump(model: str, out: str, ids: list[int], kv: str, flash: bool, names: set[str]) -> None:
    import llama_cpp as L

    got: dict[str, np.ndarray] = {}

    def cb(t_ptr, ask, user_data):
        if ask:
            return True
        t = GGMLTensor.from_address(t_ptr)
        name = t.name.decode("utf-8", "replace")
        dt = {0: np.float32, 1: np.float16}.get(int(t.type))
        if name in names and dt is not None and t.data:
            ne, nb = [int(x) for x in t.ne], [int(x) for x in t.nb]
            span = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(dt).itemsize
            arr = np.ndarray(shape=tuple(reversed(ne)), dtype=dt, buffer=ctypes.string_at(t.data, span),
                             strides=tuple(reversed(nb)))
            got[name] = np.array(arr, dtype=np.float64)
        return True

    cbf = L.ggml_backend_sched_eval_callback(cb)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model_p = L.llama_model_load_from_file(model.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = L.GGML_TYPE_F16 if kv == "f16" else L.GGML_TYPE_F32
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.cb_eval = cbf
    ctx = L.llama_init_from_model(model_p, cp)
    batch = L.llama_batch_init(len(ids), 0, 1)
    for i, t in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(ids)
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model_p))
    logits = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).astype(np.float64)
                       for i in range(len(ids))])
    np.savez(out, logits=logits, **{k.replace("-", "@"): v for k, v in got.items()})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    p.add_argument("out")
    p.add_argument("--ids", default="")
    p.add_argument("--kv", choices=("f16", "f32"), default="f16")
    p.add_argument("--flash", action="store_true")
    p.add_argument("--names", default="")
    p.add_argument("--gelu-table", action="store_true")
    a = p.parse_args()
    if a.gelu_table:
        gelu_table(a.out)
    else:
        os.dup2(2, 1)  # llama.cpp's prints go to stderr
        dump(a.model, a.out, [int(x) for x in a.ids.split(",")], a.kv, a.flash, set(filter(None, a.names.split(","))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
