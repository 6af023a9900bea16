"""What a parity run produces: per case, the measured figures against their gates.

A check (:mod:`harness.parity.checks`) measures and returns :class:`Figure` objects; it never
applies a gate. :meth:`CaseResult.apply` looks each figure's gate up in the case's gate table
(:func:`harness.core.gates.resolve`) and records the verdict: that is the one place gating happens.
:func:`guard` runs one case so that bad input or a crashing engine becomes that case's one-line
error, and the run goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from gemma4_harness.reference.errors import InputError

from ..core.gates import Gate, gate_for, with_effect
from ..core.workers import EngineFailure

RESULTS_VERSION = 3
"""Version of ``results.json`` (``kind`` ``parity``). 2: every engine-vs-oracle figure named ``<oracle>~<engine>``
with the pair pipeline's metrics. 3: the shared bounds of an engine against the oracle too (``oracle~engine.*``,
``oracle~engine_bf16.*``; were ``engine~oracle.*``, ``engine_bf16~oracle.*``). A version 1 or 2 file still
compares (:func:`harness.core.names.upgrade_results`; :data:`harness.core.names.VERSION` is this number)."""


@dataclass
class Figure:
    """One measured figure, to be judged by the gate ``gate`` (``<pair>.<metric>``).

    Attributes:
        gate: the gate's name in :data:`harness.core.gates.DEFAULT_GATES`.
        measured: the figure (NaN never passes).
        prompt: the prompt id it was measured on, or None for a figure over several.
        detail: more JSON-able facts for the report (``first_divergence``, ``per_point`` ...).
    """

    gate: str
    measured: float
    prompt: Any = None
    detail: dict[str, Any] = field(default_factory=dict)


def fig(gate: str, measured: float, prompt: Any = None, **detail: Any) -> Figure:
    """Shorthand for :class:`Figure`."""
    return Figure(gate, float(measured), prompt, detail)


def judged(f: Figure, gates: Mapping[str, Gate]) -> tuple[Gate, float, dict[str, Any]]:
    """How :meth:`CaseResult.apply` judges one figure: ``(gate, measured, detail)``, the gate of its name
    (:func:`harness.core.gates.gate_for`) at :func:`harness.core.gates.with_effect` of its ``effect``, made
    informational with the figure's ``informational_reason`` or, for a figure marked ``not_measured``, with ``not
    measured: <why>`` and a NaN value; ``detail`` without ``informational_reason``. The one rule, for the case's
    checks and for an explanation's trials (:func:`harness.parity.explain_search.judge_figures`).

    Raises:
        KeyError: the figure names a gate the table does not have.
    """
    detail = dict(f.detail)
    reason = detail.pop("informational_reason", None)
    gate = gate_for(gates, f.gate)
    if detail.get("effect") is not None and not gate.informational:  # the engine's declared approximations
        gate = with_effect(gate, float(detail["effect"]), int(detail.get("effect_power", 1)))
    measured = f.measured
    if detail.get("not_measured"):
        reason, measured = f"not measured: {detail['not_measured']}", float("nan")
    if reason is not None:
        gate = replace(gate, informational=True, reason=reason)
    return gate, measured, detail


@dataclass
class CaseResult:
    """Checks of one case; ``error`` is a one-line message when the case could not run."""

    case: str
    kind: str
    model: str
    description: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    error_kind: str | None = None  # "input" (exit 2) or "engine"
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, gate: Gate, measured: float, prompt: Any = None, **detail: Any) -> bool:
        """Record one measured figure against ``gate``; returns whether it is within the gate."""
        ok = gate.check(measured)
        self.checks.append({"gate": gate.name, "prompt": prompt, "measured": float(measured),
                            "limit": gate.limit, "op": gate.op, "pass": ok,
                            **({"informational": True, "reason": gate.reason} if gate.informational else {}),
                            **detail})
        return ok

    def apply(self, figures: Iterable[Figure], gates: Mapping[str, Gate]) -> None:
        """Judge each figure by its gate (in order) and record it.

        A figure whose ``detail`` holds ``informational_reason`` is reported against its gate but does not
        count (a finding, or a check the user opted out of), with that reason. A figure whose ``detail`` holds
        ``not_measured`` (why nothing could be measured: "the greedy streams part at step 0") is recorded as NaN,
        not gating, with the reason ``not measured: <why>``: a gate that measured nothing never passes, and the
        report says so.

        A figure whose ``detail`` holds ``effect`` (how far the engine's declared approximations move it on this
        model, ``effect_power`` 2 for a KLD) is judged at :func:`harness.core.gates.with_effect` of its gate.

        A numbered figure (``reference~openai#2.greedy``: the second engine of a kind) is judged by the gate of
        its name without the number (:func:`harness.core.gates.gate_for`).

        Raises:
            KeyError: a figure names a gate the table does not have (a harness bug).
        """
        for f in figures:
            gate, measured, detail = judged(f, gates)
            self.add(gate, measured, f.prompt, **detail)

    @property
    def passed(self) -> bool:
        """No error and every gating check passed (informational ones do not count)."""
        return self.error is None and all(c["pass"] or c.get("informational") for c in self.checks)


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(e)
    return text.splitlines()[0] if text else type(e).__name__


def guard(fn: Callable[[], CaseResult], case: str, kind: str, model: str) -> CaseResult:
    """Run one case. Bad input becomes ``error_kind`` ``input`` (exit 2); an engine failure
    (:class:`~harness.core.workers.EngineFailure`: crashed, broke its protocol) ``error_kind`` ``engine`` with its one
    line (exit 1); any other exception ``error_kind`` ``engine`` with ``engine crashed: <type>: <line>``."""
    t0 = time.perf_counter()
    try:
        res = fn()
    except InputError as e:
        res = CaseResult(case=case, kind=kind, model=model, error=one_line(e), error_kind="input")
    except EngineFailure as e:  # already one line: "engine crashed: <what the worker last said>", ...
        res = CaseResult(case=case, kind=kind, model=model, error=one_line(e), error_kind="engine")
    except Exception as e:  # an engine that crashes is named; the run goes on
        res = CaseResult(case=case, kind=kind, model=model,
                         error=f"engine crashed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                         error_kind="engine")
    res.seconds = time.perf_counter() - t0
    return res
