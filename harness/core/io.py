"""Run directories and atomic writes for reports.

Every run writes ``reports/<UTC timestamp>-<name>/`` under the current folder (or ``--out``) (``report.md``,
``results.json``, plots). A run directory is created with ``os.mkdir`` and never
reused: a second run with the same name in the same second gets ``-2``, ``-3``...
Every output goes through one writer, :func:`open_output`: a regular file is written
atomically (a temporary file in the same directory, fsync, ``os.replace``), so a reader
never sees half a report and an interrupted run never leaves a truncated one; a symlink
is followed (its target replaced, the link kept); a character device or a FIFO is
written through, never replaced (``--out /dev/null`` stays a device); a folder, a block
device or a socket is refused with one line (:class:`OutputError`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import errno
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import kind_of

from .paths import default_reports_dir
from .text import for_json
from .workers import remove_temp_dir, temp_dir

TIMESTAMP_FORMAT = "%Y%m%d-%H%M%S"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def run_timestamp(now: datetime | None = None) -> str:
    """The UTC timestamp that prefixes a run directory, ``YYYYmmdd-HHMMSS``.

    Args:
        now: the moment to format (naive values are taken as UTC); default: now.

    Returns:
        a 15-character string such as ``20250101-120000``.
    """
    if now is None:
        now = datetime.now(timezone.utc)
    elif now.tzinfo is not None:
        now = now.astimezone(timezone.utc)
    return now.strftime(TIMESTAMP_FORMAT)


class StagedRunDir:
    """A run directory being written: files go into :attr:`path` (a hidden temporary sibling); when the
    ``with`` block of :func:`staged_run_dir` ends normally it is renamed to :attr:`final` in one step."""

    def __init__(self, path: Path):
        self.path = path
        self.final: Path | None = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(base: Path) -> None:
    """Remove the temporary run directories of runs whose process is gone (killed mid-run)."""
    for p in base.glob(".tmp-*"):
        m = re.match(r"^\.tmp-.*-pid(\d+)-", p.name)
        if m and p.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def staged_run_dir(name: str, out: str | os.PathLike | None = None) -> Iterator[StagedRunDir]:
    """A run directory that appears whole or not at all.

    Inside the ``with`` block, write into ``staged.path`` (``<base>/.tmp-<ts>-<name>-pid<pid>-<random>/``);
    on normal exit it is renamed to ``<base>/<UTC timestamp>-<name>[-N]/`` (``staged.final``), a name that
    did not exist before. On an exception the temporary directory is removed; when the process is killed
    (SIGKILL included), the watchdog of :func:`harness.core.workers.temp_dir` removes it, and should that
    fail too, the next run in the same base does.

    Args:
        name: short run name such as ``parity``; letters, digits, ``.``, ``_`` and ``-`` only, starting
            with a letter or digit.
        out: the base folder; default ``reports/`` under the current folder
            (:func:`harness.core.paths.default_reports_dir`).

    Raises:
        ValueError: ``name`` is empty or holds other characters (such as ``/``).
        NotADirectoryError: ``out`` exists and is not a directory.
        OSError: the directory cannot be created or renamed (permissions, disk).
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"run name {name!r}: expected letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    base = (Path(out) if out is not None else default_reports_dir()).expanduser().resolve()
    if base.exists() and not base.is_dir():
        raise NotADirectoryError(f"{base}: output location exists and is not a directory")
    base.mkdir(parents=True, exist_ok=True)
    _clean_stale(base)
    stem = f"{run_timestamp()}-{name}"
    staged = StagedRunDir(temp_dir(f".tmp-{stem}-pid{os.getpid()}-", base))
    try:
        yield staged
        n, candidate = 1, base / stem
        while True:
            if not candidate.exists():
                try:
                    _rename_no_replace(staged.path, candidate)
                    break
                except OSError:  # another process took the name between the check and the rename
                    if not candidate.exists():
                        raise
            n += 1
            candidate = base / f"{stem}-{n}"
        _fsync_dir(base)
        staged.final = candidate
    finally:
        remove_temp_dir(staged.path, keep=staged.final is not None)


_AT_FDCWD, _RENAME_NOREPLACE = -100, 1  # <fcntl.h>, <linux/fs.h>
_FALLBACK_RENAME_LOCK = threading.Lock()


def _renameat2() -> Any:
    """libc's ``renameat2`` (Linux, glibc >= 2.28), or None."""
    return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform.startswith("linux") else None


def _rename_no_replace(src: Path, dst: Path) -> None:
    """Rename a directory to a name that must not exist (``renameat2(RENAME_NOREPLACE)`` on Linux).

    A plain ``rename`` onto an existing *empty* directory replaces it, so two runs that checked the same
    free name at once could both "succeed" (two threads of one process got the same run directory in about
    one try in five). Where ``renameat2`` or its flag is missing: a check and a plain rename, under one lock
    (threads of this process never share a name; other processes on such a system still could).

    Raises:
        FileExistsError: ``dst`` exists.
        OSError: any other failure.
    """
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL):  # not: an old kernel or a file system without the flag
            raise OSError(err, os.strerror(err), str(dst))
    with _FALLBACK_RENAME_LOCK:
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        os.rename(src, dst)


def _fsync_dir(path: Path) -> None:
    """Best-effort fsync of a directory so a rename survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class OutputError(InputError, OSError):
    """An output that cannot be written where the user asked: one line naming the path and why. An
    :class:`InputError` (exit 2 in the CLI) and an :class:`OSError` (callers that treat a failed write as an OS
    error keep doing so)."""


def output_kind(path: str | os.PathLike) -> str:
    """How :func:`open_output` writes to ``path``: ``new`` (nothing there), ``file`` (a regular file, or a symlink
    to one: replaced atomically, the symlink kept), ``stream`` (a character device or a FIFO: written through).

    Raises:
        OutputError: a folder, a block device, a socket, or anything else (refused: never replaced).
    """
    p = os.fspath(path)
    try:
        st = os.stat(p)  # follows a symlink: what is written is what it points to
    except FileNotFoundError:
        return "new"  # also a dangling symlink: its target is created
    except NotADirectoryError:  # a folder on the way is a file: name it
        blocker = next((a for a in Path(p).parents if a.exists() and not a.is_dir()), None)
        raise OutputError(f"{p}: {blocker} is a file, not a folder" if blocker is not None else
                          f"{p}: cannot write output (a folder on its path is not a folder)") from None
    except OSError as e:
        raise OutputError(f"{p}: cannot write output ({e.strerror or e})") from None
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return "stream"
    kind = kind_of(st.st_mode)
    raise OutputError(f"{p}: is a {kind}; an output goes to a regular file (replaced atomically), a character device "
                      "or a FIFO (written through)" if kind != "folder" else f"{p}: is a folder, expected a file path")


class _Through:
    """A device or FIFO being written through: ``write`` and ``flush`` only. Not a file object to numpy, which
    then streams an array through ``write`` in chunks instead of ``ndarray.tofile`` (which writes beside Python's
    buffer and loses the order on a pipe)."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _target(path: Path) -> Path:
    """The file a write to ``path`` lands in: ``path``, or what its symlinks resolve to (the links are kept)."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


@contextlib.contextmanager
def open_output(path: str | os.PathLike, mode: int = 0o666) -> Iterator[Any]:
    """The one writer of the harness's outputs: a binary file to write into, placed according to what ``path`` is.

    * nothing there, or a regular file: a temporary file in the same folder, fsynced and renamed over the
      destination when the ``with`` block ends normally (a reader sees the old file or the whole new one; on an
      exception the destination is untouched). A symlink is followed and its *target* replaced: the link stays.
      The new file gets ``mode`` less the umask.
    * a character device (``/dev/null``, ``/dev/full``, a terminal) or a FIFO: written through, never replaced. A
      FIFO with no reader is refused at once rather than waited on.
    * a folder, a block device, a socket: refused.

    Raises:
        OutputError: refused (above), the folder missing or not writable, or a write failing (``/dev/full``:
            "No space left on device"); the line names the path.
    """
    path = Path(path)
    kind = output_kind(path)
    if kind == "stream":
        flags = os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise OutputError(f"{path}: a FIFO with no reader (start the reader first, or give a file)") from None
            raise OutputError(f"{path}: cannot write output ({e.strerror or e})") from None
        os.set_blocking(fd, True)
        try:
            with os.fdopen(fd, "wb") as f:
                yield _Through(f)
        except OSError as e:
            raise OutputError(f"{path}: cannot write output ({e.strerror or e})") from None
        return
    dest = _target(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, mode & ~umask)
        os.replace(tmp, dest)
        tmp = None
    except OSError as e:
        if isinstance(e, OutputError):
            raise
        raise OutputError(f"{path}: cannot write output ({e.strerror or e})") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _fsync_dir(dest.parent)


def check_output(path: str | os.PathLike, what: str = "--out") -> None:
    """Refuse an output file that :func:`open_output` could not write, before any work starts.

    Raises:
        OutputError: ``path`` is a folder, a block device or a socket; its folder is a file, or cannot be
            created or written (a FIFO's reader and a device's space are only known when written).
    """
    p = Path(path)
    try:
        kind = output_kind(p)
    except OutputError as e:
        raise OutputError(f"{what} {e}") from None
    if kind == "stream":
        return
    parent = _target(p).parent if kind == "file" or os.path.islink(p) else (p.parent if str(p.parent) else Path("."))
    existing = next((a for a in [parent, *parent.parents] if a.exists()), None)
    if existing is not None and not existing.is_dir():
        raise OutputError(f"{what} {path}: {existing} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK):
        raise OutputError(f"{what} {path}: {existing} is not writable")


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through :func:`open_output` (a regular file atomically; a device or FIFO
    written through; anything else refused).

    Args:
        path: destination file; its folder must exist.
        data: the bytes.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        OutputError: see :func:`open_output` (an :class:`OSError`; ``path`` is untouched).
    """
    with open_output(path) as f:
        f.write(data)
    return Path(path)


def save_npy_atomic(path: str | os.PathLike, arr: np.ndarray) -> Path:
    """Write ``arr`` to ``path`` as ``.npy`` through :func:`open_output` (streamed: no second copy in memory).
    The folder is created if missing.

    Raises:
        OutputError: the destination cannot be written (named, with the reason).
    """
    dest = Path(path)
    if output_kind(dest) != "stream":
        try:
            _target(dest).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{path}: cannot write output ({e.strerror or e})") from None
    with open_output(dest) as f:
        np.save(f, arr)
    return dest


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; see :func:`write_bytes_atomic`.

    Args:
        path: destination file; its folder must exist.
        text: the content.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        TypeError: ``text`` is not a ``str``.
        OutputError: as :func:`write_bytes_atomic`.
    """
    if not isinstance(text, str):
        raise TypeError(f"write_text_atomic: expected str, got {type(text).__name__}")
    return write_bytes_atomic(path, text.encode("utf-8"))


def _float(x: float) -> float | str:
    """A finite float as is; NaN / +-Inf as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def to_jsonable(obj: Any, _where: str = "$") -> Any:
    """Convert ``obj`` into plain JSON types (dict with str keys, list, str, int, float, bool, None).

    Conversions: numpy scalars -> Python scalars; numpy arrays -> nested lists
    (any shape); tuples and sets -> lists (sets sorted when possible);
    ``Path`` -> str; dataclass instances -> dicts; enums -> their value; dict
    keys -> str (numpy / int / float keys via ``str``). Non-finite floats (a
    NaN metric is a result worth keeping) become the strings ``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``, so the output is strict JSON.

    Args:
        obj: the value.

    Returns:
        a structure that ``json.dumps(..., allow_nan=False)`` accepts.

    Raises:
        TypeError: a value of another type; the message gives its JSON path
            (such as ``$.cases[3].logits``) and type.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _float(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biufc" and obj.dtype != object:
            if obj.dtype.kind == "U":
                return obj.tolist()
            raise TypeError(f"{_where}: numpy array of dtype {obj.dtype} is not JSON-serialisable")
        return [to_jsonable(v, f"{_where}[{i}]") for i, v in enumerate(obj.tolist())] if obj.ndim else \
            to_jsonable(obj.item(), _where)
    if isinstance(obj, np.generic):
        if isinstance(obj, np.complexfloating):
            raise TypeError(f"{_where}: complex value {obj!r} is not JSON-serialisable")
        return to_jsonable(obj.item(), _where)
    if isinstance(obj, complex):
        raise TypeError(f"{_where}: complex value {obj!r} is not JSON-serialisable")
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value, _where)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if isinstance(k, np.generic):
                k = k.item()
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"{_where}: dict key {k!r} of type {type(k).__name__} is not JSON-serialisable")
            key = k if isinstance(k, str) else json.dumps(k) if not isinstance(k, float) else str(_float(k))
            out[key] = to_jsonable(v, f"{_where}.{key}")
        return out
    if isinstance(obj, (set, frozenset)):
        items = list(obj)
        try:
            items = sorted(items)
        except TypeError:
            pass
        return [to_jsonable(v, f"{_where}[{i}]") for i, v in enumerate(items)]
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, f"{_where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"{_where}: value of type {type(obj).__name__} is not JSON-serialisable")


def dumps_json(obj: Any) -> str:
    """Serialise ``obj`` as the harness writes JSON: :func:`to_jsonable`, strings with a lone surrogate made visible
    (:func:`harness.core.text.for_json`: an engine's text must not stop the results from being written),
    ``sort_keys``, indent 2, final newline.

    Raises:
        TypeError: see :func:`to_jsonable`.
    """
    return json.dumps(for_json(to_jsonable(obj)), sort_keys=True, indent=2, allow_nan=False, ensure_ascii=False) + "\n"


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (sorted keys, indent 2, numpy values converted).

    See :func:`to_jsonable` for the conversions (NaN / Inf become strings) and
    :func:`write_bytes_atomic` for the atomicity.

    Args:
        path: destination file; its folder must exist.
        obj: the value.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        TypeError: a value that cannot be converted (nothing is written).
        OSError: as :func:`write_bytes_atomic`.
    """
    return write_text_atomic(path, dumps_json(obj))


def _cell(value: Any) -> str:
    """Format one table cell: floats with 6 significant digits, None as empty, ``|`` escaped, one line."""
    if value is None:
        s = ""
    elif isinstance(value, (bool, np.bool_)):
        s = str(bool(value))
    elif isinstance(value, (float, np.floating)):
        s = f"{float(value):.6g}"
    elif isinstance(value, np.generic):
        s = str(value.item())
    else:
        s = str(value)
    return s.replace("\r\n", " ").replace("\n", " ").replace("|", "\\|")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` restricted to ``columns``, in that order.

    A column whose non-empty values are all numbers is right-aligned. A key
    missing from a row gives an empty cell; keys not in ``columns`` are
    ignored. Floats are shown with 6 significant digits; ``|`` and newlines in
    values are escaped so the table stays one row per line.

    Args:
        rows: one dict per table row (may be empty: header only).
        columns: header names, at least one.

    Returns:
        the table, lines joined with ``\\n``, ending with a newline.

    Raises:
        ValueError: ``columns`` is empty.
        TypeError: a row is not a mapping.
    """
    if not columns:
        raise ValueError("markdown_table: expected at least one column")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"markdown_table: row {i} is {type(row).__name__}, expected a dict")
    header = [_cell(c) for c in columns]
    body = [[_cell(row.get(c)) for c in columns] for row in rows]
    numeric = []
    for c in columns:
        vals = [row.get(c) for row in rows if row.get(c) is not None]
        numeric.append(bool(vals) and all(_is_number(v) for v in vals))
    widths = [max([3, len(header[j])] + [len(r[j]) for r in body]) for j in range(len(columns))]

    def line(cells: list[str]) -> str:
        padded = [cells[j].rjust(widths[j]) if numeric[j] else cells[j].ljust(widths[j]) for j in range(len(cells))]
        return "| " + " | ".join(padded) + " |"

    sep = "| " + " | ".join(("-" * (widths[j] - 1) + ":") if numeric[j] else "-" * widths[j]
                             for j in range(len(columns))) + " |"
    return "\n".join([line(header), sep] + [line(r) for r in body]) + "\n"


def dataframe_markdown(df: Any, right: Sequence[str] = ()) -> str:
    """A pandas DataFrame as a GitHub-flavoured Markdown table (``DataFrame.to_markdown``, via tabulate).

    Cells are formatted as in :func:`markdown_table` (floats with 6 significant digits, ``None`` as an
    empty cell, ``|`` and newlines escaped; in a text column a NaN, which is how pandas stores a
    missing value, is empty too, while in a float column it shows as ``nan``) and then passed to
    tabulate as text, so tabulate never re-parses or re-rounds a figure. The index is not shown.
    Numeric columns, and those named in ``right``, are right-aligned. Without tabulate installed (it
    is a dependency, but an old environment may lack it) the rows go through :func:`markdown_table`.

    Args:
        df: the table; its column names are the header.
        right: more columns to right-align (e.g. figures pre-formatted as strings).

    Returns:
        the table, lines joined with ``\\n``, ending with a newline.

    Raises:
        ValueError: ``df`` has no columns.
    """
    columns = [str(c) for c in df.columns]
    if not columns:
        raise ValueError("dataframe_markdown: expected at least one column")
    try:
        import tabulate  # noqa: F401  (DataFrame.to_markdown needs it)
    except ImportError:
        return markdown_table(df.to_dict("records"), list(df.columns))

    def fmt(col: Any) -> Any:
        # pandas stores a missing value (None) of a text column as NaN: shown empty; in a float column NaN is a value
        if col.dtype.kind == "O":
            return col.map(lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else _cell(v))
        return col.astype(object).map(_cell)

    cells = df.apply(fmt) if len(df) else df.astype(object)
    cells.columns = columns
    numeric = [df[c].dtype.kind in "iuf" and len(df) > 0 for c in df.columns]
    align = ["right" if num or c in right else "left" for c, num in zip(columns, numeric)]
    text = cells.to_markdown(index=False, tablefmt="pipe", disable_numparse=True, colalign=align)
    return text.rstrip("\n") + "\n"
