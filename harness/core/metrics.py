"""Comparison metrics: one engine's output against a reference.

Every function here is pure NumPy and works in float64 internally, whatever the
input dtype (float16/32/64 arrays, or anything ``np.asarray`` takes; a torch
tensor, bfloat16 included, is read through ``.detach().cpu().double()``).

Three groups (``docs/design.md``, "Metrics"):

* elementwise: :func:`cosine`, :func:`nmse_sum`, :func:`nmse_var`,
  :func:`max_abs_err`, :func:`max_rel_err`, :func:`rel_l2`;
* distributions: :func:`log_softmax`, :func:`kld_per_position`,
  :func:`top1_agreement`, and :func:`kld_histogram` (per-position values
  counted on fixed log bins for the reports); the whole statistic set that
  ``llama-perplexity --kl-divergence`` prints is :mod:`harness.core.kld`;
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
from dataclasses import dataclass
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
    "binned_kld",
    "kld_histogram",
    "top1_agreement",
    "GreedyAgreement",
    "greedy_agreement",
]



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


def top1_margin(logits: np.ndarray) -> np.ndarray:
    """Per row of ``[N, V]`` logits, the top-1 value minus the top-2 value, ``[N]`` (0 when V == 1): how near
    a tie the row's argmax is. A partition, not a sort: the same two values, in O(V) per row (on ``[217, 262144]``
    0.5 s against a sort's 3 s)."""
    if logits.shape[1] < 2:
        return np.zeros(logits.shape[0], dtype=logits.dtype)
    top2 = np.partition(logits, (-2, -1), axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


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
    s -= np.log(np.sum(np.exp(s), axis=1, keepdims=True))  # in place: one [N, V] array fewer, the same values
    return s


def _kld_rows(lp_ours: np.ndarray, lp_base: np.ndarray) -> np.ndarray:
    p_base = np.exp(lp_base)
    with np.errstate(invalid="ignore"):
        terms = np.subtract(lp_base, lp_ours)
        terms *= p_base  # in place: on [8, 262144] rows a third of the time of fresh temporaries and a where
    kld = np.sum(terms, axis=1)
    if np.isnan(kld).any():
        # 0 * log(0 / q) = 0: an entry the base gives no mass contributes nothing, whatever ours says (entries
        # -inf on both sides, or -inf in ours where the base's mass underflows to 0, made NaN above; a row with
        # none of them summed only zeros there).
        terms[p_base == 0] = 0.0
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


REST_FLOOR = 1e-6
"""The least rest mass :func:`binned_kld` takes: above the float32 rounding of the sum of the top-N probabilities
a server sends (the harness asks for 5: 5 x 2^-24 = 3.0e-7 at most), and small enough that a row whose rest is
that small adds next to nothing (a rest of 1e-6 against 1e-4 adds 1e-6 x ln(1e-2) = -4.6e-6 nats)."""


def binned_kld(ours: Any, base: Any) -> float:
    """``KL(base || ours)`` of two distributions coarsened to the ``n`` tokens one side named (a server's top-N)
    plus one bin for every other token: what can be said of the KLD from top-N log-probs alone.

    Formula: ``sum_i p_base[i] * (log p_base[i] - log p_ours[i]) + r_base * (log r_base - log r_ours)`` over the
    named tokens ``i``, with ``p = exp(log-prob)`` and ``r = 1 - sum_i p`` the mass of the tokens not named. By the
    data-processing inequality of the KL divergence (merging outcomes never increases it: Cover & Thomas, *Elements
    of Information Theory*, 2nd ed., Theorem 2.8.1; in code, llama.cpp's ``kl_divergence`` of
    ``tools/perplexity/perplexity.cpp`` sums the same terms over every token) it is a lower bound of the full
    :func:`kld_per_position` of the same rows. ``0 log 0 = 0``. Each rest mass is taken as at least
    :data:`REST_FLOOR`: top-N log-probs sent as float32 sum to 1 only within their rounding (``n`` values of relative
    error up to 2^-24 each), so a rest of 0 or below on one side is rounding, not a token called impossible, and
    must not turn a peaked row into an infinite divergence.

    Args:
        ours, base: log-probabilities (natural log, float) of the same ``n`` tokens, shape ``[n]``, ``n >= 1``; each
            side's probabilities summing to at most 1 (within rounding). NaN in ``ours`` gives NaN (a non-finite
            log-prob is not a number to pass); ``-inf`` is a token given no mass.

    Returns:
        The binned KLD in nats, >= 0 (rounding clamped), NaN where ``ours`` holds NaN.

    Raises:
        ValueError: shapes differ, not 1-D, or empty.
    """
    q, p = np.asarray(ours, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if p.ndim != 1 or p.shape != q.shape or not p.size:
        raise ValueError(f"binned_kld: expected two 1-D arrays of one length >= 1, got {q.shape} and {p.shape}")
    if np.isnan(q).any():
        return float("nan")
    pb, pq = np.exp(p), np.exp(q)
    with np.errstate(invalid="ignore", divide="ignore"):
        terms = np.where(pb > 0, pb * (p - q), 0.0)
        rb, rq = (max(1.0 - float(np.sum(x)), REST_FLOOR) for x in (pb, pq))
        rest = rb * (math.log(rb) - math.log(rq))
    return max(float(np.sum(terms)) + rest, 0.0)


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
