"""The GGUF block formats in torch: each type's block layout and decoder, on the block's own device (CPU or CUDA).

Source of the formats: the block structs of ggml's ``ggml-common.h``
(``block_q4_0``, ``block_q4_K``, ...) and the NumPy reference decoder in
gguf-py's ``gguf/quants.py``. Every decoder here reproduces gguf-py's
arithmetic *bit for bit*: the same float32 operations in the same order
(an fp16 scale is widened to float32 first, then multiplied; K-quants form
``d * sc`` and ``dmin * m`` first, then ``(d * sc) * q - (dmin * m)``), with
each multiply and add a separate, correctly rounded float32 operation (no
fused multiply-add). ``tests/test_fast_quants.py`` checks the equality with
``gguf.quants.dequantize`` for every type.

Block layouts (``QK_K`` = 256; all multi-byte fields little-endian; ``f16`` an
IEEE half; element ``i`` of a block is ``y[i]``):

=====  =====  ======  =====================================================================
type   elems  bytes   fields, in byte order                         value
=====  =====  ======  =====================================================================
F32    1      4       float32                                       x
F16    1      2       float16                                       float(x)
BF16   1      2       bfloat16 (top half of a float32)              float(x)
Q4_0   32     18      d f16, qs[16] (y[j] low nibble of qs[j],      d * (q - 8)
                      y[j+16] high nibble)
Q4_1   32     20      d f16, m f16, qs[16] (as Q4_0)                d * q + m
Q5_0   32     22      d f16, qh[4] (uint32; bit j = bit 4 of y[j]), d * (q - 16)
                      qs[16] (low 4 bits, as Q4_0)
Q5_1   32     24      d f16, m f16, qh[4], qs[16]                   d * q + m
Q8_0   32     34      d f16, qs[32] int8                            d * q
Q2_K   256    84      scales[16] (low nibble scale, high nibble     (d * sc) * q - (dmin * m)
                      min, per 16 elements), qs[64] (2-bit),
                      d f16, dmin f16
Q3_K   256    110     hmask[32] (bit clear = subtract 4), qs[64]    (d * (sc - 32)) * q
                      (low 2 bits), scales[12] (16 x 6-bit),
                      d f16
Q4_K   256    144     d f16, dmin f16, scales[12] (8 x 6-bit scale  (d * sc) * q - (dmin * m)
                      + 8 x 6-bit min, per 32 elements),
                      qs[128] (4-bit)
Q5_K   256    176     d f16, dmin f16, scales[12], qh[32]           (d * sc) * q - (dmin * m)
                      (bit k of qh[j] = bit 4 of y[32k+j]), qs[128]
Q6_K   256    210     ql[128] (low 4 bits), qh[64] (high 2 bits),   (d * sc) * (q - 32)
                      scales[16] int8 (per 16 elements), d f16
IQ4_NL 32     18      d f16, qs[16] (4-bit indices, as Q4_0)        d * kvalues_iq4nl[q]
=====  =====  ======  =====================================================================

NaN: with Inf/NaN scale fields (never in a sane file) NaN positions match
gguf-py but NaN payload bits may not (torch's fp16 -> fp32 conversion quiets
signalling NaNs, NumPy's keeps them; CUDA makes canonical NaNs). Every other
value, Inf included, is bit-identical.

:mod:`fast.quants` decodes whole tensors and rows with these (:func:`~fast.quants.dequantize`,
:class:`~fast.quants.QuantizedTensor`, :func:`~fast.quants.linear`).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from gemma4_harness.reference.errors import ModelFileError


QK_K = 256


class UnsupportedQuantTypeError(ModelFileError, ValueError):
    """A GGUF tensor type that :mod:`fast.quants` cannot dequantize.

    A :class:`ValueError` (what callers of :func:`dequantize` catch) and a
    :class:`reference.errors.ModelFileError` (so the CLI reports it as one line).
    """


# --------------------------------------------------------------------------- helpers


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 field at byte ``off`` of each block of ``b`` (n, type_size) uint8, widened to float32: (n, 1)."""
    return b[:, off:off + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(values: Sequence[int], device: torch.device, ndim_after: int) -> torch.Tensor:
    """uint8 shift amounts shaped ``(len(values), 1, ..., 1)`` with ``ndim_after`` trailing singleton dims (cached)."""
    return _shifts_cached(tuple(values), device, ndim_after)


@functools.lru_cache(maxsize=64)
def _shifts_cached(values: tuple[int, ...], device: torch.device, ndim_after: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).view(-1, *([1] * ndim_after))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Split bytes into 4-bit values: (..., k) uint8 -> (..., 2, k) with [..., 0, :] low and [..., 1, :] high nibbles."""
    return (qs.unsqueeze(-2) >> _shifts((0, 4), qs.device, 1)) & 0x0F


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """Little-endian bits of a packed bit field: (n, k) uint8 -> (n, 8 * k); bit ``8 * byte + i`` is bit i of that byte."""
    n, k = qh.shape
    return ((qh.unsqueeze(-1) >> _shifts(range(8), qh.device, 0)) & 1).reshape(n, 8 * k)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K / Q5_K scale field: (n, 12) uint8 -> (sc, m), each (n, 8) uint8 in 0..63.

    Bytes 0-3 hold the low 6 bits of scales 0-3 (top 2 bits: high bits of scales 4-7),
    bytes 4-7 the same for mins, bytes 8-11 the low nibbles of scales 4-7 (low half)
    and of mins 4-7 (high half).
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


# --------------------------------------------------------------------------- block decoders
# Each takes blocks b (n, type_size) uint8 and out (n, block_size) float32 (contiguous),
# writes the decoded values into out and returns it. The integer quants are copied
# into out first (small integers are exact in float32; so is subtracting the
# offset), then scaled in place: only the float32 multiplies and adds round, one
# operation at a time, in gguf-py's order.


def _put_nibbles(qs: torch.Tensor, out: torch.Tensor) -> None:
    """out (n, g, 2, k) float32 <- low / high nibbles of qs (n, g, k) uint8."""
    out[:, :, 0] = qs & 0x0F
    out[:, :, 1] = qs >> 4


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    _put_nibbles(b[:, 2:18].unsqueeze(1), out.view(n, 1, 2, 16))
    return out.sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    _put_nibbles(b[:, 4:20].unsqueeze(1), out.view(n, 1, 2, 16))
    return out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit quants of Q5_0 / Q5_1 blocks: qh (n, 4), qs (n, 16) uint8 -> (n, 32) uint8 in 0..31."""
    n = qs.shape[0]
    return _nibbles(qs).reshape(n, 32) | (_bits(qh) << 4)


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(_q5(b[:, 2:6], b[:, 6:22]))
    return out.sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(_q5(b[:, 4:8], b[:, 8:24]))
    return out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(b[:, 2:34].view(torch.int8))
    return out.mul_(_f16(b, 0))


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).unsqueeze(-1)  # (n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    # qs[32h + j] >> 2s holds y[128h + 32s + j]
    qs = b[:, 16:80].reshape(n, 2, 1, 32)
    out.view(n, 2, 4, 32).copy_((qs >> _shifts((0, 2, 4, 6), b.device, 1)) & 3)
    out.view(n, 16, 16).mul_(dl).sub_(ml)
    return out


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # scale i (0..15): low nibble from byte i % 8 (low half for i < 8, high half after),
    # high 2 bits from byte 8 + i % 4, bits 2 * (i // 4).
    lo = _nibbles(scales[:, 0:8]).reshape(n, 16)
    hi = ((scales[:, 8:12].unsqueeze(1) >> _shifts((0, 2, 4, 6), b.device, 1)) & 3).reshape(n, 16)
    sc = (lo | (hi << 4)).to(torch.float32) - 32
    dl = (d * sc).unsqueeze(-1)  # (n, 16, 1)
    # low 2 bits: qs[32h + j] >> 2s is y[128h + 32s + j]; high bit: bit k of hmask[j] is for y[32k + j].
    # A set hmask bit means no offset; a clear one subtracts 4. q = (low | high << 2) - 4 in -4..3.
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), b.device, 1)) & 3
    qh = (hmask.reshape(n, 1, 32) >> _shifts(range(8), b.device, 1)) & 1
    out.view(n, 8, 32).copy_(ql.reshape(n, 8, 32) | (qh << 2))
    out.sub_(4)
    out.view(n, 16, 16).mul_(dl)
    return out


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)  # (n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    # qs[32i + j]: low nibble y[64i + j], high nibble y[64i + 32 + j]
    _put_nibbles(b[:, 16:144].reshape(n, 4, 32), out.view(n, 4, 2, 32))
    out.view(n, 8, 32).mul_(dl).sub_(ml)
    return out


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)  # (n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    # low 4 bits as Q4_K; bit k of qh[j] is bit 4 of y[32k + j]
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(range(8), b.device, 1)) & 1  # (n, 8, 32)
    out.view(n, 8, 32).copy_(ql | (qh << 4))
    out.view(n, 8, 32).mul_(dl).sub_(ml)
    return out


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 192:208].view(torch.int8).to(torch.float32)
    d = _f16(b, 208)
    dl = (d * sc).unsqueeze(-1)  # (n, 16, 1)
    # ql[64h + j]: low nibble y[128h + j], high nibble y[128h + 64 + j]
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    # qh[32h + j] >> 2s: bits 4-5 of y[128h + 32s + j]
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts((0, 2, 4, 6), b.device, 1)) & 3).reshape(n, 8, 32)
    out.view(n, 8, 32).copy_(ql | (qh << 4))
    out.sub_(32)
    out.view(n, 16, 16).mul_(dl)
    return out


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""IQ4_NL's 16 non-linear levels (ggml-common.h ``kvalues_iq4nl``; gguf-py's ``IQ4_NL.kvalues``)."""


@functools.lru_cache(maxsize=8)
def _kvalues_iq4nl(device: torch.device) -> torch.Tensor:
    return torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=device)


def _iq4_nl(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """IQ4_NL (ggml-quants.c ``dequantize_row_iq4_nl``, gguf-py ``IQ4_NL.dequantize_blocks``): y[j] =
    d * kvalues_iq4nl[low nibble of qs[j]], y[j + 16] = d * kvalues_iq4nl[high nibble], one float32 product each."""
    n = b.shape[0]
    out.view(n, 2, 16).copy_(_kvalues_iq4nl(b.device)[_nibbles(b[:, 2:18]).long()])
    return out.mul_(_f16(b, 0))


BLOCK_DECODERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
}
FLOAT_TYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

#: Names of the GGUF tensor types :func:`dequantize` decodes.
SUPPORTED: frozenset[str] = frozenset(FLOAT_TYPES) | frozenset(BLOCK_DECODERS)


def _supported_list() -> str:
    return ", ".join(sorted(SUPPORTED, key=lambda s: int(GGMLQuantizationType[s])))


def type_name(qtype: GGMLQuantizationType | str | int) -> str:
    """Canonical type name (``"Q4_K"``) of ``qtype``; :class:`UnsupportedQuantTypeError` when not in :data:`SUPPORTED`."""
    if isinstance(qtype, GGMLQuantizationType):
        name = qtype.name
    elif isinstance(qtype, str):
        name = qtype.strip().upper()
    elif isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        try:
            name = GGMLQuantizationType(int(qtype)).name
        except ValueError:
            name = f"#{int(qtype)}"
    else:
        raise TypeError(f"qtype must be a gguf.GGMLQuantizationType, a type name or a type number, "
                        f"not {type(qtype).__name__}")
    if name not in SUPPORTED:
        raise UnsupportedQuantTypeError(
            f"tensor type {name} is not supported by fast dequantization (supported: {_supported_list()})")
    return name


def block_layout(qtype: GGMLQuantizationType | str | int) -> tuple[int, int]:
    """``(elements per block, bytes per block)`` of a supported type, from gguf's ``GGML_QUANT_SIZES``.

    Raises:
        UnsupportedQuantTypeError (a ValueError): ``qtype`` is not in :data:`SUPPORTED`.
    """
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name(qtype)]]


def row_bytes_of(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, bytes per row) of a tensor of numpy-order ``shape``; ValueError when the row length does not fit the block."""
    if len(shape) == 0:
        raise ValueError(f"{name} tensor shape must have at least one dimension, got {shape}")
    if any(s < 0 for s in shape):
        raise ValueError(f"{name} tensor shape {shape} has a negative dimension")
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    if shape[-1] % bs != 0:
        raise ValueError(f"{name} tensor shape {shape}: row length {shape[-1]} is not a multiple "
                         f"of the {name} block size {bs}")
    return math.prod(shape[:-1]), shape[-1] // bs * ts
