"""A server in llama-server's dialect that computes exactly (the float64 reference behind ``/completion``), for the
tests of declared numerics: an fp32 server without approximations does not exist among the real parts (llama.cpp
always reads GELU from its fp16 table), and the test needs one to show that such a server, declared so
(``--declare approximations=none --declare kv_cache=f32``), is held to the fp32 bounds, and that a 1e-2 shift of its
log-probs (``perturb``) fails them. Only the requests the pair check sends are answered: ``GET /props``,
``GET /v1/models``, ``POST /completion`` (token-id prompt, ``n_predict``, ``n_probs``, ``return_tokens``); every
other path is a 404 (the server checks are opted out where it is used). With ``token_only`` it reports no log-probs
(a server without ``n_probs``). With ``repeat_penalty`` X or ``ban`` (token ids) its logits stay exact and its greedy
decoding does not: each step's logit of a token already in the context divided by X (multiplied when negative;
llama.cpp's ``penalty_repeat``, src/llama-sampling.cpp ``llama_sampler_penalties_apply``), the banned ids at -inf
(a ``logit_bias`` of -inf), the argmax taken and the log-probs of those processed logits reported (as vLLM's
``logprobs_mode`` ``processed_logprobs``): a fault only in decoding, on a server that gives no logits. With
``raw_logprobs`` as well, the log-probs reported are those of the logits before the penalty and the ban (as
llama-server's ``n_probs`` and vLLM's default ``raw_logprobs``): its token is then not the top-1 of its own log-probs.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterable

import numpy as np
from http_stub import JsonHandler, StubServer

from gemma4_harness.harness.engines.base import Generated
from gemma4_harness.harness.engines.reference import ReferenceEngine


def _log_softmax(z: np.ndarray) -> np.ndarray:
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def decoded(ref: ReferenceEngine, prompt: list[int], n: int, top_n: int, repeat_penalty: float | None,
            ban: Iterable[int], raw_logprobs: bool = False) -> Generated:
    """Greedy decoding of ``n`` tokens on the reference's logits after a repetition penalty and a ban (module
    docstring), with the top-``top_n`` log-probs of the processed logits, or of the logits before them
    (``raw_logprobs``); ``own``: each step's log-prob of its token, among them or not."""
    ids, g, banned = list(prompt), Generated(), sorted(set(int(b) for b in ban))
    g.tokens, g.top, g.own = [], [], []
    for _ in range(n):
        raw = np.array(ref.logits(ids)[-1], dtype=np.float64)
        z = raw.copy()
        if repeat_penalty:
            seen = np.unique(ids)
            z[seen] = np.where(z[seen] > 0, z[seen] / repeat_penalty, z[seen] * repeat_penalty)
        z[banned] = -np.inf
        tok = int(np.argmax(z))
        lp = _log_softmax(raw if raw_logprobs else z)
        best = np.argsort(-lp, kind="stable")[:top_n]
        g.tokens.append(tok)
        g.own.append(float(lp[tok]))
        g.top.append([(int(i), float(lp[i])) for i in best])
        ids.append(tok)
    return g


class ReferenceServer(StubServer):
    """``with ReferenceServer(gguf, perturb=0.01) as s: ... s.url``: see the module docstring."""

    def __init__(self, gguf: str | Path, perturb: float = 0.0, token_only: bool = False,
                 repeat_penalty: float | None = None, ban: Iterable[int] = (), raw_logprobs: bool = False) -> None:
        srv = self
        self.ref = ReferenceEngine(gguf)
        self.perturb, self.token_only = float(perturb), token_only
        self.repeat_penalty, self.ban, self.raw_logprobs = repeat_penalty, tuple(ban), raw_logprobs
        self.lock = threading.Lock()  # the reference is not thread-safe

        class Handler(JsonHandler):
            def do_GET(self):
                if self.path == "/props":
                    return self._send(200, {"default_generation_settings": {}, "total_slots": 1})
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [
                        {"id": "reference", "owned_by": "llamacpp", "meta": {"n_vocab": srv.ref.cfg.vocab_size}}]})
                self._send(404, {"error": {"code": 404, "message": "File Not Found"}})

            def do_POST(self):
                req = json.loads(self._body() or b"{}")
                if self.path != "/completion":
                    return self._send(404, {"error": {"code": 404, "message": "File Not Found"}})
                self._send(200, srv.complete(req))

        super().__init__(Handler)

    def complete(self, req: dict) -> dict:
        """llama-server's ``/completion`` answer: greedy tokens of the reference, each step's top-``n_probs``."""
        n, top_n = int(req.get("n_predict", 16)), int(req.get("n_probs", 0))
        prompt = [int(t) for t in req["prompt"]]
        with self.lock:
            if self.repeat_penalty or self.ban:
                g = decoded(self.ref, prompt, n, max(1, top_n), self.repeat_penalty, self.ban, self.raw_logprobs)
            else:
                (g,) = self.ref.generate_full([prompt], n, top_n=max(1, top_n))
        own = getattr(g, "own", None) or [dict(s)[t] for t, s in zip(g.tokens, g.top)]
        steps = [] if self.token_only or not top_n else [
            {"id": t, "logprob": mine + self.perturb,
             "top_logprobs": [{"id": i, "logprob": lp + self.perturb} for i, lp in s]}
            for t, s, mine in zip(g.tokens, g.top, own)]
        return {"content": "", "tokens": list(g.tokens), "tokens_predicted": len(g.tokens), "stop": True,
                "stop_type": "limit", "completion_probabilities": steps}
