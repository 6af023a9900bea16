"""A subprocess-protocol engine for the tests (``docs/engine-protocol.md``): the float64 reference behind the
protocol, with every fault the harness must name on request.

    python tests/cmd_stub.py [--fault KIND [--fault-op OP] [--fault-after N]] [--perturb-layer L] [--perturb X]
                              [--dtype D] [--approx A] [--kv-cache T] [--token-only] [--no-tensors] [--linger]
                              [--spec VARIANT[,VARIANT]] [--scale-rows L] [--serve-model PATH]
                              [--repeat-penalty X] [--ban ID[,ID]] [--raw-logprobs] [--generate-noise S]
                              [--ops OP[,OP]]

It answers ``hello``, ``logits`` (float32 ``.npy``), ``generate``, ``trace`` (a ``g4h-trace`` file, with the
tensors unless ``--no-tensors``) and ``tokenize`` (one id per byte, a stand-in). ``--perturb-layer L`` adds
noise to ``blk.L.ffn_down.weight`` (the first trace point to move is that layer's ``ffn_out``). ``--perturb X``
adds ``X`` to the logits of every odd token id (``logits``) and to every log-prob ``generate`` reports (an engine
whose numbers are off by ``X``). ``--dtype``, ``--approx`` and ``--kv-cache`` are what its ``hello`` declares (it
computes in float64 whatever it says); ``--token-only``: its ``generate`` results carry no ``top_logprobs``. ``--spec`` runs the reference under
spec variants (:mod:`harness.engines.variants`): an engine that follows another implementation's rule, or makes a
known fault, in every answer (logits, generate, trace). ``--scale-rows L`` multiplies the first half of the rows of
``blk.L.ffn_down.weight`` by 1.02 (a weight perturbation that changes the matrix's shape, not only its size: no spec
variant does that). ``--serve-model PATH`` answers with the reference of another model whatever model the harness
names (a server that runs the wrong model). ``--repeat-penalty X``: its logits are exact, its greedy decoding is not:
each step's logit of a token already in the context is divided by X (multiplied when negative; llama.cpp's
``penalty_repeat``, src/llama-sampling.cpp ``llama_sampler_penalties_apply``) before the argmax, and the log-probs
it reports are those of the penalised logits. ``--ban ID[,ID]``: the same with those ids at -inf (a ``logit_bias`` of
-inf), alone or beside the penalty; ``--raw-logprobs`` with either: the log-probs reported are those of the logits
before them (llama-server's ``n_probs``, vLLM's default ``raw_logprobs``). ``--generate-noise S``: its logits are
exact, its generation's are not (Gaussian noise of scale S on every logit of every step, a fixed seed: what a broken
KV cache or decode path gives), greedy on them, their log-probs reported. ``--ops OP[,OP]``: the operations its ``hello`` offers (default
``logits,generate,trace,tokenize``; ``generate`` alone: an engine judged by its greedy streams, as a server is).
Faults (:data:`FAULTS`), applied to the first ``--fault-op`` request (default ``logits``; ``any``: every request
but ``hello``) after ``--fault-after N`` of them were answered (default 0; ``die`` with ``--fault-op any
--fault-after N``: an engine that crashes after N requests):
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, wherever the test runs from
from gemma4_harness.harness.engines.reference import ReferenceEngine  # noqa: E402
from gemma4_harness.harness.engines.variants import parse_spec, under  # noqa: E402
from gemma4_harness.harness.traces.format import TraceWriter  # noqa: E402

FAULTS = {
    "malformed": "answer a line that is not JSON",
    "die": "exit with status 3 after a line on stderr",
    "hang": "never answer",
    "shape": "logits with one row too few",
    "dtype": "logits as int32",
    "wrong-id": "answer with another request's id",
    "error": "answer ok: false with a message",
    "not-greedy": "generate: each token is the second most probable",
    "rank6": "generate: the first token is the reference's sixth most probable (listed first, at the top-1's "
             "log-prob): vLLM's rule passes it with N >= 6 only",
    "short": "generate: one token too few",
    "sample": "generate: each token sampled (temperature 1, fixed seed) from the reference's distribution, the "
              "reported top log-probs the reference's at that context (not greedy)",
    "drop": "generate: the token at step 2 (and its log-probs) left out of each stream (one token too few)",
    "refuse": "hello: ok false (cannot read the model)",
    "version": "hello: protocol 2",
    "no-ops": "hello: answers neither logits nor generate",
    "kill-parent": "SIGKILL the process that started it (the harness, or the Ray worker of a g4h sweep task), as the "
                   "kernel's out-of-memory killer would",
}
__doc__ += "\n".join(f"    {k}: {v}" for k, v in FAULTS.items()) + "\n"


class RowScaled:
    """The reference's weights with the first half of the rows of one matrix multiplied by ``factor``."""

    def __init__(self, base, name: str, factor: float = 1.02) -> None:
        self.base, self.name = base, name
        w = np.array(base[name], dtype=np.float64)
        w[: w.shape[0] // 2] *= factor
        self.scaled = w

    def __getitem__(self, name: str) -> np.ndarray:
        return self.scaled if name == self.name else self.base[name]

    def experts(self, name: str, chosen: np.ndarray):  # reference.model.expert_weights: the changed stack whole
        return self.scaled if name == self.name else self.base.experts(name, chosen)

    def __contains__(self, name: object) -> bool:
        return name in self.base

    def __iter__(self):
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, attr: str):
        return getattr(self.base, attr)


def noisy(ref, prompt, n: int, top_n: int, scale: float, seed: int = 5):
    """Greedy decoding on the reference's logits plus Gaussian noise of ``scale`` on every logit of every step (a
    fixed seed), the top-``top_n`` log-probs of the noisy logits reported: a generation path that computes other
    logits than the forward."""
    from gemma4_harness.harness.engines.base import Generated

    rng = np.random.default_rng(seed)
    ids, g = list(prompt), Generated()
    g.tokens, g.top = [], []
    for _ in range(n):
        z = np.array(ref.logits(ids)[-1], dtype=np.float64) + rng.normal(0.0, scale, ref.cfg.vocab_size)
        lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        best = np.argsort(-lp, kind="stable")[:top_n]
        g.tokens.append(int(best[0]))
        g.top.append([(int(i), float(lp[i])) for i in best])
        ids.append(int(best[0]))
    return g


def penalised(ref, prompt, n: int, top_n: int, penalty: float | None, ban=(), raw: bool = False):
    """Greedy decoding with a repetition penalty: each step's logits of the tokens already in the context divided
    by ``penalty`` (multiplied when negative), the ``ban`` ids at -inf, the argmax taken, the top-``top_n``
    log-probs of the processed logits reported (of the logits before them with ``raw``)."""
    from gemma4_harness.harness.engines.base import Generated

    ids, g = list(prompt), Generated()
    g.tokens, g.top = [], []
    for _ in range(n):
        raw_z = np.array(ref.logits(ids)[-1], dtype=np.float64)
        z = raw_z.copy()
        if penalty:
            seen = np.unique(ids)
            z[seen] = np.where(z[seen] > 0, z[seen] / penalty, z[seen] * penalty)
        z[list(ban)] = -np.inf
        tok = int(np.argmax(z))
        shown = raw_z if raw else z
        lp = shown - shown.max() - np.log(np.exp(shown - shown.max()).sum())
        best = np.argsort(-lp, kind="stable")[:top_n]
        g.tokens.append(tok)
        g.top.append([(int(i), float(lp[i])) for i in best])
        ids.append(tok)
    return g


class Perturbed:
    """The reference's weights with Gaussian noise (0.05 x the tensor's RMS) added to one tensor."""

    def __init__(self, base, name: str) -> None:
        self.base, self.name = base, name
        w = np.asarray(base[name], dtype=np.float64)
        rms = float(np.sqrt(np.mean(w * w)))
        self.noisy = w + np.random.default_rng(1).normal(0.0, 0.05 * rms, w.shape)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.noisy if name == self.name else self.base[name]

    def experts(self, name: str, chosen: np.ndarray):  # reference.model.expert_weights: the changed stack whole
        return self.noisy if name == self.name else self.base.experts(name, chosen)

    def __contains__(self, name: object) -> bool:
        return name in self.base

    def __iter__(self):
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, attr: str):  # the rest of the streaming Weights (source, shape, rows, row_blocks ...)
        return getattr(self.base, attr)


def sampled(ref, prompt, n: int, top_n: int, temperature: float = 1.0, seed: int = 7):
    """A stream of ``n`` tokens each drawn from the reference's softmax (at ``temperature``, a fixed seed), with the
    reference's top-``top_n`` ``(id, logprob)`` at each step's context: what a sampling engine reports."""
    from gemma4_harness.harness.engines.base import Generated

    rng = np.random.default_rng(seed)
    ids, g = list(prompt), Generated()
    g.tokens, g.top = [], []
    for _ in range(n):
        z = ref.logits(ids)[-1]
        lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        best = np.argsort(-lp, kind="stable")[:top_n]
        p = np.exp(lp / temperature)
        tok = int(rng.choice(len(p), p=p / p.sum()))
        g.tokens.append(tok)
        g.top.append([(int(i), float(lp[i])) for i in best])
        ids.append(tok)
    return g


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fault", choices=sorted(FAULTS), default=None)
    p.add_argument("--fault-op", default="logits")
    p.add_argument("--fault-after", type=int, default=0)
    p.add_argument("--perturb", type=float, default=0.0)
    p.add_argument("--perturb-layer", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--approx", action="append", default=[], help="declare this approximation in hello")
    p.add_argument("--kv-cache", default=None, help="declare this KV cache type in hello (computing as before)")
    p.add_argument("--token-only", action="store_true", help="generate: tokens only, no top_logprobs")
    p.add_argument("--no-tensors", action="store_true")
    p.add_argument("--linger", action="store_true", help="do not exit when stdin closes (sleep an hour)")
    p.add_argument("--spec", default=None, help="run the reference under these spec variants (comma list)")
    p.add_argument("--scale-rows", type=int, default=None, help="x1.02 on half the rows of blk.L.ffn_down.weight")
    p.add_argument("--serve-model", default=None, help="answer with this model, whatever the harness names")
    p.add_argument("--repeat-penalty", type=float, default=None, help="a repetition penalty in greedy decoding")
    p.add_argument("--ban", default=None, help="these token ids (comma list) at -inf in greedy decoding")
    p.add_argument("--raw-logprobs", action="store_true",
                   help="with --repeat-penalty / --ban: report the log-probs of the logits before them")
    p.add_argument("--generate-noise", type=float, default=None, help="noise on generation's logits only")
    p.add_argument("--ops", default="logits,generate,trace,tokenize", help="the operations hello offers")
    a = p.parse_args()
    with under(parse_spec(a.spec), fast=False):
        return serve(a)


def serve(a: argparse.Namespace) -> int:
    """Answer the requests on stdin until it closes (see the module docstring)."""
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    ref = None

    def reply(req, **fields):
        proto.write(json.dumps({"id": req["id"], "ok": True, **fields}) + "\n")

    seen = 0  # requests of --fault-op answered so far
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        fault = None
        if a.fault in ("refuse", "version", "no-ops"):
            fault = a.fault if op == "hello" else None
        elif op == a.fault_op or (a.fault_op == "any" and op != "hello"):
            fault = a.fault if seen >= a.fault_after else None
            seen += 1
        if fault == "malformed":
            proto.write("this is not a JSON reply\n")
            continue
        if fault == "die":
            print("stub: fatal: simulated crash in " + op, file=sys.stderr, flush=True)
            return 3
        if fault == "hang":
            time.sleep(3600)
        if fault == "kill-parent":
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(3600)
        if fault == "wrong-id":
            req = dict(req, id=req["id"] + 7)
        if fault == "error":
            proto.write(json.dumps({"id": req["id"], "ok": False, "error": "stub: simulated failure"}) + "\n")
            continue
        if op == "hello":
            if fault == "refuse":
                proto.write(json.dumps({"id": req["id"], "ok": False, "error": "stub: cannot read this model"}) + "\n")
                continue
            ref = ReferenceEngine(a.serve_model or req["model"])
            if a.scale_rows is not None:
                ref.weights = RowScaled(ref.weights, f"blk.{a.scale_rows}.ffn_down.weight")
            if a.perturb_layer is not None:
                ref.weights = Perturbed(ref.weights, f"blk.{a.perturb_layer}.ffn_down.weight")
            reply(req, protocol=2 if fault == "version" else 1, engine="cmd-stub (reference)",
                  ops=["tokenize"] if fault == "no-ops" else a.ops.split(","),
                  vocab_size=ref.cfg.vocab_size, dtype=a.dtype, approximations=a.approx,
                  **({"kv_cache": a.kv_cache} if a.kv_cache else {}))
        elif op == "logits":
            z = ref.logits(req["ids"])
            if a.perturb:
                z[:, 1::2] += a.perturb
            z = z.astype(np.float32)
            if fault == "shape":
                z = z[:-1]
            if fault == "dtype":
                z = z.astype(np.int32)
            np.save(req["out"], z)
            reply(req, logits=req["out"])
        elif op == "generate":
            results = []
            gens = ref.generate_full(req["prompts"], req["max_new_tokens"], top_n=max(6, req["top_n"]))
            if fault == "sample":
                gens = [sampled(ref, p, req["max_new_tokens"], req["top_n"]) for p in req["prompts"]]
            if a.generate_noise is not None:
                gens = [noisy(ref, p, req["max_new_tokens"], max(6, req["top_n"]), a.generate_noise)
                        for p in req["prompts"]]
            if a.repeat_penalty is not None or a.ban:
                gens = [penalised(ref, p, req["max_new_tokens"], max(6, req["top_n"]), a.repeat_penalty,
                                  [int(b) for b in a.ban.split(",")] if a.ban else (), a.raw_logprobs)
                        for p in req["prompts"]]
            for g in gens:
                toks = [s[1][0] for s in g.top] if fault == "not-greedy" else g.tokens
                if fault == "rank6":
                    s0 = g.top[0]
                    g.top[0] = [(s0[5][0], s0[0][1])] + s0[:5] + s0[6:]
                    toks = [s0[5][0]] + toks[1:]
                steps = [[[i, lp + a.perturb] for i, lp in s[:req["top_n"]]] for s in g.top]
                if fault == "short":
                    toks, steps = toks[:-1], steps[:-1]
                if fault == "drop" and len(toks) > 2:
                    toks, steps = toks[:2] + toks[3:], steps[:2] + steps[3:]
                results.append({"tokens": toks} if a.token_only else {"tokens": toks, "top_logprobs": steps})
            reply(req, results=results)
        elif op == "trace":
            dump = None if a.no_tensors else req.get("dump_dir")
            w = TraceWriter("cmd-stub", req["ids"], dtype="float64", keep_tensors=dump is not None)
            ref.logits(req["ids"], trace=w)
            w.write(req["out"], dump)
            reply(req, trace=req["out"])
        elif op == "tokenize":
            reply(req, ids=[2] * bool(req.get("add_special", True)) + list(req["text"].encode("utf-8")))
    if a.linger:
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
