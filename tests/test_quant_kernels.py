"""The packed-weight CPU kernels (``fast/csrc/linear_quant.c`` through :mod:`fast.quant_kernels`).

What must hold, for every type the kernels decode:

* gathers and row dequantization equal ``gguf.quants.dequantize`` bit for bit;
* ``x @ dequant(W).T`` is within the float32 rounding bound of the float64 product
  (the bound is derived below from the kernel's documented summation order);
* a row's result is bit-identical whatever the batch size (1..16), whatever its
  neighbours hold, and whatever the thread count;
* the AVX-512, AVX2 and plain-C builds give the same bits (built here when a compiler is present);
* shapes the kernels do not take fall back (or raise the constructor's one-line error);
* a tensor made from a read-only memory map is a view of it (no copy).

Weights: the legacy types come from ``gguf.quants.quantize`` of random floats;
the K-quants (which gguf-py cannot quantize) are random bytes with finite fp16
scale fields, as in ``tests/test_fast_quants.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from gemma4_harness.fast import cpu_kernels
from gemma4_harness.fast import quant_kernels as qk
from gemma4_harness.fast.quants import QuantizedTensor, dequantize, linear

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPES = list(qk.TYPES)
QUANTIZABLE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Byte offsets of the fp16 scale fields inside a block (ggml-common.h block_* structs).
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

available, why = qk.status()
needs_kernel = pytest.mark.skipif(not available, reason=f"packed CPU kernels not built here: {why}")


def _raw(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Packed bytes ``[rows, bytes_per_row]`` of a ``[rows, k]`` matrix of type ``name``."""
    rng = np.random.default_rng(seed)
    if name in QUANTIZABLE:
        w = (rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, T[name]))
    bs, ts = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, size=(rows, k // bs, ts), dtype=np.uint8)
    for off in SCALE_OFFSETS[name]:
        scale = (rng.standard_normal((rows, k // bs)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, k // bs, 2)
    return raw.reshape(rows, -1)


def _gguf_rows(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw.copy(), T[name])))


def _qt(name: str, rows: int, k: int, seed: int = 0) -> QuantizedTensor:
    return QuantizedTensor(torch.from_numpy(_raw(name, rows, k, seed)), name, (rows, k))


def _rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Largest |kernel - exact| the summation order allows, per output ``[M, N]``.

    Each output is 16 lane sums of K/16 terms, each added with one fused
    multiply-add (one rounding), then a 4-level tree: every product goes through at
    most ``n = K/16 + 4`` roundings, so |error| <= gamma_n * sum_k |x_k w_k| with
    gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, 2nd ed.,
    Lemma 3.1 and eq. 3.4). The float64 reference adds at most K * 2^-53 relative to
    the same sum; 2^-52 covers it.
    """
    k = x.shape[1]
    n = k // 16 + 4
    u = 2.0 ** -24
    s = x.double().abs() @ w.double().abs().T
    return (n * u / (1 - n * u) + k * 2.0 ** -52) * s


def _assert_bit_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if not torch.equal(got.view(torch.int32), ref.view(torch.int32)):
        i = int((got.view(torch.int32) != ref.view(torch.int32)).reshape(-1).nonzero()[0])
        raise AssertionError(f"first difference at flat index {i}: {got.reshape(-1)[i].item()!r} "
                             f"vs {ref.reshape(-1)[i].item()!r}")


# --------------------------------------------------------------------------- dequantization


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_take_rows_and_dequantize_rows_are_gguf_exact(name):
    bs = GGML_QUANT_SIZES[T[name]][0]
    raw = _raw(name, 40, 4 * max(bs, 64), seed=1)
    ref = _gguf_rows(raw, name)
    qt = QuantizedTensor(torch.from_numpy(raw), name, ref.shape)
    ids = torch.tensor([[3, 0, 39], [-1, 3, 17]])
    got = qk.take_rows(qt.raw, name, qt.row_len, ids.reshape(-1) % 40)
    assert got is not None  # the kernel path, not the torch fallback
    _assert_bit_equal(got, ref[ids.reshape(-1) % 40])
    _assert_bit_equal(qt.take_rows(ids), ref[ids % 40])
    _assert_bit_equal(qk.dequantize_rows(qt.raw, name, qt.row_len, 5, 31), ref[5:31])
    _assert_bit_equal(qt.dequantize_rows(0, 40), ref)
    _assert_bit_equal(qt.dequantize(), ref)
    assert qt.take_rows(torch.tensor([], dtype=torch.long)).shape == (0, qt.row_len)


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_gathers_on_fully_random_bytes_match_gguf(name):
    """Every fp16 scale pattern (subnormal, huge, Inf, NaN): NaN where gguf has NaN, the same bits elsewhere.

    (NaN payloads are not compared: F16C quiets signalling NaNs, NumPy keeps them; see fast/quants.py.)
    """
    bs, ts = GGML_QUANT_SIZES[T[name]]
    raw = np.random.default_rng(11).integers(0, 256, size=(64, 4 * ts), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # Inf * 0 scales: gguf-py warns, the NaN is the value
        ref = _gguf_rows(raw, name)
    got = qk.dequantize_rows(torch.from_numpy(raw), name, 4 * bs, 0, 64)
    assert torch.equal(got.isnan(), ref.isnan())
    keep = ~ref.isnan()
    _assert_bit_equal(got[keep], ref[keep])


@needs_kernel
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_take_rows_other_dtypes_cast_the_exact_values(name):
    qt = _qt(name, 8, 256)
    ids = torch.tensor([1, 7])
    assert torch.equal(qt.take_rows(ids, dtype=torch.bfloat16), qt.take_rows(ids).to(torch.bfloat16))
    for dtype in (torch.bfloat16, torch.float64):  # kernel then cast == the torch decoders' cast
        assert torch.equal(qt.dequantize_rows(2, 6, dtype), dequantize(qt.raw[2:6], name, (4, 256), dtype))
    with pytest.raises(TypeError, match="floating"):
        qt.take_rows(ids, dtype=torch.int32)
    with pytest.raises(IndexError):
        qt.take_rows(torch.tensor([8]))


# --------------------------------------------------------------------------- the multiply


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 13, 16])
def test_linear_within_the_rounding_bound_of_the_exact_product(name, m):
    bs = GGML_QUANT_SIZES[T[name]][0]
    qt = _qt(name, 37, 2 * max(bs, 256), seed=m)
    x = torch.randn(m, qt.row_len, generator=torch.Generator().manual_seed(m))
    y = qk.linear(x, qt.raw, name, qt.row_len)
    assert y is not None and y.shape == (m, 37) and y.dtype == torch.float32
    w = qt.dequantize()
    exact = x.double() @ w.double().T
    assert bool(((y.double() - exact).abs() <= _rounding_bound(x, w)).all())
    assert torch.equal(qt.linear(x), y)  # QuantizedTensor.linear takes the same path


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_rows_are_bit_identical_across_batch_sizes_neighbours_and_threads(name):
    bs = GGML_QUANT_SIZES[T[name]][0]
    qt = _qt(name, 70, 2 * max(bs, 256), seed=3)  # 70 rows: tiles of 4 and 16 rows and their tails
    g = torch.Generator().manual_seed(4)
    x = torch.randn(qk.MAX_ROWS, qt.row_len, generator=g)
    full = qk.linear(x, qt.raw, name, qt.row_len)
    for m in range(1, qk.MAX_ROWS + 1):
        _assert_bit_equal(qk.linear(x[:m], qt.raw, name, qt.row_len), full[:m])
        other = torch.cat([torch.randn(m - 1, qt.row_len, generator=g) * 100, x[5:6]])
        _assert_bit_equal(qk.linear(other, qt.raw, name, qt.row_len)[-1], full[5])
    # threads: a matrix large enough for the kernel to use them (it keeps small products on one thread)
    big = _qt(name, 520, qt.row_len, seed=6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qk.linear(x[:7], big.raw, name, big.row_len)
        for n in (2, 3):
            torch.set_num_threads(n)
            _assert_bit_equal(qk.linear(x[:7], big.raw, name, big.row_len), one)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_concurrent_callers_and_a_forked_child_get_the_same_bits():
    """Two Python threads at once (one job holds the pool, the other runs on its own thread) and a child
    forked after the pool has started (it has no workers and must not wait for any) agree bit for bit."""
    import threading

    qt = _qt("Q8_0", 1024, 1024, seed=8)  # big enough to use the threads
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = qk.linear(x, qt.raw, "Q8_0", 1024)
        got: list[torch.Tensor] = []

        def call():
            for _ in range(20):
                got.append(qk.linear(x, qt.raw, "Q8_0", 1024))

        workers = [threading.Thread(target=call) for _ in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert len(got) == 40 and all(torch.equal(g, want) for g in got)
        if not hasattr(os, "fork"):
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: compute, report equality, leave without running pytest's teardown
            ok = torch.equal(qk.linear(x, qt.raw, "Q8_0", 1024), want)
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        import select

        ready = select.select([r], [], [], 120)[0]  # a hang in the child fails the test instead of blocking it
        answer = os.read(r, 1) if ready else b"timeout"
        os.close(r)
        if not ready:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        assert answer == b"1"
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(TYPES), rows=st.integers(1, 40), blocks=st.integers(1, 5), m=st.integers(1, 16),
       seed=st.integers(0, 2**16))
def test_linear_any_shape(name, rows, blocks, m, seed):
    bs = GGML_QUANT_SIZES[T[name]][0]
    k = bs * blocks
    qt = _qt(name, rows, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    y = qk.linear(x, qt.raw, name, k)
    w = qt.dequantize()
    assert bool(((y.double() - x.double() @ w.double().T).abs() <= _rounding_bound(x, w)).all())
    _assert_bit_equal(qk.linear(x[-1:], qt.raw, name, k), y[-1:])


def _variant(define: str):
    """The kernel library built with ``define`` (forcing a vector path), or a skip when it cannot be built."""
    try:
        return qk.bind(cpu_kernels.build(source=qk.SOURCE, flags=qk.FLAGS + [define], libs=qk.LIBS))
    except (RuntimeError, OSError) as e:
        pytest.skip(f"cannot build the {define} variant: {e}")


@needs_kernel
@pytest.mark.parametrize("define", ["-DG4H_QK_GENERIC", "-DG4H_QK_NO512"])
def test_vector_paths_give_the_same_bits(define):
    lib = _variant(define)
    for name in TYPES:
        bs = GGML_QUANT_SIZES[T[name]][0]
        qt = _qt(name, 23, 2 * max(bs, 256), seed=5)
        x = torch.randn(16, qt.row_len, generator=torch.Generator().manual_seed(5))
        for m in (1, 2, 3, 8, 9, 16):  # every register-block shape of the fused kernels, and the row tails
            y = torch.empty(m, 23)
            assert lib.g4h_qlinear(qk.TYPES[name], qt.raw.data_ptr(), qt.raw.shape[1], 23, qt.row_len,
                                   x.data_ptr(), m, y.data_ptr(), 2) == 0
            _assert_bit_equal(y, qk.linear(x[:m], qt.raw, name, qt.row_len))
        rows = torch.empty(23, qt.row_len)
        assert lib.g4h_qdequant_rows(qk.TYPES[name], qt.raw.data_ptr(), qt.raw.shape[1], qt.row_len, 0, 23,
                                     rows.data_ptr(), 1) == 0
        _assert_bit_equal(rows, _gguf_rows(qt.raw.numpy(), name))


@needs_kernel
def test_an_edited_header_rebuilds_both_packed_kernels(tmp_path, monkeypatch):
    """``fast/csrc/fp16.h`` (the fp16 conversions) is compiled into ``linear_quant.c`` and ``linear_q8.c``: the build
    cache is keyed by its bytes (:func:`fast.cpu_kernels.library_path`), so after an edit both kernels get a new
    library rather than the one built before (here the edit is an ``#error``: both builds then fail)."""
    monkeypatch.setenv("G4H_CACHE", str(tmp_path / "cache"))
    csrc = tmp_path / "csrc"
    shutil.copytree(qk.SOURCE.parent, csrc)
    sources = [csrc / qk.SOURCE.name, csrc / qk.Q8_SOURCE.name]
    before = [cpu_kernels.library_path(s, qk.FLAGS, qk.LIBS) for s in sources]
    assert before == [cpu_kernels.library_path(s, qk.FLAGS, qk.LIBS) for s in sources]  # the key is stable
    header = csrc / "fp16.h"
    header.write_text(header.read_text() + "\n#error fp16.h edited\n")
    after = [cpu_kernels.library_path(s, qk.FLAGS, qk.LIBS) for s in sources]
    assert all(a != b for a, b in zip(before, after)), (before, after)
    for source in sources:
        with pytest.raises(RuntimeError, match=f"failed on {source.name}"):
            cpu_kernels.build(source=source, flags=qk.FLAGS, libs=qk.LIBS)


# --------------------------------------------------------------------------- fallbacks and errors


@needs_kernel
def test_falls_back_where_it_does_not_apply():
    qt = _qt("Q8_0", 4, 64)
    x = torch.randn(2, 64)
    assert qk.linear(torch.randn(qk.MAX_ROWS + 1, 64), qt.raw, "Q8_0", 64) is None  # large M: dequantize + GEMM
    assert qk.linear(x.bfloat16(), qt.raw, "Q8_0", 64) is None
    assert qk.linear(x, qt.raw, "Q2_K", 64) is None                  # a type the kernels do not decode
    assert qk.linear(x, qt.raw.reshape(-1), "Q8_0", 64) is None      # not [rows, bytes_per_row]
    assert qk.linear(x[:, :32], qt.raw, "Q8_0", 32) is None          # bytes do not match the row length
    strided = torch.from_numpy(np.repeat(qt.raw.numpy(), 2, axis=1))[:, ::2]
    assert qk.linear(x, strided, "Q8_0", 64) is None                 # non-contiguous bytes
    many = torch.randn(qk.MAX_ROWS + 4, 64)
    torch.testing.assert_close(linear(many, qt), many @ qt.dequantize().T)  # and the caller still answers


def test_row_length_not_a_multiple_of_the_block_is_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        QuantizedTensor(torch.zeros(4 * 144, dtype=torch.uint8), "Q4_K", (4, 320))


@needs_kernel
def test_the_c_entry_points_reject_bad_shapes():
    lib = qk._get()
    qt = _qt("Q4_0", 2, 64)
    y = torch.empty(1, 2)
    x = torch.zeros(1, 64)
    args = (qt.raw.data_ptr(), qt.raw.shape[1], 2, 64, x.data_ptr())
    assert lib.g4h_qlinear(99, *args, 1, y.data_ptr(), 1) == -1            # unknown type
    assert lib.g4h_qlinear(2, qt.raw.data_ptr(), 36, 2, 48, x.data_ptr(), 1, y.data_ptr(), 1) == -2  # K % 32
    assert lib.g4h_qlinear(2, qt.raw.data_ptr(), 37, 2, 64, x.data_ptr(), 1, y.data_ptr(), 1) == -2  # row bytes
    assert lib.g4h_qlinear(2, *args, 0, y.data_ptr(), 1) == -2              # M = 0


def test_can_be_switched_off():
    code = ("from gemma4_harness.fast import quant_kernels as qk, quants; import torch; print(qk.status()); "
            "qt = quants.QuantizedTensor(torch.zeros(2, 34, dtype=torch.uint8), 'Q8_0', (2, 32)); "
            "print(qk.linear(torch.zeros(1, 32), qt.raw, 'Q8_0', 32), qt.linear(torch.ones(1, 32)).tolist())")
    env = dict(os.environ, G4H_CPU_KERNEL="0", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.splitlines() == ["(False, 'disabled by G4H_CPU_KERNEL=0')", "None [[0.0, 0.0]]"]


# --------------------------------------------------------------------------- views of a memory map


def test_from_gguf_without_copy_is_a_view_of_the_mapped_file(tmp_path):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "test")
    arr = rng.standard_normal((64, 256)).astype(np.float32)
    w.add_tensor("w", gguf.quants.quantize(arr, T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(str(tmp_path / "m.gguf"), "r").tensors[0]
    assert isinstance(t.data, np.memmap) and not t.data.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning escapes
        qt = QuantizedTensor.from_gguf(t, copy=False)
    assert qt.raw.data_ptr() == t.data.ctypes.data  # the same memory: nothing was copied
    assert qt.shape == (64, 256) and qt.nbytes == t.n_bytes
    _assert_bit_equal(qt.dequantize(), _gguf_rows(np.asarray(t.data), "Q8_0"))
    copied = QuantizedTensor.from_gguf(t)
    assert copied.raw.data_ptr() != t.data.ctypes.data and torch.equal(copied.raw, qt.raw)
    with pytest.raises(ValueError, match="C-contiguous"):
        QuantizedTensor.from_numpy(np.asarray(t.data)[:, ::2], "Q8_0", (64, 128), copy=False)


# --------------------------------------------------------------------------- benchmark (pytest --bench)


@pytest.mark.bench
@needs_kernel
def test_bench_packed_kernels_gbs():
    """GB/s of the packed kernels at M = 1 and 8 on E2B's matrices, beside the torch path and a read probe.

    Prints the table of ``python -m gemma4_harness.fast.quant_bench`` (figures, no asserts on them).
    """
    from gemma4_harness.fast import quant_bench

    rows = quant_bench.run(["Q8_0", "Q4_K"], list(quant_bench.SHAPES), [1, 8], l2=True)
    print(f"\nread probe {rows[0]['probe']:.1f} GB/s, threads {torch.get_num_threads()}\n{quant_bench.table(rows)}")
    assert all(r["packed"] > 0 for r in rows)


# --------------------------------------------------------------------------- the real Gemma 3 270M GGUF


@pytest.mark.slow
@needs_kernel
def test_packed_fast_model_on_the_real_gemma3_gguf():
    """FastModel(keep_quantized) on the CPU: views of the mapped file, dense-path logits, neighbour isolation.

    The packed path differs from the dense one (whole-tensor dequantization, then ``linear_f32`` /
    ``F.linear``) only in summation order, so the reference~fast logit gate applies between them.
    Isolation: a sequence decoding next to one neighbour and then next to another (same lengths,
    same arrivals) gets bit-identical logits at every step.
    """
    from gemma4_harness.fast.engine import Engine, Request
    from gemma4_harness.fast.model import FastModel
    from gemma4_harness.harness.core.gates import resolve
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf
    from gemma4_harness.reference import load_model

    cfg, w = load_model(gemma3_270m_gguf())
    packed = FastModel(cfg, w, "cpu", "float32", keep_quantized=True)
    kinds = set()
    for name in w:
        t = packed.w[name]
        if isinstance(t, QuantizedTensor):
            assert t.raw.data_ptr() == w.stored(name).ctypes.data, name  # a view of the map, not a copy
            kinds.add(t.qtype.name)
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= kinds <= set(qk.TYPES)
    ids = [2, 651, 6037, 563, 1032, 8866, 236764]
    dense = FastModel(cfg, w, "cpu", "float32").logits(ids)
    got = packed.logits(ids)
    gates = resolve({}, "gemma3-270m")
    assert gates["reference~fast.max_abs_logit"].check(float((got - dense).abs().max()))
    assert torch.equal(got.argmax(-1), dense.argmax(-1))

    def serve(neighbour):
        reqs = [Request("a", ids, 6), Request("b", neighbour, 6)]
        return Engine(packed, max_batch=2, keep_logits=True).run(reqs)["a"].logits

    first, second = serve([2, 9259, 11, 1550, 19, 6, 4827]), serve([2, 4521, 7, 88, 2301, 5, 310])
    assert len(first) == 6 and all(np.array_equal(a, b) for a, b in zip(first, second))


# --------------------------------------------------------------------------- the fast engine's weight mode


def _e2b_gguf(qtype: str) -> str:
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    return str(synth.ensure_built(MODELS_DIR / "e2b.toml").gguf[qtype])


@needs_kernel
def test_fast_engine_keeps_a_quantized_gguf_packed_by_default():
    """``--weights`` absent: packed (views of the mapped file) for a quantized GGUF, dequantized for an F32 one;
    ``dequantized`` decodes every matrix at load; anything else is refused in one line."""
    from gemma4_harness.harness.core.gates import resolve
    from gemma4_harness.harness.engines.fast import FastEngine
    from gemma4_harness.reference.errors import InputError

    q8 = FastEngine(_e2b_gguf("Q8_0"), device="cpu")
    assert q8.weights == "packed"
    emb = q8.model.w["token_embd.weight"]
    assert isinstance(emb, QuantizedTensor) and emb.qtype.name == "Q8_0"
    assert q8.elem_bytes("token_embd.weight") == 34 / 32  # bench's bytes per token count the packed bytes
    dense = FastEngine(_e2b_gguf("Q8_0"), device="cpu", weights="dequantized")
    assert dense.weights == "dequantized"
    assert all(isinstance(t, torch.Tensor) for t in dense.model.w.t.values())
    ids = [2, 17, 301, 5, 99, 410]
    gate = resolve({}, "e2b")["reference~fast.max_abs_logit"]  # packed vs dequantized: summation order only
    assert gate.check(float(np.max(np.abs(q8.logits(ids) - dense.logits(ids)))))
    assert FastEngine(_e2b_gguf("F32"), device="cpu").weights == "dequantized"
    with pytest.raises(InputError, match="--weights"):
        FastEngine(_e2b_gguf("Q8_0"), device="cpu", weights="int8")


@needs_kernel
def test_parity_fast_packed_check_on_a_built_in_case():
    """The parity figure fast packed vs reference on the same quantized file: inside the reference~fast gate,
    and no figure for an F16 file (nothing in it is kept packed)."""
    from gemma4_harness.harness.core.gates import resolve
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.fast import fast_packed_checks

    prompt = {"id": "short", "prompt_ids": [2, 17, 301, 5, 99, 410, 7]}
    files = {q: _e2b_gguf(q) for q in ("Q8_0", "F16")}
    ref = {q: ReferenceEngine(p).logits(prompt["prompt_ids"]) for q, p in files.items()}
    figs = fast_packed_checks(files, prompt, ref)
    assert [(f.gate, f.prompt) for f in figs] == [("reference~fast.max_abs_logit", "short@Q8_0-packed")]
    assert figs[0].detail["packed_types"] == ["Q8_0"] and figs[0].detail["same_top1"] == 1.0
    assert resolve({}, "e2b")["reference~fast.max_abs_logit"].check(figs[0].measured)
