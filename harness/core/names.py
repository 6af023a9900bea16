"""The gate names of earlier results versions and their names now: the one place an old name is mapped.

Version 2 of ``results.json`` (:data:`harness.parity.result.RESULTS_VERSION`) named every engine-vs-oracle figure
of a pair ``<oracle>~<engine>.<metric>`` with the metrics of the pair pipeline (:mod:`harness.parity.checks.pair`):
a built-in case's fast and llama.cpp figures are the pairs of ``--model`` (``reference~fast``,
``reference~fast_bf16``, ``reference~llamacpp``), and the built-in checks that named ``<engine>~reference`` name
``reference~<engine>`` (:data:`OLD_GATES`). Version 3 (:data:`VERSION`) turns the last two pairs the other way round:
the shared bounds of an fp32 and a 16-bit engine against the oracle, which ``g4h compare`` judges by and every
``<oracle>~<kind>`` pair takes its bounds from, are ``oracle~engine.*`` and ``oracle~engine_bf16.*`` (were
``engine~oracle.*`` and ``engine_bf16~oracle.*``: :data:`OLD_PAIRS`), so that every pair reads ``<oracle>~<engine>``.

Read by:

* :func:`upgrade_results`: a version 1 or 2 ``results.json`` or baseline (``g4h parity --baseline``,
  ``--oracle-drift``, :func:`harness.parity.baseline.load_baseline`) with its gates renamed, so that it still
  compares;
* :func:`old_gate_line`: a case TOML ``[gates]`` key written with an old name is *refused*, with one line naming the
  new key (:func:`harness.core.gates.resolve`; exit 2). Refused, not mapped: an override carries a limit for the
  figure it names, and several version 1 figures are another measure under their new name (a cosine is now a
  relative L2, the same top-1 over every position now over the decisive ones, KLD pooled over the prompts now per
  prompt); a limit carried over silently would judge the new figure with a bound set for the old one. The version 2
  names (:data:`OLD_PAIRS`) are the same figures renamed, and are refused all the same: one rule for every old key
  (the line says which key to write), no second spelling of a gate kept alive in case files that results, reports
  and ``docs/gates.md`` no longer use, and the case files are few (no built-in case overrides these).
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

OLD_PAIRS: dict[str, str] = {"engine~oracle": "oracle~engine", "engine_bf16~oracle": "oracle~engine_bf16"}
"""Pair names of results version 2 -> their version 3 names (every metric of the pair: the same figures, renamed so
that the engine stands second, as in every other pair)."""

VERSION = 3
"""The results version whose names :data:`harness.core.gates.DEFAULT_GATES` holds: the one
:data:`harness.parity.result.RESULTS_VERSION` writes (tests/test_names.py holds the two equal)."""


def new_gate(name: str, version: int = 1) -> str:
    """The name now (:data:`VERSION`) of gate ``name`` of results version ``version`` (``name`` itself when it was
    not renamed since). A second engine's gate keeps its number after the pair (``llamacpp~reference#2.runs`` ->
    ``reference~llamacpp#2.runs``)."""
    plain = _NUMBER.sub("", name)
    renamed = OLD_GATES.get(plain, plain) if version < 2 else plain
    pair, _, metric = renamed.rpartition(".")
    if version < 3 and pair in OLD_PAIRS:
        renamed = f"{OLD_PAIRS[pair]}.{metric}"
    if renamed == plain:
        return name
    number = _NUMBER.search(name)
    pair, _, metric = renamed.rpartition(".")
    return f"{pair}{number.group(0) if number else ''}.{metric}"


def _old_names() -> dict[str, tuple[str, int]]:
    """Every old gate name a case may still write -> (its name now, the results version that renamed it)."""
    out = {old: (new_gate(old), 2) for old in OLD_GATES}
    for old, new in OLD_PAIRS.items():
        out.update({f"{old}.{m}": (f"{new}.{m}", 3) for m in _PAIR_METRICS})
    return out


_PAIR_METRICS = ("max_abs_logit", "mean_kld", "same_top1_decisive", "greedy", "max_abs_logprob")
"""The metrics of the version 2 pairs of :data:`OLD_PAIRS` (their gates in results version 2)."""


_NUMBER = re.compile(r"#\d+(?=[.~]|$)")


def old_gate_line(name: str, where: str) -> str | None:
    """One line refusing a case's ``[gates]`` key ``name`` written with a name of an earlier results version, naming
    the new key; None for a name that is not an old one."""
    old = _old_names()
    if name not in old:
        return None
    new, version = old[name]
    why = f" ({REMEASURED[name]}: set its limit again)" if name in REMEASURED else ""
    return f"{where}: [gates] {name}: renamed {new} (results version {version}){why}"


def upgrade_results(data: Mapping[str, Any], version: int) -> dict[str, Any]:
    """A copy of parity results of an earlier ``version`` read as results version :data:`VERSION`: every check's
    gate renamed (:func:`new_gate`: :data:`OLD_GATES` from version 1, :data:`OLD_PAIRS` from version 2), a version
    1 check's detail keys too (:data:`OLD_DETAILS`), and a version 1 check whose figure is another measure now
    (:data:`REMEASURED`) marked informational with the reason, so that a baseline comparison lists it without
    judging it. Results of the current version come back unchanged (a copy)."""
    out = copy.deepcopy(dict(data))
    if version >= VERSION:
        return out
    for case in out.get("cases", []):
        for chk in case.get("checks", []) if isinstance(case, dict) else []:
            if not isinstance(chk, dict) or not isinstance(chk.get("gate"), str):
                continue
            old = chk["gate"]
            chk["gate"] = new_gate(old, version)
            if version >= 2:
                continue
            for k, v in OLD_DETAILS.items():
                if k in chk:
                    chk[v] = chk.pop(k)
            base = _NUMBER.sub("", old)
            if base in REMEASURED:
                chk["informational"] = True
                chk["informational_reason"] = (f"results version 1 figure of {old}, {REMEASURED[base]}: listed, "
                                               "not compared")
    out["version"] = VERSION
    return out
