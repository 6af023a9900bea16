"""The built llama.cpp for the tests that compare with it: :func:`need_llamacpp` (the explicit opt-out, else a failure
when llama-cpp-python is missing) and :func:`load_ggml`, its ggml libraries through ctypes (the ones llama-cpp-python
loads: ``llama_cpp/lib``), for tests/test_activation_quants.py, tests/test_quantized_gates.py and
tests/test_llamacpp_numerics.py."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest


class TraitsCPU(ctypes.Structure):
    """``struct ggml_type_traits_cpu`` (``ggml/include/ggml-cpu.h``)."""
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def need_llamacpp() -> Path:
    """The folder of llama-cpp-python's libraries; skips the test when the user opted out with
    ``G4H_SKIP_LLAMACPP=1``, fails it when llama-cpp-python is not installed (a check that cannot run is a failure)."""
    if os.environ.get("G4H_SKIP_LLAMACPP", "") not in ("", "0"):
        pytest.skip("opted out with G4H_SKIP_LLAMACPP=1")
    try:
        import llama_cpp
    except ImportError as e:
        pytest.fail(f"llama-cpp-python is not installed ({e}); nox -s tests installs it (G4H_SKIP_LLAMACPP=1 opts "
                    "out)", pytrace=False)
    return Path(llama_cpp.__file__).parent / "lib"


def load_ggml() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """``(libggml-base, libggml-cpu)``, the CPU backend initialised, with the signatures of the functions the tests
    call: ``ggml_get_type_traits_cpu`` (-> :class:`TraitsCPU`), ``ggml_row_size``, ``ggml_quantize_chunk``,
    ``ggml_quantize_requires_imatrix``."""
    d = need_llamacpp()
    base = ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCPU)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    base.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    base.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return base, cpu
