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

from harness.core.workers import worker_env

#: Runs ``g4h parity`` in-process; argv: stop step, model, out folder.
_CHILD = r"""
import sys, time
import harness.core.io as io
import harness.parity.job as parity
import harness.parity.report as report
from harness.cli import main

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
