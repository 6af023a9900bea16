"""llama.cpp's quantized activations (reference/activation_quants.py, its torch twin fast/activation_quants.py)
against the built llama.cpp itself, through ctypes on the ggml libraries the harness builds (the ones
llama-cpp-python loads):

* the weight type -> dot-product type table, every row, against ``ggml_get_type_traits_cpu(t)->vec_dot_type``;
* each activation quantizer (Q8_0, Q8_1, Q8_K, F16, BF16) bit for bit against the CPU backend's own ``from_float``
  (what ``ggml_compute_forward_mul_mat`` runs) on adversarial rows: zeros, exact .5 ties, huge and tiny values,
  subnormals, one outlier per block, a negative maximum, both signs of the maximum; and the scalar reference
  (``ggml_quantize_chunk``: ``quantize_row_q8_0_ref``, ``roundf``) shown to differ from it on ties;
* one dot product per weight type (the library's ``vec_dot`` on the library's own quantized row and the library's
  converted activation) against the float64 product of our rounded activation with the exact dequantized weight
  (for Q4_1 / Q5_1 plus the weights' minima times the fp16 rounding of the Q8_1 block sums), within the fp32
  accumulation bound :func:`fp32_bound` derives; and Q4_1 / Q5_1 matrix products of varied shapes on adversarial
  rows, which the row rounding alone misses.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import gemma4_harness.fast.activation_quants as fq
import gemma4_harness.reference.activation_quants as rq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggml_lib import load_ggml  # noqa: E402

GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9, "Q2_K": 10,
              "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18,
              "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29, "BF16": 30,
              "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39, "NVFP4": 40, "Q1_0": 41, "Q2_0": 42}
"""``enum ggml_type`` of ``ggml/include/ggml.h`` (llama-cpp-python 0.3.36's llama.cpp)."""

FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@pytest.fixture(scope="module")
def ggml():
    return load_ggml()


def _from_float(ggml, vtype: str, x: np.ndarray) -> np.ndarray:
    """The CPU backend's ``from_float`` of ``vtype`` on the float32 row ``x``: the bytes it writes."""
    base, cpu = ggml
    fn = FROM_FLOAT(cpu.ggml_get_type_traits_cpu(GGML_TYPES[vtype]).contents.from_float)
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(base.ggml_row_size(GGML_TYPES[vtype], x.size), dtype=np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def adversarial_rows(n: int = 512, seed: int = 0) -> np.ndarray:
    """Rows of ``n`` float32 values that stress the rounding: random of every scale, zeros, exact .5 ties after
    scaling (a block whose maximum is 127 holds k + 0.5), huge and tiny magnitudes, subnormals, one outlier per
    block, a negative maximum, both signs of the maximum (the negative first), a NaN-free extreme near fp16's
    overflow. [rows, n] float32."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3) for _ in range(6)]
    rows.append(np.zeros(n))
    ties = np.tile(np.concatenate([[127.0], np.arange(31) * 0.5 - 7.5]), n // 32)  # amax 127: x * 127/127 = x
    rows += [ties, -ties, ties * 2.0 ** -20]
    rows.append(rng.standard_normal(n) * 1e30)
    rows.append(rng.standard_normal(n) * 1e-30)
    rows.append(np.full(n, 1e-45) * rng.integers(-3, 4, n))  # subnormals (multiples of the smallest)
    rows.append(rng.standard_normal(n) * 1e-39)  # subnormal scale: 127/amax overflows to inf
    out = rng.standard_normal(n)
    out[::32] = 1000.0  # one outlier per block of 32
    rows.append(out)
    neg = rng.uniform(0, 1, n)
    neg[::256] = -5.0  # the largest magnitude negative: Q8_K's d > 0
    rows.append(neg)
    both = rng.uniform(-1, 1, n)
    both[3::256], both[7::256] = -2.0, 2.0  # +amax and -amax in one block, the negative first
    rows.append(both)
    big = rng.uniform(-1, 1, n) * 60000.0  # near fp16's largest finite value
    rows.append(big)
    x = np.stack(rows).astype(np.float32)
    return x


# --------------------------------------------------------------------------- the table


def test_vec_dot_table_is_the_librarys(ggml):
    """Every weight type's dot-product type, as the built library's ``type_traits_cpu`` says."""
    _, cpu = ggml
    names = {v: k for k, v in GGML_TYPES.items()}
    for name, t in GGML_TYPES.items():
        tr = cpu.ggml_get_type_traits_cpu(t).contents
        if name in ("Q8_K",):  # an activation type only: no vec_dot_type
            assert name not in rq.VEC_DOT_TYPE
            continue
        assert rq.VEC_DOT_TYPE.get(name) == names[tr.vec_dot_type], name


# --------------------------------------------------------------------------- the quantizers, bit for bit


def _fields_q8_0(raw: np.ndarray, nb: int):
    b = raw.reshape(nb, 34)
    return b[:, :2].copy().view(np.float16)[:, 0], b[:, 2:].copy().view(np.int8)


def test_q8_0_bit_for_bit(ggml):
    for row in adversarial_rows():
        d, qs = rq.quantize_q8_0(row.astype(np.float64))
        theirs_d, theirs_qs = _fields_q8_0(_from_float(ggml, "Q8_0", row), row.size // 32)
        assert np.array_equal(d.view(np.uint16), theirs_d.view(np.uint16))
        assert np.array_equal(qs, theirs_qs)


def test_q8_1_bit_for_bit(ggml):
    for row in adversarial_rows():
        d, s, qs = rq.quantize_q8_1(row.astype(np.float64))
        b = _from_float(ggml, "Q8_1", row).reshape(-1, 36)
        assert np.array_equal(d.view(np.uint16), b[:, 0:2].copy().view(np.uint16)[:, 0])
        assert np.array_equal(s.view(np.uint16), b[:, 2:4].copy().view(np.uint16)[:, 0])
        assert np.array_equal(qs, b[:, 4:].copy().view(np.int8))


def test_q8_K_bit_for_bit(ggml):
    for row in adversarial_rows():
        d, qs, bsums = rq.quantize_q8_K(row.astype(np.float64))
        b = _from_float(ggml, "Q8_K", row).reshape(-1, 4 + 256 + 32)  # float d, int8 qs[256], int16 bsums[16]
        assert np.array_equal(d.view(np.uint32), b[:, 0:4].copy().view(np.uint32)[:, 0])
        assert np.array_equal(qs, b[:, 4:260].copy().view(np.int8))
        assert np.array_equal(bsums, b[:, 260:].copy().view(np.int16))


@pytest.mark.parametrize("vtype", ["F16", "BF16"])
def test_16_bit_bit_for_bit(ggml, vtype):
    for row in adversarial_rows():
        ours = getattr(rq, vtype.lower())(row.astype(np.float64))
        theirs = _from_float(ggml, vtype, row).view(np.uint16)
        as_float = theirs.view(np.float16).astype(np.float64) if vtype == "F16" else \
            (theirs.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        assert np.array_equal(ours, as_float, equal_nan=True), vtype


def test_round_trips_are_the_fields_and_fast_agrees():
    """The round trips are ``d * q`` of the fields (exactly), and the torch twin gives the same values bit for bit."""
    for row in adversarial_rows():
        x = row.astype(np.float64)
        d, qs = rq.quantize_q8_0(x)
        with np.errstate(all="ignore"):
            assert np.array_equal(rq.q8_0(x), (qs * d.astype(np.float64)[:, None]).ravel(), equal_nan=True)
        for name in ("q8_0", "q8_1", "q8_K", "f16", "bf16"):
            with np.errstate(all="ignore"):
                ours = getattr(rq, name)(x)
            twin = getattr(fq, name)(torch.from_numpy(x)).numpy()
            assert np.array_equal(ours, twin, equal_nan=True), name


def test_scalar_reference_rounds_ties_away_the_simd_path_to_even(ggml):
    """What the CPU backend runs (AVX: ``_mm256_round_ps``, nearest even) is not the scalar reference
    ``quantize_row_q8_0_ref`` that ``ggml_quantize_chunk`` runs (``roundf``: half away from zero): on a block whose
    maximum is 127, x = 2.5 is 2 in the first and 3 in the second. The emulation follows the first."""
    base, _ = ggml
    row = adversarial_rows()[7]  # the ties row
    simd = _fields_q8_0(_from_float(ggml, "Q8_0", row), row.size // 32)[1]
    out = np.zeros(base.ggml_row_size(GGML_TYPES["Q8_0"], row.size), dtype=np.uint8)
    base.ggml_quantize_chunk(GGML_TYPES["Q8_0"], row.ctypes.data, out.ctypes.data, 0, 1, row.size, None)
    scalar = _fields_q8_0(out, row.size // 32)[1]
    ours = rq.quantize_q8_0(row.astype(np.float64))[1]
    assert np.array_equal(ours, simd)
    i = int(np.nonzero(row == 2.5)[0][0])
    assert (simd.ravel()[i], scalar.ravel()[i]) == (2, 3)


# --------------------------------------------------------------------------- one product per weight type

PRODUCT_TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                 "IQ4_NL", "IQ4_XS"]

U = 2.0 ** -24
"""fp32's unit roundoff."""


def fp32_bound(x_hat: np.ndarray, w: np.ndarray, block: int) -> float:
    """How far llama.cpp's fp32 dot product may lie from the float64 one of the same rounded activation ``x_hat``
    and dequantized weight row ``w``, both [n].

    Derivation: per block (32 or 256 values, or 16 in the K-quants' sub-blocks) the integer sums are exact; each
    block's term is the sum times scales, formed in at most 3 fp32 roundings (the two scales' product, the min's
    product with the block sum of Q8_1/Q8_K, the conversion); the terms of the ``K = n/16`` sub-blocks at most are
    added in fp32 (at most ``K`` roundings each, first order). A K-quant term subtracts a min part from a scale part,
    each bounded by the block's ``max|w|`` times ``sum|x_hat|`` (the weight ``d*sc*q - dmin*m`` lies between
    them), and gguf.quants' float32 dequantized weight differs from the exact block value by up to 3 roundings of
    the same parts. So ``|err| <= (K + 6) * u * 2 * sum_blocks(max|w_b| * sum_b|x_hat|)``, u = 2^-24. The 16-bit
    types: fp32 products and sums, ``(n + 2) * u * sum|x_hat * w|``."""
    if block == 1:
        return (x_hat.size + 2) * U * float(np.sum(np.abs(x_hat * w)))
    k = x_hat.size // 16
    xb, wb = np.abs(x_hat).reshape(-1, block), np.abs(w).reshape(-1, block)
    return (k + 6) * U * 2.0 * float(np.sum(wb.max(axis=1) * xb.sum(axis=1)))


def _quantize_weight(ggml, wtype: str, w: np.ndarray) -> np.ndarray:
    """One weight row in ``wtype`` as llama.cpp's quantizer writes it (``ggml_quantize_chunk``)."""
    base, _ = ggml
    w = np.ascontiguousarray(w, dtype=np.float32)
    out = np.zeros(base.ggml_row_size(GGML_TYPES[wtype], w.size), dtype=np.uint8)
    base.ggml_quantize_chunk(GGML_TYPES[wtype], w.ctypes.data, out.ctypes.data, 0, 1, w.size, None)
    return out


@pytest.mark.parametrize("wtype", PRODUCT_TYPES)
def test_one_product_per_weight_type(ggml, wtype):
    """The library's ``vec_dot`` of a weight row (quantized by the library) with an activation row (converted by
    the library's ``from_float`` of the dot-product type) against our float64 product of the rounded activation
    (:func:`reference.activation_quants.round_activations`) with the exact dequantized weight (gguf.quants, as the
    reference reads a GGUF), within :func:`fp32_bound`; and the rounding matters: without it, the gap is larger
    than the bound (the 8-bit types)."""
    _, cpu = ggml
    n = 1024
    rng = np.random.default_rng(GGML_TYPES[wtype])
    vtype = rq.VEC_DOT_TYPE[wtype]
    block = {"Q8_0": 32, "Q8_1": 32, "Q8_K": 256}.get(vtype, 1)
    worst = 0.0
    for seed in range(8):
        x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)  # heavy-ish tails
        w = (rng.standard_normal(n) * 0.05).astype(np.float32)
        wq = _quantize_weight(ggml, wtype, w)
        w_deq = gguf.quants.dequantize(wq, gguf.GGMLQuantizationType(GGML_TYPES[wtype])).astype(np.float64).ravel()
        xq = _from_float(ggml, vtype, x)
        tr = cpu.ggml_get_type_traits_cpu(GGML_TYPES[wtype]).contents
        s = np.zeros(1, dtype=np.float32)
        VEC_DOT(tr.vec_dot)(n, s.ctypes.data, 0, wq.ctypes.data, 0, xq.ctypes.data, 0, 1)
        x_hat = rq.round_activations(x.astype(np.float64), wtype)
        ours = float(x_hat @ w_deq)
        if vtype == "Q8_1":  # the weights' minima times the fp16 block sums (test_q8_1_products_are_exact_...)
            ours += float(rq.q8_1_sum_correction(x.astype(np.float64), rq.block_minima(wq[None], wtype))[0])
        bound = fp32_bound(x_hat, w_deq, block)
        gap = abs(float(s[0]) - ours)
        assert gap <= bound, f"{wtype} seed {seed}: |ggml - ours| = {gap:.3g} > bound {bound:.3g}"
        worst = max(worst, gap / bound)
        if block > 1 and seed == 0:
            plain = abs(float(s[0]) - float(x.astype(np.float64) @ w_deq))
            assert plain > bound, f"{wtype}: the unrounded product is already within the bound ({plain:.3g})"
    print(f"{wtype}: worst |ggml - ours| / bound = {worst:.3g}")


# --------------------------------------------------------------------------- Q4_1 / Q5_1: the Q8_1 block sums


def _q8_1_rows(n: int, seed: int) -> np.ndarray:
    """Activation rows of ``n`` values for the Q8_1 products: the adversarial rows whose blocks' ``d`` and ``s`` are
    finite (a block scale or block sum beyond fp16's range gives a non-finite product on both sides: tested apart),
    random rows of heavy tails, and rows of one sign (the block sums are large, so their fp16 rounding in
    ``block_q8_1.s`` is too). [rows, n]."""
    rng = np.random.default_rng(seed)
    adv = adversarial_rows(n, seed)
    with np.errstate(all="ignore"):
        d, s, _ = rq.quantize_q8_1(adv.astype(np.float64))
    finite = np.isfinite(d.astype(np.float64)).all(axis=1) & np.isfinite(s.astype(np.float64)).all(axis=1)
    rand = (rng.standard_normal((4, n)) * np.exp(rng.standard_normal((4, n)))).astype(np.float32)
    pos = rng.uniform(0.5, 1.5, (4, n)).astype(np.float32) * np.array([[1.0], [-1.0], [300.0], [1e-3]], np.float32)
    return np.concatenate([adv[finite], rand, pos])


def _q8_1_weights(n: int, out: int, seed: int) -> np.ndarray:
    """Weight rows: small random, and offset ones (the block minimum ``m`` far from 0, so ``m * s`` matters),
    one row constant per block (``d = 0``). float32 [out, n]."""
    rng = np.random.default_rng(seed + 1)
    w = rng.standard_normal((out, n)) * 0.05
    w[1::3] += 0.2
    w[2::3] -= 0.3
    w[-1] = np.repeat(rng.standard_normal(n // 32), 32) * 0.1
    return w.astype(np.float32)


@pytest.mark.parametrize("wtype", ["Q4_1", "Q5_1"])
@pytest.mark.parametrize("n, out", [(32, 4), (96, 7), (1024, 9), (2816, 5)])
def test_q8_1_products_are_exact_with_the_block_sums(ggml, wtype, n, out):
    """A Q4_1 / Q5_1 matrix product, each output the library's ``vec_dot`` of a weight row (the library's
    quantization) with the library's Q8_1 row, against the reference's: the rounded row times the exactly
    dequantized weight plus :func:`reference.activation_quants.q8_1_sum_correction` (the block minima read from the
    stored bytes, :func:`reference.activation_quants.block_minima`), within :func:`fp32_bound` on every output,
    on adversarial and one-signed rows and shapes of 1 to 88 blocks. Without the correction (the old emulation) the
    one-signed rows lie beyond the bound: the test fails on the old path."""
    base, cpu = ggml
    t = GGML_TYPES[wtype]
    xs = _q8_1_rows(n, seed=n)
    w = _q8_1_weights(n, out, seed=n)
    wq = np.zeros(base.ggml_row_size(t, n) * out, dtype=np.uint8)
    base.ggml_quantize_chunk(t, w.ctypes.data, wq.ctypes.data, 0, out, n, None)
    wq = wq.reshape(out, -1)
    w_deq = gguf.quants.dequantize(wq, gguf.GGMLQuantizationType(t)).astype(np.float64).reshape(out, n)
    mins = rq.block_minima(wq, wtype)
    assert mins.shape == (out, n // 32)
    vec_dot = VEC_DOT(cpu.ggml_get_type_traits_cpu(t).contents.vec_dot)
    theirs = np.zeros((len(xs), out))
    for i, x in enumerate(xs):
        xq = _from_float(ggml, "Q8_1", x)
        for o in range(out):
            s = np.zeros(1, dtype=np.float32)
            vec_dot(n, s.ctypes.data, 0, np.ascontiguousarray(wq[o]).ctypes.data, 0, xq.ctypes.data, 0, 1)
            theirs[i, o] = s[0]
    x64 = xs.astype(np.float64)
    x_hat = rq.round_activations(x64, wtype)
    old = x_hat @ w_deq.T
    ours = old + rq.q8_1_sum_correction(x64, mins)
    bound = np.array([[fp32_bound(x_hat[i], w_deq[o], 32) for o in range(out)] for i in range(len(xs))])
    gap, gap_old = np.abs(theirs - ours), np.abs(theirs - old)
    floor = np.maximum(bound, 1e-300)  # a row of zeros: bound and gaps 0
    ratio, ratio_old = np.max(gap / floor), np.max(gap_old / floor)
    assert np.all(gap <= bound), f"{wtype} n={n}: worst |ggml - ours| / bound = {ratio:.3g}"
    assert np.any(gap_old > bound), f"{wtype} n={n}: the old path is within the bound everywhere"
    print(f"{wtype} n={n}: max |ggml - ours| = {gap.max():.3g} (worst / bound {ratio:.3g}); old path: max "
          f"{gap_old.max():.3g} (worst / bound {ratio_old:.3g})")


@pytest.mark.parametrize("what", ["scale", "sum"])
def test_q8_1_product_of_an_overflowing_block_is_not_finite_on_both_sides(ggml, what):
    """A block whose maximum is beyond fp16's range times 127 (``d`` infinite), or whose values are all large and
    of one sign (``d`` finite, ``s = fp16(d * sum(q))`` beyond 65504: from a block maximum of about 2000 up):
    llama.cpp's Q4_1 product is not finite (``m * s``), and neither is the reference's (the emulation does not invent
    a finite value where the engine has none)."""
    base, cpu = ggml
    n, t = 64, GGML_TYPES["Q4_1"]
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(n) * 1e30 if what == "scale" else rng.uniform(2500.0, 3000.0, n)).astype(np.float32)
    with np.errstate(all="ignore"):
        d, s_x, _ = rq.quantize_q8_1(x.astype(np.float64))
    assert np.isinf(d.astype(np.float64)).any() if what == "scale" else \
        (np.isfinite(d.astype(np.float64)).all() and np.isinf(s_x.astype(np.float64)).any())
    w = _q8_1_weights(n, 3, seed=5)[1]
    wq = np.zeros(base.ggml_row_size(t, n), dtype=np.uint8)
    base.ggml_quantize_chunk(t, w.ctypes.data, wq.ctypes.data, 0, 1, n, None)
    s = np.zeros(1, dtype=np.float32)
    VEC_DOT(cpu.ggml_get_type_traits_cpu(t).contents.vec_dot)(n, s.ctypes.data, 0, wq.ctypes.data, 0,
                                                             _from_float(ggml, "Q8_1", x).ctypes.data, 0, 1)
    w_deq = gguf.quants.dequantize(wq, gguf.GGMLQuantizationType(t)).astype(np.float64).ravel()
    with np.errstate(all="ignore"):
        plain = rq.round_activations(x.astype(np.float64), "Q4_1") @ w_deq
        ours = plain + rq.q8_1_sum_correction(x.astype(np.float64), rq.block_minima(wq[None], "Q4_1"))[0]
    assert not np.isfinite(s[0]) and not np.isfinite(ours)
    if what == "sum":
        assert np.isfinite(plain)  # the old emulation gave a finite value where llama.cpp has none


def test_q8_1_sum_gap_fast_twin_agrees():
    """The torch twin's block-sum gap is the reference's bit for bit (adversarial rows, non-finite ones included),
    and its correction the reference's to float64 rounding."""
    rng = np.random.default_rng(7)
    for n in (32, 96, 512):
        x = adversarial_rows(n, seed=n).astype(np.float64)
        with np.errstate(all="ignore"):
            ours = rq.q8_1_sum_gap(x)
            twin = fq.q8_1_sum_gap(torch.from_numpy(x)).numpy()
        assert np.array_equal(ours, twin, equal_nan=True), n
        mins = rng.standard_normal((5, n // 32))
        fin = np.isfinite(ours).all(axis=1)
        a = rq.q8_1_sum_correction(x[fin], mins)
        b = fq.q8_1_sum_correction(torch.from_numpy(x[fin]), torch.from_numpy(mins)).numpy()
        assert np.allclose(a, b, rtol=1e-12, atol=0.0)
