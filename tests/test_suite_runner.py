"""The suite's own runner: ``nox -s tests`` runs pytest-xdist with ``noxfile.XDIST``; a worker that dies (a native
library's abort, as a Ray driver's once did in a fresh clone's run) must end the run as a failure naming the test it
ran, not hang. With xdist 3.8's default (the dead worker replaced) under ``--dist loadfile``, the controller and the
new worker wait on each other forever: this test then times out."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

from gemma4_harness.harness.core.paths import REPO_ROOT

#: Seconds the tiny run may take: it runs about 3 s of sleeps; a hung run never ends.
HANG_S = 120


def _xdist_options() -> tuple[str, ...]:
    """``XDIST`` of noxfile.py, read without importing nox (the test environment need not have it)."""
    tree = ast.parse((REPO_ROOT / "noxfile.py").read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "XDIST" for t in targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py has no XDIST: the tests session's pytest-xdist options")


def test_the_tests_session_passes_its_xdist_options():
    source = (REPO_ROOT / "noxfile.py").read_text()
    assert 'session.run("pytest", "-n", str(_test_workers()), *XDIST, *session.posargs)' in source


def test_a_worker_that_aborts_fails_the_run_at_once(tmp_path: Path):
    (tmp_path / "test_abort.py").write_text(
        "import os, time\n\ndef test_before():\n    time.sleep(1)\n\ndef test_aborts():\n    os.abort()\n\n"
        "def test_after():\n    pass\n")
    for name in ("b", "c", "d"):  # files for the other worker, so that it is busy when the first one dies
        (tmp_path / f"test_{name}.py").write_text("import time\n\ndef test_1():\n    time.sleep(1)\n\n"
                                                  "def test_2():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's addopts
    cmd = [sys.executable, "-m", "pytest", "-n", "2", *_xdist_options(), "-q", "-p", "no:cacheprovider"]
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # its own group: a hung run's workers are killed with it
    try:
        out, _ = p.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError(f"pytest {' '.join(_xdist_options())} hung after a worker's abort") from None
    assert p.returncode == 1, out[-2000:]
    assert "crashed while running 'test_abort.py::test_aborts'" in out, out[-2000:]
