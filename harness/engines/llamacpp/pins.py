"""What the llama.cpp build (:mod:`.build`) builds and where: the pinned llama-cpp-python release, its sdist's hash and
the llama.cpp commit it vendors, the CMake flags and targets, the cache folder, and :class:`BuildError`. Every fact
here that changes a build is part of its cache key (:func:`.build.build_key`, :func:`.native.native_build_root`).
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Sequence

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


def cache_dir() -> Path:
    """The harness's user cache folder: ``$XDG_CACHE_HOME/gemma4-harness``, else ``~/.cache/gemma4-harness``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemma4-harness"


def lib_name(base: str) -> str:
    return f"lib{base}.dylib" if sys.platform == "darwin" else f"lib{base}.so"


def platform_facts() -> dict[str, str]:
    libc = "-".join(x for x in platform.libc_ver() if x)
    return {"system": sys.platform, "machine": platform.machine(), "libc": libc,
            "wheel_platform": sysconfig.get_platform().replace("-", "_").replace(".", "_")}


def cmake_flags(extra: Sequence[str]) -> list[str]:
    origin = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
    return [*CMAKE_FLAGS, f"-DCMAKE_INSTALL_RPATH={origin};{origin}/../lib", *extra]
