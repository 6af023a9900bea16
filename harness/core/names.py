"""The gate names of results version 1 and their names now: the one place an old name is mapped.

Version 2 of ``results.json`` (:data:`harness.parity.result.RESULTS_VERSION`) names every engine-vs-oracle figure
``<oracle>~<engine>.<metric>`` with the metrics of the pair pipeline (:mod:`harness.parity.checks.pair`): a built-in
case's fast and llama.cpp figures are the pairs of ``--model`` (``reference~fast``, ``reference~fast_bf16``,
``reference~llamacpp``), and the built-in checks that named ``<engine>~reference`` name ``reference~<engine>``.

Read by:

* :func:`upgrade_results`: a version 1 ``results.json`` or baseline (``g4h parity --baseline``, ``--oracle-drift``,
  :func:`harness.parity.baseline.load_baseline`) with its gates renamed, so that it still compares;
* :func:`old_gate_line`: a case TOML ``[gates]`` key written with an old name is *refused*, with one line naming the
  new key (:func:`harness.core.gates.resolve`). Refused, not mapped: an override carries a limit for the figure it
  names, and several old figures are another measure under their new name (a cosine is now a relative L2, the
  same top-1 over every position now over the decisive ones, KLD pooled over the prompts now per prompt); a limit
  carried over silently would judge the new figure with a bound set for the old one. The case files are few (the
  built-in ones are migrated, each override keeping its reason), and the line says which key to write.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping

OLD_GATES: dict[str, str] = {
    "fast~reference.max_abs_logit": "reference~fast.max_abs_logit",
    "fast~reference.layer_cosine": "reference~fast.layer_rel_l2",
    "fast_bf16~reference.mean_kld": "reference~fast_bf16.mean_kld",
    "fast_bf16~reference.same_top1": "reference~fast_bf16.same_top1_decisive",
    "llamacpp~reference.runs": "reference~llamacpp.runs",
    "llamacpp~reference.max_abs_logit": "reference~llamacpp.max_abs_logit",
    "llamacpp~reference.mean_kld": "reference~llamacpp.mean_kld",
    "llamacpp~reference.same_top1": "reference~llamacpp.same_top1_decisive",
    "llamacpp~reference.mm_vision_runs": "reference~llamacpp.mm_vision_runs",
    "llamacpp~reference.mm_audio_runs": "reference~llamacpp.mm_audio_runs",
    "llamacpp~reference.mm_vision_cosine": "reference~llamacpp.mm_vision_cosine",
    "llamacpp~reference.mm_audio_cosine": "reference~llamacpp.mm_audio_cosine",
    "llamacpp~reference.mm_soft_token_max_abs": "reference~llamacpp.mm_soft_token_max_abs",
    "drafter.fast~reference.max_abs": "drafter.reference~fast.max_abs",
    "drafter.llamacpp~reference.same_drafts": "drafter.reference~llamacpp.same_drafts",
    "drafter.llamacpp~reference.max_abs": "drafter.reference~llamacpp.max_abs",
}
"""Gate name in results version 1 -> its name in version 2."""

REMEASURED: dict[str, str] = {
    "fast~reference.layer_cosine": "the worst cosine over the trace points; now the worst relative L2",
    "fast_bf16~reference.same_top1": "over every position; now over the positions that are not near-ties",
    "llamacpp~reference.same_top1": "over every position; now over the positions that are not near-ties",
    "fast_bf16~reference.mean_kld": "pooled over the prompts; now per prompt",
    "llamacpp~reference.mean_kld": "pooled over the prompts; now per prompt",
    "llamacpp~reference.max_abs_logit": "pooled over the prompts; now per prompt",
}
"""Old gates whose figure is another measure under the new name (what it was; what it is now): a version 1 figure
of one is kept under the new name but not compared (:func:`upgrade_results` marks it informational)."""

OLD_DETAILS: dict[str, str] = {"vs_exact_gelu": "vs_exact_reference",
                               "top1_flips_vs_exact_gelu": "top1_flips_vs_exact_reference"}
"""Detail keys of version 1 checks -> their version 2 names."""


def new_gate(name: str) -> str:
    """The version 2 name of gate ``name`` (``name`` itself when it was not renamed). A second engine's gate keeps
    its number after the pair (``llamacpp~reference#2.runs`` -> ``reference~llamacpp#2.runs``)."""
    number = _NUMBER.search(name)
    plain = _NUMBER.sub("", name)
    if plain not in OLD_GATES:
        return name
    pair, _, metric = OLD_GATES[plain].rpartition(".")
    return f"{pair}{number.group(0) if number else ''}.{metric}"


_NUMBER = re.compile(r"#\d+(?=[.~]|$)")


def old_gate_line(name: str, where: str) -> str | None:
    """One line refusing a case's ``[gates]`` key ``name`` written with a version 1 name, naming the new key;
    None for a name that is not an old one."""
    if name not in OLD_GATES:
        return None
    why = f" ({REMEASURED[name]}: set its limit again)" if name in REMEASURED else ""
    return f"{where}: [gates] {name}: renamed {OLD_GATES[name]} (results version 2){why}"


def upgrade_results(data: Mapping[str, Any], version: int) -> dict[str, Any]:
    """A copy of parity results of an earlier ``version`` read as results version ``version + 1..2``: every
    check's gate renamed (:data:`OLD_GATES`), its detail keys too (:data:`OLD_DETAILS`), and a check whose figure is
    another measure now (:data:`REMEASURED`) marked informational with the reason, so that a baseline comparison
    lists it without judging it. Results of the current version come back unchanged (a copy)."""
    out = copy.deepcopy(dict(data))
    if version >= 2:
        return out
    for case in out.get("cases", []):
        for chk in case.get("checks", []) if isinstance(case, dict) else []:
            if not isinstance(chk, dict) or not isinstance(chk.get("gate"), str):
                continue
            old = chk["gate"]
            chk["gate"] = new_gate(old)
            for k, v in OLD_DETAILS.items():
                if k in chk:
                    chk[v] = chk.pop(k)
            base = _NUMBER.sub("", old)
            if base in REMEASURED:
                chk["informational"] = True
                chk["informational_reason"] = (f"results version 1 figure of {old}, {REMEASURED[base]}: listed, "
                                               "not compared")
    out["version"] = 2
    return out
