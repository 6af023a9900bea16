"""Each pytest-xdist worker runs on its share of the CPUs (``tests/conftest.py``), so that no more threads spin
than there are cores: on 2 cores the suite took 16.5 minutes with each of 2 workers on both cores, 8.7 with each
on one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def test_torch_follows_the_thread_variable():
    """In this process: torch's pool has the size ``OMP_NUM_THREADS`` says (set by conftest under xdist, before
    torch started); the probe the next test runs writes the figures it sees where it is told to."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env:
        assert torch.get_num_threads() == int(env)
    report = os.environ.get("G4H_THREADS_REPORT")
    if report:
        Path(report).write_text(f"{os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()}")


def test_each_xdist_worker_gets_its_share_of_the_cpus(tmp_path):
    report = tmp_path / "threads.txt"
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS and not k.startswith("PYTEST_XDIST")}
    env["G4H_THREADS_REPORT"] = str(report)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                           f"{__file__}::test_torch_follows_the_thread_variable"],
                          cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert report.read_text().split() == [str(share), str(share)]
