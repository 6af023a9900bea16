"""CPU kernels for GGUF-packed weights (``fast/csrc/linear_quant.c``), compiled on first use.

Why: a decode step on the CPU is bound by reading the weights. Kept packed, a
Q8_0 matrix is 1.06 bytes a weight instead of 4, a Q4_K one 0.56; but the
fallback (dequantize a chunk with torch, then ``F.linear``) writes and re-reads
the float32 chunk and runs the torch decoders, several times slower than the
read itself. The C kernel reads each packed byte once per call, dequantizes in
registers and a small L1 buffer, and keeps the multiply-adds of all ``M`` rows of
``x`` in fp32 registers. ``x`` stays float32 (no activation quantization, unlike
llama.cpp's q8 dot products), so the result is the float32 product of ``x`` and
the exact dequantized weights, summed in one fixed order (the C file's header
gives it). A row's result is bit-identical whatever the batch size and whatever
its neighbours hold, and whichever vector path (AVX-512, AVX2, plain C) the
compiler took.

Which: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (:data:`TYPES`); the
others (Q2_K, Q3_K, float types) take the torch path.

How: built by :func:`fast.cpu_kernels.build` with the system C compiler
(``-O3 -march=native -ffp-contract=off -pthread``; the cache is keyed by the
source and its headers, the flags, the compiler and the CPU's feature flags).
Why not a kernel library: the maintained ones that read GGUF blocks (ggml
itself, llamafile's tinyBLAS) quantize the activations to 8 bits for their dot
products, which this project may not do, and none promises a fixed summation
order across batch sizes; the float path here is one C file and one header.
Threads: ``torch.get_num_threads()`` of them (:func:`fast.cpu_kernels.threads`), from the small pool in
``fast/csrc/workpool.h`` rather than OpenMP: the caller never waits for a worker
the OS has not scheduled yet, which on a busy 2-core machine made OpenMP calls
several times slower on 2 threads than on 1 (the header gives the figures).
Products below about a million weight-ops stay on the calling thread.

When it is not used (the functions return None and the caller falls back):
no compiler or a failed build, ``G4H_CPU_KERNEL=0`` in the environment, a
tensor not on the CPU, ``x`` not float32, more than :data:`MAX_ROWS` rows, a type
not in :data:`TYPES`, or raw bytes that are not one contiguous ``[rows,
bytes_per_row]`` block. The choice depends on shapes and types only, never on
values.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import cpu_kernels

__all__ = ["MAX_ROWS", "TYPES", "SOURCE", "FLAGS", "PACKED", "Q8", "bind", "bind_q8", "status", "isa", "disabled",
           "layout", "linear", "take_rows", "dequantize_rows", "Q8_SOURCE", "Q8_TYPES", "Q8_MAX_ROWS", "q8_linear",
           "q8_quantize", "q8k_quantize", "q8_isa"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "linear_quant.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-shared", "-fPIC"]
"""Compiler flags. ``-ffp-contract=off``: the dequantization's multiplies and adds must round one at a
time as gguf-py's do; the dot product's fused multiply-adds are explicit in the source."""
LIBS = ["-lm"]

MAX_ROWS = 16
"""Largest ``M`` :func:`linear` takes (decode and small batches); above it the caller dequantizes and uses a GEMM."""

TYPES: dict[str, int] = {name: int(GGMLQuantizationType[name])
                         for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
"""GGUF type name -> GGML type number, for the types the kernels decode."""
_SIZES = {name: (num, *GGML_QUANT_SIZES[GGMLQuantizationType(num)]) for name, num in TYPES.items()}

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
PACKED = cpu_kernels.Library(SOURCE, FLAGS, LIBS, {"g4h_qlinear": ([_I, _P, _L, _L, _L, _P, _L, _P, _I], _I),
                                                   "g4h_qtake_rows": ([_I, _P, _L, _L, _P, _L, _P, _I], _I),
                                                   "g4h_qdequant_rows": ([_I, _P, _L, _L, _L, _L, _P, _I], _I),
                                                   "g4h_qk_isa": ([], _I)})
"""``csrc/linear_quant.c`` (:func:`linear`, :func:`take_rows`, :func:`dequantize_rows`)."""
bind = PACKED.bind
"""Load a built ``linear_quant`` library and declare its functions' C signatures (the tests use it on builds with
other flags). Raises OSError when the file cannot be loaded, AttributeError when a symbol is missing."""
_get = PACKED.get


def status() -> tuple[bool, str]:
    """``(available, reason)``: whether the packed kernels are in use here, and why not when they are not."""
    return PACKED.status()


@contextlib.contextmanager
def disabled():
    """Within the ``with`` block the kernels are not used (every function here returns None and the callers take
    their torch path): for benchmarks against that path, and tests. Not thread-safe."""
    with PACKED.disabled(), Q8.disabled():
        yield


def isa() -> int | None:
    """The vector path the build took: 512 (AVX-512), 256 (AVX2 + FMA), 0 (plain C); None when not built."""
    lib = _get()
    return None if lib is None else int(lib.g4h_qk_isa())


def layout(raw: torch.Tensor, qtype: str, row_len: int) -> tuple[int, int] | None:
    """``(GGML type number, bytes per row)`` when ``raw`` is a contiguous CPU ``[rows, bytes_per_row]`` block
    of a kernel type with rows of ``row_len`` elements, else None. Depends on the tensor's type, shape, device
    and layout only (what :func:`linear` checks), so a caller may work it out once per weight and pass it."""
    return _layout(_SIZES, raw, qtype, row_len)


def _layout(table: dict[str, tuple[int, int, int]], raw: torch.Tensor, qtype: str, row_len: int):
    """:func:`layout` for the types of ``table`` (name -> (type number, block size, block bytes))."""
    sizes = table.get(qtype)
    if sizes is None or raw.device.type != "cpu" or raw.dtype != torch.uint8 or raw.dim() != 2:
        return None
    num, bs, ts = sizes
    if row_len <= 0 or row_len % bs or raw.shape[1] != row_len // bs * ts or not raw.is_contiguous():
        return None
    return num, raw.shape[1]


def _check(rc: int, what: str) -> None:
    if rc == -3:
        raise MemoryError(f"{what}: the packed kernel could not allocate its buffers")
    if rc != 0:
        raise RuntimeError(f"{what}: packed kernel returned {rc} after the Python side accepted the arguments")


def _product(kernel: cpu_kernels.Library, x: torch.Tensor, raw: torch.Tensor, qtype: str, row_len: int,
             max_rows: int | None, lay: tuple[int, int] | None = None):
    """What :func:`linear` and :func:`q8_linear` check before a product (shapes, dtypes, devices, never values):
    ``(library, layout, x made contiguous, y = an empty float32 [M, N])``, or None when ``kernel`` does not take it
    (``x`` not a float32 ``[M, row_len]`` CPU tensor with ``1 <= M <= max_rows`` (None: any M), autograd on ``x``,
    ``raw`` not a kernel layout, the library not available)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] < 1
            or max_rows is not None and x.shape[0] > max_rows or x.shape[1] != row_len
            or torch.is_grad_enabled() and x.requires_grad):
        return None
    if lay is None:
        lay = layout(raw, qtype, row_len)
    lib = kernel.get() if lay is not None else None
    if lib is None:
        return None
    return lib, lay, x.contiguous(), torch.empty(x.shape[0], raw.shape[0], dtype=torch.float32)


def linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, row_len: int,
           lay: tuple[int, int] | None = None) -> torch.Tensor | None:
    """``x @ dequant(W).T`` for ``W`` the packed ``[N, row_len]`` matrix in ``raw``; None when the kernel cannot.

    Args:
        x: float32 ``[M, row_len]`` on the CPU, ``1 <= M <= MAX_ROWS`` (made contiguous if it is not).
        raw: uint8 ``[N, bytes_per_row]``, contiguous, on the CPU (a :class:`fast.quants.QuantizedTensor`'s bytes).
        qtype: GGUF type name (``"Q8_0"``).
        row_len: elements per row of ``W`` (``K``).
        lay: :func:`layout` of ``raw`` worked out before (a :class:`fast.quants.QuantizedTensor`'s
            ``kernel_layout``), or None to work it out here.

    Returns:
        float32 ``[M, N]`` (a new tensor), or None.
    """
    call = _product(PACKED, x, raw, qtype, row_len, MAX_ROWS, lay)
    if call is None:
        return None
    lib, lay, x, y = call
    m, n = y.shape
    _check(lib.g4h_qlinear(lay[0], raw.data_ptr(), lay[1], n, row_len, x.data_ptr(), m, y.data_ptr(),
                           cpu_kernels.threads()), f"{qtype} linear [{m}, {row_len}] x [{n}, {row_len}]")
    return y


def take_rows(raw: torch.Tensor, qtype: str, row_len: int, ids: torch.Tensor) -> torch.Tensor | None:
    """Rows ``ids`` of the packed ``[N, row_len]`` matrix in ``raw``, dequantized: float32 ``[len(ids), row_len]``.

    Bit-identical with ``gguf.quants.dequantize`` of those rows. None when the kernel does not apply.

    Args:
        raw: as in :func:`linear`.
        ids: int64 ``[n]`` on the CPU, every id in ``[0, N)`` (the caller checks; out-of-range ids are not caught here).
    """
    lay = layout(raw, qtype, row_len)
    lib = _get() if lay is not None else None
    if lib is None or ids.device.type != "cpu" or ids.dim() != 1:
        return None
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), row_len, dtype=torch.float32)
    _check(lib.g4h_qtake_rows(lay[0], raw.data_ptr(), lay[1], row_len, ids.data_ptr(), ids.numel(), out.data_ptr(),
                              cpu_kernels.threads()), f"{qtype} take_rows")
    return out


def dequantize_rows(raw: torch.Tensor, qtype: str, row_len: int, start: int, stop: int) -> torch.Tensor | None:
    """Rows ``start:stop`` of the packed matrix in ``raw``, dequantized: float32 ``[stop - start, row_len]``.

    Bit-identical with ``gguf.quants.dequantize``. None when the kernel does not apply. The caller
    checks ``0 <= start <= stop <= N``.
    """
    lay = layout(raw, qtype, row_len)
    lib = _get() if lay is not None else None
    if lib is None:
        return None
    out = torch.empty(stop - start, row_len, dtype=torch.float32)
    _check(lib.g4h_qdequant_rows(lay[0], raw.data_ptr(), lay[1], row_len, start, stop, out.data_ptr(),
                                 cpu_kernels.threads()), f"{qtype} dequantize_rows")
    return out


# --------------------------------------------------------------------------- --compute q8: llama.cpp's arithmetic

Q8_SOURCE = Path(__file__).resolve().parent / "csrc" / "linear_q8.c"
"""The integer-dot-product kernels of the fast engine's ``--compute q8`` (its header gives what they compute)."""
Q8_TYPES: dict[str, int] = {name: int(GGMLQuantizationType[name])
                            for name in ("Q8_0", "Q4_0", "Q5_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}
"""Weight types :func:`q8_linear` takes: Q8_0, Q4_0, Q5_0 (their ``vec_dot_type`` is Q8_0) and the K-quants Q2_K to
Q6_K (Q8_K: what the Q2_K, Q3_K_*, Q4_K_* and Q5_K_* files hold); the others take the rounding emulation in torch
(:mod:`fast.q8_compute`)."""
_Q8_SIZES = {name: (num, *GGML_QUANT_SIZES[GGMLQuantizationType(num)]) for name, num in Q8_TYPES.items()}
Q8_MAX_ROWS = 64
"""Largest ``M`` one call of ``g4h_q8_linear`` takes (:func:`q8_linear` cuts larger ones)."""

Q8 = cpu_kernels.Library(Q8_SOURCE, FLAGS, LIBS, {"g4h_q8_linear": ([_I, _P, _L, _L, _L, _P, _L, _P, _I], _I),
                                                 "g4h_q8_quantize": ([_P, _L, _L, _P, _P], _I),
                                                 "g4h_q8k_quantize": ([_P, _L, _L, _P, _P, _P], _I),
                                                 "g4h_q8_force_isa": ([_I], _I),
                                                 "g4h_q8_isa": ([], _I)})
"""``csrc/linear_q8.c`` (:func:`q8_linear`, :func:`q8_quantize`, :func:`q8k_quantize`)."""
bind_q8 = Q8.bind
"""Load a built ``linear_q8`` library and declare its functions (also used by the tests)."""


def q8_isa() -> int | None:
    """The path :func:`q8_linear` takes here: 512 (AVX-512 VNNI), 256 (AVX2), 0 (plain C); None when not built."""
    lib = Q8.get()
    return None if lib is None else int(lib.g4h_q8_isa())


def q8_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, row_len: int) -> torch.Tensor | None:
    """``x @ W.T`` as llama.cpp's CPU backend computes it for a weight ``W`` of one of :data:`Q8_TYPES` (packed
    ``[N, row_len]`` in ``raw``), ``fast/csrc/linear_q8.c``. None when it does not apply (the caller emulates in torch).

    Q8_0 / Q4_0 / Q5_0: each row of ``x`` quantized to Q8_0 blocks (``quantize_row_q8_0``, AVX path: ties to even,
    multiplier ``127/amax``, fp16 scale), exact integer sums per block, times the two block scales in fp32, summed in
    fp32. The K-quants (Q2_K to Q6_K): each row quantized to Q8_K (``quantize_row_q8_K_ref``: 256 values, ``d =
    1/(-127/max)`` in fp32, the int16 sums of 16), exact integer sums per sub-block times its scale (Q2_K 4-bit, Q3_K
    6-bit minus 32, Q4_K / Q5_K 6-bit, Q6_K int8; the mins of Q2_K, Q4_K, Q5_K through the sums of 16), the
    super-block scale products and sums in fp32, in the order of ggml's generic ``ggml_vec_dot_q2_K_q8_K`` ...
    ``ggml_vec_dot_q6_K_q8_K`` (bit for bit, on every ISA path).

    Args:
        x: float32 ``[M, row_len]`` on the CPU, any ``M >= 1`` (cut in calls of :data:`Q8_MAX_ROWS`).
        raw: uint8 ``[N, bytes_per_row]``, contiguous, on the CPU.
        qtype: GGUF type name, one of :data:`Q8_TYPES`.
        row_len: ``K``, a multiple of 32 (256 for the K-quants).

    Returns:
        float32 ``[M, N]``, or None (another type or device, not float32, autograd, no compiler).
    """
    num = Q8_TYPES.get(qtype)
    lay = None if num is None else _layout(_Q8_SIZES, raw, qtype, row_len)  # Q2_K / Q3_K: not in _SIZES
    call = None if lay is None else _product(Q8, x, raw, qtype, row_len, None, lay)
    if call is None:
        return None
    lib, lay, x, y = call
    m, n = y.shape
    for a in range(0, m, Q8_MAX_ROWS):
        b = min(m, a + Q8_MAX_ROWS)
        _check(lib.g4h_q8_linear(num, raw.data_ptr(), lay[1], n, row_len, x[a:b].data_ptr(), b - a,
                                 y[a:b].data_ptr(), cpu_kernels.threads()),
               f"{qtype} q8 linear [{b - a}, {row_len}] x [{n}, {row_len}]")
    return y


def q8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernels' ``block_q8_0`` of the rows of ``x`` (float32 ``[M, K]``, K a multiple of 32, CPU):
    ``(d float32 [M, K/32], q int8 [M, K])``, for the tests against :func:`reference.activation_quants.quantize_q8_0`.
    None when the library is not built."""
    lib = Q8.get()
    if lib is None:
        return None
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    d = torch.empty(m, k // 32, dtype=torch.float32)
    q = torch.empty(m, k, dtype=torch.int8)
    _check(lib.g4h_q8_quantize(x.data_ptr(), m, k, d.data_ptr(), q.data_ptr()), "q8 quantize")
    return d, q


def q8k_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The kernels' ``block_q8_K`` of the rows of ``x`` (float32 ``[M, K]``, K a multiple of 256, CPU): ``(d float32
    [M, K/256], q int8 [M, K], bsums int16 [M, K/256, 16])``, for the tests against
    :func:`reference.activation_quants.quantize_q8_K` and the library's ``from_float``. None when the library is not
    built."""
    lib = Q8.get()
    if lib is None:
        return None
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    d = torch.empty(m, k // 256, dtype=torch.float32)
    q = torch.empty(m, k, dtype=torch.int8)
    bsums = torch.empty(m, k // 256, 16, dtype=torch.int16)
    _check(lib.g4h_q8k_quantize(x.data_ptr(), m, k, d.data_ptr(), q.data_ptr(), bsums.data_ptr()), "q8_K quantize")
    return d, q, bsums
