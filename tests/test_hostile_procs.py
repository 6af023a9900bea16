"""Issue 37, item 2: one process policy for everything the harness starts. An engine started through a shell
wrapper that forks grandchildren runs in a process group of its own; the group dies when the engine is closed,
and when the harness is killed with SIGKILL at any moment (the watchdog of :mod:`harness.core.workers` kills it).

Every process of a trial carries a marker in its environment (inherited by the engine, the wrapper's children,
the watchdog): after the trial, the processes still carrying it are counted (zombies excluded)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts processes through /proc")

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "cmd_stub.py"

WRAPPER = """#!/bin/sh
# an engine's launcher script: children that do not exit when stdin closes, a subshell that forks more
sleep 1000 &
( while :; do sleep 1; done ) &
sh -c 'sleep 1000 & sleep 1000' &
"$G4H_PY" "$G4H_STUB" --linger
"""

HARNESS = """
import os, sys
sys.path.insert(0, {root!r})
from gemma4_harness.harness.engines import make_engine
e = make_engine({spec!r}, {model!r})
print("ready", flush=True)
for _ in range({n}):
    e.logits([2, 5, 6, 7])
e.close()
print("closed", flush=True)
"""


def _marked(mark: str) -> list[int]:
    """Processes (not zombies) whose environment holds ``mark``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if mark.encode() not in (d / "environ").read_bytes():
                continue
            if "\nState:\tZ" in (d / "status").read_text():
                continue
        except OSError:
            continue
        out.append(int(d.name))
    return out


def _settle(mark: str, wait_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _trial(tmp_path: Path, model: Path, kill_after: float | None, n: int) -> tuple[int, int, str]:
    """Run a harness process with the wrapped engine; SIGKILL it ``kill_after`` seconds in (None: let it close the
    engine and exit). Returns (marked processes seen while it ran, survivors, its stdout)."""
    wrapper = tmp_path / "engine.sh"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    mark = f"G4H_KILL_MARK={uuid.uuid4().hex}"
    env = {**os.environ, "G4H_PY": sys.executable, "G4H_STUB": str(STUB), mark.split("=")[0]: mark.split("=")[1]}
    code = HARNESS.format(root=str(ROOT), spec="cmd:" + shlex.quote(str(wrapper)), model=str(model), n=n)
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    seen = 0
    if kill_after is None:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "closed" in out, err
    else:
        deadline = time.monotonic() + kill_after
        while time.monotonic() < deadline and p.poll() is None:
            seen = max(seen, len(_marked(mark)))
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate()
    survivors = _settle(mark)
    for pid in survivors:  # leave nothing behind for the other tests, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    return seen, len(survivors), out


def test_the_engine_group_dies_on_close(tiny_gguf, tmp_path):
    _, survivors, _ = _trial(tmp_path, tiny_gguf, None, 3)
    assert survivors == 0


# Ten moments: while the harness imports, while the wrapper starts its children, during hello, during requests.
MOMENTS = (0.2, 0.5, 0.8, 1.2, 1.6, 2.0, 2.5, 3.0, 4.0, 6.0)


def test_the_engine_group_dies_with_a_killed_harness(tiny_gguf, tmp_path):
    results = []
    for t in MOMENTS:
        seen, survivors, out = _trial(tmp_path, tiny_gguf, t, 10 ** 6)
        results.append((t, seen, "ready" in out, survivors))
    print("kill at s, marked processes seen, engine ready, survivors:", results)
    assert all(r[3] == 0 for r in results), results
    assert any(r[2] and r[1] >= 5 for r in results), results  # some kills came with the wrapper's tree running
