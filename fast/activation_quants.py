"""The torch twin of :mod:`reference.activation_quants`: llama.cpp's activation rows as its dot products see them
(Q8_0, Q8_1, Q8_K, F16, BF16 round trips), under the same names, for tensors on any device.

The same float32 operations as the reference's (each a correctly rounded IEEE operation in torch; ``torch.round``
rounds ties to even), so the values are the same bit for bit (``tests/test_activation_quants.py``). Each function
takes a float tensor whose last axis is the row (a multiple of the block size), rounds it to float32 first, and
returns float64 (``d * q`` is exact there, not always in float32 for Q8_K).
"""

from __future__ import annotations

import torch

from gemma4_harness.reference.activation_quants import QK8_0, QK_K, VEC_DOT_TYPE

__all__ = ["VEC_DOT_TYPE", "q8_0", "q8_1", "q8_1_sum_gap", "q8_1_sum_correction", "q8_K", "f16", "bf16",
           "round_activations"]


def _rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as float32 blocks ``[..., n/block, block]``. Raises ValueError: a row that is not whole blocks."""
    if x.shape[-1] % block:
        raise ValueError(f"a row of {x.shape[-1]} values is not a whole number of blocks of {block}")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pack_int8(v: torch.Tensor) -> torch.Tensor:
    """As :func:`reference.activation_quants._pack_int8`: non-finite or beyond int32 -> -2^31, then saturated."""
    ok = torch.isfinite(v) & (v.abs() < 2.0**31)
    return torch.where(ok, v, torch.full_like(v, -(2.0**31))).clamp(-128, 127)


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.activation_quants.q8_0` in torch: ``fp16(amax/127) * round_even(x * (127/amax))`` per block
    of 32. [..., n] -> float64 [..., n]. Source: ``quantize_row_q8_0``, ``ggml/src/ggml-cpu/arch/x86/quants.c``."""
    b = _rows(x, QK8_0)
    amax = b.abs().amax(dim=-1)
    inv = torch.where(amax != 0, torch.tensor(127.0, dtype=torch.float32, device=b.device) / amax,
                      torch.zeros_like(amax))
    d = (amax / 127.0).to(torch.float16).to(torch.float64)
    qs = _pack_int8(torch.round(b * inv[..., None])).to(torch.float64)
    return (qs * d[..., None]).reshape(x.shape)


def q8_1(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.activation_quants.q8_1` in torch (the values of :func:`q8_0`). [..., n] -> float64 [..., n].
    Source: ``quantize_row_q8_1``, ``arch/x86/quants.c``."""
    return q8_0(x)


def q8_1_sum_gap(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.activation_quants.q8_1_sum_gap` in torch: per block of 32, ``s - d16 * sum(qs)``, ``s =
    fp16(fp32(amax/127) * sum)`` over the int32 values before they are packed (int32 wraparound). [..., n] ->
    float64 [..., n/32]. Source: ``quantize_row_q8_1``, ``arch/x86/quants.c``; ``block_q8_1``, ``ggml-common.h``."""
    b = _rows(x, QK8_0)
    amax = b.abs().amax(dim=-1)
    inv = torch.where(amax != 0, torch.tensor(127.0, dtype=torch.float32, device=b.device) / amax,
                      torch.zeros_like(amax))
    v = torch.round(b * inv[..., None])
    ok = torch.isfinite(v) & (v.abs() < 2.0**31)
    i32 = torch.where(ok, v, torch.full_like(v, -(2.0**31))).to(torch.int64).sum(dim=-1)
    i32 = ((i32 + 2**31) % 2**32) - 2**31  # int32 wraparound
    s = ((amax / 127.0) * i32.to(torch.float32)).to(torch.float16).to(torch.float64)
    d = (amax / 127.0).to(torch.float16).to(torch.float64)
    return s - d * v.clamp(-128, 127).where(ok, torch.full_like(v, -128.0)).to(torch.float64).sum(dim=-1)


def q8_1_sum_correction(x: torch.Tensor, minima: torch.Tensor) -> torch.Tensor:
    """:func:`reference.activation_quants.q8_1_sum_correction` in torch: ``q8_1_sum_gap(x) @ minima.T``, what a
    Q4_1 / Q5_1 product of llama.cpp adds to the rounded row's product with the dequantized weight. [..., n],
    [out, n/32] -> float64 [..., out]. Source: ``ggml_vec_dot_q4_1_q8_1`` / ``ggml_vec_dot_q5_1_q8_1``,
    ``ggml/src/ggml-cpu/arch/x86/quants.c``."""
    return q8_1_sum_gap(x) @ minima.to(device=x.device, dtype=torch.float64).T


def q8_K(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.activation_quants.q8_K` in torch: ``iscale = -127/max`` (``max`` the first element of
    largest magnitude, signed), ``q = min(127, nearest_int(iscale * x))``, value ``q / iscale`` as ``fp32(1/iscale)
    * q``, per block of 256. [..., n] -> float64 [..., n]. Source: ``quantize_row_q8_K_ref``, ``ggml-quants.c``."""
    b = _rows(x, QK_K)
    first = b.abs().argmax(dim=-1, keepdim=True)  # torch: the first index of the maximum, as the C loop's strict >
    mx = torch.gather(b, -1, first)[..., 0]
    zero = mx == 0
    iscale = torch.tensor(-127.0, dtype=torch.float32, device=b.device) / torch.where(zero, torch.ones_like(mx), mx)
    iscale = torch.where(zero, torch.ones_like(iscale), iscale)
    f = (b * iscale[..., None]) + 12582912.0  # nearest_int: float32 add, then the low 23 bits
    q = (f.view(torch.int32).to(torch.int64) & 0x007FFFFF) - 0x00400000
    q = torch.clamp(q, max=127)
    q = torch.where(zero[..., None], torch.zeros_like(q), q)
    q = ((q & 0xFF) ^ 0x80) - 0x80  # C's int -> int8: the low byte, signed
    d = torch.where(zero, torch.zeros_like(iscale), 1.0 / iscale).to(torch.float64)
    return (q.to(torch.float64) * d[..., None]).reshape(x.shape)


def f16(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.activation_quants.f16` in torch: float32, then fp16 (nearest even). [...] -> float64."""
    return x.to(torch.float32).to(torch.float16).to(torch.float64)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """:func:`reference.activation_quants.bf16` in torch: float32, then bfloat16 (nearest even; torch's conversion
    keeps a NaN a NaN). [...] -> float64."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)


ROUNDING = {"F16": f16, "BF16": bf16, "Q8_0": q8_0, "Q8_1": q8_1, "Q8_K": q8_K}
"""Dot-product type -> its round trip (``F32``: none)."""


def round_activations(x: torch.Tensor, weight_type: str | None) -> torch.Tensor:
    """:func:`reference.activation_quants.round_activations` in torch: ``x`` rounded to the dot-product type of a
    weight of GGML type ``weight_type`` (unchanged, in its own dtype, for F32 and None); float64 otherwise.

    Raises:
        KeyError: a GGML type :data:`VEC_DOT_TYPE` does not know.
    """
    if weight_type is None:
        return x
    fn = ROUNDING.get(VEC_DOT_TYPE[weight_type])
    return x if fn is None else fn(x)
