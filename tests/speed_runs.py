"""Issue 25's figures in one script: time to a verdict (``g4h parity --model``) per phase, and the CPU decode
table (``g4h bench``: fast, llama.cpp portable, llama.cpp native).

Not part of the test suite (tens of minutes, gigabytes); run it by hand on an idle machine::

    python tests/speed_runs.py --work /work/big                       # both parts
    python tests/speed_runs.py --work /work/big --part verdict --before /tmp/g4h-before
    python tests/speed_runs.py --work /work/big --part bench

``--part verdict``: ``g4h parity --model M --against llamacpp`` (reference oracle, then ``--oracle fast``) on the
E2B-shape Q8_0 file (``g4h synth --shape e2b --format q8_0``, written into ``--work`` when missing), then the same
job on the 31B and 26B-A4B shapes cut to 8 layers. Each run is a fresh process (``python -m gemma4_harness.harness.cli``) with
``OMP_NUM_THREADS`` = ``--threads``, sampled from outside every 0.1 s: per phase (a phase starts at each progress
line of the job, or at the first call of an oracle or engine function the child marks: :data:`MARKS`) the wall
time, the CPU time of the whole process tree (llama.cpp's workers included) and the peak resident memory of the
tree (``VmRSS``, which counts the mapped model file's pages, and ``RssAnon``, the private memory).
``--before DIR`` runs the same jobs on another source tree too (``git archive <commit> | tar -x -C DIR``),
for a before/after table; ``--verdict-runs`` picks runs (``<shape>[-<layers>]-<ref|fast>``: ``e2b-ref``,
``e2b-4-ref`` on the E2B shape cut to 4 layers when the file is written; llama.cpp cannot cut a file with
``--layers``).

``--part bench``: one ``g4h bench`` run per model with ``--engines fast,llamacpp,llamacpp-native`` (repetitions
interleaved), tg32 at batch 1 and 8, 1 and 2 threads: the E2B shape cut to 4 layers in Q8_0 and in Q4_K_M (written
into ``--work``; the Q4_K_M one by the cached ``llama-quantize`` from an f16 file) and the real Gemma 3 270M
Q4_K_M. The roofline shares come from the bench's own bandwidth probe.

The load average is printed at the start and the end of every run: figures taken on a loaded machine are not
the machine's. Output: one JSON object per run on stdout, then the tables (markdown) on stderr and in
``--work/speed-runs.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Functions the child marks as phases when first entered (module, attribute path, phase name); absent ones
#: are skipped, so the same marks serve an older tree.
MARKS = (
    ("gemma4_harness.harness.parity.checks.reference_runs", "ReferenceRuns.logits", "oracle logits"),
    ("gemma4_harness.harness.parity.checks.reference_runs", "ReferenceRuns.generations", "oracle greedy"),
    ("gemma4_harness.harness.parity.checks.reference_runs", "ReferenceRuns.prefetch", "oracle, all checks in one pass"),
    ("gemma4_harness.harness.parity.cases", "cached_vs_uncached", "reference cached~uncached"),
    ("gemma4_harness.harness.engines.llamacpp", "LlamaCppEngine.logits_many", "llamacpp logits + trace"),
    ("gemma4_harness.harness.engines.llamacpp", "LlamaCppEngine.generate_full", "llamacpp greedy"),
)
PHASE_TAG = "g4h-phase: "


# --------------------------------------------------------------------------- child: the job with phase marks


def child(tree: str, argv: list[str]) -> int:
    """Run ``g4h`` from ``tree`` with :data:`MARKS` installed (prints ``g4h-phase: NAME`` on stderr)."""
    sys.path.insert(0, tree)
    import importlib

    current = [None]

    def wrap(fn, name):
        def inner(*a, **k):
            if current[0] != name:
                current[0] = name
                print(PHASE_TAG + name, file=sys.stderr, flush=True)
            return fn(*a, **k)
        return inner

    for mod, attr, name in MARKS:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        owner, _, fn_name = attr.rpartition(".")
        obj = getattr(m, owner, None) if owner else m
        if obj is not None and hasattr(obj, fn_name):
            setattr(obj, fn_name, wrap(getattr(obj, fn_name), name))
    from gemma4_harness.harness.cli import main

    return int(main(argv) or 0)


# --------------------------------------------------------------------------- parent: sampling a process tree


def _tree(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _cpu_rss(pid: int) -> tuple[float, int, int]:
    """CPU seconds, VmRSS and RssAnon (private memory, without the mapped model file's page cache) of a process."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        status = {ln.split(":")[0]: ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ln.startswith(("VmRSS:", "RssAnon:"))}
        return cpu, int(status["VmRSS"]) * 1024, int(status.get("RssAnon", 0)) * 1024
    except (OSError, IndexError, ValueError, KeyError):
        return -1.0, 0, 0


class TreeSampler:
    """CPU seconds (every process of the tree, the exited ones at their last sample) and resident memory of a
    process tree, every ``interval`` seconds; :meth:`mark` closes a phase."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval = pid, interval
        self.cpu: dict[int, float] = {}
        self.phases: list[dict[str, Any]] = []
        self._peak = self._peak_anon = 0
        self._name = "start"
        self._t0 = self._tp = time.perf_counter()
        self._cpu0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        rss = anon = 0
        for p in _tree(self.pid):
            c, r, a = _cpu_rss(p)
            if c >= 0:
                self.cpu[p] = max(self.cpu.get(p, 0.0), c)
                rss, anon = rss + r, anon + a
        with self._lock:
            self._peak, self._peak_anon = max(self._peak, rss), max(self._peak_anon, anon)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "TreeSampler":
        self.sample()
        self._thread.start()
        return self

    def mark(self, name: str) -> None:
        self.sample()
        now, cpu = time.perf_counter(), sum(self.cpu.values())
        with self._lock:
            self.phases.append({"phase": self._name, "wall_s": round(now - self._tp, 2),
                                "cpu_s": round(cpu - self._cpu0, 2), "peak_rss_gb": round(self._peak / 1e9, 2),
                                "peak_anon_gb": round(self._peak_anon / 1e9, 2)})
            self._name, self._tp, self._cpu0, self._peak, self._peak_anon = name, now, cpu, 0, 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.mark("end")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_g4h(label: str, tree: Path, argv: list[str], threads: int, timeout: float | None = None) -> dict[str, Any]:
    """``g4h ARGV`` from ``tree`` in a fresh process, phases sampled (see the module docstring); stopped (its whole
    process group) after ``timeout`` seconds, the phases so far kept."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(tree), "--", *argv]
    start_load = load()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    sampler = TreeSampler(proc.pid).start()
    timer = None
    if timeout:
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
        timer.start()
    lines = []
    for line in proc.stderr:
        line = line.rstrip()
        lines.append(line)
        if line.startswith(PHASE_TAG):
            sampler.mark(line[len(PHASE_TAG):])
        elif line.startswith("g4h parity: ") or line.startswith("[bench] "):
            sampler.mark(line.split(": ", 1)[1] if line.startswith("g4h") else line[8:])
    out = proc.stdout.read()
    proc.wait()
    if timer is not None:
        timer.cancel()
    sampler.stop()
    phases = [p for p in sampler.phases if p["wall_s"] > 0.05 or p["phase"] == "end"]
    stopped = timeout is not None and proc.returncode == -9
    res = {"run": label, "tree": str(tree), "command": "g4h " + " ".join(argv), "exit": proc.returncode,
           "stopped_after_s": timeout if stopped else None,
           "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(sum(sampler.cpu.values()), 1),
           "peak_rss_gb": max((p["peak_rss_gb"] for p in sampler.phases), default=0.0),
           "peak_anon_gb": max((p["peak_anon_gb"] for p in sampler.phases), default=0.0),
           "load_start": start_load, "load_end": load(), "threads": threads, "phases": phases,
           "stdout_tail": out.strip().splitlines()[-3:], "stderr_tail": [ln for ln in lines if ln][-2:]}
    print(json.dumps(res), flush=True)
    return res


# --------------------------------------------------------------------------- the runs


def ensure_file(work: Path, shape: str, layers: int | None, fmt: str = "q8_0") -> Path:
    """The shape's GGUF in ``work`` (written once, with ``g4h synth``'s writer)."""
    path = work / (f"{shape}-q8_0.gguf" if layers is None else f"{shape}-l{layers}-{fmt}.gguf")
    if not path.exists():
        from gemma4_harness.harness.synth.scale import write_scale_gguf

        t = time.perf_counter()
        write_scale_gguf(shape, path, layers=layers, fmt=fmt)
        print(json.dumps({"wrote": str(path), "bytes": path.stat().st_size,
                          "seconds": round(time.perf_counter() - t, 1)}), flush=True)
    return path


def ensure_q4_k_m(work: Path, shape: str, layers: int) -> Path:
    """The shape cut to ``layers`` in Q4_K_M: the f16 file from ``g4h synth``'s writer, quantized by the cached
    ``llama-quantize`` (built beside ``llama-server`` on first use), as a user makes one."""
    path = work / f"{shape}-l{layers}-q4_k_m.gguf"
    if not path.exists():
        from gemma4_harness.harness.engines.llamacpp.tools import ensure_tools

        f16 = ensure_file(work, shape, layers, fmt="f16")
        t = time.perf_counter()
        subprocess.run([str(ensure_tools().quantize), str(f16), str(path), "Q4_K_M"], check=True,
                       capture_output=True)
        print(json.dumps({"wrote": str(path), "bytes": path.stat().st_size,
                          "seconds": round(time.perf_counter() - t, 1)}), flush=True)
    return path


def verdict_runs(names: list[str], work: Path, trees: list[Path], threads: int,
                 before: set[str] | None = None, timeout: float | None = None) -> list[dict[str, Any]]:
    """The parity runs ``names`` on each tree (the first, an older tree, only for the runs in ``before``)."""
    out = []
    for name in names:
        shape_part, _, kind = name.rpartition("-")  # e2b / 31b-8 / 26b-a4b-8; ref | fast
        head, _, last = shape_part.rpartition("-")
        shape, layers = (head, int(last)) if last.isdigit() else (shape_part, None)
        model = ensure_file(work, shape, layers)
        argv = ["parity", "--model", str(model), "--against", "llamacpp", "--out", str(work / "reports")]
        if kind == "fast":
            argv += ["--oracle", "fast"]
        for i, tree in enumerate(trees):
            if i < len(trees) - 1 and before is not None and name not in before:
                continue
            out.append(run_g4h(name, tree, argv, threads, timeout))
    return out


def bench_runs(work: Path, tree: Path, reps: int) -> list[dict[str, Any]]:
    out = []
    sys.path.insert(0, str(tree))
    e2b4, e2b4k = ensure_file(work, "e2b", 4), ensure_q4_k_m(work, "e2b", 4)
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    for model in (e2b4, e2b4k, gemma3_270m_gguf()):
        for threads in (1, 2):
            argv = ["bench", "--model", str(model), "--engines", "fast,llamacpp,llamacpp-native", "--pp", "0",
                    "--tg", "32", "--batch", "1,8", "--reps", str(reps), "--threads", str(threads),
                    "--out", str(work / "reports")]
            res = run_g4h(f"bench {Path(model).name} t{threads}", tree, argv, threads)
            report = next((ln.split("report: ", 1)[1] for ln in res["stdout_tail"] if ln.startswith("report: ")),
                          None)
            if report:
                data = json.loads((Path(report).parent / "results.json").read_text())
                res["rows"] = [{k: r.get(k) for k in ("engine", "dtype", "batch", "mean_tok_s", "std_tok_s",
                                                      "roofline_share", "bytes_per_token")} for r in data["rows"]]
                res["bandwidth_gbs"] = round(data["read_bandwidth_gbs"], 1) if data.get("read_bandwidth_gbs") else None
                res["ratios"] = data.get("ratios")
                res["load_avg"] = data.get("machine", {}).get("load_avg")
            out.append(res)
    return out


def tables(verdict: list[dict[str, Any]], bench: list[dict[str, Any]]) -> str:
    lines = []
    if verdict:
        lines += ["| run | tree | phase | wall s | CPU s | peak RSS GB | peak anon GB |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in verdict:
            for p in r["phases"]:
                lines.append(f"| {r['run']} | {Path(r['tree']).name} | {p['phase'][:60]} | {p['wall_s']} | "
                             f"{p['cpu_s']} | {p['peak_rss_gb']} | {p.get('peak_anon_gb', '')} |")
            lines.append(f"| **{r['run']}** | {Path(r['tree']).name} | **total** (exit {r['exit']}, load "
                         f"{r['load_start'][0]} -> {r['load_end'][0]}"
                         + (f", stopped after {r['stopped_after_s']:.0f} s" if r.get("stopped_after_s") else "")
                         + f") | **{r['wall_s']}** | {r['cpu_s']} | "
                         f"{r['peak_rss_gb']} | {r.get('peak_anon_gb', '')} |")
    for r in bench:
        lines += ["", f"{r['run']}: load {r.get('load_avg')}, read bandwidth {r.get('bandwidth_gbs')} GB/s", "",
                  "| engine | batch | t/s | ± | roofline |", "|---|---:|---:|---:|---:|"]
        for row in r.get("rows", []):
            share = row["roofline_share"]
            lines.append(f"| {row['engine']}-{row['dtype']} | {row['batch']} | {row['mean_tok_s'] or 0:.1f} | "
                         f"{row['std_tok_s'] or 0:.1f} | {'' if share is None else f'{100 * share:.0f} %'} |")
        lines += [f"- {k}: {v:.2f}" for k, v in (r.get("ratios") or {}).items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/work/big", help="folder for the model files and reports")
    ap.add_argument("--part", choices=("verdict", "bench", "all"), default="all")
    ap.add_argument("--verdict-runs", default="e2b-ref,e2b-fast,31b-8-ref,31b-8-fast,26b-a4b-8-ref,26b-a4b-8-fast",
                    help="comma list: <shape>[-<layers>]-<ref|fast>, 31b-8-ref = the 31B shape cut to 8 layers")
    ap.add_argument("--before", default=None, help="another source tree to run verdict jobs on too")
    ap.add_argument("--before-runs", default="e2b-ref,e2b-fast",
                    help="the verdict runs repeated on --before (the old path of the reference takes long)")
    ap.add_argument("--trees", choices=("both", "before", "after"), default="both",
                    help="with --before: run the verdict jobs on both trees, or only one")
    ap.add_argument("--timeout", type=float, default=None, help="stop a verdict run after this many seconds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="bench repetitions (interleaved)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    trees = ([Path(args.before)] if args.before and args.trees != "after" else []) + \
        ([ROOT] if not args.before or args.trees != "before" else [])
    before = set(args.before_runs.split(",")) if args.trees == "both" else None
    verdict = verdict_runs(args.verdict_runs.split(","), work, trees, args.threads, before, args.timeout) \
        if args.part in ("verdict", "all") else []
    bench = bench_runs(work, ROOT, args.reps) if args.part in ("bench", "all") else []
    text = tables(verdict, bench)
    print(text, file=sys.stderr)
    (work / "speed-runs.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
