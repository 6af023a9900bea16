"""The fast engine's ``--compute q8`` (fast/q8_compute.py, fast/csrc/linear_q8.c): llama.cpp's arithmetic, the third
implementation of one rounding (llama.cpp's CPU backend, the float64 emulation of reference/activation_quants.py,
this one).

* the kernel's activation quantizers against the emulation and against the built library's ``from_float`` (Q8_0 and
  Q8_K), bit for bit, on the adversarial rows of tests/test_activation_quants.py;
* its products of Q8_0, Q4_0, Q5_0, Q4_K, Q5_K and Q6_K weights against the emulation (the rounded row times the exact
  dequantized weight, float64) within the fp32 accumulation bound (:func:`test_activation_quants.fp32_bound`), on odd
  row counts, K a multiple of 32 but not of 64 or 256 (the K-quants: 256, 512, 2816), batches of 1 to 70 rows and
  several seeds; every ISA path (AVX-512
  VNNI, AVX2, plain C) the same bits; the unrounded product lies beyond the bound (so a rounding or block-sum error
  fails); and against ggml's own ``vec_dot`` on the library's own quantized weight and activation rows; the
  K-quants (random blocks: every 6-bit scale and min, int8 scales down to -128, fp16 super-block scales from
  subnormal to 65504; Q5_K's high bits) bit for bit against the library's own generic
  ``ggml_vec_dot_q4_K_q8_K_generic`` / ``..._q5_K_...`` / ``..._q6_K_...`` on every ISA path;
* the engine: ``--compute q8`` declares ``quantized_activations`` and its pair is judged by the emulated gates:
  a small Q8_0 / Q4_0 / Q4_K_M / Q5_K_M file passes ``local_median`` (the K-quant products of the last two through
  the C kernel), a copy with the first half of ``blk.1.ffn_down``'s rows x1.02
  fails it naming ``ffn_out@1``; ``g4h parity --against fast --compute q8`` exits 0 end to end.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import gemma4_harness.reference.activation_quants as rq
from gemma4_harness.fast import quant_kernels as qk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggml_lib import load_ggml  # noqa: E402
from test_activation_quants import GGML_TYPES, VEC_DOT, _from_float, adversarial_rows, fp32_bound  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""The types whose activations are Q8_K (blocks of 256)."""
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lib():
    """The built ``linear_q8`` library (its ISA cap restored after each use)."""
    from gemma4_harness.fast import cpu_kernels

    if qk.q8_isa() is None:
        pytest.skip("no C compiler: the q8 kernels are not built")
    return qk.bind_q8(cpu_kernels.build(source=qk.Q8_SOURCE, flags=qk.FLAGS, libs=qk.LIBS))


def _isas(lib) -> list[int]:
    """The ISA paths this CPU can take, best first (each forced in turn)."""
    out = []
    for cap in (512, 256, 0):
        got = lib.g4h_q8_force_isa(cap)
        if got not in out:
            out.append(got)
    lib.g4h_q8_force_isa(512)
    return out


def _product(lib, qtype: str, raw: np.ndarray, x: np.ndarray, threads: int = 2) -> np.ndarray:
    n, k = raw.shape[0], x.shape[1]
    y = np.empty((x.shape[0], n), dtype=np.float32)
    raw = np.ascontiguousarray(raw)
    x = np.ascontiguousarray(x, dtype=np.float32)
    for a in range(0, x.shape[0], qk.Q8_MAX_ROWS):  # one call takes at most 64 rows
        xa, ya = x[a:a + qk.Q8_MAX_ROWS], np.empty((min(qk.Q8_MAX_ROWS, x.shape[0] - a), n), dtype=np.float32)
        rc = lib.g4h_q8_linear(qk.Q8_TYPES[qtype], raw.ctypes.data, raw.shape[1], n, k, xa.ctypes.data, xa.shape[0],
                               ya.ctypes.data, threads)
        assert rc == 0
        y[a:a + xa.shape[0]] = ya
    return y


def test_quantizer_is_the_emulation_and_the_librarys_bit_for_bit(lib):
    """The kernel's ``block_q8_0`` of adversarial rows (ties, subnormals, huge values, a scale that overflows fp16)
    is :func:`reference.activation_quants.quantize_q8_0`'s and the built library's ``from_float`` (Q8_0), bit for
    bit: scales and values."""
    ggml = load_ggml()
    rows = adversarial_rows()
    d = np.empty((rows.shape[0], rows.shape[1] // 32), dtype=np.float32)
    q = np.empty(rows.shape, dtype=np.int8)
    assert lib.g4h_q8_quantize(rows.ctypes.data, rows.shape[0], rows.shape[1], d.ctypes.data, q.ctypes.data) == 0
    with np.errstate(all="ignore"):
        ed, eq = rq.quantize_q8_0(rows.astype(np.float64))
    assert np.array_equal(d.view(np.uint32), ed.astype(np.float32).view(np.uint32))
    assert np.array_equal(q, eq.reshape(rows.shape))
    for i, row in enumerate(rows):
        b = _from_float(ggml, "Q8_0", row).reshape(-1, 34)
        assert np.array_equal(d[i].astype(np.float16).view(np.uint16), b[:, :2].copy().view(np.uint16)[:, 0]), i
        assert np.array_equal(q[i], b[:, 2:].copy().view(np.int8).ravel()), i


def test_q8_K_quantizer_is_the_emulation_and_the_librarys_bit_for_bit(lib):
    """The kernel's ``block_q8_K`` of the adversarial rows (ties, subnormals, a scale ``-127/max`` that overflows, a
    negative maximum, both signs of the maximum) is :func:`reference.activation_quants.quantize_q8_K`'s and the built
    library's ``from_float`` (Q8_K), bit for bit: the float32 scale, the int8 values and the int16 sums of 16."""
    ggml = load_ggml()
    rows = adversarial_rows()
    got = qk.q8k_quantize(torch.from_numpy(rows))
    assert got is not None
    d, q, bsums = (t.numpy() for t in got)
    with np.errstate(all="ignore"):
        ed, eq, eb = rq.quantize_q8_K(rows.astype(np.float64))
    assert np.array_equal(d.view(np.uint32), ed.view(np.uint32))
    assert np.array_equal(q.reshape(eq.shape), eq) and np.array_equal(bsums, eb)
    for i, row in enumerate(rows):
        b = _from_float(ggml, "Q8_K", row).reshape(-1, 4 + 256 + 32)  # float d, int8 qs[256], int16 bsums[16]
        assert np.array_equal(d[i].view(np.uint32), b[:, :4].copy().view(np.uint32)[:, 0]), i
        assert np.array_equal(q[i].reshape(-1, 256), b[:, 4:260].copy().view(np.int8)), i
        assert np.array_equal(bsums[i], b[:, 260:].copy().view(np.int16)), i


F16_SCALES = np.array([2.0 ** -24, 6.1e-5, 1e-3, 0.0123, 0.5, 3.0, 1000.0, 65504.0], dtype=np.float16)
"""fp16 super-block scales of the random K-quant blocks: the smallest subnormal to the largest finite value."""


def _k_blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    """Random ``block_q2_K`` ... ``block_q6_K`` rows, uint8 ``[n, bytes_per_row]``: every bit of the quants (the high
    bits of Q3_K's hmask and Q5_K's qh included) and of the scales and mins (Q2_K's 4-bit pairs, Q3_K's packed 6-bit
    scales, Q4_K's and Q5_K's 6-bit scales and mins, Q6_K's int8 scales, -128 included) random; ``d`` (and ``dmin``) drawn from
    :data:`F16_SCALES` (mostly moderate, some extreme), with random signs."""
    nb = k // 256
    size = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
    raw = rng.integers(0, 256, (n, nb, size), dtype=np.uint8)
    picks = np.where(rng.uniform(size=(n, nb, 2)) < 0.7, 0.0123, rng.choice(F16_SCALES, (n, nb, 2)))
    scales = (picks * rng.choice([-1.0, 1.0], (n, nb, 2))).astype(np.float16).view(np.uint8).reshape(n, nb, 4)
    if qtype in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = scales  # d, dmin
    elif qtype == "Q2_K":
        raw[..., 80:84] = scales  # d, dmin
    else:
        raw[..., size - 2:size] = scales[..., :2]  # d (Q3_K, Q6_K)
    return raw.reshape(n, nb * size)


def _weights(qtype: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A packed ``[n, k]`` weight (gguf.quants; the K-quants :func:`_k_blocks`) and its exact dequantized values
    (float64)."""
    if qtype in K_TYPES:
        raw = _k_blocks(qtype, n, k, rng)
        return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64).reshape(n, k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[1::3] += 0.03
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)


SHAPES = [(7, 96, 1), (33, 160, 3), (65, 2080, 8), (5, 32, 13), (129, 288, 70), (1, 544, 2)]
"""(N rows of W, K, M rows of x): odd row counts, K a multiple of 32 but not of 64 or 256 (96, 160, 2080, 288), one
block (32), batches beyond one call's 64 rows (70)."""
K_SHAPES = [(7, 256, 1), (33, 512, 3), (65, 2816, 8), (5, 256, 13), (9, 512, 70), (1, 2816, 2)]
"""The same for the K-quants (K a multiple of 256: one super-block, two, eleven as Gemma 4 E2B's 2816)."""


@pytest.mark.parametrize("qtype", TYPES)
def test_products_are_the_emulation_within_fp32(lib, qtype):
    """Every output of the kernel against the emulation (the row rounded by
    :func:`reference.activation_quants.round_activations`, times the exact dequantized weight, float64) within the
    fp32 accumulation bound of its row (:func:`test_activation_quants.fp32_bound`), on :data:`SHAPES` and 3 seeds,
    activations of heavy tails and of varied scale, a zero row and a row of ties; every ISA path the same bits, on
    1 and 2 threads; and the unrounded product beyond the bound somewhere (the test sees the rounding)."""
    isas = _isas(lib)
    worst, plain_worst = {}, 0.0
    try:
        for seed in range(3):
            rng = np.random.default_rng(1000 * seed + GGML_TYPES[qtype])
            for n, k, m in K_SHAPES if qtype in K_TYPES else SHAPES:
                raw, deq = _weights(qtype, n, k, rng)
                x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, k)))
                     * 10.0 ** rng.uniform(-2, 2, (m, 1))).astype(np.float32)
                x[0, :32] = np.concatenate([[127.0], np.arange(31) * 0.5 - 7.5])  # exact .5 ties
                if m > 2:
                    x[1] = 0.0
                x_hat = rq.round_activations(x.astype(np.float64), qtype)
                emu = x_hat @ deq.T
                outs = []
                for isa in isas:
                    lib.g4h_q8_force_isa(isa)
                    outs += [_product(lib, qtype, raw, x, threads) for threads in (1, 2)]
                for o in outs[1:]:
                    assert np.array_equal(o, outs[0]), f"{qtype} {n}x{k} m={m}: the ISA paths or threads differ"
                y = outs[0].astype(np.float64)
                for i in range(m):
                    for j in range(n):
                        bound = fp32_bound(x_hat[i], deq[j], 256 if qtype in K_TYPES else 32)
                        gap = abs(y[i, j] - emu[i, j])
                        assert gap <= bound, f"{qtype} {n}x{k} m={m} seed {seed} [{i},{j}]: {gap:.3g} > {bound:.3g}"
                        worst[(n, k)] = max(worst.get((n, k), 0.0), gap)
                        if bound > 0:
                            plain_worst = max(plain_worst, abs(y[i, j] - x[i].astype(np.float64) @ deq[j]) / bound)
    finally:
        lib.g4h_q8_force_isa(512)
    assert plain_worst > 1.0, "the unrounded product is within the bound: the test cannot see the rounding"
    print(f"{qtype}: ISA paths {isas}; max |kernel - emulation| per (N, K): "
          + ", ".join(f"{n}x{k} {v:.3g}" for (n, k), v in worst.items()) + f"; unrounded / bound {plain_worst:.3g}")


def _ggml_weights(base, qtype: str, n: int, k: int, rng) -> np.ndarray:
    """``[n, k]`` weights quantized by the built library (``ggml_quantize_chunk``), uint8 ``[n, bytes_per_row]``; for
    the K-quants followed by as many random blocks of extreme scales (:func:`_k_blocks`)."""
    t = GGML_TYPES[qtype]
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    wq = np.zeros(base.ggml_row_size(t, k) * n, dtype=np.uint8)
    base.ggml_quantize_chunk(t, w.ctypes.data, wq.ctypes.data, 0, n, k, None)
    wq = wq.reshape(n, -1)
    return np.concatenate([wq, _k_blocks(qtype, n, k, rng)]) if qtype in K_TYPES else wq


def _ggml_rows(k: int, rng) -> np.ndarray:
    """Activation rows for the comparisons with the library: 6 adversarial rows and 3 of heavy tails, float32."""
    return np.concatenate([adversarial_rows(k, seed=3)[:6],
                           (rng.standard_normal((3, k)) * np.exp(rng.standard_normal((3, k)))).astype(np.float32)])


@pytest.mark.parametrize("qtype", TYPES)
def test_products_are_ggmls_vec_dot_within_fp32(lib, qtype):
    """Each output against the built library's own product: its ``vec_dot`` of the weight row (the library's
    quantization; for the K-quants also random blocks of extreme scales) with the activation row its ``from_float``
    (Q8_0, Q8_K) converted, within :func:`fp32_bound`; the kernel reads the same weight bytes. (The library's vec_dot
    is its AVX2 path here: another fp32 order than the kernel's.)"""
    base, cpu = load_ggml()
    t = GGML_TYPES[qtype]
    rng = np.random.default_rng(t + 77)
    k, vtype = (2816, "Q8_K") if qtype in K_TYPES else (2080, "Q8_0")
    wq = _ggml_weights(base, qtype, 9, k, rng)
    n = wq.shape[0]
    deq = gguf.quants.dequantize(wq, gguf.GGMLQuantizationType(t)).astype(np.float64).reshape(n, k)
    xs = _ggml_rows(k, rng)
    ours = _product(lib, qtype, wq, xs)
    vec_dot = VEC_DOT(cpu.ggml_get_type_traits_cpu(t).contents.vec_dot)
    worst = 0.0
    for i, x in enumerate(xs):
        xq = _from_float((base, cpu), vtype, x)
        x_hat = rq.round_activations(x.astype(np.float64), qtype)
        for j in range(n):
            s = np.zeros(1, dtype=np.float32)
            vec_dot(k, s.ctypes.data, 0, wq[j].ctypes.data, 0, xq.ctypes.data, 0, 1)
            bound = fp32_bound(x_hat, deq[j], 256 if qtype in K_TYPES else 32)
            gap = abs(float(s[0]) - float(ours[i, j]))
            assert gap <= bound, f"{qtype} row {i} out {j}: |ggml - kernel| {gap:.3g} > {bound:.3g}"
            worst = max(worst, gap / bound if bound else 0.0)
    print(f"{qtype}: worst |ggml vec_dot - kernel| / fp32 bound = {worst:.3g}")


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_products_are_ggmls_generic_bit_for_bit(lib, qtype):
    """The K-quant kernels compute ggml's generic (scalar) dot product in its order: every output, on every ISA path
    and on 1 and 2 threads, has the bits of the built library's own ``ggml_vec_dot_q4_K_q8_K_generic`` /
    ``..._q5_K_...`` / ``..._q6_K_...`` (compiled there with its fused multiply-adds) of the same weight row and the
    library's ``from_float`` (Q8_K) of the activation row; on the library's quantized weights and random blocks of
    extreme scales, K = 256, 512, 2816."""
    base, cpu = load_ggml()
    t = GGML_TYPES[qtype]
    generic = VEC_DOT(ctypes.cast(getattr(cpu, f"ggml_vec_dot_{qtype[:2].lower()}_K_q8_K_generic"),
                                  ctypes.c_void_p).value)
    rng = np.random.default_rng(t + 5)
    isas = _isas(lib)
    checked = 0
    try:
        for k in (256, 512, 2816):
            wq = _ggml_weights(base, qtype, 5, k, rng)
            xs = _ggml_rows(k, rng)
            theirs = np.zeros((xs.shape[0], wq.shape[0]), dtype=np.float32)
            for i, x in enumerate(xs):
                xq = _from_float((base, cpu), "Q8_K", x)
                for j in range(wq.shape[0]):
                    generic(k, theirs[i, j:].ctypes.data, 0, wq[j].ctypes.data, 0, xq.ctypes.data, 0, 1)
            for isa in isas:
                lib.g4h_q8_force_isa(isa)
                for threads in (1, 2):
                    ours = _product(lib, qtype, wq, xs, threads)
                    bad = np.argwhere(ours.view(np.uint32) != theirs.view(np.uint32))
                    assert bad.size == 0, (f"{qtype} K={k} ISA {isa}: {len(bad)} outputs differ from ggml's generic, "
                                           f"first {bad[0]}: {ours[tuple(bad[0])]!r} vs {theirs[tuple(bad[0])]!r}")
                    checked += ours.size
    finally:
        lib.g4h_q8_force_isa(512)
    print(f"{qtype}: {checked} outputs bit for bit ggml's generic vec_dot, ISA paths {isas}")


def test_q8_linear_routes_and_refuses():
    """:func:`fast.quant_kernels.q8_linear` takes float32 CPU rows of its types, the K-quants among them (any number
    of rows, cut in calls of 64), and returns None for another type (the engine then rounds in torch)."""
    if qk.q8_isa() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(5)
    raw, deq = _weights("Q8_0", 6, 64, rng)
    x = torch.from_numpy(rng.standard_normal((130, 64)).astype(np.float32))
    y = qk.q8_linear(x, torch.from_numpy(raw), "Q8_0", 64)
    emu = rq.round_activations(x.double().numpy(), "Q8_0") @ deq.T
    assert y is not None and y.shape == (130, 6)
    assert np.abs(y.double().numpy() - emu).max() < 1e-4
    assert torch.equal(qk.q8_linear(x[70:71], torch.from_numpy(raw), "Q8_0", 64), y[70:71])  # rows independent
    assert qk.q8_linear(x, torch.from_numpy(raw), "Q4_1", 64) is None
    for qtype in K_TYPES:
        raw, deq = _weights(qtype, 5, 512, rng)
        x = torch.from_numpy(rng.standard_normal((70, 512)).astype(np.float32))
        y = qk.q8_linear(x, torch.from_numpy(raw), qtype, 512)
        assert y is not None and y.shape == (70, 5), qtype
        emu = rq.round_activations(x.double().numpy(), qtype) @ deq.T
        assert np.allclose(y.double().numpy(), emu, rtol=1e-4, atol=1e-3 * np.abs(emu).max()), qtype
        assert torch.equal(qk.q8_linear(x[66:67], torch.from_numpy(raw), qtype, 512), y[66:67]), qtype


# --------------------------------------------------------------------------- the engine and its pair


def test_engine_declares_llamacpps_rounding_only_under_q8():
    """``compute="q8"`` declares ``quantized_activations`` with llama.cpp's tables (the emulated gates judge it); the
    default declares nothing (the fp32 gates); an unknown mode or a 16-bit dtype with q8 is refused in one line."""
    from gemma4_harness.harness.engines.fast import FastEngine
    from gemma4_harness.harness.engines.numerics import engine_numerics
    from gemma4_harness.harness.synth import ensure_built
    from gemma4_harness.reference.errors import InputError

    path = ensure_built(ROOT / "tests" / "shapes" / "odd-h72-v300.toml").gguf["F32"]
    q8 = FastEngine(path, device="cpu", compute="q8")
    n = engine_numerics(q8, "fast")
    assert "quantized_activations" in n.approximations and n.vec_dot_types == "llama.cpp"
    assert "quantized_activations" in n.emulation()
    assert engine_numerics(FastEngine(path, device="cpu"), "fast").approximations == ()
    with pytest.raises(InputError, match="--compute"):
        FastEngine(path, device="cpu", compute="q4")
    with pytest.raises(InputError, match="--compute q8"):
        FastEngine(path, device="cpu", dtype="bfloat16", compute="q8")


K_VARIANT = ("odd-h72-v300.toml", {"hidden_size": 256, "intermediate_size": 512})
"""The K-quant files of the pair test (:data:`K_MIXES`): odd-h72-v300 widened to rows of 256, quantized from its F32
file by the cached llama-quantize as a user makes one: K-quant matrices (the MLPs, attn_q/k/v, the tied embedding),
the attention outputs (rows of 72 / 144) in its fallback F16."""
K_MIXES = {"h256-q4_k_m": ("Q4_K_M", {"Q4_K", "Q6_K"}), "h256-q5_k_m": ("Q5_K_M", {"Q5_K", "Q6_K"}),
           "h256-q3_k_m": ("Q3_K_M", {"Q3_K", "Q4_K", "Q5_K", "Q6_K"}),
           "h256-q2_k": ("Q2_K", {"Q2_K", "Q3_K", "Q6_K"})}
"""The K-quant variants of the pair test: llama-quantize's file type, and the types whose products take the C
kernel (every quantized matrix of the file)."""


def _q8_file(variant: str, tmp_path: Path) -> Path:
    """The quantized GGUF of a pair test: test_local_gate's variants, or one of :data:`K_MIXES` (:data:`K_VARIANT`)."""
    from test_local_gate import _built

    if variant not in K_MIXES:
        return _built(variant, tmp_path)[1]
    import re

    from gemma4_harness.harness.engines.llamacpp.tools import quantize
    from gemma4_harness.harness.synth import ensure_built
    from test_local_gate import SHAPES as LSHAPES

    base, changes = K_VARIANT
    text = re.sub(r"^qtypes = .*$", 'qtypes = ["F32"]', (LSHAPES / base).read_text(), count=1, flags=re.M)
    for key, value in changes.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
    spec = tmp_path / "q8-h256.toml"
    spec.write_text(text)
    return quantize(ensure_built(spec).gguf["F32"], tmp_path / f"{variant}.gguf", K_MIXES[variant][0], threads=1)


@pytest.mark.parametrize("variant", ["h96-q8_0", "h128-ple-q4_0", *K_MIXES])
def test_fast_q8_pair_passes_correct_and_names_the_faulty_layer(variant, tmp_path, monkeypatch):
    """The fast engine under ``--compute q8`` on a small Q8_0 / Q4_0 / Q4_K_M / Q5_K_M / Q3_K_M / Q2_K file (with
    F16 matrices beside) passes the emulated pair's gates, ``local_median`` far below its floor, every product of a
    :data:`TYPES` weight through the C kernel (none rounded in torch; the K-quant files' Q2_K to Q6_K, as
    :data:`K_MIXES` lists, among them); on a copy whose
    ``blk.1.ffn_down`` has the first half of its rows x1.02 it fails ``local_median``, naming ``ffn_out@1``. And
    the gate sees the arithmetic: the same declaration over products that do not round their input (the exact fp32
    path) fails on the correct file."""
    from quant_faults import make_fault
    from quant_pairs import judge, prompts_for

    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    import gemma4_harness.fast.q8_compute as q8c

    path = _q8_file(variant, tmp_path)
    runs = ReferenceRuns(ReferenceEngine(path))
    prompts = prompts_for(path, runs.ref.cfg)[:4]
    gate = "reference~fast_q8.local_median"
    q8 = {"compute": "q8"}
    in_c, in_torch = set(), set()
    kernel, emulated = qk.q8_linear, q8c._rounded_product

    def counted_kernel(x, raw, qtype, row_len):
        y = kernel(x, raw, qtype, row_len)
        if y is not None:
            in_c.add(qtype)
        return y

    def counted_emulation(x, w, typ, mins):
        in_torch.add(typ)
        return emulated(x, w, typ, mins)

    monkeypatch.setattr(qk, "q8_linear", counted_kernel)
    monkeypatch.setattr(q8c, "_rounded_product", counted_emulation)
    good = judge(runs, path, prompts, n_tokens=2, engine="fast", options=q8)
    monkeypatch.setattr(qk, "q8_linear", kernel)
    monkeypatch.setattr(q8c, "_rounded_product", emulated)
    assert good["passed"], {g: v["worst"] for g, v in good["gates"].items() if v["fail"]}
    if qk.q8_isa() is not None:
        assert not in_torch & set(TYPES), f"rounded in torch: {sorted(in_torch & set(TYPES))}"
        assert in_c == (K_MIXES[variant][1] if variant in K_MIXES else {variant[-4:].upper()}), in_c
    local = good["gates"][gate]
    assert local["worst"] < local["limit"] / 10 and local["detail"]["first_divergence"] is None, local
    bad_file, _ = make_fault("rows", path, tmp_path / "rows.gguf", "blk.1.ffn_down.weight")
    bad = judge(runs, bad_file, prompts, n_tokens=2, engine="fast", options=q8)
    local = bad["gates"][gate]
    assert not bad["passed"] and local["fail"], local
    assert local["detail"]["first_divergence"] == "ffn_out@1", local
    monkeypatch.setattr(q8c, "linear", q8c._exact_linear)  # declared q8, computed exactly
    unrounded = judge(runs, path, prompts, n_tokens=2, engine="fast", options=q8)
    assert not unrounded["passed"] and unrounded["gates"][gate]["fail"], unrounded["gates"][gate]
    print(f"{variant}: correct local_median {good['gates'][gate]['worst']:.3g}, rows fault {local['worst']:.3g}, "
          f"unrounded {unrounded['gates'][gate]['worst']:.3g}; C kernel {sorted(in_c)}, torch {sorted(in_torch)}")


def test_g4h_parity_against_fast_q8_end_to_end(tmp_path):
    """``g4h parity --model Q8_0 --against fast --compute q8`` exits 0, its local gate in the report."""
    from gemma4_harness.harness.synth import ensure_built
    from test_local_gate import VARIANTS, SHAPES as LSHAPES
    import re

    base, changes, qtype = VARIANTS["h96-q8_0"]
    text = (LSHAPES / base).read_text()
    text = re.sub(r"^qtypes = .*$", f'qtypes = ["F32", "{qtype}"]', text, count=1, flags=re.M)
    for key, value in changes.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
    spec = tmp_path / "q8-e2e.toml"
    spec.write_text(text)
    path = ensure_built(spec).gguf[qtype]
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "parity", "--model", str(path),
                           "--against", "fast", "--compute", "q8", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reference~fast_q8.local_median" in proc.stdout


def test_rms_norm_is_llamacpps_float32_steps_bit_for_bit():
    """:func:`fast.q8_compute.rms_norm` gives :func:`harness.engines.llamacpp.numerics.rms_norm_fp32`'s bits (the
    emulating reference's, llama.cpp's steps) on rows of full-mantissa float32 values and on quantized-embedding-like
    rows of small integers times one scale: the float32 squares summed in double (squared in double instead, the
    first layer of Gemma 3 270M Q4_K_M moved off llama.cpp's ties)."""
    from gemma4_harness.fast import q8_compute
    from gemma4_harness.harness.engines.llamacpp.numerics import rms_norm_fp32

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((400, 640)) * np.exp(rng.standard_normal((400, 1)))).astype(np.float32)
    x[200:] = (rng.integers(-127, 128, (200, 640)) * np.float32(0.0137)).astype(np.float32)
    w = (1.0 + rng.standard_normal(640) * 0.1).astype(np.float32)
    ours = q8_compute.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-6).double().numpy()
    assert np.array_equal(ours, rms_norm_fp32(x.astype(np.float64), w.astype(np.float64), 1e-6))
    ours = q8_compute.rms_norm(torch.from_numpy(x), None, 1e-6).double().numpy()
    assert np.array_equal(ours, rms_norm_fp32(x.astype(np.float64), None, 1e-6))
