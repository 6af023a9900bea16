"""Judging a sweep: which rows failed, whether the engines agree on each file, and the exit status.

* Row statuses (:data:`STATUSES`): ``ok``; ``not_run`` (the engine cannot run the file: a limit ``g4h inspect``
  declares, such as a type the fast engine does not decode, is *declared* and fails nothing; any other reason, such
  as llama-cpp-python missing on the node, fails the run); ``bad_input`` (the file is unusable: its ``g4h inspect``
  problem); ``crashed`` (the engine aborted, its worker or the Ray worker died, a protocol fault, non-finite logits);
  ``oom`` (Ray's memory monitor killed the task, the memory plan refused, or no node has the memory the plan
  needs); ``timeout`` (ran past ``--task-timeout``); ``no_base`` (the group's base could not be computed); ``error``
  (anything else, named).
* :func:`agreement`: two engines that both ran on one file, compared with each other (llama-perplexity's KLD set of
  the second against the first) and judged by the gate their precisions call for (:func:`pair_gate`).
* :func:`exit_status`: 2 when a file is unusable; else 1 when a row failed or a pair of engines disagrees; else 0.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core.engine_kinds import KINDS
from ..core.gates import DEFAULT_GATES, Gate
from ..core.kld import kld_stats
from .tasks import _stack

STATUSES = ("ok", "not_run", "bad_input", "crashed", "oom", "timeout", "no_base", "error")
"""Every row status (see the module docstring)."""

FAILED = frozenset({"crashed", "oom", "timeout", "no_base", "error"})
"""Statuses that fail the sweep (exit 1); ``not_run`` fails too unless the limit is declared."""

#: Engine kinds that round the activations of quantized (and 16-bit) matrix products (parity's
#: ``harness.engines.numerics.KIND_NUMERICS``: llama.cpp's CPU backend); a ``cmd:`` engine says so in its ``hello``.
QUANTIZED_ACTIVATION_KINDS = frozenset(k.name for k in KINDS if k.quantizes_activations)
#: Stored types of matrices that no engine rounds activations for.
EXACT_TYPES = frozenset({"F32", "F64", "float32", "float64"})


def failed(row: dict[str, Any]) -> bool:
    """Whether a row fails the sweep."""
    return row["status"] in FAILED or (row["status"] == "not_run" and not row.get("declared"))


def rounds_activations(row: dict[str, Any]) -> bool:
    """Whether the row's engine rounds the activations of non-F32 products (by its kind, or as it declares)."""
    return row.get("engine_kind") in QUANTIZED_ACTIVATION_KINDS or "quantized_activations" in (
        row.get("approximations") or ())


def pair_gate(a: dict[str, Any], b: dict[str, Any], types: dict[str, int]) -> Gate:
    """The gate of engines ``a`` and ``b`` on a file holding ``types``: the 8-bit ratio gate when one of them rounds
    activations and the file has non-F32 matrices; the 16-bit gate when one computes in 16 bits; else the fp32 one."""
    if (rounds_activations(a) or rounds_activations(b)) and set(types) - EXACT_TYPES:
        return DEFAULT_GATES["sweep~engines_q8.mean_kld_ratio"]
    if any(r.get("dtype") in ("bfloat16", "float16") for r in (a, b)):
        return DEFAULT_GATES["sweep~engines_bf16.mean_kld"]
    return DEFAULT_GATES["sweep~engines.mean_kld"]


def agreement(a: dict[str, Any], b: dict[str, Any], logits_a: dict[str, np.ndarray], logits_b: dict[str, np.ndarray],
              prompts: Sequence[dict[str, Any]], types: dict[str, int], sensitivity: float | None) -> dict[str, Any]:
    """Engines ``a`` and ``b`` on the same file: ``b``'s logits against ``a``'s (llama-perplexity's statistics), the
    gate, the figure it judges and the verdict.

    Args:
        a, b: their rows (``engine``, ``engine_kind``, ``approximations``, ``dtype``).
        logits_a, logits_b: prompt id -> ``[T, V]``.
        prompts: the group's prompts.
        types: the file's stored types (:attr:`harness.sweep.files.SweepFile.types`).
        sensitivity: the group's 8-bit yardstick (mean KLD, :func:`harness.sweep.tasks.sensitivity_run`), or None.

    Returns:
        ``{"engines": [a, b], "gate", "limit", "op", "measured", "passed", "informational", "why", "mean_kld",
        "same_top_p_pct", "kld_p99_0", "max_abs_logit"}``.
    """
    ref, toks = _stack(logits_a, prompts)
    ours, _ = _stack(logits_b, prompts)
    stats = kld_stats(ours, ref, toks)
    gate = pair_gate(a, b, types)
    out: dict[str, Any] = {"engines": [a["engine"], b["engine"]], "gate": gate.name, "limit": gate.limit,
                           "op": gate.op, "mean_kld": stats.mean_kld, "same_top_p_pct": stats.same_top_p_pct,
                           "kld_p99_0": stats.kld_p99_0, "max_abs_logit": float(np.max(np.abs(ours - ref))),
                           "informational": False, "why": None}
    if gate.name.endswith("mean_kld_ratio"):
        if sensitivity is None or not sensitivity > 0:
            out.update(measured=None, passed=True, informational=True,
                       why="the group's 8-bit yardstick is missing (its task failed): reported, not gated")
            return out
        out["measured"] = stats.mean_kld / sensitivity
        out["why"] = f"mean KLD {stats.mean_kld:.3g} = {out['measured']:.3g} x the 8-bit yardstick {sensitivity:.3g}"
    else:
        out["measured"] = stats.mean_kld
    out["passed"] = gate.check(out["measured"])
    return out


def exit_status(rows: Sequence[dict[str, Any]], agreements: Sequence[dict[str, Any]]) -> int:
    """0 every row ran (or was declared out of reach) and every pair agrees; 1 a row failed or a pair disagrees; 2 a
    file is unusable (bad input wins)."""
    if any(r["status"] == "bad_input" for r in rows):
        return 2
    if any(failed(r) for r in rows) or any(not a["passed"] for a in agreements):
        return 1
    return 0


def damage_key(row: dict[str, Any]) -> tuple:
    """Sort key of the report's table: failed rows first, then by mean KLD against the base, largest first."""
    k = row.get("mean_kld")
    return (0 if failed(row) or row["status"] == "bad_input" else 1 if row["status"] != "ok" else 2,
            -(k if isinstance(k, (int, float)) and k == k else float("inf")), row.get("file", ""), row["engine"])
