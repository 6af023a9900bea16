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
  :func:`reference.config.config_from_gguf` reads): exactly the GGUF type
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
are checked where the config is built, in :func:`reference.config.config_from_gguf`.

Sources: GGUF specification (ggml ``docs/gguf.md``); llama.cpp
``ggml/src/gguf.cpp`` (``GGUF_MAX_ARRAY_ELEMENTS``, ``GGML_MAX_DIMS``, the
data-section layout rule) and ``src/llama-model-loader.cpp`` (exact key types);
gguf-py ``GGML_QUANT_SIZES`` and ``gguf/quants.py`` (block layouts).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from .config import one_edit_apart
from .errors import ConfigError, InputError, ModelFileError
from .files import open_regular

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml GGML_MAX_DIMS
MAX_ARRAY_ITEMS = 1 << 30  # llama.cpp GGUF_MAX_ARRAY_ELEMENTS
MAX_KEY_BYTES = 65535  # GGUF spec: a key is ASCII, at most 2**16 - 1 bytes
MAX_NAME_BYTES = 64  # ggml GGML_MAX_NAME: a tensor name is shorter (llama.cpp refuses longer ones)
#: A length or array size up to this that runs past the end of the file reads as a truncation (a larger one, as
#: a damaged field): used to tell a truncated file from a wrong count in the header.
PLAUSIBLE_BYTES = 1 << 24
MIN_KV_BYTES = 8 + 4 + 1  # name length, value type, smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset

# GGUF value types (GGUF spec; gguf-py GGUFValueType).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
VALUE_TYPE_NAMES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
                    "UINT64", "INT64", "FLOAT64")
_NUMPY = {U8: "<u1", I8: "<i1", U16: "<u2", I16: "<i2", U32: "<u4", I32: "<i4", F32: "<f4", BOOL: "?",
          U64: "<u8", I64: "<i8", F64: "<f8"}
_STRUCT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64: "<d"}

# Types of the keys the harness reads, as llama.cpp reads them (get_key<uint32_t>
# wants UINT32, get_key<float> FLOAT32; per-layer values are UINT32 or an
# INT32/UINT32 array; the sliding-window pattern a BOOL/INT32/UINT32 array).
_UINT = {(U32, None)}
_FLOAT = {(F32, None)}
_STR = {(STRING, None)}
_PER_LAYER = {(U32, None), (ARRAY, U32), (ARRAY, I32)}
_ARCH_KEYS: dict[str, set] = {
    **{k: _UINT for k in (
        "context_length", "embedding_length", "block_count", "attention.key_length", "attention.value_length",
        "attention.key_length_swa", "attention.value_length_swa", "attention.sliding_window",
        "attention.shared_kv_layers", "embedding_length_per_layer_input", "rope.dimension_count",
        "rope.dimension_count_swa", "expert_count")},
    **{k: _PER_LAYER for k in (
        "feed_forward_length", "attention.head_count", "attention.head_count_kv", "expert_used_count",
        "expert_feed_forward_length")},
    **{k: _FLOAT for k in (
        "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa", "rope.scaling.factor",
        "final_logit_softcapping", "attn_logit_softcapping")},
    "rope.scaling.type": _STR,
    "attention.sliding_window_pattern": {(ARRAY, BOOL), (ARRAY, I32), (ARRAY, U32), (U32, None)},
}
_GENERAL_KEYS: dict[str, set] = {
    "general.architecture": _STR,
    "general.alignment": _UINT,
    "tokenizer.ggml.tokens": {(ARRAY, STRING)},
    "tokenizer.ggml.scores": {(ARRAY, F32)},
    "tokenizer.ggml.token_type": {(ARRAY, I32)},
    **{f"tokenizer.ggml.{k}_token_id": _UINT for k in ("bos", "eos", "padding", "unknown")},
}


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


class _Cursor:
    """Bounded little-endian reads from the mapped file; every overrun is a named ModelFileError."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.size, self.pos = buf, path, len(buf), 0
        self.invalid_utf8: dict[str, int] = {}  # array key -> its first string item that is not valid UTF-8

    def fail(self, what: str, at_end: bool = False) -> ModelFileError:
        """The error ``<path>: <what>``; ``at_end``: the read ran into the end of the file (a truncation looks so)."""
        err = ModelFileError(f"{self.path}: {what}")
        err.at_end = at_end
        return err

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> int:
        if n > self.left():
            raise self.fail(f"{what} at byte {self.pos}: needs {n} bytes, the file ends {self.left()} bytes later "
                            "(truncated?)", at_end=True)
        start = self.pos
        self.pos += n
        return start

    def scalar(self, vtype: int, what: str):
        fmt = _STRUCT[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        """A length-prefixed string value (invalid UTF-8 replaced: values are data, not names)."""
        n = self.scalar(U64, f"{what}: length")
        if n > self.left():
            raise self.fail(f"{what}: length {n} at byte {self.pos - 8} exceeds the {self.left()} bytes left",
                            at_end=n <= PLAUSIBLE_BYTES)
        start = self.take(n, what)
        return self.buf[start:start + n].decode("utf-8", errors="replace")


def _vt_name(vtype: int) -> str:
    return VALUE_TYPE_NAMES[vtype] if 0 <= vtype < len(VALUE_TYPE_NAMES) else str(vtype)


def _entry(kind: str, i: int, name: str | bytes | None, prev: str) -> str:
    """``key 'gemma4.x' (#5, after key general.name)``, or ``key #5 (after ...)`` when no name bytes are readable.

    A name that is not UTF-8 is shown as its bytes, ``tensor 'out\\xe5ut_norm.weight' (#1, ...)``.
    """
    if not name:
        return f"{kind} #{i} (after {prev})"
    shown = repr(name[:80])[1:] if isinstance(name, bytes) else repr(name[:80])
    return f"{kind} {shown} (#{i}, after {prev})"


def _name_fault(name: str, ascii_only: bool) -> str:
    """What is wrong with a key or tensor name: ``length 0``, ``70 bytes``, ``the character '\\x01' at 32``."""
    bad = next((c for c in name if not c.isprintable() or (ascii_only and not c.isascii())), None)
    if bad is not None:
        return f"the character {bad!r} at {name.index(bad)}"
    return f"{len(name.encode())} bytes"


def _peek_name(cur: _Cursor, start: int) -> str:
    """The printable ASCII bytes at ``start`` (at most 80): what a name whose length field is damaged reads as."""
    raw = bytes(cur.buf[start:min(start + 80, cur.size)])
    n = next((j for j, b in enumerate(raw) if not 0x20 <= b < 0x7F), len(raw))
    return raw[:n].decode("ascii")


def _printable_suffix(raw: bytes) -> str:
    """The printable ASCII bytes at the end of ``raw``."""
    n = len(raw)
    while n and 0x20 <= raw[n - 1] < 0x7F:
        n -= 1
    return raw[n:].decode("ascii")


def _read_name(cur: _Cursor, kind: str, i: int, prev: str) -> str:
    """The name of key or tensor entry ``i`` (``prev``: ``key X``, ``tensor X`` or ``the header``), its length
    bounded by the bytes left; every error names an entry.

    A length field too long for the file: when printable bytes follow it, the entry is named by them (the
    name as the file spells it) and its length is at fault; when none do, the reader is not at a name at
    all, so the entry before (its value, or its n_dims or dims) is named as the likely fault.
    """
    start = cur.pos
    last = f"{prev} (#{i - 1})" if i else prev  # entry i - 1 is of the same kind
    if cur.left() < 8:
        raise cur.fail(f"the file ends at byte {cur.size}, inside the length of {kind} #{i}; the last complete "
                       f"entry is {last} (truncated?)", at_end=True)
    (n,) = struct.unpack_from("<Q", cur.buf, start)
    left = cur.left() - 8
    if n > left:
        seen = _peek_name(cur, start + 8)
        if n <= MAX_KEY_BYTES and len(seen) == left:
            raise cur.fail(f"{_entry(kind, i, seen, prev)}: the file ends inside its name, at byte {cur.size} "
                           f"(name length {n} at byte {start}; truncated?)", at_end=True)
        part = "its n_dims or dims" if prev.startswith("tensor ") else "its value (type, count or length)"
        # A length below 2**48 has two zero high bytes; printable ones mean the reader is inside a name's text,
        # misplaced by the entry before, and what follows is no name of its own.
        text = _printable_suffix(bytes(cur.buf[start:start + 8]))
        if len(text) < 2 and (seen or prev == "the header"):
            raise cur.fail(f"{_entry(kind, i, seen, prev)}: name length {n} at byte {start} exceeds the {left} "
                           f"bytes left (this length, or {part} in the entry before, is damaged)")
        found = f"text {text + seen!r}" if len(text) >= 2 else f"a {kind} name length of {n}, more than the {left} " \
                                                                 "bytes left, and no name"
        raise cur.fail(f"{last} is followed at byte {start} by {found}: {part}, or the {kind} entry #{i} after it, "
                       "is damaged")
    cur.pos = start + 8 + n
    raw = bytes(cur.buf[start + 8:cur.pos])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise cur.fail(f"{_entry(kind, i, raw, prev)}: name is not valid "
                       f"UTF-8 (at byte {start + 8})") from None


def _read_value(cur: _Cursor, key: str, vtype: int, check_element=lambda etype: None):
    """One value (Python scalar, str, numpy array or list of str) and its element type.

    ``check_element(etype)`` returns an error to raise for an array of that element type, or None.
    """
    what = f"key {key}"
    if vtype in _STRUCT:
        value = cur.scalar(vtype if vtype != BOOL else U8, f"{what}: {_vt_name(vtype)} value")
        if vtype == BOOL:
            if value > 1:
                raise ConfigError(f"{cur.path}: {what}: BOOL value {value}, expected 0 or 1")
            value = bool(value)
        return value, None
    if vtype == STRING:
        return cur.string(f"{what}: string value"), None
    if vtype != ARRAY:
        raise ConfigError(f"{cur.path}: {what}: value type {vtype} is unknown (expected 0-12)")
    etype = cur.scalar(U32, f"{what}: array element type")
    count = cur.scalar(U64, f"{what}: array length")
    if etype == ARRAY:
        raise ConfigError(f"{cur.path}: {what}: arrays of arrays are not allowed (llama.cpp refuses them)")
    if etype not in _STRUCT and etype != STRING:
        raise ConfigError(f"{cur.path}: {what}: array element type {etype} is unknown (expected 0-12, not 9)")
    err = check_element(etype)
    if err:
        raise err
    item = 8 if etype == STRING else struct.calcsize(_STRUCT[etype])  # a string needs at least its length
    if count > MAX_ARRAY_ITEMS or count * item > cur.left():
        raise cur.fail(f"{what}: array of {count} {_vt_name(etype)} items needs at least {count * item} bytes, "
                       f"only {cur.left()} are left", at_end=count * item <= PLAUSIBLE_BYTES)
    if etype != STRING:
        start = cur.take(count * item, what)
        if etype == BOOL:
            raw = np.frombuffer(cur.buf, dtype=np.uint8, count=count, offset=start)
            if count and raw.max() > 1:
                i = int(np.argmax(raw > 1))
                raise ConfigError(f"{cur.path}: {what}: item {i} is BOOL value {raw[i]}, expected 0 or 1")
        return np.frombuffer(cur.buf, dtype=np.dtype(_NUMPY[etype]), count=count, offset=start), etype
    out: list[str] = []
    buf, pos, size, unpack, append = cur.buf, cur.pos, cur.size, struct.unpack_from, out.append
    for i in range(count):  # a 262k vocabulary: kept inline, no per-item method calls
        if pos + 8 > size:
            raise cur.fail(f"{what}: item {i} of {count} at byte {pos}: the file ends (truncated?)", at_end=True)
        (n,) = unpack("<Q", buf, pos)
        if n > size - pos - 8:
            raise cur.fail(f"{what}: item {i} of {count}: string length {n} at byte {pos} exceeds the "
                           f"{size - pos - 8} bytes left", at_end=n <= PLAUSIBLE_BYTES)
        raw = buf[pos + 8:pos + 8 + n]
        try:
            append(raw.decode("utf-8"))
        except UnicodeDecodeError:  # kept (values are data), and noted: a tokenizer table must be text
            append(raw.decode("utf-8", errors="replace"))
            cur.invalid_utf8.setdefault(what.removeprefix("key "), i)
        pos += 8 + n
    cur.pos = pos
    return out, etype


def _read_header(cur: _Cursor) -> tuple[int, int, int, str | None]:
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


def _read_kv(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]]]:
    meta: dict[str, Any] = {}
    types: dict[str, tuple[int, int | None]] = {}
    prev = "the header"
    for i in range(n_kv):  # messages locate a broken entry by the last good key before it
        key = _read_name(cur, "key", i, prev)
        if not key or len(key) > MAX_KEY_BYTES or not key.isascii() or not key.isprintable():
            raise ConfigError(f"{cur.path}: {_entry('key', i, key, prev)}: name has {_name_fault(key, True)}, "
                              f"expected 1 to {MAX_KEY_BYTES} printable ASCII characters")
        if key in meta:
            raise ConfigError(f"{cur.path}: key {key} appears twice")
        vtype = cur.scalar(U32, f"key {key}: value type")
        arch = meta.get("general.architecture")  # known types are checked before the value is read: a wrong
        err = _key_type_error(cur.path, key, (vtype, None), arch)  # type would misread the entries that follow
        if err:
            raise err
        meta[key], etype = _read_value(cur, key, vtype, lambda et: _key_type_error(cur.path, key, (ARRAY, et), arch))
        types[key] = (vtype, etype)
        prev = f"key {key}"
    return meta, types


def _key_type_error(path: str, key: str, got: tuple[int, int | None], arch: Any) -> ConfigError | None:
    """The error for a known key of the wrong GGUF type (unknown keys: :func:`_near_miss_error`, once every key is
    read)."""
    prefix = f"{arch}." if isinstance(arch, str) else None
    allowed = _GENERAL_KEYS.get(key)
    if allowed is None and prefix and key.startswith(prefix):
        allowed = _ARCH_KEYS.get(key[len(prefix):])
    if allowed is None or got in allowed or (got[0] == ARRAY and got[1] is None
                                             and any(t[0] == ARRAY for t in allowed)):
        return None

    def show(t):
        return _vt_name(t[0]) if t[1] is None else f"ARRAY of {_vt_name(t[1])}"
    want = " or ".join(sorted(show(t) for t in allowed))
    return ConfigError(f"{path}: key {key} has GGUF type {show(got)}, expected {want} "
                       "(llama.cpp reads it as that type and refuses any other)")


def _check_key_types(path: str, types: dict[str, tuple[int, int | None]], meta: dict[str, Any]) -> None:
    """Keys read before ``general.architecture`` was known are checked here, after the whole section; then the
    unknown keys (:func:`_near_miss_error`)."""
    arch = meta.get("general.architecture")
    for key, got in types.items():
        err = _key_type_error(path, key, got, arch) or _near_miss_error(path, key, meta, arch)
        if err:
            raise err


def _near_miss_error(path: str, key: str, meta: dict[str, Any], arch: Any) -> ConfigError | None:
    """An unknown key one character from an ``<arch>.*`` key the model reads that the file does not hold: a
    misspelt or damaged name, which would read as absent (another model, silently). Any other unknown key is
    allowed: ``gemma3.context_length`` beside ``gemma4.context_length`` in a gemma4 file is not a misspelling."""
    prefix = f"{arch}." if isinstance(arch, str) else None
    if prefix is None or key in _GENERAL_KEYS or (key.startswith(prefix) and key[len(prefix):] in _ARCH_KEYS):
        return None
    near = [prefix + k for k in _ARCH_KEYS if one_edit_apart(key, prefix + k) and prefix + k not in meta]
    if not near:
        return None
    return ConfigError(f"{path}: key {key} is unknown, one character from {near[0]}, which the file does not hold "
                       "(a misspelt or damaged name; the model would read that key as absent)")


def _read_tensor_infos(cur: _Cursor, n_tensors: int, last_key: str | None, alignment: int
                       ) -> list[tuple[str, tuple[int, ...], int, int]]:
    infos = []
    names: set[str] = set()
    prev = f"key {last_key}" if last_key else "the header"
    for i in range(n_tensors):
        name = _read_name(cur, "tensor", i, prev)
        where = f"tensor {name} (#{i}, after {prev})"
        if not 0 < len(name.encode()) < MAX_NAME_BYTES or not name.isprintable():
            raise ModelFileError(f"{cur.path}: {_entry('tensor', i, name, prev)}: name has {_name_fault(name, False)}, "
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
    cur = _Cursor(buf, path_s)
    version, n_tensors, n_kv, count_problem = _read_header(cur)
    try:  # every read is bounded by the bytes left, so reading on past a count too large for the file is safe
        meta, types = _read_kv(cur, n_kv)
        _check_key_types(path_s, types, meta)
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

