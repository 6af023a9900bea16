"""Tensors read on demand: :class:`LazyTensor`, and the one reader of HF safetensors folders.

Every loader of the reference (text, vision, audio; GGUF or safetensors) describes each tensor of
its file as a :class:`LazyTensor`: its shape and stored type, and functions that read all of it or
some of its rows. Nothing is read until asked for.

Safetensors (:func:`safetensors_folder`): each file is checked by the ``safetensors`` library
(``safe_open``: header, offsets, sizes) and memory-mapped; a tensor is a read-only view of the
mapped bytes, so reading one tensor, or a few rows of one, touches only those bytes and the
checkpoint is never read whole. ``BF16`` (which numpy has no dtype for) is widened to float32 by
placing its 16 bits in the high half of a 32-bit word, which is exact (the same value torch's
``bfloat16 -> float32`` gives). File format: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets from the end of the header),
then the data (github.com/huggingface/safetensors, README "Format").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors import safe_open

from .errors import ModelFileError
from .files import check_regular

#: safetensors dtype name -> numpy dtype of the stored element (BF16 is read as raw 16-bit words).
SAFETENSORS_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?",
}

Index = slice | np.ndarray  # rows to read: a slice, or an int64 array of row indices


@dataclass
class LazyTensor:
    """One tensor of a model file, read when asked for.

    Attributes:
        shape: numpy-order shape of the tensor as the loader presents it.
        dtype: stored type, for reports (a GGML type name such as ``Q8_0``, or a safetensors
            dtype name such as ``BF16``).
        read: returns the whole tensor as a float array of ``shape`` (float32 for stored
            F32/F16/BF16/quantized data; the loader may transform it).
        read_rows: returns rows ``index`` (first dimension) of a tensor of 2 dims or more (a slice or an
            int64 array; float array ``[n, *shape[1:]]``: an expert stack's rows are experts), reading only
            those rows' bytes; None when the tensor has one dimension or its rows cannot be read apart.
        stored: GGUF only: the tensor's bytes as mapped (``GGUFFile.view``, no copy).
        source: the file the tensor comes from (for messages).
        key: the tensor's name in that file.
    """

    shape: tuple[int, ...]
    dtype: str
    read: Callable[[], np.ndarray]
    read_rows: Callable[[Index], np.ndarray] | None = None
    stored: np.ndarray | None = None
    source: str = ""
    key: str = ""


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly: the 16 bits become the high half. [...] -> [...]."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped; tensors are views of the map, read on access.

    Args:
        path: the file.

    Raises:
        ModelFileError: the ``safetensors`` library refuses the file, or its header is not what the
            format states (message names the file and, where it can, the tensor).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        check_regular(self.path, error=ModelFileError)  # a FIFO or a device cannot be mapped (nor block the open)
        try:
            with safe_open(str(self.path), framework="numpy") as handle:  # the library checks the header
                keys = list(handle.keys())
        except Exception as e:  # the library raises its own error types for a damaged file
            raise ModelFileError(f"{self.path}: cannot read safetensors ({str(e)[:120]})") from None
        try:
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{self.path}: cannot read the safetensors header ({str(e)[:120]})") from None
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if self.path.stat().st_size else None
        self._start = 8 + n
        self.entries: dict[str, tuple[str, tuple[int, ...], int]] = {}
        for key in keys:
            e = header.get(key)
            if not isinstance(e, dict) or e.get("dtype") not in SAFETENSORS_DTYPES:
                dt = e.get("dtype") if isinstance(e, dict) else None
                raise ModelFileError(f"{self.path}: tensor {key}: dtype {dt!r} is not one the reference reads "
                                     f"(expected one of {', '.join(SAFETENSORS_DTYPES)})")
            shape = tuple(int(s) for s in e["shape"])
            begin, end = (int(o) for o in e["data_offsets"])
            if end - begin != math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[e["dtype"]]).itemsize:
                raise ModelFileError(f"{self.path}: tensor {key}: {end - begin} bytes for shape {list(shape)} "
                                     f"of {e['dtype']}")
            self.entries[key] = (e["dtype"], shape, self._start + begin)

    def keys(self) -> list[str]:
        """Tensor names, in header order."""
        return list(self.entries)

    def _view(self, key: str) -> np.ndarray:
        """The stored elements of ``key`` as a read-only view of the map, numpy shape (no copy)."""
        dtype, shape, offset = self.entries[key]
        dt = np.dtype(SAFETENSORS_DTYPES[dtype])
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, dtype=dt)
        return np.frombuffer(self._map, dtype=dt, count=count, offset=offset).reshape(shape)

    def _widen(self, key: str, arr: np.ndarray) -> np.ndarray:
        return _bf16_to_f32(arr) if self.entries[key][0] == "BF16" else arr

    def read(self, key: str) -> np.ndarray:
        """The whole tensor ``key``: a read-only view for numpy dtypes, a float32 copy for BF16."""
        return self._widen(key, self._view(key))

    def read_rows(self, key: str, index: Index) -> np.ndarray:
        """Rows ``index`` of tensor ``key`` (first dimension), reading only their bytes. [n, ...]."""
        return self._widen(key, np.array(self._view(key)[index]))

    def lazy(self, key: str) -> LazyTensor:
        """``key`` as a :class:`LazyTensor` (rows readable when it has two dimensions or more)."""
        dtype, shape, _ = self.entries[key]
        rows = (lambda index, key=key: self.read_rows(key, index)) if len(shape) >= 2 else None
        return LazyTensor(shape=shape, dtype=dtype, read=lambda key=key: self.read(key), read_rows=rows,
                          source=str(self.path), key=key)


def safetensors_folder(folder: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of every ``*.safetensors`` file in ``folder``, by its name in the file, read lazily.

    Args:
        folder: an HF model folder.

    Returns:
        HF tensor name -> :class:`LazyTensor` (``source`` is the file that holds it).

    Raises:
        ModelFileError: no ``*.safetensors`` file; an unreadable file (see :class:`SafetensorsFile`);
            one name in two files.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no *.safetensors files")
    out: dict[str, LazyTensor] = {}
    for f in files:
        sf = SafetensorsFile(f)
        for key in sf.keys():
            if key in out:
                raise ModelFileError(f"{f}: tensor {key} is also in {Path(out[key].source).name}")
            out[key] = sf.lazy(key)
    return out
