"""Build llama.cpp once, from the llama-cpp-python sdist, and cache it in the user cache directory.

The harness needs two things from llama.cpp: the ``llama_cpp`` Python package
(llama-cpp-python 0.3.36: ctypes bindings that load ``libllama``, ``libggml*``
and ``libmtmd`` from ``llama_cpp/lib/``) and the ``llama-server`` executable.
Both come from the llama.cpp tree the sdist vendors (``vendor/llama.cpp``), and
one CMake build serves both:

1. the sdist is fetched from PyPI (``pip download llama-cpp-python==0.3.36
   --no-deps --no-binary :all:``), its SHA-256 checked against
   :data:`SDIST_SHA256`, and kept in ``<cache>/sdist/``;
2. ``cmake`` configures ``vendor/llama.cpp`` with :data:`CMAKE_FLAGS` (shared
   libraries, unversioned sonames, an ``$ORIGIN`` run path) and compiles only
   the targets :data:`TARGETS` (``llama-server`` and ``mtmd``; ``llama``,
   ``ggml*``, ``llama-common`` and the server's own libraries come with them);
3. the Python package is built by the sdist's own backend (scikit-build-core)
   with ``CMAKE_ARGS=-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF``, which compiles
   nothing, and the libraries of step 2 are added to that wheel under
   ``llama_cpp/lib/`` (its ``RECORD`` rewritten), so ``pip install`` of the
   cached wheel gives a complete, working ``llama_cpp`` in any virtualenv.

Cache layout (``<cache>`` = ``$XDG_CACHE_HOME/gemma4-harness`` or
``~/.cache/gemma4-harness``)::

    <cache>/sdist/llama_cpp_python-0.3.36.tar.gz
    <cache>/llama.cpp-0.3.36-<key>/         key: hash of the CMake flags and the platform
        bin/llama-server                    run path $ORIGIN/../lib
        lib/libllama.so libggml*.so libmtmd.so libllama-common.so ...
        wheels/llama_cpp_python-0.3.36-py3-none-<platform>.whl
        stamp.json                          version, flags, platform, seconds per phase
        build.log                           cmake's and pip's output
    <cache>/llama.cpp-0.3.36-<key>.lock     held while one process builds

A build happens in a temporary sibling folder that is renamed into place when
complete, under an exclusive lock on the ``.lock`` file, so a second process
waits and then reuses the result, and an interrupted build never leaves a
half-filled cache folder.

Public API: :func:`ensure_built` (-> :class:`LlamaCppBuild`), :func:`cache_dir`,
:func:`build_key`, :class:`BuildError`; CLI ``python -m gemma4_harness.harness.engines.llamacpp.build
[--print-path | --print-wheel] [--force]``.
"""

from __future__ import annotations

import argparse
import base64
import csv
import fcntl
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from gemma4_harness.fast.cpu_identity import cpu_model
from gemma4_harness.reference.errors import InputError

#: The llama-cpp-python release whose vendored llama.cpp is built (harness/engines/llamacpp/worker.py mirrors
#: its structs).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: SHA-256 of ``llama_cpp_python-0.3.36.tar.gz`` as PyPI serves it (checked after every download).
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: The llama.cpp commit that sdist vendors (its CHANGELOG.md: "update llama.cpp to ggml-org/llama.cpp@0c1e57098");
#: the sdist has no git history, so it is passed to CMake for llama-server's ``/props`` build info.
LLAMA_CPP_COMMIT = "0c1e57098"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"

#: The CMake configuration. GGML_NATIVE=OFF: the ggml CPU backend is compiled for a fixed x86-64 level
#: (AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no AMX) rather than for this machine's CPU, so a cache
#: restored on another CI machine runs there too. LLAMA_BUILD_UI / LLAMA_USE_PREBUILT_UI off: no npm, no
#: download; llama-server embeds an empty asset table. LLAMA_OPENSSL off: llama-server only listens on
#: 127.0.0.1 here, and the binary does not depend on the system's libssl. LLAMA_CURL is a deprecated
#: no-op in this llama.cpp (kept so the flag set reads the same as the wheel's). No versioned sonames
#: (``libllama.so`` is the file itself: a wheel cannot hold symlinks), and the install run path is baked
#: in at build time, so the files work from wherever they are copied, side by side.
CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}",
    "-DCMAKE_PLATFORM_NO_VERSIONED_SONAME=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
)
#: Only these targets (and what they link) are compiled; the other tools are configured, never built.
TARGETS: tuple[str, ...] = ("llama-server", "mtmd")
#: CMAKE_ARGS for the Python package's own build: no llama.cpp, no mtmd (they come from the build above).
WHEEL_CMAKE_ARGS = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
#: Environment variable with extra CMake flags (e.g. ``-DGGML_CUDA=ON``); they are part of the cache key.
EXTRA_FLAGS_ENV = "G4H_LLAMACPP_CMAKE_ARGS"
#: Bumped when the cache folder's layout changes (part of the key).
LAYOUT_VERSION = 1
#: Library base names the Python package loads (plus every ``ggml*`` backend library).
PY_LIBS = ("llama", "mtmd")


class BuildError(InputError):
    """llama.cpp could not be built or fetched here: a missing tool, a failed step, a bad download.

    ``str(err)`` is one line naming what is missing or which step failed (and the build log).
    """


@dataclass(frozen=True)
class LlamaCppBuild:
    """A complete cached build.

    Attributes:
        root: ``<cache>/llama.cpp-<version>-<key>/``.
        server: the ``llama-server`` executable.
        lib_dir: the shared libraries (``libllama``, ``libggml*``, ``libmtmd``, ``libllama-common``, ...).
        wheel: the llama-cpp-python wheel with those libraries inside (``pip install`` it).
        stamp: the contents of ``stamp.json`` (version, flags, platform, ``seconds`` per phase).
    """

    root: Path
    server: Path
    lib_dir: Path
    wheel: Path
    stamp: dict


def cache_dir() -> Path:
    """The harness's user cache folder: ``$XDG_CACHE_HOME/gemma4-harness``, else ``~/.cache/gemma4-harness``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemma4-harness"


def _lib_name(base: str) -> str:
    return f"lib{base}.dylib" if sys.platform == "darwin" else f"lib{base}.so"


def _platform_facts() -> dict[str, str]:
    libc = "-".join(x for x in platform.libc_ver() if x)
    return {"system": sys.platform, "machine": platform.machine(), "libc": libc,
            "wheel_platform": sysconfig.get_platform().replace("-", "_").replace(".", "_")}


def _flags(extra: Sequence[str]) -> list[str]:
    origin = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
    return [*CMAKE_FLAGS, f"-DCMAKE_INSTALL_RPATH={origin};{origin}/../lib", *extra]


def build_key(extra_flags: Sequence[str] = ()) -> str:
    """The short hash naming a cache folder: the CMake flags, targets, wheel flags, platform and layout.

    Returns:
        12 lowercase hex digits (the start of a SHA-256).
    """
    facts = {"flags": _flags(extra_flags), "targets": list(TARGETS), "wheel": WHEEL_CMAKE_ARGS,
             "platform": _platform_facts(), "layout": LAYOUT_VERSION, "sdist": SDIST_SHA256}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def _extra_from_env() -> list[str]:
    return os.environ.get(EXTRA_FLAGS_ENV, "").split()


def build_root(extra_flags: Sequence[str] | None = None, cache: Path | None = None) -> Path:
    """Where the build for these flags lives (whether or not it exists yet)."""
    extra = _extra_from_env() if extra_flags is None else list(extra_flags)
    return (cache or cache_dir()) / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{build_key(extra)}"


def _load(root: Path) -> LlamaCppBuild | None:
    """The build at ``root`` when its stamp and every file it names are there, else None."""
    try:
        stamp = json.loads((root / "stamp.json").read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("version") != LLAMA_CPP_PYTHON_VERSION or stamp.get("layout") != LAYOUT_VERSION:
        return None
    b = LlamaCppBuild(root=root, server=root / "bin" / "llama-server", lib_dir=root / "lib",
                      wheel=root / "wheels" / stamp.get("wheel", "?"), stamp=stamp)
    files = [b.server, b.wheel] + [b.lib_dir / n for n in stamp.get("libs", [])]
    return b if all(f.is_file() for f in files) and stamp.get("libs") else None


def ensure_built(force: bool = False, extra_flags: Sequence[str] | None = None, cache: Path | None = None,
                 jobs: int | None = None, sdist: Path | None = None,
                 log: Callable[[str], None] | None = None) -> LlamaCppBuild:
    """The cached llama.cpp build, built first when absent (about 7.5 CPU-minutes: ~4 min on 2 idle cores).

    Args:
        force: rebuild even when a complete build is cached (the old one is replaced only once the new one
            is complete).
        extra_flags: more CMake flags (default: ``$G4H_LLAMACPP_CMAKE_ARGS``, split on spaces); part of the key.
        cache: the cache folder (default :func:`cache_dir`).
        jobs: parallel compile jobs (default ``$CMAKE_BUILD_PARALLEL_LEVEL``, else the CPU count).
        sdist: a local ``llama_cpp_python-0.3.36.tar.gz`` to use instead of downloading it (checked too).
        log: receives one progress line per phase (default: stderr, prefixed ``llama.cpp build:``).

    Returns:
        The :class:`LlamaCppBuild`.

    Raises:
        BuildError: cmake, a C/C++ compiler or pip is missing; the download, the configure, the compile or the
            wheel step failed (the message names the step and the log); another platform than Linux or macOS.
    """
    say = log or (lambda m: print(f"llama.cpp build: {m}", file=sys.stderr, flush=True))
    cache = Path(cache) if cache is not None else cache_dir()
    extra = _extra_from_env() if extra_flags is None else list(extra_flags)
    root = build_root(extra, cache)
    return _built_once(root, cache, (lambda: None) if force else (lambda: _load(root)),
                       lambda: _build(root, extra, cache, jobs, sdist, say))


def _built_once(root: Path, cache: Path, find: Callable[[], Any], build: Callable[[], Any]) -> Any:
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
    with _Lock(root.with_name(root.name + ".lock")):
        found = find()
        if found is not None:
            return found
        for stale in [*cache.glob(f".tmp-{root.name}-*"), *cache.glob(f".old-{root.name}-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a build that died (we hold the lock)
        return build()


def _build(root: Path, extra: list[str], cache: Path, jobs: int | None, sdist: Path | None,
           say: Callable[[str], None]) -> LlamaCppBuild:
    tools = _check_tools()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{root.name}-", dir=cache))
    log_path = root.with_name(root.name + ".build.log")
    seconds: dict[str, float] = {}
    try:
        with open(log_path, "w") as logf:
            t0 = time.perf_counter()
            tarball = fetch_sdist(cache, sdist, say)
            seconds["sdist"] = time.perf_counter() - t0
            say(f"extracting {tarball.name}")
            src = _extract(tarball, tmp / "src")
            llama_src, build = src / "vendor" / "llama.cpp", tmp / "build"
            n_jobs = jobs or int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or 0) or os.cpu_count() or 1
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            t0 = time.perf_counter()
            say(f"configuring {llama_src.relative_to(tmp)} (cmake{' -G Ninja' if gen else ''})")
            _run(["cmake", "-S", str(llama_src), "-B", str(build), *gen, *_flags(extra)], logf, "cmake configure",
                 log_path)
            seconds["configure"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            say(f"compiling {', '.join(TARGETS)} with {n_jobs} jobs (several minutes)")
            _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(n_jobs)], logf, "cmake build",
                 log_path)
            seconds["compile"] = time.perf_counter() - t0
            stage = tmp / "out"
            libs = _collect(build / "bin", stage)
            t0 = time.perf_counter()
            say("building the llama-cpp-python wheel without its C++ part (pip wheel, LLAMA_BUILD=OFF)")
            wheel = _python_wheel(tarball, tmp / "pywheel", stage, libs, logf, log_path)
            seconds["wheel"] = time.perf_counter() - t0
            version = _check_server(stage / "bin" / "llama-server")
        stamp = {"version": LLAMA_CPP_PYTHON_VERSION, "layout": LAYOUT_VERSION, "llama_cpp_commit": LLAMA_CPP_COMMIT,
                 "sdist_sha256": SDIST_SHA256, "flags": _flags(extra), "targets": list(TARGETS),
                 "wheel_cmake_args": WHEEL_CMAKE_ARGS, "platform": _platform_facts(), "tools": tools,
                 "server_version": version, "libs": libs, "wheel": wheel.name,
                 "seconds": {k: round(v, 1) for k, v in seconds.items()}, "jobs": n_jobs,
                 "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (stage / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.copy2(log_path, stage / "build.log")
        _replace_dir(stage, root)
        log_path.unlink(missing_ok=True)  # kept as <root>/build.log; the sibling is left only by a failed build
        say(f"done in {sum(seconds.values()):.0f} s: {root}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    built = _load(root)
    if built is None:
        raise BuildError(f"{root}: the build finished but its stamp or files are missing")
    return built


def _check_tools() -> dict[str, str]:
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


def _extract(tarball: Path, dst: Path) -> Path:
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


def _run(cmd: list[str], logf, step: str, log_path: Path, env: dict[str, str] | None = None) -> None:
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


def _collect(bin_dir: Path, stage: Path) -> list[str]:
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
    missing = [_lib_name(b) for b in PY_LIBS + ("ggml", "ggml-base") if _lib_name(b) not in libs]
    if missing:
        raise BuildError(f"{bin_dir}: the build produced no {', '.join(missing)}")
    return libs


def _python_wheel(tarball: Path, out: Path, stage: Path, libs: list[str], logf, log_path: Path) -> Path:
    """llama-cpp-python's wheel built without llama.cpp, then completed with the libraries it loads.

    Returns:
        ``stage/wheels/<wheel>``: the backend's wheel plus ``llama_cpp/lib/<lib>`` for ``libllama``,
        ``libmtmd`` and every ``libggml*``; tagged ``py3-none-<platform>`` and its ``RECORD`` rewritten.
    """
    env = dict(os.environ, CMAKE_ARGS=WHEEL_CMAKE_ARGS)
    env.pop("FORCE_CMAKE", None)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(out), str(tarball)],
         logf, "pip wheel (llama-cpp-python, LLAMA_BUILD=OFF)", log_path, env=env)
    built = sorted(out.glob("llama_cpp_python-*.whl"))
    if len(built) != 1:
        raise BuildError(f"pip wheel left {len(built)} llama_cpp_python wheels in {out} (expected 1)")
    wanted = [n for n in libs if n in {_lib_name(b) for b in PY_LIBS} or n.startswith("libggml")]
    plat = _platform_facts()["wheel_platform"]
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


def _check_server(server: Path) -> str:
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


def _replace_dir(new: Path, root: Path) -> None:
    """Move the complete build ``new`` to ``root``; an older ``root`` is moved aside first and then removed."""
    old = None
    if root.exists():
        old = root.with_name(f".old-{root.name}-{os.getpid()}")
        os.rename(root, old)
    os.rename(new, root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class _Lock:
    """An exclusive ``flock`` on a file, held for the ``with`` block (waits for another holder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> "_Lock":
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


# --------------------------------------------------------------------------- the native variant (g4h bench)

#: The native variant's flags: the portable configuration with ggml's CPU backend compiled for this machine's CPU
#: (``GGML_NATIVE=ON``: ``-march=native``, so AVX-512, VNNI and the rest where the CPU has them), which is what a
#: user who builds llama.cpp on their machine runs. Only ``g4h bench`` uses it (a speed comparison must be against
#: the build a user would run); correctness checks keep the portable build.
NATIVE_FLAGS: tuple[str, ...] = tuple("-DGGML_NATIVE=ON" if f == "-DGGML_NATIVE=OFF" else f for f in CMAKE_FLAGS)
#: The native variant builds only the libraries ``llama_cpp`` loads (``libllama`` and the ``libggml*`` it links):
#: no server, no mtmd, about half of the portable build's compile time.
NATIVE_TARGETS: tuple[str, ...] = ("llama",)


def native_build_root(cache: Path | None = None) -> Path:
    """Where the native variant for this CPU lives: ``<cache>/llama.cpp-<version>-native-<key>``, the key hashing
    the flags, the platform and the CPU's model name and feature flags (:func:`fast.cpu_identity.cpu_model`), so a
    cache shared between machines never hands one CPU a build for another's instruction set."""
    facts = {"flags": _flags(()), "native": list(NATIVE_FLAGS), "targets": list(NATIVE_TARGETS),
             "platform": _platform_facts(), "layout": LAYOUT_VERSION, "sdist": SDIST_SHA256, "cpu": cpu_model()}
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    return (cache or cache_dir()) / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-native-{key}"


def native_lib_dir(cache: Path | None = None) -> Path | None:
    """The native variant's library folder when it is built (``LLAMA_CPP_LIB_PATH`` for a worker), else None."""
    root = native_build_root(cache)
    try:
        stamp = json.loads((root / "stamp.json").read_text())
    except (OSError, ValueError):
        return None
    libs = stamp.get("libs") or []
    return root / "lib" if libs and all((root / "lib" / n).is_file() for n in libs) else None


def ensure_native_built(cache: Path | None = None, jobs: int | None = None, sdist: Path | None = None,
                        log: Callable[[str], None] | None = None) -> Path:
    """The native variant's library folder, built first when absent (once per CPU; on 2 cores about 6 minutes).

    Built under its own lock with the same sdist, in a temporary sibling renamed into place when complete, as
    :func:`ensure_built` does. Only ``g4h bench --engines llamacpp-native`` asks for it.

    Raises:
        BuildError: a missing tool or a failed step (named, with the log).
    """
    say = log or (lambda m: print(f"llama.cpp native build: {m}", file=sys.stderr, flush=True))
    cache = Path(cache) if cache is not None else cache_dir()
    root = native_build_root(cache)
    found = _built_once(root, cache, lambda: native_lib_dir(cache),
                        lambda: _build_native(root, cache, jobs, sdist, say)) or native_lib_dir(cache)
    if found is None:
        raise BuildError(f"{root}: the native build finished but its stamp or libraries are missing")
    return found


def _build_native(root: Path, cache: Path, jobs: int | None, sdist: Path | None, say: Callable[[str], None]) -> None:
    """Configure and compile :data:`NATIVE_TARGETS` with :data:`NATIVE_FLAGS`; copy the libraries to ``root/lib``."""
    _check_tools()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{root.name}-", dir=cache))
    log_path = root.with_name(root.name + ".build.log")
    seconds: dict[str, float] = {}
    flags = [*NATIVE_FLAGS, *_flags(())[len(CMAKE_FLAGS):]]
    try:
        with open(log_path, "w") as logf:
            src = _extract(fetch_sdist(cache, sdist, say), tmp / "src")
            llama_src, build = src / "vendor" / "llama.cpp", tmp / "build"
            n_jobs = jobs or int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or 0) or os.cpu_count() or 1
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            t0 = time.perf_counter()
            say("configuring with GGML_NATIVE=ON")
            _run(["cmake", "-S", str(llama_src), "-B", str(build), *gen, *flags], logf, "cmake configure (native)",
                 log_path)
            seconds["configure"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            say(f"compiling {', '.join(NATIVE_TARGETS)} for this CPU with {n_jobs} jobs (several minutes)")
            _run(["cmake", "--build", str(build), "--target", *NATIVE_TARGETS, "-j", str(n_jobs)], logf,
                 "cmake build (native)", log_path)
            seconds["compile"] = time.perf_counter() - t0
        stage = tmp / "out"
        (stage / "lib").mkdir(parents=True)
        suffix = ".dylib" if sys.platform == "darwin" else ".so"
        libs = sorted(p.name for p in (build / "bin").iterdir() if p.name.startswith("lib") and p.name.endswith(suffix))
        if _lib_name("llama") not in libs or _lib_name("ggml") not in libs:
            raise BuildError(f"{build / 'bin'}: the native build produced no {_lib_name('llama')} or "
                             f"{_lib_name('ggml')}")
        for name in libs:
            shutil.copy2(build / "bin" / name, stage / "lib" / name, follow_symlinks=True)
        stamp = {"version": LLAMA_CPP_PYTHON_VERSION, "layout": LAYOUT_VERSION, "llama_cpp_commit": LLAMA_CPP_COMMIT,
                 "flags": flags, "targets": list(NATIVE_TARGETS), "platform": _platform_facts(), "libs": libs,
                 "seconds": {k: round(v, 1) for k, v in seconds.items()}, "jobs": n_jobs,
                 "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (stage / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.copy2(log_path, stage / "build.log")
        _replace_dir(stage, root)
        log_path.unlink(missing_ok=True)
        say(f"done in {sum(seconds.values()):.0f} s: {root}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gemma4_harness.harness.engines.llamacpp.build [--print-path | --print-wheel] [--force]``: build if needed, say where.

    Returns (as exit status): 0 when the build is there; 2 with one line on stderr when it cannot be made
    (:class:`BuildError`).
    """
    ap = argparse.ArgumentParser(prog="python -m gemma4_harness.harness.engines.llamacpp.build", description=__doc__.splitlines()[0])
    ap.add_argument("--print-path", action="store_true", help="print only the build folder")
    ap.add_argument("--print-wheel", action="store_true", help="print only the llama-cpp-python wheel's path")
    ap.add_argument("--force", action="store_true", help="rebuild even when a build is cached")
    ap.add_argument("--native", action="store_true",
                    help="instead: the native variant for g4h bench (GGML_NATIVE=ON, libraries only); print its "
                         "library folder")
    ap.add_argument("--sdist", type=Path, help="use this llama_cpp_python-0.3.36.tar.gz instead of downloading it")
    ap.add_argument("--jobs", type=int, help="parallel compile jobs (default: CPU count)")
    args = ap.parse_args(argv)
    if args.native:
        try:
            print(ensure_native_built(jobs=args.jobs, sdist=args.sdist))
        except BuildError as e:
            print(f"llamacpp_build: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        b = ensure_built(force=args.force, jobs=args.jobs, sdist=args.sdist)
    except BuildError as e:
        print(f"llamacpp_build: error: {e}", file=sys.stderr)
        return 2
    if args.print_path or args.print_wheel:
        print(b.root if args.print_path else b.wheel)
        return 0
    print(f"build:  {b.root}\nserver: {b.server}\nlibs:   {b.lib_dir}\nwheel:  {b.wheel}\n"
          f"built:  {b.stamp.get('built_at')} in {b.stamp.get('seconds')} s ({b.stamp.get('server_version')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
