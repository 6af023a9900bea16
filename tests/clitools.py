"""Helpers for tests that run ``g4h`` in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, extra_path: Path | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    """``python -m gemma4_harness.harness.cli ARGS`` from the repo root (text mode, output captured)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in (extra_path, REPO_ROOT) if p] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *names: str, rc: int = 2) -> str:
    """Exit ``rc`` (2: bad input; 1 with ``g4h: engine failed:``: an engine failure), exactly one non-empty stderr
    line, no traceback, and the line names one of ``names``."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    detail = f"rc={proc.returncode}\n--- stderr ---\n{proc.stderr}\n--- stdout ---\n{proc.stdout}"
    assert "Traceback" not in proc.stderr, detail
    assert proc.returncode == rc, detail
    assert len(lines) == 1, detail
    assert any(n in lines[0] for n in names), f"the error line names none of {names!r}: {lines[0]!r}"
    return lines[0]
