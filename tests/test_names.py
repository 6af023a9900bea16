"""The gate names of results version 1 mapped in one place (harness/core/names.py)."""

from __future__ import annotations

import pytest

from gemma4_harness.harness.core.gates import DEFAULT_GATES, resolve
from gemma4_harness.harness.core.names import OLD_GATES, REMEASURED, new_gate, upgrade_results
from gemma4_harness.reference.errors import InputError


def test_every_old_name_maps_to_a_gate_and_none_is_left():
    assert all(new in DEFAULT_GATES for new in OLD_GATES.values())
    assert not set(OLD_GATES) & set(DEFAULT_GATES)
    assert set(REMEASURED) <= set(OLD_GATES)
    # one direction, <oracle>~<engine>: the reference is an engine only against a second reference
    engine_side = [g for g in DEFAULT_GATES if "~reference." in g]
    assert engine_side == [g for g in DEFAULT_GATES if g.startswith("reference~reference.")]


def test_numbered_and_unknown_names():
    assert new_gate("llamacpp~reference#2.runs") == "reference~llamacpp#2.runs"
    assert new_gate("drafter.llamacpp~reference.max_abs") == "drafter.reference~llamacpp.max_abs"
    assert new_gate("reference~fast.max_abs_logit") == "reference~fast.max_abs_logit"


def test_case_toml_with_an_old_key_is_refused_naming_the_new_one():
    ov = {"fast_bf16~reference.same_top1": {"informational": True, "reason": "narrow"}}
    with pytest.raises(InputError) as ei:
        resolve(ov, "my-case.toml")
    msg = str(ei.value)
    assert msg.startswith("my-case.toml: [gates] fast_bf16~reference.same_top1: renamed "
                          "reference~fast_bf16.same_top1_decisive") and "\n" not in msg
    assert resolve({"reference~fast_bf16.same_top1_decisive": ov["fast_bf16~reference.same_top1"]},
                   "x")["reference~fast_bf16.same_top1_decisive"].informational


def test_upgrade_leaves_the_current_version_alone():
    data = {"version": 2, "kind": "parity", "cases": [{"case": "a", "checks": [{"gate": "fast~reference.x"}]}]}
    assert upgrade_results(data, 2) == data
    v1 = upgrade_results({**data, "version": 1}, 1)
    assert v1["version"] == 2 and v1["cases"][0]["checks"][0]["gate"] == "fast~reference.x"  # not an old gate
