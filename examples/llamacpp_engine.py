#!/usr/bin/env python3
"""A Gemma 4 engine for g4h's subprocess protocol (``docs/engine-protocol.md``), wrapping llama-cpp-python.

The shortest way to put an engine under the harness: read one JSON request a line on stdin, answer one
JSON line on stdout. This one runs llama.cpp through llama-cpp-python's ``Llama`` class (CPU, F32 KV
cache, flash attention off, one output row per position with ``logits_all``)::

    g4h parity --model m.gguf --against "cmd:python examples/llamacpp_engine.py"
    g4h logits --model m.gguf --engine "cmd:python examples/llamacpp_engine.py" --prompt-ids p.json --out z.npy

``--perturb P`` makes it a broken engine on purpose: Gaussian noise of ``--perturb-scale`` is added to the
logits at position ``P`` of every prompt of ``--perturb-len`` tokens (any length when not given), so
``g4h parity`` must fail on exactly that prompt and position.

Requests it answers: ``hello``, ``logits``, ``generate`` (greedy, top-N log-probs), ``tokenize``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

PROTOCOL = 1
GGML_TYPE_F32 = 0


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Natural-log probabilities of one logits row ``[V]``, in float64."""
    z = np.asarray(z, dtype=np.float64)
    m = z.max()
    return z - (m + np.log(np.sum(np.exp(z - m))))


class Engine:
    """The model and the answers to each request (one method per ``op``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.llm = None

    def hello(self, req: dict) -> dict:
        import llama_cpp  # imported here so that a missing install is an error reply, not a dead process

        if not str(req["model"]).endswith(".gguf"):
            raise ValueError(f"{req['model']}: this engine reads GGUF files only")
        self.llm = llama_cpp.Llama(model_path=req["model"], n_ctx=self.args.ctx, n_batch=self.args.ctx,
                                   n_ubatch=self.args.ctx, n_threads=self.args.threads, n_gpu_layers=0,
                                   logits_all=True, flash_attn=False, swa_full=False,
                                   type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)
        return {"protocol": PROTOCOL, "engine": f"llama-cpp-python {llama_cpp.__version__}",
                "ops": ["logits", "generate", "tokenize"], "vocab_size": self.llm.n_vocab(),
                "dtype": "float32", "approximations": ["gelu_fp16_table", "quantized_activations"]}

    def _run(self, ids: list[int]) -> np.ndarray:
        """Logits ``[T, V]`` (float32) of every position of ``ids``, from an empty KV cache."""
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[:len(ids)], dtype=np.float32)

    def logits(self, req: dict) -> dict:
        z = self._run(req["ids"])
        a = self.args
        if a.perturb is not None and a.perturb < len(z) and a.perturb_len in (None, len(z)):
            z[a.perturb] += np.random.default_rng(0).normal(0.0, a.perturb_scale, z.shape[1]).astype(np.float32)
        np.save(req["out"], z)
        return {"logits": req["out"]}

    def generate(self, req: dict) -> dict:
        results = []
        for prompt in req["prompts"]:
            self.llm.reset()
            self.llm.eval(prompt)
            tokens, tops = [], []
            for step in range(req["max_new_tokens"]):
                lp = log_softmax(self.llm.scores[self.llm.n_tokens - 1])
                top = np.argsort(-lp, kind="stable")[:req["top_n"]]
                tokens.append(int(top[0]))
                tops.append([[int(i), float(lp[i])] for i in top])
                if step + 1 < req["max_new_tokens"]:
                    self.llm.eval([tokens[-1]])
            results.append({"tokens": tokens, "top_logprobs": tops})
        return {"results": results}

    def tokenize(self, req: dict) -> dict:
        ids = self.llm.tokenize(req["text"].encode("utf-8"), add_bos=req.get("add_special", True), special=True)
        return {"ids": [int(i) for i in ids]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=2048, help="context length (tokens)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: llama.cpp's choice)")
    p.add_argument("--perturb", type=int, default=None, metavar="P", help="add noise to the logits at position P")
    p.add_argument("--perturb-len", type=int, default=None, metavar="T", help="only in prompts of T tokens")
    p.add_argument("--perturb-scale", type=float, default=0.1, help="standard deviation of that noise")
    args = p.parse_args()
    # stdout carries the protocol only: keep a handle on it, then send fd 1 (llama.cpp's own prints) to stderr
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    engine = Engine(args)
    for line in sys.stdin:  # the harness closes stdin when it is done: the loop ends and so does the engine
        req = json.loads(line)
        if req["op"] not in ("hello", "logits", "generate", "tokenize"):
            reply = {"ok": False, "error": f"unknown op {req['op']!r}"}
        else:
            try:
                reply = {"ok": True, **getattr(engine, req["op"])(req)}
            except Exception as e:  # any failure is one error reply; the harness names the request
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        proto.write(json.dumps({"id": req["id"], **reply}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
