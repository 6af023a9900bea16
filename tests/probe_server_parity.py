"""``g4h parity --against openai:URL`` on every built-in case, one real ``llama-server`` per case.

    python tests/probe_server_parity.py --out /tmp/server-parity            # every case in cases/models/
    python tests/probe_server_parity.py --out DIR --case 31b --threads 1    # one case, one thread

For each case: build it (:func:`harness.synth.ensure_built`), start ``llama-server --parallel 4`` on its F32 GGUF
with the harness's Gemma 4 chat template (``cases/tokenizer/gemma4_chat_template.jinja``: the synthetic GGUFs carry
no template, and llama-server's ChatML fallback is not Gemma's format), run ``g4h parity --model GGUF --against
openai:<url>/v1`` into ``DIR``, stop the server. A server that does not come up (llama.cpp aborts on a layout) is
that case's engine failure, named with llama.cpp's own assert line, and the run goes on with the next case.
Writes ``DIR/summary.json`` and prints one line per case; exit 0 when every case that llama.cpp can run passed.
Not a test (pytest does not collect it): tests/test_server_parity.py runs the same loop.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import servers  # noqa: E402  (after the sys.path lines)

from gemma4_harness.harness import synth  # noqa: E402
from gemma4_harness.harness.cli import main as g4h  # noqa: E402
from gemma4_harness.harness.core.cases import builtin_specs  # noqa: E402
from gemma4_harness.harness.core.paths import CASES_DIR  # noqa: E402

TEMPLATE = CASES_DIR / "tokenizer" / "gemma4_chat_template.jinja"


def abort_line(log: Path) -> str:
    """llama.cpp's own reason from a server log: its ``GGML_ASSERT`` / ``error`` line, else the last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    hit = next((ln for ln in lines if re.search(r"GGML_ASSERT|GGML_ABORT|terminate called|error:", ln)), None)
    return re.sub(r"\S*/([^/\s]+:\d+:)", r"\1", hit or (lines[-1] if lines else "no output"))[:300]


def run_case(spec: Path, out: Path, threads: int, extra_args: list[str]) -> dict:
    """One case: server up, ``g4h parity`` against it, server down. Returns the summary row."""
    built = synth.ensure_built(spec)
    gguf = built.gguf["F32"]
    log = out / f"{spec.stem}-llama-server.log"
    proc = servers.llama_server_process(gguf, log, threads=threads,
                                        extra=["--jinja", "--chat-template-file", str(TEMPLATE)])
    row: dict = {"case": spec.stem, "model": str(gguf)}
    try:
        proc.start()
    except RuntimeError:
        row.update(status="engine failure", exit=None, why=f"llama-server did not start: {abort_line(log)}")
        return row
    try:
        t0 = time.monotonic()
        rc = g4h(["parity", "--model", str(gguf), "--against", f"openai:{proc.url}/v1", "--out", str(out), "--quiet",
                  *extra_args])
        row.update(exit=rc, seconds=round(time.monotonic() - t0, 1))
    finally:
        proc.stop()
    runs = sorted(out.glob("*-parity"), key=lambda p: p.stat().st_mtime)
    data = json.loads((runs[-1] / "results.json").read_text()) if runs else {}
    case = (data.get("cases") or [{}])[0]
    checks = {c["gate"]: c for c in case.get("checks", [])}
    runs_fig = checks.get("reference~openai.runs", {})
    batch = checks.get("server.batched~alone.greedy", {})
    row.update(status={0: "pass", 1: "fail", 2: "error"}.get(rc, str(rc)), report=str(runs[-1]) if runs else None,
               server=runs_fig.get("engine"), error=case.get("error") or (None if runs_fig.get("measured") else
                                                                           runs_fig.get("got")),
               failing=[g for g, c in checks.items() if not c["pass"] and not c.get("informational")],
               figures={g: c["measured"] for g, c in checks.items() if not g.startswith("reference~reference")},
               batch={k: batch.get(k) for k in ("requests", "identical", "by_top_n", "near_ties", "bit_identical",
                                                "max_in_flight", "wall_s")})
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the loop; exit 0 when every case llama.cpp can run passed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the reports, server logs and summary.json")
    ap.add_argument("--case", action="append", default=None, help="only this built-in case (repeatable)")
    ap.add_argument("--threads", type=int, default=servers.THREADS, help="llama-server --threads")
    ap.add_argument("parity_args", nargs="*", help="more g4h parity options, after --")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [s for s in builtin_specs() if not args.case or s.stem in args.case]
    rows = []
    for spec in specs:
        row = run_case(spec, out, args.threads, args.parity_args)
        rows.append(row)
        print(f"{row['case']:24s} {row['status']:15s} {row.get('why') or row.get('error') or ''}", flush=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["status"] in ("pass", "engine failure") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
