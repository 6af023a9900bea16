"""Check a GGUF file's structure before any of it is trusted, and read it once.

:func:`check_gguf` parses the whole header with bounded reads and checks it
against the file's size, then returns a :class:`GGUFFile` that the loader uses
directly (metadata as Python values, memory-mapped tensor views), so the file
is parsed once and ``gguf.GGUFReader`` (9-15 s on a 262k-token vocabulary,
one memmap view per string) is never needed. Tensor *values* (NaN, Inf,
magnitudes no matmul can carry) are checked by :mod:`reference.weight_check`.

What is checked, in order (each failure is one line naming the file and the
header field, key or tensor, and what was expected):

* header: magic ``GGUF``; version 2 or 3; ``tensor_count`` and ``kv_count``
  no larger than the bytes left can hold (a key/value needs at least 13 bytes,
  a tensor info at least 24). Past a count too large, the entries are still
  read (every read is bounded): when they read well up to the end of the file,
  the file is truncated and the entry where it ends is named; otherwise the
  count is;
* each key/value: name length within the bytes left, ASCII, 1 to 65535 bytes,
  not a duplicate (an entry whose length field is damaged is named by the
  printable bytes that follow it; a length field that holds text, or no name
  after it, names the entry before); a known value type; BOOL values 0 or 1
  (the spec calls anything else invalid); an array's element type known and not an
  array, and its count within the bytes left *before* anything is allocated;
* the types of the keys this harness reads (``general.alignment``, the
  ``tokenizer.ggml`` ids and tables, every ``gemma4.*`` / ``gemma3.*`` key
  :func:`reference.config_gguf.config_from_gguf` reads): exactly the GGUF type
  llama.cpp reads them as (its ``get_key`` refuses any other); unknown keys are
  allowed (another architecture's ``gemma3.*`` copy in a gemma4 file, a converter's
  own), except one character from a ``<arch>.*`` key the model reads that the file
  does not hold (a misspelt or damaged name would silently read as absent);
* each tensor info: name 1 to 63 bytes (ggml ``GGML_MAX_NAME``), printable,
  not a duplicate; ``n_dims`` <= 4; every dimension > 0
  and < 2**63; a type that ``gguf`` knows the block size of; rows a multiple
  of the block size;
* ``general.alignment`` a power of two (default 32);
* the data section: every tensor's offset a multiple of the alignment and its
  bytes inside the file; tensors back to back in table order, each padded to
  the alignment, with less than one alignment of padding after the last.
  llama.cpp (``gguf_init_from_file_impl``) refuses any other layout, so a gap
  or an overlap always means a wrong offset, type or shape;
* every padding byte 0x00 (the spec: "the file is padded with 0x00 bytes"):
  a tensor whose type or shape shrank it by less than the alignment leaves
  its own bytes there.

Value ranges of the model keys (block count, RoPE bases, epsilon, softcap, ...)
are checked where the config is built, in :func:`reference.config_gguf.config_from_gguf`.

Here: the structure and the data section; the bounded reads of names and values are :mod:`.gguf_read`, the
keys' types :mod:`.gguf_keys`.

Sources: GGUF specification (ggml ``docs/gguf.md``); llama.cpp
``ggml/src/gguf.cpp`` (``GGUF_MAX_ARRAY_ELEMENTS``, ``GGML_MAX_DIMS``, the
data-section layout rule) and ``src/llama-model-loader.cpp`` (exact key types);
gguf-py ``GGML_QUANT_SIZES`` and ``gguf/quants.py`` (block layouts).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from .errors import ConfigError, InputError, ModelFileError
from .files import open_regular
from .gguf_keys import check_key_types, key_type_error
from .gguf_read import ARRAY, MAX_KEY_BYTES, U32, U64, Cursor, entry, name_fault, read_name, read_value

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml GGML_MAX_DIMS
MAX_NAME_BYTES = 64  # ggml GGML_MAX_NAME: a tensor name is shorter (llama.cpp refuses longer ones)
MIN_KV_BYTES = 8 + 4 + 1  # name length, value type, smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


class Metadata(dict):
    """A GGUF file's key -> value dict, which also says which string arrays held bytes that are not UTF-8:
    ``invalid_utf8`` maps such a key to its first bad item (the value holds U+FFFD there). A tokenizer table must
    be text (:class:`reference.tokenizer.GGUFTokenizer` refuses it); other values are data."""

    invalid_utf8: dict[str, int] = {}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, checked.

    Attributes:
        name: GGUF tensor name.
        ggml_type: ``gguf.GGMLQuantizationType`` value.
        dims: GGUF order (``ne[0]``, the row length, first).
        offset: absolute byte offset of the data in the file.
        n_bytes: bytes of data (``n_elements / block_size * type_size``).
    """

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (``dims`` reversed)."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        """GGML type name, e.g. ``Q8_0``."""
        return gguf.GGMLQuantizationType(self.ggml_type).name

    def describe(self) -> str:
        """``Q8_0 [16, 32], 544 bytes at byte 1234`` (shape in numpy order)."""
        return f"{self.type_name} {list(self.shape)}, {self.n_bytes} bytes at byte {self.offset}"


@dataclass
class GGUFFile:
    """A checked GGUF file: metadata, tensor table and the mapped bytes.

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: key -> Python value (arrays as lists, strings as str).
        value_types: key -> (GGUF value type, array element type or None).
        alignment: ``general.alignment`` or 32.
        data_offset: byte where the data section starts.
        tensors: name -> :class:`TensorInfo`, in table order.
    """

    path: str
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[int, int | None]]
    alignment: int
    data_offset: int
    tensors: dict[str, TensorInfo]
    _map: Any = field(default=None, repr=False)

    def view(self, name: str) -> np.ndarray:
        """The stored data of ``name`` as a read-only view of the mapped file (no copy).

        Same convention as ``gguf.GGUFReader``'s ``tensor.data``: F32/F16/F64/I8..I64
        as their numpy dtype in numpy shape; every other type as uint8
        ``[..., bytes per row]``. ``gguf.quants.dequantize`` takes it as is.
        """
        t = self.tensors[name]
        q = gguf.GGMLQuantizationType(t.ggml_type)
        typed = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
        if q.name in typed:
            dt = np.dtype(typed[q.name])
            return np.frombuffer(self._map, dtype=dt, count=t.n_bytes // dt.itemsize, offset=t.offset).reshape(t.shape)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        return raw.reshape(gguf.quants.quant_shape_to_byte_shape(t.shape, q))


def _read_header(cur: Cursor) -> tuple[int, int, int, str | None]:
    """(version, tensor_count, kv_count, what is wrong with the counts or None).

    Counts the bytes after the header cannot hold are not raised here: the caller reads on, to tell a
    truncated file (which then names the entry where it ends) from a damaged count.
    """
    path = cur.path
    if cur.size < 4 or cur.buf[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic {bytes(cur.buf[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.scalar(U32, "header field version")
    if version not in GGUF_VERSIONS:
        raise ModelFileError(f"{path}: header field version = {version}: expected 2 or 3 "
                             "(a big-endian file reads as a huge version)")
    n_tensors = cur.scalar(U64, "header field tensor_count")
    n_kv = cur.scalar(U64, "header field kv_count")
    left = cur.left()
    problem = None
    if n_kv > left // MIN_KV_BYTES:
        problem = (f"header field kv_count = {n_kv}: {left} bytes follow the header, room for at most "
                   f"{left // MIN_KV_BYTES} keys")
    elif n_tensors > left // MIN_TENSOR_INFO_BYTES:
        problem = (f"header field tensor_count = {n_tensors}: {left} bytes follow the header, room for at most "
                   f"{left // MIN_TENSOR_INFO_BYTES} tensor infos")
    elif n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > left:
        problem = (f"header fields kv_count = {n_kv} and tensor_count = {n_tensors} need more than the {left} "
                   "bytes that follow the header")
    return version, n_tensors, n_kv, problem


def _read_kv(cur: Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]]]:
    meta: dict[str, Any] = {}
    types: dict[str, tuple[int, int | None]] = {}
    prev = "the header"
    for i in range(n_kv):  # messages locate a broken entry by the last good key before it
        key = read_name(cur, "key", i, prev)
        if not key or len(key) > MAX_KEY_BYTES or not key.isascii() or not key.isprintable():
            raise ConfigError(f"{cur.path}: {entry('key', i, key, prev)}: name has {name_fault(key, True)}, "
                              f"expected 1 to {MAX_KEY_BYTES} printable ASCII characters")
        if key in meta:
            raise ConfigError(f"{cur.path}: key {key} appears twice")
        vtype = cur.scalar(U32, f"key {key}: value type")
        arch = meta.get("general.architecture")  # known types are checked before the value is read: a wrong
        err = key_type_error(cur.path, key, (vtype, None), arch)  # type would misread the entries that follow
        if err:
            raise err
        meta[key], etype = read_value(cur, key, vtype, lambda et: key_type_error(cur.path, key, (ARRAY, et), arch))
        types[key] = (vtype, etype)
        prev = f"key {key}"
    return meta, types


def _read_tensor_infos(cur: Cursor, n_tensors: int, last_key: str | None, alignment: int
                       ) -> list[tuple[str, tuple[int, ...], int, int]]:
    infos = []
    names: set[str] = set()
    prev = f"key {last_key}" if last_key else "the header"
    for i in range(n_tensors):
        name = read_name(cur, "tensor", i, prev)
        where = f"tensor {name} (#{i}, after {prev})"
        if not 0 < len(name.encode()) < MAX_NAME_BYTES or not name.isprintable():
            raise ModelFileError(f"{cur.path}: {entry('tensor', i, name, prev)}: name has {name_fault(name, False)}, "
                                 f"expected 1 to {MAX_NAME_BYTES - 1} printable characters")
        if name in names:
            raise ModelFileError(f"{cur.path}: tensor {name} appears twice in the tensor table")
        names.add(name)
        n_dims = cur.scalar(U32, f"{where}: n_dims")
        if n_dims > MAX_DIMS:
            raise ModelFileError(f"{cur.path}: {where}: n_dims = {n_dims}, expected at most {MAX_DIMS}")
        dims = tuple(cur.scalar(U64, f"{where}: dimension {j}") for j in range(n_dims))
        for j, d in enumerate(dims):
            if d == 0 or d >= 1 << 63:
                raise ModelFileError(f"{cur.path}: {where}: dimension {j} (ne[{j}]) = {d}, expected 1 <= ne < 2**63")
        ggml_type = cur.scalar(U32, f"{where}: type")
        try:
            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, _ = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(f"{cur.path}: {where}: GGML type {ggml_type} is unknown") from None
        row = dims[0] if dims else 1
        if row % block:
            raise ModelFileError(f"{cur.path}: {where}: type {qtype.name} stores rows of a multiple of {block} "
                                 f"elements, but ne[0] = {row}")
        offset = cur.scalar(U64, f"{where}: offset")
        if offset % alignment or offset >= cur.size:  # checked here, so a damaged n_dims or dims is caught at
            what = (f"past the end of the file ({cur.size} bytes; truncated?)" if offset >= cur.size
                    else f"not a multiple of general.alignment {alignment}")
            raise ModelFileError(f"{cur.path}: tensor {name}: offset {offset} is {what}")  # this entry
        infos.append((name, dims, int(ggml_type), offset))
        prev = f"tensor {name}"
    return infos


def _alignment(path: str, meta: dict[str, Any]) -> int:
    a = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(a, bool) or not isinstance(a, int) or a <= 0 or a & (a - 1):
        raise ConfigError(f"{path}: key general.alignment = {a!r}: expected a power of two")
    return a


def _check_zero(path: str, buf, start: int, end: int, where: str, hint: str) -> None:
    """The GGUF spec pads with 0x00 bytes: anything else is data that belongs to no tensor."""
    pad = bytes(buf[start:end])
    if pad.strip(b"\0"):
        first = start + len(pad) - len(pad.lstrip(b"\0"))
        raise ModelFileError(f"{path}: {where}: padding byte {first} is {pad[first - start]:#04x}, expected 0x00 "
                             f"({hint})")


def _layout(path: str, buf, infos, data_offset: int, alignment: int, size: int) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, rel in infos:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        n_bytes = int(np.prod(dims, dtype=object)) // block * type_size if dims else type_size
        t = TensorInfo(name, ggml_type, dims, data_offset + rel, n_bytes)
        if t.offset + n_bytes > size:
            raise ModelFileError(f"{path}: tensor {name} ({t.type_name} {list(t.shape)}, {n_bytes} bytes at "
                                 f"offset {rel}) ends at byte {t.offset + n_bytes}, past the end of the file "
                                 f"({size} bytes; truncated?)")
        tensors[name] = t
    prev: TensorInfo | None = None
    expected = data_offset
    for t in tensors.values():  # back to back in table order, each padded to the alignment
        if t.offset != expected:
            rel = t.offset - data_offset
            if prev is None:
                raise ModelFileError(f"{path}: tensor {t.name} is the first in the table but starts at offset {rel} "
                                     "of the data section, expected 0")
            end = prev.offset + prev.n_bytes
            if t.offset < end:
                raise ModelFileError(f"{path}: tensor {t.name} at offset {rel} overlaps tensor {prev.name} "
                                     f"({prev.describe()}, ending at offset {end - data_offset})")
            raise ModelFileError(f"{path}: tensor {t.name} at offset {rel}, expected {expected - data_offset}: "
                                 f"the previous tensor {prev.name} ({prev.describe()}) ends "
                                 f"{t.offset - end} bytes earlier: its type or shape, or this offset, is wrong")
        expected = t.offset + -(-t.n_bytes // alignment) * alignment
        if prev is not None:
            _check_zero(path, buf, prev.offset + prev.n_bytes, t.offset, f"tensor {prev.name} ({prev.describe()})",
                        "its type or shape is wrong?")
        prev = t
    if prev is not None:
        end = prev.offset + prev.n_bytes
        if size - end >= alignment:
            raise ModelFileError(f"{path}: {size - end} bytes follow the last tensor {prev.name} ({prev.describe()}), "
                                 f"expected less than general.alignment {alignment}: its type or shape is wrong, "
                                 "or the file has extra bytes")
        _check_zero(path, buf, end, size, f"tensor {prev.name} ({prev.describe()}), the last one",
                    "its type or shape is wrong?")
    return tensors


def check_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and check a GGUF file's header, metadata and tensor table (data bytes untouched).

    Args:
        path: the ``.gguf`` file.

    Returns:
        :class:`GGUFFile` (the file stays memory-mapped for :meth:`GGUFFile.view`).

    Raises:
        ModelFileError: unreadable, not GGUF, an unsupported version, a count, length,
            dimension, type or offset the file cannot hold, an overlap or gap in
            the data section (named: the header field, key or tensor).
        ConfigError: a key with an unknown value type, a nested array, a
            duplicate or empty key, a known key of the wrong GGUF type, a bad
            ``general.alignment``.

    Cost: one pass over the header; a 262k-token vocabulary parses in about
    0.3 s (gguf.GGUFReader: 9-12 s). Tensor data is not read.
    """
    path_s = str(path)
    try:
        with open_regular(path, error=ModelFileError) as f:  # never a FIFO or a device: mapped
            size = os.fstat(f.fileno()).st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise ModelFileError(f"{path_s}: cannot read: {e.strerror or e}") from None
    cur = Cursor(buf, path_s)
    version, n_tensors, n_kv, count_problem = _read_header(cur)
    try:  # every read is bounded by the bytes left, so reading on past a count too large for the file is safe
        meta, types = _read_kv(cur, n_kv)
        check_key_types(path_s, types, meta)
        alignment = _alignment(path_s, meta)
        infos = _read_tensor_infos(cur, n_tensors, next(reversed(meta), None), alignment)
    except InputError as e:
        if count_problem is None:
            raise
        if getattr(e, "at_end", False):  # the entries read well up to the end of the file: a truncation
            raise ModelFileError(f"{str(e)} ({count_problem})") from None
        raise ModelFileError(f"{path_s}: {count_problem} (the count is wrong, or the file is truncated)") from None
    if count_problem is not None:  # unreachable: the counts need more bytes than the entries could have read
        raise ModelFileError(f"{path_s}: {count_problem}")
    data_offset = -(-cur.pos // alignment) * alignment
    if infos:
        last = infos[-1][0]
        _check_zero(path_s, buf, cur.pos, min(data_offset, cur.size),
                    f"before the data section, after the last tensor entry (tensor {last})",
                    f"is header field tensor_count = {n_tensors} right, and the n_dims or dims of tensor {last}?")
    tensors = _layout(path_s, buf, infos, data_offset, alignment, cur.size)
    for key, value in meta.items():  # arrays stay views until the header is known good
        if isinstance(value, np.ndarray):
            meta[key] = value.tolist()
    meta = Metadata(meta)
    meta.invalid_utf8 = dict(cur.invalid_utf8)
    return GGUFFile(path_s, version, meta, types, alignment, data_offset, tensors, buf)

