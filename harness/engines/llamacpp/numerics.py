"""llama.cpp's deliberate numerical approximations, emulated in the reference so that they do not mask
or mimic a real difference.

The text decoder's one: the CPU backend's GELU reads an fp16 lookup table (:func:`gelu_fp16_table`);
:func:`llamacpp_numerics` swaps it into :func:`reference.model.gelu_tanh`, the one op of the
specification an emulation may replace (its docstring says so). The encoders' (mtmd):
:func:`llamacpp_mm_numerics`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from typing import Callable, Iterator

import numpy as np
import torch

import gemma4_harness.fast.activation_quants as fq
import gemma4_harness.fast.model as fm
import gemma4_harness.reference.audio as ra
import gemma4_harness.reference.activation_quants as rq
from gemma4_harness.reference.activation_quants import round_activations
import gemma4_harness.reference.model as rm
import gemma4_harness.reference.vision as rv

_exact_attention = rm.attention  # and attention_numerics this one
_exact_attention_fast = fm.attention
_exact_patch_embed = rv.patch_embed
_exact_conv2d = ra.conv2d_stride2


GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
"""ggml's constants (``ggml/src/ggml-cpu/vec.h``), as float32."""


def _tanhf() -> Callable[[np.ndarray], np.ndarray]:
    """The C library's ``tanhf`` over a float32 array (glibc's, the one ggml's table is built with on Linux),
    through ctypes; NumPy's float32 ``tanh`` where no C library can be loaded (it differs from glibc in the last
    bit of a few values)."""
    name = ctypes.util.find_library("m")
    try:
        libm = ctypes.CDLL(name) if name else None
    except OSError:
        libm = None
    if libm is None:
        return np.tanh
    fn = libm.tanhf
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lambda a: np.array([fn(float(v)) for v in a], dtype=np.float32)


@functools.lru_cache(maxsize=1)
def gelu_table() -> np.ndarray:
    """ggml's ``ggml_table_gelu_f16`` as float64, rebuilt bit for bit: for each fp16 bit pattern whose value ``x``
    lies in (-10, 10), ``fp16(ggml_gelu_f32(x))``, where ``ggml_gelu_f32`` (``ggml/src/ggml-cpu/vec.h``) is
    ``0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x)))`` **in float32**, as the compiler builds
    it with FMA on: ``1.0f + GELU_COEF_A*x*x`` contracts to ``fmaf(GELU_COEF_A*x, x, 1.0f)`` (GCC's default
    ``-ffp-contract=fast``; the build has ``-mfma``); ``tanhf`` is the C library's. The table is filled once in
    ``ggml_cpu_init`` (``ggml/src/ggml-cpu/ggml-cpu.c``). Checked against the table of the llama.cpp build the
    harness makes (read from ``libggml-cpu.so``): every finite entry equal (``tests/test_llamacpp_numerics.py``).
    Rounding the float64 GELU instead puts 274 of the 37376 entries in (-10, 10) one fp16 step away (e.g. x =
    0.3533: ggml 0.2253, float64 0.2255); without the FMA, 1. Entries at |x| >= 10 are read too: the clamp tests
    the float32 input, which can round to fp16 10.0 (x = 9.9996). Infinite and NaN patterns hold 0. [65536]
    float64."""
    f = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    inside = np.isfinite(f)
    x = f[inside]
    a = GELU_COEF_A * x  # float32
    inner = (a.astype(np.float64) * x.astype(np.float64) + 1.0).astype(np.float32)  # fmaf: one rounding
    g = (np.float32(0.5) * x) * (np.float32(1.0) + _tanhf()((SQRT_2_OVER_PI * x) * inner))
    out = np.zeros(1 << 16)
    out[inside] = g.astype(np.float16).astype(np.float64)
    return out


def gelu_fp16_table(x: np.ndarray) -> np.ndarray:
    """GELU (tanh form) the way llama.cpp's CPU backend computes it: through an fp16 lookup table.

    ggml's CPU ``gelu`` / ``geglu`` (``ggml_vec_gelu_f32`` / ``ggml_vec_geglu_f32`` with ``GGML_GELU_FP16``, the
    default) return 0 for ``x <= -10`` and ``x`` for ``x >= 10``; otherwise they round ``x`` to fp16 and read
    :func:`gelu_table` at its bit pattern.

    Args:
        x: float64 array, any shape.

    Returns:
        float64 array of the same shape (values exactly representable in fp16 inside ``(-10, 10)``).
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond the fp16 range: clamped below
        bits = x.astype(np.float16).view(np.uint16)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, gelu_table()[bits]))


def gelu_fp16_table_fast(x: torch.Tensor) -> torch.Tensor:
    """:func:`gelu_fp16_table` for the fast twin (``g4h parity --oracle fast``): the same table, read at the fp16
    bit pattern of ``x``, and the same clamps.

    Args:
        x: float tensor, any shape and device.

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    table = torch.from_numpy(gelu_table()).to(device=x.device, dtype=x.dtype)
    bits = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    looked = table[bits]
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, looked))


@contextlib.contextmanager
def llamacpp_numerics() -> Iterator[None]:
    """While inside, the reference computes its GELUs with :func:`gelu_fp16_table` (and the fast twin, when it
    is the oracle, with :func:`gelu_fp16_table_fast`).

    llama.cpp's fp16 GELU table is a deliberate, documented approximation, and on the small
    synthetic cases it moves logits by up to ~3e-2 and can flip a near-tied top-1 (measured: e2b
    max |Δlogit| 0.0267 -> 0.0162, 26b-a4b top-1 99.5 % -> 100 %, KLD 10-60x lower on every case once
    emulated). Comparing against a reference with the same table removes that known difference,
    so what is left, and gated, is fp32 rounding plus any real formula or layout fault. The
    reference module looks ``gelu_tanh`` up at call time; this swaps that one name and restores it
    on exit (not thread-safe: the harness runs its checks one at a time).
    """
    original, original_fast = rm.gelu_tanh, fm.gelu_tanh
    rm.gelu_tanh, fm.gelu_tanh = gelu_fp16_table, gelu_fp16_table_fast
    try:
        yield
    finally:
        rm.gelu_tanh, fm.gelu_tanh = original, original_fast


def linear_input_quantized(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """:func:`reference.model.linear_input` as llama.cpp's CPU backend takes a matrix product's input: rounded to
    the dot-product type of ``w``'s GGML type (:func:`reference.activation_quants.round_activations`; the type is
    the one a GGUF's weight carries, :class:`reference.weights.GGMLArray`; none for F32 weights and for weights
    with no GGML type). [..., in], [out, in] -> [..., in].

    Raises:
        KeyError: a GGML type llama.cpp's table (:data:`reference.activation_quants.VEC_DOT_TYPE`) does not hold;
            the harness checks the file's types before it emulates
            (:func:`harness.engines.numerics.emulable_types`).
    """
    return round_activations(x, getattr(w, "ggml_type", None))


def linear_offset_quantized(x: np.ndarray, w: np.ndarray) -> np.ndarray | None:
    """:func:`reference.model.linear_offset` as llama.cpp's Q4_1 / Q5_1 products add it: each weight block's minimum
    times the fp16 rounding of the Q8_1 activation block's sum, less what the rounded row's product already holds
    (:func:`reference.activation_quants.q8_1_sum_correction`, the minima the GGUF's weight carries:
    :attr:`reference.weights.GGMLArray.block_min`); None for every other type. [..., in], [out, in] -> [..., out].

    Raises:
        ValueError: a Q4_1 / Q5_1 weight without its blocks' minima (a view that is not whole rows: not a product
            the reference makes).
    """
    if rq.VEC_DOT_TYPE.get(getattr(w, "ggml_type", None) or "", "") != "Q8_1":
        return None
    mins = getattr(w, "block_min", None)
    if mins is None:
        raise ValueError(f"a {w.ggml_type} weight {w.shape} without its blocks' minima: its product cannot be emulated")
    return rq.q8_1_sum_correction(x, mins)


def rms_norm_fp32(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """:func:`reference.model.rms_norm` in llama.cpp's float32 steps (``ggml_compute_forward_rms_norm_f32`` and its
    fusion with the weight's ``mul``, ``ggml/src/ggml-cpu/ops.cpp``): ``sum`` of the float32 squares in double,
    ``mean = fp32(sum / n)``, ``scale = fp32(1 / sqrtf(mean + eps))``, ``y = fp32(fp32(x * scale) * w)``.

    Why an emulation needs it: the int8 rounding of a product's input decides each value to the nearest integer of
    ``x * 127 / amax``, so the input must carry llama.cpp's float32 bits, not the float64 value rounded once. Where
    the input is a norm of an exact value (the first layer's, of a quantized embedding row, whose ratios of small
    integers make exact .5 ties common on the synthetic files), the float64 norm rounded to float32 sits on the other
    side of a tie in 1 value of ~60 (measured on e2b Q8_0: one flipped int8 moves that token's first query by 2e-3).
    [..., n], [n] or None, eps -> [..., n] float64 (float32 values)."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    sq = (x32 * x32).astype(np.float64)
    mean = (np.sum(sq, axis=-1, keepdims=True) / x32.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps)).astype(np.float32)
    y = (x32 * scale).astype(np.float32)
    if weight is not None:
        y = (y * np.asarray(weight, dtype=np.float64).astype(np.float32)).astype(np.float32)
    return y.astype(np.float64)


def embed_fp32(cfg, W, ids: np.ndarray) -> np.ndarray:
    """:func:`reference.model.embed` in llama.cpp's float32 steps: the table's rows as float32 (``ggml_get_rows``;
    a quantized row dequantizes exactly), times ``sqrtf(n_embd)`` in float32 (``ggml_scale``, llama.cpp
    ``src/models/gemma4.cpp``: ``inpL = ggml_scale(ctx0, inpL, sqrtf(n_embd))``, its ``inp_scaled``).

    Why an emulation needs it: the PLE projection (``per_layer_model_proj``) takes ``inp_scaled`` itself as its input,
    no norm between, so its int8 rounding decides each value on those float32 bits. A quantized embedding row makes
    the ratios ``x_i * 127 / amax`` ratios of small integers, exact .5 ties in float64, which the float32 product
    puts on one side or the other. Measured (h128-ple-q4_0 of tests/test_local_gate.py, Q4_0 embeddings and
    projection): the float64 embedding moved the reference's ``inp_per_layer`` 1.1e-3 from llama.cpp's and its
    logits 0.27 at the first position of every prompt, and a correct llama-server failed
    ``reference~openai_q8.agreeing_positions`` (0 positions against the null's 10); the fast oracle, which computes
    in float32, agreed with llama.cpp. [T] -> [T, h] float64 (float32 values)."""
    rows = np.asarray(W.rows("token_embd.weight", ids), dtype=np.float64).astype(np.float32)
    return (rows * np.sqrt(np.float32(cfg.hidden_size))).astype(np.float32).astype(np.float64)


@contextlib.contextmanager
def quantized_activations_numerics() -> Iterator[None]:
    """While inside, every matrix product of the reference takes its input as llama.cpp does
    (:func:`linear_input_quantized` swapped into :func:`reference.model.linear_input`): each product whose weight is
    stored quantized or in 16 bits gets its input row rounded to that weight's dot-product type (Q8_0, Q8_1, Q8_K,
    F16, BF16), then is computed in float64 with the exact dequantized weight, plus, for Q4_1 / Q5_1 weights, the
    fp16 rounding of the Q8_1 block sums (:func:`linear_offset_quantized`); every RMSNorm runs in llama.cpp's
    float32 steps (:func:`rms_norm_fp32`: the rounding of the product after it depends on those bits), and so does
    the scaled embedding (:func:`embed_fp32`, the PLE projection's input). What is left
    against llama.cpp is its fp32 accumulation, and the int8 roundings its fp32 activations take the other way
    where they differ from ours in the last bits (rare, but each moves one value by one step). The fast twin is not
    swapped here: the fast oracle (``--oracle fast``) computes the same rounding as llama.cpp's own arithmetic,
    ``--compute q8`` (:mod:`fast.q8_compute`), entered beside this by :func:`harness.engines.numerics.emulate`
    (``harness/parity/checks/reference_runs.py``, ``ReferenceRuns.numerics``). Restores on exit (not thread-safe)."""
    original, offset, norm, emb = rm.linear_input, rm.linear_offset, rm.rms_norm, rm.embed
    rm.linear_input, rm.linear_offset, rm.rms_norm = linear_input_quantized, linear_offset_quantized, rms_norm_fp32
    rm.embed = embed_fp32
    try:
        yield
    finally:
        rm.linear_input, rm.linear_offset, rm.rms_norm, rm.embed = original, offset, norm, emb


JITTER = 2.0 ** -22
"""Relative size of the perturbation :func:`jitter_numerics` puts on each input before its rounding: a few fp32
units in the last place, the size of the float32 difference between llama.cpp's activations and the reference's."""


@contextlib.contextmanager
def jitter_numerics(seed: int = 0) -> Iterator[None]:
    """Inside :func:`quantized_activations_numerics`: every product's input is first multiplied by ``1 + JITTER * u``
    (``u`` uniform in [-1, 1], a fixed-seed stream), so that the int8 roundings near a midpoint go the other way as
    they do in an engine whose fp32 values differ from ours in their last bits. The reference against itself so
    perturbed shows what those flips alone do on this model and prompt (``harness/parity/checks/quantized.py``,
    ``agreeing_positions``). The fast twin's :func:`fast.model.linear` too (its input, float32, times the same
    factor, rounded to float32: a few ulps), for the fast oracle computing in q8 (``g4h parity --oracle fast``;
    entered inside :func:`fast.q8_compute.q8_compute`, so the perturbed input is what its rounding sees). Restores
    on exit (not thread-safe)."""
    rng = np.random.default_rng(seed)
    inner, inner_offset, inner_fast = rm.linear_input, rm.linear_offset, fm.linear
    last: list = [None, None, None]  # (x, w, perturbed x) of the latest input

    def jittered(x, w):
        xp = np.asarray(x, dtype=np.float64) * (1.0 + JITTER * rng.uniform(-1.0, 1.0, np.shape(x)))
        last[:] = [x, w, xp]
        return inner(xp, w)

    def jittered_offset(x, w):  # the same perturbed input as the product's rounding (every product asks both)
        return inner_offset(last[2] if last[0] is x and last[1] is w else x, w)

    def jittered_fast(x, w):
        u = torch.from_numpy(rng.uniform(-1.0, 1.0, tuple(x.shape))).to(x.device)
        return inner_fast((x.double() * (1.0 + JITTER * u)).to(x.dtype), w)

    rm.linear_input, rm.linear_offset, fm.linear = jittered, jittered_offset, jittered_fast
    try:
        yield
    finally:
        rm.linear_input, rm.linear_offset, fm.linear = inner, inner_offset, inner_fast
        last.clear()


@contextlib.contextmanager
def jitter_sums_numerics(seed: int | np.random.Generator = 0) -> Iterator[None]:
    """Inside :func:`quantized_activations_numerics`: every product's *output* (:func:`reference.model.linear`, through
    :func:`reference.model.linear_output`) is multiplied by ``1 + JITTER * u`` (``u`` uniform in [-1, 1], a fixed-seed
    stream): a model of an engine that sums in fp32 in another order. Unlike :func:`jitter_numerics` it leaves the
    inputs that the engine computes exactly as we do bit for bit (a layer's first RMSNorm of a stream both sides
    share, the first layer's norm of a quantized embedding row, whose exact .5 ties are common) where they are, so it
    flips only the roundings an engine's fp32 sums can flip: the null of the re-seeded, per-layer comparison
    (``harness/parity/checks/quantized.py``, ``local_rel_l2``). Measured on e2b Q8_0 (re-seeded from the llamacpp
    engine's stream): the input jitter moved the first layer by 1.9e-2 (its ties), where the engine itself stays
    within 1e-3. Restores on exit (not thread-safe). The fast twin's :func:`fast.model.linear` too (its float32 output
    times the same factor, rounded to float32), for the fast oracle computing in q8.

    ``seed``: an int starts a fresh stream (``numpy.random.default_rng(seed)``) at each entry; a
    ``numpy.random.Generator`` is drawn from as it stands, so that a forward whose operations enter this context
    one at a time (a chain of :func:`reference.batch.forward_chains`, entered around each of its operations) draws
    one stream across all of them: the same draws, in the same order and shapes, as one forward inside one entry
    (``ReferenceRuns.reseeded_many``, ``harness/parity/checks/reference_runs.py``)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    inner, inner_fast = rm.linear_output, fm.linear

    def jittered(y, w):
        y = inner(y, w)
        return y * (1.0 + JITTER * rng.uniform(-1.0, 1.0, y.shape))

    def jittered_fast(x, w):
        y = inner_fast(x, w)
        u = torch.from_numpy(rng.uniform(-1.0, 1.0, tuple(y.shape))).to(y.device)
        return (y.double() * (1.0 + JITTER * u)).to(y.dtype)

    rm.linear_output, fm.linear = jittered, jittered_fast
    try:
        yield
    finally:
        rm.linear_output, fm.linear = inner, inner_fast


def round_coarse_q8(x, weight_type: str | None = "Q8_0"):
    """The yardstick of an 8-bit activation rounding whose types are not known (``quantized_activations_q8``):
    ``x`` rounded as llama.cpp rounds for K-quants (Q8_K, blocks of 256) where the row allows, else Q8_0 (blocks of
    32), else unchanged; unchanged too for an F32 weight or one with no type. NumPy or torch in, float64 or the
    tensor's dtype out. [..., in] -> [..., in]."""
    if weight_type in (None, "F32"):
        return x
    n = x.shape[-1]
    if isinstance(x, torch.Tensor):
        fn = fq.q8_K if n % 256 == 0 else fq.q8_0 if n % 32 == 0 else None
        return x if fn is None else fn(x).to(x.dtype)
    fn = rq.q8_K if n % 256 == 0 else rq.q8_0 if n % 32 == 0 else None
    return x if fn is None else fn(x)


@contextlib.contextmanager
def coarse_q8_numerics() -> Iterator[None]:
    """While inside, the reference rounds the input of every product with a quantized or 16-bit weight by
    :func:`round_coarse_q8`, and the fast twin (which keeps no weight type) the input of every product: how far an
    8-bit activation rounding of unknown types moves this model (the yardstick of ``harness/parity/checks/quantized.py``
    for an engine whose rounding cannot be emulated; ``harness.sweep.tasks.sensitivity_run`` measures the same
    way). Restores on exit (not thread-safe)."""
    original, original_fast = rm.linear_input, fm.linear
    rm.linear_input = lambda x, w: round_coarse_q8(x, getattr(w, "ggml_type", None))
    fm.linear = lambda x, w: original_fast(round_coarse_q8(x), w)
    try:
        yield
    finally:
        rm.linear_input, fm.linear = original, original_fast


def fp16(x: np.ndarray) -> np.ndarray:
    """Values rounded to fp16 and back to float64. [...] -> [...].

    A value beyond fp16's range (|x| >= 65520) becomes +-inf, as ggml's own fp32 -> fp16 conversion makes it
    (``ggml_compute_fp32_to_fp16`` / F16C ``_mm_cvtps_ph``, round to nearest even: ``ggml/src/ggml-impl.h``): that
    is what llama.cpp computes, so it is emulated without NumPy's ``RuntimeWarning: overflow encountered in cast``.
    The inf is not hidden: it flows on, and the harness's finiteness checks name it where it lands."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def fp32(x: np.ndarray) -> np.ndarray:
    """Values rounded to fp32 and back to float64. [...] -> [...]."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def bf16(x: np.ndarray) -> np.ndarray:
    """Values rounded to bfloat16 (round to nearest even) and back to float64. [...] -> [...]."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float64).astype(np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


KV_ROUNDING = {"float32": fp32, "float16": fp16, "bfloat16": bf16}
"""A KV cache type -> the rounding of what is stored in it (float64: none)."""

FA_TILE_Q = 64
"""``GGML_FA_TILE_Q`` (``ggml/src/ggml-cpu/common.h``): a flash-attention call with at least this many query rows
goes through ``ggml_compute_forward_flash_attn_ext_tiled`` (the query kept in fp32, K/V read back to fp32, fp32
accumulators); fewer rows (every decode step) through ``..._f16_one_chunk`` (the query rounded to fp16, an fp16
output accumulator)."""


def attention_kv_rounded(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                         window: int | None, scale: float, q_block: np.ndarray | None = None,
                         k_block: np.ndarray | None = None, *, kv: str = "float16",
                         operands: bool = False) -> np.ndarray:
    """:func:`reference.model.attention` over a KV cache that stores K and V as ``kv`` (``float16``,
    ``bfloat16``, ``float32``): both are rounded once, as stored.

    With ``operands`` (llama.cpp without flash attention on a 16-bit cache, ``attn_fp16_operands``): the products
    ``K·Q`` and ``V·softmax`` are ``ggml_mul_mat`` calls whose first operand is the 16-bit cache, and on x86 the
    CPU backend converts the f32 second operand to the cache's ``vec_dot_type`` first (``ggml_compute_forward_mul_mat``
    in ``ggml/src/ggml-cpu/ggml-cpu.c``; tinyBLAS takes F16 x F16 only, ``llamafile/sgemm.cpp``): the query and
    the softmax weights are rounded to that type too; sums stay fp32 (here float64); the graph is
    ``llm_graph_context::build_attn_mha`` in ``src/llama-graph.cpp``. Queries go in blocks as in the reference.
    [T, H, D], [S, Hkv, D], [S, Hkv, D], [T], [S], window, scale, [T], [S] -> [T, H*D].
    """
    r = KV_ROUNDING[kv]
    k, v = r(k), r(v)
    if not operands:
        return _exact_attention(q, k, v, q_pos, k_pos, window, scale, q_block, k_block)
    T, H, D = q.shape
    group = H // k.shape[1]
    out = np.empty((T, H, D))
    for lo in range(0, T, rm.ATTENTION_BLOCK):
        qp = q_pos[lo:lo + rm.ATTENTION_BLOCK]
        qb = None if q_block is None else q_block[lo:lo + rm.ATTENTION_BLOCK]
        allowed = rm.attention_mask(qp, k_pos, window, qb, k_block)  # [t, S]
        reach = allowed.any(axis=0)
        kh = np.repeat(k[reach], group, axis=1)
        vh = np.repeat(v[reach], group, axis=1)
        scores = np.einsum("thd,shd->hts", r(q[lo:lo + rm.ATTENTION_BLOCK]), kh) * scale
        p = r(rm.softmax(np.where(allowed[:, reach][None], scores, -np.inf)))
        out[lo:lo + rm.ATTENTION_BLOCK] = np.einsum("hts,shd->thd", p, vh)
    return out.reshape(T, H * D)


def attention_flash_fp16(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                         window: int | None, scale: float, q_block: np.ndarray | None = None,
                         k_block: np.ndarray | None = None) -> np.ndarray:
    """:func:`reference.model.attention` as llama.cpp's CPU flash attention computes it (``ggml_flash_attn_ext``,
    ``ggml/src/ggml-cpu/ops.cpp``; ``build_attn_mha`` casts an F32 cache to F16 first, so K and V are always fp16).

    A call with at least :data:`FA_TILE_Q` query rows (a long prompt) takes the tiled kernel: the query in fp32,
    K and V read back to fp32, an fp32 online softmax: the exact attention over fp16 K/V. A call with fewer rows
    (every decode step, short prompts) takes ``ggml_compute_forward_flash_attn_ext_f16_one_chunk``: the query is
    rounded to fp16, each score is an fp16 dot product summed in fp32, and the keys are visited in order with an
    online softmax whose output accumulator ``VKQ16`` is **fp16**: on a new maximum it is rescaled
    (``ggml_vec_scale_f16``) and every key adds ``v * exp(s - M)`` to it (``ggml_vec_mad_f16``), each step rounded
    to fp16; the sum of weights stays fp32; the result is divided by it at the end. Emulated here step by step, in
    key order (position order: the order of a sequence's cells in a fresh KV cache), with the fp32 values rounded
    to fp32. [T, H, D], [S, Hkv, D], [S, Hkv, D], [T], [S], window, scale, [T], [S] -> [T, H*D].
    """
    T, H, D = q.shape
    k, v = fp16(k), fp16(v)
    if T >= FA_TILE_Q:
        return _exact_attention(q, k, v, q_pos, k_pos, window, scale, q_block, k_block)
    group = H // k.shape[1]
    allowed = rm.attention_mask(q_pos, k_pos, window, q_block, k_block)  # [T, S]
    kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = fp32(np.einsum("thd,shd->ths", fp16(q), kh) * scale)  # [T, H, S]
    acc = np.zeros((T, H, D))
    big_m = np.full((T, H), -np.inf)
    big_s = np.zeros((T, H))
    for j in range(kh.shape[0]):
        ok = np.broadcast_to(allowed[:, j, None], (T, H))
        if not ok.any():
            continue
        s = scores[:, :, j]
        new = ok & (s > big_m)
        # exponents only where their value is used: np.where evaluates both branches, and a key not yet allowed
        # (big_m still -inf) or masked would give exp(inf) or a huge finite weight, whose fp16 rounding below overflowed
        # (NumPy's "overflow encountered in cast") for values that are then thrown away
        old = ok & ~new
        ms = np.where(new, fp32(np.exp(fp32(np.where(new, big_m, s) - s))), 1.0)
        vs = np.where(old, fp32(np.exp(fp32(s - np.where(old, big_m, s)))), 1.0)
        acc = np.where(new[..., None], fp16(fp32(acc * ms[..., None])), acc)
        acc = np.where(ok[..., None], fp16(fp32(acc + fp32(vh[j][None] * vs[..., None]))), acc)
        big_s = np.where(ok, fp32(big_s * ms + vs), big_s)
        big_m = np.where(new, s, big_m)
    return (acc / big_s[..., None]).reshape(T, H * D)


def _attention_fast(kv: str | None, operands: bool, flash: bool):
    """:func:`fast.model.attention` under the same emulation as the reference's (``g4h parity --oracle fast``): K/V
    rounded in the tensor's own dtype where that is all, else the reference's emulation on the block in float64
    (the flash kernel's fp16 accumulator and the fp16 operands are the reference's functions)."""
    def fn(q, k, v, q_pos, k_pos, window, scale, q_block=None, k_block=None, masks=None):
        if (flash and q.shape[0] < FA_TILE_Q) or (operands and not flash):
            args = [t.detach().double().cpu().numpy() if isinstance(t, torch.Tensor) else t
                    for t in (q, k, v, q_pos, k_pos, window, scale, q_block, k_block)]
            out = attention_flash_fp16(*args) if flash else attention_kv_rounded(*args, kv=kv, operands=True)
            return torch.from_numpy(out).to(device=q.device, dtype=q.dtype)
        dt = torch.float16 if flash or kv == "float16" else torch.bfloat16 if kv == "bfloat16" else None
        if dt is not None:
            k, v = k.to(dt).to(k.dtype), v.to(dt).to(v.dtype)
        return _exact_attention_fast(q, k, v, q_pos, k_pos, window, scale, q_block, k_block, masks)
    return fn


@contextlib.contextmanager
def attention_numerics(kv: str | None = None, operands: bool = False, flash: bool = False) -> Iterator[None]:
    """While inside, the reference's :func:`reference.model.attention` stores K/V as ``kv`` (None: no rounding),
    with ``operands`` rounds the query and softmax weights to that type (:func:`attention_kv_rounded`), and with
    ``flash`` computes as llama.cpp's CPU flash attention (:func:`attention_flash_fp16`, whatever ``kv``); the fast
    twin's :func:`fast.model.attention` too, when it is the oracle. Swaps the module names and restores them on exit
    (not thread-safe)."""
    if flash:
        fn = attention_flash_fp16
    elif kv in KV_ROUNDING:
        def fn(*a, **kw):
            return attention_kv_rounded(*a, kv=kv, operands=operands, **kw)
    else:
        yield
        return
    original, original_fast = rm.attention, fm.attention
    rm.attention, fm.attention = fn, _attention_fast(kv, operands, flash)
    try:
        yield
    finally:
        rm.attention, fm.attention = original, original_fast


def patch_embed_im2col_f16(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """:func:`reference.vision.patch_embed` as llama.cpp computes it: ``ggml_conv_2d`` gathers the input patches
    with ``ggml_im2col`` into F16 (for any kernel type but BF16), and the F32 kernel is converted to F16 for the
    F16 x F16 dot products. [N, p*p*3], [H, 3, p, p] -> [N, H]."""
    return _exact_patch_embed(fp16(x), fp16(kernel))


def conv2d_im2col_f16(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """:func:`reference.audio.conv2d_stride2` as llama.cpp's ``ggml_conv_2d`` computes it (input and kernel in F16).
    [C_in, T, F], [C_out, C_in, 3, 3] -> [C_out, T/2, F/2]."""
    return _exact_conv2d(fp16(x), fp16(w))


@contextlib.contextmanager
def llamacpp_mm_numerics() -> Iterator[None]:
    """While inside, the reference's encoders take llama.cpp's deliberate approximations (measured on
    ``mm-llamacpp``, image prompt, mmproj with ``clip.use_gelu``): the patch embedding's and the audio subsampling
    convolutions' F16 im2col (:func:`patch_embed_im2col_f16`, :func:`conv2d_im2col_f16`; the first vision point
    ``inp`` moves from rel. L2 3.2e-4 to 6.6e-8 once emulated) and the fp16 GELU table in the vision MLP
    (:func:`gelu_fp16_table`). Flash attention, which holds K and V in F16 on the CPU, is turned off in the worker
    instead. Swaps the module names and restores them on exit (not thread-safe)."""
    saved = (rv.gelu_tanh, rv.patch_embed, ra.conv2d_stride2)
    rv.gelu_tanh, rv.patch_embed, ra.conv2d_stride2 = gelu_fp16_table, patch_embed_im2col_f16, conv2d_im2col_f16
    try:
        yield
    finally:
        rv.gelu_tanh, rv.patch_embed, ra.conv2d_stride2 = saved
