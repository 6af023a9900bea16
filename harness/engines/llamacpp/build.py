"""Build llama.cpp once, from the llama-cpp-python sdist, and cache it in the user cache directory.

The harness needs two things from llama.cpp: the ``llama_cpp`` Python package
(llama-cpp-python 0.3.36: ctypes bindings that load ``libllama``, ``libggml*``
and ``libmtmd`` from ``llama_cpp/lib/``) and the ``llama-server`` executable.
Both come from the llama.cpp tree the sdist vendors (``vendor/llama.cpp``), and
one CMake build serves both:

1. the sdist is fetched from PyPI (``pip download llama-cpp-python==0.3.36
   --no-deps --no-binary :all:``), its SHA-256 checked against
   :data:`~.pins.SDIST_SHA256`, and kept in ``<cache>/sdist/``;
2. ``cmake`` configures ``vendor/llama.cpp`` with :data:`~.pins.CMAKE_FLAGS` (shared
   libraries, unversioned sonames, an ``$ORIGIN`` run path) and compiles only
   the targets :data:`~.pins.TARGETS` (``llama-server`` and ``mtmd``; ``llama``,
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

Public API: :func:`ensure_built` (-> :class:`LlamaCppBuild`), :func:`build_key`, :func:`.pins.cache_dir`,
:class:`.pins.BuildError`; CLI ``python -m gemma4_harness.harness.engines.llamacpp.build
[--print-path | --print-wheel] [--force] [--native]``.

Here: the portable build and the CLI; what is built and where (the pins, the flags, the cache folder) is
:mod:`.pins`, each step :mod:`.build_steps`, the native variant for ``g4h bench`` :mod:`.native`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .build_steps import (
    built_once,
    check_server,
    check_tools,
    collect_libs,
    extract_sdist,
    fetch_sdist,
    python_wheel,
    replace_dir,
    run_step,
)
from .native import ensure_native_built
from .pins import (
    EXTRA_FLAGS_ENV,
    LAYOUT_VERSION,
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    SDIST_SHA256,
    TARGETS,
    WHEEL_CMAKE_ARGS,
    BuildError,
    cache_dir,
    cmake_flags,
    platform_facts,
)


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


def build_key(extra_flags: Sequence[str] = ()) -> str:
    """The short hash naming a cache folder: the CMake flags, targets, wheel flags, platform and layout.

    Returns:
        12 lowercase hex digits (the start of a SHA-256).
    """
    facts = {"flags": cmake_flags(extra_flags), "targets": list(TARGETS), "wheel": WHEEL_CMAKE_ARGS,
             "platform": platform_facts(), "layout": LAYOUT_VERSION, "sdist": SDIST_SHA256}
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
        cache: the cache folder (default :func:`.pins.cache_dir`).
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
    return built_once(root, cache, (lambda: None) if force else (lambda: _load(root)),
                       lambda: _build(root, extra, cache, jobs, sdist, say))


def _build(root: Path, extra: list[str], cache: Path, jobs: int | None, sdist: Path | None,
           say: Callable[[str], None]) -> LlamaCppBuild:
    tools = check_tools()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{root.name}-", dir=cache))
    log_path = root.with_name(root.name + ".build.log")
    seconds: dict[str, float] = {}
    try:
        with open(log_path, "w") as logf:
            t0 = time.perf_counter()
            tarball = fetch_sdist(cache, sdist, say)
            seconds["sdist"] = time.perf_counter() - t0
            say(f"extracting {tarball.name}")
            src = extract_sdist(tarball, tmp / "src")
            llama_src, build = src / "vendor" / "llama.cpp", tmp / "build"
            n_jobs = jobs or int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or 0) or os.cpu_count() or 1
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            t0 = time.perf_counter()
            say(f"configuring {llama_src.relative_to(tmp)} (cmake{' -G Ninja' if gen else ''})")
            run_step(["cmake", "-S", str(llama_src), "-B", str(build), *gen, *cmake_flags(extra)], logf, "cmake configure",
                 log_path)
            seconds["configure"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            say(f"compiling {', '.join(TARGETS)} with {n_jobs} jobs (several minutes)")
            run_step(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(n_jobs)], logf, "cmake build",
                 log_path)
            seconds["compile"] = time.perf_counter() - t0
            stage = tmp / "out"
            libs = collect_libs(build / "bin", stage)
            t0 = time.perf_counter()
            say("building the llama-cpp-python wheel without its C++ part (pip wheel, LLAMA_BUILD=OFF)")
            wheel = python_wheel(tarball, tmp / "pywheel", stage, libs, logf, log_path)
            seconds["wheel"] = time.perf_counter() - t0
            version = check_server(stage / "bin" / "llama-server")
        stamp = {"version": LLAMA_CPP_PYTHON_VERSION, "layout": LAYOUT_VERSION, "llama_cpp_commit": LLAMA_CPP_COMMIT,
                 "sdist_sha256": SDIST_SHA256, "flags": cmake_flags(extra), "targets": list(TARGETS),
                 "wheel_cmake_args": WHEEL_CMAKE_ARGS, "platform": platform_facts(), "tools": tools,
                 "server_version": version, "libs": libs, "wheel": wheel.name,
                 "seconds": {k: round(v, 1) for k, v in seconds.items()}, "jobs": n_jobs,
                 "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (stage / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.copy2(log_path, stage / "build.log")
        replace_dir(stage, root)
        log_path.unlink(missing_ok=True)  # kept as <root>/build.log; the sibling is left only by a failed build
        say(f"done in {sum(seconds.values()):.0f} s: {root}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    built = _load(root)
    if built is None:
        raise BuildError(f"{root}: the build finished but its stamp or files are missing")
    return built


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
