"""The twins op by op, in the style of llama.cpp's test-backend-ops.

Each row of :data:`CASES` names an op (the same function name in ``reference/model.py`` and
``fast/model.py``, or ``module.name`` for the multimodal twins: ``multimodal``, ``vision``, ``audio``), its
shapes and a dtype; one driver draws random inputs, runs ``reference.<module>.<op>`` in float64 and
``fast.<module>.<op>`` in torch, and checks the NMSE against the op's bound in
:data:`harness.core.gates.OP_BOUNDS` (each with its reason). A formula fault in either twin shows here
at the op that has it, before any model-level gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

from gemma4_harness.fast import audio as fa
from gemma4_harness.fast import model as fm
from gemma4_harness.fast import multimodal as fmm
from gemma4_harness.fast import vision as fv
from gemma4_harness.harness.core.gates import OP_BOUNDS
from gemma4_harness.harness.core.metrics import nmse_sum
from gemma4_harness.reference import audio as ra
from gemma4_harness.reference import model as rm
from gemma4_harness.reference import multimodal as rmm
from gemma4_harness.reference import vision as rv
from gemma4_harness.reference.audio_config import AudioConfig

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
TWINS = {"model": (rm, fm), "multimodal": (rmm, fmm), "vision": (rv, fv), "audio": (ra, fa)}


def twins(op: str):
    """``(reference function, fast function)`` of an op name (``name`` or ``module.name``)."""
    module, _, name = op.rpartition(".")
    ref_mod, fast_mod = TWINS[module or "model"]
    return getattr(ref_mod, name), getattr(fast_mod, name)


@dataclass(frozen=True)
class OpCase:
    """One row: the op, a label for its shapes, the dtype, and how to draw its arguments.

    ``make(rng, dtype)`` returns ``(reference args, fast args)``: float64 numpy for the reference, torch for
    the fast twin (weights in ``dtype``, activations float32), drawn from the same values.
    """

    op: str
    shapes: str
    dtype: str
    make: Callable[[np.random.Generator, torch.dtype], tuple[tuple, tuple]]
    compare: Callable[[Any, Any], float] | None = None


def _t(a: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(dtype)


def _q(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``a`` rounded as the fast twin holds it (so both twins see the same weight values)."""
    return _t(a, dtype).double().numpy()


def _norm_case(shape):
    def make(rng, dt):
        x, w = rng.standard_normal(shape), rng.uniform(0.5, 1.5, shape[-1])
        return (_q(x, dt), w, 1e-6), (_t(x, dt), _t(w), 1e-6)
    return make


def _unary(shape, scale=3.0, extra=()):
    def make(rng, dt):
        x = rng.standard_normal(shape) * scale
        return (_q(x, dt), *extra), (_t(x, dt), *extra)
    return make


def _linear(n, k, m):
    def make(rng, dt):
        x, w = rng.standard_normal((n, k)), rng.standard_normal((m, k)) / np.sqrt(k)
        return (_q(x, dt), _q(w, dt)), (_t(x), _t(w, dt))
    return make


def _rope_angles(t, half):
    def make(rng, dt):
        pos = np.arange(t) * 37
        inv = 10000.0 ** (-np.arange(half) / half)
        return (pos, inv), (torch.from_numpy(pos), torch.from_numpy(inv))
    return make


def _apply_rope(t, h, d, n_rot):
    def make(rng, dt):
        x = rng.standard_normal((t, h, d))
        ang = np.arange(t)[:, None] * 10000.0 ** (-np.arange(n_rot // 2) / (n_rot // 2))[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        return (x, cos, sin, n_rot), (_t(x), _t(cos), _t(sin), n_rot)
    return make


def _attention(t, s, h, hkv, d, window):
    def make(rng, dt):
        q, k, v = (rng.standard_normal(shape) for shape in ((t, h, d), (s, hkv, d), (s, hkv, d)))
        qp, kp = np.arange(s - t, s), np.arange(s)
        return (q, k, v, qp, kp, window, 1.0), (_t(q), _t(k), _t(v), torch.from_numpy(qp), torch.from_numpy(kp),
                                                window, 1.0)
    return make


def _mask(t, s, window):
    def make(rng, dt):
        qp, kp = np.arange(s - t, s), np.arange(s)
        return (qp, kp, window), (torch.from_numpy(qp), torch.from_numpy(kp), window)
    return make


def _mask_compare(ref, fast) -> float:
    return 0.0 if np.array_equal(ref, fast.numpy()) else float("inf")


def _image_blocks(t, s, start, length):
    """Query and key block ids: one image of ``length`` tokens from position ``start``; -1 elsewhere."""
    kb = np.full(s, -1)
    kb[start:start + length] = 0
    return kb[s - t:], kb


def _attention_blocks(t, s, h, hkv, d, window, start, length):
    def make(rng, dt):
        q, k, v = (rng.standard_normal(shape) for shape in ((t, h, d), (s, hkv, d), (s, hkv, d)))
        qp, kp = np.arange(s - t, s), np.arange(s)
        qb, kb = _image_blocks(t, s, start, length)
        return ((q, k, v, qp, kp, window, 1.0, qb, kb),
                (_t(q), _t(k), _t(v), torch.from_numpy(qp), torch.from_numpy(kp), window, 1.0,
                 torch.from_numpy(qb), torch.from_numpy(kb)))
    return make


def _mask_blocks(t, s, window, start, length):
    def make(rng, dt):
        qp, kp = np.arange(s - t, s), np.arange(s)
        qb, kb = _image_blocks(t, s, start, length)
        return (qp, kp, window, qb, kb), tuple(torch.from_numpy(a) for a in (qp, kp)) + (
            window, torch.from_numpy(qb), torch.from_numpy(kb))
    return make


def _types(t):
    """Token types with two images (the second one touching a video: one block), audio and text."""
    types = np.zeros(t, dtype=np.int64)
    types[3:20], types[25:30], types[30:34], types[40:52] = 1, 1, 2, 3
    return types


def _llm_ids(t):
    def make(rng, dt):
        ids, ph = rng.integers(0, 512, t), _types(t) != 0
        return (ids, ph, 0), (torch.from_numpy(ids), torch.from_numpy(ph), 0)
    return make


def _block_ids(t):
    def make(rng, dt):
        return (_types(t),), (torch.from_numpy(_types(t)),)
    return make


def _merge(t, h):
    def make(rng, dt):
        x, ph = rng.standard_normal((t, h)), _types(t) != 0
        e = rng.standard_normal((int(ph.sum()), h))
        return (x, ph, e), (_t(x), torch.from_numpy(ph), _t(e))
    return make


def _exact(ref, fast) -> float:
    return 0.0 if np.array_equal(np.asarray(ref), fast.numpy()) else float("inf")


def _clipped(n, k, m, module):
    """A clipped linear: bounds at about the 20th / 80th percentiles so that both sides clamp."""
    def make(rng, dt):
        x, w = rng.standard_normal((n, k)), rng.standard_normal((m, k)) / np.sqrt(k)
        bounds = (-0.8, 0.9, -0.7, 0.6)
        if module == "vision":
            return (_q(x, dt), _q(w, dt), bounds), (_t(x), _t(w, dt), bounds)
        names = ("input_min", "input_max", "output_min", "output_max")
        ref_w = {"l.weight": _q(w, dt), **{f"l.{s}": np.array([b]) for s, b in zip(names, bounds)}}
        fast_w = {"l.weight": _t(w, dt), **{f"l.{s}": _t(np.array([b])) for s, b in zip(names, bounds)}}
        return (_q(x, dt), ref_w, "l"), (_t(x), fast_w, "l")
    return make


def _patch_embed(n, h, p):
    def make(rng, dt):
        x, kern = rng.random((n, p * p * 3)), rng.standard_normal((h, 3, p, p)) / p
        return (_q(x, torch.float32), _q(kern, dt)), (_t(x), _t(kern, dt))
    return make


def _grid(side):
    yy, xx = np.mgrid[0:side, 0:side]
    return np.stack([xx.reshape(-1), yy.reshape(-1)], -1)


def _position_embed(side, pad, size, h):
    def make(rng, dt):
        pos = np.concatenate([_grid(side), np.full((pad, 2), -1)])
        table, padding = rng.standard_normal((2, size, h)), np.all(pos == -1, -1)
        return (pos, table, padding), (torch.from_numpy(pos), _t(table), torch.from_numpy(padding))
    return make


def _rope_2d(side, heads, d):
    def make(rng, dt):
        x, pos = rng.standard_normal((side * side, heads, d)), _grid(side)
        return (x, pos, 100.0), (_t(x), torch.from_numpy(pos), 100.0)
    return make


def _vision_attention(n, pad, h, hkv, d):
    def make(rng, dt):
        q, k, v = (rng.standard_normal(shape) for shape in ((n, h, d), (n, hkv, d), (n, hkv, d)))
        valid = np.arange(n) < n - pad
        return (q, k, v, valid), (_t(q), _t(k), _t(v), torch.from_numpy(valid))
    return make


def _pool(side, pad, h, k):
    def make(rng, dt):
        pos = np.concatenate([_grid(side), np.full((pad, 2), -1)])
        x, padding = rng.standard_normal((len(pos), h)), np.all(pos == -1, -1)
        return (x, pos, padding, k), (_t(x), torch.from_numpy(pos), torch.from_numpy(padding), k)
    return make


def _embed_vision(n, h, ht):
    def make(rng, dt):
        x, w = rng.standard_normal((n, h)) * 3.0, rng.standard_normal((ht, h)) / np.sqrt(h)
        return (_q(x, torch.float32), _q(w, dt), 1e-6), (_t(x), _t(w, dt), 1e-6)
    return make


def _conv2d(c_in, c_out, t, f):
    def make(rng, dt):
        x, w = rng.standard_normal((c_in, t, f)), rng.standard_normal((c_out, c_in, 3, 3)) / np.sqrt(9 * c_in)
        return (x, w), (_t(x), _t(w))
    return make


def _layer_norm(shape):
    def make(rng, dt):
        x, w = rng.standard_normal(shape) * 2 + 1, rng.uniform(0.5, 1.5, shape[-1])
        return (x, w, 1e-6), (_t(x), _t(w), 1e-6)
    return make


def _dwconv(t, h, k):
    def make(rng, dt):
        x, w = rng.standard_normal((t, h)), rng.standard_normal((h, k))
        return (x, w), (_t(x), _t(w))
    return make


AUDIO_CFG = AudioConfig(hidden_size=32, num_attention_heads=2, subsampling_conv_channels=(128, 8),
                        output_proj_dims=24, text_hidden_size=64)


def _rel_bias(t, heads, d):
    def make(rng, dt):
        q, rel = rng.standard_normal((t, heads, d)), rng.standard_normal((AUDIO_CFG.n_rel_pos, heads, d))
        return (AUDIO_CFG, q, rel), (AUDIO_CFG, _t(q), _t(rel))
    return make


def _audio_mask(t, n_valid):
    def make(rng, dt):
        valid = np.arange(t) < n_valid
        return (AUDIO_CFG, valid), (AUDIO_CFG, torch.from_numpy(valid))
    return make


def _gelu_ffn(n, h, f):
    def make(rng, dt):
        x = rng.standard_normal((n, h))
        ws = [rng.standard_normal(s) / np.sqrt(s[1]) for s in ((f, h), (f, h), (h, f))]
        return (_q(x, torch.float32), *[_q(w, dt) for w in ws]), (_t(x), *[_t(w, dt) for w in ws])
    return make


def _route(n, h, e, k):
    def make(rng, dt):
        x, w = rng.standard_normal((n, h)), rng.standard_normal((e, h)) * 1.5
        rs, ps = rng.uniform(0.5, 1.5, h), rng.uniform(0.5, 1.5, e)
        return (x, w, rs, ps, k, 1e-6), (_t(x), _t(w), _t(rs), _t(ps), k, 1e-6)
    return make


def _route_compare(ref, fast) -> float:
    (ri, rw), (fi, fw) = ref, fast
    assert np.array_equal(np.sort(ri, -1), np.sort(fi.numpy(), -1)), "the twins chose different experts"
    order_r, order_f = np.argsort(ri, -1), np.argsort(fi.numpy(), -1)
    return nmse_sum(np.take_along_axis(fw.double().numpy(), order_f, -1), np.take_along_axis(rw, order_r, -1))


def _expert(h, f):
    def make(rng, dt):
        x = rng.standard_normal(h)
        gu, d = rng.standard_normal((2 * f, h)) / np.sqrt(h), rng.standard_normal((h, f)) / np.sqrt(f)
        return (x, gu, d), (_t(x[None, :]), _t(gu), _t(d))
    return make


def _experts(n, h, f, e, k):
    def make(rng, dt):
        x = rng.standard_normal((n, h))
        gu, d = rng.standard_normal((e, 2 * f, h)) / np.sqrt(h), rng.standard_normal((e, h, f)) / np.sqrt(f)
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
        wgt = rng.uniform(0.1, 1.0, (n, k))
        return (x, gu, d, idx, wgt), (_t(x), _t(gu), _t(d), torch.from_numpy(idx), _t(wgt))
    return make


CASES: list[OpCase] = [
    OpCase("rms_norm", "[7, 64]", "float32", _norm_case((7, 64))),
    OpCase("rms_norm", "[7, 64]", "bfloat16", _norm_case((7, 64))),
    OpCase("gelu_tanh", "[5, 96]", "float32", _unary((5, 96))),
    OpCase("gelu_tanh", "[5, 96]", "bfloat16", _unary((5, 96))),
    OpCase("softcap", "[3, 500] x30", "float32", _unary((3, 500), scale=40.0, extra=(30.0,))),
    OpCase("linear", "[1, 256] x [96, 256]", "float32", _linear(1, 256, 96)),
    OpCase("linear", "[9, 256] x [96, 256]", "float32", _linear(9, 256, 96)),
    OpCase("linear", "[33, 128] x [64, 128]", "float32", _linear(33, 128, 64)),
    OpCase("linear", "[9, 256] x [96, 256]", "bfloat16", _linear(9, 256, 96)),
    OpCase("rope_angles", "[40] x 16", "float32", _rope_angles(40, 16)),
    OpCase("apply_rope", "[6, 4, 32] n_rot 32", "float32", _apply_rope(6, 4, 32, 32)),
    OpCase("apply_rope", "[6, 4, 64] n_rot 16", "float32", _apply_rope(6, 4, 64, 16)),
    OpCase("attention", "T 5, S 21, GQA 4:2, window 8", "float32", _attention(5, 21, 4, 2, 16, 8)),
    OpCase("attention", "T 21, S 21, MHA, full", "float32", _attention(21, 21, 2, 2, 32, None)),
    OpCase("attention", "T 600, S 700, GQA 4:2, window 16 (3 blocks)", "float32", _attention(600, 700, 4, 2, 8, 16)),
    OpCase("attention", "T 600, S 600, full (3 blocks)", "float32", _attention(600, 600, 2, 1, 8, None)),
    OpCase("attention_mask", "T 9, S 40, window 8", "float32", _mask(9, 40, 8), _mask_compare),
    OpCase("attention_mask", "T 40, S 40, full", "float32", _mask(40, 40, None), _mask_compare),
    OpCase("gelu_ffn", "[4, 64] F 128", "float32", _gelu_ffn(4, 64, 128)),
    OpCase("gelu_ffn", "[4, 64] F 128", "bfloat16", _gelu_ffn(4, 64, 128)),
    OpCase("moe_route", "[6, 64] E 8 K 2", "float32", _route(6, 64, 8, 2), _route_compare),
    OpCase("expert_ffn", "[64] F 32", "float32", _expert(64, 32)),
    OpCase("moe_experts", "[20, 64] E 8 K 2 F 32", "float32", _experts(20, 64, 32, 8, 2)),
    # bidirectional vision attention on a sliding layer: an image of 300 tokens, window 8, query blocks
    # that end inside it (their reach runs to the image's end)
    OpCase("attention", "T 700, S 710, window 8, image 300 from 200", "float32",
           _attention_blocks(700, 710, 4, 2, 8, 8, 200, 300)),
    OpCase("attention", "T 30, S 40, window 8, image 20 from 12", "float32", _attention_blocks(30, 40, 2, 1, 8, 8, 12, 20)),
    OpCase("attention_mask", "T 30, S 40, window 8, image 20 from 12", "float32", _mask_blocks(30, 40, 8, 12, 20),
           _mask_compare),
    OpCase("multimodal.llm_input_ids", "[60]", "int64", _llm_ids(60), _exact),
    OpCase("multimodal.block_ids", "[60]: image, image + video, audio", "int64", _block_ids(60), _exact),
    OpCase("multimodal.merge_embeddings", "[60, 64], 38 rows", "float32", _merge(60, 64)),
    OpCase("vision.clipped_linear", "[20, 64] x [48, 64]", "float32", _clipped(20, 64, 48, "vision")),
    OpCase("vision.clipped_linear", "[20, 64] x [48, 64]", "bfloat16", _clipped(20, 64, 48, "vision")),
    OpCase("vision.patch_embed", "[30, 48] -> 32", "float32", _patch_embed(30, 32, 4)),
    OpCase("vision.patch_embed", "[30, 48] -> 32", "bfloat16", _patch_embed(30, 32, 4)),
    OpCase("vision.position_embed", "6 x 6 + 4 padding, P 16", "float32", _position_embed(6, 4, 16, 32)),
    OpCase("vision.rope_2d", "6 x 6, 2 heads, D 16", "float32", _rope_2d(6, 2, 16)),
    OpCase("vision.vision_attention", "N 40 (6 padding), GQA 4:2", "float32", _vision_attention(40, 6, 4, 2, 16)),
    OpCase("vision.vision_attention", "N 600 (50 padding), 2 blocks", "float32", _vision_attention(600, 50, 2, 2, 8)),
    OpCase("vision.pool", "9 x 9 + 9 padding, k 3", "float32", _pool(9, 9, 32, 3)),
    OpCase("vision.embed_vision", "[9, 32] -> 64", "float32", _embed_vision(9, 32, 64)),
    OpCase("vision.embed_vision", "[9, 32] -> 64", "bfloat16", _embed_vision(9, 32, 64)),
    OpCase("audio.clippable_linear", "[25, 32] x [64, 32]", "float32", _clipped(25, 32, 64, "audio")),
    OpCase("audio.clippable_linear", "[25, 32] x [64, 32]", "bfloat16", _clipped(25, 32, 64, "audio")),
    OpCase("audio.conv2d_stride2", "[8, 25, 64] -> 16", "float32", _conv2d(8, 16, 25, 64)),
    OpCase("audio.layer_norm", "[13, 32, 8]", "float32", _layer_norm((13, 32, 8))),
    OpCase("audio.glu", "[25, 64]", "float32", _unary((25, 64))),
    OpCase("audio.causal_depthwise_conv", "[25, 32] k 5", "float32", _dwconv(25, 32, 5)),
    OpCase("audio.rel_pos_table", "H 32, F 13", "float32", lambda rng, dt: ((AUDIO_CFG,), (AUDIO_CFG,))),
    OpCase("audio.relative_bias", "T' 40, 2 heads, D 16", "float32", _rel_bias(40, 2, 16)),
    OpCase("audio.attention_mask", "T' 40, 31 valid", "float32", _audio_mask(40, 31), _mask_compare),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{c.dtype}-{c.shapes}")
def test_op_twins(case: OpCase):
    bound = OP_BOUNDS[(case.op, case.dtype)]
    ref_fn, fast_fn = twins(case.op)
    ref_args, fast_args = case.make(np.random.default_rng(hash(case.op) % 2**32), DT[case.dtype])
    ref = ref_fn(*ref_args)
    with torch.inference_mode():
        fast = fast_fn(*fast_args)
    if case.compare is not None:
        err = case.compare(ref, fast)
    elif isinstance(ref, tuple):
        err = max(nmse_sum(f.double().numpy(), r) for r, f in zip(ref, fast))
    else:
        err = nmse_sum(fast.double().numpy().reshape(np.shape(ref)), ref)
    assert err <= bound.max_nmse, f"{case.op} {case.dtype} {case.shapes}: NMSE {err:.3g} > {bound.max_nmse:g} " \
                                  f"({bound.reason})"


def test_every_bound_has_a_case():
    assert {(c.op, c.dtype) for c in CASES} == set(OP_BOUNDS)


def test_a_formula_fault_breaks_its_bound():
    """The driver is not vacuous: the reference's softcap without the tanh is far outside the bound."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 500)) * 40.0
    err = nmse_sum(fm.softcap(_t(x), 30.0).double().numpy(), x)
    assert err > 1e3 * OP_BOUNDS[("softcap", "float32")].max_nmse


@pytest.mark.parametrize("window,image", [(16, None), (None, None), (16, (200, 400)), (16, (300, 30))],
                         ids=["window", "full", "window+image-across-3-blocks", "window+image-inside-a-block"])
def test_blocked_attention_equals_the_whole_score_matrix(window, image):
    """The reference's query blocks (and a sliding layer's window-only keys, and an image block's later keys)
    give the plain formula's result."""
    rng = np.random.default_rng(1)
    T, H, D = 2 * rm.ATTENTION_BLOCK + 37, 2, 8
    q, k, v = rng.standard_normal((T, H, D)), rng.standard_normal((T, H, D)), rng.standard_normal((T, H, D))
    pos = np.arange(T)
    blocks = (None, None) if image is None else _image_blocks(T, T, *image)
    scores = np.einsum("thd,shd->hts", q, k)
    scores = np.where(rm.attention_mask(pos, pos, window, *blocks)[None], scores, -np.inf)
    whole = np.einsum("hts,shd->thd", rm.softmax(scores), v).reshape(T, H * D)
    assert np.max(np.abs(rm.attention(q, k, v, pos, pos, window, 1.0, *blocks) - whole)) <= 1e-12


def _rms_norm_rows_f32(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """``fast/csrc/rows_f32.c``'s rms_norm replayed in NumPy from its header: squares summed in float64 in 8 lanes
    (lane l takes i = l, l + 8, ... in order), the fixed tree, the scale rounded once to float32, then
    ``(x * s) * w`` in float32."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[1]
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        sq = np.zeros(-(-n // 8) * 8)
        sq[:n] = row.astype(np.float64) ** 2
        a = np.zeros(8)
        for chunk in sq.reshape(-1, 8):  # one addition per lane per chunk, in order (a padded 0.0 changes nothing)
            a = a + chunk
        b = a[:4] + a[4:]
        c = b[:2] + b[2:]
        s = np.float32(1.0 / np.sqrt((c[0] + c[1]) / n + eps))
        out[r] = row * s if w is None else (row * s) * w
    return out.reshape(x.shape)


def test_rms_norm_gives_its_defined_bits_on_the_cpu_and_the_fused_formulas_elsewhere():
    """fast's rms_norm on the CPU is the C kernel: the bits of its header's formula (replayed in NumPy), with and
    without a weight, for decode and prefill row counts and widths that are not a multiple of the 8 lanes, a row's
    result the same alone and among others, and within a few float32 ulps of the float64 reference. Where the
    kernel does not apply (on a GPU; here the kernel switched off), torch's fused F.rms_norm: the bits of
    ``x * rsqrt(mean(x**2) + eps) * w`` written out in float32."""
    from gemma4_harness.fast import cpu_kernels
    from gemma4_harness.fast.model import rms_norm

    assert cpu_kernels.rms_norm_f32(torch.ones(1, 8), None, 1e-6) is not None, "the row kernels did not build"
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 640), (3, 256), (16, 2560), (37, 4, 128), (2, 13), (5, 1)]:
        x = torch.randn(shape, generator=g) * 3
        w = torch.rand(shape[-1], generator=g) + 0.5
        for weight in (w, None):
            got = rms_norm(x, weight, 1e-6)
            want = _rms_norm_rows_f32(x.numpy(), None if weight is None else weight.numpy(), 1e-6)
            assert np.array_equal(got.numpy(), want), (shape, weight is None)
            alone = rms_norm(x.reshape(-1, shape[-1])[-1:], weight, 1e-6)
            assert torch.equal(alone[0], got.reshape(-1, shape[-1])[-1]), shape
            ref = rm.rms_norm(x.double().numpy(), None if weight is None else weight.double().numpy(), 1e-6)
            # x * s, then * w: two float32 roundings and the scale's own, each at most half an ulp
            assert np.max(np.abs(got.double().numpy() - ref) / np.maximum(np.abs(ref), 1e-30)) <= 1.5 * 2.0 ** -23
            with cpu_kernels.ROWS.disabled():
                fused = rms_norm(x, weight, 1e-6)
            written = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            if weight is not None:
                written = written * weight
            assert torch.equal(fused, written), (shape, weight is None)


def test_softcap_on_the_cpu_is_within_one_ulp_of_the_correctly_rounded_value():
    """The C soft-cap (``fast/csrc/rows_f32.c``) evaluates ``cap * tanh(x / cap)`` in float64 and rounds once, so
    every result is the correctly rounded float32 or, within 1e-13 of a rounding boundary, one ulp from it: checked
    over logit-sized rows and 33 decades of magnitude on both signs, for caps that are and are not powers of two.
    -0 stays -0, NaN stays NaN and +-Inf gives +-cap, as torch's ``tanh(x / cap) * cap`` does."""
    from gemma4_harness.fast import cpu_kernels
    from gemma4_harness.fast.model import softcap

    g = torch.Generator().manual_seed(1)
    mags = np.logspace(-30, 3, 20001)
    for cap in (30.0, 50.0, 16.0):
        x = torch.cat([torch.randn(3, 4099, generator=g).flatten() * cap,
                       torch.from_numpy(np.concatenate([mags, -mags])).float()])
        y = softcap(x, cap)
        assert y is not None and cpu_kernels.softcap_f32(x, cap) is not None, "the row kernels did not build"
        ref = (cap * np.tanh(x.double().numpy() / cap)).astype(np.float32)
        ulps = np.abs(y.numpy().view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
        assert ulps.max() <= 1, (cap, float(x[int(np.argmax(ulps))]))
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    got, torch_way = softcap(special, 30.0), torch.tanh(special / 30.0) * 30.0
    assert torch.equal(torch.signbit(got[:4]), torch.signbit(torch_way[:4])) and torch.equal(got[:4], torch_way[:4])
    assert torch.isnan(got[4])


def test_argmax_on_the_cpu_is_torchs_and_flags_every_non_finite_value():
    """The one-pass greedy pick of the CPU decode loop (``fast.cpu_kernels.argmax_f32``) gives torch's argmax (the
    first largest value) on rows of several lengths, ties included, and reports a row that holds a NaN or +-Inf
    anywhere (first, last, in the tail past the 16 lanes)."""
    from gemma4_harness.fast import cpu_kernels

    g = torch.Generator().manual_seed(2)
    for rows, n in [(1, 262144), (3, 1000), (2, 17), (4, 5), (8, 4099)]:
        x = torch.randn(rows, n, generator=g)
        x[0, n // 3] = x[0, n - 1] = 50.0  # a tie: the first one wins
        got = cpu_kernels.argmax_f32(x)
        assert got is not None, "the row kernels did not build"
        assert torch.equal(got[0], x.argmax(-1)) and got[1], (rows, n)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for at in (0, n - 1, n // 2):
                y = x.clone()
                y[rows - 1, at] = bad
                assert cpu_kernels.argmax_f32(y)[1] is False, (rows, n, bad, at)
