"""Comparing two traces: per (point, layer) errors from checksums or full tensors, and the first divergence.

:func:`compare` lines two :class:`~harness.traces.format.Trace` objects up per (point, layer) in the
canonical trace order (:func:`~harness.traces.format.canonical_key`) and names the first point that
diverges. From checksums alone it computes *lower bounds* of the relative error
(:func:`checksum_error`); with tensor dumps on both sides the full relative L2 error, cosine and
max |a - b| (:mod:`harness.core.metrics`). :func:`layer_errors` does the same for two in-memory
recordings (:class:`~harness.traces.TraceRecorder`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from gemma4_harness.reference.errors import InputError

from ..core import metrics
from ..core.gates import DIFF_TOL
from ..core.io import markdown_table
from .format import Trace, _product, canonical_key


def check_same_prompt(a: Trace, b: Trace) -> None:
    """Refuse to compare traces of different prompts.

    Raises:
        InputError: the header ``prompt_ids`` differ (the message gives both lengths and the first
            differing position).
    """
    pa, pb = a.prompt_ids, b.prompt_ids
    if pa == pb:
        return
    pos = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
    raise InputError(f"{a.label} and {b.label} trace different prompts ({len(pa)} vs {len(pb)} tokens, "
                     f"first difference at position {pos})")


def _maxabs_known(*vals: float | None) -> float | None:
    known = [abs(v) for v in vals if v is not None and not math.isnan(v)]
    return max(known) if known else None


def checksum_error(ca: Mapping[str, Any], cb: Mapping[str, Any], n: int, precision: float = 0.0) -> dict[str, float]:
    """Lower bounds of the relative error of two tensors of ``n`` elements from their checksums alone.

    With ``L = max(l2_a, l2_b)`` and ``M = max(absmax_a, absmax_b)`` (whichever are known):

    * ``l2``:     ``| l2_a - l2_b | / L``                  <= ||a-b||_2 / L  (triangle inequality)
    * ``sum``:    ``| sum_a - sum_b | / (sqrt(n) L)``      <= ||a-b||_2 / L  (Cauchy-Schwarz)
    * ``absmax``: ``| absmax_a - absmax_b | / M``          <= max|a-b| / M
    * ``first``:  ``max_i | first_a[i] - first_b[i] | / M``  <= max|a-b| / M

    so each figure is at most the true relative L2 error or the true max error relative to the larger
    max|x|: a value above a tolerance proves a divergence; a value below does not prove agreement.
    When M is unknown (a source that gave no absmax) the leading values are scaled by ``L / sqrt(n)``
    (the RMS). A statistic either side lacks is skipped. Identical checksums (NaN equal to NaN) give 0;
    any other NaN gives inf.

    ``precision`` (> 0 for printed dumps: the sum of both sides' absolute value rounding) is allowed for
    before dividing: ``precision`` off each leading-value and absmax difference, ``sqrt(n) * precision``
    off the l2 difference, and for the sum (printed with 6 decimals, accumulated in float32 by ggml)
    1e-6 off the difference and ``2^-24 sqrt(n)`` off the bound.

    Args:
        ca, cb: checksum dicts (:func:`checksums`, values may be None).
        n: number of elements (product of the shape).
        precision: absolute rounding of the values the checksums came from, both sides together.

    Returns:
        ``{stat: bound}`` for the statistics both sides have.

    Source: ``docs/trace-format.md`` ("Comparing traces").
    """
    def same(x, y):
        return x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))

    def rel(d: float, den: float | None) -> float:
        if d == 0:
            return 0.0
        if den is None or den == 0 or math.isnan(d) or math.isnan(den):
            return math.inf
        return d / den

    def less(d: float, allowance: float) -> float:
        return d if math.isnan(d) else max(0.0, d - allowance)

    out: dict[str, float] = {}
    L = _maxabs_known(ca.get("l2"), cb.get("l2"))
    M = _maxabs_known(ca.get("absmax"), cb.get("absmax"))
    scale_vals = M if M else (L / math.sqrt(n) if L and n else None)
    root_n = math.sqrt(max(n, 1))
    for stat in ("l2", "sum", "absmax"):
        x, y = ca.get(stat), cb.get(stat)
        if x is None or y is None:
            continue
        if same(x, y):
            out[stat] = 0.0
            continue
        d = abs(x - y)
        if stat == "sum":
            b = rel(less(d, 1e-6 if precision else 0.0), (root_n * L) if L else None)
            out[stat] = less(b, 2.0**-24 * root_n if precision else 0.0)
        elif stat == "l2":
            out[stat] = rel(less(d, root_n * precision), L)
        else:
            out[stat] = rel(less(d, precision), M)
    fa, fb = ca.get("first") or [], cb.get("first") or []
    k = min(len(fa), len(fb))
    if k:
        ds = [0.0 if same(x, y) else less(abs(x - y), precision) for x, y in zip(fa[:k], fb[:k])]
        dmax = math.nan if any(math.isnan(d) for d in ds) else max(ds)
        out["first"] = rel(dmax, scale_vals)
    return out


@dataclass(frozen=True)
class DivergenceRule:
    """When a (point, layer) counts as diverged.

    Attributes:
        tol: relative error bound: the full relative L2 error when both sides have tensors, else the
            checksum lower bound (:func:`checksum_error`); None = not used.
        min_cosine: cosine bound (tensors only); None = not used.
        max_abs: ``{point: bound on max|a - b|}`` (tensors only), e.g. ``{"result_output": 1e-3}``.
    """

    tol: float | None = DIFF_TOL
    min_cosine: float | None = None
    max_abs: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: the bounds in force."""
        parts = []
        if self.tol is not None:
            parts.append(f"relative error <= {self.tol:g}")
        if self.min_cosine is not None:
            parts.append(f"cosine >= {self.min_cosine}")
        parts += [f"max|a-b| <= {v:g} at {k}" for k, v in self.max_abs.items()]
        return "; ".join(parts) or "no bounds"


@dataclass
class PointDiff:
    """The comparison of one (point, layer).

    Attributes:
        point, layer: the trace point.
        shape_a, shape_b: the two shapes.
        basis: ``tensors`` (full tensors compared), ``checksums`` (lower bounds only) or ``shape``
            (shapes differ: counts as diverged, error inf).
        bounds: :func:`checksum_error` figures.
        rel_l2: ``||a - b|| / ||b||`` (tensors only; b = the second trace).
        cosine: cosine similarity (tensors only).
        max_abs: ``max|a - b|`` (tensors only).
        err: the figure compared with ``tol``: ``rel_l2`` with tensors, else ``max(bounds)``.
        diverged: beyond the rule.
        why: which bound it broke ("" when not diverged).
    """

    point: str
    layer: int
    shape_a: list[int]
    shape_b: list[int]
    basis: str
    bounds: dict[str, float]
    err: float
    rel_l2: float | None = None
    cosine: float | None = None
    max_abs: float | None = None
    diverged: bool = False
    why: str = ""

    @property
    def where(self) -> str:
        """``point@layer``."""
        return f"{self.point}@{self.layer}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"point": self.point, "layer": self.layer, "shape_a": self.shape_a, "shape_b": self.shape_b,
                "basis": self.basis, "err": self.err, "rel_l2": self.rel_l2, "cosine": self.cosine,
                "max_abs": self.max_abs, "bounds": self.bounds, "diverged": self.diverged, "why": self.why}


@dataclass
class DiffResult:
    """The comparison of two traces.

    Attributes:
        rows: one :class:`PointDiff` per (point, layer) in both traces, canonical trace order.
        only_a, only_b: ``point@layer`` present in one trace only (not counted as divergences).
        skipped: points left out on request.
        rule: the :class:`DivergenceRule` applied.
    """

    rows: list[PointDiff]
    only_a: list[str]
    only_b: list[str]
    skipped: list[str]
    rule: DivergenceRule

    @property
    def first(self) -> PointDiff | None:
        """The first diverged (point, layer) in canonical trace order, or None."""
        return next((r for r in self.rows if r.diverged), None)

    def growth(self) -> list[dict[str, Any]]:
        """Error growth: one row per section (``input``, each layer, ``output``): points compared, the worst
        point and its error, the ``l_out`` error, the cosine minimum (tensors), diverged points."""
        groups: dict[tuple[int, int], list[PointDiff]] = {}
        for r in self.rows:
            sec, layer, _ = canonical_key(r.point, r.layer)
            groups.setdefault((sec, layer), []).append(r)
        out = []
        for (sec, layer), rs in sorted(groups.items()):
            worst = max(rs, key=lambda r: (r.err if not math.isnan(r.err) else math.inf))
            lout = next((r for r in rs if r.point == "l_out"), None)
            cos = [r.cosine for r in rs if r.cosine is not None]
            out.append({"layer": {-1: "encoders", 0: "input", 2: "output"}.get(sec, layer), "points": len(rs),
                        "worst_point": worst.point, "worst_err": worst.err,
                        "l_out_err": None if lout is None else lout.err,
                        "min_cosine": min(cos) if cos else None,
                        "diverged": sum(r.diverged for r in rs)})
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        f = self.first
        return {"first_divergence": None if f is None else f.where, "rule": self.rule.describe(),
                "rows": [r.as_dict() for r in self.rows], "only_a": self.only_a, "only_b": self.only_b,
                "skipped": self.skipped}



def compare_point(ra: Mapping[str, Any], rb: Mapping[str, Any], ta: np.ndarray | None, tb: np.ndarray | None,
                  rule: DivergenceRule) -> PointDiff:
    """Compare one (point, layer) of two traces.

    Args:
        ra, rb: the two records (b is the baseline side: ``rel_l2`` divides by ``||b||``).
        ta, tb: the full tensors, or None (then only checksums are compared).
        rule: the bounds.

    Returns:
        :class:`PointDiff`. Shapes that differ count as diverged (error inf).

    Source: ``docs/trace-format.md`` ("Comparing traces"); metrics from :mod:`harness.core.metrics`.
    """
    point, layer = ra["point"], int(ra["layer"])
    sa, sb = list(ra["shape"]), list(rb["shape"])
    if sa != sb:
        return PointDiff(point, layer, sa, sb, "shape", {}, math.inf, diverged=True,
                         why=f"shape {sa} vs {sb}")
    prec = float(ra.get("abs_precision") or 0.0) + float(rb.get("abs_precision") or 0.0)
    bounds = checksum_error(ra["checksums"], rb["checksums"], _product(sa), prec)
    res = PointDiff(point, layer, sa, sb, "checksums", bounds, max(bounds.values()) if bounds else 0.0)
    if ta is not None and tb is not None and list(ta.shape) == sa and list(tb.shape) == sb and ta.size:
        res.basis = "tensors"
        same = np.array_equal(ta, tb, equal_nan=True)
        if same:
            res.rel_l2, res.cosine, res.max_abs = 0.0, 1.0, 0.0
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                res.rel_l2 = metrics.rel_l2(ta, tb)
                res.max_abs = metrics.max_abs_err(ta, tb)
                finite = np.all(np.isfinite(ta)) and np.all(np.isfinite(tb))
                res.cosine = metrics.cosine(ta, tb) if finite else math.nan
            if math.isnan(res.rel_l2):
                res.rel_l2 = math.inf
        res.err = res.rel_l2
    why = []
    if rule.tol is not None and not res.err <= rule.tol:
        why.append(f"{'rel L2' if res.basis == 'tensors' else 'checksum bound'} {res.err:.3g} > {rule.tol:g}")
    if rule.min_cosine is not None and res.cosine is not None and not res.cosine >= rule.min_cosine:
        why.append(f"cosine {res.cosine:.8f} < {rule.min_cosine}")
    lim = rule.max_abs.get(point)
    if lim is not None and res.max_abs is not None and not res.max_abs <= lim:
        why.append(f"max|a-b| {res.max_abs:.3g} > {lim:g}")
    res.diverged, res.why = bool(why), "; ".join(why)
    return res


def compare(a: Trace, b: Trace, rule: DivergenceRule | None = None, skip: Iterable[str] = (),
            use_tensors: bool = True) -> DiffResult:
    """Compare two traces of the same prompt per (point, layer), in canonical trace order.

    Args:
        a: the trace under test.
        b: the baseline trace (relative errors divide by its norms).
        rule: when a point counts as diverged (default: relative error > :data:`DIFF_TOL`).
        skip: points to leave out, as a name (every layer) or ``point@layer`` (e.g. ``result_output``
            when one engine kept only the last position's logits).
        use_tensors: compare full tensors when both traces have them.

    Returns:
        :class:`DiffResult`; its ``first`` is the first diverged point.

    Raises:
        InputError: different prompts (:func:`check_same_prompt`); an unreadable tensor dump.
    """
    check_same_prompt(a, b)
    rule = rule or DivergenceRule()
    skip = set(skip)

    def skipped_key(k: tuple[str, int]) -> bool:
        return k[0] in skip or f"{k[0]}@{k[1]}" in skip

    ka, kb = a.by_key(), b.by_key()
    order_a = {k: i for i, k in enumerate(ka)}
    both = [k for k in ka if k in kb and not skipped_key(k)]
    both.sort(key=lambda k: (canonical_key(*k), order_a[k]))
    tensors = use_tensors and a.has_tensors() and b.has_tensors()
    rows = []
    for k in both:
        ta = a.tensor(*k) if tensors else None
        tb = b.tensor(*k) if tensors else None
        rows.append(compare_point(ka[k], kb[k], ta, tb, rule))
    only_a = [f"{p}@{l}" for (p, l) in ka if (p, l) not in kb and not skipped_key((p, l))]
    only_b = [f"{p}@{l}" for (p, l) in kb if (p, l) not in ka and not skipped_key((p, l))]
    skipped = sorted({f"{p}@{l}" for (p, l) in list(ka) + list(kb) if skipped_key((p, l))},
                     key=lambda w: canonical_key(w.rsplit("@", 1)[0], int(w.rsplit("@", 1)[1])))
    return DiffResult(rows=rows, only_a=only_a, only_b=only_b, skipped=skipped, rule=rule)


def render_diff(res: DiffResult, a: Trace, b: Trace) -> str:
    """The text ``g4h diff`` prints: the two traces, the verdict (first divergence), and the
    error-growth table (:meth:`DiffResult.growth`)."""
    def who(t: Trace) -> str:
        h = t.header
        bits = [f"engine {h.get('engine')}"] + ([f"case {h['case']}"] if h.get("case") else [])
        return f"{t.label} ({', '.join(bits)})"

    basis = {r.basis for r in res.rows}
    how = ("full tensors: relative L2 error, cosine" if basis == {"tensors"} else
           "checksums: lower bounds of the relative error" if "tensors" not in basis else
           "full tensors where both have them, else checksums")
    lines = [f"A: {who(a)}", f"B: {who(b)}",
             f"prompt: {len(a.prompt_ids)} tokens; {len(res.rows)} points compared by {how}; "
             f"rule: {res.rule.describe()}"]
    f = res.first
    if f is None:
        lines.append("no divergence: every common point is within the rule")
    else:
        n_div = sum(r.diverged for r in res.rows)
        lines.append(f"FIRST DIVERGENCE: {f.where} ({f.why}); {n_div} of {len(res.rows)} points beyond the rule")
    lines += ["", "error growth (err = rel L2 with tensors, else the checksum lower bound):", ""]
    cols = ["layer", "points", "worst_point", "worst_err", "l_out_err", "min_cosine", "diverged"]
    g = res.growth()
    if not any(r["min_cosine"] is not None for r in g):
        cols.remove("min_cosine")
    lines.append(markdown_table(g, cols).rstrip("\n"))
    if res.only_a:
        lines.append(f"only in A ({len(res.only_a)}): {', '.join(res.only_a[:12])}{' ...' if len(res.only_a) > 12 else ''}")
    if res.only_b:
        lines.append(f"only in B ({len(res.only_b)}): {', '.join(res.only_b[:12])}{' ...' if len(res.only_b) > 12 else ''}")
    if res.skipped:
        lines.append(f"skipped: {', '.join(res.skipped)}")
    return "\n".join(lines) + "\n"

