"""NaN, Inf and out-of-range weights, found on the stored form where the format allows it.

Limits (the largest |w| accepted):

* :data:`MAX_ABS_FP32` = 1e30 for fp32/bf16/fp64 compute. A matmul output
  element is a sum of ``K`` products ``x * w``; with post-RMSNorm activations
  up to ~1e4 (the norm weight times a unit-RMS vector; the real Gemma 3 270M
  GGUF's largest norm weight is 1657) and ``K`` up to 21504 (the widest
  contraction of a Gemma 4 model: the 31B FFN down projection), a weight of
  1e30 reaches ~2e38, the edge of float32 (3.4e38). The largest real weight
  measured here is 1657: the limit excludes nothing a trained model holds,
  only corruption.
* :data:`MAX_ABS_FP16` = 65504 (the largest finite fp16) when the engine
  holds weights in fp16: a larger weight becomes Inf on conversion.

``rope_freqs.weight`` is a divisor of the RoPE inverse frequencies, not a
matmul operand: it must be finite and > 0, with no upper limit (llama.cpp's
converter writes 1e30 for pairs that do not rotate).

Quantized types keep their scales in fp16 fields (``d``, and ``dmin``/``m``);
the codes are small integers. So a block can only be non-finite through a
scale field, and its largest |w| is at most ``|d| * code_max + |m| * min_max``
(the factors below, from each type's formula in gguf-py ``quants.py``). Those
fields are read in place, every ``type_size`` bytes, without dequantizing.
With fp16 scales the bound is at most 65504 * 4096 = 2.7e8 (Q6_K's factor,
the largest; the IQ types' grids times their sub-scales stay below it), far
below :data:`MAX_ABS_FP32`, so only NaN/Inf scale fields matter for fp32
compute; for fp16 compute the IQ types are dequantized to check the values.
Types whose scale is packed elsewhere (IQ1_M, MXFP4, NVFP4, Q1_0, ...) are
dequantized with ``gguf.quants`` in chunks and checked as values.

Sources: gguf-py ``gguf/quants.py`` (``dequantize_blocks`` of every type: field
offsets and formulas); ggml ``ggml-common.h`` block structs.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from .errors import ModelFileError


class CarryWarning(UserWarning):
    """A weight the engine can hold but not carry: its magnitude, through the operations that follow it, passes
    the largest value of the compute dtype (:func:`carry_problems`). A warning, not an error: the output check
    (:mod:`harness.core.finite`) fails the run if the output does go non-finite."""


MAX_ABS_FP32 = 1e30
MAX_ABS_FP16 = 65504.0
ROPE_FREQS = "rope_freqs.weight"
_CHUNK = 1 << 22  # elements (or blocks) examined per step: bounds the temporaries to a few tens of MB

# type -> (bytes per block, ((offset of an fp16 field, largest |code| it multiplies), ...)).
# None as the factor: the field's bound is not a simple product; magnitude is then checked by dequantizing.
_SCALE_FIELDS: dict[str, tuple[int, tuple[tuple[int, float | None], ...]]] = {
    "Q4_0": (18, ((0, 8),)),  # d * (q - 8), q in 0..15
    "Q4_1": (20, ((0, 15), (2, 1))),  # d * q + m
    "Q5_0": (22, ((0, 16),)),  # d * (q - 16), q in 0..31
    "Q5_1": (24, ((0, 31), (2, 1))),  # d * q + m
    "Q8_0": (34, ((0, 128),)),  # d * q, q int8
    "Q2_K": (84, ((80, 45), (82, 15))),  # (d * sc) * q - (dmin * m): sc, m <= 15, q <= 3
    "Q3_K": (110, ((108, 128),)),  # (d * (sc - 32)) * q: |sc - 32| <= 32, q in -4..3
    "Q4_K": (144, ((0, 945), (2, 63))),  # sc, m <= 63, q <= 15
    "Q5_K": (176, ((0, 1953), (2, 63))),  # sc, m <= 63, q <= 31
    "Q6_K": (210, ((208, 4096),)),  # (d * sc) * (q - 32): sc int8, q in 0..63
    "TQ1_0": (54, ((52, 1),)),  # d * (q - 1), q in 0..2
    "TQ2_0": (66, ((64, 2),)),  # d * (q - 1), q in 0..3
    "IQ4_NL": (18, ((0, 127),)),  # d * kvalues_iq4nl, |kvalue| <= 127
    "IQ4_XS": (136, ((0, 4064),)),  # (d * (ls - 32)) * kvalue
    "IQ2_XXS": (66, ((0, None),)),
    "IQ2_XS": (74, ((0, None),)),
    "IQ2_S": (82, ((0, None),)),
    "IQ3_XXS": (98, ((0, None),)),
    "IQ3_S": (110, ((0, None),)),
    "IQ1_S": (50, ((0, None),)),
}


def max_abs_for(dtype: Any) -> float:
    """The weight limit for an engine computing in ``dtype`` (a torch/numpy dtype or its name)."""
    name = str(dtype).replace("torch.", "")
    return MAX_ABS_FP16 if name in ("float16", "half") else MAX_ABS_FP32


def _where(shape: tuple[int, ...], flat_index: int) -> str:
    return str([int(i) for i in np.unravel_index(flat_index, shape)]) if len(shape) > 1 else f"[{flat_index}]"


def _fail_value(source: str, name: str, shape, index: int, value: float, limit: float | None) -> ModelFileError:
    at = f"{source}: tensor {name}: element {_where(tuple(shape), index)}"
    if np.isnan(value):
        return ModelFileError(f"{at} is NaN")
    if np.isinf(value):
        return ModelFileError(f"{at} is {'+' if value > 0 else '-'}Inf")
    if limit is None:
        return ModelFileError(f"{at} is {value:.6g}: expected a positive factor")
    return ModelFileError(f"{at} is {value:.6g}: |w| > {limit:.6g}, more than a matmul in this dtype can carry")


def _scan(source: str, name: str, flat: np.ndarray, shape, offset: int, max_abs: float) -> float:
    """Check a flat float array that sits at ``offset`` (elements) of a tensor of ``shape``; return its largest |w|.

    The comparison runs in float64: a float32 1e30 is 1.0000000150e30, above a limit of 1e30 (compared in float32,
    the limit rounds to the same float32 and the value passed)."""
    rope = name == ROPE_FREQS
    amax = 0.0
    for start in range(0, flat.size, _CHUNK):
        c = flat[start:start + _CHUNK]
        lo, hi = float(c.min()), float(c.max())  # NaN propagates into both; float64 from here on
        if (0 < lo and hi < np.inf) if rope else (-max_abs <= lo and hi <= max_abs):
            amax = max(amax, -lo, hi)
            continue
        c64 = c.astype(np.float64)
        bad = ~np.isfinite(c64) | ((c64 <= 0) if rope else (np.abs(c64) > max_abs))
        j = int(np.argmax(bad))
        raise _fail_value(source, name, shape, offset + start + j, float(c64[j]), None if rope else max_abs)
    return amax


def check_values(source: str, name: str, arr: np.ndarray, max_abs: float = MAX_ABS_FP32, *,
                 shape: tuple[int, ...] | None = None, first_row: int = 0) -> float:
    """Check a float array for NaN, Inf and ``|w| > max_abs`` (``rope_freqs``: finite and > 0); return its largest
    ``|w|`` (float64).

    Args:
        source: the file, for messages.
        name: the tensor's canonical name.
        arr: any float array (a dequantized tensor, an F32/F16/BF16 one), any shape; or rows
            ``first_row ..`` of the tensor of ``shape``.
        max_abs: the limit (:data:`MAX_ABS_FP32` or :data:`MAX_ABS_FP16`).
        shape: the whole tensor's shape when ``arr`` holds some of its rows (None: ``arr.shape``).
        first_row: the tensor row ``arr`` starts at (messages give indices in the whole tensor).

    Raises:
        ModelFileError: one line naming the tensor, the first bad element's index
            and its value.

    Cost: two reductions (min, max) per chunk of 4M elements; no full-size temporary.
    """
    arr = np.asarray(arr)
    shape = arr.shape if shape is None else tuple(shape)
    return _scan(source, name, arr.reshape(-1), shape, first_row * _row_elems(shape), max_abs)


def _row_elems(shape: tuple[int, ...]) -> int:
    """Elements per row (first dimension) of a tensor of ``shape``."""
    return int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1


def _f16(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float16).astype(np.float32)


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _check_half(source: str, name: str, bits: np.ndarray, shape, bf16: bool, max_abs: float, offset: int = 0
                ) -> float:
    """fp16/bf16 stored as uint16 bits (``offset`` elements into the tensor): non-finite iff the exponent bits
    are all ones. Returns the largest |w| (the largest magnitude bits: the sign bit dropped, finite values order
    as their bits do)."""
    exp_mask, to_float = (0x7F80, _bf16) if bf16 else (0x7C00, _f16)
    top = 0
    for start in range(0, bits.size, _CHUNK):
        c = bits[start:start + _CHUNK]
        bad = (c & exp_mask) == exp_mask
        if bad.any():
            j = int(np.argmax(bad))
            raise _fail_value(source, name, shape, offset + start + j, float(to_float(c[j:j + 1].copy())[0]),
                              max_abs)
        if c.size:
            top = max(top, int((c & 0x7FFF).max()))
        if name == ROPE_FREQS or bf16 or max_abs < MAX_ABS_FP16:  # values needed: sign or magnitude
            _scan(source, name, to_float(c.copy()), shape, offset + start, max_abs)
    return float(to_float(np.array([top], dtype=np.uint16))[0])


def _check_scales(source: str, name: str, raw: np.ndarray, type_name: str, max_abs: float, first_block: int = 0
                  ) -> tuple[bool, float]:
    """Check a quantized tensor (from its block ``first_block``) through its fp16 scale fields, read in place.

    Returns ``(done, bound)``: ``done`` False when the type's magnitude bound is not a simple product and
    ``max_abs`` is low enough to matter (the caller then dequantizes); ``bound``: the largest |w| the scales allow
    (inf for a type whose bound is not a simple product).
    """
    block_bytes, fields = _SCALE_FIELDS[type_name]
    flat = raw.reshape(-1)
    n_blocks = flat.size // block_bytes
    unbounded = False
    field_bounds: dict[int, float] = {}
    for start in range(0, n_blocks, _CHUNK):
        n = min(_CHUNK, n_blocks - start)
        worst = np.zeros(n, dtype=np.float64)
        for off, factor in fields:
            bits = np.ndarray((n,), dtype="<u2", buffer=flat, offset=start * block_bytes + off,
                              strides=(block_bytes,))
            bad = (bits & 0x7C00) == 0x7C00
            if bad.any():
                b = int(np.argmax(bad))
                v = float(_f16(bits[b:b + 1].copy())[0])
                raise ModelFileError(f"{source}: tensor {name}: block {first_block + start + b} ({type_name}) has a "
                                     "scale field "
                                     f"of {'NaN' if np.isnan(v) else 'Inf'} (byte {off} of the block)")
            if factor is None:
                unbounded = True
                continue
            if n:  # the caller's magnitude bound: the field's largest |value| (its bits, sign dropped) x its factor
                top = np.array([int((bits & 0x7FFF).max())], dtype=np.uint16)
                field_bounds[off] = max(field_bounds.get(off, 0.0), float(_f16(top)[0]) * factor)
            if max_abs < MAX_ABS_FP16 * 4096:  # above that, no fp16 scale times its code can reach the limit
                worst += np.abs(_f16(bits.copy()).astype(np.float64)) * factor
        if worst.size and worst.max() > max_abs:
            b = int(np.argmax(worst))
            raise ModelFileError(f"{source}: tensor {name}: block {first_block + start + b} ({type_name}) has scales "
                                 "that allow "
                                 f"|w| up to {worst[b]:.6g}, more than {max_abs:.6g}, the limit for this dtype")
    bound = float("inf") if unbounded else float(sum(field_bounds.values()))
    return not unbounded or max_abs >= MAX_ABS_FP16 * 4096, bound


def check_stored(source: str, name: str, type_name: str, stored: np.ndarray, shape: tuple[int, ...],
                 max_abs: float = MAX_ABS_FP32, *, first_row: int = 0) -> float:
    """Check one GGUF tensor, or some of its rows, in its stored form (no full dequantization when the type allows).

    Args:
        source: the file, for messages.
        name: the tensor name.
        type_name: GGML type name (``F32``, ``Q8_0``, ...).
        stored: the tensor's data as mapped (``GGUFFile.view``: typed for F32/F16,
            uint8 rows otherwise), or the rows ``first_row ..`` of it.
        shape: numpy-order logical shape of the whole tensor.
        max_abs: the limit (see the module docstring).
        first_row: the tensor row ``stored`` starts at (messages give the element or block of the
            whole tensor).

    Returns:
        the largest ``|w|`` (float64): exact for F32/F64/F16/BF16 and for types checked by dequantizing; for a type
        with fp16 scale fields, the largest the scales allow (an upper bound); inf when unknown.

    Raises:
        ModelFileError: a NaN/Inf value or scale field, or a magnitude above the
            limit, named with the tensor and the element or block.

    Cost: F32/F64 one min/max pass; F16/BF16 one integer pass over the bits;
    types with fp16 scale fields read only those fields (2-4 bytes per block);
    other types are dequantized in chunks of 4M elements.
    """
    stored = np.ascontiguousarray(stored)
    offset = first_row * _row_elems(tuple(shape))  # elements of the tensor before ``stored``
    if type_name in ("F32", "F64"):
        return _scan(source, name, stored.reshape(-1), shape, offset, max_abs)
    if type_name in ("F16", "BF16"):
        return _check_half(source, name, stored.reshape(-1).view("<u2"), shape, type_name == "BF16", max_abs, offset)
    if type_name in _SCALE_FIELDS and name != ROPE_FREQS:
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
        done, bound = _check_scales(source, name, stored.view(np.uint8), type_name, max_abs, offset // block)
        if done:
            return bound
    return _check_by_dequantizing(source, name, type_name, stored, shape, max_abs, offset)


def _check_by_dequantizing(source: str, name: str, type_name: str, stored: np.ndarray, shape, max_abs,
                           offset: int = 0) -> float:
    qtype = gguf.GGMLQuantizationType[type_name]
    rows = stored.reshape(-1, stored.shape[-1]) if stored.ndim else stored.reshape(1, -1)
    row_elems = shape[-1] if shape else 1
    step = max(1, _CHUNK // max(1, row_elems))
    amax = 0.0
    for r in range(0, rows.shape[0], step):
        try:
            vals = gguf.quants.dequantize(rows[r:r + step], qtype)
        except NotImplementedError:
            return float("inf")  # the engine that reads it reports the unsupported type
        amax = max(amax, _scan(source, name, vals.reshape(-1), shape, offset + r * row_elems, max_abs))
    return amax


def check_weights(W, max_abs: float = MAX_ABS_FP32) -> dict[str, float]:
    """Check every tensor of a loaded model (``reference.weights.Weights``) before an engine uses it.

    GGUF tensors are checked in their stored form (:func:`check_stored`);
    safetensors through ``W.raw`` (:func:`check_values`). Weights made on a
    device with no file (``fast.shapes.RandomWeights``) are skipped.

    Args:
        W: the weights from :func:`reference.weights.load_model`.
        max_abs: the limit; :func:`max_abs_for` gives it for a compute dtype.

    Returns:
        tensor name -> its largest ``|w|`` (an upper bound for types with scale fields: :func:`check_stored`),
        the magnitudes :func:`fast.carry.carry_problems` starts from; empty for weights made on a device.

    Raises:
        ModelFileError: the first bad tensor, named (see :func:`check_stored`).
    """
    if hasattr(W, "torch_tensor"):
        return {}
    bounds = {}
    for name in W:
        stored = W.stored(name) if hasattr(W, "stored") else None
        if stored is not None:
            bounds[name] = check_stored(W.source, name, W.raw_dtype(name), stored, tuple(W.shape(name)), max_abs)
        else:
            bounds[name] = check_values(W.source, name, np.asarray(W.raw(name)), max_abs)
    return bounds
