"""Judging a sweep: which rows failed, whether the engines agree on each file, and the exit status.

* Row statuses (:data:`STATUSES`): ``ok``; ``not_run`` (the engine cannot run the file: a limit ``g4h inspect``
  declares, such as a type the fast engine does not decode, is *declared* and fails nothing; any other reason, such
  as llama-cpp-python missing on the node, fails the run); ``bad_input`` (the file is unusable: its ``g4h inspect``
  problem); ``crashed`` (the engine aborted, its worker or the Ray worker died, a protocol fault, non-finite logits);
  ``oom`` (Ray's memory monitor killed the task, the memory plan refused, or no node has the memory the plan
  needs); ``timeout`` (ran past ``--task-timeout``); ``no_base`` (the group's base could not be computed); ``error``
  (anything else, named).
* Every row carries its parity pair (``checks``, :func:`harness.sweep.tasks.pair_figures`: the reference on the row's
  own file against the engine, through ``g4h parity``'s pair pipeline); a failing gating check fails the sweep
  (:func:`pair_failures`), and the row's status is read from the pair's ``.runs`` (:func:`harness.sweep.tasks.pair_status`).
  ``timeout``, ``no_base`` and a Ray-killed task's ``oom``/``crashed`` are the sweep's own: they say what became of a
  task, which a parity run (one process) does not have.
* :func:`base_verdict`: a row of an earlier sweep's store (measured before the parity pair, no ``checks``) on the
  group's base file against the base, judged as it was then, as ``g4h parity`` judges it:
  the float64 reference makes the approximations the engine declares (its :class:`~harness.engines.numerics.Numerics`,
  read by the same :func:`~harness.engines.numerics.engine_numerics`, keyed by the same
  :meth:`~harness.engines.numerics.Numerics.emulation`), the gate is the parity's ``reference~<kind>.mean_kld`` (the
  same :func:`~harness.core.gates.pair_name`) at :func:`~harness.core.gates.effect_limit` of the emulations' effect on
  the base. ``quantized_activations`` is not emulated in the sweep: on a base with quantized or 16-bit matrices such
  an engine is judged by parity's yardstick rule (``reference~<kind>_q8x.mean_kld``, 2 x the group's 8-bit
  yardstick), and the row says so.
* :func:`agreement`: two engines that both ran on one file, compared with each other (llama-perplexity's KLD set of
  the second against the first) and judged by the gate their precisions call for (:func:`pair_gate`); when they
  declare different emulable approximations (llama.cpp's fp16 GELU table, fast none), the limit is raised by their
  effect on the base (the reference under the one key against the other), by the same rule.
* :func:`exit_status`: 2 when a file is unusable; else 1 when a row failed, an engine fails against the base or a pair
  of engines disagrees; else 0.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core.gates import DEFAULT_GATES, Gate, pair_name, with_effect
from ..core.kld import kld_stats
from ..engines.numerics import EXACT_TYPES, KIND_NUMERICS, key_name
from .tasks import _stack, sweep_emulation

STATUSES = ("ok", "not_run", "bad_input", "crashed", "oom", "timeout", "no_base", "error")
"""Every row status (see the module docstring)."""

FAILED = frozenset({"crashed", "oom", "timeout", "no_base", "error"})
"""Statuses that fail the sweep (exit 1); ``not_run`` fails too unless the limit is declared."""

#: Engine kinds that round the activations of quantized (and 16-bit) matrix products, as their declared numerics say
#: (:data:`harness.engines.numerics.KIND_NUMERICS`, what ``g4h parity`` reads: llama.cpp's CPU backend); a ``cmd:``
#: engine says so in its ``hello``.
QUANTIZED_ACTIVATION_KINDS = frozenset(k for k, n in KIND_NUMERICS.items() if "quantized_activations" in n.approximations)

QUANTIZED_NOT_EMULATED = (
    "quantized_activations is not emulated in the sweep's base (each row's g4h parity pair emulates it, "
    "harness/parity/checks/pair.py): judged by parity's yardstick rule instead")
"""Said on every figure of an engine that rounds its activations, on a file with quantized or 16-bit matrices."""


def failed(row: dict[str, Any]) -> bool:
    """Whether a row fails the sweep."""
    return row["status"] in FAILED or (row["status"] == "not_run" and not row.get("declared"))


def rounds_activations(row: dict[str, Any]) -> bool:
    """Whether the row's engine rounds the activations of non-F32 products (by its kind, or as it declares)."""
    return row.get("engine_kind") in QUANTIZED_ACTIVATION_KINDS or "quantized_activations" in (
        row.get("approximations") or ())


def row_emulation(row: dict[str, Any], types: dict[str, int] | Sequence[str]) -> tuple[str, ...]:
    """The emulation key the base makes for the row's engine on a file of ``types``
    (:func:`harness.sweep.tasks.sweep_emulation` of the row's declared ``emulation``)."""
    return sweep_emulation(row.get("emulation") or (), types)


def _effect(effects: dict[str, dict[str, float]] | None, ref: str, ours: str, metric: str) -> float | None:
    e = (effects or {}).get(f"{ref}|{ours}")
    return None if e is None else e.get(metric)


BASE_METRICS = (("mean_kld", 2), ("max_abs_logit", 1))
"""The figures of an engine on the base file judged against the base, with the power of the effect
(:func:`harness.core.gates.effect_limit`: 2 for a KLD, which grows with the square of a logit error), as
``g4h parity``'s ``<pair>.<metric>``."""


def base_verdict(row: dict[str, Any], types: dict[str, int] | Sequence[str], sensitivity: float | None,
                 effects: dict[str, dict[str, float]] | None) -> list[dict[str, Any]]:
    """An engine's row on the group's base file, judged against the base as ``g4h parity`` judges the pair (see the
    module docstring): one verdict per :data:`BASE_METRICS`, each ``{"gate", "measured", "limit", "passed",
    "informational", "why", "effect", "emulated"}``; empty for a row that is not on the base file or did not run.

    Args:
        row: the row (``is_base``, ``engine_kind``, ``numerics``, ``emulation``, ``mean_kld``, ``max_abs_logit``,
            ``vs_emulated``).
        types: the base file's stored types.
        sensitivity: the group's 8-bit yardstick (mean KLD), or None.
        effects: the base's :func:`harness.sweep.tasks.emulation_effects`.
    """
    if not row.get("is_base") or row.get("status") != "ok" or not isinstance(row.get("mean_kld"), (int, float)):
        return []
    kind = row.get("engine_kind") or ""
    numerics = row.get("numerics") or {}
    sixteen = numerics.get("dtype") in ("bfloat16", "float16")
    pair = pair_name(kind, numerics.get("dtype"))
    key = row_emulation(row, types)
    name = key_name(key)
    quantized = rounds_activations(row) and bool(set(types) - EXACT_TYPES)
    out = []
    for metric, power in BASE_METRICS:
        v: dict[str, Any] = {"gate": f"{pair}_q8x.{metric}" if quantized else f"{pair}.{metric}", "limit": None,
                             "measured": None, "passed": True, "informational": False, "why": None, "effect": None,
                             "emulated": list(key)}
        if key:
            got = (row.get("vs_emulated") or {}).get(name)
            v["measured"] = None if got is None else got.get(metric)
        else:
            v["measured"] = row.get(metric)
        gate = DEFAULT_GATES.get(v["gate"])
        if gate is None:  # a kind parity has no pair for (nor one for every kind)
            v.update(informational=True, why=f"g4h parity has no gate {v['gate']}"
                     + (" (a 16-bit engine: the cross-engine 16-bit gate judges it)" if sixteen else "")
                     + ": reported, not gated")
        elif v["measured"] is None:
            v.update(informational=True, why=f"the base was not computed under {name} (what {row.get('engine')} "
                     "declared at its handshake; the sweep computes the emulations an engine's kind predicts): "
                     "reported, not gated")
        elif quantized:
            if metric != "mean_kld":
                v.update(informational=True, limit=gate.limit, why=f"{QUANTIZED_NOT_EMULATED}: reported, not gated")
            elif sensitivity is None or not sensitivity > 0:
                v.update(informational=True, limit=gate.limit,
                         why=f"{QUANTIZED_NOT_EMULATED}, and the group's 8-bit yardstick is missing: reported, not gated")
            else:
                g = with_effect(gate, sensitivity, 1)
                v.update(effect=sensitivity, limit=g.limit, passed=g.check(v["measured"]),
                         why=f"{QUANTIZED_NOT_EMULATED}: limit max({gate.limit:g}, 2 x the group's 8-bit yardstick "
                             f"{sensitivity:.3g}) = {g.limit:.3g}")
        else:
            effect = _effect(effects, name, "exact", metric) if key else None
            g = with_effect(gate, effect, power) if effect is not None else gate
            v.update(effect=effect, limit=g.limit, passed=g.check(v["measured"]))
            if key:
                v["why"] = (f"against the base under {name} (what the engine declares, emulated as g4h parity does); "
                            f"their effect on the base is {effect:.3g}, the limit max({gate.limit:g}, "
                            f"{2 ** power:g} x effect) = {g.limit:.3g}")
        if gate is not None and gate.informational:
            v["informational"] = True
        out.append(v)
    return out


def pair_gate(a: dict[str, Any], b: dict[str, Any], types: dict[str, int]) -> Gate:
    """The gate of engines ``a`` and ``b`` on a file holding ``types``: the 8-bit ratio gate when one of them rounds
    activations and the file has non-F32 matrices; the 16-bit gate when one computes in 16 bits; else the fp32 one."""
    if (rounds_activations(a) or rounds_activations(b)) and set(types) - EXACT_TYPES:
        return DEFAULT_GATES["sweep~engines_q8.mean_kld_ratio"]
    if any(r.get("dtype") in ("bfloat16", "float16") for r in (a, b)):
        return DEFAULT_GATES["sweep~engines_bf16.mean_kld"]
    return DEFAULT_GATES["sweep~engines.mean_kld"]


def agreement(a: dict[str, Any], b: dict[str, Any], logits_a: dict[str, np.ndarray], logits_b: dict[str, np.ndarray],
              prompts: Sequence[dict[str, Any]], types: dict[str, int], sensitivity: float | None,
              effects: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Engines ``a`` and ``b`` on the same file: ``b``'s logits against ``a``'s (llama-perplexity's statistics), the
    gate, the figure it judges and the verdict.

    Args:
        a, b: their rows (``engine``, ``engine_kind``, ``approximations``, ``dtype``).
        logits_a, logits_b: prompt id -> ``[T, V]``.
        prompts: the group's prompts.
        types: the file's stored types (:attr:`harness.sweep.files.SweepFile.types`).
        sensitivity: the group's 8-bit yardstick (mean KLD, :func:`harness.sweep.tasks.sensitivity_run`), or None.
        effects: the base's :func:`harness.sweep.tasks.emulation_effects`: when the two engines declare different
            emulable approximations (:func:`row_emulation`), the fp32 and 16-bit gates' limit is
            :func:`harness.core.gates.effect_limit` of the mean KLD between the base under the one and under the
            other (measured on the group's base file); without that figure the pair is reported, not gated.

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
                       why=f"{QUANTIZED_NOT_EMULATED}, and the group's 8-bit yardstick is missing (its task failed): "
                           "reported, not gated")
            return out
        out["measured"] = stats.mean_kld / sensitivity
        out["why"] = (f"{QUANTIZED_NOT_EMULATED}: mean KLD {stats.mean_kld:.3g} = {out['measured']:.3g} x the 8-bit "
                      f"yardstick {sensitivity:.3g}")
    else:
        out["measured"] = stats.mean_kld
        ka, kb = key_name(row_emulation(a, types)), key_name(row_emulation(b, types))
        out["emulated"] = [ka, kb]
        if ka != kb:
            effect = _effect(effects, ka, kb, "mean_kld")
            if effect is None:
                out.update(passed=True, informational=True,
                           why=f"{a['engine']} declares {ka}, {b['engine']} {kb}, and the base was not computed under "
                               "both (a cmd: engine declares its numerics at its handshake; the sweep computes what "
                               "an engine's kind predicts): reported, not gated")
                return out
            raised = with_effect(gate, effect, 2)
            out.update(effect=effect, limit=raised.limit,
                       why=f"{a['engine']} declares {ka}, {b['engine']} {kb}: their effect on the base (the "
                           f"reference under the one against the other) is a mean KLD of {effect:.3g}, the limit "
                           f"max({gate.limit:g}, 4 x effect) = {raised.limit:.3g}")
            gate = raised
    out["passed"] = gate.check(out["measured"])
    return out


def exit_status(rows: Sequence[dict[str, Any]], agreements: Sequence[dict[str, Any]]) -> int:
    """0 every row ran (or was declared out of reach), every engine on a base file agrees with the base
    (:func:`base_verdict`, in ``against_base``) and every pair agrees; 1 a row failed, an engine disagrees with the base
    or a pair disagrees; 2 a file is unusable (bad input wins)."""
    if any(r["status"] == "bad_input" for r in rows):
        return 2
    if any(failed(r) for r in rows) or any(not a["passed"] for a in agreements):
        return 1
    if any(not v["passed"] and not v["informational"] for r in rows for v in r.get("against_base") or ()):
        return 1
    if any(pair_failures(r) for r in rows):
        return 1
    return 0


def pair_failures(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's parity checks (:func:`harness.sweep.tasks.pair_figures`) that fail: gating and outside their
    limit, as ``g4h parity`` counts them (:attr:`harness.parity.result.CaseResult.passed`). A ``.runs`` of 0 is the
    row's status already (:func:`failed`) and is not counted twice."""
    return [c for c in row.get("checks") or () if not c["pass"] and not c.get("informational")
            and not c["gate"].endswith(".runs")]


def damage_key(row: dict[str, Any]) -> tuple:
    """Sort key of the report's table: failed rows first, then by mean KLD against the base, largest first."""
    k = row.get("mean_kld")
    return (0 if failed(row) or row["status"] == "bad_input" else 1 if row["status"] != "ok" else 2,
            -(k if isinstance(k, (int, float)) and k == k else float("inf")), row.get("file", ""), row["engine"])
