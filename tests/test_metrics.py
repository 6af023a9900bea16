"""harness.core.metrics: hand-derived values, properties, a torch cross-check, bad input.

Expected values are derived in each test with plain ``math`` arithmetic on a
tiny explicit example, never copied from the implementation.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gemma4_harness.harness.core import kld as K
from gemma4_harness.harness.core import metrics as M

FAST = settings(max_examples=60, deadline=None)


# --------------------------------------------------------------------------- hand-computed: elementwise


def test_cosine_by_hand():
    a, b = [1.0, 2.0, 3.0], [1.0, 0.0, -1.0]
    dot = 1 * 1 + 2 * 0 + 3 * (-1)  # -2
    expected = dot / (math.sqrt(1 + 4 + 9) * math.sqrt(1 + 0 + 1))
    assert M.cosine(a, b) == pytest.approx(expected, rel=1e-15)
    # flattening: a 2-D input is the same as its flattened form
    assert M.cosine(np.array(a + [0.0]).reshape(2, 2), np.array(b + [5.0]).reshape(2, 2)) == pytest.approx(
        dot / (math.sqrt(14) * math.sqrt(2 + 25)), rel=1e-15)


def test_cosine_zero_vectors():
    assert M.cosine([0.0, 0.0], [0.0, 0.0]) == 1.0
    assert M.cosine([0.0, 0.0], [1.0, 0.0]) == 0.0


def test_nmse_sum_by_hand():
    a, ref = [1.0, 2.0, 3.0], [1.0, 1.0, 1.0]
    num = (1 - 1) ** 2 + (2 - 1) ** 2 + (3 - 1) ** 2  # 5
    den = 1 + 1 + 1
    assert M.nmse_sum(a, ref) == pytest.approx(num / den, rel=1e-15)
    assert M.nmse_sum([0.0, 0.0], [0.0, 0.0]) == 0.0
    assert M.nmse_sum([1.0, 0.0], [0.0, 0.0]) == math.inf


def test_nmse_var_by_hand():
    a, ref = [1.0, 2.0, 3.0], [1.0, 2.0, 4.0]
    mse = ((1 - 1) ** 2 + (2 - 2) ** 2 + (3 - 4) ** 2) / 3  # 1/3
    mean = (1 + 2 + 4) / 3
    var = ((1 - mean) ** 2 + (2 - mean) ** 2 + (4 - mean) ** 2) / 3  # population variance, 14/9
    assert M.nmse_var(a, ref) == pytest.approx(mse / var, rel=1e-14)
    # zero-variance reference: check-nmse.py's rule
    assert M.nmse_var([2.0, 2.0], [2.0, 2.0]) == 0.0
    assert M.nmse_var([2.0, 3.0], [2.0, 2.0]) == math.inf


def test_max_abs_and_rel_err_by_hand():
    a, ref = [1.0, 0.5, -3.0], [2.0, 0.0, -3.5]
    assert M.max_abs_err(a, ref) == pytest.approx(max(abs(1 - 2), abs(0.5 - 0), abs(-3 + 3.5)))
    eps = 0.1
    # denominators: max(|ref|, eps) = 2, 0.1 (floored), 3.5
    expected = max(abs(1 - 2) / 2, abs(0.5 - 0) / eps, abs(-3 + 3.5) / 3.5)  # 5.0, from the floored element
    assert M.max_rel_err(a, ref, eps=eps) == pytest.approx(expected, rel=1e-15)
    # with a tiny eps the floored element dominates even more
    assert M.max_rel_err(a, ref, eps=1e-6) == pytest.approx(0.5 / 1e-6, rel=1e-12)
    assert math.isnan(M.max_abs_err([math.nan, 1.0], [0.0, 1.0]))


def test_rel_l2_by_hand():
    a, ref = [1.0, 2.0, 3.0], [1.0, 2.0, 4.0]
    expected = math.sqrt((3 - 4) ** 2) / math.sqrt(1 + 4 + 16)
    assert M.rel_l2(a, ref) == pytest.approx(expected, rel=1e-15)
    assert M.rel_l2(a, ref) == pytest.approx(math.sqrt(M.nmse_sum(a, ref)), rel=1e-14)


# --------------------------------------------------------------------------- hand-computed: KLD set


def _two_by_three():
    """2 positions x 3 tokens, with softmaxes that are simple fractions.

    base row 0: logits (0, 0, 0)            -> p = (1/3, 1/3, 1/3)
    ours row 0: logits (ln 2, 0, 0)         -> q = (2/4, 1/4, 1/4)
    base row 1: logits (0, ln 2, 0)         -> p = (1/4, 2/4, 1/4)
    ours row 1: logits (0, 0, 0)            -> q = (1/3, 1/3, 1/3)
    """
    base = np.array([[0.0, 0.0, 0.0], [0.0, math.log(2), 0.0]])
    ours = np.array([[math.log(2), 0.0, 0.0], [0.0, 0.0, 0.0]])
    p = [[1 / 3, 1 / 3, 1 / 3], [1 / 4, 1 / 2, 1 / 4]]
    q = [[1 / 2, 1 / 4, 1 / 4], [1 / 3, 1 / 3, 1 / 3]]
    return ours, base, p, q


def test_kld_per_position_by_hand():
    ours, base, p, q = _two_by_three()
    k0 = 1 / 3 * math.log((1 / 3) / (1 / 2)) + 2 * (1 / 3) * math.log((1 / 3) / (1 / 4))
    k1 = 2 * (1 / 4) * math.log((1 / 4) / (1 / 3)) + 1 / 2 * math.log((1 / 2) / (1 / 3))
    got = M.kld_per_position(ours, base)
    assert got.shape == (2,)
    assert got[0] == pytest.approx(k0, rel=1e-13)
    assert got[1] == pytest.approx(k1, rel=1e-13)
    # the direction is KL(base || ours), not the reverse
    k0_rev = sum(q[0][v] * math.log(q[0][v] / p[0][v]) for v in range(3))
    assert abs(k0 - k0_rev) > 1e-3 and got[0] != pytest.approx(k0_rev)


def test_kld_stats_by_hand_two_positions():
    ours, base, p, q = _two_by_three()
    k0 = sum(p[0][v] * math.log(p[0][v] / q[0][v]) for v in range(3))
    k1 = sum(p[1][v] * math.log(p[1][v] / q[1][v]) for v in range(3))
    lo, hi = min(k0, k1), max(k0, k1)
    tokens = [1, 1]
    s = K.kld_stats(ours, base, tokens)
    assert s.n == 2
    assert s.mean_kld == pytest.approx((k0 + k1) / 2, rel=1e-13)
    assert s.mean_kld_unc == 0.0  # llama.cpp reports no uncertainty for n <= 10
    assert s.maximum_kld == pytest.approx(hi, rel=1e-13)
    assert s.minimum_kld == pytest.approx(lo, rel=1e-13)
    assert s.median_kld == pytest.approx((k0 + k1) / 2, rel=1e-13)  # even n: mean of the two middle values
    # linear interpolation between sorted values: position f*(n-1) = f
    for name, f in [("p99_9", 0.999), ("p99_0", 0.99), ("p90_0", 0.9), ("p10_0", 0.1), ("p0_1", 0.001)]:
        assert getattr(s, f"kld_{name}") == pytest.approx(lo + f * (hi - lo), rel=1e-13), name
    # top-1: row 0 both argmax 0 (ours strictly, base by first-index tie-break); row 1 base 1, ours 0
    assert s.same_top_p_pct == pytest.approx(50.0)
    assert s.same_top_p_pct_unc == pytest.approx(100 * math.sqrt(0.5 * 0.5 / (2 - 1)))
    # PPL with next tokens (1, 1): q = (1/4, 1/3), p = (1/3, 1/2)
    ppl_q = math.exp(-(math.log(1 / 4) + math.log(1 / 3)) / 2)  # sqrt(12)
    ppl_b = math.exp(-(math.log(1 / 3) + math.log(1 / 2)) / 2)  # sqrt(6)
    assert s.mean_ppl_q == pytest.approx(math.sqrt(12), rel=1e-13) and ppl_q == pytest.approx(math.sqrt(12))
    assert s.mean_ppl_base == pytest.approx(ppl_b, rel=1e-13)
    assert s.mean_ppl_ratio == pytest.approx(ppl_q / ppl_b, rel=1e-13)  # sqrt(2)
    assert s.mean_ln_ppl_ratio == pytest.approx(0.5 * math.log(2), rel=1e-13)
    assert s.mean_ppl_diff == pytest.approx(ppl_q - ppl_b, rel=1e-13)
    assert s.mean_ln_ppl_ratio_unc == 0.0 and s.mean_ppl_q_unc == 0.0
    assert s.cor_ln_ppl is None  # uncertainties are 0 at n <= 10
    # Δp of the evaluated token: ours - base
    dp = [1 / 4 - 1 / 3, 1 / 3 - 1 / 2]  # -1/12, -1/6
    assert s.mean_dp_pct == pytest.approx(100 * (dp[0] + dp[1]) / 2, rel=1e-13)
    assert s.maximum_dp_pct == pytest.approx(100 * max(dp), rel=1e-13)
    assert s.minimum_dp_pct == pytest.approx(100 * min(dp), rel=1e-13)
    assert s.median_dp_pct == pytest.approx(100 * (dp[0] + dp[1]) / 2, rel=1e-13)
    assert s.dp_pct_p75_0 == pytest.approx(100 * (min(dp) + 0.75 * (max(dp) - min(dp))), rel=1e-13)
    assert s.rms_dp_pct == pytest.approx(100 * math.sqrt((dp[0] ** 2 + dp[1] ** 2) / 2), rel=1e-13)
    assert s.rms_dp_pct_unc == 0.0
    d = s.as_dict()
    assert d["n"] == 2 and d["mean_kld"] == s.mean_kld and len(d) == len(K.KLDStats.__dataclass_fields__)


def test_kld_stats_without_tokens_leaves_token_fields_none():
    ours, base, _, _ = _two_by_three()
    s = K.kld_stats(ours, base)
    assert s.mean_ppl_q is None and s.mean_ppl_ratio is None and s.rms_dp_pct is None
    assert s.mean_kld > 0


def _hand_rows(n: int):
    """n positions x 3 tokens with per-row shifts, and their softmaxes computed with math.exp."""
    ours, base = [], []
    for i in range(n):
        b = [0.0, 0.3 * i, -0.2 * (i % 4)]
        o = [0.1 * (i % 3), 0.3 * i - 0.15 * (i % 2), -0.2 * (i % 4) + 0.05 * i]
        base.append(b)
        ours.append(o)

    def sm(row):
        z = sum(math.exp(x) for x in row)
        return [math.exp(x) / z for x in row]

    return np.array(ours), np.array(base), [sm(r) for r in ours], [sm(r) for r in base]


def test_kld_stats_uncertainties_by_hand():
    """n = 12 > 10: the uncertainties are standard errors; derive them with the statistics module."""
    n = 12
    ours, base, q, p = _hand_rows(n)
    tokens = [i % 3 for i in range(n)]
    kld = [sum(p[i][v] * math.log(p[i][v] / q[i][v]) for v in range(3)) for i in range(n)]
    s = K.kld_stats(ours, base, tokens)
    assert s.mean_kld == pytest.approx(statistics.fmean(kld), rel=1e-12)
    # llama.cpp: sqrt((E[x^2] - E[x]^2) / (n-1)) == sample stdev / sqrt(n)
    assert s.mean_kld_unc == pytest.approx(statistics.stdev(kld) / math.sqrt(n), rel=1e-10)

    same = sum(max(range(3), key=lambda v: (q[i][v], -v)) == max(range(3), key=lambda v: (p[i][v], -v))
               for i in range(n))
    frac = same / n
    assert s.same_top_p_pct == pytest.approx(100 * frac)
    assert s.same_top_p_pct_unc == pytest.approx(100 * math.sqrt(frac * (1 - frac) / (n - 1)), rel=1e-12)

    nll = [-math.log(q[i][tokens[i]]) for i in range(n)]
    nll_b = [-math.log(p[i][tokens[i]]) for i in range(n)]
    se_q = statistics.stdev(nll) / math.sqrt(n)
    assert s.mean_ppl_q == pytest.approx(math.exp(statistics.fmean(nll)), rel=1e-12)
    assert s.mean_ppl_q_unc == pytest.approx(math.exp(statistics.fmean(nll)) * se_q, rel=1e-10)
    # Var(mean(a) - mean(b)) = var(a)/n + var(b)/n - 2 cov(a,b)/n = var(a - b)/n (sample variances)
    diff = [a - b for a, b in zip(nll, nll_b)]
    assert s.mean_ln_ppl_ratio == pytest.approx(statistics.fmean(diff), rel=1e-12)
    assert s.mean_ln_ppl_ratio_unc == pytest.approx(statistics.stdev(diff) / math.sqrt(n), rel=1e-9)
    assert s.mean_ppl_ratio_unc == pytest.approx(
        math.exp(statistics.fmean(diff)) * statistics.stdev(diff) / math.sqrt(n), rel=1e-9)
    assert s.cor_ln_ppl == pytest.approx(statistics.correlation(nll, nll_b), rel=1e-9)

    dp = [q[i][tokens[i]] - p[i][tokens[i]] for i in range(n)]
    assert s.mean_dp_pct_unc == pytest.approx(100 * statistics.stdev(dp) / math.sqrt(n), rel=1e-10)
    dp2 = [x * x for x in dp]
    rms = math.sqrt(statistics.fmean(dp2))
    assert s.rms_dp_pct == pytest.approx(100 * rms, rel=1e-12)
    # d sqrt(m) = dm / (2 sqrt(m))
    assert s.rms_dp_pct_unc == pytest.approx(100 * 0.5 / rms * statistics.stdev(dp2) / math.sqrt(n), rel=1e-9)


def test_uncertainty_threshold_is_llama_cpp_count_gt_10():
    ours, base, _, _ = _hand_rows(11)
    assert K.kld_stats(ours[:10], base[:10]).mean_kld_unc == 0.0
    assert K.kld_stats(ours, base).mean_kld_unc > 0.0


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(3)
    base = rng.normal(size=(37, 11)) * 2
    ours = base + rng.normal(size=base.shape) * 0.3
    s = K.kld_stats(ours, base)
    k = M.kld_per_position(ours, base)
    for name, f in K.KLD_PERCENTILES:
        assert getattr(s, f"kld_{name}") == pytest.approx(np.percentile(k, 100 * f, method="linear"), rel=1e-12)
    assert s.median_kld == pytest.approx(np.median(k), rel=1e-12)


def test_top1_agreement_by_hand():
    ours = np.array([[3.0, 1.0], [0.0, 2.0], [5.0, 5.0], [1.0, 0.0]])
    base = np.array([[2.0, 1.0], [3.0, 2.0], [4.0, 4.0], [0.0, 1.0]])
    # argmax ours: 0, 1, 0 (tie -> lowest id), 0; base: 0, 0, 0, 1 -> rows 0 and 2 agree
    assert M.top1_agreement(ours, base) == pytest.approx(2 / 4)


def test_masked_entries_and_large_logits():
    # -inf on both sides at the same entries: same KLD as on the vocabulary without them
    base = np.array([[1.0, -np.inf, 0.5, 2.0], [0.0, -np.inf, -np.inf, 1.0]])
    ours = np.array([[1.2, -np.inf, 0.4, 1.9], [0.1, -np.inf, -np.inf, 1.0]])
    got = M.kld_per_position(ours, base)
    for i, keep in enumerate([[0, 2, 3], [0, 3]]):
        zb = sum(math.exp(base[i, v]) for v in keep)
        zo = sum(math.exp(ours[i, v]) for v in keep)
        expected = sum(math.exp(base[i, v]) / zb * ((base[i, v] - math.log(zb)) - (ours[i, v] - math.log(zo)))
                       for v in keep)
        assert got[i] == pytest.approx(expected, rel=1e-12)
    # ours masks a token the base gives mass to: infinite divergence
    assert M.kld_per_position(np.array([[0.0, -np.inf]]), np.array([[0.0, 0.0]]))[0] == math.inf
    # ours masks a token whose base mass underflows to 0 (exp(-1e4)): it contributes nothing, in that row only
    under = M.kld_per_position(np.array([[0.0, -np.inf, 1.0], [0.0, 0.0, 1.0]]),
                               np.array([[0.0, -1e4, 1.0], [0.0, -1e4, 1.0]]))
    assert under[0] == pytest.approx(0.0, abs=1e-15) and 0 < under[1] < 1 and np.all(np.isfinite(under))
    # logits of size 1e4: a constant shift changes nothing, a real change is finite and exact
    big = np.array([[1e4, -1e4, 9999.0], [-1e4, 1e4 - 1.0, 1e4]])
    assert np.all(M.kld_per_position(big + 1234.5, big) <= 1e-12)
    k = M.kld_per_position(big[:, [0, 2, 1]], big)
    e = math.e
    # row 0: p = (e, ~0, 1)/(1+e); q = (e, 1, ~0)/(1+e), log q_2 - log p_2 = (-1e4 - 9999) = -19999.
    # Only p_2 contributes (p_0 = q_0; p_1 = exp(-2e4) underflows to 0).
    assert k[0] == pytest.approx(1 / (1 + e) * 19999, rel=1e-12)
    # row 1: p = (0, 1, e)/(1+e), q swaps the last two: (e-1)/(e+1) * (log e - log 1)
    assert k[1] == pytest.approx((e - 1) / (e + 1), rel=1e-12)


# --------------------------------------------------------------------------- torch cross-check


def test_kld_and_top1_match_torch():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(200, 97, generator=g, dtype=torch.float64) * 3
    ours = base + torch.randn(base.shape, generator=g, dtype=torch.float64) * 0.5
    lq = torch.log_softmax(ours, dim=-1)
    lp = torch.log_softmax(base, dim=-1)
    per_pos = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)
    same = (ours.argmax(-1) == base.argmax(-1)).double().mean().item()
    s = K.kld_stats(ours.numpy(), base.numpy())
    assert s.mean_kld == pytest.approx(per_pos.mean().item(), rel=1e-12)
    np.testing.assert_allclose(M.kld_per_position(ours, base), per_pos.numpy(), rtol=1e-11, atol=1e-15)
    assert s.same_top_p_pct == pytest.approx(100 * same)
    assert 0 < same < 1
    # float32 input is accepted and promoted
    s32 = K.kld_stats(ours.float().numpy(), base.float().numpy())
    assert s32.mean_kld == pytest.approx(s.mean_kld, rel=1e-4)


# --------------------------------------------------------------------------- properties


def _logits(n_max=5, v_max=8, lo=-1e4, hi=1e4):
    shapes = st.tuples(st.integers(1, n_max), st.integers(2, v_max))
    return shapes.flatmap(lambda sh: hnp.arrays(np.float64, sh, elements=st.floats(lo, hi)))


@FAST
@given(base=_logits(), shift=st.floats(-1e3, 1e3), data=st.data())
def test_kld_zero_for_equal_distributions(base, shift, data):
    per_row = data.draw(hnp.arrays(np.float64, (base.shape[0], 1), elements=st.floats(-1e3, 1e3)))
    ours = base + shift + per_row
    k = M.kld_per_position(ours, base)
    assert np.all(k >= 0)
    assert np.all(k <= 1e-12)


@FAST
@given(base=_logits(lo=-5, hi=5), data=st.data())
def test_kld_positive_for_different_distributions(base, data):
    delta = data.draw(hnp.arrays(np.float64, base.shape, elements=st.floats(-3, 3)))
    ours = base + delta
    k = M.kld_per_position(ours, base)
    assert np.all(k >= 0)
    spread = delta.max(axis=1) - delta.min(axis=1)
    differs = spread >= 0.5  # not a constant shift: the softmaxes differ
    assert np.all(k[differs] > 1e-12)
    assert np.all(k[spread == 0] <= 1e-12)


# zero or clearly normal: a scale of 1e-3 must not push an element into underflow
_elem = st.floats(-1e3, 1e3).filter(lambda x: x == 0 or abs(x) > 1e-100)


@FAST
@given(
    a=hnp.arrays(np.float64, st.integers(1, 20), elements=_elem),
    data=st.data(),
    scale=st.floats(1e-3, 1e3),
)
def test_cosine_scale_and_sign(a, data, scale):
    b = data.draw(hnp.arrays(np.float64, a.shape, elements=_elem))
    c = M.cosine(a, b)
    assert -1.0 <= c <= 1.0
    assert M.cosine(a * scale, b) == pytest.approx(c, abs=1e-12)
    assert M.cosine(a, b * scale) == pytest.approx(c, abs=1e-12)
    if np.any(a != 0) and np.any(b != 0):
        assert M.cosine(-a, b) == -c
        assert M.cosine(a, -b) == -c


@FAST
@given(a=hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6),
                    elements=st.floats(-1e6, 1e6)))
def test_self_comparisons_are_exact(a):
    assert M.nmse_sum(a, a) == 0.0
    assert M.nmse_var(a, a) == 0.0
    assert M.max_abs_err(a, a) == 0.0
    assert M.max_rel_err(a, a) == 0.0
    assert M.rel_l2(a, a) == 0.0


@FAST
@given(x=_logits(n_max=30, v_max=6))
def test_same_top1_identical_is_100_percent(x):
    s = K.kld_stats(x, x)
    assert s.same_top_p_pct == 100.0 and s.same_top_p_pct_unc == 0.0
    assert M.top1_agreement(x, x) == 1.0
    assert s.mean_kld == 0.0 and s.maximum_kld == 0.0


@FAST
@given(base=_logits(n_max=60, v_max=6, lo=-20, hi=20), data=st.data())
def test_percentiles_monotone(base, data):
    ours = base + data.draw(hnp.arrays(np.float64, base.shape, elements=st.floats(-4, 4)))
    tokens = data.draw(hnp.arrays(np.int64, base.shape[0], elements=st.integers(0, base.shape[1] - 1)))
    s = K.kld_stats(ours, base, tokens)
    chain = [s.minimum_kld, s.kld_p0_1, s.kld_p1_0, s.kld_p5_0, s.kld_p10_0, s.median_kld,
             s.kld_p90_0, s.kld_p95_0, s.kld_p99_0, s.kld_p99_9, s.maximum_kld]
    assert all(x <= y for x, y in zip(chain, chain[1:])), chain
    dp = [s.minimum_dp_pct, s.dp_pct_p0_1, s.dp_pct_p1_0, s.dp_pct_p5_0, s.dp_pct_p10_0, s.dp_pct_p25_0,
          s.median_dp_pct, s.dp_pct_p75_0, s.dp_pct_p90_0, s.dp_pct_p95_0, s.dp_pct_p99_0, s.dp_pct_p99_9,
          s.maximum_dp_pct]
    assert all(x <= y for x, y in zip(dp, dp[1:])), dp
    assert s.mean_kld_unc >= 0 and s.rms_dp_pct >= 0 and s.mean_ln_ppl_ratio_unc >= 0


# --------------------------------------------------------------------------- greedy agreement


def test_greedy_agreement_by_hand():
    a = [5, 7, 9, 1]
    b = [5, 7, 8, 2]
    topn_a = [[5, 1], [7, 2], [9, 8, 3], [1]]
    topn_b = [[5, 0], [7, 3], [8, 9], [2]]
    r = M.greedy_agreement(a, b, topn_a, topn_b, n=5)
    # step 2: a=9 is in b's top (8, 9), b=8 is in a's top (9, 8, 3) -> pass; step 3 is never compared
    assert r.agree and r.first_mismatch == 2 and r.n_compared == 3
    # n=1 keeps only the top token: 9 not in [8] -> fail
    r1 = M.greedy_agreement(a, b, topn_a, topn_b, n=1)
    assert not r1.agree and r1.first_mismatch == 2 and "top-1" in r1.reason
    # one-sided membership fails
    r2 = M.greedy_agreement(a, b, [[5], [7], [9, 3], [1]], topn_b)
    assert not r2.agree and "b's 8 not in a's top-5" in r2.reason
    # identical prefix, different lengths: passes as vLLM's zip does
    r3 = M.greedy_agreement([1, 2, 3], [1, 2], [[1], [2], [3]], [[1], [2]])
    assert r3.agree and r3.first_mismatch is None and r3.n_compared == 2


_stream = st.lists(st.integers(0, 4), min_size=1, max_size=8)
_topn = st.lists(st.integers(0, 4), min_size=0, max_size=5)


@FAST
@given(ta=_stream, tb=_stream, data=st.data(), n=st.integers(1, 5))
def test_greedy_agreement_symmetric(ta, tb, data, n):
    pa = data.draw(st.lists(_topn, min_size=len(ta), max_size=len(ta)))
    pb = data.draw(st.lists(_topn, min_size=len(tb), max_size=len(tb)))
    ab = M.greedy_agreement(ta, tb, pa, pb, n=n)
    ba = M.greedy_agreement(tb, ta, pb, pa, n=n)
    assert ab.agree == ba.agree
    assert ab.first_mismatch == ba.first_mismatch and ab.n_compared == ba.n_compared


@FAST
@given(ta=_stream, data=st.data(), n=st.integers(1, 5))
def test_greedy_identical_streams_agree(ta, data, n):
    pa = data.draw(st.lists(_topn, min_size=len(ta), max_size=len(ta)))
    pb = data.draw(st.lists(_topn, min_size=len(ta), max_size=len(ta)))
    r = M.greedy_agreement(ta, list(ta), pa, pb, n=n)
    assert r.agree and r.first_mismatch is None and r.n_compared == len(ta)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fn", [M.cosine, M.nmse_sum, M.nmse_var, M.max_abs_err, M.max_rel_err, M.rel_l2])
def test_elementwise_bad_input(fn):
    with pytest.raises(ValueError, match=r"shape mismatch.*\(2, 3\).*\(3, 2\)"):
        fn(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"empty input.*\(0,\)"):
        fn(np.zeros(0), np.zeros(0))


@pytest.mark.parametrize("fn", [M.kld_per_position, M.top1_agreement, K.kld_stats])
def test_kld_bad_input(fn):
    with pytest.raises(ValueError, match=r"shape mismatch.*\(2, 3\).*\(2, 4\)"):
        fn(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"empty input.*\(0, 5\)"):
        fn(np.zeros((0, 5)), np.zeros((0, 5)))
    with pytest.raises(ValueError, match=r"2-D.*\(6,\)"):
        fn(np.zeros(6), np.zeros(6))
    with pytest.raises(ValueError, match=r"nan at \[1, 2\]"):
        fn(np.zeros((2, 3)), np.array([[0.0, 0, 0], [0, 0, math.nan]]))
    with pytest.raises(ValueError, match=r"row 0 is all -inf"):
        fn(np.full((1, 3), -np.inf), np.zeros((1, 3)))


def test_kld_stats_bad_tokens():
    x = np.zeros((2, 3))
    with pytest.raises(ValueError, match=r"tokens has shape \(3,\).*\(2,\)"):
        K.kld_stats(x, x, [0, 1, 2])
    with pytest.raises(ValueError, match=r"tokens\[1\] = 3 is outside.*\(2, 3\)"):
        K.kld_stats(x, x, [0, 3])
    with pytest.raises(ValueError, match=r"integer ids"):
        K.kld_stats(x, x, [0.5, 1.0])


def test_greedy_bad_input():
    with pytest.raises(ValueError, match="empty token stream"):
        M.greedy_agreement([], [1], [], [[1]])
    with pytest.raises(ValueError, match="length mismatch"):
        M.greedy_agreement([1, 2], [1, 2], [[1]], [[1], [2]])
    with pytest.raises(ValueError, match="n must be >= 1"):
        M.greedy_agreement([1], [1], [[1]], [[1]], n=0)
    with pytest.raises(ValueError, match="eps must be > 0"):
        M.max_rel_err([1.0], [1.0], eps=0.0)


def test_top1_margin_is_the_gap_between_the_two_largest():
    z = np.array([[1.0, 5.0, 3.0, 5.0], [0.0, -1.0, 2.5, 2.0], [-np.inf, 0.0, -np.inf, -3.0]])
    assert M.top1_margin(z).tolist() == [0.0, 0.5, 3.0]
    assert M.top1_margin(np.array([[4.0], [1.0]])).tolist() == [0.0, 0.0]
    rng = np.random.default_rng(3)
    for v in (2, 3, 17, 1000):
        z = rng.standard_normal((5, v))
        s = np.sort(z, axis=1)
        assert np.array_equal(M.top1_margin(z), s[:, -1] - s[:, -2])


# --------------------------------------------------------------------------- binned KLD (top-N log-probs)


def test_binned_kld_by_hand():
    """Two named tokens and the rest, worked with math.log: base (0.5, 0.3 | 0.2), ours (0.4, 0.4 | 0.2)."""
    base, ours = [math.log(0.5), math.log(0.3)], [math.log(0.4), math.log(0.4)]
    want = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert M.binned_kld(ours, base) == pytest.approx(want, rel=1e-12)
    # the rest bin counts: ours moves mass out of the named tokens
    ours2 = [math.log(0.5), math.log(0.2)]
    want2 = 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.3)
    assert M.binned_kld(ours2, base) == pytest.approx(want2, rel=1e-12)


@FAST
@given(hnp.arrays(np.float64, st.integers(3, 40), elements=st.floats(-8, 8)),
       hnp.arrays(np.float64, 40, elements=st.floats(-0.5, 0.5)), st.integers(1, 6))
def test_binned_kld_is_a_lower_bound_of_the_full_kld(z, dz, n):
    """Merging tokens never raises the KLD (data processing): the binned KLD of any top-n is at most the full KLD
    of the same rows, and with every token named it is the full KLD (the rest bin then empty on both sides)."""
    base, ours = z, z + dz[: z.size]
    full = float(M.kld_per_position(ours[None], base[None])[0])
    lp_b, lp_o = M.log_softmax(base[None])[0], M.log_softmax(ours[None])[0]
    named = np.argsort(-lp_o)[: min(n, z.size)]
    # the rest floor can only drop a negative rest term, of at most REST_FLOOR / e in size (r ln(r / REST_FLOOR) is
    # least at r = REST_FLOOR / e)
    assert M.binned_kld(lp_o[named], lp_b[named]) <= full + M.REST_FLOOR / math.e + 1e-12
    every = np.arange(z.size)
    assert M.binned_kld(lp_o[every], lp_b[every]) == pytest.approx(full, rel=1e-6, abs=1e-5)


def test_binned_kld_rounding_and_bad_input():
    """float32 log-probs of a peaked row summing a little over 1 are rounding, not an infinite divergence; NaN in
    ours is NaN (never a pass); shapes must agree."""
    base = np.array([-1e-9, -21.0, -22.0])
    ours = np.array([np.float32(-1e-9), 2e-7, -22.0])  # a log-prob above 0 by float32 rounding
    assert 0.0 <= M.binned_kld(ours, base) < 1e-5
    assert math.isnan(M.binned_kld([float("nan"), -1.0], [-0.5, -1.0]))
    with pytest.raises(ValueError, match="1-D arrays of one length"):
        M.binned_kld([-1.0], [-1.0, -2.0])
