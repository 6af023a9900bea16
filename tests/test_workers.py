"""Worker processes and their temporary folders outlive no parent (``harness.core.workers``).

A parent is killed with SIGKILL (no handler, no ``finally``, no ``atexit`` runs): its workers must die
(``PR_SET_PDEATHSIG``) and the folders it made with ``temp_dir`` must be removed (the watchdog sees the
parent's pipe close). The llama.cpp worker itself is killed the same way in ``tests/test_llamacpp.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemma4_harness.harness.core.workers import worker_env

#: How long the kernel, the watchdog and the reaping of orphans may take after the kill.
SETTLE_S = 10.0


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs: no such process, or a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def children_of(pid: int) -> dict[int, str]:
    """Running processes whose parent is ``pid``: pid -> command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry.name)] = cmd
    return out


def wait_until(cond, timeout: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def start_parent(code: str, tmp: Path) -> subprocess.Popen:
    """``python -c code`` with this checkout on the path and ``TMPDIR=tmp``; stdout is a pipe."""
    env = dict(worker_env(), TMPDIR=str(tmp))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)


PARENT = """
import time
from gemma4_harness.harness.core import workers
d = workers.temp_dir("g4h-test-")
(d / "data.bin").write_bytes(b"x" * 1000)
w = workers.start_worker("timeit", ["-n", "1", "-r", "1", "import time; time.sleep(120)"])
print(d, w.pid, workers._watchdog.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_killed_parent_leaves_no_worker_and_no_temp_dir(tmp_path):
    parent = start_parent(PARENT, tmp_path)
    folder, worker, watchdog = parent.stdout.readline().split()
    folder, worker, watchdog = Path(folder), int(worker), int(watchdog)
    assert folder.parent == tmp_path and (folder / "data.bin").is_file()
    assert not process_gone(worker) and not process_gone(watchdog)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_until(lambda: process_gone(worker)), "the worker outlived its parent"
    assert wait_until(lambda: not folder.exists()), "the parent's temporary folder is still there"
    assert wait_until(lambda: process_gone(watchdog)), "the watchdog did not exit"
    assert list(tmp_path.iterdir()) == []


def test_temp_dir_removed_at_a_normal_exit_and_kept_until_then(tmp_path):
    code = """
from gemma4_harness.harness.core import workers
kept, left = workers.temp_dir("g4h-kept-"), workers.temp_dir("g4h-left-")
workers.remove_temp_dir(kept)
print(kept.exists(), left.exists(), flush=True)
"""
    parent = start_parent(code, tmp_path)
    out, _ = parent.communicate(timeout=60)
    assert out.split() == ["False", "True"]
    assert list(tmp_path.iterdir()) == []  # the one left behind is removed before the exit completes


def test_forked_child_does_not_take_its_parents_folders(tmp_path):
    """A forked child's exit removes its own folders only; the parent's stay until the parent ends."""
    code = """
import os, time
from gemma4_harness.harness.core import workers
mine = workers.temp_dir("g4h-parent-")
pid = os.fork()
if pid == 0:
    workers.temp_dir("g4h-child-")
    os._exit(0)  # no atexit: the child's watchdog sees its pipe close
os.waitpid(pid, 0)
deadline = time.monotonic() + 10
while any(p.name.startswith("g4h-child-") for p in mine.parent.iterdir()) and time.monotonic() < deadline:
    time.sleep(0.02)
print(sorted(p.name.split("-")[1] for p in mine.parent.iterdir()), flush=True)
"""
    parent = start_parent(code, tmp_path)
    out, _ = parent.communicate(timeout=60)
    assert out.strip() == "['parent']"
    assert list(tmp_path.iterdir()) == []


CMD_PARENT = """
import shlex, sys, time
from gemma4_harness.harness.engines.cmd import CmdEngine
eng = CmdEngine(shlex.join([sys.executable, {stub!r}, "--linger"]), {model!r})
eng.logits([2, 3, 4])  # the engine has written into its scratch folder
print(eng.workdir, eng.proc.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_killed_parent_leaves_no_cmd_engine_and_no_scratch_folder(tmp_path):
    """A ``cmd:`` engine (tests/cmd_stub.py, told to outlive a closed stdin) and its scratch folder, after a
    SIGKILL of the harness process that started it."""
    from conftest import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stub = str(Path(__file__).resolve().parent / "cmd_stub.py")
    parent = start_parent(CMD_PARENT.format(stub=stub, model=str(model)), tmp)
    folder, engine = parent.stdout.readline().split()
    folder, engine = Path(folder), int(engine)
    assert folder.parent == tmp and any(folder.iterdir()) and not process_gone(engine)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_until(lambda: process_gone(engine)), "the cmd: engine outlived its parent"
    assert wait_until(lambda: not folder.exists()), "the engine's scratch folder is still there"
    assert list(tmp.iterdir()) == []
