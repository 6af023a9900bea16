"""Issue 35's field table: servers as users start them, on correct and faulty files, and the prompt-file forms, each
judged by ``g4h parity``; a Markdown row per run (command, exit status against the expected one, the verdict line,
the explanation line of a failing pair, seconds). A measurement script, not a test (not collected by pytest).

    python tests/field_table.py [--out DIR] [--only ID ...] [--list]

Servers: ``llama-server`` and ``llama-cpp-python`` with their defaults (field_servers.py ``server``: nothing but the
model, host and port), ``llama-server-strict`` (tests/servers.py ``llama_server_cmd(f32=True)``: the settings of
docs/server-dialects.md's observations, an F32 KV cache and flash attention off, declared with ``F32_DECLARE``) and
``transformers-serve`` (the generic OpenAI dialect, offline). A faulty run serves a copy made by
tests/quant_faults.py ``make_fault`` (or eos_model.py ``perturbed_hf``) while ``--model`` names the correct file,
as tests/test_quantized_servers.py does. Server checks that take minutes (batch, stream, stop) are skipped, as
field_servers.py ``--quick`` does. Each row is appended to ``DIR/rows.jsonl`` as it ends (a partial run keeps its
rows); the table is printed at the end. Exit status: 0 when every run exited as expected.
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

from field_servers import QUICK, TEXTS, server  # noqa: E402
from servers import F32_DECLARE, ServerProcess, child_env, llama_server_cmd, transformers_serve_process  # noqa: E402

FFN = "blk.1.ffn_down.weight"
#: (id, server, model, qtype, fault, prompts, expected exit). model: a case/shape name, "gemma3" (the real Gemma 3 270M
#: Q4_K_M GGUF), or "eos" (tests/eos_model.py);
#: fault: None, "rows"/"block"/"swap" (quant_faults.make_fault on FFN), "hf" (eos_model.perturbed_hf), "copy" (the
#: correct file copied out of the cache, for both sides);
#: prompts: "texts" (field_servers.TEXTS), "default" (the case library's set), or a prompt-file form of FORMS.
PLAN = [
    ("c1", "llama-server", "odd-h72-v300", "F32", None, "default", 0),
    ("c2", "llama-cpp-python", "odd-h72-v300", "F32", None, "texts", 0),
    ("c3", "llama-server-strict", "odd-h72-v300", "F32", None, "default", 0),
    ("c4", "llama-server", "odd-h88-v515-gqa", "F32", None, "default", 0),
    ("c5", "llama-cpp-python", "odd-h100-v389-ple", "F32", None, "texts", 0),
    ("c6", "llama-server", "e2b", "Q8_0", None, "texts", 0),
    ("c7", "llama-cpp-python", "e2b", "Q8_0", None, "texts", 0),
    ("c8", "llama-server", "e2b", "Q4_0", None, "texts", 0),
    ("c9", "llama-server-strict", "e2b", "Q8_0", None, "texts", 0),
    ("f1", "llama-server", "odd-h72-v300", "F32", "rows", "default", 1),
    ("f2", "llama-cpp-python", "odd-h72-v300", "F32", "rows", "texts", 1),
    ("f3", "llama-server-strict", "odd-h72-v300", "F32", "rows", "default", 1),
    ("f4", "llama-server", "e2b", "Q8_0", "rows", "texts", 1),
    ("f5", "llama-cpp-python", "e2b", "Q8_0", "rows", "texts", 1),
    ("f6", "llama-server", "e2b", "Q4_0", "block", "texts", 1),
    ("f7", "llama-server", "e2b", "Q8_0", "swap", "texts", 1),
    # a known disagreement: llama.cpp's final softcap of 30 on a model that states none (docs/spec-variants.md)
    # the case's [gates] declare llama.cpp's default final softcap of 30 (informational there): these pass
    ("k1", "llama-server", "edge-no-softcap", "F32", None, "texts", 0),
    ("k2", "llama-cpp-python", "edge-no-softcap", "F32", None, "texts", 0),
    # the same file copied out of the case library (its [gates] declare the difference there): must be explained
    ("k3", "llama-server", "edge-no-softcap", "F32", "copy", "texts", 1),
    ("k4", "llama-cpp-python", "edge-no-softcap", "F32", "copy", "texts", 1),
    ("e1", "llama-server", "eos", "F32", None, "eos", 0),
    ("e2", "llama-cpp-python", "eos", "F32", None, "eos", 0),
    ("e3", "transformers-serve", "eos", "hf", None, "eos-hf", 0),
    ("e4", "transformers-serve", "eos", "hf", "hf", "eos-hf", 1),
    ("p1", "llama-server", "eos", "F32", None, "forms", 0),
    ("p2", "llama-server", "eos", "F32", None, "oov", 2),
    ("p3", "llama-server", "eos", "F32", None, "too-long", 2),
    ("p4", "llama-server", "eos", "F32", None, "no-room", 2),
    ("p5", "llama-server", "eos", "F32", None, "bos-text", 0),
    ("g1", "llama-server", "gemma3", "Q4_K_M", None, "texts", 0),
    ("g2", "llama-server", "gemma3", "Q4_K_M", "rows", "texts", 1),
    ("p6", "llama-server", "eos", "F32", None, "ids-int-note", 0),
    ("p7", "llama-server", "eos", "F32", None, "neither", 2),
    # fits the model (4096) but not the server's n_ctx (2048): bad input wanted; on 0d57ab4 exit 1 ENGINE FAILED
    ("p8", "llama-cpp-python", "eos", "F32", None, "server-ctx", 2),
]

EOS_TEXTS = ("hello world", "The cat sat", "a b c d", "Once upon", "1 2 3", "what is it")
"""tests/test_server_eos.py's GGUF texts (some reach EOS within 8 greedy tokens, some do not)."""


def forms(kind: str) -> list[dict]:
    """A prompt file's lines: ``forms`` every documented form (docs/usage.md "Prompts": text, ids, with and without
    ``id``, special-token text); the others one bad line each among good ones (the 31b case: vocabulary 512,
    context 4096)."""
    good = [{"id": "t", "text": "hello world"}, {"text": "The cat sat"}, {"id": "ids", "prompt_ids": [2, 40, 41, 42]},
            {"prompt_ids": [2, 100, 101]}]
    return {"forms": good + [{"id": "special", "text": "a<eos>b"}],
            "oov": good + [{"id": "oov", "prompt_ids": [2, 40, 99999]}],
            "too-long": good + [{"id": "long", "prompt_ids": [2] + [40] * 4099}],
            "no-room": good + [{"id": "noroom", "prompt_ids": [2] + [40] * 4091}],
            "bos-text": good + [{"id": "bos", "text": "<bos>hello world"}],
            "ids-int-note": [{"id": 7, "prompt_ids": [2, 40, 41], "note": "an integer id and a note"}, {},
                             {"text": "The cat sat", "note": "no id: its line number"}],
            "neither": good + [{"id": "neither", "prompt": "hello"}],
            # fits the model's context (4096) and not llama-cpp-python's default n_ctx (2048): text only there
            "server-ctx": [{"id": "t", "text": "hello world"}, {"id": "long", "text": "ab " * 600}]}[kind]


def prompt_file(kind: str, out: Path) -> Path | None:
    rows = ([{"id": f"text{i}", "text": t} for i, t in enumerate(TEXTS)] if kind == "texts" else
            [{"id": f"eos{i}", "text": t} for i, t in enumerate(EOS_TEXTS)] if kind == "eos" else
            [{"id": f"hf{i}", "text": t} for i, t in enumerate(("hello world", "The cat sat", "zzz", "1 2 3", "ok",
                                                                 "Once upon"))] if kind == "eos-hf" else
            None if kind == "default" else forms(kind))
    if rows is None:
        return None
    f = out / f"prompts-{kind}.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" if r else "\n" for r in rows))  # {}: a blank line
    return f


def files(model: str, qtype: str, fault: str | None, out: Path) -> tuple[Path, Path]:
    """(the file the server gets, the file ``--model`` names)."""
    if model == "eos":
        from eos_model import eos_case, perturbed_hf

        gguf, hf = eos_case(out / "eos-model")
        correct = hf if qtype == "hf" else gguf
        return (perturbed_hf(hf, out / "eos-hf-perturbed") if fault == "hf" else correct), correct
    from gemma4_harness.harness.core.cases import resolve_spec
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf
    from gemma4_harness.harness.synth import ensure_built

    shape = ROOT / "tests" / "shapes" / f"{model}.toml"
    correct = (gemma3_270m_gguf() if model == "gemma3" else
               Path(ensure_built(shape if shape.is_file() else resolve_spec(model)).gguf[qtype]))
    if fault is None:
        return correct, correct
    if fault == "copy":  # both sides read the copy
        import shutil

        dst = out / f"copy-{correct.name}"
        shutil.copyfile(correct, dst)
        return dst, dst
    from quant_faults import make_fault

    return make_fault(fault, correct, out / f"{model}-{qtype}-{fault}.gguf", FFN)[0], correct


def start(kind: str, served: Path, log: Path) -> tuple[ServerProcess, list[str]]:
    """The server and the ``g4h parity`` options that declare its settings."""
    if kind == "llama-server-strict":
        from gemma4_harness.harness.engines.llamacpp.build import ensure_built

        cmd = llama_server_cmd(ensure_built().server, served, f32=True)
        return ServerProcess(kind, cmd, lambda h, p: ["--host", h, "--port", str(p)], "/health", log,
                             env=child_env()), F32_DECLARE
    if kind == "transformers-serve":
        return transformers_serve_process(served, log), []
    return server(kind, served, log), []


def run(row: tuple, out: Path) -> dict:
    rid, kind, model, qtype, fault, prompts, want = row
    served, correct = files(model, qtype, fault, out)
    pf = prompt_file(prompts, out)
    args = ["--model", str(correct), *(["--prompts", str(pf)] if pf else []), *QUICK]
    t0 = time.monotonic()
    srv, declare = start(kind, served, out / f"{rid}-{kind}.log")
    with srv:
        run_dir = out / rid
        cmd = [sys.executable, "-m", "gemma4_harness.harness.cli", "parity", *args, *declare, "--against",
               f"openai:{srv.url}/v1", "--out", str(run_dir), "--quiet"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    secs = time.monotonic() - t0
    found = sorted(run_dir.glob("*/results.json"))
    data = json.loads(found[-1].read_text()) if found else {}
    expl = [f"{c['gate'].rsplit('.', 1)[0]}: {c['explanation']['line']}" for case in data.get("cases", [])
            for c in case["checks"] if isinstance(c.get("explanation"), dict) and c["explanation"].get("line")]
    failing = sorted({c["gate"] for case in data.get("cases", []) for c in case["checks"]
                      if not c["pass"] and not c.get("informational")})
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    verdict = data.get("verdict") or (lines[-1] if lines else "")
    traceback = "Traceback" in p.stderr
    return {"id": rid, "server": kind, "model": f"{model} {qtype}", "fault": fault or "-", "prompts": prompts,
            "want": want, "exit": p.returncode, "seconds": round(secs), "verdict": verdict, "failing": failing,
            "explanation": expl, "traceback": traceback, "stderr_tail": lines[-3:],
            "command": " ".join(["g4h parity", *[a.replace(str(out), "$OUT").replace(str(Path.home()), "~")
                                                 for a in args + declare], "--against openai:URL"])}


def table(rows: list[dict]) -> str:
    head = ("| id | server | model | fault | prompts | exit (want) | verdict | failing gates / explanation | s |\n"
            "|---|---|---|---|---|---|---|---|---:|")
    out = [head]
    for r in rows:
        ok = "" if r["exit"] == r["want"] else " **!**"
        why = "; ".join(r["failing"][:4]) + (" — " + " / ".join(r["explanation"]) if r["explanation"] else "")
        out.append(f"| {r['id']} | {r['server']} | {r['model']} | {r['fault']} | {r['prompts']} | "
                   f"{r['exit']} ({r['want']}){ok} | {r['verdict'].replace('|', '/')} | {why.replace('|', '/')} | "
                   f"{r['seconds']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/field-table")
    p.add_argument("--only", action="append", default=None, help="a row id of PLAN (repeatable)")
    p.add_argument("--list", action="store_true", help="print the plan and stop")
    a = p.parse_args(argv)
    plan = [r for r in PLAN if not a.only or r[0] in a.only]
    if a.list:
        print("\n".join(" ".join(map(str, r)) for r in plan))
        return 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in plan:
        r = run(row, out)
        rows.append(r)
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{r['id']:4s} {r['server']:20s} {r['model']:24s} {r['fault']:6s} exit {r['exit']} (want {r['want']}) "
              f"{r['seconds']:4d} s  {r['verdict'][:140]}", flush=True)
    print()
    print(table(rows))
    return int(any(r["exit"] != r["want"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
