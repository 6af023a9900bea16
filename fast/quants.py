"""GGUF tensor dequantization in torch, on the tensor's own device (CPU or CUDA): whole tensors, rows of packed
weights kept packed, and a linear layer over them, with the block decoders of :mod:`fast.quant_blocks` (the
formats, their layouts and the bit-for-bit equality with gguf-py are described there).

Public API:

* :func:`dequantize` -- raw bytes -> float tensor of the logical shape.
* :data:`fast.quant_blocks.SUPPORTED` -- the type names it decodes.
* :class:`QuantizedTensor` -- raw bytes kept on a device (quantized weights
  stay quantized in device memory) with on-the-fly dequantization of rows.
* :func:`linear` -- ``x @ W.T`` with ``W`` a :class:`QuantizedTensor`,
  dequantizing ``W`` one block of rows at a time.

On the CPU, :class:`QuantizedTensor`'s row decoding and :func:`linear` for 1 to
16 float32 rows go through the C kernels of :mod:`fast.quant_kernels` (same
values, bit for bit; for :func:`linear` a fixed float32 summation order) when
they are built and the type is one they decode; otherwise through the torch
decoders here.
On CUDA, :func:`linear` for 1 to 64 rows of a Q8_0 or Q4_K weight goes through
the fused Triton kernel of :mod:`fast.cuda_kernels` when triton imports.

Memory: :func:`dequantize` allocates its output (``numel * dtype size``) and
decodes at most ``_CHUNK_ELEMS`` (2**24) elements at a time: float32 results
are written straight into the output; the working buffers are a few uint8
unpacking steps (a few bytes an element of the chunk, about 100 MB at most),
plus one float32 chunk buffer (64 MB) when ``dtype`` is not float32. So
decoding a large tensor never needs a full-size temporary. A
:class:`QuantizedTensor` holds only its raw bytes; :func:`linear` adds one
dequantized chunk of ``chunk_rows`` rows (plus the working buffers for it)
and the output.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import cuda_kernels, quant_kernels
from .quant_blocks import BLOCK_DECODERS, FLOAT_TYPES, row_bytes_of, type_name

__all__ = ["QuantizedTensor", "dequantize", "linear"]

# Elements decoded per step inside dequantize(): bounds the working memory.
_CHUNK_ELEMS = 1 << 24
# Default number of weight elements dequantized per step by linear().
_LINEAR_CHUNK_ELEMS = 1 << 22


def _check_raw(raw: torch.Tensor, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw must be a torch.Tensor of dtype uint8, not {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw must hold the tensor's bytes as torch.uint8, got {raw.dtype}")
    rows, row_bytes = row_bytes_of(name, shape)
    if raw.numel() != rows * row_bytes:
        raise ValueError(f"{name} tensor of shape {shape} needs {rows * row_bytes} bytes "
                         f"({rows} rows x {row_bytes}), got {raw.numel()} (raw shape {tuple(raw.shape)})")
    if raw.dim() > 1 and raw.shape[-1] != row_bytes:
        raise ValueError(f"{name} tensor of shape {shape}: raw shape {tuple(raw.shape)} should end in "
                         f"{row_bytes} bytes per row (or be flat)")
    return rows, row_bytes


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _decode_flat(flat: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Decode the bytes ``flat`` (1-D uint8, a whole number of blocks) into a 1-D tensor of ``dtype``."""
    if name in FLOAT_TYPES:
        src = FLOAT_TYPES[name]
        if flat.storage_offset() % src.itemsize:
            flat = flat.clone()
        # F32 goes through clone() so the result never aliases the raw bytes.
        out = flat.contiguous().view(src).to(dtype)
        return out.clone() if out.data_ptr() == flat.data_ptr() else out
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    decode = BLOCK_DECODERS[name]
    blocks = flat.reshape(-1, ts)
    n = blocks.shape[0]
    step = max(1, _CHUNK_ELEMS // bs)
    out = torch.empty(n, bs, dtype=dtype, device=flat.device)
    # float32 results go straight into out; other dtypes through one float32 chunk buffer
    buf = None if dtype == torch.float32 else torch.empty(min(n, step), bs, dtype=torch.float32, device=flat.device)
    for i in range(0, n, step):
        j = min(n, i + step)
        if buf is None:
            decode(blocks[i:j], out[i:j])
        else:
            out[i:j] = decode(blocks[i:j], buf[:j - i])
    return out.reshape(-1)


# --------------------------------------------------------------------------- public API


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType | str | int, shape: Sequence[int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a GGUF tensor's raw bytes into floats, on ``raw``'s device.

    Args:
        raw: the tensor's bytes as stored in the GGUF file, ``torch.uint8``,
            either flat ``[n_bytes]`` or ``[..., bytes_per_row]`` (how gguf's
            ``GGUFReader`` shapes quantized data). Any device; any strides.
        qtype: a :class:`gguf.GGMLQuantizationType`, its name (``"Q4_K"``,
            case-insensitive) or its number.
        shape: the logical shape in numpy order (last dimension = row length,
            i.e. gguf's ``ReaderTensor.shape`` reversed).
        dtype: floating dtype of the result. Values are computed in float32
            exactly as gguf-py does, then cast (float64 is exact; float16 and
            bfloat16 round once).

    Returns:
        a new tensor of ``shape`` and ``dtype`` on ``raw.device``. In float32
        it equals ``gguf.quants.dequantize`` bit for bit.

    Block layouts: see the module docstring (bytes per block, what each field
    is; from ggml-common.h's ``block_*`` structs and gguf-py's ``quants.py``).

    Raises:
        UnsupportedQuantTypeError (a ValueError): the type is not in :data:`fast.quant_blocks.SUPPORTED`.
        ValueError: ``shape`` is empty or has a row length that is not a multiple
            of the block size, or ``raw`` has the wrong number of bytes.
        TypeError: ``raw`` is not a uint8 tensor, or ``dtype`` is not floating.
    """
    name = type_name(qtype)
    shape = tuple(int(s) for s in shape)
    dtype = _out_dtype(dtype)
    _check_raw(raw, name, shape)
    return _decode_flat(raw.reshape(-1), name, dtype).reshape(shape)


class QuantizedTensor:
    """A GGUF tensor kept as its raw bytes on a device, dequantized on demand.

    This is how the fast path keeps quantized weights quantized in device
    memory: only ``nbytes`` (the file's bytes) stay resident; :meth:`dequantize`,
    :meth:`dequantize_rows`, :meth:`take_rows` and :func:`linear` decode what
    they need when they need it and let it go afterwards.

    Attributes:
        raw: ``torch.uint8`` of shape ``[n_rows, bytes_per_row]`` where
            ``n_rows = prod(shape[:-1])`` (a view of the caller's bytes when they
            were already laid out so; no copy is made).
        qtype: the :class:`gguf.GGMLQuantizationType`.
        shape: logical numpy-order shape (last dimension = row length).

    Raises (constructor): as :func:`dequantize` does for a bad type, shape or byte count.
    """

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType | str | int, shape: Sequence[int]):
        name = type_name(qtype)
        self.shape: tuple[int, ...] = tuple(int(s) for s in shape)
        rows, row_bytes = _check_raw(raw, name, self.shape)
        self.qtype: GGMLQuantizationType = GGMLQuantizationType[name]
        self.type_name: str = name
        self.raw: torch.Tensor = raw.reshape(rows, row_bytes)
        # (GGML type number, bytes per row) when the CPU packed kernels take this matrix, else None: worked out
        # once, so that a decode step's hundred-odd products skip the checks (fast.model.linear)
        self.kernel_layout: tuple[int, int] | None = (
            quant_kernels.layout(self.raw, name, self.shape[-1]) if len(self.shape) == 2 else None)

    # ---- construction

    @classmethod
    def from_numpy(cls, data: np.ndarray, qtype: GGMLQuantizationType | str | int, shape: Sequence[int],
                   device: torch.device | str | None = None, copy: bool = True) -> "QuantizedTensor":
        """From a NumPy array holding the bytes (any dtype: its memory is reinterpreted as bytes).

        Args:
            copy: True: copied once into a writable array, then moved to ``device``. False: on
                the CPU, ``raw`` is a view of ``data`` (e.g. a GGUFReader memory map, kept alive);
                nothing here writes to ``raw``, so a read-only map is fine. Needs C-contiguous bytes.

        Raises: as the constructor; ValueError for ``copy=False`` on an array that is not C-contiguous.
        """
        if copy:
            arr = np.array(data, copy=True, order="C")  # a writable copy (GGUFReader memmaps are read-only)
        else:
            arr = np.asarray(data)
            if not arr.flags.c_contiguous:
                raise ValueError(f"QuantizedTensor.from_numpy(copy=False) needs C-contiguous bytes, got strides "
                                 f"{arr.strides} for shape {arr.shape}")
        with warnings.catch_warnings():  # torch warns that a read-only array makes a read-only tensor: intended
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(arr.reshape(-1).view(np.uint8))
        return cls(t.to(device) if device is not None else t, qtype, shape)

    @classmethod
    def from_gguf(cls, tensor, device: torch.device | str | None = None, copy: bool = True) -> "QuantizedTensor":
        """From a ``gguf.GGUFReader`` tensor (``ReaderTensor``): its bytes, type and reversed (numpy-order) shape.

        ``copy=False`` keeps a view of the reader's memory map on the CPU (see :meth:`from_numpy`).

        Raises: as the constructor.
        """
        shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
        return cls.from_numpy(tensor.data, tensor.tensor_type, shape, device, copy=copy)

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        """The same tensor with its bytes on ``device`` (self when already there)."""
        raw = self.raw.to(device)
        return self if raw is self.raw else QuantizedTensor(raw, self.qtype, self.shape)

    # ---- properties

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        """Bytes held (the size of the tensor in the file)."""
        return self.raw.numel()

    @property
    def n_rows(self) -> int:
        """Rows = ``prod(shape[:-1])``."""
        return self.raw.shape[0]

    @property
    def row_len(self) -> int:
        """Elements per row = ``shape[-1]``."""
        return self.shape[-1]

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.qtype.name}, shape={self.shape}, device={self.device}, nbytes={self.nbytes})"

    def __getitem__(self, index: int) -> "QuantizedTensor":
        """``t[e]``: :meth:`select` (one expert of a MoE stack, as a dense tensor's ``w[e]``)."""
        return self.select(index)

    # ---- decoding

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor, ``shape``, ``dtype``, on ``self.device`` (bit-exact with gguf-py in float32).

        Memory: the full output plus :func:`dequantize`'s bounded working buffers.
        Raises: TypeError for a non-floating ``dtype``.
        """
        return self.dequantize_rows(0, self.n_rows, dtype).reshape(self.shape)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor flattened to ``[n_rows, row_len]``: ``[stop - start, row_len]``, ``dtype``.

        Raises: IndexError unless ``0 <= start <= stop <= n_rows``; TypeError for a non-floating ``dtype``.
        """
        if not (0 <= start <= stop <= self.n_rows):
            raise IndexError(f"rows {start}:{stop} out of range for {self.n_rows} rows of {self!r}")
        # the packed CPU kernel when it applies (float32; other dtypes cast it when the chunk is small)
        if self.device.type == "cpu" and (dtype == torch.float32 or (stop - start) * self.row_len <= _CHUNK_ELEMS):
            out = quant_kernels.dequantize_rows(self.raw, self.qtype.name, self.row_len, start, stop)
            if out is not None:
                return out.to(_out_dtype(dtype))
        return dequantize(self.raw[start:stop], self.qtype, (stop - start, self.row_len), dtype)

    def take_rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32, check: bool = True) -> torch.Tensor:
        """Embedding lookup: rows ``ids`` of the ``[n_rows, row_len]`` view, decoded: ``[*ids.shape, row_len]``.

        Only the selected rows are dequantized (a token embedding of 262,144 rows
        costs ``len(ids)`` rows, not the table). ``check=False`` skips the range check, which reads ``ids``
        back to the host (a CUDA graph cannot hold that read); the caller then promises ids in
        ``[0, n_rows)``.

        Raises: IndexError for an id outside ``[-n_rows, n_rows)`` (with ``check``); TypeError for a
        non-integer ``ids`` or a non-floating ``dtype``.
        """
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.long)
        if check:
            if flat.numel() and (int(flat.min()) < -self.n_rows or int(flat.max()) >= self.n_rows):
                raise IndexError(f"row id out of range for {self.n_rows} rows of {self!r}")
            flat = flat % max(self.n_rows, 1)
        on_cpu = self.device.type == "cpu"
        out = quant_kernels.take_rows(self.raw, self.qtype.name, self.row_len, flat) if on_cpu else None
        if out is not None:  # the packed CPU kernel: float32, bit-identical with the decoders here
            return out.to(_out_dtype(dtype)).reshape(*ids.shape, self.row_len)
        rows = self.raw.index_select(0, flat)
        out = dequantize(rows, self.qtype, (flat.numel(), self.row_len), dtype)
        return out.reshape(*ids.shape, self.row_len)

    def select(self, index: int) -> "QuantizedTensor":
        """Slice ``index`` of the first dimension of a tensor of 2 or more dimensions (e.g. one MoE expert); no copy.

        Raises: ValueError for a 1-D tensor; IndexError for an index out of range.
        """
        if len(self.shape) < 2:
            raise ValueError(f"select needs a tensor of 2 or more dimensions, got {self!r}")
        n0 = self.shape[0]
        if not -n0 <= index < n0:
            raise IndexError(f"index {index} out of range for first dimension {n0} of {self!r}")
        index %= n0
        per = self.n_rows // n0 if n0 else 0
        return QuantizedTensor(self.raw[index * per:(index + 1) * per], self.qtype, self.shape[1:])

    def linear(self, x: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
        """``x @ W.T`` with ``W`` this tensor; see :func:`linear`."""
        return linear(x, self, chunk_rows)

    def matmul(self, x: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
        """Same as :meth:`linear`: ``x @ W.T`` (the ``nn.Linear`` convention, W stored ``[out, in]``)."""
        return linear(x, self, chunk_rows)


def _packed_in_blocks(x2: torch.Tensor, qt: "QuantizedTensor", n_in: int) -> torch.Tensor | None:
    """``x2 @ W.T`` for more rows than :data:`fast.quant_kernels.MAX_ROWS`, a block of that many rows at a time
    through the packed kernel, or None where it does not apply. The kernel's result for a row does not depend on
    the other rows, so this is the one-call result bit for bit; measured faster than dequantizing and a GEMM at
    every row count tried (16 to 83 rows of a 6144 x 1536 Q8_0 or Q4_K matrix, 2 threads: 1.2-1.7x)."""
    step = quant_kernels.MAX_ROWS
    first = quant_kernels.linear(x2[:step], qt.raw, qt.type_name, n_in, qt.kernel_layout)
    if first is None:
        return None
    parts = [first] + [quant_kernels.linear(x2[a:a + step], qt.raw, qt.type_name, n_in, qt.kernel_layout)
                       for a in range(step, x2.shape[0], step)]
    return torch.cat(parts, 0)


def linear(x: torch.Tensor, qt: QuantizedTensor, chunk_rows: int | None = None) -> torch.Tensor:
    """``x @ W.T`` for a quantized weight ``W = qt`` of shape ``[out, in]``, dequantizing ``W`` a chunk of rows at a time.

    Args:
        x: ``[..., in]``, floating, on ``qt.device``.
        qt: a 2-D :class:`QuantizedTensor` ``[out, in]`` (the GGUF layout of a
            linear weight: numpy shape ``(n_out, n_in)``).
        chunk_rows: rows of ``W`` decoded per step; default: about 2**22
            elements' worth (``max(1, 4194304 // in)``).

    Returns:
        ``[..., out]`` in ``x.dtype``. Each chunk ``W[r0:r1]`` is dequantized in
        float32 (bit-exact), cast to ``x.dtype``, and multiplied:
        ``y[..., r0:r1] = x @ W[r0:r1].T``. The result equals
        ``x @ dequantize(W).T`` up to matmul summation order. On the CPU, float32 rows
        of a type the packed kernels decode go through :func:`fast.quant_kernels.linear`
        instead, :data:`fast.quant_kernels.MAX_ROWS` at a time (no chunk is materialised;
        one fixed summation order, so each row's result is the same bit for bit whatever
        the other rows are and however many there are). On CUDA, 1 to
        :data:`fast.cuda_kernels.MAX_ROWS` rows of a Q8_0 / Q4_K weight go through the
        fused Triton kernel :func:`fast.cuda_kernels.linear` (float32 sums of ``x`` times
        the exact weights, cast to ``x.dtype``; batch-invariant in the same sense).

    Memory: never more than one chunk of ``W`` dequantized at a time
    (``chunk_rows * in`` elements in ``x.dtype``, plus the float32 working
    buffers of that chunk), beside ``qt``'s raw bytes and the output.

    Raises:
        ValueError: ``qt`` is not 2-D, ``x``'s last dimension is not ``in``, or
            ``chunk_rows`` < 1.
        TypeError: ``x`` is not floating.
    """
    if len(qt.shape) != 2:
        raise ValueError(f"linear needs a 2-D weight, got {qt!r}")
    n_out, n_in = qt.shape
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be floating, got {x.dtype}")
    if x.shape[-1] != n_in:
        raise ValueError(f"x has last dimension {x.shape[-1]}, weight {qt!r} expects {n_in}")
    if chunk_rows is None:
        chunk_rows = max(1, _LINEAR_CHUNK_ELEMS // max(n_in, 1))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_in)
    y = quant_kernels.linear(x2, qt.raw, qt.type_name, n_in, qt.kernel_layout)  # None unless CPU, float32, 1..16 rows
    if y is None and x2.shape[0] > quant_kernels.MAX_ROWS:
        y = _packed_in_blocks(x2, qt, n_in)
    if y is None and x2.device.type == "cuda":  # the fused Triton kernel: None unless 1..MAX_ROWS rows, Q8_0/Q4_K
        y = cuda_kernels.linear(x2, qt.raw, qt.qtype.name, n_in)
    if y is not None:
        return y.reshape(*lead, n_out)
    if chunk_rows >= n_out:
        return (x2 @ qt.dequantize_rows(0, n_out, x.dtype).T).reshape(*lead, n_out)
    out = torch.empty(x2.shape[0], n_out, dtype=x.dtype, device=x.device)
    for r0 in range(0, n_out, chunk_rows):
        r1 = min(n_out, r0 + chunk_rows)
        w = qt.dequantize_rows(r0, r1, x.dtype)
        out[:, r0:r1] = x2 @ w.T
        del w
    return out.reshape(*lead, n_out)
