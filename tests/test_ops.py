"""The twins op by op, in the style of llama.cpp's test-backend-ops.

Each row of :data:`CASES` names an op (the same function name in ``reference/model.py`` and
``fast/model.py``), its shapes and a dtype; one driver draws random inputs, runs ``reference.model.<op>``
in float64 and ``fast.model.<op>`` in torch, and checks the NMSE against the op's bound in
:data:`harness.core.gates.OP_BOUNDS` (each with its reason). A formula fault in either twin shows here
at the op that has it, before any model-level gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

from fast import model as fm
from harness.core.gates import OP_BOUNDS
from harness.core.metrics import nmse_sum
from reference import model as rm

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{c.dtype}-{c.shapes}")
def test_op_twins(case: OpCase):
    bound = OP_BOUNDS[(case.op, case.dtype)]
    ref_args, fast_args = case.make(np.random.default_rng(hash(case.op) % 2**32), DT[case.dtype])
    ref = getattr(rm, case.op)(*ref_args)
    with torch.inference_mode():
        fast = getattr(fm, case.op)(*fast_args)
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


@pytest.mark.parametrize("window", [16, None])
def test_blocked_attention_equals_the_whole_score_matrix(window):
    """The reference's query blocks (and a sliding layer's window-only keys) give the plain formula's result."""
    rng = np.random.default_rng(1)
    T, H, D = 2 * rm.ATTENTION_BLOCK + 37, 2, 8
    q, k, v = rng.standard_normal((T, H, D)), rng.standard_normal((T, H, D)), rng.standard_normal((T, H, D))
    pos = np.arange(T)
    scores = np.einsum("thd,shd->hts", q, k)
    scores = np.where(rm.attention_mask(pos, pos, window)[None], scores, -np.inf)
    whole = np.einsum("hts,shd->thd", rm.softmax(scores), v).reshape(T, H * D)
    assert np.max(np.abs(rm.attention(q, k, v, pos, pos, window, 1.0) - whole)) <= 1e-12
