"""Faulty copies of a GGUF for the quantized-activation gates: the first half of one matrix's rows scaled by a
factor (1.02: a fault Gemma's norms do not cancel, since only some rows change), in the file's own type.

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


def scale_rows(src: str | Path, dst: str | Path, tensor: str, factor: float = 1.02) -> Path:
    """Copy ``src`` to ``dst`` with the first half of ``tensor``'s rows scaled by ``factor``. Returns ``dst``.

    Raises:
        KeyError: no such tensor. ValueError: a type without a known scale layout.
    """
    dst = Path(dst)
    shutil.copyfile(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    t = next(t for t in r.tensors if t.name == tensor)
    kind = t.tensor_type.name
    data = t.data
    half = data.shape[0] // 2
    if kind in ("F32", "F16"):
        data[:half] = (data[:half].astype(np.float64) * factor).astype(data.dtype)
    elif kind == "BF16":
        v = (data[:half].astype(np.uint32) << 16).view(np.float32) * np.float32(factor)
        data[:half] = (v.view(np.uint32) >> 16).astype(data.dtype)
    elif kind in SCALE_FIELDS:
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        rows = data[:half].reshape(half, -1, size)
        for off in SCALE_FIELDS[kind]:
            d = rows[:, :, off:off + 2].copy().view(np.float16)
            rows[:, :, off:off + 2] = (d.astype(np.float64) * factor).astype(np.float16).view(np.uint8)
        data[:half] = rows.reshape(half, -1)
    else:
        raise ValueError(f"{tensor}: type {kind} has no known scale layout")
    r.data.flush()
    return dst
