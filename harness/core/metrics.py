"""Comparison metrics: one engine's output against a reference.

Every function here is pure NumPy and works in float64 internally, whatever the
input dtype (float16/32/64 arrays, or anything ``np.asarray`` takes; a torch
tensor, bfloat16 included, is read through ``.detach().cpu().double()``).

Three groups (``docs/design.md``, "Metrics"):

* elementwise: :func:`cosine`, :func:`nmse_sum`, :func:`nmse_var`,
  :func:`max_abs_err`, :func:`max_rel_err`, :func:`rel_l2`;
* the statistic set that ``llama-perplexity --kl-divergence`` prints
  (llama.cpp ``tools/perplexity/perplexity.cpp``, function ``kl_divergence``
  and its helpers), from two logit arrays: :func:`kld_stats` returning
  :class:`KLDStats`, with the helpers :func:`kld_per_position` and
  :func:`top1_agreement` (and :func:`kld_histogram`, per-position values
  counted on fixed log bins for the reports);
* vLLM's greedy-stream comparison (``tests/models/utils.py``,
  ``check_logprobs_close``): :func:`greedy_agreement`.

Naming: ``ours`` / ``a`` is the thing under test, ``base`` / ``ref`` the
reference. In llama.cpp's terms ``ours`` is ``Q`` (the quantized model) and
``base`` is the base model whose log-probabilities were saved.

Bad input (shape mismatch, empty arrays, wrong rank, NaN logits, token id out
of range) raises :class:`ValueError` with one line that names the shapes or the
offending position.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "cosine",
    "nmse_sum",
    "nmse_var",
    "max_abs_err",
    "max_rel_err",
    "rel_l2",
    "log_softmax",
    "kld_per_position",
    "kld_histogram",
    "top1_agreement",
    "KLDStats",
    "kld_stats",
    "GreedyAgreement",
    "greedy_agreement",
]

# The percentiles llama-perplexity prints, as (field suffix, fraction).
KLD_PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p99_9", 0.999), ("p99_0", 0.990), ("p95_0", 0.950), ("p90_0", 0.900),
    ("p10_0", 0.100), ("p5_0", 0.050), ("p1_0", 0.010), ("p0_1", 0.001),
)
DP_PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p99_9", 0.999), ("p99_0", 0.990), ("p95_0", 0.950), ("p90_0", 0.900), ("p75_0", 0.750),
    ("p25_0", 0.250), ("p10_0", 0.100), ("p5_0", 0.050), ("p1_0", 0.010), ("p0_1", 0.001),
)


# --------------------------------------------------------------------------- input checks


def _as_f64(x: Any) -> np.ndarray:
    """``x`` as a float64 ndarray (a torch tensor goes through ``.detach().cpu().double()``)."""
    if hasattr(x, "detach") and hasattr(x, "double"):  # torch.Tensor, without importing torch
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _pair(a: Any, b: Any, name_a: str, name_b: str) -> tuple[np.ndarray, np.ndarray]:
    """Both inputs as float64 arrays of one non-empty shape, else ValueError naming the shapes."""
    x, y = _as_f64(a), _as_f64(b)
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {name_a} has shape {x.shape}, {name_b} has shape {y.shape}")
    if x.size == 0:
        raise ValueError(f"empty input: {name_a} has shape {x.shape}, {name_b} has shape {y.shape}")
    return x, y


def _logit_pair(ours: Any, base: Any) -> tuple[np.ndarray, np.ndarray]:
    """Two ``[N, V]`` logit arrays, N >= 1, V >= 1, no NaN or +inf, no all-(-inf) row."""
    x, y = _as_f64(ours), _as_f64(base)
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"logits must be 2-D [positions, vocab]: ours has shape {x.shape}, base has shape {y.shape}")
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: ours has shape {x.shape}, base has shape {y.shape}")
    if x.size == 0:
        raise ValueError(f"empty input: ours has shape {x.shape}, base has shape {y.shape}")
    for name, z in (("ours", x), ("base", y)):
        bad = np.isnan(z) | (z == np.inf)
        if bad.any():
            i, j = (int(k) for k in np.argwhere(bad)[0])
            raise ValueError(f"{name} logits of shape {z.shape} hold {z[i, j]} at [{i}, {j}] (only finite or -inf allowed)")
        dead = np.all(z == -np.inf, axis=1)
        if dead.any():
            raise ValueError(f"{name} logits of shape {z.shape}: row {int(np.argmax(dead))} is all -inf (no distribution)")
    return x, y


# --------------------------------------------------------------------------- elementwise


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of ``a`` and ``b`` over all elements (both flattened).

    Formula: ``sum(a*b) / (||a||_2 * ||b||_2)``, evaluated on ``a/max|a|`` and
    ``b/max|b|`` so that neither the squares nor the product overflow (the
    ratio is unchanged by a positive scale of either side).

    Zero vectors: both all-zero gives 1.0 (identical); exactly one all-zero
    gives 0.0 (as torch ``F.cosine_similarity`` does, whose norm clamp makes
    a zero vector's similarity 0). Source: the usual definition; vLLM uses it
    (``F.cosine_similarity``) in ``check_embeddings_close``.

    Args:
        a, b: arrays of one shape, any float dtype, at least one element.

    Raises:
        ValueError: the shapes differ, or the arrays are empty.
    """
    x, y = _pair(a, b, "a", "b")
    x, y = x.ravel(), y.ravel()
    sx, sy = np.max(np.abs(x)), np.max(np.abs(y))
    if sx == 0 and sy == 0:
        return 1.0
    if sx == 0 or sy == 0:
        return 0.0
    x, y = x / sx, y / sy
    c = float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y)))
    return min(1.0, max(-1.0, c))


def nmse_sum(a: Any, ref: Any) -> float:
    """Normalised MSE, sum form: ``sum((a - ref)^2) / sum(ref^2)``.

    Source: llama.cpp ``tests/test-backend-ops.cpp`` ``nmse(a, b, n)``
    ("mse(a, b) / mse(a, 0)"), the figure test-backend-ops compares with each
    op's ``max_nmse_err``. Note: upstream divides by the sum of squares of its
    *first* argument, which in test-backend-ops is the backend under test
    (``eval(backend, backend_cpu)``); here the denominator is the reference,
    as ``docs/design.md`` specifies. The two agree to first order in the error.

    Zero reference: ``sum(ref^2) == 0`` gives 0.0 when ``a == ref``
    everywhere, else ``inf`` (upstream would print 0/0 = NaN or x/0 = inf).

    Args:
        a: the output under test; ref: the reference; one shape, non-empty.

    Raises:
        ValueError: the shapes differ, or the arrays are empty.
    """
    x, r = _pair(a, ref, "a", "ref")
    num = float(np.sum((x - r) ** 2))
    den = float(np.sum(r ** 2))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def nmse_var(a: Any, ref: Any) -> float:
    """Normalised MSE, variance form: ``mean((a - ref)^2) / var(ref)``.

    ``var`` is the population variance (``np.var``, ddof=0). Source: llama.cpp
    ``examples/model-conversion/scripts/utils/check-nmse.py``
    ``calculate_nmse(reference, test)``, including its zero-variance rule:
    ``var(ref) == 0`` gives 0.0 when the MSE is 0, else ``inf``.

    Args:
        a: the output under test; ref: the reference; one shape, non-empty.

    Raises:
        ValueError: the shapes differ, or the arrays are empty.
    """
    x, r = _pair(a, ref, "a", "ref")
    mse = float(np.mean((x - r) ** 2))
    var = float(np.var(r))
    if var == 0.0:
        return 0.0 if mse == 0.0 else math.inf
    return mse / var


def max_abs_err(a: Any, ref: Any) -> float:
    """Largest absolute difference: ``max(|a - ref|)``.

    Source: llama.cpp ``check-nmse.py`` "Max Absolute Error" (``np.max(np.abs(test - reference))``).
    NaN anywhere makes the result NaN (a gate then fails).

    Args:
        a, ref: one shape, non-empty.

    Raises:
        ValueError: the shapes differ, or the arrays are empty.
    """
    x, r = _pair(a, ref, "a", "ref")
    with np.errstate(invalid="ignore"):
        d = np.abs(x - r)
    return float(np.nan if np.isnan(d).any() else np.max(d))


def max_rel_err(a: Any, ref: Any, eps: float = 1e-8) -> float:
    """Largest relative difference: ``max(|a - ref| / max(|ref|, eps))``.

    The denominator is guarded per element by a floor: ``|ref_i|`` where
    ``|ref_i| >= eps``, else ``eps`` (so an element with ``ref_i == 0``
    contributes ``|a_i| / eps``). Source: the usual definition; llama.cpp has
    no single function for it.

    Args:
        a, ref: one shape, non-empty. eps: the floor, > 0.

    Raises:
        ValueError: the shapes differ, the arrays are empty, or ``eps <= 0``.
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    x, r = _pair(a, ref, "a", "ref")
    with np.errstate(invalid="ignore"):
        d = np.abs(x - r) / np.maximum(np.abs(r), eps)
    return float(np.nan if np.isnan(d).any() else np.max(d))


def rel_l2(a: Any, ref: Any) -> float:
    """Relative L2 error: ``||a - ref||_2 / ||ref||_2`` (all elements).

    Zero reference: 0.0 when ``a == ref``, else ``inf``. Equals
    ``sqrt(nmse_sum(a, ref))``. Computed with ``np.linalg.norm`` (scaled, no
    overflow for large entries).

    Args:
        a, ref: one shape, non-empty.

    Raises:
        ValueError: the shapes differ, or the arrays are empty.
    """
    x, r = _pair(a, ref, "a", "ref")
    num = float(np.linalg.norm((x - r).ravel()))
    den = float(np.linalg.norm(r.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# --------------------------------------------------------------------------- distributions


def log_softmax(logits: Any) -> np.ndarray:
    """Row-wise log-softmax of ``[N, V]`` logits, float64, numerically stable.

    Formula: ``x - m - log(sum(exp(x - m)))`` with ``m`` the row max (the
    same max-subtraction llama.cpp's ``log_softmax`` helpers use). ``-inf``
    entries stay ``-inf``; logits of magnitude 1e4 are fine.

    Raises:
        ValueError: not 2-D, empty, NaN or +inf present, or a row all ``-inf``.
    """
    x, _ = _logit_pair(logits, logits)
    return _log_softmax(x)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=1, keepdims=True)  # finite: every row has a finite entry
    s = x - m
    return s - np.log(np.sum(np.exp(s), axis=1, keepdims=True))


def _kld_rows(lp_ours: np.ndarray, lp_base: np.ndarray) -> np.ndarray:
    p_base = np.exp(lp_base)
    with np.errstate(invalid="ignore"):
        terms = p_base * (lp_base - lp_ours)
    # 0 * log(0 / q) = 0: an entry the base gives no mass contributes nothing,
    # whatever ours says (this covers entries -inf on both sides).
    terms = np.where(p_base > 0, terms, 0.0)
    kld = np.sum(terms, axis=1)
    # KL >= 0; float64 rounding of equal distributions gives |kld| ~ 1e-16 * |logit|.
    return np.maximum(kld, 0.0)


def kld_per_position(ours: Any, base: Any) -> np.ndarray:
    """Per-position KL divergence ``KL(base || ours)``, shape ``[N]``.

    Formula: ``KLD_i = sum_v p_base[i,v] * (log p_base[i,v] - log p_ours[i,v])``
    with ``p = softmax(logits)`` per row. Source: llama.cpp
    ``tools/perplexity/perplexity.cpp``, the ``log_softmax(..., base_log_prob,
    tok, kld)`` overload that ``kl_divergence`` calls per position ("sum +=
    p_base * (p_log_base - logits[i] + max_logit)").

    Differences from llama.cpp, all on purpose: both sides are exact float64
    log-softmaxes (llama.cpp stores the base as uint16-quantized log-probs and
    skips entries with log p_base <= -16); an entry with p_base == 0 (e.g.
    ``-inf`` on both sides) contributes 0; an entry ``-inf`` in ours but with
    p_base > 0 makes that position ``inf``; values below 0 from rounding
    (|.| ~ 1e-16 times the logit size) are clamped to 0.

    Args:
        ours, base: logits ``[N, V]`` (positions x vocab), one shape, any float
            dtype; finite or ``-inf``; no row all ``-inf``.

    Raises:
        ValueError: not 2-D, shapes differ, empty, NaN or +inf, all-``-inf`` row.
    """
    x, y = _logit_pair(ours, base)
    return _kld_rows(_log_softmax(x), _log_softmax(y))


KLD_HIST_BINS_PER_DECADE = 4
"""Bins per factor of 10 in :func:`kld_histogram` (bin ``k`` holds ``10**(k/4) <= KLD < 10**((k+1)/4)``)."""

KLD_HIST_FLOOR_LOG10 = -16
"""Per-position KLD below ``10**-16`` (float64 rounding noise, exact zeros) is counted in ``below``."""


def kld_histogram(kld: Any) -> dict[str, Any]:
    """Per-position KLD values counted on a fixed log10 grid: compact, JSON-able, deterministic.

    The grid does not depend on the data (bin ``k`` is ``[10**(k/b), 10**((k+1)/b))`` with
    ``b`` = :data:`KLD_HIST_BINS_PER_DECADE`), so two runs that give the same values give the same
    counts, and histograms of different runs or cases can be added bin by bin. Only the bins from the
    first to the last non-empty one are stored.

    Args:
        kld: per-position KLD values (e.g. :func:`kld_per_position`), any shape.

    Returns:
        ``{"n", "bins_per_decade", "log10_lo", "counts", "below", "nonfinite"}``: ``n`` values in all;
        ``counts[i]`` values in bin ``[10**(log10_lo + i/b), 10**(log10_lo + (i+1)/b))``; ``below``
        values under ``10**`` :data:`KLD_HIST_FLOOR_LOG10` (zeros included; negatives too, which a
        KLD never is); ``nonfinite`` NaN / inf values. ``counts`` is empty (``log10_lo`` = the
        floor) when no value lies on the grid.
    """
    v = np.asarray(kld, dtype=np.float64).ravel()
    b = KLD_HIST_BINS_PER_DECADE
    finite = np.isfinite(v)
    on_grid = finite & (v >= 10.0 ** KLD_HIST_FLOOR_LOG10)
    k = np.floor(np.log10(v[on_grid]) * b).astype(np.int64)
    out: dict[str, Any] = {"n": int(v.size), "bins_per_decade": b, "log10_lo": float(KLD_HIST_FLOOR_LOG10),
                           "counts": [], "below": int(np.sum(finite & ~on_grid)),
                           "nonfinite": int(np.sum(~finite))}
    if k.size:
        lo, hi = int(k.min()), int(k.max())
        out["log10_lo"] = lo / b
        out["counts"] = np.bincount(k - lo, minlength=hi - lo + 1).astype(int).tolist()
    return out


def top1_agreement(ours: Any, base: Any) -> float:
    """Fraction (0..1) of positions whose argmax token is the same on both sides.

    Formula: ``mean(argmax(ours, -1) == argmax(base, -1))``; ties go to the
    lowest token id on each side, as llama.cpp's strict ``>`` scan does.
    Source: llama.cpp ``perplexity.cpp`` ``kld.n_same_top`` (``imax == imax_base``).
    (:class:`KLDStats` reports the same quantity in percent, ``same_top_p_pct``.)

    Args:
        ours, base: logits ``[N, V]``, one shape.

    Raises:
        ValueError: not 2-D, shapes differ, empty, NaN or +inf, all-``-inf`` row.
    """
    x, y = _logit_pair(ours, base)
    return float(np.mean(np.argmax(x, axis=1) == np.argmax(y, axis=1)))


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


# --------------------------------------------------------------------------- greedy streams


@dataclass(frozen=True)
class GreedyAgreement:
    """Verdict of :func:`greedy_agreement`.

    Attributes:
        agree: the streams pass vLLM's rule.
        first_mismatch: index of the first differing token, ``None`` if the
            compared prefix is identical.
        n_compared: positions examined (up to and including the first mismatch).
        reason: one line saying why.
    """

    agree: bool
    first_mismatch: int | None
    n_compared: int
    reason: str


def greedy_agreement(
    tokens_a: Sequence[int],
    tokens_b: Sequence[int],
    topn_a: Sequence[Sequence[int]],
    topn_b: Sequence[Sequence[int]],
    n: int = 5,
) -> GreedyAgreement:
    """Compare two greedy token streams with vLLM's rule.

    Source: vLLM ``tests/models/utils.py`` ``check_logprobs_close``. Walk both
    streams together (over the shorter length, as its ``zip`` does); at the
    first position ``i`` where ``tokens_a[i] != tokens_b[i]`` the pair passes
    iff ``tokens_a[i]`` is among ``topn_b[i][:n]`` *and* ``tokens_b[i]`` is
    among ``topn_a[i][:n]``; after that position nothing more is compared (the
    contexts differ from there on). No mismatch in the common prefix passes,
    whatever the lengths (vLLM only warns when the texts differ). The verdict
    is symmetric in a and b.

    Args:
        tokens_a, tokens_b: the generated token ids (non-empty).
        topn_a, topn_b: per step, the ids of that side's top-n candidates,
            best first (``topn_a[i]`` belongs to step ``i``); same length as
            the side's tokens. Only the first ``n`` entries are used; a list
            with fewer entries is used as it is.
        n: how many top candidates count (vLLM's ``num_logprobs``), >= 1.

    Raises:
        ValueError: an empty stream, a top-n list count that differs from its
            stream's length, or ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ta, tb = [int(t) for t in tokens_a], [int(t) for t in tokens_b]
    if not ta or not tb:
        raise ValueError(f"empty token stream: tokens_a has {len(ta)} tokens, tokens_b has {len(tb)}")
    if len(topn_a) != len(ta) or len(topn_b) != len(tb):
        raise ValueError(
            f"length mismatch: tokens_a {len(ta)} vs topn_a {len(topn_a)}, tokens_b {len(tb)} vs topn_b {len(topn_b)}"
        )
    m = min(len(ta), len(tb))
    for i in range(m):
        if ta[i] == tb[i]:
            continue
        cand_a = {int(t) for t in list(topn_a[i])[:n]}
        cand_b = {int(t) for t in list(topn_b[i])[:n]}
        a_in_b, b_in_a = ta[i] in cand_b, tb[i] in cand_a
        if a_in_b and b_in_a:
            why = f"first mismatch at step {i} ({ta[i]} vs {tb[i]}): each token is in the other side's top-{n}; streams diverge after"
        else:
            missing = []
            if not a_in_b:
                missing.append(f"a's {ta[i]} not in b's top-{n}")
            if not b_in_a:
                missing.append(f"b's {tb[i]} not in a's top-{n}")
            why = f"first mismatch at step {i} ({ta[i]} vs {tb[i]}): " + "; ".join(missing)
        return GreedyAgreement(a_in_b and b_in_a, i, i + 1, why)
    why = f"identical over {m} tokens"
    if len(ta) != len(tb):
        why += f" (lengths differ: a {len(ta)}, b {len(tb)}; compared the common prefix, as vLLM's zip does)"
    return GreedyAgreement(True, None, m, why)
