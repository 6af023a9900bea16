"""The statistic set that ``llama-perplexity --kl-divergence`` prints, from two logit arrays.

Source: llama.cpp ``tools/perplexity/perplexity.cpp``, function ``kl_divergence`` and its helpers
(mean KLD with its uncertainty, percentiles, same-top-p, perplexity ratio and correlation, Δp); the
field names are llama-perplexity's. :func:`kld_stats` returns :class:`KLDStats`. The per-position pieces
it builds on (log-softmax, KLD per position) are in :mod:`harness.core.metrics`.

Naming: ``ours`` is llama.cpp's ``Q`` (the model under test), ``base`` the base model whose
log-probabilities were saved. Bad input raises :class:`ValueError` with one line naming the shapes or
the offending position.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .metrics import _kld_rows, _log_softmax, _logit_pair

__all__ = ["KLDStats", "kld_stats", "KLD_PERCENTILES", "DP_PERCENTILES"]

# The percentiles llama-perplexity prints, as (field suffix, fraction).
KLD_PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p99_9", 0.999), ("p99_0", 0.990), ("p95_0", 0.950), ("p90_0", 0.900),
    ("p10_0", 0.100), ("p5_0", 0.050), ("p1_0", 0.010), ("p0_1", 0.001),
)
DP_PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p99_9", 0.999), ("p99_0", 0.990), ("p95_0", 0.950), ("p90_0", 0.900), ("p75_0", 0.750),
    ("p25_0", 0.250), ("p10_0", 0.100), ("p5_0", 0.050), ("p1_0", 0.010), ("p0_1", 0.001),
)


# --------------------------------------------------------------------------- llama.cpp statistics helpers


def _mean_and_uncertainty(v: np.ndarray) -> tuple[float, float]:
    """llama.cpp ``mean_and_uncertainty(sum, sum2, count)``.

    mean = sum/n; unc = sqrt((sum2/n - mean^2) / (n - 1)) when that variance
    is > 0 and n > 10, else 0 -- i.e. the standard error of the mean,
    sqrt(population variance / (n - 1)) = sample std / sqrt(n). The variance is
    computed two-pass (``np.var``) rather than as sum2/n - mean^2: same
    quantity, without the cancellation.
    """
    n = v.size
    with np.errstate(invalid="ignore", over="ignore"):
        f = float(np.mean(v))
        var = float(np.var(v)) if n > 10 else 0.0
    if var != var:  # an inf among the values (e.g. a masked next token): no finite spread
        return f, math.nan
    df = math.sqrt(var / (n - 1)) if (var > 0 and n > 10) else 0.0
    return f, df


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp ``covariance(suma, sumb, sumab, count)``: ``(mean(ab) - mean(a) mean(b)) / (n - 1)``, 0 when n < 10.

    It is the covariance of the two *means* (population covariance / (n - 1)),
    the term the uncertainty of ln(PPL(Q)/PPL(base)) needs. Two-pass here.
    """
    n = a.size
    if n < 10:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.mean((a - np.mean(a)) * (b - np.mean(b))) / (n - 1))


def _percentile(sorted_v: np.ndarray, fraction: float) -> float:
    """llama.cpp ``percentile(values, fraction)`` on sorted values: linear interpolation.

    ``fraction <= 0`` gives the min, ``>= 1`` the max; otherwise
    ``p = fraction * (n - 1)``, ``ip = floor(p)``, result
    ``(1 - (p - ip)) * v[ip] + (p - ip) * v[min(ip + 1, n - 1)]`` -- numpy's
    ``method="linear"``. Written as ``v[ip] + t * (v[ip+1] - v[ip])`` and kept
    inside ``[v[ip], v[ip+1]]`` so that rounding never breaks monotonicity
    and equal or infinite neighbours need no ``0 * inf``. (llama.cpp passes
    the fraction as float32, e.g. ``0.999f``; here it is float64.)
    """
    n = sorted_v.size
    if fraction <= 0:
        return float(sorted_v[0])
    if fraction >= 1:
        return float(sorted_v[-1])
    p = fraction * (n - 1)
    ip = int(math.floor(p))
    t = p - ip
    lo, hi = float(sorted_v[ip]), float(sorted_v[min(ip + 1, n - 1)])
    if t == 0 or lo == hi:
        return lo
    return min(max(lo + t * (hi - lo), lo), hi)


def _median(sorted_v: np.ndarray) -> float:
    """llama.cpp's median: the middle value, or the mean of the two middle values for even n."""
    n = sorted_v.size
    if n % 2:
        return float(sorted_v[n // 2])
    lo, hi = float(sorted_v[n // 2 - 1]), float(sorted_v[n // 2])
    return lo if lo == hi else 0.5 * (lo + hi)


# --------------------------------------------------------------------------- KLD statistic set


@dataclass(frozen=True)
class KLDStats:
    """The ``llama-perplexity --kl-divergence`` statistic set (final summary).

    Field names are llama-perplexity's printed labels, snake_cased; ``Q`` is
    ``ours``. ``_unc`` is the "±" figure printed next to a value. Quantities
    llama.cpp prints in percent (everything about Δp, and "Same top p") are
    stored in percent and carry a ``_pct`` suffix; the rest are plain numbers
    (KLD in nats). Percentile fields are ``<what>_p<percent>`` with ``.``
    written ``_`` (``kld_p99_9`` is "99.9%   KLD").

    Fields that need the next-token ids (perplexities, Δp) are ``None`` when
    :func:`kld_stats` got no ``tokens``; ``cor_ln_ppl`` is also ``None`` when
    one of the log-PPL uncertainties is 0 (undefined correlation).
    """

    n: int
    # ====== KL divergence statistics ======
    mean_kld: float
    mean_kld_unc: float
    maximum_kld: float
    kld_p99_9: float
    kld_p99_0: float
    kld_p95_0: float
    kld_p90_0: float
    median_kld: float
    kld_p10_0: float
    kld_p5_0: float
    kld_p1_0: float
    kld_p0_1: float
    minimum_kld: float
    same_top_p_pct: float
    same_top_p_pct_unc: float
    # ====== Perplexity statistics ====== (tokens only)
    mean_ppl_q: float | None = None
    mean_ppl_q_unc: float | None = None
    mean_ppl_base: float | None = None
    mean_ppl_base_unc: float | None = None
    cor_ln_ppl: float | None = None
    mean_ln_ppl_ratio: float | None = None
    mean_ln_ppl_ratio_unc: float | None = None
    mean_ppl_ratio: float | None = None
    mean_ppl_ratio_unc: float | None = None
    mean_ppl_diff: float | None = None
    mean_ppl_diff_unc: float | None = None
    # ====== Token probability statistics ====== (tokens only; percent)
    mean_dp_pct: float | None = None
    mean_dp_pct_unc: float | None = None
    maximum_dp_pct: float | None = None
    dp_pct_p99_9: float | None = None
    dp_pct_p99_0: float | None = None
    dp_pct_p95_0: float | None = None
    dp_pct_p90_0: float | None = None
    dp_pct_p75_0: float | None = None
    median_dp_pct: float | None = None
    dp_pct_p25_0: float | None = None
    dp_pct_p10_0: float | None = None
    dp_pct_p5_0: float | None = None
    dp_pct_p1_0: float | None = None
    dp_pct_p0_1: float | None = None
    minimum_dp_pct: float | None = None
    rms_dp_pct: float | None = None
    rms_dp_pct_unc: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (``int`` / ``float`` / ``None``), in declaration order."""
        return asdict(self)


def kld_stats(ours: Any, base: Any, tokens: Any | None = None) -> KLDStats:
    """The ``llama-perplexity --kl-divergence`` statistics of ``ours`` against ``base``.

    Source: llama.cpp ``tools/perplexity/perplexity.cpp``, function
    ``kl_divergence`` and its helpers (``log_softmax`` with the
    ``kl_divergence_result`` accumulator, ``mean_and_uncertainty``,
    ``covariance``, ``percentile``). Definitions, with ``n`` positions:

    * ``KLD_i`` as in :func:`kld_per_position`. Mean KLD ± SEM, where
      SEM = ``sqrt((mean(x^2) - mean(x)^2) / (n - 1))`` and is reported as 0
      when n <= 10 (llama.cpp's ``mean_and_uncertainty``). Maximum, minimum,
      median (middle value / mean of the two middle ones) and the
      99.9/99/95/90/10/5/1/0.1 percentiles by linear interpolation between
      the sorted values (``p = f*(n-1)``; numpy's ``"linear"``).
    * Same top p: ``100 * k/n`` with ``k`` the positions whose argmax agrees
      (:func:`top1_agreement`), ± ``100 * sqrt(p(1-p)/(n-1))`` (binomial SE,
      no n > 10 rule; for n == 1 it is 0 where llama.cpp computes 0/0).
    * With ``tokens`` (``tokens[i]`` is the token that follows position
      ``i``, i.e. llama.cpp's ``tokens[i+1]``): ``nll_i = -log p_ours[i,
      tokens[i]]``, ``nll_base_i`` likewise. ``ln PPL(Q) = mean(nll)`` ±
      SEM; PPL(Q) = exp of it, ± ``PPL * SEM``; same for base.
      ``cov`` = llama.cpp ``covariance`` (0 when n < 10). ln(PPL(Q)/PPL(base))
      = difference of the means ± ``sqrt(unc_q^2 + unc_base^2 - 2 cov)``;
      PPL ratio = exp of it ± ratio * that; PPL(Q)-PPL(base) ±
      ``sqrt(ppl_unc^2 + ppl_base_unc^2 - 2 PPL PPL_base cov)``; Cor =
      ``cov / (unc_q unc_base)``. Square roots of rounding-negative arguments
      give 0 (llama.cpp would give NaN).
    * Δp: ``dp_i = p_ours[i, tokens[i]] - p_base[i, tokens[i]]`` -- the
      probability of the *evaluated* next token, ours minus base. Mean Δp ±
      SEM, percentiles (99.9/99/95/90/75/median/25/10/5/1/0.1, max, min) as
      for KLD, and RMS Δp = ``sqrt(mean(dp^2))`` ± ``0.5/RMS * SEM(dp^2)``
      (0 when RMS == 0). All in percent.

    Unlike llama.cpp the statistics are computed for any ``n >= 1`` (it only
    prints the summary from 100 positions on), over every position given (it
    scores only the second half of each context chunk: pick the rows before
    calling), and in float64 throughout.

    Args:
        ours: logits under test, ``[N, V]``, any float dtype; finite or ``-inf``.
        base: reference logits, same shape.
        tokens: optional ``[N]`` integer next-token ids in ``[0, V)``.

    Raises:
        ValueError: logits not 2-D / shapes differ / empty / NaN or +inf / an
            all-``-inf`` row; tokens of the wrong shape, not integer, or out of range.
    """
    x, y = _logit_pair(ours, base)
    n, v = x.shape
    lp_q, lp_b = _log_softmax(x), _log_softmax(y)
    kld = _kld_rows(lp_q, lp_b)
    ks = np.sort(kld)
    mean_kld, mean_kld_unc = _mean_and_uncertainty(kld)

    same = float(np.mean(np.argmax(x, axis=1) == np.argmax(y, axis=1)))
    same_unc = math.sqrt(max(same * (1.0 - same), 0.0) / (n - 1)) if n > 1 else 0.0

    fields: dict[str, Any] = dict(
        n=int(n),
        mean_kld=mean_kld,
        mean_kld_unc=mean_kld_unc,
        maximum_kld=float(ks[-1]),
        median_kld=_median(ks),
        minimum_kld=float(ks[0]),
        same_top_p_pct=100.0 * same,
        same_top_p_pct_unc=100.0 * same_unc,
    )
    for name, f in KLD_PERCENTILES:
        fields[f"kld_{name}"] = _percentile(ks, f)

    if tokens is not None:
        t = _tokens(tokens, n, v)
        rows = np.arange(n)
        nll = -lp_q[rows, t]
        nll_b = -lp_b[rows, t]
        fields.update(_ppl_fields(nll, nll_b))
        fields.update(_dp_fields(np.exp(-nll) - np.exp(-nll_b)))
    return KLDStats(**fields)


def _tokens(tokens: Any, n: int, v: int) -> np.ndarray:
    t = np.asarray(tokens.detach().cpu().numpy() if hasattr(tokens, "detach") else tokens)
    if t.shape != (n,):
        raise ValueError(f"shape mismatch: tokens has shape {t.shape}, logits have {n} positions (want ({n},))")
    if t.dtype.kind not in "iu":
        if t.dtype.kind == "f" and np.all(np.isfinite(t)) and np.all(t == np.round(t)):
            t = t.astype(np.int64)
        else:
            raise ValueError(f"tokens must be integer ids, got dtype {t.dtype} with shape {t.shape}")
    bad = (t < 0) | (t >= v)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"tokens[{i}] = {int(t[i])} is outside the vocabulary [0, {v}) of logits with shape ({n}, {v})")
    return t.astype(np.int64)


def _sqrt0(x: float) -> float:
    """sqrt, 0 for a (rounding-)negative argument, NaN stays NaN."""
    return math.sqrt(x) if x > 0 else (x if x != x else 0.0)


def _ppl_fields(nll: np.ndarray, nll_b: np.ndarray) -> dict[str, Any]:
    with np.errstate(over="ignore", invalid="ignore"):
        lq, lq_unc = _mean_and_uncertainty(nll)
        lb, lb_unc = _mean_and_uncertainty(nll_b)
        cov = _covariance(nll, nll_b)
        ppl_q, ppl_b = _exp(lq), _exp(lb)
        ppl_q_unc, ppl_b_unc = ppl_q * lq_unc, ppl_b * lb_unc
        denom = lq_unc * lb_unc
        cor = cov / denom if denom > 0 else None
        ratio = lq - lb
        ratio_unc = _sqrt0(lq_unc * lq_unc + lb_unc * lb_unc - 2.0 * cov)
        ppl_ratio = _exp(ratio)
        diff_unc = _sqrt0(ppl_q_unc ** 2 + ppl_b_unc ** 2 - 2.0 * ppl_q * ppl_b * cov)
    return dict(
        mean_ppl_q=ppl_q, mean_ppl_q_unc=ppl_q_unc,
        mean_ppl_base=ppl_b, mean_ppl_base_unc=ppl_b_unc,
        cor_ln_ppl=cor,
        mean_ln_ppl_ratio=ratio, mean_ln_ppl_ratio_unc=ratio_unc,
        mean_ppl_ratio=ppl_ratio, mean_ppl_ratio_unc=ppl_ratio * ratio_unc,
        mean_ppl_diff=ppl_q - ppl_b, mean_ppl_diff_unc=diff_unc,
    )


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _dp_fields(dp: np.ndarray) -> dict[str, Any]:
    ds = np.sort(dp)
    mean_dp, mean_dp_unc = _mean_and_uncertainty(dp)
    mse, mse_unc = _mean_and_uncertainty(dp * dp)
    rms = math.sqrt(mse)
    rms_unc = 0.5 / rms * mse_unc if rms > 0 else 0.0
    out: dict[str, Any] = dict(
        mean_dp_pct=100.0 * mean_dp, mean_dp_pct_unc=100.0 * mean_dp_unc,
        maximum_dp_pct=100.0 * float(ds[-1]),
        median_dp_pct=100.0 * _median(ds),
        minimum_dp_pct=100.0 * float(ds[0]),
        rms_dp_pct=100.0 * rms, rms_dp_pct_unc=100.0 * rms_unc,
    )
    for name, f in DP_PERCENTILES:
        out[f"dp_pct_{name}"] = 100.0 * _percentile(ds, f)
    return out
