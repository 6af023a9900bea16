"""Real-size runs: wall time and peak memory of engines on GGUFs made by the scale fixture.

Not part of the test suite (minutes and gigabytes); run by hand, one at a time on a shared machine::

    python tests/scale_runs.py --work /tmp/g4h-scale            # every run below
    python tests/scale_runs.py --work /tmp/g4h-scale --only e2b-ref,e2b-flat

Each run is ``g4h logits`` in a fresh process (``python -m gemma4_harness.harness.cli``), sampled from outside by
:class:`harness.core.memory_machine.PeakMemory` every 20 ms: wall time, peak ``VmRSS`` and peak ``RssAnon``
(private memory, without the page cache of the mapped model file). The files are written with
:func:`harness.synth.scale.write_scale_gguf` into ``--work`` and removed at the end (``--keep`` keeps
them). Output: one JSON object per run on stdout.

Runs:

* ``e2b-ref``: E2B shape, 35 layers, Q8_0, 16-token prompt, the reference (default ``--ref-cache-gb 2``).
* ``e2b-fast``: the same file, fast fp32 with ``--weights dequantized`` under ``RLIMIT_AS``
  ``--fast-limit-gb`` (default 16: the memory plan stops it with one line, which is the result), and
  with ``--layers 4``, compared with the reference's ``--layers 4`` logits.
* ``e2b-flat``: the reference on ``--layers 4``, ``8``, ``16`` and ``35`` of the same file.
* ``31b-ref``: 31B shape cut to 4 layers (``--layers 4`` at writing), Q8_0, the reference.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gemma4_harness.harness.core.memory_machine import PeakMemory  # noqa: E402
from gemma4_harness.harness.synth.scale import write_scale_gguf  # noqa: E402

PROMPT = [2] + [(7919 * i) % 262000 + 100 for i in range(1, 16)]  # 16 tokens


def ensure(path: Path, shape: str, layers: int | None) -> Path:
    """Write the shape's Q8_0 file unless it is there; report the time."""
    if not path.exists():
        t = time.perf_counter()
        write_scale_gguf(shape, path, layers=layers, fmt="q8_0")
        print(json.dumps({"wrote": str(path), "bytes": path.stat().st_size,
                          "seconds": round(time.perf_counter() - t, 1)}), flush=True)
    return path


def run_logits(label: str, model: Path, engine: str, work: Path, *extra: str, limit_gb: float | None = None) -> dict:
    """One ``g4h logits`` in a fresh process, sampled from outside; ``limit_gb``: its ``RLIMIT_AS``."""
    ids = work / "prompt.json"
    ids.write_text(json.dumps(PROMPT))
    out = work / f"{label}.npy"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "gemma4_harness.harness.cli", "logits", "--model", str(model), "--engine", engine,
           "--prompt-ids", str(ids), "--out", str(out), *extra]
    def limit() -> None:
        if limit_gb is not None:
            n = int(limit_gb * 1e9)
            resource.setrlimit(resource.RLIMIT_AS, (n, n))

    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    with PeakMemory(proc.pid, interval=0.02) as pm:
        _, err = proc.communicate()
    res = {"run": label, "command": "g4h " + " ".join(cmd[3:]).replace(str(work) + "/", ""), "exit": proc.returncode,
           **pm.as_dict(), **({"RLIMIT_AS_gb": limit_gb} if limit_gb else {})}
    if proc.returncode:
        res["stderr"] = err.strip().splitlines()[-1] if err.strip() else ""
    else:
        logits = np.load(out)
        res.update(finite=bool(np.isfinite(logits).all()), std_min=round(float(logits.std(axis=1).min()), 3),
                   distinct_argmax=len(set(logits.argmax(axis=1).tolist())))
    print(json.dumps(res), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/g4h-scale", help="folder for the files (not the repository)")
    ap.add_argument("--only", default="e2b-ref,e2b-fast,e2b-flat,31b-ref", help="comma-separated runs")
    ap.add_argument("--keep", action="store_true", help="keep the written files")
    ap.add_argument("--fast-limit-gb", type=float, default=16.0,
                    help="RLIMIT_AS of the full-size fast fp32 run (~19 GB of weights: on a shared machine the "
                         "plan should stop it rather than take the memory; 0 = no limit)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    try:
        if only & {"e2b-ref", "e2b-fast", "e2b-flat"}:
            e2b = ensure(work / "e2b-q8_0.gguf", "e2b", None)
        if "e2b-ref" in only:
            run_logits("e2b-ref", e2b, "reference", work)
        if "e2b-fast" in only:
            run_logits("e2b-fast", e2b, "fast", work, "--device", "cpu", "--dtype", "float32",
                       "--weights", "dequantized", limit_gb=args.fast_limit_gb or None)
            a = run_logits("e2b-fast-l4", e2b, "fast", work, "--device", "cpu", "--dtype", "float32",
                           "--weights", "dequantized", "--layers", "4")
            b = run_logits("e2b-ref-l4", e2b, "reference", work, "--layers", "4")
            if a["exit"] == 0 and b["exit"] == 0:
                d = np.abs(np.load(work / "e2b-fast-l4.npy") - np.load(work / "e2b-ref-l4.npy")).max()
                print(json.dumps({"run": "e2b fast fp32 vs reference, --layers 4", "max_abs_dlogit": float(d)}))
        if "e2b-flat" in only:
            peaks = {}
            for n in (4, 8, 16, 35):
                r = run_logits(f"e2b-ref-l{n}", e2b, "reference", work, "--layers", str(n))
                peaks[n] = r["peak_anon_gb"]
            print(json.dumps({"run": "e2b reference peak RssAnon by layers", "peak_anon_gb": peaks,
                              "largest_over_smallest": round(max(peaks.values()) / min(peaks.values()), 3)}))
        if "31b-ref" in only:
            big = ensure(work / "31b-l4-q8_0.gguf", "31b", 4)
            run_logits("31b-l4-ref", big, "reference", work)
    finally:
        if not args.keep:
            for f in work.glob("*.gguf"):
                f.unlink()
            for f in work.glob("*.npy"):
                f.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
