"""A ``g4h parity`` killed at any moment leaves no run directory or a complete one, and nothing hidden.

The run executes in a child process whose writers are wrapped (test instrumentation, in the child only):
before each step of the run's end it prints the step's name and, at the step the test asked for, waits to
be killed with SIGKILL (no handler, ``finally`` or ``atexit`` runs). The steps, in order: the computation,
``results.json``, ``report.md``, the rename of the staged directory into place, just after that rename,
and after the command returned.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_workers import wait_until

from gemma4_harness.harness.core.workers import worker_env

#: Runs ``g4h parity`` in-process; argv: stop step, model, out folder.
_CHILD = r"""
import sys, time
import gemma4_harness.harness.core.io as io
import gemma4_harness.harness.parity.job as parity
import gemma4_harness.harness.parity.report as report
from gemma4_harness.harness.cli import main

stop, model, out = sys.argv[1:4]

def step(name):
    print(name, flush=True)
    if name == stop:
        time.sleep(600)  # killed here

def before(name_of, fn):
    def wrapped(*a, **k):
        step(name_of(*a))
        return fn(*a, **k)
    return wrapped

def after(name, fn):
    def wrapped(*a, **k):
        out = fn(*a, **k)
        step(name)
        return out
    return wrapped

parity.user_case = before(lambda *a: "compute", parity.user_case)
report.write_json_atomic = before(lambda path, *a: "write " + path.name, report.write_json_atomic)
report.write_text_atomic = before(lambda path, *a: "write " + path.name, report.write_text_atomic)
report.write_bytes_atomic = before(lambda path, *a: "write " + path.name, report.write_bytes_atomic)
io._rename_no_replace = after("renamed", before(lambda *a: "rename", io._rename_no_replace))
rc = main(["parity", "--model", model, "--out", out, "--skip", "llamacpp", "--quiet"])
step("done")
"""

STEPS = ("compute", "write results.json", "write report.md", "rename", "renamed", "done")


def run_dirs_state(out: Path) -> tuple[list[str], list[str]]:
    """(visible run directories, hidden or stray entries) under ``out``."""
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    runs = [n for n in entries if re.fullmatch(r"\d{8}-\d{6}-parity(-\d+)?", n)]
    return runs, [n for n in entries if n not in runs]


def assert_complete(run: Path) -> None:
    """results.json parses, report.md is there, and every file report.md links exists."""
    data = json.loads((run / "results.json").read_text())
    assert data["kind"] == "parity" and data["cases"]
    report = (run / "report.md").read_text()
    for link in re.findall(r"\]\(([^)]+)\)", report):
        assert (run / link).is_file(), f"report.md links {link}, which is missing"


@pytest.mark.slow
@pytest.mark.parametrize("stop", STEPS)
def test_parity_killed_at_each_step_leaves_nothing_or_a_whole_run(tiny_gguf, tmp_path, stop):
    out, tmp = tmp_path / "runs", tmp_path / "tmp"
    tmp.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, stop, str(tiny_gguf), str(out)],
                             stdout=subprocess.PIPE, text=True, env=dict(worker_env(), TMPDIR=str(tmp)))
    seen = []
    for line in child.stdout:
        seen.append(line.strip())
        if seen[-1] == stop:
            break
    assert seen[-1:] == [stop], f"the run never reached {stop!r}: {seen}"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    complete = STEPS.index(stop) >= STEPS.index("renamed")
    assert wait_until(lambda: run_dirs_state(out)[1] == []), f"left behind: {run_dirs_state(out)[1]}"
    runs, _ = run_dirs_state(out)
    assert len(runs) == (1 if complete else 0), f"killed at {stop!r}: run directories {runs}"
    if complete:
        assert_complete(out / runs[0])
    assert [p.name for p in tmp.iterdir() if p.name.startswith("g4h")] == []  # none of our temporary folders


# --------------------------------------------------------------------------- nothing survives a killed parity run

#: Seconds after a SIGKILL within which every process of the run must be gone: the watchdog gives multiprocessing's
#: resource tracker workers.REMOVE_RETRY_S (5 s) to end on its own before it kills it.
SURVIVOR_WAIT_S = 12.0

KILL_DELAYS_S = (0.0, 0.3, 0.7, 1.2, 2.0, 3.0, 4.5, 6.0, 8.0, 11.0)
"""The ten moments of the kill test: seconds after the first case worker of ``g4h parity --jobs 2`` appears (the
parent's own start-up before that takes 2 to 45 s depending on the machine's load): while the workers start,
import torch, load their models, compute, and around the end of the run."""


def processes_with(token: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment holds ``G4H_KILL_PROBE=token`` (every process the run
    started inherits it: case workers, the resource tracker, watchdogs, engines)."""
    needle = f"G4H_KILL_PROBE={token}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return out


def kill_and_count(models: list[Path], out: Path, delay: float, wait: float = SURVIVOR_WAIT_S) -> dict:
    """Start ``g4h parity --model M... --against fast --jobs 2``, SIGKILL it ``delay`` seconds after its first case
    worker appears, and count the processes of the run still alive ``wait`` seconds later (and how many there were
    at the kill)."""
    import time
    import uuid

    token = uuid.uuid4().hex
    env = dict(worker_env(), G4H_KILL_PROBE=token)
    argv = [sys.executable, "-m", "gemma4_harness.harness.cli", "parity", *[a for m in models for a in ("--model", str(m))],
            "--against", "fast", "--jobs", "2", "--quiet", "--out", str(out)]
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spawned = wait_until(lambda: child.poll() is not None or any(
        "spawn_main" in cmd for _, cmd in processes_with(token)), 300)
    assert spawned and child.poll() is None, "the run ended (or never started a case worker) before the kill"
    time.sleep(delay)
    ended = child.poll() is not None
    at_kill = processes_with(token)
    child.kill()  # SIGKILL; a no-op when the run has already ended and been reaped
    child.wait()
    t0 = time.monotonic()
    wait_until(lambda: not processes_with(token), wait)
    gone_s = time.monotonic() - t0
    left = processes_with(token)
    return {"delay_s": delay, "ended_before_kill": ended, "processes_at_kill": len(at_kill),
            "workers_at_kill": sum("spawn_main" in c for _, c in at_kill),
            "tracker_at_kill": any("resource_tracker" in c for _, c in at_kill),
            "all_gone_after_s": None if left else round(gone_s, 2), "survivors": len(left),
            "left": [c[:120] for _, c in left]}


@pytest.mark.parametrize("delay", [0.5, 3.0])
def test_killed_parity_with_workers_leaves_no_process(tmp_path, delay):
    """``g4h parity --jobs 2`` killed while its spawned case workers import, load or compute: within
    SURVIVOR_WAIT_S nothing of it is left (no case worker, no resource tracker, no watchdog); before the process
    policy a worker went on computing for 20 s and the tracker lived on. The ten moments: the slow variant and
    ``python tests/test_parity_kill.py``."""
    from conftest import write_tiny_gguf

    models = [write_tiny_gguf(tmp_path / f"m{i}.gguf") for i in range(3)]
    r = kill_and_count(models, tmp_path / "runs", delay)
    assert r["survivors"] == 0, r


@pytest.mark.slow
@pytest.mark.parametrize("delay", KILL_DELAYS_S)
def test_killed_parity_at_ten_moments_leaves_no_process(tmp_path, delay):
    from conftest import write_tiny_gguf

    models = [write_tiny_gguf(tmp_path / f"m{i}.gguf") for i in range(3)]
    r = kill_and_count(models, tmp_path / "runs", delay)
    assert r["survivors"] == 0, r


if __name__ == "__main__":  # the kill test's table: python tests/test_parity_kill.py
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import write_tiny_gguf

    with tempfile.TemporaryDirectory() as tmp:
        models = [write_tiny_gguf(Path(tmp) / f"m{i}.gguf") for i in range(3)]
        rows = [kill_and_count(models, Path(tmp) / "runs", d) for d in KILL_DELAYS_S]
    print("| delay after the first worker, s | processes at the kill (workers, tracker) | all gone after, s | "
          f"survivors after {SURVIVOR_WAIT_S:g} s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['delay_s']:g} | {r['processes_at_kill']} ({r['workers_at_kill']}, "
              f"{'yes' if r['tracker_at_kill'] else 'no'}) | {r['all_gone_after_s']} | {r['survivors']} |")
    print(json.dumps(rows, indent=1))
    sys.exit(1 if any(r["survivors"] for r in rows) else 0)
