"""What explaining a divergence costs on each built-in case, against the parity run itself (issue 27's figures).

    python tests/explain_timing.py [--case e2b ...] [--out timing.json]

For each built-in text case (its F32 GGUF) it runs ``g4h parity --model GGUF --against ENGINE`` once per engine,
the engines being tests/cmd_stub.py as the unmodified reference, under one variant that applies to the case (a
disagreement where one does), under a pair, and with noise on one weight (no variant explains it: the whole search,
singles and pairs, within the default budget). It prints, per case and engine, the parity run's seconds (the pair's
figures on the 8 synthetic prompts, the reference against itself, the explanation included) and the explanation's
own, and the built-in parity run's seconds of the case when this machine kept them (``parity-case-seconds.json``).
The load is printed (other jobs share the CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout

from gemma4_harness.harness.core.cases import builtin_specs  # noqa: E402
from gemma4_harness.harness.core.paths import cache_root  # noqa: E402
from gemma4_harness.harness.engines.reference import ReferenceEngine  # noqa: E402
from gemma4_harness.harness.engines.variants import family  # noqa: E402
from gemma4_harness.harness.parity.job import run as run_parity  # noqa: E402
from gemma4_harness.harness.synth import ensure_built  # noqa: E402

STUB = Path(__file__).resolve().parent / "cmd_stub.py"


def _cmd(*args: str) -> str:
    return "cmd:'" + " ".join([sys.executable, str(STUB), *args]) + "'"


def engines_for(cfg) -> list[tuple[str, str]]:
    """(label, engine) per engine: the reference, one variant (a disagreement first), a pair, an unknown fault."""
    applies = [v for v in family("text") if v.why_not(cfg) is None]
    single = next(v for v in applies if v.kind == "disagreement") if any(v.kind == "disagreement" for v in applies) \
        else applies[0]
    other = next(v for v in applies if v.group != single.group and v.kind == "fault")
    return [("reference", _cmd()), (single.name, _cmd("--spec", single.name)),
            (f"{single.name} + {other.name}", _cmd("--spec", f"{single.name},{other.name}")),
            ("noise on blk.1.ffn_down", _cmd("--perturb-layer", "1"))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    kept = {}
    try:
        kept = json.loads((cache_root() / "parity-case-seconds.json").read_text())
    except (OSError, ValueError):
        pass
    rows = []
    for spec in builtin_specs():
        if a.case and spec.stem not in a.case:
            continue
        gguf = ensure_built(spec).gguf["F32"]
        for label, engine in engines_for(ReferenceEngine(gguf).cfg):
            t0 = time.perf_counter()
            data, _ = run_parity(models=[str(gguf)], against=[engine], quiet=True, out=os.environ.get("TMPDIR", "/tmp"))
            wall = time.perf_counter() - t0
            e = next((c["explanation"] for c in data["cases"][0]["checks"] if "explanation" in c), None)
            rows.append({"case": spec.stem, "engine": label, "explain_s": e["seconds"] if e else 0.0,
                         "tried": f"{e['singles_tried']}+{e['pairs_tried']}" if e else "",
                         "answer": e["line"][:90] if e else "passes: nothing to explain",
                         "job_s": round(wall, 1), "builtin_case_s": kept.get(spec.stem)})
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'case':24s} {'engine':44s} {'explain s':>9s} {'tried':>6s} {'parity s':>8s} {'case s':>7s}  answer")
    for r in rows:
        print(f"{r['case']:24s} {r['engine']:44s} {r['explain_s']:9.2f} {r['tried']:>6s} {r['job_s']:8.1f} "
              f"{r['builtin_case_s'] or '':>7}  {r['answer']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"load": load, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
