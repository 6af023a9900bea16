"""Long prompts: time and peak memory of one forward, split into sliding and full layers.

Not a test (the suite's bounded-attention checks are in ``tests/test_long_prompt.py``); a measuring script::

    python tests/longprompt.py --engine reference fast --tokens 2048 8192 32768 --out /tmp/longprompt.jsonl

Each (engine, length) runs in a fresh process (so its peak memory is its own): the synthetic case
(``cases/models/<case>.toml``, default ``e2b``: window 16, 8 sliding and 2 full layers) from its F32 GGUF,
its context raised to the prompt's length, and one forward of a random prompt (token 2, then ids drawn
from [4, 256) with seed 0): the reference's ``forward`` (float64) or ``FastModel.logits`` (CPU, float32,
one-shot prefill), after a 64-token warm-up forward. Printed and appended to ``--out`` as one JSON line each:

* ``seconds``: the forward (weights loaded before the clock starts);
* ``layer_s`` / ``attention_s``: seconds inside the decoder layers, and inside their attention op alone,
  by layer type (``sliding`` / ``full``), from wrappers around ``decoder_layer`` and ``attention``
  (reference) or ``FastModel.decoder_layer`` and ``FastModel.attend`` (fast);
* ``peak_rss_gb``: the process's peak resident set (``VmHWM``, weights and the mapped file included);
  ``peak_rss_anon_gb``: the largest private resident memory (``RssAnon``) seen, sampled every 10 ms;
* ``finite``: every logit finite.

At the end, a table and the growth of each time from one length to the next against the growth of T
(linear: the same ratio; quadratic: its square).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class _AnonPeak:
    """The largest ``RssAnon`` of this process, sampled by a thread every ``every_s`` seconds."""

    def __init__(self, every_s: float = 0.01):
        self.peak_kb, self.every_s, self._stop = 0, every_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, _status_kb("RssAnon"))
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, _status_kb("RssAnon"))


def _timed(fn, totals: dict, kind_of):
    """``fn`` wrapped: the seconds of each call are added to ``totals[kind_of(*args)]``."""
    def wrapped(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[kind_of(*args, **kwargs)] += time.perf_counter() - t
    return wrapped


def _kind(layer) -> str:
    return "sliding" if layer.is_sliding else "full"


def measure_one(engine: str, n_tokens: int, case: str, threads: int) -> dict:
    """One forward of ``n_tokens`` through ``engine`` on ``case``, in this process (see the module docstring)."""
    import numpy as np

    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.reference import load_model

    built = synth.ensure_built(MODELS_DIR / f"{case}.toml")
    cfg, W = load_model(built.gguf["F32"])
    cfg = dataclasses.replace(cfg, context_length=max(cfg.context_length, n_tokens + 8))
    ids = [2] + [int(i) for i in np.random.default_rng(0).integers(4, 256, n_tokens - 1)]
    layer_s: dict[str, float] = defaultdict(float)
    attention_s: dict[str, float] = defaultdict(float)
    if engine == "reference":
        import gemma4_harness.reference.model as rm

        rm.decoder_layer = _timed(rm.decoder_layer, layer_s, lambda cfg, layer, *a, **k: _kind(layer))
        rm.attention = _timed(rm.attention, attention_s,
                              lambda q, k, v, qp, kp, window, *a, **kw: "full" if window is None else "sliding")

        def run(ids):
            return rm.forward(cfg, W, ids)
    else:
        import torch

        from gemma4_harness.fast.model import FastModel

        torch.set_num_threads(threads)
        FastModel.decoder_layer = _timed(FastModel.decoder_layer, layer_s, lambda self, layer, *a, **k: _kind(layer))
        FastModel.attend = _timed(FastModel.attend, attention_s, lambda self, layer, *a, **k: _kind(layer))
        model = FastModel(cfg, W, "cpu", "float32")

        def run(ids):
            return model.logits(ids).numpy()
    run(ids[:64])  # a short forward first: one-time costs (kernel setup, first allocations) stay off the clock
    layer_s.clear()
    attention_s.clear()
    with _AnonPeak() as anon:
        t = time.perf_counter()
        out = run(ids)
        seconds = time.perf_counter() - t
    return {"engine": engine, "case": case, "T": n_tokens, "threads": threads, "seconds": round(seconds, 2),
            "layer_s": {k: round(v, 2) for k, v in sorted(layer_s.items())},
            "attention_s": {k: round(v, 2) for k, v in sorted(attention_s.items())},
            "layers": {k: sum(_kind(x) == k for x in cfg.layers) for k in ("sliding", "full")},
            "peak_rss_gb": round(_status_kb("VmHWM") / 2**20, 3), "peak_rss_anon_gb": round(anon.peak_kb / 2**20, 3),
            "finite": bool(np.isfinite(out).all())}


def growth_table(rows: list[dict]) -> str:
    """Markdown: per engine, each length's times, and each time's growth over the previous length."""
    lines = ["| engine | T | total s | sliding layers s | full layers s | sliding attn s | full attn s | "
             "peak RSS GB | peak RssAnon GB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['T']} | {r['seconds']} | {r['layer_s'].get('sliding', 0)} | "
                     f"{r['layer_s'].get('full', 0)} | {r['attention_s'].get('sliding', 0)} | "
                     f"{r['attention_s'].get('full', 0)} | {r['peak_rss_gb']} | {r['peak_rss_anon_gb']} |")
    lines += ["", "| engine | T -> T' | T'/T | total | sliding layers | full layers | sliding attn | full attn |",
              "|---|---|---|---|---|---|---|---|"]
    by_engine: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_engine[r["engine"]].append(r)

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.1f}x" if a else "-"
    for engine, rs in by_engine.items():
        rs.sort(key=lambda r: r["T"])
        for a, b in zip(rs, rs[1:]):
            lines.append(f"| {engine} | {a['T']} -> {b['T']} | {b['T'] / a['T']:.0f}x | "
                         f"{ratio(a['seconds'], b['seconds'])} | "
                         + " | ".join(ratio(a[f].get(k, 0), b[f].get(k, 0))
                                      for f, k in (("layer_s", "sliding"), ("layer_s", "full"),
                                                   ("attention_s", "sliding"), ("attention_s", "full"))) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", nargs="+", default=["reference", "fast"], choices=["reference", "fast"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--case", default="e2b")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the fast engine")
    ap.add_argument("--out", default=None, help="append each result as a JSON line here")
    ap.add_argument("--one", action="store_true", help="(internal) measure one engine and length in this process")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.engine[0], args.tokens[0], args.case, args.threads)), flush=True)
        return 0
    rows = []
    for engine in args.engine:
        for n in args.tokens:
            proc = subprocess.run([sys.executable, __file__, "--one", "--engine", engine, "--tokens", str(n),
                                   "--case", args.case, "--threads", str(args.threads)],
                                  capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(growth_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
