"""The report's lines on explained divergences (:mod:`harness.parity.explain`): kept apart from the search, so that
the report (and ``g4h compare``, which prints its table) does not import the variants and torch behind them."""

from __future__ import annotations

from typing import Any, Mapping


def explanation_lines(data: Mapping[str, Any]) -> list[str]:
    """The lines under a parity report's verdict: the spec variants the reference ran under (``--spec``), and for
    every failing pair the explanation of its divergence, one line each (empty when there is neither)."""
    lines = []
    if data.get("spec"):
        lines.append(f"- the reference ran under spec variants {', '.join(data['spec'])} (`--spec`; "
                     "docs/spec-variants.md): figures compare the engines with that rule, not the reference's")
    for c in data.get("cases", []):
        for chk in c.get("checks", []):
            e = chk.get("explanation")
            if isinstance(e, Mapping) and e.get("line"):
                pair = chk["gate"].rsplit(".", 1)[0]
                where = f" (first divergence {e['first_point']})" if e.get("first_point") else ""
                lines.append(f"- **{c['case']}** `{pair}`{where}: {e['line']}")
    return lines + [""] if lines else []
