"""Where a job keeps the full tensors of its traces: in memory up to a budget, then in files it maps.

A parity job keeps every traced tensor of every prompt until its pairs are compared: the oracle's (under each
approximation set) and each engine's. At full depth that is more than the model: the 31B shape (60 layers, hidden
5376) held 2.09 GB of the fast oracle's and 0.70 GB of llama.cpp's traced tensors per 8 layers as float64 copies
(measured on an 8-layer cut, 16 prompts), about 21 GB at 60 layers, beside a 17.3 GB file that the oracle and
llama.cpp both map: llama.cpp then read its weights from disk on every token (585 s of system time in a 26-minute
run) and ran past its deadline.

So a tensor is kept in its own float dtype (float32 stays float32: :meth:`Trace.tensor
<harness.traces.format.Trace.tensor>` widens it to float64 when read, exactly), and past :data:`MEMORY_BUDGET` bytes
of live tensors in this process it goes to an ``.npy`` file in a temporary folder on disk (:func:`spill_parent`,
:func:`harness.core.workers.temp_dir`: removed however the process ends) and is read back as a read-only memory map:
page cache the kernel may drop and read again, not anonymous memory the model's weights are paged out for. A file
is removed when its map is no longer referenced. The values are the same bits either way.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

from ..core.paths import cache_root
from ..core.workers import temp_dir

#: Bytes of traced tensors a process keeps in memory before it writes them to files (see the module docstring).
#: 512 MiB: the synthetic cases' tensors stay in memory; a real-size job spills (the 31B shape cut to 8 layers already
#: keeps 2.8 GB as float64, 1.4 GB as float32), so that its own memory stays small beside the file it maps.
MEMORY_BUDGET = 1 << 29

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class TensorStore:
    """Keeps arrays (:meth:`keep`) in memory while the live total is within ``budget`` bytes, else in files.

    Args:
        budget: bytes of live in-memory arrays before later ones go to files (0: every array to a file).
        folder: where the files go; default a :func:`harness.core.workers.temp_dir` made on first use in
            :func:`spill_parent`.

    Attributes:
        in_memory: bytes of kept arrays still referenced in memory.
        spilled: bytes written to files so far (figures for a progress line or a test).
        spill_error: why files could not be written or mapped (then every later array stays in memory), or None.
    """

    def __init__(self, budget: int = MEMORY_BUDGET, folder: str | os.PathLike | None = None) -> None:
        self.budget = int(budget)
        self.in_memory = 0
        self.spilled = 0
        self.spill_error: str | None = None
        self._folder = None if folder is None else Path(folder)
        self._n = 0
        # Reentrant: _release runs from a weakref finalizer, which the garbage collector may call in this same
        # thread while keep() holds the lock (an allocation inside it starting a collection): a plain Lock hung.
        self._lock = threading.RLock()

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.in_memory -= nbytes

    def _in_memory(self, a: np.ndarray, dtype: np.dtype, nbytes: int) -> np.ndarray:
        out = np.array(a, dtype=dtype, copy=True)
        with self._lock:
            self.in_memory += nbytes
        weakref.finalize(out, self._release, nbytes)
        return out

    def keep(self, arr) -> np.ndarray:
        """A copy of ``arr`` (any real array; the same shape) as float32 when it is float32, else float64 (both
        exact), held in memory or as a read-only ``np.memmap`` of an ``.npy`` file (see the module docstring).

        A file that cannot be written or mapped (a full disk, the process's limit of maps: ``vm.max_map_count``)
        is no failure of the job: the array and every later one stay in memory, and :attr:`spill_error` says why
        (one line on stderr, once). [..] -> [..]; never raises for the store's own files.
        """
        a = np.asarray(arr)
        dtype = a.dtype if a.dtype in _FLOATS else np.dtype(np.float64)
        nbytes = a.size * dtype.itemsize
        with self._lock:
            spill = self.spill_error is None and self.in_memory + nbytes > self.budget
            if spill:
                self._n += 1
                n = self._n
        if not spill:
            return self._in_memory(a, dtype, nbytes)
        path = None
        try:
            with self._lock:
                if self._folder is None:
                    self._folder = temp_dir("g4h-traces-", dir=spill_parent())
                folder = self._folder
            path = folder / f"{n}.npy"
            np.save(path, np.ascontiguousarray(a, dtype=dtype), allow_pickle=False)
            out = np.load(path, mmap_mode="r", allow_pickle=False)
        except OSError as e:
            if path is not None:
                _unlink(str(path))
            with self._lock:
                first = self.spill_error is None
                self.spill_error = f"{path or 'the trace folder'}: {e.strerror or e}"
            if first:
                print(f"g4h: traced tensors stay in memory from now on: cannot write or map {self.spill_error}",
                      file=sys.stderr)
            return self._in_memory(a, dtype, nbytes)
        with self._lock:
            self.spilled += nbytes
        weakref.finalize(out, _unlink, str(path))
        return out


#: File systems whose files are memory: spilling there would save nothing.
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})


def spill_parent(mounts: str | os.PathLike = "/proc/mounts") -> Path:
    """The folder the spill folders go in: the system's temporary folder, unless it is a memory file system
    (``tmpfs``, as ``/tmp`` is on Fedora, Arch and recent Debian: its files are shared memory, the very memory a
    spill should free), then the project cache (:func:`harness.core.paths.cache_root`, on disk). ``mounts``: the
    mount table (``/proc/mounts``' format: device, mount point with spaces as ``\\040``, type); where it cannot be
    read, the temporary folder."""
    tmp = Path(tempfile.gettempdir()).resolve()
    fstype, best = None, -1
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (tmp == Path(mount) or Path(mount) in tmp.parents) and len(mount) > best:
                    fstype, best = parts[2], len(mount)
    except OSError:
        return tmp
    if fstype not in _MEMORY_FS:
        return tmp
    parent = cache_root() / "traces"
    parent.mkdir(parents=True, exist_ok=True)
    return parent


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_default: TensorStore | None = None
_default_lock = threading.Lock()


def default_store() -> TensorStore:
    """This process's store (:data:`MEMORY_BUDGET`), which :class:`harness.traces.format.TraceWriter` keeps its
    tensors in."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TensorStore()
        return _default
