"""What this machine has and what a process used (:mod:`.memory` plans against the first):

* :func:`available_memory`: the bytes a new allocation may take here, the least of ``MemAvailable``, the memory
  cgroup's headroom and ``RLIMIT_AS`` (CUDA: the device's free memory), with where the figure came from.
* :class:`PeakMemory`: peak ``VmRSS`` and ``RssAnon`` of a process, sampled from ``/proc/<pid>/status``
  by a background thread (benchmarks and the scale measurements).

Test hook: ``G4H_MEMORY_AVAILABLE_GB`` (:data:`AVAILABLE_ENV`), when set, replaces what
:func:`available_memory` measures (CPU and CUDA alike), so a test can make a plan fail or pass on any
machine. It is meant for tests; a user who sets it gets plans against the figure given.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

from gemma4_harness.reference.errors import InputError

from .memory_facts import GB


#: Test hook: GB (10^9 bytes) that :func:`available_memory` reports instead of measuring.
AVAILABLE_ENV = "G4H_MEMORY_AVAILABLE_GB"


# --------------------------------------------------------------------------- what is available


def _meminfo(field_name: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _status(field_name: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes (``VmRSS``, ``RssAnon``, ``VmSize`` ...)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup may still grow by (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ctrl, rel = parts[1], parts[2].lstrip("/")
        if ctrl == "":  # v2
            base = Path("/sys/fs/cgroup") / rel
            limit_f, used_f = base / "memory.max", base / "memory.current"
        elif "memory" in ctrl.split(","):  # v1
            base = Path("/sys/fs/cgroup/memory") / rel
            limit_f, used_f = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        try:
            limit = limit_f.read_text().strip()
            used = int(used_f.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 1 << 60:
            return max(0, int(limit) - used)
    return None


def available_memory(device: str = "cpu", own_process: bool = True) -> tuple[int | None, str]:
    """Bytes an engine can still allocate, and where that figure comes from.

    CPU: the least of ``MemAvailable`` (``/proc/meminfo``: free memory plus reclaimable caches), the
    memory cgroup's headroom (limit minus usage) and, when ``RLIMIT_AS`` is set, the address space
    left (the limit minus this process's ``VmSize``; for an engine in a fresh worker process,
    ``own_process=False``, the whole limit). CUDA: free device memory (``torch.cuda.mem_get_info``).

    With ``$G4H_MEMORY_AVAILABLE_GB`` set (:data:`AVAILABLE_ENV`, a test hook) that figure is returned
    instead of any measurement.

    Returns:
        ``(bytes or None when nothing can be read, "MemAvailable" | "cgroup limit" | "RLIMIT_AS" |
        "free CUDA memory" | "G4H_MEMORY_AVAILABLE_GB")``.

    Raises:
        InputError: ``$G4H_MEMORY_AVAILABLE_GB`` is not a number >= 0.
    """
    forced = os.environ.get(AVAILABLE_ENV)
    if forced is not None:
        try:
            gb = float(forced)
        except ValueError:
            gb = -1.0
        if not gb >= 0:
            raise InputError(f"${AVAILABLE_ENV} = {forced!r}: expected a number of GB >= 0")
        return int(gb * GB), AVAILABLE_ENV
    if device.startswith("cuda"):
        import torch  # heavy: only for a CUDA plan

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), "free CUDA memory"
    found: list[tuple[int, str]] = []
    avail = _meminfo("MemAvailable")
    if avail is not None:
        found.append((avail, "MemAvailable"))
    cg = _cgroup_headroom()
    if cg is not None:
        found.append((cg, "cgroup limit"))
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = (_status("VmSize") or 0) if own_process else 0
        found.append((max(0, soft - used), "RLIMIT_AS"))
    if not found:
        return None, "unknown"
    return min(found)


# --------------------------------------------------------------------------- measuring


class PeakMemory:
    """Peak resident memory of a process, sampled from ``/proc/<pid>/status`` by a background thread.

    ``peak_rss`` is the largest ``VmRSS`` seen (all resident pages, mapped files included) and
    ``peak_anon`` the largest ``RssAnon`` (private memory: what the process allocated, not the
    page cache of a mapped model file). Both are also read once at start and stop, so a run
    shorter than the interval still has figures. Use as a context manager::

        with PeakMemory() as pm:
            run()
        pm.peak_anon, pm.peak_rss   # bytes

    Args:
        pid: the process (default this one).
        interval: seconds between samples (default 0.01).
    """

    def __init__(self, pid: int | str = "self", interval: float = 0.01):
        self.pid = pid
        self.interval = interval
        self.peak_rss = 0
        self.peak_anon = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def sample(self) -> None:
        """Read the fields once and keep the maxima."""
        rss, anon = _status("VmRSS", self.pid), _status("RssAnon", self.pid)
        self.peak_rss = max(self.peak_rss, rss or 0)
        self.peak_anon = max(self.peak_anon, anon or 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "PeakMemory":
        """Start sampling."""
        self._t0 = time.perf_counter()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "PeakMemory":
        """Stop sampling (one last sample)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        self.seconds = time.perf_counter() - self._t0
        return self

    def __enter__(self) -> "PeakMemory":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def as_dict(self) -> dict[str, float]:
        """``{"wall_s", "peak_rss_gb", "peak_anon_gb"}`` (GB = 10^9 bytes)."""
        return {"wall_s": round(self.seconds, 2), "peak_rss_gb": round(self.peak_rss / GB, 3),
                "peak_anon_gb": round(self.peak_anon / GB, 3)}
