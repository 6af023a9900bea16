"""The fused dequantize-and-multiply Triton kernels (:mod:`fast.cuda_kernels`), run on the CPU by Triton's interpreter.

``TRITON_INTERPRET=1`` runs the very kernel source the GPU compiles, with NumPy. Triton reads the variable when a
kernel is defined (``triton.jit``), not at import nor at launch, and :mod:`fast.cuda_kernels` defines its kernels
once per process at the first call; so a module-scoped autouse fixture sets it before any test here calls the kernels
(and restores the environment after the file). Triton's own library functions are defined when triton is first
imported, which torch and transformers do early in a test process: ``tests/conftest.py`` therefore sets the variable
at start-up on a machine without CUDA. On a GPU machine run this file in its own process with
``TRITON_INTERPRET=1``.

What must hold (for Q8_0 and Q4_K, ``x`` float32 and bfloat16, ``M`` = 1, 3, 16, 64, ``N`` not a multiple of the
tile):

* ``x @ dequant(W).T`` is within the float32 rounding bound of the float64 product of ``x`` and the exact weights
  (``fast.quants.dequantize``, itself checked bit for bit against ``gguf.quants.dequantize`` in
  ``tests/test_fast_quants.py``), plus one rounding to ``x.dtype`` for 16-bit ``x``;
* a row's result is bit-identical whatever the batch size and whatever its neighbours hold;
* calls the kernel does not take return None.

What the interpreter cannot show: the GPU's summation order inside a tile, its code generation (e.g. that the
IEEE ``tl.dot`` stays off the tensor cores) and its speed; ``python -m gemma4_harness.fast.cuda_bench`` on a GPU measures the last.

Weights: random bytes with finite fp16 scale fields (:func:`fast.quant_bench.packed_pool`'s recipe, with random
scales), so every nibble, int8 and 6-bit scale/min pattern occurs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from gemma4_harness.fast import cuda_bench
from gemma4_harness.fast import cuda_kernels as ck
from gemma4_harness.fast.quants import QuantizedTensor, linear

SCALE_OFFSETS = {"Q8_0": (0,), "Q4_K": (0, 2)}  # byte offsets of the fp16 fields in a block (GGML block_* structs)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # unit roundoff of the output


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv("G4H_CUDA_KERNEL", raising=False)
        ok, why = ck.status()
        assert ok, why
        yield


def _qt(name: str, n: int, k: int, seed: int = 0) -> QuantizedTensor:
    """A random packed ``[n, k]`` weight: random bytes, fp16 scale fields random normal * 0.01 (finite)."""
    bs, ts = GGML_QUANT_SIZES[T[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
    for off in SCALE_OFFSETS[name]:
        scale = (rng.standard_normal((n, k // bs)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(n, k // bs, 2)
    return QuantizedTensor(torch.from_numpy(raw.reshape(n, -1)), name, (n, k))


def _bound(x: torch.Tensor, w: torch.Tensor, exact: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """Largest |kernel - exact| allowed, per output ``[M, N]``.

    Float32: each of the K products is rounded once (or fused) and then goes through at most K - 1 additions in
    any summation order, so |error| <= gamma_K * sum_k |x_k w_k| with gamma_K = K u / (1 - K u), u = 2^-24
    (Higham, Accuracy and Stability, 2nd ed., Lemma 3.1 and eq. 3.4); the order is the compiler's (or NumPy's,
    in the interpreter), so the bound is the one that holds for every order. The float64 reference adds at most
    K * 2^-53 relative to the same sum; 2^-52 covers it. A 16-bit output is rounded once more:
    ``u_out * (|exact| + float32 bound)``.
    """
    k = x.shape[1]
    u = 2.0 ** -24
    b32 = (k * u / (1 - k * u) + k * 2.0 ** -52) * (x.double().abs() @ w.double().abs().T)
    return b32 + U_OUT[out] * (exact.abs() + b32)


def _assert_bit_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if not torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                       ref.view(torch.int16 if ref.element_size() == 2 else torch.int32)):
        i = int((got != ref).reshape(-1).nonzero()[0])
        raise AssertionError(f"first difference at flat index {i}: {got.reshape(-1)[i].item()!r} "
                             f"vs {ref.reshape(-1)[i].item()!r}")


@pytest.mark.parametrize("name,k", [("Q8_0", 288), ("Q4_K", 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_linear_within_the_rounding_bound_of_the_exact_product(name, k, dtype, m):
    qt = _qt(name, 70, k, seed=m)  # 70 rows: one full tile of 64 and a tail; K = 288 is not a multiple of 128
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = ck.linear(x, qt.raw, name, k)
    assert y is not None and y.shape == (m, 70) and y.dtype == dtype
    w = qt.dequantize()
    exact = x.double() @ w.double().T
    assert bool(((y.double() - exact).abs() <= _bound(x, w, exact, dtype)).all())


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_a_real_row_length(name):
    """K = 2560 (Gemma 4 E4B's hidden size): 20 loop steps of the kernel; float16 ``x`` too."""
    qt = _qt(name, 40, 2560, seed=9)
    x = torch.randn(2, 2560, generator=torch.Generator().manual_seed(9))
    w = qt.dequantize()
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        y = ck.linear(xd, qt.raw, name, 2560)
        exact = xd.double() @ w.double().T
        assert y.dtype == dtype and bool(((y.double() - exact).abs() <= _bound(xd, w, exact, dtype)).all())


@pytest.mark.slow
def test_rows_of_the_real_gemma3_gguf():
    """40 rows of the real Gemma 3 270M's Q8_0 token embedding (K = 640) and of a Q4_K attention output (K = 1024),
    against the float64 product with ``gguf.quants.dequantize``'s values."""
    import gguf

    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf
    from gemma4_harness.reference.gguf_check import check_gguf

    gf = check_gguf(gemma3_270m_gguf())  # the checked parser: tests/test_gguf_check.py holds it equal to GGUFReader
    for name, tname in (("Q8_0", "token_embd.weight"), ("Q4_K", "blk.0.attn_output.weight")):
        t = gf.tensors[tname]
        assert t.type_name == name
        raw = np.array(gf.view(tname)[:40], copy=True, order="C")  # a writable copy of the mapped rows
        k = int(t.dims[0])
        w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, T(t.ggml_type))))
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
        y = ck.linear(x, torch.from_numpy(raw), name, k)
        exact = x.double() @ w.double().T
        assert y.shape == (5, 40) and bool(((y.double() - exact).abs() <= _bound(x, w, exact, torch.float32)).all())


@pytest.mark.parametrize("name,k", [("Q8_0", 256), ("Q4_K", 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_bit_identical_across_batch_sizes_and_neighbours(name, k, dtype):
    qt = _qt(name, 45, k, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, k, generator=g).to(dtype)
    full = ck.linear(x, qt.raw, name, k)
    for i in range(8):
        _assert_bit_equal(ck.linear(x[i:i + 1], qt.raw, name, k), full[i:i + 1])
    # the same row at another place in another batch (a different row tile), beside large neighbours
    other = torch.cat([torch.randn(12, k, generator=g).to(dtype) * 100, x[5:6], torch.randn(3, k).to(dtype)])
    _assert_bit_equal(ck.linear(other, qt.raw, name, k)[12], full[5])
    _assert_bit_equal(ck.linear(x[:3], qt.raw, name, k), full[:3])


def test_returns_none_where_it_does_not_apply(monkeypatch):
    qt = _qt("Q8_0", 4, 64)
    x = torch.randn(2, 64)
    assert ck.linear(x, qt.raw, "Q8_0", 64) is not None
    assert ck.linear(torch.randn(ck.MAX_ROWS + 1, 64), qt.raw, "Q8_0", 64) is None  # large M: dequantize + GEMM
    assert ck.linear(x, qt.raw, "Q6_K", 64) is None                  # a type the kernels do not decode
    assert ck.linear(x.double(), qt.raw, "Q8_0", 64) is None         # float64 x
    assert ck.linear(x, qt.raw.reshape(-1), "Q8_0", 64) is None      # not [rows, bytes_per_row]
    assert ck.linear(x[:, :32], qt.raw, "Q8_0", 32) is None          # bytes do not match the row length
    strided = torch.from_numpy(np.repeat(qt.raw.numpy(), 2, axis=1))[:, ::2]
    assert ck.linear(x, strided, "Q8_0", 64) is None                 # non-contiguous bytes
    with ck.disabled():
        assert ck.linear(x, qt.raw, "Q8_0", 64) is None
    monkeypatch.setenv("G4H_CUDA_KERNEL", "0")
    assert ck.linear(x, qt.raw, "Q8_0", 64) is None
    assert ck.status() == (False, "disabled by G4H_CUDA_KERNEL=0")
    monkeypatch.delenv("G4H_CUDA_KERNEL")
    monkeypatch.delenv("TRITON_INTERPRET")                           # a CPU tensor outside interpreter mode
    assert ck.linear(x, qt.raw, "Q8_0", 64) is None
    assert not ck.status()[0]
    # fast.quants.linear never sends CPU tensors to this kernel: the CPU path is the C kernel's or torch's
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with ck.disabled():
        want = linear(x, qt)
    assert torch.equal(linear(x, qt), want)


def test_empty_weight_gives_an_empty_result():
    qt = QuantizedTensor(torch.zeros(0, 34, dtype=torch.uint8), "Q8_0", (0, 32))
    y = ck.linear(torch.randn(3, 32), qt.raw, "Q8_0", 32)
    assert y is not None and y.shape == (3, 0)


# The compiled kernels on a real GPU, in a child process without TRITON_INTERPRET (this process's kernels are the
# interpreter's: Triton fixes the mode when a kernel is defined). Argument: the device; the CPU test below runs the
# same script through the interpreter, so the script itself is checked on every machine.
GPU_SCRIPT = """
import sys
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gemma4_harness.fast import cuda_kernels as ck
from gemma4_harness.fast.quants import QuantizedTensor, linear

dev = sys.argv[1]
torch.backends.cuda.matmul.allow_tf32 = True  # must not matter: the kernel's dot is IEEE float32 whatever torch says
ok, why = ck.status()
assert ok, why
n, k = (300, 2560) if dev == "cuda" else (70, 512)  # the interpreter is slow: a smaller matrix
for name in ("Q8_0", "Q4_K"):
    bs, ts = GGML_QUANT_SIZES[T[name]]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
    for off in {"Q8_0": (0,), "Q4_K": (0, 2)}[name]:
        raw[:, :, off:off + 2] = (rng.standard_normal((n, k // bs, 1)) * 0.01).astype(np.float16).view(np.uint8)
    qt = QuantizedTensor(torch.from_numpy(raw.reshape(n, -1)), name, (n, k)).to(dev)
    w = qt.dequantize().double()
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1)).to(dev)
    for dtype, u_out in ((torch.float32, 0.0), (torch.bfloat16, 2.0 ** -8)):
        xd = x.to(dtype)
        full = ck.linear(xd, qt.raw, name, k)
        exact = xd.double() @ w.T
        b32 = (k * 2.0 ** -24 / (1 - k * 2.0 ** -24) + k * 2.0 ** -52) * (xd.double().abs() @ w.abs().T)
        assert bool(((full.double() - exact).abs() <= b32 + u_out * (exact.abs() + b32)).all()), (name, dtype)
        for m in (1, 3, 8, 17):
            assert torch.equal(ck.linear(xd[:m], qt.raw, name, k), full[:m]), (name, dtype, m)
        assert torch.equal(ck.linear(xd[40:41], qt.raw, name, k), full[40:41]), (name, dtype)
        if dev == "cuda":  # gemma4_harness.fast.quants.linear takes the fused kernel on CUDA
            assert torch.equal(linear(xd[:5], qt), full[:5]), (name, dtype)
print("ok")
"""


def _gpu_script(device: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "G4H_CUDA_KERNEL")}
    env["PYTHONPATH"] = REPO
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", GPU_SCRIPT, device], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_the_gpu_script_passes_in_the_interpreter():
    assert _gpu_script("cpu", interpret=True) == "ok"


@pytest.mark.cuda
def test_the_compiled_kernels_on_the_gpu():
    """Rounding bound, batch invariance (M = 1, 3, 8, 17, 64; another row tile) and the routing of
    :func:`fast.quants.linear`, with the kernels compiled for the GPU (not interpreted), TF32 allowed in torch."""
    assert _gpu_script("cuda", interpret=False) == "ok"


def test_the_bench_smoke_mode_runs_on_the_cpu():
    """``python -m gemma4_harness.fast.cuda_bench --device cpu --smoke`` through :func:`fast.cuda_bench.run`: every row and field,
    finite positive figures (no timing asserted)."""
    rows = cuda_bench.run(["Q8_0", "Q4_K"], list(cuda_bench.SMOKE_SHAPES), [1, 3], device="cpu", smoke=True)
    assert [(r["type"], r["M"]) for r in rows] == [(t, m) for t in ("Q8_0", "Q4_K") for _ in cuda_bench.SMOKE_SHAPES
                                                   for m in (1, 3)]
    for r in rows:
        for key in ("fused", "dequant", "ratio", "probe", "MB"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["max_abs_diff"] is not None and math.isfinite(r["max_abs_diff"])
    assert "fused GB/s" in cuda_bench.table(rows)
    assert os.environ.get("TRITON_INTERPRET") == "1"
