"""llama.cpp's quantized activations: what the input row of a matrix product becomes before the dot products.

Before ``ggml_mul_mat`` multiplies a weight of GGML type ``t`` with an F32 activation, the CPU backend converts each
activation row to ``t``'s *dot-product type* (``type_traits_cpu[t].vec_dot_type`` in
``ggml/src/ggml-cpu/ggml-cpu.c``, with that type's ``from_float``; :data:`VEC_DOT_TYPE`), and the dot products
then run on the converted row: integer sums per block times the two block scales for the 8-bit types, fp16 or bf16
products for the 16-bit ones. The functions here give that converted row back as float64 (each value
``d * q`` exactly, or the 16-bit value), so that a float64 product with the exact dequantized weight is what
llama.cpp computes up to its fp32 accumulation.

Which conversion runs is the one of the build the harness makes (``GGML_NATIVE=OFF``: AVX, AVX2, FMA, F16C, no
AVX-512; ``harness/engines/llamacpp/build.py``): for Q8_0 and Q8_1 the AVX path of ``arch/x86/quants.c``, which
differs from the scalar reference of ``ggml-quants.c`` in two ways (scale of the rounding ``127/amax``, not
``1/(amax/127)``; ties rounded to even by ``_mm256_round_ps``, not away from zero by ``roundf``); for Q8_K the
scalar reference (``quantize_row_q8_K`` calls ``quantize_row_q8_K_ref`` on x86), whose ``nearest_int`` rounds ties
to even too. The repacked GEMM paths (``repack.cpp``: Q4_0, IQ4_NL and Q4_K weights on AVX2, four activation rows
at a time through ``ggml_quantize_mat_q8_0_4x8`` / ``..._q8_K_4x8`` in ``arch/x86/repack.cpp``) compute the same
numbers, except that the Q8_K one takes the sign of the block's largest magnitude as positive whenever ``+amax``
occurs in the block (the scalar one takes the first element of largest magnitude): the two differ only for a block
that holds both ``+amax`` and ``-amax``, the negative first. ``tests/test_activation_quants.py`` compares every
function here with the built library, bit for bit.

One product is not a function of the rounded row alone: Q4_1 / Q5_1 weights (dot-product type Q8_1) multiply each
block's minimum by the activation block's stored sum ``s``, an fp16 rounding; :func:`q8_1_sum_correction` is what that
adds to the rounded row's product (the weights' minima from their stored blocks, :func:`block_minima`).

Every function takes float64 values of any shape whose last axis is the row (a multiple of the block size), rounds
them to float32 first (llama.cpp's activations are F32), and returns float64 of the same shape.
"""

from __future__ import annotations

import numpy as np

QK8_0 = 32
"""Elements per block of Q8_0 and Q8_1 (``ggml-common.h``)."""

QK_K = 256
"""Elements per block of Q8_K and the K-quants (``ggml-common.h``)."""

VEC_DOT_TYPE: dict[str, str] = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q1_0": "Q8_0", "Q2_0": "Q8_0", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0",
    "MXFP4": "Q8_0", "NVFP4": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1", "Q8_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
    "IQ2_XXS": "Q8_K", "IQ2_XS": "Q8_K", "IQ2_S": "Q8_K", "IQ3_XXS": "Q8_K", "IQ3_S": "Q8_K", "IQ1_S": "Q8_K",
    "IQ1_M": "Q8_K", "IQ4_XS": "Q8_K", "TQ1_0": "Q8_K", "TQ2_0": "Q8_K",
}
"""GGML weight type -> the type its activation row is converted to before the dot products: every row of
``type_traits_cpu`` in ``ggml/src/ggml-cpu/ggml-cpu.c`` (llama-cpp-python 0.3.36's llama.cpp) that has a
``vec_dot_type``. F32 weights leave the row as it is."""


def _rows(x: np.ndarray, block: int) -> np.ndarray:
    """``x`` as float32 blocks ``[..., n/block, block]`` (llama.cpp's F32 activations).

    Raises:
        ValueError: the last axis is not a multiple of ``block`` (ggml asserts the same).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] % block:
        raise ValueError(f"a row of {x.shape[-1]} values is not a whole number of blocks of {block}")
    return x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _cvt_epi32(v: np.ndarray) -> np.ndarray:
    """``_mm256_cvtps_epi32`` of float32 integers: a NaN, an infinity or a value beyond int32 gives -2^31. int64."""
    ok = np.isfinite(v) & (np.abs(v) < 2.0**31)
    return np.where(ok, v, -(2.0**31)).astype(np.int64)


def _pack_int8(v: np.ndarray) -> np.ndarray:
    """float32 integers -> int8 as the AVX path stores them: :func:`_cvt_epi32`, then the saturating ``packs`` to
    int16 and int8."""
    return np.clip(_cvt_epi32(v), -128, 127).astype(np.int8)


def _nearest_int(f: np.ndarray) -> np.ndarray:
    """``nearest_int`` of ``ggml-quants.c`` on float32 values: ``f + 12582912.f`` in float32, its low 23 bits minus
    ``0x400000`` (ties to even for ``|f| < 2^22``; an infinity gives -2^22, a NaN 0, as the C does). int64."""
    bits = (f.astype(np.float32) + np.float32(12582912.0)).astype(np.float32).view(np.int32).astype(np.int64)
    return (bits & 0x007FFFFF) - 0x00400000


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``block_q8_0`` of each block of 32: ``(d float16 [..., n/32], qs int8 [..., n/32, 32])``.

    As ``quantize_row_q8_0`` in ``ggml/src/ggml-cpu/arch/x86/quants.c`` (its AVX path), in float32: ``amax`` the
    largest magnitude, ``d = fp16(amax / 127)``, ``qs = round_even(x * (127 / amax))`` (0 where ``amax`` is 0).
    """
    b = _rows(x, QK8_0)
    amax = np.max(np.abs(b), axis=-1)
    with np.errstate(all="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    with np.errstate(all="ignore"):  # amax beyond fp16's range: d infinite, as F16C gives it
        d = (amax / np.float32(127.0)).astype(np.float16)
        return d, _pack_int8(np.rint(b * inv[..., None]))


def quantize_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``block_q8_1`` of each block of 32: ``(d float16, s float16 [..., n/32], qs int8 [..., n/32, 32])``.

    As ``quantize_row_q8_1`` in ``arch/x86/quants.c`` (AVX path): ``d`` and ``qs`` as :func:`quantize_q8_0`, and
    ``s = fp16(fp32(amax / 127) * sum)``, the block sum the Q4_1/Q5_1 dot products use for the weights' minimum: the
    sum of the int32 values before they are packed to int8, with int32 wraparound (they differ from ``qs`` only
    where ``127 / amax`` overflows, a block of subnormals: there each is -2^31).
    """
    d, qs = quantize_q8_0(x)
    b = _rows(x, QK8_0)
    amax = np.max(np.abs(b), axis=-1)
    with np.errstate(all="ignore"):
        d32 = amax / np.float32(127.0)
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
        i32 = _cvt_epi32(np.rint(b * inv[..., None])).sum(axis=-1)
        i32 = ((i32 + 2**31) % 2**32) - 2**31  # int32 wraparound
        s = (d32 * i32.astype(np.float32)).astype(np.float16)
    return d, s, qs


def quantize_q8_K(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``block_q8_K`` of each block of 256: ``(d float32 [..., n/256], qs int8 [..., n/256, 256],
    bsums int16 [..., n/256, 16])``.

    As ``quantize_row_q8_K_ref`` in ``ggml/src/ggml-quants.c`` (what ``quantize_row_q8_K`` runs on x86), in
    float32: ``max`` the first element of largest magnitude, with its sign; ``iscale = -127 / max``;
    ``qs = min(127, nearest_int(iscale * x))`` (``nearest_int`` adds 1.5 * 2^23: ties to even); ``d = 1 / iscale``
    (negative for a positive ``max``); a block of zeros gives ``d = 0``, ``qs = 0``. ``bsums``: sums of 16.
    """
    b = _rows(x, QK_K)
    a = np.abs(b)
    first = np.argmax(a, axis=-1)  # the first of the largest magnitudes, as the strict > of the C loop
    mx = np.take_along_axis(b, first[..., None], axis=-1)[..., 0]
    zero = mx == 0
    with np.errstate(all="ignore"):
        iscale = np.where(zero, np.float32(1.0), np.float32(-127.0) / np.where(zero, np.float32(1.0), mx))
    iscale = iscale.astype(np.float32)
    with np.errstate(all="ignore"):
        q = np.minimum(127, _nearest_int(b * iscale[..., None]))
    qs = np.where(zero[..., None], 0, q).astype(np.int64).astype(np.uint8).view(np.int8)  # C's int -> int8
    d = np.where(zero, np.float32(0.0), np.float32(1.0) / iscale).astype(np.float32)
    bsums = qs.reshape(*qs.shape[:-1], QK_K // 16, 16).astype(np.int16).sum(axis=-1, dtype=np.int16)
    return d, qs, bsums


def q8_0(x: np.ndarray) -> np.ndarray:
    """An activation row as llama.cpp's Q8_0 dot products see it: ``d * qs`` of :func:`quantize_q8_0`, float64
    (exact). [..., n] -> [..., n], n a multiple of 32. Source: ``quantize_row_q8_0``, ``arch/x86/quants.c``."""
    d, qs = quantize_q8_0(x)
    with np.errstate(all="ignore"):  # an infinite scale times 0
        return (qs.astype(np.float64) * d.astype(np.float64)[..., None]).reshape(np.shape(x))


def q8_1(x: np.ndarray) -> np.ndarray:
    """An activation row as the Q8_1 dot products (Q4_1, Q5_1 weights) see it: its values are those of
    :func:`q8_0`. The block sum ``s`` multiplies the weights' minimum, which a float64 product with the dequantized
    weight gives as ``m * sum(d * qs)``: :func:`q8_1_sum_correction` adds the fp16 rounding of ``s`` that this
    row cannot carry. [..., n] -> [..., n]. Source: ``quantize_row_q8_1``, ``arch/x86/quants.c``."""
    d, _, qs = quantize_q8_1(x)
    with np.errstate(all="ignore"):  # an infinite scale times 0
        return (qs.astype(np.float64) * d.astype(np.float64)[..., None]).reshape(np.shape(x))


BLOCK_MIN_OFFSET: dict[str, tuple[int, int]] = {"Q4_1": (20, 2), "Q5_1": (24, 2)}
"""Weight types whose dot product takes the activation block's sum (vec_dot Q8_1) -> (bytes per block of 32, byte
offset of the block's fp16 minimum ``m``): ``block_q4_1`` is ``d, m, qs[16]``, ``block_q5_1`` is ``d, m, qh[4],
qs[16]`` (``ggml/src/ggml-common.h``)."""


def block_minima(stored: np.ndarray, weight_type: str) -> np.ndarray:
    """The fp16 minimum ``m`` of every block of a Q4_1 / Q5_1 weight, from its stored bytes, as float64.
    uint8 [..., bytes per row] -> [..., row / 32].

    Raises:
        KeyError: a type without a block minimum in :data:`BLOCK_MIN_OFFSET`.
    """
    size, at = BLOCK_MIN_OFFSET[weight_type]
    b = np.asarray(stored, dtype=np.uint8)
    b = b.reshape(*b.shape[:-1], b.shape[-1] // size, size)
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float64)


def q8_1_sum_gap(x: np.ndarray) -> np.ndarray:
    """Per block of 32, what the Q8_1 block's stored sum ``s`` (:func:`quantize_q8_1`: ``fp16(fp32(amax/127) *
    sum(q))``) differs by from the block sum of the rounded row :func:`q8_1` (``d16 * sum(qs)``, exact in float64):
    ``s - d16 * sum(qs)``. [..., n] -> float64 [..., n/32], n a multiple of 32. Source: ``quantize_row_q8_1``,
    ``ggml/src/ggml-cpu/arch/x86/quants.c``; ``block_q8_1`` (``ggml/src/ggml-common.h``: ``s``, ``ggml_half``,
    "d * sum(qs[i])")."""
    d, s, qs = quantize_q8_1(x)
    with np.errstate(all="ignore"):  # an infinite scale (amax beyond fp16's range): the row is infinite too
        return s.astype(np.float64) - d.astype(np.float64) * qs.astype(np.float64).sum(axis=-1)


def q8_1_sum_correction(x: np.ndarray, minima: np.ndarray) -> np.ndarray:
    """What a Q4_1 / Q5_1 product of llama.cpp adds to the float64 product of the rounded row (:func:`q8_1`) with
    the exactly dequantized weight: ``sum_b m[o, b] * (s_b - d16_b * sum(qs_b))`` (:func:`q8_1_sum_gap`).

    llama.cpp's dot product of a weight row (blocks ``d_w, m, q_w``) with a Q8_1 row (blocks ``d, s, qs``) is, per
    block, ``d_w * d * sum(q_w * qs) + m * s`` (``ggml_vec_dot_q4_1_q8_1`` / ``ggml_vec_dot_q5_1_q8_1``: in
    ``ggml/src/ggml-cpu/arch/x86/quants.c`` the AVX2 path adds ``m * s`` into ``summs`` per block and the scaled
    integer sums into an FMA accumulator, then ``hsum(acc) + summs``; the scalar ``..._generic`` in
    ``ggml/src/ggml-cpu/quants.c`` sums ``d_w*d*sumi + m*s`` per block; all in fp32). The dequantized weight is
    ``d_w * q_w + m``, so the rounded row times it gives ``m * d16 * sum(qs)`` where llama.cpp takes ``m * s``: this
    adds the difference, leaving fp32 accumulation only (``tests/test_activation_quants.py``).

    Args:
        x: the product's input, float64 [..., n] (rounded to float32 first, as :func:`quantize_q8_1` does).
        minima: the weight's block minima, float64 [out, n/32] (:func:`block_minima`).

    Returns:
        float64 [..., out].
    """
    with np.errstate(all="ignore"):
        return q8_1_sum_gap(x) @ np.asarray(minima, dtype=np.float64).T


def q8_K(x: np.ndarray) -> np.ndarray:
    """An activation row as the K-quant and i-quant dot products see it: ``d * qs`` of :func:`quantize_q8_K`,
    float64 (exact). [..., n] -> [..., n], n a multiple of 256. Source: ``quantize_row_q8_K_ref``,
    ``ggml/src/ggml-quants.c``."""
    d, qs, _ = quantize_q8_K(x)
    with np.errstate(all="ignore"):  # an infinite scale times 0
        return (qs.astype(np.float64) * d.astype(np.float64)[..., None]).reshape(np.shape(x))


def f16(x: np.ndarray) -> np.ndarray:
    """An activation row as the F16 dot products see it: each value rounded to fp16 (round to nearest even,
    subnormals kept, beyond 65504 infinite: F16C's ``_mm256_cvtps_ph`` in ``ggml_cpu_fp32_to_fp16``,
    ``ggml-cpu.c``), after float32. [...] -> [...]."""
    with np.errstate(all="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float16).astype(np.float64)


def bf16(x: np.ndarray) -> np.ndarray:
    """An activation row as the BF16 dot products see it: each float32 value rounded to bfloat16 by
    ``ggml_compute_fp32_to_bf16`` (``ggml/src/ggml-impl.h``: add ``0x7fff`` plus the kept lowest bit, drop 16 bits:
    nearest even, subnormals kept; a NaN stays a quiet NaN), through ``ggml_cpu_fp32_to_bf16``. [...] -> [...]."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float64).astype(np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return (r << 16).astype(np.uint32).view(np.float32).astype(np.float64).reshape(np.shape(x))


ROUNDING = {"F16": f16, "BF16": bf16, "Q8_0": q8_0, "Q8_1": q8_1, "Q8_K": q8_K}
"""Dot-product type -> its round trip (``F32``: none)."""


def round_activations(x: np.ndarray, weight_type: str | None) -> np.ndarray:
    """``x`` as llama.cpp's CPU backend multiplies it with a weight of GGML type ``weight_type``: rounded to that
    type's dot-product type (:data:`VEC_DOT_TYPE`, :data:`ROUNDING`); unchanged for F32 weights and for None (a
    weight with no GGML type: float64, safetensors). [..., n] -> [..., n].

    Raises:
        KeyError: a GGML type :data:`VEC_DOT_TYPE` does not know (the caller says it cannot emulate it).
    """
    if weight_type is None:
        return x
    fn = ROUNDING.get(VEC_DOT_TYPE[weight_type])
    return x if fn is None else fn(x)
