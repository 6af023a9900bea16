"""The gate names of results versions 1 and 2 mapped in one place (harness/core/names.py)."""

from __future__ import annotations

import pytest

from gemma4_harness.harness.core.gates import DEFAULT_GATES, resolve
from gemma4_harness.harness.core.names import (OLD_GATES, OLD_PAIRS, REMEASURED, VERSION, new_gate, old_gate_line,
                                               upgrade_results)
from gemma4_harness.harness.parity.result import RESULTS_VERSION
from gemma4_harness.reference.errors import InputError


def test_every_old_name_maps_to_a_gate_and_none_is_left():
    assert all(new in DEFAULT_GATES for new in OLD_GATES.values())
    assert not set(OLD_GATES) & set(DEFAULT_GATES)
    assert set(REMEASURED) <= set(OLD_GATES)
    # one direction, <oracle>~<engine>: the reference is an engine only against a second reference
    engine_side = [g for g in DEFAULT_GATES if "~reference." in g]
    assert engine_side == [g for g in DEFAULT_GATES if g.startswith("reference~reference.")]
    # and the shared bounds too (results version 3): no gate has the engine first and the oracle second
    assert not [g for g in DEFAULT_GATES if g.rpartition(".")[0] in OLD_PAIRS or "~oracle" in g]
    assert VERSION == RESULTS_VERSION == 3


def test_version_2_pair_names_map_to_a_gate_each():
    """Every gate of the version 2 pairs ``engine~oracle``, ``engine_bf16~oracle`` has its version 3 name, a gate."""
    for old, new in OLD_PAIRS.items():
        for metric in ("max_abs_logit", "mean_kld", "same_top1_decisive", "greedy", "max_abs_logprob"):
            assert new_gate(f"{old}.{metric}", 2) == f"{new}.{metric}" in DEFAULT_GATES
            assert f"{old}.{metric}" not in DEFAULT_GATES
    assert new_gate("engine~oracle.mean_kld", 3) == "engine~oracle.mean_kld"  # a version 3 name is not mapped
    assert new_gate("engine~oracle.mean_kld") == "oracle~engine.mean_kld"  # from version 1 through version 2
    assert new_gate("reference~fast.max_abs_logit", 2) == "reference~fast.max_abs_logit"
    assert new_gate("fast~reference.max_abs_logit", 2) == "fast~reference.max_abs_logit"  # a version 1 name only


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


@pytest.mark.parametrize("old,new", [
    ("engine~oracle.mean_kld", "oracle~engine.mean_kld"),
    ("engine_bf16~oracle.same_top1_decisive", "oracle~engine_bf16.same_top1_decisive")])
def test_case_toml_with_a_version_2_key_is_refused_naming_the_new_one(old, new):
    """A ``[gates]`` key of results version 2 (the same figure, renamed) is refused as a version 1 key is: one line
    naming the key and the one to write (harness/core/names.py says why refused, not mapped)."""
    with pytest.raises(InputError) as ei:
        resolve({old: {"limit": 1e-4, "reason": "mine"}}, "my-case.toml")
    assert str(ei.value) == f"my-case.toml: [gates] {old}: renamed {new} (results version 3)"
    assert old_gate_line(old, "x") is not None and old_gate_line(new, "x") is None
    assert resolve({new: {"limit": 1e-4, "reason": "mine"}}, "x")[new].limit == 1e-4


def test_upgrade_leaves_the_current_version_alone():
    data = {"version": 3, "kind": "parity", "cases": [{"case": "a", "checks": [{"gate": "fast~reference.x"}]}]}
    assert upgrade_results(data, 3) == data
    v1 = upgrade_results({**data, "version": 1}, 1)
    assert v1["version"] == 3 and v1["cases"][0]["checks"][0]["gate"] == "fast~reference.x"  # not an old gate


def test_upgrade_of_version_2_renames_its_pairs_only():
    """A version 2 file: ``engine~oracle.*`` renamed (numbered too), details and other gates kept, nothing marked
    informational (the figures are the same measures)."""
    chk = [{"gate": "engine~oracle.mean_kld", "measured": 1e-8, "vs_exact_gelu": 1.0},
           {"gate": "engine_bf16~oracle#2.greedy", "measured": 1.0}, {"gate": "reference~fast.mean_kld"}]
    v2 = upgrade_results({"version": 2, "kind": "parity", "cases": [{"case": "a", "checks": chk}]}, 2)
    assert v2["version"] == 3 and v2["cases"][0]["checks"] == [
        {"gate": "oracle~engine.mean_kld", "measured": 1e-8, "vs_exact_gelu": 1.0},
        {"gate": "oracle~engine_bf16#2.greedy", "measured": 1.0}, {"gate": "reference~fast.mean_kld"}]
