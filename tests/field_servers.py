"""llama-server and llama-cpp-python's server, started with their defaults as users start them, against the
reference: ``g4h parity --model M --against openai:URL`` on the six odd shapes of ``tests/shapes/`` and on every
built-in GGUF case llama.cpp runs, with a table of each gate's worst value against its limit (the figures of
``docs/server-dialects.md``, "Default settings").

    python tests/field_servers.py [--server llama-server|llama-cpp-python ...] [--model NAME ...] [--out DIR]
                                  [--quick] [-- g4h parity options]

Servers run on 127.0.0.1 with nothing but the model, the host and the port on their command line (llama-server:
``-m M``; llama-cpp-python: ``--model M``), in a minimal environment (tests/servers.py). llama-server gets the
built-in prompt set (``cases/prompts/synthetic.jsonl`` within the vocabulary); llama-cpp-python, which takes text
prompts only, the texts of :data:`TEXTS` (``field_prompts``). ``--quick``
keeps the numeric checks (greedy, log-probs, prompt log-probs) and skips batch invariance, streaming and stop.
Exit status: 0 when every run exited 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from servers import ServerProcess, child_env  # noqa: E402

SHAPES = sorted((ROOT / "tests" / "shapes").glob("*.toml"))
BUILTIN = ["26b-a4b", "31b", "e2b", "e4b", "e4b-wide", "edge-no-softcap"]
"""The built-in GGUF cases llama.cpp runs (edge-keqv-shared-donor aborts it at load: docs/server-dialects.md), and
``gemma3-270m``, the real Gemma 3 270M GGUF (Q4_K_M: its quantized activations emulated)."""

TEXTS = ("Hi", "The cat sat down.", "A window of sixteen tokens", "Rain fell on the quiet town all night.",
         "Seven ships sailed past the old stone harbour before the storm came in from the west.",
         "Numbers: 3, 14, 15, 92, 65; letters: a, b, c.")
"""Text prompts for llama-cpp-python, which takes text only: on the synthetic vocabularies (4 specials, 256 byte
tokens, ``▁tN`` fillers that no text tokenizes to) ASCII text becomes byte tokens, 3 to 90 of them (lengths below,
around and past the sliding windows of 4 to 16), and survives the server's detokenize/tokenize round trip."""

QUICK = ["--skip", "server-batch", "--skip", "server-stream", "--skip", "server-stop"]


def field_prompts() -> list[dict]:
    """:data:`TEXTS` as a prompt file's lines."""
    return [{"id": f"text{i}", "text": t} for i, t in enumerate(TEXTS)]


def server(kind: str, gguf: Path, log: Path) -> ServerProcess:
    """A server of ``kind`` on ``gguf`` with its defaults (host and port aside)."""
    if kind == "llama-server":
        from gemma4_harness.harness.engines.llamacpp.build import ensure_built

        return ServerProcess(kind, [str(ensure_built().server), "-m", str(gguf)],
                             lambda h, p: ["--host", h, "--port", str(p)], "/health", log, env=child_env())
    return ServerProcess(kind, [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf)],
                         lambda h, p: ["--host", h, "--port", str(p)], "/v1/models", log, env=child_env())


def summary(results: dict) -> dict:
    """Per gate: the worst measured value, the limit it was judged at, the effect of the declared approximations
    there, and whether every figure passed (informational ones marked)."""
    out: dict[str, dict] = {}
    for c in results["cases"][0]["checks"]:
        g = c["gate"]
        m = float(c["measured"])  # results.json writes NaN as "NaN"
        row = out.setdefault(g, {"worst": None, "limit": c["limit"], "effect": None, "pass": True, "info": False})
        row["info"] = row["info"] or bool(c.get("informational"))
        row["pass"] = row["pass"] and (c["pass"] or bool(c.get("informational")))
        if m == m and (row["worst"] is None or (m > row["worst"] if c["op"] == "le" else m < row["worst"])):
            row.update(worst=m, limit=float(c["limit"]), effect=c.get("effect"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", choices=("llama-server", "llama-cpp-python"), default=None)
    p.add_argument("--model", action="append", default=None, help="a shape or built-in case name (default: all)")
    p.add_argument("--out", default="reports/field-servers")
    p.add_argument("--quick", action="store_true")
    p.add_argument("extra", nargs="*", help="more g4h parity options (after --)")
    a = p.parse_args(argv)
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    models = [(s.stem, s) for s in SHAPES] + [(n, MODELS_DIR / f"{n}.toml") for n in BUILTIN]
    models.append(("gemma3-270m", None))
    if a.model:
        models = [m for m in models if m[0] in a.model]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, status = [], 0
    for name, spec in models:
        if spec is None:
            from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

            gguf = gemma3_270m_gguf()
        else:
            gguf = synth.ensure_built(spec).gguf["F32"]
        for kind in a.server or ("llama-server", "llama-cpp-python"):
            args = [] if kind == "llama-server" else ["--prompts", str(out / "texts.jsonl")]
            if kind != "llama-server":
                (out / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in field_prompts()))
            run_dir = out / f"{name}-{kind}"
            t0 = time.monotonic()
            with server(kind, gguf, out / f"{name}-{kind}.log") as srv:
                cmd = [sys.executable, "-m", "gemma4_harness.harness.cli", "parity", "--model", str(gguf), "--against",
                       f"openai:{srv.url}/v1", "--out", str(run_dir), "--quiet", *args, *(QUICK if a.quick else []),
                       *a.extra]
                rc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).returncode
            secs = time.monotonic() - t0
            status |= rc != 0
            res = sorted(run_dir.glob("*-parity*"))[-1] / "results.json"
            data = json.loads(res.read_text())
            rows.append((name, kind, rc, round(secs), summary(data), data["verdict"]))
            print(f"{name:22s} {kind:17s} exit {rc} {secs:5.0f} s  {data['verdict'][:100]}", flush=True)
    (out / "summary.json").write_text(json.dumps([{"model": m, "server": k, "exit": rc, "seconds": s, "gates": g,
                                                   "verdict": v} for m, k, rc, s, g, v in rows], indent=1))
    print()
    print(table(rows))
    return status


def _cell(g: dict | None) -> str:
    if not g or g["worst"] is None:
        return "-" if not g else "n/a"
    eff = f", effect {g['effect']:.2g}" if g.get("effect") else ""
    tag = " (info)" if g["info"] else ("" if g["pass"] else " FAIL")
    return f"{g['worst']:.2g} / {g['limit']:.2g}{eff}{tag}"


def table(rows: list) -> str:
    """The markdown table of the closing note: per model and server, the exit status and the worst value against its
    limit of the gates that the declared numerics set."""
    head = ("| model | server | exit | greedy | max_abs_logprob: worst / limit | prompt_logprobs: worst / limit | "
            "others failing |\n|---|---|---:|---|---|---|---|")
    lines = [head]
    for name, kind, rc, _, g, _ in rows:
        greedy = g.get("reference~openai.greedy", {})
        gr = f"{greedy.get('worst', float('nan')):.3g}" if greedy.get("worst") is not None else "-"
        others = [k for k, v in g.items() if not v["pass"] and k not in ("reference~openai.max_abs_logprob",
                                                                        "server.prompt_logprobs")]
        lines.append(f"| {name} | {kind} | {rc} | {gr} | {_cell(g.get('reference~openai.max_abs_logprob'))} | "
                     f"{_cell(g.get('server.prompt_logprobs'))} | {', '.join(others) or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
