"""Faulty copies of a GGUF for the quantized-activation gates, each in the file's own type and each changing a
matrix's shape (Gemma's norms cancel a uniform scale of a whole matrix, not these):

* :func:`scale_rows`: the first half of one matrix's rows scaled by a factor (1.02);
* :func:`scale_block`: one block of one row scaled by :data:`BLOCK_FACTOR` (its fp16 scale ``d``, and ``dmin``
  where the type has one; a float row's values of that block);
* :func:`swap_rows`: two rows swapped (their bytes: exact in every type);
* :func:`scale_expert_rows`: the first half of one MoE expert's rows of a stacked expert matrix
  (``ffn_down_exps``) scaled by 1.02: only the positions routed to that expert move.

A quantized row is scaled through its blocks' fp16 scales (``d``, and ``dmin`` where the type has one: every value
of such a block is a linear function of them), so the values become ``factor`` times theirs to fp16 rounding of the
scale (2^-11); F32/F16/BF16 rows are scaled value by value."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np

#: Byte offsets of the fp16 scale fields in one block of each type (``ggml-common.h``): d, and dmin where present.
SCALE_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "IQ4_NL": (0,),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}

BLOCK_FACTOR = 1.5
"""The scale of :func:`scale_block`'s one block: what one flipped bit does to an fp16 scale whose mantissa is 1.0
(its top mantissa bit: x1.5); the smallest corruption of a stored byte that is not a rounding-sized change."""

FAULTS = ("rows", "block", "swap", "expert")
"""The fault kinds of :func:`make_fault`."""


def _tensor(dst: Path, tensor: str):
    r = gguf.GGUFReader(dst, "r+")
    t = next((t for t in r.tensors if t.name == tensor), None)
    if t is None:
        raise KeyError(f"{dst}: no tensor {tensor}")
    return r, t


def _scale(data: np.ndarray, kind: str, qtype, rows: slice | int, factor: float, block: int | None = None) -> None:
    """Scale ``data[rows]`` (a tensor's raw rows, in place) by ``factor``: every value, or only block ``block``
    (a quantized type's block, or the same 32 values of a float row)."""
    if kind in ("F32", "F16", "BF16"):
        cols = slice(None) if block is None else slice(32 * block, 32 * block + 32)
        part = data[rows, cols]
        if kind == "BF16":
            v = (part.astype(np.uint32) << 16).view(np.float32) * np.float32(factor)
            data[rows, cols] = (v.view(np.uint32) >> 16).astype(data.dtype)
        else:
            data[rows, cols] = (part.astype(np.float64) * factor).astype(data.dtype)
    elif kind in SCALE_FIELDS:
        _, size = gguf.GGML_QUANT_SIZES[qtype]
        sel = data[rows]
        blocks = sel.reshape(*sel.shape[:-1], -1, size)
        pick = blocks if block is None else blocks[..., block:block + 1, :]
        for off in SCALE_FIELDS[kind]:
            d = pick[..., off:off + 2].copy().view(np.float16)
            pick[..., off:off + 2] = (d.astype(np.float64) * factor).astype(np.float16).view(np.uint8)
        data[rows] = blocks.reshape(sel.shape)
    else:
        raise ValueError(f"type {kind} has no known scale layout")


def scale_rows(src: str | Path, dst: str | Path, tensor: str, factor: float = 1.02) -> Path:
    """Copy ``src`` to ``dst`` with the first half of ``tensor``'s rows scaled by ``factor``. Returns ``dst``.

    Raises:
        KeyError: no such tensor. ValueError: a type without a known scale layout.
    """
    dst = Path(dst)
    shutil.copyfile(src, dst)
    r, t = _tensor(dst, tensor)
    data = t.data
    _scale(data, t.tensor_type.name, t.tensor_type, slice(0, data.shape[0] // 2), factor)
    r.data.flush()
    return dst


def scale_block(src: str | Path, dst: str | Path, tensor: str, factor: float = BLOCK_FACTOR) -> tuple[Path, str]:
    """Copy ``src`` to ``dst`` with one block of one row of ``tensor`` scaled by ``factor``: the block of the largest
    scale ``|d|`` in the matrix (a float matrix: the 32 values of largest magnitude sum, on 32-value boundaries),
    where a wrong scale matters most. Returns ``(dst, "row R block B")``.

    Raises:
        KeyError: no such tensor. ValueError: a type without a known scale layout.
    """
    dst = Path(dst)
    shutil.copyfile(src, dst)
    r, t = _tensor(dst, tensor)
    data, kind = t.data, t.tensor_type.name
    if kind in ("F32", "F16", "BF16"):
        v = ((data.astype(np.uint32) << 16).view(np.float32) if kind == "BF16" else data).astype(np.float64)
        size = np.abs(v[:, :v.shape[1] // 32 * 32]).reshape(v.shape[0], -1, 32).sum(axis=2)
    elif kind in SCALE_FIELDS:
        _, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        off = SCALE_FIELDS[kind][0]
        blocks = data.reshape(data.shape[0], -1, nbytes)
        size = np.abs(blocks[:, :, off:off + 2].copy().view(np.float16)[..., 0].astype(np.float64))
    else:
        raise ValueError(f"{tensor}: type {kind} has no known scale layout")
    row, block = (int(i) for i in np.unravel_index(int(np.argmax(size)), size.shape))
    _scale(data, kind, t.tensor_type, slice(row, row + 1), factor, block)
    r.data.flush()
    return dst, f"row {row} block {block}"


def swap_rows(src: str | Path, dst: str | Path, tensor: str) -> tuple[Path, str]:
    """Copy ``src`` to ``dst`` with rows 0 and ``n/2`` of ``tensor`` swapped (their stored bytes). Returns
    ``(dst, "rows 0 and n/2")``.

    Raises:
        KeyError: no such tensor.
    """
    dst = Path(dst)
    shutil.copyfile(src, dst)
    r, t = _tensor(dst, tensor)
    data = t.data
    j = data.shape[0] // 2
    data[[0, j]] = data[[j, 0]]
    r.data.flush()
    return dst, f"rows 0 and {j}"


def scale_expert_rows(src: str | Path, dst: str | Path, tensor: str, expert: int = 0,
                      factor: float = 1.02) -> tuple[Path, str]:
    """Copy ``src`` to ``dst`` with the first half of the rows of expert ``expert`` of the stacked expert matrix
    ``tensor`` (``[n_expert, out, in]``, ``blk.N.ffn_down_exps.weight``) scaled by ``factor``; the other experts
    untouched. Returns ``(dst, "expert E rows 0..R-1")``.

    Raises:
        KeyError: no such tensor. ValueError: not a stack of experts (fewer than 3 dimensions), no such expert, or
        a type without a known scale layout.
    """
    dst = Path(dst)
    shutil.copyfile(src, dst)
    r, t = _tensor(dst, tensor)
    data = t.data
    if data.ndim != 3 or not 0 <= expert < data.shape[0]:
        raise ValueError(f"{tensor}: no expert {expert} in a tensor of shape {tuple(data.shape)}")
    half = data.shape[1] // 2
    _scale(data[expert], t.tensor_type.name, t.tensor_type, slice(0, half), factor)
    r.data.flush()
    return dst, f"expert {expert} rows 0..{half - 1}"


def make_fault(kind: str, src: str | Path, dst: str | Path, tensor: str) -> tuple[Path, str]:
    """One faulty copy of ``src`` at ``dst``: ``kind`` one of :data:`FAULTS` in ``tensor``. Returns ``(dst, what)``,
    ``what`` a short description for tables (``blk.3.ffn_down.weight rows x1.02``)."""
    if kind == "rows":
        return scale_rows(src, dst, tensor), f"{tensor} first half of rows x1.02"
    if kind == "block":
        path, where = scale_block(src, dst, tensor)
        return path, f"{tensor} {where} x{BLOCK_FACTOR:g}"
    if kind == "swap":
        path, where = swap_rows(src, dst, tensor)
        return path, f"{tensor} {where} swapped"
    if kind == "expert":
        path, where = scale_expert_rows(src, dst, tensor)
        return path, f"{tensor} {where} x1.02"
    raise ValueError(f"unknown fault {kind!r} (known: {', '.join(FAULTS)})")


KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
"""ggml-common.h ``kvalues_iq4nl``: IQ4_NL's 16 levels."""


def quantize_iq4_nl(arr: np.ndarray) -> np.ndarray:
    """float32 ``[..., k]`` (k a multiple of 32) -> IQ4_NL bytes ``[..., k / 32 * 18]`` (ggml-common.h
    ``block_iq4_nl``: d fp16, qs[16], element j the low nibble of qs[j], j + 16 its high nibble), for test files
    (gguf.quants has no IQ4_NL quantizer). d is the block's value of largest magnitude over -127 (the first guess of
    ggml-quants.c ``quantize_row_iq4_nl_impl``; its search for a better d is left out: any finite d makes a valid
    block), each element the level nearest x / d."""
    b = np.asarray(arr, dtype=np.float32).reshape(-1, 32)
    mx = b[np.arange(len(b)), np.abs(b).argmax(1)]
    d = (mx / -127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    scaled = np.divide(b, df, out=np.zeros_like(b), where=df != 0)
    q = np.abs(scaled[..., None] - KVALUES_IQ4NL).argmin(-1).astype(np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 32 * 18)


def requantize(src: Path, dst: Path, qtype: str) -> Path:
    """A copy of the F32 GGUF ``src`` whose matrices of whole blocks are stored in ``qtype`` (quantized by
    ``gguf.quants``: Q4_1 and Q5_1, which ``g4h synth`` does not write and the fast tests cannot wait for
    llama-quantize to be built for; IQ4_NL by :func:`quantize_iq4_nl`); 1-D tensors and matrices of rows that are
    not whole blocks stay F32."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        w.add_key_value(name, f.contents(), f.types[0],
                        sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    q = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[q][0]
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, f"{src}: {t.name} is not F32"
        arr = np.array(t.data, dtype=np.float32)
        if arr.ndim >= 2 and arr.shape[-1] % block == 0:
            data = quantize_iq4_nl(arr) if qtype == "IQ4_NL" else gguf.quants.quantize(arr, q)
            w.add_tensor(t.name, data, raw_dtype=q)
        else:
            w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
