"""The llama.cpp multimodal worker: llama.cpp's mtmd encoders in their own process.

Started by :func:`harness.engines.llamacpp.mtmd.mtmd_soft_tokens` as ``python -m
gemma4_harness.harness.engines.llamacpp.mmworker``; reads one JSON request on stdin, writes ``result.json`` and ``.npy`` files
into ``out_dir`` and exits 0; any other exit (an abort inside llama.cpp, a signal) is a crash the parent names
from stderr (:func:`harness.core.workers.crash_error`).

Request::

    {"model": "text.gguf", "mmproj": "mmproj.gguf", "threads": 2, "out_dir": "/tmp/...",
     "image_min_tokens": 1, "image_max_tokens": 1120,
     "items": [{"kind": "image", "file": "item0.npy"},      # uint8 [H, W, 3]
               {"kind": "audio", "file": "item1.npy"}]}     # float32 [N] samples at 16 kHz

Each item is tokenized alone (``mtmd_tokenize`` of the default media marker with one bitmap), every media
chunk is encoded (``mtmd_encode_chunk``) and its output read (``mtmd_get_output_embd``: ``n_tokens x n_embd``
floats, the projected soft tokens); a clip longer than 30 s gives several chunks, concatenated. The clip graph's
callback (``cb_eval`` of ``mtmd_context_params``) copies out the tensors named like the reference's trace points
(:data:`VISION_POINTS`, ``<name>-<layer>`` per layer; the audio graph names only its input, which the callback
does not see). Flash attention is off (on the CPU it holds K and V in F16).

Result::

    {"version": 1, "non_causal": true, "n_embd": 64,
     "items": [{"kind": "image", "embd": "item0-embd.npy", "n_tokens": 60, "n_chunks": 1,
                "trace": [["Qcur_pos", 0, "item0-Qcur_pos-0.npy"], ...]}, ...]}
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .worker import GGMLTensor, default_threads, tensor_to_numpy

RESULT_VERSION = 1

#: llama.cpp clip graph-callback names (gemma4v graph, ``build_vit``) that the reference traces under the same name,
#: with the numpy rank of each (``[N, H]``, or ``[N, heads, D]`` for the attention inputs).
VISION_POINTS = {"inp": 2, "pos_embd": 2, "layer_inp_normed": 2, "Qcur_pos": 3, "Kcur_pos": 3, "Vcur_normed": 3,
                 "kqv_out": 2, "attn_out": 2, "attn_post_normed": 2, "ffn_inp": 2, "ffn_inp_normed": 2,
                 "ffn_out": 2, "ffn_post_normed": 2, "layer_out": 2, "pooled": 2, "std_scaled": 2, "projected": 2}

CHUNK_IMAGE, CHUNK_AUDIO = 1, 2  # MTMD_INPUT_CHUNK_TYPE_IMAGE / _AUDIO


class WorkerError(Exception):
    """llama.cpp refused the files or an item (it said why)."""


def _split(name: str) -> tuple[str, int] | None:
    if name in VISION_POINTS:
        return name, -1
    base, sep, idx = name.rpartition("-")
    if sep and base in VISION_POINTS and idx.isdigit():
        return base, int(idx)
    return None


class MtmdRunner:
    """The text model and one mtmd context."""

    def __init__(self, req: dict[str, Any]) -> None:
        import llama_cpp  # optional heavy dependency, loaded only in this worker process
        from llama_cpp import mtmd_cpp  # optional heavy dependency (the mtmd bindings), this worker only

        self.L, self.M = llama_cpp, mtmd_cpp
        self.errors: list[str] = []

        def log(level, text, user_data):
            msg = (text or b"").decode("utf-8", "replace")
            if int(level) >= 3:
                sys.stderr.write(msg)
                if int(level) >= 4 and msg.strip():
                    self.errors.append(msg.strip())

        self._log = llama_cpp.llama_log_callback(log)
        llama_cpp.llama_log_set(self._log, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(req["model"]).encode(), mp)
        if not self.model:
            raise WorkerError(f"llama.cpp could not load {req['model']}: {self._why('NULL model')}")
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.model))
        self.tracing: dict[tuple[str, int], list[np.ndarray]] | None = None
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval_cb)
        cp = mtmd_cpp.mtmd_context_params_default()
        cp.use_gpu = False
        cp.print_timings = False
        cp.n_threads = int(req.get("threads") or default_threads())
        cp.warmup = False
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # flash attention holds K/V in F16
        cp.image_min_tokens = int(req.get("image_min_tokens", 0))
        cp.image_max_tokens = int(req.get("image_max_tokens", 0))
        cp.cb_eval = self._cb
        cp.cb_eval_user_data = None
        self.ctx = mtmd_cpp.mtmd_init_from_file(str(req["mmproj"]).encode(), self.model, cp)
        if not self.ctx:
            raise WorkerError(f"llama.cpp could not load the mmproj {req['mmproj']}: {self._why('NULL context')}")

    def _why(self, default: str) -> str:
        return self.errors[-1] if self.errors else default

    def _eval_cb(self, t_ptr, ask, user_data) -> bool:
        if self.tracing is None:
            return False
        t = GGMLTensor.from_address(t_ptr)
        key = _split(t.name.decode("utf-8", "replace"))
        if key is None:
            return False
        if ask:
            return True
        arr = tensor_to_numpy(t, VISION_POINTS[key[0]])
        if arr is not None:
            self.tracing.setdefault(key, []).append(arr)
        return True

    def encode(self, kind: str, data: np.ndarray) -> tuple[np.ndarray, int, dict[tuple[str, int], np.ndarray]]:
        """Soft tokens ``[n, n_embd]`` float32 of one item, its number of media chunks, and its vision trace."""
        M = self.M
        if kind == "image":
            rgb = np.ascontiguousarray(data, dtype=np.uint8)
            buf = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
            bitmap = M.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], buf)
        else:
            pcm = np.ascontiguousarray(data, dtype=np.float32)
            buf = (ctypes.c_float * pcm.size).from_buffer_copy(pcm.tobytes())
            bitmap = M.mtmd_bitmap_init_from_audio(pcm.size, buf)
        if not bitmap:
            raise WorkerError(f"mtmd could not make a bitmap of the {kind}: {self._why('NULL bitmap')}")
        chunks = M.mtmd_input_chunks_init()
        text = M.mtmd_input_text(M.mtmd_default_marker(), len(M.mtmd_default_marker()), False, True)
        arr = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), arr, 1)
        if rc != 0:
            raise WorkerError(f"mtmd_tokenize returned {rc} for the {kind}: {self._why('no message')}")
        rows, n_chunks = [], 0
        self.tracing = {} if kind == "image" else None
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(chunk) not in (CHUNK_IMAGE, CHUNK_AUDIO):
                continue
            n = int(M.mtmd_input_chunk_get_n_tokens(chunk))
            rc = M.mtmd_encode_chunk(self.ctx, chunk)
            if rc != 0:
                raise WorkerError(f"mtmd_encode_chunk returned {rc} for the {kind}: {self._why('no message')}")
            p = M.mtmd_get_output_embd(self.ctx)
            rows.append(np.ctypeslib.as_array(p, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy())
            n_chunks += 1
        trace = {k: np.concatenate(v) for k, v in (self.tracing or {}).items()}
        self.tracing = None
        self.non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, None))
        if not rows:
            raise WorkerError(f"mtmd gave no media chunk for the {kind}")
        return np.concatenate(rows), n_chunks, trace


def main() -> int:
    """Read the request, encode every item, write ``result.json``; exit 0, or 3 with
    ``G4H-WORKER-ERROR[mtmd]: <message>`` on stderr."""
    req = json.loads(sys.stdin.read())
    out_dir = Path(req["out_dir"])
    try:
        run = MtmdRunner(req)
        items = []
        for k, it in enumerate(req["items"]):
            embd, n_chunks, trace = run.encode(it["kind"], np.load(out_dir / it["file"], allow_pickle=False))
            np.save(out_dir / f"item{k}-embd.npy", embd)
            files = []
            for (point, layer), arr in trace.items():
                name = f"item{k}-{point}{layer}.npy"
                np.save(out_dir / name, arr)
                files.append([point, layer, name])
            items.append({"kind": it["kind"], "embd": f"item{k}-embd.npy", "n_tokens": int(embd.shape[0]),
                          "n_chunks": n_chunks, "trace": files})
    except WorkerError as e:
        sys.stderr.write(f"\nG4H-WORKER-ERROR[mtmd]: {e}\n")
        sys.stderr.flush()
        return 3
    (out_dir / "result.json.tmp").write_text(json.dumps({"version": RESULT_VERSION, "n_embd": run.n_embd,
                                                         "non_causal": run.non_causal, "items": items}))
    os.replace(out_dir / "result.json.tmp", out_dir / "result.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip llama.cpp's teardown: the result is written


if __name__ == "__main__":
    sys.exit(main())
