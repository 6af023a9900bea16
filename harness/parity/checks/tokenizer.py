"""The tokenizer checks (:mod:`harness.tokenizer.checks`) as gated figures of the parity job."""

from __future__ import annotations

from typing import Any

from ...tokenizer.checks import tokenizer_checks
from ..result import Figure, fig

GATED = ("pass", "fail", "error", "not_run")
"""Statuses that count against the verdict; ``info`` and ``opted_out`` are reported beside it."""


def tokenizer_figures(info: dict[str, Any], skip: tuple[str, ...] = (), slow: bool = False) -> list[Figure]:
    """Every tokenizer check as a ``tokenizer.check`` figure: 1 for ``pass``, 0 otherwise.

    A check that passes or fails, errs, or could not run here (``not_run``) is gated: a check that
    cannot run is a failure unless the user opted it out. ``info`` findings and ``opted_out`` checks are
    recorded as informational figures with their reason. The status counts go to
    ``info["tokenizer_summary"]``.
    """
    out = tokenizer_checks(slow=slow, skip=skip)
    figs = []
    for chk in out["checks"]:
        status = chk.get("status")
        detail: dict[str, Any] = {"got": status}
        if status not in GATED:
            detail["informational_reason"] = str(chk.get("detail", status))[:200]
        elif status != "pass":
            detail["why"] = str(chk.get("detail", status))[:200]
        figs.append(fig("tokenizer.check", 1.0 if status == "pass" else 0.0, chk.get("name"), **detail))
    info["tokenizer_summary"] = out.get("summary")
    return figs
