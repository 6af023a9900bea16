"""Bounded reads of a GGUF file's header (:mod:`.gguf_check` says what is checked): a cursor over the mapped file whose
every overrun is a named :class:`~.errors.ModelFileError` (:class:`Cursor`), a key or tensor name
(:func:`read_name`), a value of any GGUF type, arrays counted against the bytes left before anything is allocated
(:func:`read_value`), and how an entry and its name's fault are named in a message.
"""

from __future__ import annotations

import struct

import numpy as np

from .errors import ConfigError, ModelFileError


MAX_ARRAY_ITEMS = 1 << 30  # llama.cpp GGUF_MAX_ARRAY_ELEMENTS
MAX_KEY_BYTES = 65535  # GGUF spec: a key is ASCII, at most 2**16 - 1 bytes


#: A length or array size up to this that runs past the end of the file reads as a truncation (a larger one, as
#: a damaged field): used to tell a truncated file from a wrong count in the header.
PLAUSIBLE_BYTES = 1 << 24


# GGUF value types (GGUF spec; gguf-py GGUFValueType).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
VALUE_TYPE_NAMES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
                    "UINT64", "INT64", "FLOAT64")
_NUMPY = {U8: "<u1", I8: "<i1", U16: "<u2", I16: "<i2", U32: "<u4", I32: "<i4", F32: "<f4", BOOL: "?",
          U64: "<u8", I64: "<i8", F64: "<f8"}
_STRUCT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64: "<d"}


class Cursor:
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


def type_name(vtype: int) -> str:
    return VALUE_TYPE_NAMES[vtype] if 0 <= vtype < len(VALUE_TYPE_NAMES) else str(vtype)


def entry(kind: str, i: int, name: str | bytes | None, prev: str) -> str:
    """``key 'gemma4.x' (#5, after key general.name)``, or ``key #5 (after ...)`` when no name bytes are readable.

    A name that is not UTF-8 is shown as its bytes, ``tensor 'out\\xe5ut_norm.weight' (#1, ...)``.
    """
    if not name:
        return f"{kind} #{i} (after {prev})"
    shown = repr(name[:80])[1:] if isinstance(name, bytes) else repr(name[:80])
    return f"{kind} {shown} (#{i}, after {prev})"


def name_fault(name: str, ascii_only: bool) -> str:
    """What is wrong with a key or tensor name: ``length 0``, ``70 bytes``, ``the character '\\x01' at 32``."""
    bad = next((c for c in name if not c.isprintable() or (ascii_only and not c.isascii())), None)
    if bad is not None:
        return f"the character {bad!r} at {name.index(bad)}"
    return f"{len(name.encode())} bytes"


def _peek_name(cur: Cursor, start: int) -> str:
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


def read_name(cur: Cursor, kind: str, i: int, prev: str) -> str:
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
            raise cur.fail(f"{entry(kind, i, seen, prev)}: the file ends inside its name, at byte {cur.size} "
                           f"(name length {n} at byte {start}; truncated?)", at_end=True)
        part = "its n_dims or dims" if prev.startswith("tensor ") else "its value (type, count or length)"
        # A length below 2**48 has two zero high bytes; printable ones mean the reader is inside a name's text,
        # misplaced by the entry before, and what follows is no name of its own.
        text = _printable_suffix(bytes(cur.buf[start:start + 8]))
        if len(text) < 2 and (seen or prev == "the header"):
            raise cur.fail(f"{entry(kind, i, seen, prev)}: name length {n} at byte {start} exceeds the {left} "
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
        raise cur.fail(f"{entry(kind, i, raw, prev)}: name is not valid "
                       f"UTF-8 (at byte {start + 8})") from None


def read_value(cur: Cursor, key: str, vtype: int, check_element=lambda etype: None):
    """One value (Python scalar, str, numpy array or list of str) and its element type.

    ``check_element(etype)`` returns an error to raise for an array of that element type, or None.
    """
    what = f"key {key}"
    if vtype in _STRUCT:
        value = cur.scalar(vtype if vtype != BOOL else U8, f"{what}: {type_name(vtype)} value")
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
        raise cur.fail(f"{what}: array of {count} {type_name(etype)} items needs at least {count * item} bytes, "
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
