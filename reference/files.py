"""The one reader of the user's input files: what a path is, how much of it is read, and for how long.

Every file the harness takes from a user goes through here, so that each has the same three guards:

* **kind**: a model file (GGUF, safetensors, an image, a WAV) must be a *regular* file: it is memory-mapped
  or read whole, and a FIFO, a device or a socket cannot be (opening a FIFO with no writer would block
  forever; ``/dev/zero`` never ends). Small text inputs (a prompt, a prompt set, a text file, a JSON
  config) may also come from a pipe or a character device (``--prompt-ids /dev/stdin``, process
  substitution ``<(...)``): those are read with a size bound and a time bound (:data:`STREAM_TIMEOUT_S`).
  A folder, a block device and a socket are refused everywhere. Files are opened with ``O_NONBLOCK``, so
  not even the ``open`` of a FIFO can block, and the kind is taken from the opened descriptor (``fstat``),
  not from an earlier ``stat`` of the name.
* **size**: a file larger than the caller's bound is refused before a byte is read; a stream is refused as
  soon as it passes the bound.
* **encoding**: text is UTF-8; an invalid byte is named with its offset.

Each refusal is an :class:`reference.errors.InputError` (or the caller's subclass) with one line naming the
file and what was expected.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import select
import stat
import time
from typing import IO, Any

from .errors import InputError

MAX_TEXT_BYTES = 256 << 20
"""Default bound of a text input (256 MiB): a prompt set, a corpus or a trace larger than this is not one."""

MAX_CONFIG_BYTES = 64 << 20
"""Bound of a JSON config (``config.json``, ``processor_config.json``, a baseline): 64 MiB."""

STREAM_TIMEOUT_S = 60.0
"""Seconds a pipe or character device may take to deliver its whole input (environment ``G4H_INPUT_TIMEOUT_S``
overrides it): a FIFO nobody writes to, or a terminal nobody types into, ends with one line instead of a hang."""

_CHUNK = 1 << 20


def stream_timeout() -> float:
    """:data:`STREAM_TIMEOUT_S`, or ``G4H_INPUT_TIMEOUT_S`` when set to a positive number."""
    try:
        t = float(os.environ.get("G4H_INPUT_TIMEOUT_S", ""))
    except ValueError:
        return STREAM_TIMEOUT_S
    return t if 0 < t < float("inf") else STREAM_TIMEOUT_S


def kind_of(mode: int) -> str:
    """What an ``st_mode`` is, in words: ``regular file``, ``folder``, ``FIFO``, ``character device`` ..."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"


def is_stream(mode: int) -> bool:
    """A FIFO (pipe) or a character device: read to its end, with a bound, never mapped."""
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def _open(path: str | os.PathLike, what: str, error: type[InputError]) -> tuple[int, os.stat_result]:
    """``os.open`` without blocking and without following into anything but what the name points to; the fd
    and its ``fstat``."""
    label = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{label}: no such file") from None
    except IsADirectoryError:
        raise error(f"{label}: is a folder, expected a file") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket, or a device with no driver
            raise error(f"{label}: cannot be opened for reading (a socket or a device without a driver); "
                        "expected a regular file") from None
        raise error(f"{label}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise error(f"{label}: cannot read: {e.strerror or e}") from None
    return fd, st


def open_regular(path: str | os.PathLike, what: str = "", error: type[InputError] = InputError,
                 max_bytes: int | None = None) -> IO[bytes]:
    """Open a file that must be a regular file (it is mapped or read at offsets), for reading in binary.

    Args:
        path: the file.
        what: how the message names it (``--mmproj``, ``config.json`` ...); empty: the path alone.
        error: the exception class of a refusal (``ModelFileError`` for a model file).
        max_bytes: refuse a larger file (None: no bound).

    Returns:
        the open file (blocking mode), positioned at 0; the caller closes it.

    Raises:
        error: missing, a folder, a FIFO, a device or a socket; larger than ``max_bytes``; unreadable.
    """
    fd, st = _open(path, what, error)
    label = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{label}: is a {kind_of(st.st_mode)}, expected a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        os.close(fd)
        raise error(f"{label}: {_fmt_bytes(st.st_size)}, more than the {_fmt_bytes(max_bytes)} this input may hold")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_regular(path: str | os.PathLike, what: str = "", error: type[InputError] = InputError) -> int:
    """Refuse anything but a readable regular file at ``path`` (for a library that opens the file by its name:
    safetensors, PIL); returns its size in bytes.

    Raises:
        error: as :func:`open_regular`.
    """
    with open_regular(path, what, error) as f:
        return os.fstat(f.fileno()).st_size


def read_bytes(path: str | os.PathLike, what: str = "", *, max_bytes: int = MAX_TEXT_BYTES, streams: bool = True,
               timeout: float | None = None, error: type[InputError] = InputError) -> bytes:
    """The whole content of an input file, bounded.

    Args:
        path: the file.
        what: how the message names it (``--prompt-ids``); empty: the path alone.
        max_bytes: the most it may hold.
        streams: also take a FIFO or a character device (read to its end within ``timeout``); else only a
            regular file.
        timeout: seconds a stream may take to end (default :func:`stream_timeout`).
        error: the exception class of a refusal.

    Raises:
        error: see :func:`open_regular`; a stream longer than ``max_bytes`` or not ended within ``timeout``.
    """
    fd, st = _open(path, what, error)
    label = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    try:
        if stat.S_ISREG(st.st_mode):
            if st.st_size > max_bytes:
                raise error(f"{label}: {_fmt_bytes(st.st_size)}, more than the {_fmt_bytes(max_bytes)} this input "
                            "may hold")
            os.set_blocking(fd, True)
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(max_bytes + 1)
            if len(data) > max_bytes:  # grew while read
                raise error(f"{label}: more than the {_fmt_bytes(max_bytes)} this input may hold")
            return data
        if not (streams and is_stream(st.st_mode)):
            raise error(f"{label}: is a {kind_of(st.st_mode)}, expected a regular file")
        return _read_stream(fd, label, max_bytes, stream_timeout() if timeout is None else timeout, error)
    finally:
        os.close(fd)


def _read_stream(fd: int, label: str, max_bytes: int, timeout: float, error: type[InputError]) -> bytes:
    """Read a pipe or character device (non-blocking ``fd``) to its end, within ``max_bytes`` and ``timeout``."""
    deadline = time.monotonic() + timeout
    parts: list[bytes] = []
    n = 0
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            if time.monotonic() >= deadline:
                got = f"after {_fmt_bytes(n)}" if n else "nothing received"
                raise error(f"{label}: the input did not end within {timeout:g} s ({got}; a FIFO with no "
                            "writer, or a terminal?); give a regular file, or set G4H_INPUT_TIMEOUT_S")
            continue
        try:
            chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - n))
        except BlockingIOError:
            continue
        except OSError as e:
            raise error(f"{label}: cannot read: {e.strerror or e}") from None
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        n += len(chunk)
        if n > max_bytes:
            raise error(f"{label}: more than the {_fmt_bytes(max_bytes)} this input may hold (a stream without "
                        "end, such as /dev/zero?)")


def decode_utf8(data: bytes, label: str, error: type[InputError] = InputError) -> str:
    """``data`` as UTF-8 text (a leading BOM dropped), or one line naming the first invalid byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # its offset counts from after the BOM the codec dropped: the file's, here
        at = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        raise error(f"{label}: not UTF-8 text (invalid byte 0x{data[at]:02x} at offset {at})") from None


def read_text(path: str | os.PathLike, what: str = "", *, max_bytes: int = MAX_TEXT_BYTES, streams: bool = True,
              error: type[InputError] = InputError) -> str:
    """An input file as UTF-8 text (:func:`read_bytes`, then :func:`decode_utf8`).

    Raises:
        error: see :func:`read_bytes`; not UTF-8 (the offset of the first invalid byte named).
    """
    label = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    return decode_utf8(read_bytes(path, what, max_bytes=max_bytes, streams=streams, error=error), label, error)


def read_json(path: str | os.PathLike, what: str = "", *, max_bytes: int = MAX_CONFIG_BYTES, streams: bool = True,
              allow_nan: bool = True, error: type[InputError] = InputError) -> Any:
    """An input file as JSON (:func:`read_text`, then ``json.loads``).

    ``allow_nan``: take Python's ``NaN`` / ``Infinity`` literals (a config's checker then names the key that holds
    one); False refuses them here.

    Raises:
        error: see :func:`read_text`; not JSON (line and column named); a NaN or Infinity literal when not allowed.
    """
    label = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    text = read_text(path, what, max_bytes=max_bytes, streams=streams, error=error)

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(text, **({} if allow_nan else {"parse_constant": constant}))
    except json.JSONDecodeError as e:
        raise error(f"{label}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise error(f"{label}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{label}: not valid JSON (nested too deeply)") from None
