"""Fused dequantize-and-multiply CUDA kernels for GGUF-packed weights, written in Triton.

Why: on CUDA, :func:`fast.quants.linear` without these kernels dequantizes a chunk of
rows of the packed weight into a float buffer with torch, then multiplies (``x @ w.T``):
every weight is written and re-read as a float, several times the packed bytes. For
decode and small batches (1 to :data:`MAX_ROWS` rows of ``x``) the kernels here read
each packed byte from device memory, decode it in registers and multiply, with no
float copy of the weight.

What: ``y[M, N] = x[M, K] @ dequant(W)[N, K].T`` for ``W`` packed Q8_0 or Q4_K
(:data:`TYPES`). The dequantized weights are gguf-py's values exactly (fp16 scale
fields widened to float32; Q8_0 ``d * q``; Q4_K ``(d * sc) * q - (dmin * m)``, each
multiply and subtract rounded on its own: the kernels are compiled with
``enable_fp_fusion=False`` so the compiler does not contract them into an FMA). ``x``
(float32, bfloat16 or float16) is widened to float32 (exact), the products are summed in
float32 into a float32 ``[M, N]`` buffer, and torch casts it once to ``x.dtype`` (round to
nearest even; an extra ``M * N * 4`` bytes for 16-bit ``x``). Block layouts: the GGML block
formats (``block_q8_0``: fp16 ``d``, 32 int8 ``qs``, 34 bytes; ``block_q4_K``: fp16
``d``, fp16 ``dmin``, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles, 144 bytes
for 256 weights; the table in :mod:`fast.quants`); the reference for the values is
gguf-py's ``gguf.quants`` (``Q8_0.dequantize_blocks``, ``Q4_K.dequantize_blocks``).

No TF32, no tensor cores: the product is ``tl.dot`` on float32 tiles with
``input_precision="ieee"`` (Triton's default for float32 on NVIDIA is ``"tf32"``, which
would round ``x`` and ``W`` to 10-bit mantissas). Triton lowers an IEEE float32 dot to
multiply-adds on the CUDA cores. 16-bit ``x`` takes the same float32 path (widened in
registers), so the weights are never rounded to 16 bits (the dequantize-then-multiply
path casts them to ``x.dtype`` first).

Batch invariance: every tile size (:data:`BLOCK_M`, :data:`BLOCK_N`, the ``BLOCK_K`` of
each type) and the warp count are constants, never functions of ``M``; ``M`` is a
runtime argument the compiler is told not to specialize on (``do_not_specialize``;
``K``, the type and the tile sizes are compile-time constants: one compile per row length), so
every ``M`` from 1 to :data:`MAX_ROWS` runs the same compiled kernel; rows past ``M`` in
the last row tile are loaded as zeros and only change which outputs are stored. So the
arithmetic for output ``y[m, n]`` (which products, summed in which order) is the same
whatever ``M`` is and whatever the other rows hold, and a row's result is bit-identical
across batch sizes and neighbours. What is guaranteed: the same bits on one GPU model with
one Triton version and one driver (same compiled code, the order within a tile fixed by
the compiler's layout, which does not depend on a row's position in the tile). What is
not: the same bits across GPU architectures or Triton versions (the summation order inside
a tile is the compiler's choice), nor equality with the CPU kernels of
:mod:`fast.quant_kernels` (another fixed order); both stay within the float32 rounding
bound of the exact product (``tests/test_cuda_kernels.py``).

When it is not used (:func:`linear` returns None and the caller keeps its path): a tensor
not on CUDA (except in interpreter mode, below), ``x`` and ``raw`` on different devices,
``x`` not float32/bfloat16/float16 or not 2-D, more than :data:`MAX_ROWS` rows, a type not
in :data:`TYPES`, raw bytes that are not one contiguous ``[N, bytes_per_row]`` uint8
block, ``x`` requiring grad, Triton not importable, ``G4H_CUDA_KERNEL=0`` in the
environment, or inside :func:`disabled`. The choice depends on shapes, dtypes and devices,
never on values.

Interpreter mode: with ``TRITON_INTERPRET=1`` in the environment, :func:`linear` also
takes CPU tensors and runs the very same kernel source through Triton's NumPy interpreter
(slow; for tests). Triton reads the variable when a kernel is defined (``triton.jit``),
which :func:`_build` does once per process, at the first call: the mode seen then holds
for the process (:func:`status` says so when the variable changed afterwards). The
interpreter checks the decoding and the tiling (indices, masks, layouts, dtypes); it runs
``tl.dot`` as a NumPy float32 matmul, so it cannot show the GPU's summation order, code
generation or speed.

Triton is imported lazily: a CPU install does not have it (every CUDA build of torch
depends on it; the ``test`` extra installs it for the interpreter tests).
"""

from __future__ import annotations

import contextlib
import os

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["MAX_ROWS", "TYPES", "BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_WARPS", "status", "disabled", "linear"]

MAX_ROWS = 64
"""Largest ``M`` :func:`linear` takes (decode and small batches); above it the caller dequantizes and uses a GEMM."""

TYPES: dict[str, int] = {name: int(GGMLQuantizationType[name]) for name in ("Q8_0", "Q4_K")}
"""GGUF type name -> GGML type number, for the types the kernels decode."""

BLOCK_M = 8
"""Rows of ``x`` per program (constant: a row's arithmetic must not depend on ``M``)."""
BLOCK_N = 64
"""Rows of ``W`` (outputs) per program."""
BLOCK_K = {"Q8_0": 128, "Q4_K": 128}
"""Elements of ``K`` per loop step (4 Q8_0 blocks; half a Q4_K super-block)."""
NUM_WARPS = 4
"""Warps per program."""

_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SIZES = {name: GGML_QUANT_SIZES[GGMLQuantizationType(num)] for name, num in TYPES.items()}

_mode: bool | None = None  # interpreter mode the kernels were built in (None: not built)
_why = ""  # why they could not be built
_off = 0  # > 0 inside disabled()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


tl = None
"""``triton.language``, bound by :func:`_build` (the kernel bodies below look it up as a module global)."""
_SOURCES: list = []  # the kernel functions, made Triton JIT functions by _build()


def _jit(fn):
    """Mark a kernel function for :func:`_build` (which rebinds its module name to ``triton.jit(fn)``)."""
    _SOURCES.append(fn)
    return fn


@_jit
def _f16_at(ptr, mask):
    """The little-endian fp16 field at byte pointers ``ptr``, widened to float32 (two uint8 loads, bitcast)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def _q8_0_tile(row, k, n_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantized float32 ``[BLOCK_N, BLOCK_K]`` Q8_0 tile: rows at byte pointers ``row`` ``[BLOCK_N]``, elements
    ``k`` ``[BLOCK_K]`` (a multiple of 32 from a multiple of 32; ``k >= K`` give 0). Element ``e`` of block ``b`` is
    int8 byte ``34 b + 2 + e`` times the fp16 ``d`` at byte ``34 b``."""
    NB: tl.constexpr = BLOCK_K // 32
    ok = n_ok[:, None] & (k < K)[None, :]
    q = tl.load(row[:, None] + (k // 32 * 34 + 2 + k % 32)[None, :], mask=ok, other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)
    kb = tl.max(k.reshape(NB, 32), axis=1) // 32  # block number of each group of 32 elements
    d = _f16_at(row[:, None] + (kb * 34)[None, :], n_ok[:, None] & (kb * 32 < K)[None, :])  # [BLOCK_N, NB]
    return (q.reshape(BLOCK_N, NB, 32) * d[:, :, None]).reshape(BLOCK_N, BLOCK_K)


@_jit
def _q4_k_tile(row, k, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantized float32 ``[BLOCK_N, BLOCK_K]`` Q4_K tile (``K`` a multiple of 256: no ``k`` mask needed).

    Super-block of 256 elements, 144 bytes: fp16 ``d`` at 0, fp16 ``dmin`` at 2, 12 scale bytes at 4, 128 bytes of
    nibbles at 16. Element ``e``: nibble ``(e // 32) % 2`` (low, high) of byte ``16 + 32 (e // 64) + e % 32``.
    Sub-block ``s = e // 32`` takes its 6-bit scale and min from scale bytes A, B, C = ``s % 4``, ``s % 4 + 4``,
    ``s % 4 + 8``: for ``s < 4`` ``sc = A & 63``, ``m = B & 63``; for ``s >= 4`` ``sc = (C & 15) | (A >> 6) << 4``,
    ``m = (C >> 4) | (B >> 6) << 4``. Value ``(d * sc) * q - (dmin * m)`` (gguf-py's order).
    """
    NB: tl.constexpr = BLOCK_K // 32
    ok = n_ok[:, None]
    e = k % 256
    byte = tl.load(row[:, None] + (k // 256 * 144 + 16 + e // 64 * 32 + e % 32)[None, :], mask=ok, other=0)
    q = ((byte >> (e // 32 % 2 * 4).to(tl.uint8)[None, :]) & 15).to(tl.float32)
    ks = tl.max(k.reshape(NB, 32), axis=1)  # one element of each sub-block
    s = (ks % 256 // 32)[None, :]
    base = row[:, None] + (ks // 256 * 144)[None, :]  # [BLOCK_N, NB] super-block of each sub-block
    a = tl.load(base + 4 + s % 4, mask=ok, other=0)
    b = tl.load(base + 8 + s % 4, mask=ok, other=0)
    c = tl.load(base + 12 + s % 4, mask=ok, other=0)
    high = s >= 4
    sc = tl.where(high, (c & 15) | ((a >> 6) << 4), a & 63).to(tl.float32)
    mn = tl.where(high, (c >> 4) | ((b >> 6) << 4), b & 63).to(tl.float32)
    dl = _f16_at(base, ok) * sc  # [BLOCK_N, NB]
    ml = _f16_at(base + 2, ok) * mn
    w = q.reshape(BLOCK_N, NB, 32) * dl[:, :, None] - ml[:, :, None]
    return w.reshape(BLOCK_N, BLOCK_K)


@_jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, row_bytes, stride_xm, stride_ym, QTYPE: tl.constexpr,
                   K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``y[M, N] = x[M, K] @ dequant(W)[N, K].T``: one program per (row tile, weight tile), a 1-D grid.

    ``QTYPE`` (the GGML type number), ``K`` and the block sizes are compile-time constants; ``M`` is a runtime
    value the compiler does not specialize on.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # the row tiles of one weight tile run next to each other (its bytes stay in L2)
    pid_n = pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    row = w_ptr + rn.to(tl.int64) * row_bytes  # [BLOCK_N] byte pointers to the rows of W
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :],
                     other=0.0).to(tl.float32)
        if QTYPE == 8:
            wt = _q8_0_tile(row, k, n_ok, K, BLOCK_N, BLOCK_K)
        else:
            wt = _q4_k_tile(row, k, n_ok, BLOCK_N, BLOCK_K)
        # float32 operands, IEEE products and sums: no TF32 (Triton's default input precision for float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee", out_dtype=tl.float32)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])  # y is float32


def _build() -> None:
    """Make the kernel functions Triton JIT functions (rebinding their module names), once per process.

    Raises: ImportError when triton is not installed.
    """
    global tl
    # lazy heavy imports: only CUDA machines (and the interpreter tests) have triton; a CPU install lacks it
    import triton  # lazy heavy import (see above)
    import triton.language as language  # lazy heavy import (see above)

    tl = language
    g = globals()
    for fn in _SOURCES:
        g[fn.__name__] = triton.jit(fn, do_not_specialize=["M"] if fn.__name__ == "_linear_kernel" else None)


def _ready(interp: bool) -> bool:
    """Build the kernels on first use; True when they are built for the mode ``interp``."""
    global _mode, _why
    if _mode is None and not _why:
        try:
            _build()
            _mode = interp
        except ImportError as e:
            _why = f"triton is not importable: {e}"
    return _mode is interp


def status() -> tuple[bool, str]:
    """``(available, reason)``: whether :func:`linear` can run here, and why not (or how, in interpreter mode).

    Available means: ``G4H_CUDA_KERNEL`` is not ``0``, Triton imports and the kernels build, and either a CUDA
    device is present or ``TRITON_INTERPRET=1`` (then the reason says so). Imports triton (a heavy import).
    """
    if os.environ.get("G4H_CUDA_KERNEL", "1") == "0":
        return False, "disabled by G4H_CUDA_KERNEL=0"
    interp = _interpreting()
    if not interp and not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU through the interpreter)"
    if not _ready(interp):
        return False, _why or (f"the kernels were built {'with' if _mode else 'without'} TRITON_INTERPRET=1 in this "
                               f"process (Triton reads it when a kernel is defined)")
    return True, "Triton interpreter (TRITON_INTERPRET=1): CPU tensors accepted" if interp else ""


@contextlib.contextmanager
def disabled():
    """Within the ``with`` block :func:`linear` returns None (callers take the dequantize-then-multiply path): for
    benchmarks against that path, and tests. Not thread-safe."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def _applies(x: torch.Tensor, raw: torch.Tensor, qtype: str, row_len: int) -> bool:
    sizes = _SIZES.get(qtype)
    if sizes is None or x.device != raw.device or x.dtype not in _X_DTYPES or x.dim() != 2:
        return False
    if not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != row_len or torch.is_grad_enabled() and x.requires_grad:
        return False
    bs, ts = sizes
    return (raw.dtype == torch.uint8 and raw.dim() == 2 and row_len > 0 and row_len % bs == 0
            and raw.shape[1] == row_len // bs * ts and raw.is_contiguous())


def linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, row_len: int) -> torch.Tensor | None:
    """``x @ dequant(W).T`` for ``W`` the packed ``[N, row_len]`` matrix in ``raw``; None when the kernel cannot.

    Args:
        x: ``[M, row_len]``, float32, bfloat16 or float16, ``1 <= M <= MAX_ROWS``, on a CUDA device (or on the CPU
            with ``TRITON_INTERPRET=1``); made contiguous if it is not.
        raw: uint8 ``[N, bytes_per_row]``, contiguous, on ``x``'s device (a :class:`fast.quants.QuantizedTensor`'s
            bytes), GGML blocks of ``qtype``.
        qtype: GGUF type name (``"Q8_0"``, ``"Q4_K"``).
        row_len: elements per row of ``W`` (``K``), a multiple of the type's block size (32, 256).

    Returns:
        ``[M, N]`` in ``x.dtype`` (a new tensor): the float32 sum of ``x`` (widened) times the exact gguf-py values
        of ``W``, rounded once to ``x.dtype``; or None (see the module docstring for when).

    Raises: nothing of its own for inputs it declines (it returns None); Triton's compile or launch errors pass
    through.
    """
    if _off or os.environ.get("G4H_CUDA_KERNEL", "1") == "0":
        return None
    interp = _interpreting()
    if x.device.type != "cuda" and not (interp and x.device.type == "cpu"):
        return None
    if not _applies(x, raw, qtype, row_len):
        return None
    if not _ready(interp):
        return None
    x = x.contiguous()
    m, n = x.shape[0], raw.shape[0]
    # float32 out; the cast to a 16-bit x.dtype is torch's (round to nearest even): the interpreter's own
    # float32 -> bfloat16 conversion truncates, so an in-kernel cast would differ between it and the GPU
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if n == 0:
        return y.to(x.dtype)
    grid = (_cdiv(m, BLOCK_M) * _cdiv(n, BLOCK_N),)
    _linear_kernel[grid](x, raw, y, m, n, raw.shape[1], x.stride(0), y.stride(0), QTYPE=TYPES[qtype], K=row_len,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K[qtype], num_warps=NUM_WARPS,
                         enable_fp_fusion=False)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints (what ``triton.cdiv`` computes, without importing triton)."""
    return -(-a // b)
