"""The steps of a llama.cpp build (:mod:`.build`, :mod:`.native`), each failing with one :class:`~.pins.BuildError`
line: the tools checked, the sdist fetched (SHA-256 checked) and extracted, a command run into the build log, the
libraries collected, the Python package's wheel built and the libraries added to it, ``llama-server`` tried, and a
finished folder put in place under a lock, once (:func:`built_once`).
"""

from __future__ import annotations

import base64
import csv
import fcntl
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

from .pins import (
    LLAMA_CPP_PYTHON_VERSION,
    PY_LIBS,
    SDIST_NAME,
    SDIST_SHA256,
    WHEEL_CMAKE_ARGS,
    BuildError,
    cache_dir,
    lib_name,
    platform_facts,
)


def built_once(root: Path, cache: Path, find: Callable[[], Any], build: Callable[[], Any]) -> Any:
    """``find()`` when it finds a build; else, under ``root``'s lock, ``find()`` again (another process may have
    built it while this one waited), then the leftovers of builds that died removed and ``build()``.

    Raises:
        BuildError: another platform than Linux or macOS; whatever ``build`` raises.
    """
    found = find()
    if found is not None:
        return found
    if sys.platform not in ("linux", "darwin"):
        raise BuildError(f"building llama.cpp is supported on Linux and macOS only, not {sys.platform}")
    cache.mkdir(parents=True, exist_ok=True)
    with BuildLock(root.with_name(root.name + ".lock")):
        found = find()
        if found is not None:
            return found
        for stale in [*cache.glob(f".tmp-{root.name}-*"), *cache.glob(f".old-{root.name}-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a build that died (we hold the lock)
        return build()


def check_tools() -> dict[str, str]:
    """cmake (>= 3.14), a C and a C++ compiler, and pip: their versions, or :class:`BuildError` naming the missing one."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cannot build llama.cpp: cmake not found on PATH (install cmake >= 3.14, "
                         "e.g. apt-get install cmake or pip install cmake)")
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m or (int(m.group(1)), int(m.group(2))) < (3, 14):
        raise BuildError(f"cannot build llama.cpp: {cmake} is {out.splitlines()[0] if out else '?'}; need >= 3.14")
    found = {"cmake": out.splitlines()[0]}
    for lang, env, names in (("C", "CC", ("cc", "gcc", "clang")), ("C++", "CXX", ("c++", "g++", "clang++"))):
        cands = [os.environ[env].split()[0]] if os.environ.get(env) else list(names)
        exe = next((shutil.which(c) for c in cands if shutil.which(c)), None)
        if exe is None:
            raise BuildError(f"cannot build llama.cpp: no {lang} compiler found (looked for "
                             f"{', '.join(cands)}; install one, e.g. apt-get install g++, or set {env})")
        ver = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.splitlines()
        found[lang] = f"{exe}: {ver[0] if ver else '?'}"
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        raise BuildError(f"cannot build the llama-cpp-python wheel: {sys.executable} has no pip")
    return found


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(cache: Path | None = None, local: Path | None = None,
                say: Callable[[str], None] | None = None) -> Path:
    """The llama-cpp-python sdist in ``<cache>/sdist/``: copied from ``local``, or downloaded from PyPI once.

    Raises:
        BuildError: pip could not download it, or its SHA-256 is not :data:`SDIST_SHA256`.
    """
    dst = (cache or cache_dir()) / "sdist" / SDIST_NAME
    if dst.is_file() and _sha256(dst) == SDIST_SHA256:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        if local is not None:
            got = Path(local)
        else:
            (say or (lambda m: None))(f"downloading {SDIST_NAME} from PyPI")
            cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                   "--no-deps", "--no-binary", ":all:", "-d", tmp]
            p = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / SDIST_NAME
            if p.returncode != 0 or not got.is_file():
                last = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
                raise BuildError(f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} failed: "
                                 f"{last[-1].strip() if last else f'exit status {p.returncode}'}")
        digest = _sha256(got)
        if digest != SDIST_SHA256:
            raise BuildError(f"{got}: SHA-256 {digest} is not the one PyPI publishes for {SDIST_NAME} "
                             f"({SDIST_SHA256})")
        part = dst.with_name(dst.name + ".part")
        shutil.copyfile(got, part)
        os.replace(part, dst)
    return dst


def extract_sdist(tarball: Path, dst: Path) -> Path:
    """Unpack the sdist into ``dst``; returns its top folder (``llama_cpp_python-<version>``)."""
    dst.mkdir(parents=True)
    with tarfile.open(tarball) as tf:
        if sys.version_info >= (3, 12):
            tf.extractall(dst, filter="data")
        else:
            for m in tf.getmembers():
                if m.name.startswith(("/", "..")) or ".." in Path(m.name).parts:
                    raise BuildError(f"{tarball}: unsafe member path {m.name!r}")
            tf.extractall(dst)
    top = dst / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        raise BuildError(f"{tarball}: no vendor/llama.cpp/CMakeLists.txt inside (not the llama-cpp-python sdist?)")
    return top


def run_step(cmd: list[str], logf, step: str, log_path: Path, env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` with its output appended to the build log; :class:`BuildError` naming the step on failure."""
    logf.write(f"\n$ {' '.join(cmd)}\n")
    logf.flush()
    p = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    if p.returncode != 0:
        logf.flush()
        raise BuildError(f"llama.cpp {step} failed (exit status {p.returncode}): {_last_error(log_path)} "
                         f"(full log: {log_path})")


def _last_error(log_path: Path) -> str:
    """The most telling line of a failed step's log: the first ``error`` / ``CMake Error`` line, else the last line."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in lines:
        if "CMake Error" in ln or re.search(r"\berror\b", ln, re.IGNORECASE):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def collect_libs(bin_dir: Path, stage: Path) -> list[str]:
    """Copy ``llama-server`` to ``stage/bin`` and every shared library to ``stage/lib``; returns the library names."""
    server = bin_dir / "llama-server"
    if not server.is_file():
        raise BuildError(f"{bin_dir}: the build produced no llama-server")
    (stage / "bin").mkdir(parents=True)
    (stage / "lib").mkdir()
    shutil.copy2(server, stage / "bin" / "llama-server")
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    libs = sorted(p.name for p in bin_dir.iterdir() if p.name.startswith("lib") and p.name.endswith(suffix))
    for name in libs:
        shutil.copy2(bin_dir / name, stage / "lib" / name, follow_symlinks=True)
    missing = [lib_name(b) for b in PY_LIBS + ("ggml", "ggml-base") if lib_name(b) not in libs]
    if missing:
        raise BuildError(f"{bin_dir}: the build produced no {', '.join(missing)}")
    return libs


def python_wheel(tarball: Path, out: Path, stage: Path, libs: list[str], logf, log_path: Path) -> Path:
    """llama-cpp-python's wheel built without llama.cpp, then completed with the libraries it loads.

    Returns:
        ``stage/wheels/<wheel>``: the backend's wheel plus ``llama_cpp/lib/<lib>`` for ``libllama``,
        ``libmtmd`` and every ``libggml*``; tagged ``py3-none-<platform>`` and its ``RECORD`` rewritten.
    """
    env = dict(os.environ, CMAKE_ARGS=WHEEL_CMAKE_ARGS)
    env.pop("FORCE_CMAKE", None)
    run_step([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(out), str(tarball)],
         logf, "pip wheel (llama-cpp-python, LLAMA_BUILD=OFF)", log_path, env=env)
    built = sorted(out.glob("llama_cpp_python-*.whl"))
    if len(built) != 1:
        raise BuildError(f"pip wheel left {len(built)} llama_cpp_python wheels in {out} (expected 1)")
    wanted = [n for n in libs if n in {lib_name(b) for b in PY_LIBS} or n.startswith("libggml")]
    plat = platform_facts()["wheel_platform"]
    dst_dir = stage / "wheels"
    dst_dir.mkdir()
    dist = built[0].name.split("-")
    dst = dst_dir / f"{dist[0]}-{dist[1]}-py3-none-{plat}.whl"
    add_files_to_wheel(built[0], dst, {f"llama_cpp/lib/{n}": stage / "lib" / n for n in wanted}, tag=f"py3-none-{plat}")
    return dst


def add_files_to_wheel(src: Path, dst: Path, files: dict[str, Path], tag: str) -> None:
    """Write ``dst``: the wheel ``src`` plus ``files`` (archive name -> file), ``Tag`` set to ``tag``,
    ``Root-Is-Purelib: false``, and a ``RECORD`` with every entry's SHA-256 and size (PEP 376/427).

    Raises:
        BuildError: ``src`` has no ``*.dist-info/RECORD`` or ``WHEEL`` file.
    """
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        wheel_meta = next((n for n in names if n.endswith(".dist-info/WHEEL")), None)
        if record is None or wheel_meta is None:
            raise BuildError(f"{src}: not a wheel (no .dist-info/RECORD or WHEEL)")
        entries: list[tuple[zipfile.ZipInfo, bytes]] = []
        for info in zin.infolist():
            if info.filename == record or info.filename in files:
                continue
            data = zin.read(info)
            if info.filename == wheel_meta:
                lines = [ln for ln in data.decode().splitlines() if not ln.startswith(("Tag:", "Root-Is-Purelib:"))]
                data = ("\n".join(lines + ["Root-Is-Purelib: false", f"Tag: {tag}"]) + "\n").encode()
            entries.append((info, data))
    for arc, path in sorted(files.items()):
        info = zipfile.ZipInfo(arc, date_time=time.localtime(path.stat().st_mtime)[:6])
        info.external_attr = 0o755 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        entries.append((info, path.read_bytes()))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for info, data in entries:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        w.writerow([info.filename, f"sha256={digest}", len(data)])
    w.writerow([record, "", ""])
    part = dst.with_name(dst.name + ".part")
    with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as zout:
        for info, data in entries:
            zout.writestr(info, data)
        zout.writestr(record, buf.getvalue())
    os.replace(part, dst)


def check_server(server: Path) -> str:
    """Run ``llama-server --version`` (it must find its libraries through its run path); returns its version line."""
    try:
        p = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{server}: does not run ({e})") from None
    text = (p.stdout + p.stderr).strip().splitlines()
    if p.returncode != 0:
        raise BuildError(f"{server} --version exited {p.returncode}: {text[-1] if text else 'no output'}")
    return next((ln for ln in text if ln.startswith("version")), text[0] if text else "?")


def replace_dir(new: Path, root: Path) -> None:
    """Move the complete build ``new`` to ``root``; an older ``root`` is moved aside first and then removed."""
    old = None
    if root.exists():
        old = root.with_name(f".old-{root.name}-{os.getpid()}")
        os.rename(root, old)
    os.rename(new, root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class BuildLock:
    """An exclusive ``flock`` on a file, held for the ``with`` block (waits for another holder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> "BuildLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"llama.cpp build: waiting for another build to finish ({self.path})", file=sys.stderr, flush=True)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
