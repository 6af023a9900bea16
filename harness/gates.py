"""The gate table: every tolerance the harness applies, in one place, each with its reason.

A gate compares one measured figure with a limit. Gates are keyed by the pair
they judge; a case may override a limit in its TOML ``[gates]`` table, and must
give a reason there (see :func:`resolve`).

Source of the defaults: ``DESIGN.md`` ("Gates") and the issue that introduced
each pair.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class Gate:
    """One limit on one metric.

    Attributes:
        name: ``<pair>.<metric>``, e.g. ``reference~transformers.max_abs_logit``.
        limit: the bound.
        op: ``le`` (measured <= limit passes) or ``ge`` (measured >= limit).
        reason: why this bound, in one sentence.
    """

    name: str
    limit: float
    op: str
    reason: str

    def check(self, measured: float) -> bool:
        """True when ``measured`` is within the gate. NaN never passes."""
        if measured != measured:  # NaN
            return False
        return measured <= self.limit if self.op == "le" else measured >= self.limit


DEFAULT_GATES: dict[str, Gate] = {g.name: g for g in [
    Gate("reference~transformers.max_abs_logit", 1e-4, "le",
         "float64 reference vs fp32 eager: fp32 rounding over a tiny model's depth stays ~1e-5; a formula "
         "fault moves logits by > 1e-2"),
    Gate("reference~transformers.layer_rel_l2", 1e-4, "le",
         "per trace point ||ref - hf|| / ||hf||; fp32 rounding gives ~1e-6, so 1e-4 leaves room without hiding "
         "a per-layer fault"),
    Gate("reference.cached~uncached.max_abs_logit", 1e-10, "le",
         "same float64 arithmetic in a different order (prefill + one-token decode vs one forward): only "
         "summation-order rounding, ~1e-14"),
    Gate("reference.gguf_f32~safetensors.max_abs_logit", 0.0, "le",
         "the same float32 weights through two loaders must give bit-identical float64 logits"),
    Gate("reference.gguf_quant~gguf_quants.max_abs_weight", 0.0, "le",
         "our loader must dequantize exactly as gguf.quants.dequantize does"),
    Gate("gemma3_real.continuation", 1.0, "ge",
         "the real Gemma 3 270M GGUF must greedily continue each known prompt with the expected text"),
]}


def resolve(overrides: Mapping[str, Any] | None, where: str) -> dict[str, Gate]:
    """The default gates with a case's overrides applied.

    Args:
        overrides: the case's ``[gates]`` table: ``name -> {limit = x, reason = "..."}``.
        where: the case file, for messages.

    Returns:
        name -> :class:`Gate`.

    Raises:
        ValueError: an unknown gate name, or an override without a reason or limit.
    """
    gates = dict(DEFAULT_GATES)
    for name, ov in (overrides or {}).items():
        if name not in gates:
            raise ValueError(f"{where}: [gates] {name}: unknown gate (known: {', '.join(sorted(gates))})")
        if not isinstance(ov, Mapping) or "limit" not in ov or not str(ov.get("reason", "")).strip():
            raise ValueError(f"{where}: [gates] {name}: expected {{limit = <number>, reason = \"...\"}}")
        gates[name] = replace(gates[name], limit=float(ov["limit"]), reason=str(ov["reason"]))
    return gates
