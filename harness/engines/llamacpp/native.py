"""The native variant of the llama.cpp build, for ``g4h bench`` only: the portable configuration with ggml's CPU
backend compiled for this machine's CPU (``GGML_NATIVE=ON``), libraries only, cached under a key that names the CPU
(``python -m gemma4_harness.harness.engines.llamacpp.build --native``; the portable build is :mod:`.build`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from gemma4_harness.fast.cpu_identity import cpu_model

from .build_steps import built_once, check_tools, extract_sdist, fetch_sdist, replace_dir, run_step
from .pins import (
    CMAKE_FLAGS,
    LAYOUT_VERSION,
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    SDIST_SHA256,
    BuildError,
    cache_dir,
    cmake_flags,
    lib_name,
    platform_facts,
)


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
    facts = {"flags": cmake_flags(()), "native": list(NATIVE_FLAGS), "targets": list(NATIVE_TARGETS),
             "platform": platform_facts(), "layout": LAYOUT_VERSION, "sdist": SDIST_SHA256, "cpu": cpu_model()}
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
    found = built_once(root, cache, lambda: native_lib_dir(cache),
                        lambda: _build_native(root, cache, jobs, sdist, say)) or native_lib_dir(cache)
    if found is None:
        raise BuildError(f"{root}: the native build finished but its stamp or libraries are missing")
    return found


def _build_native(root: Path, cache: Path, jobs: int | None, sdist: Path | None, say: Callable[[str], None]) -> None:
    """Configure and compile :data:`NATIVE_TARGETS` with :data:`NATIVE_FLAGS`; copy the libraries to ``root/lib``."""
    check_tools()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{root.name}-", dir=cache))
    log_path = root.with_name(root.name + ".build.log")
    seconds: dict[str, float] = {}
    flags = [*NATIVE_FLAGS, *cmake_flags(())[len(CMAKE_FLAGS):]]
    try:
        with open(log_path, "w") as logf:
            src = extract_sdist(fetch_sdist(cache, sdist, say), tmp / "src")
            llama_src, build = src / "vendor" / "llama.cpp", tmp / "build"
            n_jobs = jobs or int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or 0) or os.cpu_count() or 1
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            t0 = time.perf_counter()
            say("configuring with GGML_NATIVE=ON")
            run_step(["cmake", "-S", str(llama_src), "-B", str(build), *gen, *flags], logf, "cmake configure (native)",
                 log_path)
            seconds["configure"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            say(f"compiling {', '.join(NATIVE_TARGETS)} for this CPU with {n_jobs} jobs (several minutes)")
            run_step(["cmake", "--build", str(build), "--target", *NATIVE_TARGETS, "-j", str(n_jobs)], logf,
                 "cmake build (native)", log_path)
            seconds["compile"] = time.perf_counter() - t0
        stage = tmp / "out"
        (stage / "lib").mkdir(parents=True)
        suffix = ".dylib" if sys.platform == "darwin" else ".so"
        libs = sorted(p.name for p in (build / "bin").iterdir() if p.name.startswith("lib") and p.name.endswith(suffix))
        if lib_name("llama") not in libs or lib_name("ggml") not in libs:
            raise BuildError(f"{build / 'bin'}: the native build produced no {lib_name('llama')} or "
                             f"{lib_name('ggml')}")
        for name in libs:
            shutil.copy2(build / "bin" / name, stage / "lib" / name, follow_symlinks=True)
        stamp = {"version": LLAMA_CPP_PYTHON_VERSION, "layout": LAYOUT_VERSION, "llama_cpp_commit": LLAMA_CPP_COMMIT,
                 "flags": flags, "targets": list(NATIVE_TARGETS), "platform": platform_facts(), "libs": libs,
                 "seconds": {k: round(v, 1) for k, v in seconds.items()}, "jobs": n_jobs,
                 "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (stage / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.copy2(log_path, stage / "build.log")
        replace_dir(stage, root)
        log_path.unlink(missing_ok=True)
        say(f"done in {sum(seconds.values()):.0f} s: {root}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
