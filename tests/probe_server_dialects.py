"""Probe the real llama.cpp servers and write what they answer: the evidence behind docs/server-dialects.md.

    python tests/probe_server_dialects.py --out /tmp/probe            # both servers, synthetic + Gemma 3 270M

Starts ``llama-server`` (``--parallel 4``) and llama-cpp-python's server (fixtures' settings, :mod:`servers`)
on the synthetic ``31b`` GGUF and on the real Gemma 3 270M GGUF, sends each probe request (endpoint, body),
and writes ``<out>/<server>-<model>.json``: per probe the request, the HTTP status, the response headers
that identify a server, and the body (long lists cut to their first items). Then the determinism check:
every prompt of a set of 16 greedily generated alone, then all 16 at once (16 threads, so 4 slots share
batches on llama-server), counting identical token streams and comparing the top-5 log-probs.
Not a test (pytest does not collect it); it needs the llama.cpp build and llama-cpp-python's server extras.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import servers  # noqa: E402  (after the sys.path lines)

HEADERS = ("server", "content-type", "access-control-allow-origin", "x-request-id")


def cut(x, n: int = 6):
    """``x`` with every list longer than ``2n`` cut to its first ``n`` items plus a ``"... (N items)"`` marker."""
    if isinstance(x, list):
        out = [cut(v, n) for v in x[:n]] if len(x) > 2 * n else [cut(v, n) for v in x]
        return out + [f"... ({len(x)} items)"] if len(x) > 2 * n else out
    if isinstance(x, dict):
        return {k: cut(v, n) for k, v in x.items()}
    if isinstance(x, str) and len(x) > 400:
        return x[:400] + f"... ({len(x)} chars)"
    return x


def call(base: str, method: str, path: str, body=None, raw: bool = False, timeout: float = 120.0) -> dict:
    """One request; returns ``{"request", "status", "headers", "body"}`` (``body`` as text when not JSON)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, text = r.status, r.headers, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, e.headers, e.read().decode("utf-8", "replace")
    try:
        parsed = text if raw else json.loads(text)
    except ValueError:
        parsed = text
    return {"request": {"method": method, "path": path, "body": body if not isinstance(body, bytes) else repr(body)},
            "status": status, "headers": {k: hdrs.get(k) for k in HEADERS if hdrs.get(k)}, "body": parsed}


def llama_server_probes(ids: list[int], text: str) -> list[tuple[str, str, str, object, bool]]:
    """(name, method, path, body, raw) for llama-server."""
    g = {"temperature": 0, "cache_prompt": False}
    return [
        ("health", "GET", "/health", None, False),
        ("props", "GET", "/props", None, False),
        ("models", "GET", "/v1/models", None, False),
        ("tokenize", "POST", "/tokenize", {"content": text}, False),
        ("tokenize_add_special", "POST", "/tokenize", {"content": text, "add_special": True}, False),
        ("tokenize_pieces", "POST", "/tokenize", {"content": text, "with_pieces": True}, False),
        ("tokenize_parse_special_false", "POST", "/tokenize", {"content": "<bos>" + text, "parse_special": False}, False),
        ("detokenize", "POST", "/detokenize", {"tokens": ids}, False),
        ("apply_template", "POST", "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}, False),
        ("completion_ids_nprobs", "POST", "/completion",
         {"prompt": ids, "n_predict": 3, "n_probs": 3, "return_tokens": True, **g}, False),
        ("completion_post_sampling", "POST", "/completion",
         {"prompt": ids, "n_predict": 2, "n_probs": 3, "post_sampling_probs": True, **g}, False),
        ("completion_text", "POST", "/completion", {"prompt": text, "n_predict": 2, **g}, False),
        ("completion_stop", "POST", "/completion", {"prompt": ids, "n_predict": 8, "stop": ["t"], **g}, False),
        ("completion_stream", "POST", "/completion",
         {"prompt": ids, "n_predict": 2, "n_probs": 2, "stream": True, "return_tokens": True, **g}, True),
        ("completion_bad_id", "POST", "/completion", {"prompt": [2, 10 ** 7], "n_predict": 1, **g}, False),
        ("v1_completions", "POST", "/v1/completions",
         {"prompt": ids, "max_tokens": 3, "logprobs": 3, "temperature": 0}, False),
        ("v1_completions_echo", "POST", "/v1/completions",
         {"prompt": ids, "max_tokens": 1, "logprobs": 3, "echo": True, "temperature": 0}, False),
        ("v1_completions_stream", "POST", "/v1/completions",
         {"prompt": ids, "max_tokens": 2, "logprobs": 2, "stream": True, "temperature": 0}, True),
        ("v1_chat", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
          "temperature": 0}, False),
        ("malformed_json", "POST", "/completion", b"{not json", False),
        ("unknown_path", "GET", "/nope", None, False),
    ]


def lcp_probes(ids: list[int], text: str) -> list[tuple[str, str, str, object, bool]]:
    """(name, method, path, body, raw) for llama-cpp-python's server."""
    g = {"temperature": 0, "repeat_penalty": 1.0}
    return [
        ("health", "GET", "/health", None, False),
        ("props", "GET", "/props", None, False),
        ("models", "GET", "/v1/models", None, False),
        ("openapi_paths", "GET", "/openapi.json", None, False),
        ("tokenize", "POST", "/extras/tokenize", {"input": text}, False),
        ("tokenize_empty", "POST", "/extras/tokenize", {"input": ""}, False),
        ("tokenize_count", "POST", "/extras/tokenize/count", {"input": text}, False),
        ("detokenize", "POST", "/extras/detokenize", {"tokens": ids}, False),
        ("v1_completions_ids", "POST", "/v1/completions", {"prompt": ids, "max_tokens": 3, "logprobs": 3, **g}, False),
        ("v1_completions", "POST", "/v1/completions", {"prompt": text, "max_tokens": 3, "logprobs": 3, **g}, False),
        ("v1_completions_echo", "POST", "/v1/completions",
         {"prompt": text, "max_tokens": 1, "logprobs": 3, "echo": True, **g}, False),
        ("v1_completions_stop", "POST", "/v1/completions", {"prompt": text, "max_tokens": 8, "stop": ["t"], **g}, False),
        ("v1_completions_stream", "POST", "/v1/completions",
         {"prompt": text, "max_tokens": 2, "logprobs": 2, "stream": True, **g}, True),
        ("v1_chat", "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
          **g}, False),
        ("malformed_json", "POST", "/v1/completions", b"{not json", False),
        ("unknown_path", "GET", "/nope", None, False),
    ]


def greedy(base: str, kind: str, ids: list[int], n: int, top: int = 5, cache: bool = False) -> tuple[list, list]:
    """One greedy continuation: (tokens, per reported step the top ``top`` [key, logprob]); keys are ids
    (llama-server) or token texts (llama-cpp-python, which has no per-request cache switch)."""
    if kind == "llama-server":
        r = servers.post_json(base + "/completion", {"prompt": ids, "n_predict": n, "n_probs": top, "temperature": 0,
                                                    "return_tokens": True, "cache_prompt": cache, "ignore_eos": True})
        return r["tokens"], [[[c["id"], c["logprob"]] for c in s["top_logprobs"]]
                             for s in r.get("completion_probabilities", [])]
    r = servers.post_json(base + "/v1/completions", {"prompt": ids, "max_tokens": n, "logprobs": top, "temperature": 0,
                                                     "repeat_penalty": 1.0})  # ids: a text here (no id prompts)
    lp = r["choices"][0]["logprobs"]
    return lp["tokens"], [sorted(d.items(), key=lambda kv: -kv[1]) for d in lp["top_logprobs"]]


def determinism(base: str, kind: str, prompts: list, n: int) -> dict:
    """Each prompt alone (in turn), then all at once from 16 threads; compare streams and top-5 log-probs."""
    alone = [greedy(base, kind, p, n) for p in prompts]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda p: greedy(base, kind, p, n), prompts))
    wall = time.perf_counter() - t0
    again = [greedy(base, kind, p, n) for p in prompts]
    cached = [greedy(base, kind, p, n, cache=True) for p in prompts] if kind == "llama-server" else None

    def compare(xs, ys) -> dict:
        """Counts over the prompts; log-prob differences only on steps before the streams part (same context), and
        for each parting the top-1 margin there (alone) and whether vLLM's rule (harness.core.metrics) still passes."""
        from gemma4_harness.harness.core.metrics import greedy_agreement

        diffs, partings = [], []
        for a, b in zip(xs, ys):
            stop = next((i for i, (u, v) in enumerate(zip(a[0], b[0])) if u != v), len(a[0]))
            if kind == "llama-server" and len(a[1]) != len(a[0]):
                stop = 0 if stop < len(a[0]) else len(a[1])  # steps not all reported: compare only identical streams
            diffs += [abs(x[1] - y[1]) for sa, sb in list(zip(a[1], b[1]))[:stop] for x, y in zip(sa, sb) if x[0] == y[0]]
            if kind == "llama-server" and stop < len(a[0]) and len(a[1]) == len(a[0]):
                ga = greedy_agreement(a[0], b[0], [[c[0] for c in s] for s in a[1]], [[c[0] for c in s] for s in b[1]])
                partings.append({"step": stop, "alone_top1_margin": round(a[1][stop][0][1] - a[1][stop][1][1], 4),
                                 "vllm_rule_agrees": ga.agree})
        return {"same_tokens": sum(a[0] == b[0] for a, b in zip(xs, ys)),
                "bit_identical_top5": sum(a[1] == b[1] for a, b in zip(xs, ys)),
                "max_abs_logprob_diff_same_context": max(diffs) if diffs else None, "partings": partings}

    return {"prompts": len(prompts), "new_tokens": n,
            "reported_steps": f"{sum(len(a[1]) for a in alone)}/{sum(len(a[0]) for a in alone)}",
            "alone_vs_together": compare(alone, together), "alone_vs_alone_again": compare(alone, again),
            "alone_vs_prompt_cache_on": compare(alone, cached) if cached else None,
            "concurrent_wall_s": round(wall, 2)}


def run(kind: str, model: Path, label: str, out: Path, ids: list[int] | None, text: str,
        det_prompts: list | None, det_tokens: int = 16) -> None:
    """Start one server on one model, run its probes and the determinism check, write ``<out>/<kind>-<label>.json``."""
    log = out / f"{kind}-{label}.log"
    proc = (servers.llama_server_process(model, log) if kind == "llama-server"
            else servers.llama_cpp_python_process(model, log))
    with proc as srv:
        base = srv.url
        if ids is None:  # real model: the server's own tokenization of the text, BOS included
            tok = (servers.post_json(base + "/tokenize", {"content": text, "add_special": True}) if kind == "llama-server"
                   else servers.post_json(base + "/extras/tokenize", {"input": text}))
            ids = tok["tokens"]
        probes = llama_server_probes(ids, text) if kind == "llama-server" else lcp_probes(ids, text)
        res = {"server": kind, "model": str(model), "prompt_ids": ids, "probes": {}}
        for name, method, path, body, raw in probes:
            res["probes"][name] = cut(call(base, method, path, body, raw))
        if det_prompts is not None:
            if kind == "llama-server" and isinstance(det_prompts[0], str):  # ids: the server's tokenization, BOS added
                det_prompts = [servers.post_json(base + "/tokenize", {"content": t, "add_special": True})["tokens"]
                               for t in det_prompts]
            res["determinism"] = determinism(base, kind, det_prompts, det_tokens)
        (out / f"{kind}-{label}.json").write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
        print(f"{kind} {label}: {len(res['probes'])} probes; determinism {res.get('determinism')}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", choices=("llama-server", "llama-cpp-python"))
    ap.add_argument("--model", choices=("synth", "gemma3"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.harness.core.prompts import load_prompts
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    synth_model = synth.ensure_built(MODELS_DIR / f"{servers.SYNTH_CASE}.toml").gguf["F32"]
    prompts = sorted((p["prompt_ids"] for p in load_prompts()), key=len)
    det = [prompts[-1][: 4 + 3 * i] for i in range(16)]  # 16 prompts of 4..49 tokens, one shared prefix
    for kind in ("llama-server", "llama-cpp-python"):
        if args.only and kind != args.only:
            continue
        texts = [" ".join(f"t{300 + 7 * j % 200}" for j in range(i + 2)) for i in range(16)]  # text prompts
        if args.model != "gemma3":
            run(kind, synth_model, "synth", args.out, prompts[1], "t300 t301 hello",
                det if kind == "llama-server" else texts)
        if args.model == "synth":
            continue
        g3_texts = [" ".join(["The capital of France is"] * (1 + i % 4)) + f" {i}" for i in range(16)]
        run(kind, gemma3_270m_gguf(), "gemma3", args.out, None, "The capital of France is", g3_texts, 8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
