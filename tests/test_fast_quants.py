"""fast.quants: torch dequantization of GGUF tensors, bit-exact against gguf-py.

The bar is bit-exact equality (``torch.equal`` in float32) with
``gguf.quants.dequantize``:

* on blocks that ``gguf.quants.quantize`` makes (F16, BF16, Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1) from data with edge values, and from hypothesis-drawn data;
* on random bytes for every supported type, with the fp16 scale fields
  overwritten by finite values (this is what covers the K-quants, which gguf
  cannot quantize); and on fully random bytes, where NaN positions must agree
  and every non-NaN value must be bit-identical (NaN payloads are not compared:
  torch's F16C conversion quiets signalling NaNs, NumPy's does not);
* on every tensor of the real Gemma 3 270M GGUF (slow).

Each runs on the CPU and, when one is present, on CUDA.
"""

from __future__ import annotations

import math
import zlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import gemma4_harness.fast.quants as fq
from gemma4_harness.fast import quant_kernels
from gemma4_harness.fast.quant_blocks import SUPPORTED, block_layout
from gemma4_harness.fast.quants import QuantizedTensor, dequantize, linear

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# More rows of x than one call of the packed CPU kernels takes: with the kernels off (quant_kernels.disabled(), as
# on a machine without a compiler), linear() takes its chunked dequantize-then-matmul path; with them on, it goes
# through them a block of rows at a time.
MANY_ROWS = quant_kernels.MAX_ROWS + 4

# Types gguf-py can quantize (F32 is a no-op there; tested with the byte cases).
QUANTIZABLE = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]

# Byte offsets of the fp16 scale fields inside one block (ggml-common.h block_* structs).
SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),        # d, qs[16]
    "Q4_1": (0, 2),      # d, m, qs[16]
    "Q5_0": (0,),        # d, qh[4], qs[16]
    "Q5_1": (0, 2),      # d, m, qh[4], qs[16]
    "Q8_0": (0,),        # d, qs[32]
    "Q2_K": (80, 82),    # scales[16], qs[64], d, dmin
    "Q3_K": (108,),      # hmask[32], qs[64], scales[12], d
    "Q4_K": (0, 2),      # d, dmin, scales[12], qs[128]
    "Q5_K": (0, 2),      # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (208,),      # ql[128], qh[64], scales[16], d
    "IQ4_NL": (0,),      # d, qs[16]
}
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": None}


def _sizes(name: str) -> tuple[int, int]:
    return GGML_QUANT_SIZES[T[name]]


def _ref(raw: np.ndarray, name: str) -> torch.Tensor:
    """gguf-py's dequantization of ``raw`` (uint8 [rows, bytes_per_row]) as a float32 torch tensor."""
    out = gguf.quants.dequantize(raw.copy(), T[name])
    assert out.dtype == np.float32
    return torch.from_numpy(np.ascontiguousarray(out))


def _ours(raw: np.ndarray, name: str, shape, device: str, **kw) -> torch.Tensor:
    return dequantize(torch.from_numpy(raw.copy()).to(device), name, shape, **kw).cpu()


def _assert_bit_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape
    if not torch.equal(got, ref):
        diff = got != ref
        i = int(diff.reshape(-1).nonzero()[0])
        raise AssertionError(f"{int(diff.sum())} of {ref.numel()} values differ; first at flat index {i}: "
                             f"got {got.reshape(-1)[i].item()!r}, gguf {ref.reshape(-1)[i].item()!r}")


def _random_bytes(name: str, rows: int, blocks_per_row: int, rng: np.random.Generator,
                  finite: bool = True) -> tuple[np.ndarray, tuple[int, int]]:
    """Random raw bytes for ``rows`` rows; with ``finite``, every scale field (and every float element) is finite."""
    bs, ts = _sizes(name)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * ts), dtype=np.uint8)
    shape = (rows, blocks_per_row * bs)
    if not finite:
        return raw, shape
    if name in FLOATS:
        width = 4 if name == "F32" else 2
        u = raw.view(np.uint32 if width == 4 else np.uint16)
        if name == "F32":
            bad = (u & 0x7F800000) == 0x7F800000
        elif name == "F16":
            bad = (u & 0x7C00) == 0x7C00
        else:  # BF16
            bad = (u & 0x7F80) == 0x7F80
        u[bad] &= ~np.array(1 << (30 if width == 4 else 14), dtype=u.dtype)  # clear the top exponent bit
        return raw, shape
    blocks = raw.reshape(rows, blocks_per_row, ts)
    n = rows * blocks_per_row
    for off in SCALE_OFFSETS[name]:
        # finite fp16 scales over many magnitudes, both signs, with zeros and subnormals mixed in
        mag = 10.0 ** rng.uniform(-9, 4.5, size=n)
        vals = (rng.choice([-1.0, 1.0], size=n) * mag).astype(np.float16)
        vals[rng.random(n) < 0.05] = 0
        vals[rng.random(n) < 0.05] = np.float16(6e-8)  # smallest fp16 subnormal
        vals[rng.random(n) < 0.02] = np.float16(65504)
        blocks[:, :, off:off + 2] = vals.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw, shape


def _edge_data(cols: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of edge values: zeros, tiny, huge, negative, all-equal, spikes, wide dynamic range."""
    rows = [
        np.zeros(cols),
        np.full(cols, 3.14159),
        np.full(cols, -2.5),
        np.full(cols, 1e-30),
        np.full(cols, 6.0e4),
        np.full(cols, -6.0e4),
        np.where(np.arange(cols) % 2 == 0, 6.0e4, -1e-5),
        np.where(np.arange(cols) % 7 == 0, -1.0, 0.0),
        np.linspace(-1, 1, cols),
        -np.abs(rng.standard_normal(cols)),
        rng.standard_normal(cols) * 1e-7,   # fp16-subnormal scales
        rng.standard_normal(cols) * 1e-40,  # float32 subnormals
        rng.standard_normal(cols) * 1e3,
        rng.standard_normal(cols) * 10.0 ** rng.uniform(-8, 4, size=cols),
        np.eye(1, cols, cols // 2).ravel() * 1e4,  # one spike
    ]
    rows += [rng.standard_normal(cols) * 10.0 ** rng.uniform(-6, 4) for _ in range(17)]
    return np.stack(rows).astype(np.float32)


# --------------------------------------------------------------------------- bit-exactness


def test_supported_set():
    assert SUPPORTED == frozenset(
        {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL"})
    for name in SUPPORTED:
        assert block_layout(name) == _sizes(name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", QUANTIZABLE)
def test_exact_on_gguf_quantized_edge_data(name, device):
    rng = np.random.default_rng(1)
    data = _edge_data(128, rng)
    with np.errstate(all="ignore"):  # gguf's quantizer computes 1/d, which overflows for tiny blocks
        q = gguf.quants.quantize(data, T[name])
    raw = np.ascontiguousarray(q).view(np.uint8)
    ref = _ref(raw, name)
    assert torch.isfinite(ref).all()
    _assert_bit_equal(_ours(raw, name, data.shape, device), ref)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(QUANTIZABLE),
    data=hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 3).map(lambda b: 32 * b)),
                    elements=st.floats(-6.0e4, 6.0e4, width=32, allow_subnormal=True)),
)
def test_exact_on_gguf_quantized_hypothesis(name, data):
    with np.errstate(all="ignore"):
        q = gguf.quants.quantize(data, T[name])
    raw = np.ascontiguousarray(q).view(np.uint8)
    _assert_bit_equal(_ours(raw, name, data.shape, "cpu"), _ref(raw, name))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_exact_on_random_bytes_with_finite_scales(name, device):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    raw, shape = _random_bytes(name, rows=13, blocks_per_row=5 if name in FLOATS else 3, rng=rng)
    ref = _ref(raw, name)
    assert torch.isfinite(ref).all()
    _assert_bit_equal(_ours(raw, name, shape, device), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_random_bytes_including_nan_and_inf_scales(name, device):
    """Fully random bytes: Inf/NaN scales. NaN positions agree; every other value is bit-identical."""
    rng = np.random.default_rng(7)
    bs, _ = _sizes(name)
    # enough blocks that random fp16 scales hit Inf/NaN (1 in 32 per field)
    raw, shape = _random_bytes(name, rows=64, blocks_per_row=8 if bs > 1 else 512, rng=rng, finite=False)
    with np.errstate(all="ignore"):
        ref = _ref(raw, name)
    got = _ours(raw, name, shape, device)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    keep = ~torch.isnan(ref)
    assert torch.equal(got[keep].view(torch.int32), ref[keep].view(torch.int32))


KVALUES_IQ4NL = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
"""ggml-common.h ``kvalues_iq4nl``, written out here (not imported) so that the test reads the format on its own."""


@pytest.mark.parametrize("device", DEVICES)
def test_iq4_nl_blocks_built_by_hand(device):
    """IQ4_NL blocks built by hand from ggml-common.h (``block_iq4_nl``: d f16, qs[16]; y[j] the low nibble of qs[j],
    y[j + 16] its high nibble, each an index into ``kvalues_iq4nl``; ggml-quants.c ``dequantize_row_iq4_nl``:
    ``d * kvalues_iq4nl[q]``): every level at both nibble positions, under scales 1, -0.5, 0.1, the smallest fp16
    subnormal, 0 and 65504. fast's decoder gives gguf.quants' values (the reference's dequantization,
    reference/weights.py) bit for bit, and both are the formula written out in float32."""
    ds = np.array([1.0, -0.5, 0.1, 6e-8, 0.0, 65504.0], dtype=np.float16)
    qs = np.array([j | (15 - j) << 4 for j in range(16)], dtype=np.uint8)
    raw = np.concatenate([np.concatenate([d.reshape(1).view(np.uint8), qs]) for d in ds]).reshape(2, 3 * 18)
    levels = np.array(KVALUES_IQ4NL + KVALUES_IQ4NL[::-1], dtype=np.float32)
    want = np.stack([np.float32(d) * levels for d in ds.astype(np.float32)]).reshape(2, 96)
    ref = _ref(raw, "IQ4_NL")
    assert np.array_equal(ref.numpy().view(np.uint32), want.view(np.uint32))
    _assert_bit_equal(_ours(raw, "IQ4_NL", (2, 96), device), ref)
    qt = QuantizedTensor(torch.from_numpy(raw.copy()).to(device), "IQ4_NL", (2, 96))
    _assert_bit_equal(qt.dequantize().cpu(), ref)


def test_an_iq4_nl_gguf_loads_in_fast_as_in_the_reference(tmp_path):
    """The e2b case's F32 file with its matrices in IQ4_NL (tests/quant_faults.py ``requantize``): the fast engine
    loads it (before, it refused the type), keeps the matrices packed, each decodes bit for bit to what the
    reference's loader (gguf.quants) gives, and the logits lie within the reference~fast gate of the reference's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quant_faults import requantize

    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.harness.core.gates import resolve
    from gemma4_harness.harness.engines.fast import FastEngine
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.reference.weights import load_gguf

    path = requantize(synth.ensure_built(MODELS_DIR / "e2b.toml").gguf["F32"], tmp_path / "e2b-IQ4_NL.gguf", "IQ4_NL")
    fast = FastEngine(str(path), device="cpu")
    _, W = load_gguf(path)
    packed = {n: t for n, t in fast.model.w.t.items() if isinstance(t, QuantizedTensor)}
    assert packed and all(t.qtype.name == "IQ4_NL" for t in packed.values())
    for name, t in packed.items():
        _assert_bit_equal(t.dequantize(), torch.from_numpy(np.asarray(W.raw(name), dtype=np.float32)))
    ids = [2, 17, 301, 5, 99, 410]
    gate = resolve({}, "e2b")["reference~fast.max_abs_logit"]
    diff = float(np.max(np.abs(fast.logits(ids) - ReferenceEngine(str(path)).logits(ids))))
    assert gate.check(diff), diff


@pytest.mark.parametrize("name", ["Q8_0", "Q5_1", "Q4_K", "Q6_K", "F16"])
def test_internal_chunking_matches_one_shot(name, monkeypatch):
    rng = np.random.default_rng(3)
    raw, shape = _random_bytes(name, rows=9, blocks_per_row=4 if _sizes(name)[0] > 1 else 300, rng=rng)
    whole = _ours(raw, name, shape, "cpu")
    monkeypatch.setattr(fq, "_CHUNK_ELEMS", 300)  # not a multiple of any block size
    _assert_bit_equal(_ours(raw, name, shape, "cpu"), whole)
    _assert_bit_equal(whole, _ref(raw, name))


# --------------------------------------------------------------------------- the real file


@pytest.fixture(scope="module")
def real_gguf():
    """The real file through the project's checked parser (``reference.gguf_check``: 0.2 s, where
    ``gguf.GGUFReader`` spends 9-12 s on the 262k-token vocabulary; tests/test_gguf_check.py holds the two equal
    on this file)."""
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf
    from gemma4_harness.reference.gguf_check import check_gguf

    return check_gguf(gemma3_270m_gguf())


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_exact_on_every_tensor_of_real_gemma3_270m(real_gguf, device):
    seen: dict[str, int] = {}
    for t in real_gguf.tensors.values():
        name, stored = t.type_name, real_gguf.view(t.name)
        qt = QuantizedTensor.from_numpy(stored, t.ggml_type, t.shape, device=device)
        assert qt.shape == t.shape
        got = qt.dequantize().cpu()
        ref = torch.from_numpy(np.array(gguf.quants.dequantize(stored, T(t.ggml_type)), copy=True))
        assert torch.isfinite(ref).all(), t.name
        try:
            _assert_bit_equal(got, ref.reshape(qt.shape))
        except AssertionError as e:
            raise AssertionError(f"{t.name} ({name}, shape {qt.shape}): {e}") from None
        seen[name] = seen.get(name, 0) + 1
        del got, ref, qt
    assert {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= set(seen), seen
    assert sum(seen.values()) == len(real_gguf.tensors)


# --------------------------------------------------------------------------- API behaviour


def test_type_spellings_and_dtypes():
    rng = np.random.default_rng(5)
    raw, shape = _random_bytes("Q4_K", rows=3, blocks_per_row=2, rng=rng)
    t = torch.from_numpy(raw)
    base = dequantize(t, "Q4_K", shape)
    for spelling in (T.Q4_K, "q4_k", int(T.Q4_K), np.int32(int(T.Q4_K))):
        assert torch.equal(dequantize(t, spelling, shape), base)
    assert torch.equal(dequantize(t, "Q4_K", shape, torch.bfloat16), base.to(torch.bfloat16))
    assert torch.equal(dequantize(t, "Q4_K", shape, torch.float16), base.to(torch.float16))
    f64 = dequantize(t, "Q4_K", shape, torch.float64)
    assert f64.dtype == torch.float64 and torch.equal(f64.float(), base)


def test_raw_layouts_flat_multi_dim_and_strided():
    rng = np.random.default_rng(6)
    raw, (rows, cols) = _random_bytes("Q6_K", rows=6, blocks_per_row=2, rng=rng)
    ref = _ref(raw, "Q6_K")
    t = torch.from_numpy(raw)
    assert torch.equal(dequantize(t.reshape(-1), "Q6_K", (rows, cols)), ref)
    shape3 = (2, 3, cols)
    assert torch.equal(dequantize(t.reshape(2, 3, -1), "Q6_K", shape3), ref.reshape(shape3))
    # a strided view: every other row of a larger buffer
    big = torch.zeros(rows * 2, raw.shape[1], dtype=torch.uint8)
    big[::2] = t
    assert torch.equal(dequantize(big[::2], "Q6_K", (rows, cols)), ref)
    # an odd byte offset for a float type
    f = np.arange(12, dtype=np.float32)
    buf = torch.zeros(1 + 48, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(f.view(np.uint8))
    assert torch.equal(dequantize(buf[1:], "F32", (3, 4)), torch.from_numpy(f).reshape(3, 4))


def test_f32_and_same_dtype_results_never_alias_raw():
    f = torch.arange(8, dtype=torch.float32)
    raw = f.view(torch.uint8)
    out = dequantize(raw, "F32", (8,))
    out += 1
    assert torch.equal(f, torch.arange(8, dtype=torch.float32))
    h = torch.arange(8, dtype=torch.float16)
    out16 = dequantize(h.view(torch.uint8), "F16", (8,), torch.float16)
    out16 += 1
    assert torch.equal(h, torch.arange(8, dtype=torch.float16))


def test_empty_tensor():
    out = dequantize(torch.zeros(0, dtype=torch.uint8), "Q4_K", (0, 256))
    assert out.shape == (0, 256) and out.dtype == torch.float32


@pytest.mark.parametrize("bad", ["IQ2_XXS", "TQ1_0", "MXFP4", "Q8_1", "bogus", T.IQ4_XS, 9999])
def test_unsupported_type_is_a_value_error_listing_supported(bad):
    with pytest.raises(ValueError, match=r"is not supported by fast dequantization \(supported: F32, F16, .*Q6_K"):
        dequantize(torch.zeros(64, dtype=torch.uint8), bad, (1, 32))
    with pytest.raises(ValueError, match="is not supported"):
        QuantizedTensor(torch.zeros(64, dtype=torch.uint8), bad, (1, 32))


def test_unsupported_type_is_also_a_model_file_error():
    from gemma4_harness.reference.errors import ModelFileError

    with pytest.raises(ModelFileError, match="IQ1_S"):
        dequantize(torch.zeros(64, dtype=torch.uint8), "IQ1_S", (1, 256))


def test_shape_and_byte_count_errors():
    with pytest.raises(ValueError, match="not a multiple of the Q4_0 block size 32"):
        dequantize(torch.zeros(18, dtype=torch.uint8), "Q4_0", (1, 31))
    with pytest.raises(ValueError, match=r"needs 36 bytes .* got 35"):
        dequantize(torch.zeros(35, dtype=torch.uint8), "Q4_0", (2, 32))
    with pytest.raises(ValueError, match="bytes per row"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), "Q4_0", (1, 64))
    with pytest.raises(ValueError, match="at least one dimension"):
        dequantize(torch.zeros(4, dtype=torch.uint8), "F32", ())
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(9, dtype=torch.int16), "Q4_0", (1, 32))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(np.zeros(18, dtype=np.uint8), "Q4_0", (1, 32))
    with pytest.raises(TypeError, match="floating"):
        dequantize(torch.zeros(18, dtype=torch.uint8), "Q4_0", (1, 32), dtype=torch.int32)
    with pytest.raises(TypeError, match="qtype"):
        dequantize(torch.zeros(18, dtype=torch.uint8), 1.5, (1, 32))


# --------------------------------------------------------------------------- QuantizedTensor and linear


def _qt(name: str, rows: int, blocks_per_row: int, seed: int = 0, device: str = "cpu") -> QuantizedTensor:
    rng = np.random.default_rng(seed)
    raw, shape = _random_bytes(name, rows, blocks_per_row, rng)
    if name in SCALE_OFFSETS:  # keep weights of moderate size so matmul tolerances mean something
        blocks = raw.reshape(rows, blocks_per_row, -1)
        for off in SCALE_OFFSETS[name]:
            vals = (rng.standard_normal(rows * blocks_per_row) * 1e-3).astype(np.float16)
            blocks[:, :, off:off + 2] = vals.view(np.uint8).reshape(rows, blocks_per_row, 2)
    elif name == "BF16":
        raw = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), T.BF16)
    else:  # F32, F16
        raw = rng.standard_normal(shape).astype(FLOATS[name]).view(np.uint8)
    return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(raw)).to(device), name, shape)


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_tensor_basics(device):
    qt = _qt("Q5_K", rows=10, blocks_per_row=2, device=device)
    assert qt.shape == (10, 512) and qt.n_rows == 10 and qt.row_len == 512
    assert qt.nbytes == 10 * 2 * 176 and qt.device.type == device and qt.qtype == T.Q5_K
    assert "Q5_K" in repr(qt)
    full = qt.dequantize()
    assert full.device.type == device
    _assert_bit_equal(full.cpu(), _ref(qt.raw.cpu().numpy(), "Q5_K"))
    assert torch.equal(qt.dequantize_rows(3, 7), full[3:7])
    assert qt.dequantize_rows(4, 4).shape == (0, 512)
    with pytest.raises(IndexError):
        qt.dequantize_rows(5, 11)
    ids = torch.tensor([[9, 0, 3], [3, -1, 2]])
    assert torch.equal(qt.take_rows(ids), full[ids % 10])
    with pytest.raises(IndexError):
        qt.take_rows(torch.tensor([10]))
    with pytest.raises(TypeError):
        qt.take_rows(torch.tensor([1.0]))
    assert qt.to("cpu").device.type == "cpu"
    assert qt.to(device) is qt


def test_quantized_tensor_select_3d():
    qt = _qt("Q8_0", rows=12, blocks_per_row=2)
    e = QuantizedTensor(qt.raw, "Q8_0", (3, 4, 64))
    full = e.dequantize()
    for i in (0, 2, -1):
        sub = e.select(i)
        assert sub.shape == (4, 64)
        assert torch.equal(sub.dequantize(), full[i])
    with pytest.raises(IndexError):
        e.select(3)
    with pytest.raises(ValueError):
        QuantizedTensor(torch.zeros(34, dtype=torch.uint8), "Q8_0", (32,)).select(0)


def test_quantized_tensor_from_numpy_and_from_gguf(tmp_path):
    rng = np.random.default_rng(11)
    data = rng.standard_normal((8, 64)).astype(np.float32)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    w.add_tensor("a", gguf.quants.quantize(data, T.Q5_0), raw_dtype=T.Q5_0)
    w.add_tensor("b", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(path))
    for t in r.tensors:
        qt = QuantizedTensor.from_gguf(t)
        assert qt.shape == (8, 64)
        ref = np.array(gguf.quants.dequantize(t.data, t.tensor_type), copy=True)
        _assert_bit_equal(qt.dequantize(), torch.from_numpy(ref))
    qt = QuantizedTensor.from_numpy(data, "F32", data.shape)
    assert torch.equal(qt.dequantize(), torch.from_numpy(data))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "Q3_K", "IQ4_NL", "F16", "BF16", "F32"])
@pytest.mark.parametrize("chunk_rows", [None, 1, 7, 1000])
def test_linear_matches_dense(name, chunk_rows, device):
    qt = _qt(name, rows=37, blocks_per_row=2 if _sizes(name)[0] > 1 else 96, seed=2, device=device)
    x = torch.randn(2, 3, qt.row_len, generator=torch.Generator().manual_seed(0)).to(device)
    y = linear(x, qt, chunk_rows=chunk_rows)
    dense = x @ qt.dequantize().T
    assert y.shape == (2, 3, 37) and y.dtype == torch.float32 and y.device.type == device
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-5 * float(dense.abs().max()))
    assert torch.equal(qt.linear(x, chunk_rows=chunk_rows), y)
    assert torch.equal(qt.matmul(x, chunk_rows=chunk_rows), y)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_bf16_input(device):
    qt = _qt("Q4_K", rows=20, blocks_per_row=1, device=device)
    x = torch.randn(5, 256).to(device=device, dtype=torch.bfloat16)
    y = linear(x, qt, chunk_rows=6)
    assert y.dtype == torch.bfloat16
    dense = x @ qt.dequantize(torch.bfloat16).T
    torch.testing.assert_close(y.float(), dense.float(), rtol=2e-2, atol=2e-2 * float(dense.abs().max()))


def test_linear_is_chunked_and_never_decodes_the_whole_matrix():
    qt = _qt("Q6_K", rows=50, blocks_per_row=2)
    calls: list[tuple[int, int]] = []
    orig = qt.dequantize_rows

    def spy(start, stop, dtype=torch.float32):
        calls.append((start, stop))
        return orig(start, stop, dtype)

    qt.dequantize_rows = spy  # linear() goes through the instance attribute
    qt.dequantize = lambda *a, **k: pytest.fail("linear must not dequantize the whole matrix")
    x = torch.randn(MANY_ROWS, 512)
    with quant_kernels.disabled():
        y = linear(x, qt, chunk_rows=8)
    assert calls == [(r, min(50, r + 8)) for r in range(0, 50, 8)]
    assert max(b - a for a, b in calls) <= 8
    assert len(calls) == math.ceil(50 / 8)
    calls.clear()
    del qt.dequantize
    del qt.dequantize_rows
    torch.testing.assert_close(y, x @ qt.dequantize().T, rtol=1e-5, atol=1e-4)


def test_linear_default_chunk_bounds_decoded_elements(monkeypatch):
    monkeypatch.setattr(fq, "_LINEAR_CHUNK_ELEMS", 4 * 256)
    qt = _qt("Q4_K", rows=19, blocks_per_row=1)
    sizes: list[int] = []
    orig = qt.dequantize_rows
    qt.dequantize_rows = lambda a, b, dtype=torch.float32: (sizes.append((b - a) * qt.row_len), orig(a, b, dtype))[1]
    with quant_kernels.disabled():
        linear(torch.randn(MANY_ROWS, 256), qt)
    assert max(sizes) <= 4 * 256 and sum(sizes) == 19 * 256


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_K"])
def test_many_rows_go_through_the_packed_kernels_batch_invariant(qtype):
    """More rows than one kernel call takes (a prefill): each row's result is the one it has alone, bit for bit, and
    nothing is dequantized (the CPU path never falls back to dequantize-then-GEMM for a type the kernels decode)."""
    if not quant_kernels.status()[0]:
        pytest.skip(f"packed kernels not built here: {quant_kernels.status()[1]}")
    qt = _qt(qtype, rows=37, blocks_per_row=2)
    qt.dequantize_rows = lambda *a, **k: pytest.fail("dequantized: the packed kernels should have taken it")
    x = torch.randn(3 * quant_kernels.MAX_ROWS + 5, qt.row_len)
    y = linear(x, qt)
    for i in (0, quant_kernels.MAX_ROWS, x.shape[0] - 1):
        assert torch.equal(y[i:i + 1], linear(x[i:i + 1], qt)), i


@pytest.mark.cuda
def test_linear_cuda_peak_memory_stays_below_a_full_fp32_copy():
    rows, bpr = 4096, 16  # 4096 x 4096 Q4_K: 9.4 MB raw, 64 MB as fp32
    qt = _qt("Q4_K", rows=rows, blocks_per_row=bpr, device="cuda")
    x = torch.randn(8, rows, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = linear(x, qt, chunk_rows=256)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full_fp32 = rows * bpr * 256 * 4
    assert peak < full_fp32 / 4, (peak, full_fp32)
    torch.testing.assert_close(y, x @ qt.dequantize().T, rtol=1e-4, atol=1e-3)


def test_linear_errors():
    qt = _qt("Q8_0", rows=4, blocks_per_row=1)
    with pytest.raises(ValueError, match="expects 32"):
        linear(torch.randn(2, 31), qt)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear(torch.randn(2, 32), qt, chunk_rows=0)
    with pytest.raises(TypeError, match="floating"):
        linear(torch.ones(2, 32, dtype=torch.int64), qt)
    with pytest.raises(ValueError, match="2-D"):
        linear(torch.randn(2, 32), QuantizedTensor(qt.raw, "Q8_0", (2, 2, 32)))


def test_packed_weights_from_a_column_cut_are_copied_not_refused():
    """A table cut by ``--layers`` (the PLE table's first columns) is a strided view of the mapped bytes:
    FastWeights keeps it packed by copying it once, with the same values as gguf's dequantization."""
    from types import SimpleNamespace

    from gemma4_harness.fast.weights import FastWeights

    rng = np.random.default_rng(3)
    full = gguf.quants.quantize(rng.standard_normal((8, 96)).astype(np.float32), T.Q8_0)  # [8, 3 blocks * 34]
    cut = full[:, :2 * 34]  # the first 64 columns: two blocks of each row, not C-contiguous
    assert not cut.flags.c_contiguous
    W = SimpleNamespace(raw_dtype=lambda name: "Q8_0", shape=lambda name: (8, 64), stored=lambda name: cut,
                        source="cut.gguf")
    qt = FastWeights._from_gguf(W, "per_layer_token_embd.weight", torch.device("cpu"), torch.float32, True)
    assert isinstance(qt, QuantizedTensor)
    want = gguf.quants.dequantize(np.ascontiguousarray(cut), T.Q8_0)
    assert np.array_equal(qt.dequantize().numpy(), want)
