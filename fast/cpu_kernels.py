"""A small-batch float32 matmul for CPU decode, compiled from ``fast/csrc/linear_f32.c`` on first use.

Why: on the CPU a decode step is bound by reading the weights. For one row
(``M = 1``) torch's ``F.linear`` already streams the weights at the machine's
read bandwidth, but for ``M = 2..16`` (a batch of decoding sequences) the BLAS
GEMM it calls runs at about a third of that, so batching buys little. The C
kernel reads each weight once and keeps all ``M`` accumulators in registers
(see the C file). Measured on the 2-core CI VM in one run (``g4h bench`` and
the kernel probe in ``tests/test_cpu_kernels.py``): at ``M = 8`` it reads
13 GB/s where ``F.linear`` reads 9-10 GB/s; at ``M = 1`` both are at the read
roofline.

How: the source is compiled with the system C compiler (``$CC``, else ``cc``)
with ``-O3 -march=native -fopenmp`` into ``<cache>/kernels/<hash>/`` (``<cache>``:
:func:`fast.paths.cache_root`, ``$G4H_CACHE`` or the user cache directory; the hash covers the source and
the headers beside it, flags, compiler version, CPU model and CPU feature flags, so a cache shared between machines
never hands one CPU a binary built for another's instruction set) and loaded
with :mod:`ctypes`. :func:`build` also compiles the packed-weight kernels of
:mod:`fast.quant_kernels`. Its OpenMP calls resolve
to the ``libgomp`` torch has already loaded, so the two share one thread pool.

When it is not used: no compiler, a failed build, ``G4H_CPU_KERNEL=0`` in the
environment, a non-CPU or non-float32 tensor, ``M`` outside ``[1, MAX_ROWS]``,
or shapes the kernel does not take (``K % 16 != 0``, odd ``N``). Then
:func:`linear_f32` returns None and the caller uses ``F.linear``. The choice
depends only on shapes, never on values, so neighbour isolation holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from .cpu_identity import cpu_model
from .paths import cache_root

MAX_ROWS = 16
"""Largest ``M`` sent to the kernel; above it a BLAS GEMM is compute-efficient and wins."""

SOURCE = Path(__file__).resolve().parent / "csrc" / "linear_f32.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]

_kernel_threads = 0  # > 0 inside small_step_threads()


def threads() -> int:
    """Threads the CPU kernels (here and :mod:`fast.quant_kernels`) run on: ``torch.get_num_threads()``, or the
    count saved by :func:`small_step_threads` while torch's own ops run on one thread."""
    return _kernel_threads or torch.get_num_threads()


@contextlib.contextmanager
def small_step_threads():
    """For a decode-sized step on the CPU: torch's own ops on one thread, the C kernels on all of torch's threads.

    Why: in a decode step every torch op is small (a few rows), and an OpenMP region on 2 threads costs more than
    it saves on a busy 2-core machine (the barrier waits for a thread the OS has not scheduled; figures in
    ``fast/csrc/workpool.h``); the weight reads, where the time goes, stay on every thread through the kernels.
    Measured on Gemma 3 270M Q4_K_M at 2 threads (``g4h bench`` with and without it). Results are the same bits:
    torch's CPU reductions do not depend on the thread count at these sizes, and the kernels' order is fixed.
    Not thread-safe (one model steps at a time in a process)."""
    global _kernel_threads
    n = torch.get_num_threads()
    if n <= 1 or _kernel_threads:
        yield
        return
    _kernel_threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _kernel_threads = 0


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> tuple[str, str]:
    """``(compiler, its --version output)``: ``$CC``, else ``cc``, else ``gcc``. Raises RuntimeError when there is
    none or it does not answer."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    try:
        return cc, subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cc}: {e}") from None


def library_path(source: Path = SOURCE, flags: list[str] | None = None, libs: list[str] | None = None) -> Path:
    """Where :func:`build` keeps the library of ``source``: ``<cache>/kernels/<key>/lib<stem>.so``.

    The key is the SHA-256 of the source's bytes, of every header (``*.h``) beside it (what it may ``#include``, so
    that an edited header such as ``fp16.h`` or ``workpool.h`` rebuilds every kernel that includes it), of the flags
    and libraries, of the compiler's version and of the CPU's model and feature flags
    (:func:`fast.cpu_identity.cpu_model`). Arguments as in :func:`build`; raises as :func:`_compiler`.
    """
    return _library_path(source, FLAGS if flags is None else list(flags), [] if libs is None else list(libs),
                         _compiler()[1])


def _library_path(source: Path, flags: list[str], libs: list[str], version: str) -> Path:
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\n".join([source.read_text(), *headers, " ".join(flags + libs), version,
                                     cpu_model()]).encode()).hexdigest()
    return _cache_dir() / key[:16] / f"lib{source.stem}.so"


def build(force: bool = False, source: Path = SOURCE, flags: list[str] | None = None,
          libs: list[str] | None = None) -> Path:
    """Compile a kernel source (or find it in the cache, :func:`library_path`) and return the shared library's path.

    Args:
        force: rebuild even when a cached library exists.
        source: the C file (default ``csrc/linear_f32.c``).
        flags: compiler flags (default :data:`FLAGS`).
        libs: libraries to link, after the source (e.g. ``["-lm"]``).

    Raises:
        RuntimeError: no C compiler, or it failed (the message holds its last line of output).
    """
    flags = FLAGS if flags is None else list(flags)
    libs = [] if libs is None else list(libs)
    cc, version = _compiler()
    out = _library_path(source, flags, libs, version)
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(source), "-o", tmp, *libs], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{cc} failed on {source.name}: {last}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class Library:
    """A kernel library of ``fast/csrc/``, compiled by :func:`build` and loaded with :mod:`ctypes` on first use: the
    one loader of this module's kernels and :mod:`fast.quant_kernels`'.

    Args:
        source: the C file; flags, libs: as in :func:`build`.
        signatures: C function name -> ``(argtypes, restype)``, declared on the loaded library (a missing symbol is
            an ``AttributeError``: the library is then unavailable).

    :meth:`get` gives the loaded library, or None when it is unavailable: no compiler, a failed build or load,
    ``G4H_CPU_KERNEL=0`` in the environment (read at the first use), or inside :meth:`disabled`. The first failure
    is kept (:meth:`status` says why) and not retried.
    """

    def __init__(self, source: Path, flags: list[str], libs: list[str],
                 signatures: dict[str, tuple[list, Any]]) -> None:
        self.source, self.flags, self.libs, self.signatures = source, flags, libs, signatures
        self.lib: ctypes.CDLL | None = None
        self.state = "unloaded"  # unloaded | ready | unavailable
        self.why = ""
        self.off = 0  # > 0 inside disabled()

    def bind(self, path: Path | str) -> ctypes.CDLL:
        """Load a built library at ``path`` and declare :attr:`signatures` on it (also used by the tests on builds
        with other flags).

        Raises: OSError when the file cannot be loaded; AttributeError when a symbol is missing.
        """
        lib = ctypes.CDLL(str(path))
        for name, (args, res) in self.signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        return lib

    def _load(self) -> None:
        # the state changes once, at the end: a thread calling get() meanwhile builds too (the cache's os.replace
        # makes that safe), rather than taking the torch path for one call
        if os.environ.get("G4H_CPU_KERNEL", "1") == "0":
            self.state, self.why = "unavailable", "disabled by G4H_CPU_KERNEL=0"
            return
        try:
            self.lib, self.state = self.bind(build(source=self.source, flags=self.flags, libs=self.libs)), "ready"
        except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as e:
            self.state, self.why = "unavailable", str(e).splitlines()[0] if str(e) else type(e).__name__

    def get(self) -> ctypes.CDLL | None:
        """The loaded library (built and loaded at the first call), or None where it is not available."""
        if self.state == "unloaded":
            self._load()
        return self.lib if self.state == "ready" and not self.off else None

    def status(self) -> tuple[bool, str]:
        """``(available, reason)``: whether the library loads here, and why not when it does not."""
        if self.state == "unloaded":
            self._load()
        return self.state == "ready", self.why

    @contextlib.contextmanager
    def disabled(self):
        """Within the ``with`` block :meth:`get` returns None (the callers take their torch path): for benchmarks
        against that path, and tests. Not thread-safe."""
        self.off += 1
        try:
            yield
        finally:
            self.off -= 1


_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
F32 = Library(SOURCE, FLAGS, [], {"g4h_linear_f32": ([_P, _P, _P, _L, _L, _L, _I], None)})
"""``csrc/linear_f32.c``: :func:`linear_f32`."""


ROWS_SOURCE = Path(__file__).resolve().parent / "csrc" / "rows_f32.c"
ROWS_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared",
              "-fPIC"]
"""``rows_f32.c``'s flags: ``-ffp-contract=off`` so that every product rounds on its own, as its header defines;
``-fno-trapping-math`` lets the compiler evaluate both sides of the soft-cap's select (values are unchanged: it
only concerns floating-point exception flags), so that the loop vectorises."""
ROWS = Library(ROWS_SOURCE, ROWS_FLAGS, ["-lm"], {"g4h_rms_norm_f32": ([_P, _P, _P, _L, _L, ctypes.c_double], None),
                                                   "g4h_softcap_f32": ([_P, _P, _L, ctypes.c_double], None),
                                                   "g4h_argmax_f32": ([_P, _L, _L, _P], _I)})
"""``csrc/rows_f32.c``: :func:`rms_norm_f32`, :func:`softcap_f32`, :func:`argmax_f32`."""


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """RMS norm over the last dimension through ``csrc/rows_f32.c``, or None when it does not apply (the caller
    uses torch).

    The formula and its order of operations are the C file's header: the float64 sum of squares of each row in a
    fixed lane order, the scale ``1 / sqrt(ss / n + eps)`` rounded once to float32, then ``(x * s) * w`` in
    float32. Same formula as the reference's ``rms_norm``. Why a kernel: torch's composite costs 9-15 us a call
    on decode-sized rows (six dispatches); through this one :func:`fast.model.rms_norm` takes about 4.5 us on a
    ``[1, 640]`` row (timed in a loop on one thread of the 2-core CI VM), and a Gemma 3 270M step makes 109.

    Args:
        x: float32 ``[..., n]`` on the CPU (made contiguous if it is not).
        weight: float32 ``[n]`` on the CPU, or None (scale only).
        eps: added to the mean square.

    Returns:
        float32, ``x``'s shape (a new tensor), or None (not float32, not on the CPU, autograd, no compiler,
        ``G4H_CPU_KERNEL=0``). The choice depends on dtypes and devices only, never on values.
    """
    if (ROWS.state == "unavailable" or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 1
            or x.shape[-1] < 1
            or weight is not None and (weight.device.type != "cpu" or weight.dtype != torch.float32
                                       or weight.shape != (x.shape[-1],))
            or torch.is_grad_enabled() and (x.requires_grad or weight is not None and weight.requires_grad)):
        return None
    lib = ROWS.get()
    if lib is None:
        return None
    x = x.contiguous()
    w = None if weight is None else weight.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    lib.g4h_rms_norm_f32(x.data_ptr(), None if w is None else w.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y


def softcap_f32(x: torch.Tensor, cap: float) -> torch.Tensor | None:
    """``cap * tanh(x / cap)`` through ``csrc/rows_f32.c`` (evaluated in float64, rounded once: the header gives
    the method and its error), or None when it does not apply (the caller uses torch).

    Why: the final soft-cap runs over every logit of every step, 262,144 a row for Gemma 4; torch's float32
    ``tanh`` took 0.94-1.15 ms a row on one thread of the 2-core CI VM, this one 0.37 ms.

    Args:
        x: float32 on the CPU, any shape (made contiguous if it is not).
        cap: the soft-cap (``final_logit_softcapping``), > 0.

    Returns:
        float32, ``x``'s shape (a new tensor), or None (not float32, not on the CPU, autograd, no compiler,
        ``G4H_CPU_KERNEL=0``). NaN stays NaN; +-Inf gives +-cap, as torch's formula does.
    """
    if ROWS.state == "unavailable" or x.device.type != "cpu" or x.dtype != torch.float32 or not cap > 0 or (
            torch.is_grad_enabled() and x.requires_grad):
        return None
    lib = ROWS.get()
    if lib is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.g4h_softcap_f32(x.data_ptr(), y.data_ptr(), x.numel(), float(cap))
    return y


def argmax_f32(x: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """``(x.argmax(-1), every value finite)`` of float32 ``[rows, n]`` logits in one pass (``csrc/rows_f32.c``),
    or None when it does not apply (the caller uses torch: :func:`fast.engine.all_finite`, then ``argmax``).

    The indices are torch's (the first largest value of each row) whenever every value is finite; when one is not,
    they are meaningless and the flag is False (the decode loop raises). Why: a decode step's greedy pick and
    output check over 262,144 logits took 0.2-0.3 ms in torch (two passes), 0.03 ms here.

    Returns: (int64 ``[rows]``, bool) or None (not a 2-D float32 CPU tensor, rows of 2^31 or more values, no
    compiler, ``G4H_CPU_KERNEL=0``).
    """
    if (ROWS.state == "unavailable" or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or not 0 < x.shape[1] < 2 ** 31):
        return None
    lib = ROWS.get()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    finite = lib.g4h_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out, bool(finite)


def status() -> tuple[bool, str]:
    """``(available, reason)``: whether the kernel is in use here, and why not when it is not."""
    return F32.status()


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """``x @ w.T`` through the C kernel, or None when it does not apply (the caller uses ``F.linear``).

    Args:
        x: float32 ``[M, K]`` on the CPU, ``1 <= M <= MAX_ROWS``.
        w: float32 ``[N, K]`` on the CPU, ``K % 16 == 0``, ``N`` even.

    Returns:
        float32 ``[M, N]`` (a new tensor), or None.
    """
    if F32.state == "unavailable":
        return None
    if (x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32
            or x.dim() != 2 or w.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != w.shape[1]
            or w.shape[1] % 16 or w.shape[0] % 2 or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return None
    lib = F32.get()
    if lib is None:
        return None
    x = x.contiguous()
    if not w.is_contiguous():
        return None
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    lib.g4h_linear_f32(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], w.shape[1], threads())
    return y
