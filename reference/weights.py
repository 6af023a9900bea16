"""One loader for every engine: GGUF or HF safetensors -> (config, canonical weights).

Both formats map onto the canonical GGUF tensor names of :mod:`reference.names`.
A GGUF is checked and parsed once by :func:`reference.gguf_check.check_gguf`
(header, keys, tensor table and data layout, before any tensor is trusted).
Tensors are read lazily and streamed: the GGUF (or each safetensors file) stays
memory-mapped, a tensor is dequantized into float64 when an operation reads it and
released after, and at most a byte budget of them stays cached (:class:`Weights`).
Embedding tables give the rows of the prompt's tokens, and the LM head reads its
table in blocks of rows, so no table is ever dequantized whole.

Quantized GGUF types are dequantized with ``gguf.quants.dequantize`` (every type
it supports), so the reference sees exactly what llama.cpp's conversion tools
produce. ``rope_freqs`` is kept as stored (float32), never recomputed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np

from .activation_quants import BLOCK_MIN_OFFSET, block_minima
from .config import ModelConfig, cut_layers, expected_tensors, optional_tensors, unread_tensors
from .config_gguf import attach_rope_freqs, config_from_gguf
from .config_hf import config_from_hf
from .errors import ConfigError, ModelFileError
from .files import read_json
from .gguf_check import GGUFFile, check_gguf
from .lazy_tensors import LazyTensor, safetensors_folder
from .names import hf_to_gguf
from .weight_check import check_stored, check_values

#: Default of ``--ref-cache-gb``: bytes of dequantized float64 weights the reference keeps between reads.
DEFAULT_CACHE_BYTES = 2 * 10**9

#: Rows of a table read per block by :meth:`Weights.row_blocks` at least (see there), and the float64
#: bytes a block may grow to by doubling its rows.
BLOCK_ROWS, BLOCK_BYTES = 4096, 64 << 20

#: Elements a matrix is dequantized in at a time, into its float64 array (bounds the float32 temporaries).
READ_ELEMENTS = 1 << 21


def _read_float64(lazy: LazyTensor) -> np.ndarray:
    """The whole tensor as float64; a matrix is dequantized :data:`READ_ELEMENTS` at a time straight into
    the result, so no full-size float32 copy exists beside it (same values: dequantization is per block)."""
    if lazy.read_rows is None or len(lazy.shape) != 2:
        return np.asarray(lazy.read(), dtype=np.float64).reshape(lazy.shape)
    out = np.empty(lazy.shape, dtype=np.float64)
    step = max(1, READ_ELEMENTS // max(1, lazy.shape[1]))
    for a in range(0, lazy.shape[0], step):
        out[a:a + step] = lazy.read_rows(slice(a, min(a + step, lazy.shape[0])))
    return out


def block_bounds(n_rows: int, n_cols: int) -> list[tuple[int, int]]:
    """Row ranges ``[(start, stop), ...]`` that :meth:`Weights.row_blocks` reads a ``[n_rows, n_cols]`` table in.

    A block holds :data:`BLOCK_ROWS` times a power of two rows, the most whose float64 copy stays
    within :data:`BLOCK_BYTES` (at least :data:`BLOCK_ROWS`); a short last block is merged into the one
    before it. With such blocks, ``x @ table.T`` computed block by block equals the one-call product
    bit for bit under OpenBLAS (measured: T 1..200, hidden 640..5376, vocab 20000..262144; a
    product narrower than ~1000 columns or a remainder of a few columns takes other kernels, which
    is why blocks are this wide and why the remainder is merged). ``tests/test_streaming.py``
    checks it on the machine that runs the tests.
    """
    rows = BLOCK_ROWS
    while rows * 2 * n_cols * 8 <= BLOCK_BYTES:
        rows *= 2
    bounds = [(a, min(a + rows, n_rows)) for a in range(0, n_rows, rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < rows:
        bounds[-2:] = [(bounds[-2][0], n_rows)]
    return bounds


class GGMLArray(np.ndarray):
    """A weight read from a GGUF that carries its stored GGML type (``ggml_type``: ``Q8_0``, ``F16`` ...), so that an
    emulation of llama.cpp's quantized activations (:func:`reference.model.linear_input`) knows, at the product, what
    the engine rounds the activation row to. Views (slices, ``.T``, an expert of a stack) keep the type; the result
    of any arithmetic is a plain ndarray (only the stored tensor is typed). The values are the float64 ones."""

    ggml_type: str | None = None
    block_min: np.ndarray | None = None
    """Q4_1 / Q5_1 only: each block's fp16 minimum ``m`` from the stored bytes, float64 ``[..., in / 32]`` (the
    array's shape but the last axis), which llama.cpp's Q8_1 dot product multiplies by the activation block's sum
    (:func:`reference.activation_quants.q8_1_sum_correction`). Kept by a selection of whole rows or experts
    (``w[a:b]``, ``w[e]``), dropped by any other view (``.T``, a column slice), where it would not match."""

    def __array_finalize__(self, obj) -> None:
        if obj is not None:
            self.ggml_type = getattr(obj, "ggml_type", None)
        self.block_min = None

    def __getitem__(self, key):
        out = super().__getitem__(key)
        if self.block_min is not None and isinstance(out, GGMLArray) and _rows_only(key, self.ndim):
            mins = self.block_min[key]
            if mins.shape[:-1] == out.shape[:-1]:
                out.block_min = mins
        return out

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        arr = np.asarray(arr).view(np.ndarray)
        return arr[()] if return_scalar else arr


def _rows_only(key, ndim: int) -> bool:
    """Whether an index ``key`` of an array of ``ndim`` dimensions selects along the leading axes only (an int, a
    slice, an integer array, or a tuple of fewer than ``ndim`` of those): the last axis, the row, stays whole."""
    parts = key if isinstance(key, tuple) else (key,)
    if len(parts) >= ndim:
        return False
    return all(isinstance(p, (int, np.integer, slice)) or (isinstance(p, np.ndarray) and p.dtype.kind in "iu")
               for p in parts)


class Weights(Mapping):
    """Read-only mapping canonical name -> float64 ndarray, dequantized when read, kept within a byte budget.

    Shapes are numpy order: linear weights ``[out, in]``, expert stacks
    ``[n_expert, out, in]``, norms ``[n]``. ``raw_dtype(name)`` tells the stored type.

    Streaming: a tensor is dequantized to float64 each time it is read and dropped when its user
    lets go of it, unless it is cached. The cache admits a tensor on its *second* read while the
    cached bytes stay within ``cache_bytes``: one forward (every tensor read once) caches nothing,
    so its peak memory is the largest tensor in use, not the model; repeated forwards (generation,
    parity) keep the first tensors that fit, which for a model smaller than the budget is all of
    them. Tables are read in parts: :meth:`rows` (embedding rows of the prompt's tokens) and
    :meth:`row_blocks` (the LM head over the vocabulary) read only the stored bytes they need.
    Every read gives the same float64 values as dequantizing the whole tensor (dequantization
    works block by block; row ranges hold whole blocks).

    Args:
        source: the file or folder, for messages.
        tensors: canonical name -> :class:`reference.lazy_tensors.LazyTensor`.
        cache_bytes: the cache budget in bytes (:data:`DEFAULT_CACHE_BYTES`; 0 caches nothing).

    Raises (on access):
        KeyError: unknown name.
        ModelFileError: the tensor (or the rows read) holds NaN, Inf or |w| > 1e30 (named, with the
            element or block in the whole tensor; see :mod:`reference.weight_check`).
    """

    def __init__(self, source: str, tensors: dict[str, LazyTensor], cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.source = source
        self._lazy = tensors
        self._cache: dict[str, np.ndarray] = {}
        self._seen: set[str] = set()  # read once, not cached
        self._checked: set[str] = set()  # checked whole: parts need no check
        self.cache_bytes = int(cache_bytes)
        self.cached_bytes = 0
        self._held: dict[str | tuple[str, int], np.ndarray] | None = None  # inside hold(); (stack, expert): experts()
        self.ggml_typed = False  # a GGUF's: reads of whole tensors and row blocks are GGMLArray views (load_gguf)

    # ------------------------------------------------------------------ checks (subclasses change the rule)

    def _check_before(self, name: str, lazy: LazyTensor, stored: np.ndarray | None, first_row: int = 0) -> None:
        """Check GGUF bytes before they are dequantized (:func:`reference.weight_check.check_stored`).

        ``stored``: the tensor's bytes, or rows ``first_row ..`` of them; None for a file with no stored form.
        """
        if stored is not None:
            check_stored(self.source, name, lazy.dtype, stored, lazy.shape, first_row=first_row)

    def _check_after(self, name: str, lazy: LazyTensor, arr: np.ndarray, first_row: int = 0) -> None:
        """Check values read from a file with no stored form (safetensors): NaN, Inf, |w| > 1e30.

        ``arr``: the tensor, or its rows ``first_row ..``.
        """
        if lazy.stored is None:
            check_values(self.source, name, arr, shape=lazy.shape, first_row=first_row)

    # ------------------------------------------------------------------ reads

    def _typed(self, name: str, arr: np.ndarray, index: slice | int | None = None) -> np.ndarray:
        """``arr`` (tensor ``name``, or its rows ``index`` of the first axis) as a :class:`GGMLArray` view of its
        stored type, for a GGUF; a Q4_1 / Q5_1 matrix with its blocks' minima from the stored bytes
        (:attr:`GGMLArray.block_min`)."""
        if not self.ggml_typed:
            return arr
        lazy = self._lazy[name]
        out = arr.view(GGMLArray)
        out.ggml_type = lazy.dtype
        if lazy.dtype in BLOCK_MIN_OFFSET and lazy.stored is not None and arr.ndim >= 2:
            stored = lazy.stored if index is None else lazy.stored[index]
            out.block_min = block_minima(stored, lazy.dtype).reshape(*arr.shape[:-1], arr.shape[-1] // 32)
        return out

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Within the ``with`` block every tensor read is kept, and read again from there, until the block ends
        (for :func:`reference.batch.forward_chains`: a layer's weights dequantized once for many forwards).

        The held tensors are the same arrays a read gives; the cache rule is unchanged (a held tensor counts
        as read once per block). Nested blocks hold until the outermost ends.
        """
        if self._held is not None:
            yield
            return
        self._held = {}
        try:
            yield
        finally:
            self._held = None

    def __getitem__(self, name: str) -> np.ndarray:
        return self._typed(name, self._get(name))

    def _get(self, name: str) -> np.ndarray:
        if name in self._cache:
            return self._cache[name]
        if self._held is not None and name in self._held:
            return self._held[name]
        lazy = self._lazy[name]
        if name not in self._checked:
            self._check_before(name, lazy, lazy.stored)
        arr = _read_float64(lazy)
        if name not in self._checked:
            self._check_after(name, lazy, arr)
        self._checked.add(name)
        arr.setflags(write=False)
        if name in self._seen and self.cached_bytes + arr.nbytes <= self.cache_bytes:
            self._cache[name] = arr
            self.cached_bytes += arr.nbytes
        elif self._held is not None:
            self._held[name] = arr
        self._seen.add(name)
        return arr

    def _read_rows(self, name: str, index: slice | np.ndarray) -> np.ndarray:
        """Rows ``index`` (first dimension) of a tensor of 2 dims or more as float64, checked unless the whole
        tensor was. [n, cols] (a stack: [n, out, in])."""
        lazy = self._lazy[name]
        if lazy.read_rows is None:
            return self[name][index]
        if name in self._checked:
            return np.asarray(lazy.read_rows(index), dtype=np.float64).reshape(-1, *lazy.shape[1:])
        parts = [(index.start or 0, index)] if isinstance(index, slice) else \
            [(r, slice(r, r + 1)) for r in np.unique(index).tolist()]  # each distinct row once
        for first, where in parts:
            self._check_before(name, lazy, None if lazy.stored is None else lazy.stored[where], first)
        arr = np.asarray(lazy.read_rows(index), dtype=np.float64).reshape(-1, *lazy.shape[1:])
        for first, where in parts:
            rows = arr if isinstance(index, slice) else arr[int(np.argmax(index == first))][None]
            self._check_after(name, lazy, rows, first)
        return arr

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """``W[name][ids]`` without dequantizing the table: only the rows of ``ids`` are read. [T] -> [T, cols].

        Args:
            name: a 2-D tensor (an embedding table).
            ids: int64 row indices, any order, repeats allowed.

        Raises:
            KeyError: unknown name. ModelFileError: a bad value in a row read.
        """
        if name in self._cache:
            return self._cache[name][ids]
        return self._read_rows(name, np.asarray(ids, dtype=np.int64))

    def row_blocks(self, name: str) -> Iterator[np.ndarray]:
        """The 2-D tensor ``name`` as float64 blocks of rows, in order (:func:`block_bounds`): [n_i, cols] each.

        Reads one block at a time; a cached tensor (or one the cache admits now) is sliced instead.
        """
        shape = self._lazy[name].shape
        admit = name in self._seen and self.cached_bytes + 8 * int(np.prod(shape)) <= self.cache_bytes
        if name in self._cache or admit:
            full = self[name]
            for a, b in block_bounds(*shape):
                yield full[a:b]
            return
        self._seen.add(name)
        for a, b in block_bounds(*shape):
            yield self._typed(name, self._read_rows(name, slice(a, b)), slice(a, b))
        self._checked.add(name)

    def experts(self, name: str, chosen: np.ndarray) -> dict[int, np.ndarray]:
        """Experts ``chosen`` of the stack ``name`` without dequantizing the others: ``{e: W[name][e]}``,
        float64 ``[out, in]`` each, the same values (dequantization is per block; an expert's rows hold whole blocks).

        A MoE layer's tokens use ``K`` of its ``E`` experts each (:func:`reference.model.moe_block`), so a pass
        reads what the tokens chose, not the stack. A cached stack (or one the cache admits now, as
        :meth:`row_blocks`) is sliced; else each expert is read alone (its stored bytes checked first), and
        inside :meth:`hold` kept until the block ends, so the calls of a layer-outer pass read the union of
        their experts once.

        Args:
            name: a 3-D tensor ``[E, out, in]`` (``ffn_gate_up_exps.weight``, ``ffn_down_exps.weight``).
            chosen: int expert indices, any order, repeats allowed.

        Raises:
            KeyError: unknown name. ModelFileError: a bad value in an expert read.
        """
        ids = [int(e) for e in np.unique(np.asarray(chosen, dtype=np.int64))]
        shape = self._lazy[name].shape
        admit = name in self._seen and self.cached_bytes + 8 * int(np.prod(shape)) <= self.cache_bytes
        if name in self._cache or admit or (self._held is not None and name in self._held):
            full = self[name]
            return {e: full[e] for e in ids}
        self._seen.add(name)
        out = {}
        for e in ids:
            key = (name, e)  # an expert held on its own (hold())
            arr = None if self._held is None else self._held.get(key)
            if arr is None:
                arr = self._read_rows(name, slice(e, e + 1))[0]
                arr.setflags(write=False)
                if self._held is not None:
                    self._held[key] = arr
            out[e] = self._typed(name, arr, e)
        return out

    def expert(self, name: str, e: int) -> np.ndarray:
        """One expert of the stack ``name``: ``experts(name, [e])[e]``, except that :meth:`hold` does not keep it
        (float64 ``[out, in]``). For a caller that multiplies every row routed to the expert at once
        (:func:`reference.batch.expert_products`): a layer-outer pass then holds one expert at a time, not the
        union of its calls' experts (on the 26B-A4B shape about 6 GB of float64 per layer).

        Raises:
            KeyError: unknown name. ModelFileError: a bad value in the expert.
        """
        held, self._held = self._held, None
        try:
            return self.experts(name, np.array([e]))[e]
        finally:
            self._held = held

    def fill_cache(self) -> int:
        """Read tensors in file order into the cache until the budget is full (a benchmark's warm-up).

        Returns:
            the bytes cached.
        """
        for name, lazy in self._lazy.items():
            if name not in self._cache and self.cached_bytes + 8 * int(np.prod(lazy.shape)) <= self.cache_bytes:
                self._seen.add(name)
                self[name]
        return self.cached_bytes

    def __contains__(self, name: object) -> bool:
        # Mapping's default looks the item up, which would dequantize it.
        return name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self._lazy)

    def __len__(self) -> int:
        return len(self._lazy)

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of ``name`` without reading it."""
        return self._lazy[name].shape

    def raw_dtype(self, name: str) -> str:
        """Stored type of ``name`` (GGML type name such as ``Q8_0``, or a safetensors dtype name such as ``BF16``)."""
        return self._lazy[name].dtype

    def stored(self, name: str) -> np.ndarray | None:
        """The tensor's bytes exactly as stored in a GGUF (memory-mapped view, not a copy), or None
        for safetensors. Used by ``fast/`` to dequantize on its own device."""
        return self._lazy[name].stored

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored after dequantization, in its natural float dtype (no float64 copy kept)."""
        lazy = self._lazy[name]
        return np.asarray(lazy.read()).reshape(lazy.shape)


# --------------------------------------------------------------------------- GGUF


Dequantizer = Callable[[np.ndarray, str, int], "np.ndarray | None"]
"""An exact replacement of ``gguf.quants.dequantize`` for rows of a quantized tensor of 2 or more dimensions (a
stack, such as a MoE layer's experts, comes as its rows one after another):
``(stored bytes [n, bytes_per_row], GGML type name, elements per row) -> float32 [n, row_len]`` with the same
values bit for bit, or None where it does not apply (then ``gguf.quants`` runs)."""


def _gguf_tensors(gf: GGUFFile, dequantizer: Dequantizer | None = None) -> dict[str, LazyTensor]:
    out: dict[str, LazyTensor] = {}
    for t in gf.tensors.values():  # sizes, offsets and types already checked by check_gguf
        data = gf.view(t.name)
        qtype = gguf.GGMLQuantizationType(t.ggml_type)

        def dequantize(part, t=t, qtype=qtype):
            # a matrix, or a stack of them (a MoE layer's [experts, rows, bytes per row]: its rows, one after
            # another, are a matrix's; dequantization is per block, so the values are the same either way)
            if dequantizer is not None and len(t.shape) >= 2 and part.ndim == len(t.shape) and part.dtype == np.uint8:
                got = dequantizer(np.ascontiguousarray(part).reshape(-1, part.shape[-1]), t.type_name, t.shape[-1])
                if got is not None:
                    return got.reshape(*part.shape[:-1], t.shape[-1])
            try:
                return gguf.quants.dequantize(part, qtype)
            except NotImplementedError:
                raise ModelFileError(f"{gf.path}: tensor {t.name}: type {t.type_name} cannot be dequantized by "
                                     "gguf.quants") from None

        rows = (lambda index, data=data, f=dequantize: f(data[index])) if len(t.shape) >= 2 else None
        out[t.name] = LazyTensor(shape=t.shape, dtype=t.type_name, read=lambda data=data, f=dequantize: f(data),
                                 read_rows=rows, stored=data, source=str(gf.path), key=t.name)
    return out


def load_gguf(path: str | os.PathLike, *, layers: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
              dequantizer: Dequantizer | None = None) -> tuple[ModelConfig, Weights]:
    """Open a ``.gguf`` file: config from its metadata, lazily dequantized weights.

    Args:
        path: the file.
        layers: keep only the first N layers (:func:`reference.config.cut_layers`); None = all.
        cache_bytes: the weights' cache budget (:class:`Weights`).
        dequantizer: a faster exact replacement of ``gguf.quants`` for matrices (:data:`Dequantizer`; the harness
            passes the packed C kernels of ``fast/``); None: ``gguf.quants`` for everything.

    Returns:
        ``(config, weights)``.

    Raises:
        ModelFileError: not a GGUF file, truncated, missing/mis-shaped tensor,
            undequantizable type.
        ConfigError: bad or missing metadata (the key is named); ``layers`` out of range.
    """
    path = Path(path)
    gf = check_gguf(path)  # structure checked before any tensor is trusted (reference.gguf_check)
    meta = gf.metadata
    tensors = _gguf_tensors(gf, dequantizer)
    cfg = config_from_gguf(meta, {k: v.shape for k, v in tensors.items()}, str(path))
    if "rope_freqs.weight" in tensors:  # checked finite and > 0 (exact: float32 values)
        cfg = attach_rope_freqs(cfg, np.asarray(Weights(str(path), tensors, 0)["rope_freqs.weight"],
                                                dtype=np.float32))
    cfg, tensors = _cut(cfg, tensors, layers)
    weights = Weights(str(path), tensors, cache_bytes)
    weights.ggml_typed = True
    weights.metadata = meta  # type: ignore[attr-defined]
    weights.gguf = gf  # type: ignore[attr-defined]  # keeps the map alive
    _validate(cfg, weights)
    return cfg, weights


# --------------------------------------------------------------------------- safetensors


def read_hf_config(path: Path) -> dict:
    """``config.json`` of the HF folder ``path`` as a dict.

    Raises:
        ModelFileError: missing or not valid JSON. ConfigError: not a JSON object.
    """
    cfg_path = path / "config.json"
    if not os.path.lexists(cfg_path):
        raise ModelFileError(f"{cfg_path}: missing (an HF model folder needs config.json)")
    raw = read_json(cfg_path, streams=False, error=ModelFileError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object")
    return raw


def load_hf(path: str | os.PathLike, *, layers: int | None = None,
            cache_bytes: int = DEFAULT_CACHE_BYTES) -> tuple[ModelConfig, Weights]:
    """Open an HF model folder (``config.json`` + ``*.safetensors``), tensor by tensor.

    A multimodal checkpoint (``model_type`` ``gemma4`` with ``text_config``,
    tensors under ``model.language_model.``) loads its text decoder; vision and
    audio tensors are ignored. Files are read through
    :func:`reference.lazy_tensors.safetensors_folder` (mapped; a tensor, or rows of one, read when asked).

    Args:
        path: the folder.
        layers: keep only the first N layers (:func:`reference.config.cut_layers`); None = all.
        cache_bytes: the weights' cache budget (:class:`Weights`).

    Returns:
        ``(config, weights)`` with canonical GGUF names.

    Raises:
        ModelFileError: no config.json or safetensors, unreadable file,
            missing/mis-shaped tensor.
        ConfigError: bad config fields (named); ``layers`` out of range.
    """
    path = Path(path)
    cfg = config_from_hf(read_hf_config(path), str(path / "config.json"))
    tensors: dict[str, LazyTensor] = {}
    for key, t in safetensors_folder(path).items():
        canon = hf_to_gguf(key)
        if canon is None:
            continue
        if canon in tensors:
            raise ModelFileError(f"{t.source}: tensor {key} maps to {canon}, which another tensor already provides")
        tensors[canon] = t
    cfg, tensors = _cut(cfg, tensors, layers)
    weights = Weights(str(path), tensors, cache_bytes)
    _validate(cfg, weights)
    return cfg, weights


# --------------------------------------------------------------------------- common


def _cut_columns(t: LazyTensor, k: int) -> LazyTensor:
    """The first ``k`` columns of the 2-D tensor ``t`` (read without the other columns' values)."""
    stored = None
    if t.stored is not None:
        if t.stored.dtype != np.uint8:  # typed (F32, F16): columns are elements
            stored = t.stored[:, :k]
        else:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.dtype]]
            stored = t.stored[:, :k // block * size] if k % block == 0 else None

    def read_rows(index, t=t):
        return t.read_rows(index)[:, :k]

    def read(t=t):
        return np.concatenate([read_rows(slice(a, b)) for a, b in block_bounds(t.shape[0], t.shape[1])])

    return LazyTensor(shape=(t.shape[0], k), dtype=t.dtype, read=read, read_rows=read_rows, stored=stored,
                      source=t.source, key=t.key)


def _cut_rows(t: LazyTensor, k: int) -> LazyTensor:
    """The first ``k`` rows of the 2-D tensor ``t``."""
    return LazyTensor(shape=(k, *t.shape[1:]), dtype=t.dtype, read=lambda: t.read_rows(slice(0, k)),
                      read_rows=t.read_rows, stored=None if t.stored is None else t.stored[:k],
                      source=t.source, key=t.key)


def _cut(cfg: ModelConfig, tensors: dict[str, LazyTensor], layers: int | None
         ) -> tuple[ModelConfig, dict[str, LazyTensor]]:
    """``--layers N``: the config of the first N layers and the tensors it reads (others dropped).

    Layers ``blk.N`` and up go; the PLE table keeps the first ``N * ple_dim`` columns
    (``per_layer_token_embd``, ``[V, L*P]``: layer-major rows) and its projection the first ``N * ple_dim``
    rows (``per_layer_model_proj``, ``[L*P, h]``).
    """
    if layers is None or layers == cfg.n_layer:
        return cfg, tensors
    cut = cut_layers(cfg, layers)
    out = {}
    for name, t in tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= layers:
            continue
        if cfg.ple_dim and name == "per_layer_token_embd.weight" and t.read_rows is not None:
            t = _cut_columns(t, layers * cfg.ple_dim)
        elif cfg.ple_dim and name == "per_layer_model_proj.weight" and t.read_rows is not None:
            t = _cut_rows(t, layers * cfg.ple_dim)
        out[name] = t
    return cut, out


def _validate(cfg: ModelConfig, weights: Weights) -> None:
    expected = expected_tensors(cfg)
    optional = optional_tensors(cfg)
    for name, shape in expected.items():
        if name not in weights:
            if name in optional:
                continue
            raise ModelFileError(f"{weights.source}: missing tensor {name} (expected shape {list(shape)})")
        got = weights.shape(name)
        if tuple(got) != tuple(shape):
            raise ModelFileError(f"{weights.source}: tensor {name} has shape {list(got)}, expected {list(shape)}")
    for name in unread_tensors(cfg, weights)[:1]:
        raise ModelFileError(f"{weights.source}: tensor {name} is not one this {cfg.arch} config reads "
                             "(a misspelt or damaged name, or keys that do not match the tensors)")


def load_model(path: str | os.PathLike, *, layers: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
               dequantizer: Dequantizer | None = None) -> tuple[ModelConfig, Weights]:
    """Load a model from a ``.gguf`` file or an HF folder; the one entry point every engine uses.

    Args:
        path: ``*.gguf`` file, or a folder with ``config.json`` and safetensors.
        layers: keep only the first N layers (``--layers N``; :func:`reference.config.cut_layers`); None = all.
        cache_bytes: bytes of float64 weights the reference may keep cached (``--ref-cache-gb``;
            see :class:`Weights`).
        dequantizer: a GGUF's faster exact dequantizer (:func:`load_gguf`); ignored for an HF folder.

    Returns:
        ``(config, weights)``.

    Raises:
        ModelFileError: the path does not exist or is neither form; any loader error.
        ConfigError: metadata errors; ``layers`` out of range.
    """
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder")
    if p.is_dir():
        return load_hf(p, layers=layers, cache_bytes=cache_bytes)
    return load_gguf(p, layers=layers, cache_bytes=cache_bytes, dequantizer=dequantizer)
